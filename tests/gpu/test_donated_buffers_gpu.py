"""The donated-buffer pass on real compiled backwards (CUDA, the kernel route): a SwiGLU MLP under the
fused linear cross-entropy loss, as a patched model runs them. The GLU backward writes ``dgate``/``dup``
over the saved ``gate``/``up`` and the loss's backward scales its saved ``dweight``/``dhidden`` in
place (inductor_ext.inductor.donated_buffers): the gradients stay those of eager, and the backward
allocates those buffers no more."""

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor import config

import inductor_ext  # noqa: F401
from inductor_ext import fused_linear_cross_entropy, swiglu
from inductor_ext.library import registration
from tests.gpu.compile_checks import ISOLATED_CUDA_COMPILES
from tests.tolerances import rel_err

pytestmark = ISOLATED_CUDA_COMPILES

N, H, I, V = 4096, 1024, 4096, 32000


class _MlpAndLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = torch.nn.Linear(H, I, bias=False), torch.nn.Linear(H, I, bias=False)
        self.down = torch.nn.Linear(I, H, bias=False)
        self.head = torch.nn.Parameter(torch.randn(V, H) * H**-0.5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:  # the reference: the same math in aten ops
            h = x + self.down(F.silu(self.gate(x)) * self.up(x))
            return F.cross_entropy(h @ self.head.t(), labels)
        h = x + self.down(swiglu(self.gate(x), self.up(x)))
        return fused_linear_cross_entropy(h, self.head, labels, weight_grad_accumulation="weight_dtype")


def _step(model, x, labels, compiled: bool):
    """Gradients of the loss and the bytes the backward allocates."""
    forward = (
        torch.compile(model, backend="fastops_inductor", options={"fastops.route": "kernel"}) if compiled else model
    )
    for _ in range(2 if compiled else 1):  # compiled: measure the step after the one that compiles
        xi = x.detach().requires_grad_()
        loss = forward(xi, labels)
        start = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
        grads = torch.autograd.grad(loss, [xi, *model.parameters()])
    return grads, torch.cuda.memory_stats()["allocated_bytes.all.allocated"] - start


def test_backward_writes_over_donated_activations_and_gradients(monkeypatch):
    torch.manual_seed(0)
    model = _MlpAndLoss().cuda().to(torch.bfloat16)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (N,), device="cuda")
    eager, _ = _step(model, x, labels, compiled=False)
    reference, _ = _step(model.double(), x.double(), labels, compiled=False)
    model.to(torch.bfloat16)

    with config.patch(force_disable_caches=True):
        ours, allocated = _step(model, x, labels, compiled=True)
        written = dict(counters["inductor_ext"])
        torch._dynamo.reset()
        monkeypatch.setattr(registration, "OUTPUTS_OVER_DONATED", {})
        _, allocated_without = _step(model, x, labels, compiled=True)

    assert written["in_place_over_donated:glu_bwd_kernel.DGATE"] == 1
    assert written["in_place_over_donated:glu_bwd_kernel.DUP"] == 1
    assert written["in_place_over_donated:scale_rows_kernel.OUT"] == 2  # dweight and dhidden
    for mine, theirs, truth in zip(ours, eager, reference, strict=True):
        assert rel_err(mine, truth) <= 1.5 * rel_err(theirs, truth) + 1e-3
    # the buffers no longer allocated: the scaled dweight and dhidden (V H + N H), dgate and dup (2 N I), bf16
    assert allocated_without - allocated >= 0.9 * 2 * (V * H + N * H + 2 * N * I)
