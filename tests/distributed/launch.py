"""Run a function on 2 processes over gloo (the CPU tests of DTensor and FSDP2) or NCCL (their GPU tests).

Each rank runs ``fn(rank, world_size, *args)`` in a spawned process with a gloo process group
(a file store in a temporary directory: no port to race for). A child's exception fails the
caller with the child's traceback; a child that has not finished after ``timeout_s`` (scaled by
:func:`time_scale`: the machine's load) is killed and fails the caller, and the process group's own
timeout (scaled alike) bounds any collective, so a hang cannot block CI while a slow, shared machine
does not fail the tests. The children run the ops' CPU branch (``TRITON_INTERPRET`` off): the aten math
the registered ops trace on CPU.
"""

import datetime
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
COLLECTIVE_TIMEOUT_S = 60
MAX_LOAD_SCALE = 4.0
"""The most the machine's load stretches a timeout (a hang still fails, at most this many times later)."""


def time_scale() -> float:
    """How much longer than on an idle machine the ranks may take: the 1-minute load average over the CPU
    count (at least 1, at most :data:`MAX_LOAD_SCALE`), times ``INDUCTOR_EXT_TEST_TIMEOUT_SCALE`` (default 1)."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        load = 1.0
    return min(max(load, 1.0), MAX_LOAD_SCALE) * float(os.environ.get("INDUCTOR_EXT_TEST_TIMEOUT_SCALE", "1"))


def _entry(
    rank: int, fn: Callable[..., Any], store_path: str, backend: str, collective_s: float, args: tuple[Any, ...]
) -> None:
    if backend == "nccl":  # one GPU per rank; tensors the test makes land on it
        import torch

        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=collective_s),
    )
    try:
        fn(rank, WORLD_SIZE, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_on_two_ranks(fn: Callable[..., Any], *args: Any, timeout_s: float = 180, backend: str = "gloo") -> None:
    """``fn(rank, 2, *args)`` on ranks 0 and 1; raises the first child's exception (with its traceback).
    ``backend="nccl"``: rank ``r`` on GPU ``r``, which is also its default device. ``timeout_s`` is the
    budget on an idle machine: the deadline stretches with the highest :func:`time_scale` seen while waiting."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"  # read by the children when they import the package
    try:
        with tempfile.TemporaryDirectory() as tmp:
            scale = time_scale()
            context = mp.start_processes(
                _entry,
                args=(fn, os.path.join(tmp, "store"), backend, COLLECTIVE_TIMEOUT_S * MAX_LOAD_SCALE * scale, args),
                nprocs=WORLD_SIZE,
                join=False,
                start_method="spawn",
            )
            start = time.monotonic()
            while not context.join(timeout=5.0):
                scale = max(scale, time_scale())
                if time.monotonic() - start > timeout_s * scale:
                    for process in context.processes:
                        if process.is_alive():
                            process.kill()
                    raise TimeoutError(
                        f"{getattr(fn, '__name__', fn)} did not finish on 2 ranks in {timeout_s * scale:.0f} s "
                        f"({timeout_s} s scaled by the machine's load)"
                    )
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def results_of_two_ranks(
    tmp_path_factory: Any, fn: Callable[..., Any], name: str, timeout_s: float, backend: str = "gloo"
) -> Any:
    """Run ``fn(rank, world_size, results_path)`` on two ranks; the JSON rank 0 wrote to ``results_path``."""
    path = tmp_path_factory.mktemp(name) / "results.json"
    run_on_two_ranks(fn, str(path), timeout_s=timeout_s, backend=backend)
    return json.loads(path.read_text())
