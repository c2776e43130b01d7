"""``python -m inductor_ext.tuning`` (console script ``inductor-ext-autotune``): tune, show, clear.

    python -m inductor_ext.tuning tune --entry mypkg.models:llama_block
    python -m inductor_ext.tuning tune --hf-config ./Llama-3.1-8B/config.json --batch 4 --seq 2048
    python -m inductor_ext.tuning tune --calls shapes.yaml
    python -m inductor_ext.tuning show
    python -m inductor_ext.tuning clear

The database lives under ``$INDUCTOR_EXT_CACHE_DIR`` (see
:mod:`inductor_ext.tuning.database`); docs/autotune.md has the whole story.
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from inductor_ext.inductor.options import parse_options
from inductor_ext.tuning.cli.calls import OpCall, load_calls, parse_dtype
from inductor_ext.tuning.cli.report import (
    decision_row,
    entry_rows,
    format_table,
    untuned_row,
)
from inductor_ext.tuning.cli.trace import calls_from_entry, calls_from_hf_config
from inductor_ext.tuning.cli.tune import tune_into_database
from inductor_ext.tuning.database import TuningDatabase
from inductor_ext.tuning.routes import device_name


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    namespace = parser.parse_args(argv)
    try:
        return namespace.run(namespace)
    except ValueError as error:
        parser.error(str(error))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m inductor_ext.tuning",
        description="Tune the fastops ops a model uses on random inputs built from shapes alone "
        "(no weights, no model execution), into the tuning database that the fastops_inductor "
        "backend reads.",
    )
    commands = parser.add_subparsers(required=True, metavar="{tune,show,clear}")

    tune = commands.add_parser("tune", help="collect a model's fastops op calls and tune them",
                               description="Collect fastops op calls (after the backend's rewrites) and tune them: "
                               "on a GPU time both routes and record the choices; on CPU record the calls "
                               "as untuned.")  # fmt: skip
    source = tune.add_mutually_exclusive_group(required=True)
    source.add_argument("--entry", metavar="MODULE:FUNCTION",
                        help="a function returning (model, example_input_shapes); called under torch.device('meta')")  # fmt: skip
    source.add_argument("--hf-config", type=Path, metavar="PATH",
                        help="a local Hugging Face config (directory or config.json); needs transformers")  # fmt: skip
    source.add_argument("--calls", type=Path, metavar="FILE", help="a JSON or YAML list of op calls ({op, args})")
    tune.add_argument("--batch", type=_positive_int, help="with --hf-config: batch size (default 1)")
    tune.add_argument("--seq", type=_positive_int, help="with --hf-config: sequence length (default 2048)")
    tune.add_argument("--dtype", type=_dtype, help="with --hf-config: model dtype (default bfloat16)")
    tune.add_argument("--no-grad", action="store_true", help="trace for inference (autograd off) instead of training")
    tune.add_argument("--device", type=_device, default=None,
                      help="cuda (time the routes; default when CUDA is available) or cpu (record untuned)")  # fmt: skip
    tune.set_defaults(run=_tune)

    show = commands.add_parser("show", help="list the tuning database", description="List the tuning database.")
    show.set_defaults(run=_show)
    clear = commands.add_parser("clear", help="empty the tuning database", description="Empty the tuning database.")
    clear.set_defaults(run=_clear)
    return parser


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _dtype(text: str) -> torch.dtype:
    try:
        return parse_dtype(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _device(text: str) -> torch.device:
    device = torch.device(text)
    if device.type not in ("cuda", "cpu"):
        raise argparse.ArgumentTypeError(f"--device must be cuda or cpu, got {text!r}")
    return device


def _collect(namespace: argparse.Namespace) -> list[OpCall]:
    hf_only = {"--batch": namespace.batch, "--seq": namespace.seq, "--dtype": namespace.dtype}
    if namespace.hf_config is None and any(v is not None for v in hf_only.values()):
        raise ValueError(f"{', '.join(k for k, v in hf_only.items() if v is not None)} apply to --hf-config only")
    grad = not namespace.no_grad
    if namespace.entry is not None:
        return calls_from_entry(namespace.entry, grad)
    if namespace.calls is not None:
        return load_calls(namespace.calls)
    batch, seq = namespace.batch or 1, namespace.seq or 2048
    return calls_from_hf_config(namespace.hf_config, batch, seq, namespace.dtype or torch.bfloat16, grad)


def _tune(namespace: argparse.Namespace) -> int:
    calls = _collect(namespace)
    if not calls:
        print("no fastops op calls found", file=sys.stderr)
        return 1
    database = TuningDatabase()
    device = namespace.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    decisions = tune_into_database(calls, database, device, parse_options(None)[0])
    if decisions is None:
        rows = [untuned_row(call.op, call.signature, "cpu") for call in calls]
    else:
        name = device_name(device)
        rows = [decision_row(d, name) for d in decisions]
    print(format_table(rows))
    print(f"\n{len(calls)} op calls -> {database.path}")
    return 0


def _show(namespace: argparse.Namespace) -> int:
    database = TuningDatabase()
    rows = entry_rows(database.items())
    if rows:
        print(format_table(rows))
    print(f"\n{len(rows)} rows in {database.path}")
    return 0


def _clear(namespace: argparse.Namespace) -> int:
    database = TuningDatabase()
    database.clear()
    print(f"cleared {database.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
