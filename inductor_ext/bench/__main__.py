"""``python -m inductor_ext.bench train|generate [options]``: a training step or generation of a real HF
model shape, each provider in its own process, side by side (see ``--help`` of each)."""

import importlib
import sys

BENCHMARKS = {"train": "inductor_ext.bench.train", "generate": "inductor_ext.bench.generate"}


USAGE = (
    f"usage: python -m inductor_ext.bench {{{','.join(BENCHMARKS)}}} [options]\n\n"
    "  train     a training step per provider: tokens/s, peak memory, first step, loss\n"
    "  generate  prefill and decode per provider, against the decode's bandwidth floor\n\n"
    "Each takes --help: python -m inductor_ext.bench train --help, python -m inductor_ext.bench generate --help"
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        print(USAGE, file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
