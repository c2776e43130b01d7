"""Where a fresh process's first decoder step (its compile) spends its time.

Each provider compiles ``bench backend``'s 4-layer decoder in a fresh process with empty Inductor
and Triton caches, its main thread under cProfile (which inflates Python-heavy stages about 2-3x;
waits on Inductor's compile workers are not inflated); ``fastops_auto_warm_db`` reuses the tuning
database ``fastops_auto``'s process filled. Each child prints ``torch._dynamo.utils.compile_times()``
and writes ``OUT/prof_<provider>.pstats`` (read them with ``pstats`` anywhere).

    PYTHONPATH=$PWD python scripts/profile_compile.py OUT [--providers torch_compile fastops_auto ...]
"""

import argparse
import cProfile
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROVIDERS = ["torch_compile", "fastops_auto", "fastops_auto_warm_db", "fastops_inductor"]


def child(name: str, out: Path) -> None:
    import torch
    from torch._dynamo.utils import compile_times

    from inductor_ext.bench import backend
    from inductor_ext.bench.harness import show_route_timing

    show_route_timing()
    shape = argparse.Namespace(layers=4, batch=2, seq=2048, hidden=4096)
    model, params, x, dy = backend.decoder_step_inputs(shape)
    step = backend._step(backend._provider(name.removesuffix("_warm_db"), model), x, params, dy)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    step()
    torch.cuda.synchronize()
    profile.disable()
    print(f"== {name}: {time.perf_counter() - start:.1f} s (under cProfile)")
    profile.dump_stats(out / f"prof_{name}.pstats")
    print(compile_times(repr="str", aggregate=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--providers", nargs="*", default=PROVIDERS, choices=PROVIDERS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child, args.out)
        return
    from inductor_ext.bench.harness import fresh_cache_env

    scratch, database = tempfile.mkdtemp(), tempfile.mkdtemp()
    for name in args.providers:
        env = fresh_cache_env(scratch, database if name.startswith("fastops_auto") else tempfile.mkdtemp())
        subprocess.run(
            [sys.executable, __file__, str(args.out), "--child", name], env={**os.environ, **env}, check=False
        )


if __name__ == "__main__":
    main()
