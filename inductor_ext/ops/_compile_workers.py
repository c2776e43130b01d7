"""Compile our kernels' autotune configs in Inductor's compile-worker processes.

:func:`inductor_ext.ops._library.precompile_configs` hands Triton's compiles to an executor
through Triton's ``AsyncCompileMode``. Threads share the GIL: a cold route timing spent 13.5 s
in its first launches of the decoder's RMSNorm, RoPE and SwiGLU kernels (58 configs, 16
threads, H200 host), most of a ``fastops_inductor`` compile's 16 s over ``torch.compile``'s.
Inductor keeps a pool of compile-worker processes for its own kernels; inside
:func:`compile_in_workers` (route timing: the backend's ``"auto"`` and the autotuner CLI),
:class:`CompileWorkerExecutor` sends each compile there as a :class:`CompileJob`: the worker
writes the kernel into Triton's on-disk cache, and this process then loads it from there.
A compile it does not recognise, no pool, or a failing worker: the compile runs here, as before.

Depends on Triton 3.6's ``JITFunction._do_compile``, whose submitted compile is a closure over
``src`` (the ``ASTSource``), ``target``, ``options`` and ``env_vars``.
"""

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import triton
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

log = logging.getLogger(__name__)

_IN_WORKERS: contextvars.ContextVar[bool] = contextvars.ContextVar("inductor_ext_compile_in_workers", default=False)


@contextlib.contextmanager
def compile_in_workers() -> Iterator[None]:
    """Within (this thread): precompiles go to Inductor's compile workers when it has a pool.

    Off by default: an eager program's first launch should not start a pool of processes.
    """
    token = _IN_WORKERS.set(True)
    try:
        yield
    finally:
        _IN_WORKERS.reset(token)


def inductor_worker_pool() -> Any | None:
    """Inductor's compile-worker pool inside :func:`compile_in_workers` (started if need be), else None."""
    if not _IN_WORKERS.get():
        return None
    try:
        from torch._inductor.async_compile import AsyncCompile, get_compile_threads

        return AsyncCompile.process_pool() if get_compile_threads() > 1 else None
    except (RuntimeError, OSError) as error:  # e.g. a daemonic process, where Inductor refuses a pool
        log.info("compiling on threads: no Inductor compile workers (%s)", error)
        return None


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One Triton compile, picklable: what a worker needs to rebuild the ``ASTSource``."""

    module: str
    name: str
    """The module attribute holding the kernel (its outermost decorator: autotuner, heuristics or jit)."""
    cache_key: str
    """The parent's ``JITFunction.cache_key``: the worker refuses a kernel whose source differs."""
    signature: dict[str, Any]
    constexprs: dict[Any, Any]
    """``ASTSource.constants``: (argument index,) -> value."""
    """``ASTSource.constants``: (argument index path,) -> value."""
    attrs: dict[Any, Any]
    target: Any
    options: dict[str, Any]
    env_vars: dict[str, Any]
    cache_dir: str

    @classmethod
    def from_compile(cls, compile_fn: Callable[[], Any]) -> "CompileJob | None":
        """The job of a compile that Triton's ``AsyncCompileMode`` submitted; None if not recognised."""
        names = getattr(getattr(compile_fn, "__code__", None), "co_freevars", ())
        cells = dict(zip(names, (c.cell_contents for c in compile_fn.__closure__ or ())))  # type: ignore[attr-defined]
        src, options = cells.get("src"), cells.get("options")
        if not isinstance(src, ASTSource) or not isinstance(src.fn, JITFunction) or options is None:
            return None
        jit = src.fn
        return cls(
            module=jit.fn.__module__, name=jit.fn.__name__, cache_key=jit.cache_key, signature=src.signature,
            constexprs=src.constants, attrs=src.attrs, target=cells.get("target"), options=dict(options.__dict__),
            env_vars=cells.get("env_vars") or {}, cache_dir=triton.knobs.cache.dir,
        )  # fmt: skip

    def __call__(self) -> None:
        """In a worker: compile into the parent's Triton cache directory."""
        kernel: Any = getattr(importlib.import_module(self.module), self.name, None)
        while kernel is not None and not isinstance(kernel, JITFunction):
            kernel = getattr(kernel, "fn", None)  # through autotuner and heuristics wrappers
        if kernel is None or kernel.cache_key != self.cache_key:
            raise RuntimeError(f"{self.module}.{self.name}: not the parent's kernel in the worker")
        with triton.knobs.cache.scope():
            triton.knobs.cache.dir = self.cache_dir
            source = ASTSource(kernel, self.signature, self.constexprs, self.attrs)
            triton.compile(source, target=self.target, options=self.options, _env_vars=self.env_vars)


class CompileWorkerExecutor(concurrent.futures.Executor):
    """Runs each Triton compile in ``workers`` (a process pool taking :class:`CompileJob`), then
    finishes it on ``threads`` in this process, where it now finds the kernel in the cache."""

    def __init__(self, workers: Any, threads: concurrent.futures.Executor) -> None:
        self.workers, self.threads = workers, threads

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        job = None if args or kwargs else CompileJob.from_compile(fn)
        if job is None:
            return self.threads.submit(fn, *args, **kwargs)
        remote = self.workers.submit(job)

        def finish() -> Any:
            try:
                remote.result()
            # whatever failed there (a compile error, a worker that died, an unpicklable job), the
            # compile below runs here and raises any real error with Triton's own message
            except Exception as error:  # noqa: BLE001
                log.info("compile worker failed on %s.%s (%s); compiling here", job.module, job.name, error)
            return fn()

        return self.threads.submit(finish)
