"""Interleaved A/B of one backend provider's first decoder step (its compile) with an environment
variable at 0 and at 1, plus ``torch.compile``'s each round: every run a fresh process with empty
Inductor, Triton and tuning caches, as ``bench backend``'s compile times.

    python -m benchmarks compile_time_ab PROVIDER VAR [--repeats 4] [--layers 4]

PROVIDER: torch_compile, fastops_auto, fastops_kernel or fastops_inductor. Compile times vary by
machine (on the H200, ``torch.compile`` took 10 to 17 s in one run), so compare within one run; one round
of ``fastops_kernel`` takes about 40 s.
"""

import argparse
import tempfile

from benchmarks.backend import first_step_command
from benchmarks.harness import fresh_cache_env, run_child


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks compile_time_ab",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("provider")
    parser.add_argument("variable", help="environment variable set to 0, then 1")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    shape = argparse.Namespace(layers=args.layers, batch=2, seq=2048, hidden=4096)  # bench backend's defaults
    runs = [(args.provider, "0"), (args.provider, "1"), ("torch_compile", "0")]
    with tempfile.TemporaryDirectory(prefix="compile_time_ab_") as scratch:
        for _ in range(args.repeats):
            for provider, value in runs:
                env = {**fresh_cache_env(scratch, tempfile.mkdtemp(dir=scratch)), args.variable: value}
                seconds = run_child(first_step_command(shape, provider), env)["seconds"]
                print(f"{provider} {args.variable}={value} {seconds:.2f} s", flush=True)
    return 0
