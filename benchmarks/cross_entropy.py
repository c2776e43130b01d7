"""Cross-entropy benchmark: HF eager, torch.compile of it, fastops eager (default and in-place), fastops compiled,
and HF's exact spelling compiled by the ``fastops_inductor`` backend (``fastops_backend``: the rewrite
must absorb the upcast, or the op reads an fp32 copy of the logits).

The reference is HF's spelling: ``F.cross_entropy(logits.float(), labels)`` (mean over
non-ignored tokens, 1 in 8 labels ignored). Minimal bytes: the forward (no gradient
needed) reads the logits once (``N·V·s``); forward+backward reads them once and writes
the gradient once (``2·N·V·s``), the floor our forward reaches by computing the
gradient while it reads. The backward is timed through ``torch.autograd.grad`` with
``grad_output = 1``: the default path then still spends one scaling pass
(read + write of the gradient, a fresh buffer), the in-place path skips it on the device.
"""

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import Inputs, Provider, Result, run_providers
from inductor_ext.ops.cross_entropy import cross_entropy, cross_entropy_ref

SHAPES = [(8192, 128256), (4096, 256000), (16384, 32000)]


def _make_inputs(n: int, v: int, dtype: torch.dtype) -> Callable[[], Inputs]:
    def make() -> Inputs:
        logits = (3 * torch.randn(n, v, device="cuda", dtype=torch.float32)).to(dtype).requires_grad_()
        labels = torch.randint(0, v, (n,), device="cuda")
        labels[::8] = -100
        return {"logits": logits, "labels": labels}

    return make


def _fwd(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        logits, labels = inp["logits"].detach(), inp["labels"]
        return lambda: f(logits, labels)

    return build


def _fwd_bwd(f: Callable[..., torch.Tensor]) -> Callable[[Inputs], Callable[[], Any]]:
    def build(inp: Inputs) -> Callable[[], Any]:
        logits, labels = inp["logits"], inp["labels"]
        return lambda: torch.autograd.grad(f(logits, labels), logits)

    return build


def _inplace(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The gradient overwrites the logits: values stay finite from one timed call to the next."""
    return cross_entropy(logits, labels, inplace_backward=True)


def _hf_loss_tail(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` after its label shift: upcast, flatten, ``F.cross_entropy``."""
    logits = logits.float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def providers(mode: str) -> list[Provider]:
    wrap = _fwd if mode == "fwd" else _fwd_bwd
    found = [
        Provider("hf_eager", wrap(cross_entropy_ref)),
        Provider("torch_compile", wrap(torch.compile(cross_entropy_ref, fullgraph=True))),
        Provider("fastops_eager", wrap(cross_entropy)),
        Provider("fastops_compile", wrap(torch.compile(cross_entropy, fullgraph=True))),
        Provider("fastops_backend", wrap(torch.compile(_hf_loss_tail, backend="fastops_inductor", fullgraph=True))),
    ]
    if mode == "fwd_bwd":
        found.append(Provider("fastops_eager_inplace", wrap(_inplace)))
    return found


def run(shapes: list[tuple[int, int]], dtype: torch.dtype, copy_gbps: float) -> list[Result]:
    results = []
    es = torch.finfo(dtype).bits // 8
    for mode, factor in (("fwd", 1), ("fwd_bwd", 2)):
        for n, v in shapes:
            torch._dynamo.reset()
            results += run_providers(
                "cross_entropy", mode, f"{n}x{v}", dtype, _make_inputs(n, v, dtype), factor * n * v * es,
                providers(mode), copy_gbps, baseline="torch_compile",
            )  # fmt: skip
    return results
