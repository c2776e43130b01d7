"""Norm outputs recomputed in the backward on CUDA under ``fastops_inductor`` on our kernel route (a Triton
kernel's node recomputed by torch's partitioner, and the outputs of ``add_rms_norm`` kernels recomputed from
their saved sum and ``rstd``; the Inductor route's aten math is checked on CPU). A patched Llama-shaped model
saves exactly the outputs the backend marked for recomputation less (the first layer's input norm, and each
norm after a residual add that feeds a projection), the step's peak falls by most of that, the loss is that of
the step that saves them to the bit, and the gradients are its gradients up to the bits that vary between two
runs of one step on CUDA. That spread is measured in each test (two runs of the saving step): on the H200 it
reaches 0.4% norm-wise in the first layer's gradients of this random-weight model, so a fixed tolerance is a
coin flip; the recomputing step must stay within a few times the measured spread, and an output recomputed
wrongly would be off by far more."""

import pytest
import torch

import inductor_ext  # noqa: F401
from inductor_ext import models
from tests.gpu.compile_checks import ISOLATED_CUDA_COMPILES, gqa_llama
from tests.inductor.test_recompute_norms import marked_output_bytes
from tests.tolerances import rel_err

pytestmark = ISOLATED_CUDA_COMPILES

H, LAYERS, BATCH, SEQ = 1024, 4, 2, 2048
TOKENS = BATCH * SEQ
NORM_OUTPUTS = TOKENS * H * 2 + TOKENS * 4
"""y (bf16) and rstd (fp32) of the one recomputed plain norm."""
FUSED_NORM_OUTPUTS = (2 * LAYERS - 1) * TOKENS * H * 2
"""y (bf16) of each recomputed ``add_rms_norm``: every layer's MLP norm and the later layers' input norms (the
final norm feeds the fused loss)."""
PEAK_SHARE = 0.7
"""The peak falls by at least this share of the recomputed bytes: the norm outputs are held from the forward
until the backward reaches their layer, and the backward recomputes one at a time."""
SPREAD_FACTOR, SPREAD_FLOOR = 4, 2**-9
"""The recomputing step's gradients are within ``SPREAD_FACTOR`` times the saving step's own run-to-run spread
(the largest norm-wise difference over the parameters), that spread taken as at least ``SPREAD_FLOOR``
(half bf16's relative resolution) so that two runs that happen to agree do not demand bit-equality."""


@pytest.fixture(scope="module")
def llama():
    return gqa_llama(H, LAYERS, BATCH, SEQ)


def _largest_difference(grads: dict, reference: dict) -> tuple[float, str]:
    """The largest norm-wise relative difference between two steps' gradients, and its parameter's name."""
    return max((rel_err(grad, reference[name]), name) for name, grad in grads.items())


def _assert_within_spread(grads: dict, kept: dict, kept_again: dict) -> None:
    spread = max(_largest_difference(kept_again, kept)[0], SPREAD_FLOOR)
    error, worst = _largest_difference(grads, kept)
    print(f"largest gradient difference {error:.2e} ({worst}); the saving step's own spread {spread:.2e}")
    assert error <= SPREAD_FACTOR * spread, (worst, spread)


def _step(forward, model, ids):
    """Saved bytes, peak bytes above the step's start, loss and gradients of one training step."""
    model.zero_grad(set_to_none=True)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return sum(saved), torch.cuda.max_memory_allocated() - start, loss.detach(), grads


def _compiled_step(llama, norms: bool):
    model, ids = llama
    torch._dynamo.reset()
    options = {"fastops.route": "kernel", "fastops.recompute_norms": norms}
    with models.patched(model):
        compiled = torch.compile(model, backend="fastops_inductor", options=options)
        with marked_output_bytes() as marked:
            _step(compiled, model, ids)  # compiles
        saved_bytes, peak, loss, grads = _step(compiled, model, ids)
        return saved_bytes, marked, peak, loss, grads, _step(compiled, model, ids)[3]


def test_compiled_outputs_are_recomputed_not_saved(llama):
    kept_bytes, kept_marked, kept_peak, kept_loss, kept_grads, kept_again = _compiled_step(llama, norms=False)
    saved_bytes, marked, peak, loss, grads, _ = _compiled_step(llama, norms=True)
    assert kept_marked == {} and marked == {"rms_norm_fwd": NORM_OUTPUTS, "add_rms_norm_fwd": FUSED_NORM_OUTPUTS}
    recomputed = NORM_OUTPUTS + FUSED_NORM_OUTPUTS
    assert kept_bytes - saved_bytes == recomputed
    assert kept_peak - peak >= PEAK_SHARE * recomputed, (kept_peak, peak, recomputed)
    assert torch.equal(loss, kept_loss)
    _assert_within_spread(grads, kept_grads, kept_again)
