"""Norm (and GLU) outputs recomputed in the backward on CUDA: under ``fastops_inductor`` on our kernel route
(a Triton kernel's node recomputed by torch's partitioner; the Inductor route's aten math is checked on
CPU) and in eager (``models.apply(recompute_norms=..., recompute_glu=...)``'s saved-tensor hooks). A patched Llama-shaped
model saves exactly the recomputed outputs less, the step's peak falls by about that much (the backward
recomputes one output at a time, just before its projection reads it), the loss is that of the step that
saves them to the bit, and the gradients are its gradients up to the bits that vary between two runs of one
step on CUDA. That spread is measured in each test (two runs of the saving step): on the H200 it reaches 0.4%
norm-wise in the first layer's gradients of this random-weight model, so a fixed tolerance is a coin flip;
the recomputing step must stay within a few times the measured spread, and an output recomputed wrongly would
be off by far more."""

import copy

import pytest
import torch

import inductor_ext  # noqa: F401
from inductor_ext import models
from inductor_ext.bench.harness import rel_err
from tests.gpu.compile_checks import ISOLATED_CUDA_COMPILES, gqa_llama

pytestmark = ISOLATED_CUDA_COMPILES

H, LAYERS, BATCH, SEQ = 1024, 4, 2, 2048
TOKENS = BATCH * SEQ
NORM_OUTPUTS = 2 * LAYERS * (TOKENS * H * 2 + TOKENS * 4)
"""y (bf16) and rstd (fp32) of two norms a layer."""
PEAK_SHARE = 0.7
"""The peak falls by at least this share of the recomputed bytes: all of them if the step peaks at the end of
the forward, those of every layer but the last (3 in 4) if it peaks in the last layer's backward."""
GLU_OUTPUTS = LAYERS * TOKENS * 4 * H * 2
"""The GLU's output (bf16), one a layer."""
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


def _compiled_step(llama, norms: bool, glu: bool = False):
    model, ids = llama
    torch._dynamo.reset()
    options = {"fastops.route": "kernel", "fastops.recompute_norms": norms, "fastops.recompute_glu": glu}
    with models.patched(model):
        compiled = torch.compile(model, backend="fastops_inductor", options=options)
        _step(compiled, model, ids)  # compiles
        saved_bytes, peak, loss, grads = _step(compiled, model, ids)
        return saved_bytes, peak, loss, grads, _step(compiled, model, ids)[3]


@pytest.mark.parametrize("glu", [False, True])
def test_compiled_outputs_are_recomputed_not_saved(llama, glu):
    kept_bytes, kept_peak, kept_loss, kept_grads, kept_again = _compiled_step(llama, norms=False)
    saved_bytes, peak, loss, grads, _ = _compiled_step(llama, norms=True, glu=glu)
    recomputed = NORM_OUTPUTS + (GLU_OUTPUTS if glu else 0)
    assert kept_bytes - saved_bytes == recomputed
    assert kept_peak - peak >= PEAK_SHARE * recomputed, (kept_peak, peak, recomputed)
    assert torch.equal(loss, kept_loss)
    _assert_within_spread(grads, kept_grads, kept_again)


def _eager_peak(llama, recompute: bool, glu: bool = False):
    """Peak, loss and gradients of an eager step, and the gradients of the same step run again (our
    saved-tensor hooks are off under the bytes-counting ones, so the peak is measured without them)."""
    reference, ids = llama
    model = copy.deepcopy(reference)
    with models.patched(model, recompute_norms=recompute, recompute_glu=glu):
        steps = []
        for _ in range(3):  # the first launches tune our kernels
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.cuda.synchronize()
            grads = {name: p.grad for name, p in model.named_parameters()}
            steps.append((torch.cuda.max_memory_allocated() - start, loss.detach(), grads))
        (peak, loss, grads), again = steps[1], steps[2]
        return peak, loss, grads, again[2]


@pytest.mark.parametrize("glu", [False, True])
def test_eager_outputs_are_recomputed_not_saved(llama, glu):
    kept_peak, kept_loss, kept_grads, kept_again = _eager_peak(llama, recompute=False)
    peak, loss, grads, _ = _eager_peak(llama, recompute=True, glu=glu)
    recomputed = NORM_OUTPUTS + (GLU_OUTPUTS if glu else 0)
    assert kept_peak - peak >= PEAK_SHARE * recomputed, (kept_peak, peak, recomputed)
    assert torch.equal(loss, kept_loss)
    _assert_within_spread(grads, kept_grads, kept_again)
