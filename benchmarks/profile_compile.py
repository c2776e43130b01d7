"""Where a fresh process's first decoder step (its compile) spends its time.

Each provider compiles ``bench backend``'s 4-layer decoder in a fresh process with empty Inductor
and Triton caches, while a sampling thread records every thread's Python stack every
``--interval-ms`` (no tracing, so unlike cProfile nothing Python-heavy is inflated);
``fastops_auto_warm_db`` reuses the tuning database ``fastops_auto``'s process filled. Each child
prints its wall seconds, ``torch._dynamo.utils.compile_times()`` and the functions found on the
most samples (inclusive, and as the innermost frame), and writes them to ``OUT/samples_<name>_threads_<setting>.txt``.
``--compile-threads 1`` also runs every provider with Inductor compiling in the main process, so
the samples show what its worker processes would otherwise spend.

    python -m benchmarks profile_compile OUT [--providers torch_compile fastops_kernel ...]
        [--compile-threads 1] [--interval-ms 5] [--top 40]
"""

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

from typing_extensions import Self  # typing.Self needs Python 3.11

PROVIDERS = ["torch_compile", "fastops_auto", "fastops_auto_warm_db", "fastops_kernel", "fastops_inductor"]


class StackSampler:
    """Samples every other thread's stack every ``interval`` seconds and credits the seconds since
    the previous sample to each function on each stack (``inclusive``) and to each innermost one
    (``innermost``); keys are ``file:line(function)`` of the function's start. Every thread, since
    the autograd engine compiles and runs the backward on its own device thread while the main
    thread waits in ``_engine_run_backward``. (While a thread runs Python the sampler waits for the
    GIL, so samples are sparser, but each carries its time.) Idle threads add their wait frames."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.inclusive: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.innermost: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.samples, self.seconds = 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _key(frame: FrameType) -> str:
        code = frame.f_code
        return f"{'/'.join(Path(code.co_filename).parts[-2:])}:{code.co_firstlineno}({code.co_name})"

    def _run(self) -> None:
        last = time.perf_counter()
        own = threading.get_ident()
        while not self._stop.wait(self.interval):
            frames = sys._current_frames()
            now = time.perf_counter()
            elapsed, last = now - last, now
            self.samples += 1
            self.seconds += elapsed
            for thread, innermost in frames.items():
                if thread == own:
                    continue
                self.innermost[self._key(innermost)] += elapsed
                seen = set()
                frame: FrameType | None = innermost
                while frame is not None:
                    seen.add(self._key(frame))
                    frame = frame.f_back
                for key in seen:
                    self.inclusive[key] += elapsed

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, top: int) -> str:
        header = f"{self.samples} samples over {self.seconds:.1f} s (every {self.interval * 1e3:g} ms or later)"
        lines = [header + "; seconds are summed over threads, shares are of the wall time"]
        for title, counter in (("inclusive", self.inclusive), ("innermost", self.innermost)):
            lines.append(f"-- {title}: seconds (share), function")
            for key, seconds in sorted(counter.items(), key=lambda item: item[1], reverse=True)[:top]:
                lines.append(f"{seconds:7.2f} s ({seconds / max(self.seconds, 1e-9):5.1%})  {key}")
        return "\n".join(lines)


def child(name: str, out: Path, interval: float, top: int) -> None:
    import torch
    from torch._dynamo.utils import compile_times

    from benchmarks import backend
    from benchmarks.harness import show_route_timing

    show_route_timing()
    shape = argparse.Namespace(layers=4, batch=2, seq=2048, hidden=4096)
    model, params, x, dy = backend.decoder_step_inputs(shape)
    step = backend._step(backend._provider(name.removesuffix("_warm_db"), model), x, params, dy)
    start = time.perf_counter()
    with StackSampler(interval) as sampler:
        step()
        torch.cuda.synchronize()
    threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "default")
    text = (
        f"== {name} (compile threads: {threads}): {time.perf_counter() - start:.1f} s\n"
        f"{compile_times(repr='str', aggregate=True)}\n{sampler.report(top)}"
    )
    print(text, flush=True)
    (out / f"samples_{name}_threads_{threads}.txt").write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks profile_compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--providers", nargs="*", default=PROVIDERS, choices=PROVIDERS)
    parser.add_argument("--compile-threads", type=int, help="also run each provider with this many compile threads")
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child, args.out, args.interval_ms / 1e3, args.top)
        return 0
    from benchmarks.harness import fresh_cache_env

    thread_settings: list[dict[str, str]] = [{}] + (
        [{"TORCHINDUCTOR_COMPILE_THREADS": str(args.compile_threads)}] if args.compile_threads else []
    )
    for threads in thread_settings:
        scratch, database = tempfile.mkdtemp(), tempfile.mkdtemp()
        for name in args.providers:
            env = fresh_cache_env(scratch, database if name.startswith("fastops_auto") else tempfile.mkdtemp())
            command = [sys.executable, "-m", "benchmarks", "profile_compile", str(args.out), "--child", name,
                       "--interval-ms", str(args.interval_ms), "--top", str(args.top)]  # fmt: skip
            subprocess.run(command, env={**os.environ, **env, **threads}, check=False)
    return 0
