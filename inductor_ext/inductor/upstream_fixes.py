"""Workarounds for PyTorch bugs that the backend's defaults run into; each names the bug and the
versions it was seen in, and is applied once, when the backend is imported.

**Multi-kernels loaded from the FX-graph cache crash** (torch 2.11 on the H200; the same code in
2.13). With the static Triton launcher (Inductor's default on CUDA), the kernels of a cached
graph come back through ``codecache.StaticAutotunerFuture``, pickled with their
``JITFunction._hash_lock`` set to None (``CachingAutotuner.prepare_for_pickle``), and its
``result()`` never restores it (``restore_after_unpickle``, which the compile-worker path
calls). A multi-kernel then reads its sub-kernels' ``fn.cache_key`` to find its cached pick,
``with self._hash_lock:`` raises ``TypeError: 'NoneType' object does not support the context
manager protocol``, and the second process that compiles the same graph under
``fastops_inductor`` (multi-kernel on by default) fails. The fix gives such kernels a fresh lock.
"""

import functools
import threading
from collections.abc import Callable
from typing import Any


def restore_hash_locks_of_cached_kernels() -> None:
    """Wrap ``StaticAutotunerFuture.result`` so that the kernel it returns has a usable ``_hash_lock``."""
    from torch._inductor import codecache

    future_type = getattr(codecache, "StaticAutotunerFuture", None)
    if future_type is None or getattr(future_type.result, "restores_hash_lock", False):
        return
    future_type.result = _with_hash_lock(future_type.result)


def _with_hash_lock(result: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(result)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        kernel = result(self, *args, **kwargs)
        fn = getattr(kernel, "fn", None)
        if fn is not None and getattr(fn, "_hash_lock", None) is None:
            fn._hash_lock = threading.RLock()
        return kernel

    wrapped.restores_hash_lock = True  # type: ignore[attr-defined]
    return wrapped


def apply() -> None:
    restore_hash_locks_of_cached_kernels()
