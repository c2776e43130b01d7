"""A patched model's norm (and GLU) outputs recomputed in the backward, in eager (``apply(recompute_norms=True,
recompute_glu=False)``).

The projections after a norm (q/k/v, gate/up, a LoRA layer) save their input, the norm's output ``y``,
for their weights' gradients, while the norm's own backward saves its input ``x``: a decoder layer
holds both through the step, two ``N H`` tensors per layer for ``y`` (1 GiB for Llama-3.2-1B at 8192
tokens in bf16). Under ``torch.compile(backend="fastops_inductor")`` the partitioner recomputes ``y``
instead (:mod:`inductor_ext.inductor.recompute`); this module does the same for the patched model
run eagerly.

While :func:`outputs_recomputed` is active (the patched causal LM's forward, in training, in plain
eager), each patched norm marks its output with its own forward over ``x``
(:func:`recomputable`), and ``torch.autograd.graph.saved_tensors_hooks`` store, for any saved tensor
that is that output or a view of it, the mark and the view's geometry instead of the tensor. The
output itself is then freed once the forward no longer uses it; the first backward node that needs it
runs the norm's forward again (the same kernel on the same input: the same bits) and the others read
that result, which lives until the last of them is done. The norm's ``x`` stays alive exactly as long
as before (its own backward, which runs after theirs, saves it).

The GLU's output ``act(gate) * up``, which the down projection saves, is recomputed the same way from
``gate`` and ``up`` (its own backward saves them, and writes their gradients over them only after the
down projection's backward has read the recomputed output): ``N I`` elements less per layer (2 GiB for
Llama-3.2-1B at 8192 tokens) for one GLU kernel per layer in the backward. Off by default, as the
backend's ``fastops.recompute_glu``.

Not active (the tensors are saved as usual) under tracing, where the backend's pass does this, and
where other saved-tensor hooks are active or disabled when the forward starts (``save_on_cpu``,
activation offloading, a framework's ``disable_saved_tensors_hooks``): only the innermost hooks run,
and ours would silently replace the caller's. Inside ``torch.utils.checkpoint`` regions the
checkpoint's own hooks are innermost, so those layers are recomputed by the checkpoint as before.
An output written in place after the forward would be recomputed without that write: HF models
never do so.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

_MARK = "_fastops_recompute"
NORMS, GLU = "norms", "glu"
"""The kinds of outputs :func:`recomputable` marks."""
_active: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("fastops_recompute", default=frozenset())


class _Recompute:
    """An output's forward, and its result once the backward asked for it."""

    __slots__ = ("forward", "root")

    def __init__(self, forward: Callable[[], Tensor]) -> None:
        self.forward: Callable[[], Tensor] | None = forward
        self.root: Tensor | None = None

    def view(self, size: torch.Size, stride: tuple[int, ...], offset: int) -> Tensor:
        if self.root is None:
            assert self.forward is not None
            # in the backward's grad mode: off, or on under create_graph=True, where the recomputed output
            # needs its history for the gradients of the gradients
            self.root, self.forward = _root(self.forward()), None
        return self.root.as_strided(size, stride, offset)


def _root(t: Tensor) -> Tensor:
    """The tensor that owns ``t``'s storage (``t`` itself unless it is a view)."""
    return t if t._base is None else t._base


def recomputable(y: Tensor, forward: Callable[[], Tensor], kind: str) -> Tensor:
    """``y``, marked for recomputation by ``forward()`` (which returns it anew, in the same layout) while
    :func:`outputs_recomputed` is active for ``kind`` (:data:`NORMS`, :data:`GLU`); otherwise untouched."""
    if not torch.compiler.is_compiling() and kind in _active.get():
        setattr(_root(y), _MARK, _Recompute(forward))
    return y


def _pack(t: Tensor) -> Any:
    root = _root(t)
    mark = getattr(root, _MARK, None)
    if mark is None or t.dtype != root.dtype:  # (a view as another dtype is not rebuilt by as_strided)
        return t
    return mark, t.size(), t.stride(), t.storage_offset()


def _unpack(packed: Any) -> Tensor:
    if isinstance(packed, Tensor):
        return packed
    mark, size, stride, offset = packed
    return mark.view(size, stride, offset)


def _hooks_are_ours_to_install() -> bool:
    """No saved-tensor hooks active (ours would replace them) and none disabled; False where this torch
    does not say."""
    autograd = torch._C._autograd
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(autograd, "_saved_tensors_hooks_is_enabled", None)
    return top is not None and enabled is not None and enabled() and top(False) is None


def outputs_recomputed(kinds: frozenset[str]) -> contextlib.AbstractContextManager[None]:
    """Within, the patched model's outputs of ``kinds`` are recomputed in the backward instead of saved
    (module docstring), if there are any, nothing is tracing, gradients are being recorded and no other
    saved-tensor hooks are active; otherwise a context that does nothing (what Dynamo traces)."""
    if (
        not kinds
        or torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or _active.get()
        or not _hooks_are_ours_to_install()
    ):
        return contextlib.nullcontext()
    return _recomputing(kinds)


@contextlib.contextmanager
def _recomputing(kinds: frozenset[str]) -> Iterator[None]:
    token = _active.set(kinds)
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _active.reset(token)
