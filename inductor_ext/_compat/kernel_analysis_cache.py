"""Memoize torch's analysis of which tensors a user-defined Triton kernel reads and writes.

Tracing a ``wrap_triton`` launch (our kernel route) asks
``torch._higher_order_ops.triton_kernel_wrap`` which of the kernel's tensor arguments it writes
(``identify_accessed_tensors`` in torch 2.13, ``identify_mutated_tensors`` in 2.11). Each answer
lowers the kernel to TTIR with Triton's front end and walks it, and nothing is cached: the
functionalization of every launch asks (once while AOTAutograd collects metadata, again while it
traces the joint graph) and Inductor asks again for every kernel it lowers. A decoder repeats
the same launches layer after layer, so these analyses take a large share of a compile
(``python -m benchmarks profile_compile`` shows it).

The answer depends only on the kernel's source and on what the TTIR is specialised on:
``generate_ttir`` stands a 2-element tensor of the same dtype in for each fake tensor or Inductor
``TensorBox``, the integer 2 for each symbolic value, and the first config's meta-parameters for
an autotuner; every other argument (ints, floats, bools, strings, None) is passed as it is. So
the memo key is the ``JITFunction``, those dtypes, the symbolic markers and the plain values.
A launch with anything else (a real tensor, a TMA descriptor, an unfamiliar type) is analysed
as before, uncached. Each caller gets its own deep copy of the answer.

Installed while our compiles run (:func:`patches`, through :func:`inductor_ext._compat.applied`), the
memo kept from one compile to the next; ``INDUCTOR_EXT_CACHE_KERNEL_ANALYSIS=0`` leaves torch's function
alone (for A/B timing).
"""

import collections
import copy
import functools
import os
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

from inductor_ext._compat import Patch
from inductor_ext.env import env_flag

ANALYSIS_FUNCTIONS = ("identify_accessed_tensors", "identify_mutated_tensors")
"""torch's per-launch analysis, by the name it has in torch 2.13 and in torch 2.11 (same arguments:
kernel, kwargs, tma_descriptor_metadata)."""

_PLAIN_TYPES = (bool, int, float, str, type(None), torch.dtype)

MAX_ANSWERS = 4096
"""Answers kept, least recently used dropped first: a program that builds kernels on the fly
(each a new ``JITFunction``) must not grow the memo, and the keys it holds, without bound."""


def analysis_key(kernel: Any, kwargs: Mapping[str, Any], tma_descriptor_metadata: Any) -> Hashable | None:
    """What the analysis of this launch depends on, or None when the launch is not cacheable."""
    import sympy
    from torch._inductor.ir import TensorBox
    from torch._subclasses.fake_tensor import FakeTensor
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    if tma_descriptor_metadata:
        return None
    meta: Mapping[str, Any] = {}
    if isinstance(kernel, Autotuner):
        meta = kernel.configs[0].kwargs if kernel.configs else {}
        kernel = kernel.fn
    if not isinstance(kernel, JITFunction):
        return None
    items = []
    for name, value in sorted({**kwargs, **meta}.items()):
        if isinstance(value, FakeTensor):
            token: tuple[Any, ...] = ("tensor", value.dtype)
        elif isinstance(value, TensorBox):
            token = ("tensor", value.get_dtype())
        elif isinstance(value, torch.Tensor):  # a real tensor: Triton specialises on its address
            return None
        elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
            token = ("symbolic",)
        elif isinstance(value, _PLAIN_TYPES):
            token = (type(value).__name__, value)
        else:
            return None
        items.append((name, token))
    return kernel, tuple(items)


def memoized(analysis: Callable[..., Any]) -> Callable[..., Any]:
    """``analysis(kernel, kwargs, tma_descriptor_metadata)`` answered once per :func:`analysis_key`."""
    answers: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()

    @functools.wraps(analysis)
    def wrapped(kernel: Any, kwargs: dict[str, Any], tma_descriptor_metadata: Any, *args: Any, **kw: Any) -> Any:
        key = analysis_key(kernel, kwargs, tma_descriptor_metadata) if not (args or kw) else None
        if key is None:
            return analysis(kernel, kwargs, tma_descriptor_metadata, *args, **kw)
        if key in answers:
            wrapped.hits += 1  # type: ignore[attr-defined]
            answers.move_to_end(key)
        else:
            answers[key] = analysis(kernel, kwargs, tma_descriptor_metadata)
            if len(answers) > MAX_ANSWERS:
                answers.popitem(last=False)
        return copy.deepcopy(answers[key])

    wrapped.answers = answers  # type: ignore[attr-defined]
    wrapped.hits = 0  # type: ignore[attr-defined]
    return wrapped


_MEMOS: dict[Callable[..., Any], Callable[..., Any]] = {}
"""torch's analysis function -> its memo (one per function, kept across compiles)."""


def memo_of(analysis: Callable[..., Any]) -> Callable[..., Any]:
    """The one :func:`memoized` wrapper of ``analysis``."""
    if analysis not in _MEMOS:
        _MEMOS[analysis] = memoized(analysis)
    return _MEMOS[analysis]


def patches(env: Mapping[str, str] = os.environ) -> list[Patch]:
    """The memo on whichever of :data:`ANALYSIS_FUNCTIONS` this torch has (callers import it at call time,
    so replacing the module attribute reaches them); none when the environment turns it off."""
    if not env_flag(env, "INDUCTOR_EXT_CACHE_KERNEL_ANALYSIS", True):
        return []
    return [
        Patch(
            f"memoize_{name}",
            f"torch._higher_order_ops.triton_kernel_wrap:{name}",
            memo_of,
            tested=((2, 11), (2, 13)),
            upstream="torch/_higher_order_ops/triton_kernel_wrap.py: the analysis is not cached",
        )
        for name in ANALYSIS_FUNCTIONS
    ]
