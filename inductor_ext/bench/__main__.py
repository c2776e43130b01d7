"""``python -m inductor_ext.bench train|generate [options]``: a training step or generation of a real HF
model shape, each provider in its own process, side by side (see ``--help`` of each)."""

import importlib
import sys

BENCHMARKS = {"train": "inductor_ext.bench.train", "generate": "inductor_ext.bench.generate"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m inductor_ext.bench {{{','.join(BENCHMARKS)}}} [options] (see their --help)\n{__doc__}",
              file=sys.stderr)  # fmt: skip
        return 2
    return int(importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
