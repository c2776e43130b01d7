"""``fastops.accumulate_products`` on CUDA: a GQA Llama's backward sums q/k/v's and gate/up's input gradients
with ``fastops::sum_of_products`` under ``fastops_inductor`` (the loss as without it, the gradients up to bf16
rounding, no higher peak), and its output is a 16-byte-aligned buffer, so the Triton kernels that read it keep
their vectorised loads."""

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache

import inductor_ext  # noqa: F401
from inductor_ext.bench.harness import rel_err
from tests.gpu.compile_checks import ISOLATED_CUDA_COMPILES, gqa_llama, run_and_get_joined_code

pytestmark = ISOLATED_CUDA_COMPILES

H, LAYERS, BATCH, SEQ, VOCAB = 1024, 2, 2, 2048, 32000
GRAD_REL_ERR = 2e-2
"""bf16 gradients rounded in another order; a product summed into the wrong gradient would be off by order one."""
PEAK_SLACK = 8 * 2**20
"""Allocator rounding between two compiles."""
OP = "torch.ops.fastops.sum_of_products.default"


def _step(llama, *, accumulate: bool):
    """Peak bytes above the start, loss, gradients, sums rewritten and generated code of a compiled step."""
    model, ids = llama
    torch._dynamo.reset()
    counters.clear()
    options = {"fastops.route": "kernel", "fastops.accumulate_products": accumulate}  # one route both times
    compiled = torch.compile(model, backend="fastops_inductor", options=options)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()

    def step():
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    with fresh_cache():  # compiled anew: a cache hit would skip the post-grad pass that counts the sums
        loss, code = run_and_get_joined_code(step)
    torch.cuda.synchronize()
    grads = {name: p.grad for name, p in model.named_parameters()}
    peak = torch.cuda.max_memory_allocated() - start
    return peak, loss, grads, counters["inductor_ext"]["sum_of_products"], code


def test_backward_sums_input_gradients_in_the_gemms():
    llama = gqa_llama(H, LAYERS, BATCH, SEQ, VOCAB)
    peak, loss, grads, rewritten, code = _step(llama, accumulate=True)
    peak_ref, loss_ref, grads_ref, rewritten_ref, _ = _step(llama, accumulate=False)
    worst = max(grads, key=lambda name: rel_err(grads[name], grads_ref[name]))
    print(f"product sums: {rewritten} rewritten, peak {peak_ref / 2**30:.3f} -> {peak / 2**30:.3f} GiB, "
          f"largest gradient difference {rel_err(grads[worst], grads_ref[worst]):.2e} ({worst})")  # fmt: skip
    assert (rewritten, rewritten_ref) == (2 * LAYERS, 0)  # q/k/v's and gate/up's input gradients a layer
    assert code.count(f"{OP}(") == 2 * LAYERS
    assert f"(op: {OP}) is assumed to be not aligned" not in code
    if "assert_alignment(" in code:  # Inductor's alignment asserts (config.alignment_asserts) are on
        assert code.count(f", 16, '{OP}')") == 2 * LAYERS  # each output asserted 16-byte aligned
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)  # the forward has no sum of products
    assert rel_err(grads[worst], grads_ref[worst]) < GRAD_REL_ERR
    assert peak <= peak_ref + PEAK_SLACK, (peak, peak_ref)
