"""What the standalone tuner prints: a progress bar while tuning, and tables of decisions.

tqdm draws the bar and tabulate the tables when they are installed (the ``tune``
extra); otherwise plain lines and aligned plain-text columns.
"""

import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

from inductor_ext.tuning.routes import RouteDecision

COLUMNS = ("op", "signature", "device", "kernel ms", "inductor ms", "choice", "speedup", "source")
"""The two time columns: median milliseconds, ± half the interdecile spread when timed by this run.
``speedup``: the other route's time over the chosen one's. ``source``: the decision's reason (timed by this
run, read from the database, or ``untuned``: recorded on CPU, nothing timed)."""

T = TypeVar("T")


def progress(items: Sequence[T], label: str) -> Iterator[T]:
    """Yield ``items`` while showing progress on stderr (without tqdm: one line per item, ``str(item)``)."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        for i, item in enumerate(items):
            print(f"[{i + 1}/{len(items)}] {label}: {item}", file=sys.stderr, flush=True)
            yield item
        return
    yield from tqdm(items, desc=label, unit="call", file=sys.stderr)


def decision_row(decision: RouteDecision, device: str) -> list[str]:
    times = [t for t in (decision.kernel_ms, decision.inductor_ms) if t is not None]
    speedup = f"{max(times) / min(times):.2f}x" if len(times) == 2 and min(times) > 0 else "-"
    kernel = _ms(decision.kernel_ms, decision.kernel_spread_ms)
    inductor = _ms(decision.inductor_ms, decision.inductor_spread_ms)
    return [_short(decision.op), decision.signature, device, kernel, inductor, decision.route, speedup, decision.reason]


def untuned_row(op: str, signature: str, device: str) -> list[str]:
    return [_short(op), signature, device, "-", "-", "-", "-", "untuned"]


def entry_rows(items: Iterable[tuple[str, dict[str, Any]]]) -> list[list[str]]:
    """Table rows of tuning-database entries: one per route decision, one per untuned call."""
    rows = []
    for key, record in items:
        kind, _, rest = key.partition("|")
        op, _, rest = rest.partition("|")
        signature, _, device = rest.rpartition("|")
        if kind == "config":  # op is the kernel here; the route column shows its launch config
            config = " ".join(f"{k}={v}" for k, v in record["config"].items() if v is not None)
            rows.append([op, signature, device, "-", "-", config, "-", "kernel config"])
        elif kind != "route":
            rows.append([key, "-", "-", "-", "-", "-", "-", str(record)])
        elif record.get("status") == "untuned":
            rows.append(untuned_row(op, signature, device))
        else:
            rows.extend(decision_row(RouteDecision(**d), device) for d in record["decisions"])
    return rows


def format_table(rows: Sequence[Sequence[str]], columns: Sequence[str] = COLUMNS) -> str:
    """``rows`` under ``columns`` (default: the decision tables'), with tabulate or as plain text."""
    try:
        from tabulate import tabulate  # type: ignore[import-untyped]
    except ImportError:
        widths = [max(len(str(r[i])) for r in (columns, *rows)) for i in range(len(columns))]
        return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in (columns, *rows))
    return tabulate(rows, headers=columns, disable_numparse=True)


def _ms(value: float | None, spread: float | None = None) -> str:
    """``median`` or ``median ±spread/2`` (the interdecile spread)."""
    if value is None:
        return "-"
    return f"{value:.4f}" if spread is None else f"{value:.4f} ±{spread / 2:.4f}"


def _short(op: str) -> str:
    return op.removeprefix("fastops::")
