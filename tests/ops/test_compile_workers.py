"""Precompiles in worker processes (inductor_ext.ops._compile_workers), without a GPU: Triton
compiles for an sm_90 target on any host (its ptxas ships with the wheel), so a worker can fill
the cache and this process must then load the kernel from it without compiling."""

import concurrent.futures
import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction

from inductor_ext.ops._compile_workers import (
    CompileJob,
    CompileWorkerExecutor,
    compile_in_workers,
    inductor_worker_pool,
)


def scale_kernel(X, Y, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(Y + offsets, tl.load(X + offsets, mask=mask) * FACTOR, mask=mask)


# a JITFunction whatever TRITON_INTERPRET says (the suite runs under the interpreter on CPU)
scale_kernel = JITFunction(scale_kernel)


def _triton_compile(src: ASTSource, target: Any, options: Any, env_vars: dict[str, Any]) -> Callable[[], Any]:
    """A compile closure shaped like the one Triton's JITFunction hands AsyncCompileMode."""

    def async_compile() -> Any:
        return triton.compile(src, target=target, options=options.__dict__, _env_vars=env_vars)

    return async_compile


@pytest.fixture
def sm90_compile(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], Any]]:
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "triton"))
    target = GPUTarget("cuda", 90, 32)
    signature = {"X": "*fp32", "Y": "*fp32", "n": "i32", "FACTOR": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(scale_kernel, signature, {(3,): 2.0, (4,): 128}, {(0,): [["tt.divisibility", 16]]})
    yield _triton_compile(src, target, make_backend(target).parse_options({"num_warps": 4}), {})


def test_a_worker_fills_the_cache_and_this_process_only_loads(
    sm90_compile: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    job = CompileJob.from_compile(sm90_compile)
    assert job is not None and job.name == "scale_kernel" and job.module == __name__
    # the compile in this process must be a cache hit: building the IR here means it compiled after all
    monkeypatch.setattr(ASTSource, "make_ir", lambda *a, **k: pytest.fail("compiled in this process"))
    with compile_in_workers():
        workers = inductor_worker_pool()  # what route timing uses; a spawned process where Inductor has none
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter either way: the patch above is not there
    with (
        contextlib.nullcontext(workers)
        if workers
        else concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as processes,
        concurrent.futures.ThreadPoolExecutor(1) as threads,
    ):
        kernel = CompileWorkerExecutor(processes, threads).submit(sm90_compile).result(timeout=300)
    assert kernel.metadata.name == "scale_kernel" and kernel.asm["cubin"]


def test_a_failing_worker_leaves_the_compile_to_this_process(sm90_compile: Callable[[], Any]) -> None:
    class FailingWorkers:
        def submit(self, job: CompileJob) -> concurrent.futures.Future[None]:
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            future.set_exception(RuntimeError("worker died"))
            return future

    with concurrent.futures.ThreadPoolExecutor(1) as threads:
        kernel = CompileWorkerExecutor(FailingWorkers(), threads).submit(sm90_compile).result()
    assert kernel.asm["cubin"]


def test_unrecognised_work_runs_on_the_threads() -> None:
    assert CompileJob.from_compile(lambda: 1) is None

    class NoWorkers:
        def submit(self, job: CompileJob) -> None:
            pytest.fail("sent to a worker")

    with concurrent.futures.ThreadPoolExecutor(1) as threads:
        assert CompileWorkerExecutor(NoWorkers(), threads).submit(lambda x: x + 1, 1).result() == 2


def test_worker_pool_is_used_only_inside_compile_in_workers() -> None:
    assert inductor_worker_pool() is None  # eager first launches never start a pool of processes
