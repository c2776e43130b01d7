"""``bench train``'s results: one summary row per provider against its references, the plot, rounds
pooled, and the results of an earlier invocation merged."""

import json
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from inductor_ext.bench.harness import kernel_us_by_class
from inductor_ext.bench.train.providers import Provider, reference

CATEGORIES = tuple(kernel_us_by_class({}))
"""The harness's kernel classes (:func:`inductor_ext.bench.harness.kernel_class`)."""


def references(name: str, results: Mapping[str, Mapping[str, Any]]) -> tuple[str | None, str | None]:
    """The names of the results ``name``'s speed and loss are compared with: the unpatched ``torch_compile``
    and eager providers of the same adapter and data (:func:`~inductor_ext.bench.train.providers.reference`)."""
    specs = {n: Provider.from_json(r["spec"]) for n, r in results.items()}
    compiled, eager = (reference(specs[name], specs.values(), backend) for backend in ("torch_compile", "eager"))
    return (compiled.name if compiled else None), (eager.name if eager else None)


def summarize(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per provider: its speed as a ratio to the compiled reference's (real tokens/s for documents;
    adapter rows also to the eager reference's) and its final loss's difference from the eager reference's
    (:func:`references`)."""
    rows = []
    for name, r in results.items():
        compiled, eager = references(name, results)
        packed = "real_tokens_per_s" in r
        speed = "real_tokens_per_s" if packed else "tokens_per_s"
        base = results[compiled][speed] if compiled else None
        eager_speed = results[eager][speed] if eager else None
        adapter = r["spec"]["adapter"] != "none"
        real = (
            {"real tokens/s": round(r["real_tokens_per_s"]), "pad %": round(100 * r["pad_fraction"], 1)}
            if packed
            else {}
        )
        reference_loss = results[eager]["losses"][-1] if eager else None
        row = {
            "provider": name,
            "tokens/s": round(r["tokens_per_s"]),
            **({"tokens/s per GPU": round(r["tokens_per_s_per_gpu"])} if r.get("ranks", 1) > 1 else {}),
            **real,
            "x torch.compile": round(r[speed] / base, 3) if base else None,
            **({"x eager": round(r[speed] / eager_speed, 3) if eager_speed else None} if adapter else {}),
            "peak GiB": round(r["peak_gib"], 2) if r["peak_gib"] is not None else None,
            "first step s": round(r["first_step_s"], 1),
            "final loss": round(r["losses"][-1], 4),
            "loss - eager": round(r["losses"][-1] - reference_loss, 4) if reference_loss is not None else None,
            "loss reference": eager,
        }
        row.update({f"{c} ms": round(r["gpu_ms_by_category"][c], 1) for c in CATEGORIES})
        row["GPU ms"] = round(r["gpu_ms_total"], 1)
        row["wall ms"] = round(r["step_ms_median"], 1)
        row["wall ms no sync"] = round(r["step_ms_unsynced"], 1) if "step_ms_unsynced" in r else None
        row["wall - GPU ms"] = round(r["step_ms_median"] - r["gpu_ms_total"], 1) if r["gpu_ms_total"] else None
        idle = r.get("gpu_idle_ms")  # absent on CPU
        row["GPU idle: launch gaps ms"] = round(idle["launch_gaps"], 1) if idle else None
        row["GPU idle: host waits ms"] = round(idle["host_waits"], 1) if idle else None
        row["tune s"] = round(r["tune_s"], 1) if r.get("tune_s") is not None else None
        row["SM MHz"] = round(r["timed_steps_gpu"]["sm_clock_mhz"]) if r.get("timed_steps_gpu") else None
        runs = r.get("rounds")  # --rounds > 1: each run's median step and clock, in the order of the rounds
        row["wall ms by round"] = " / ".join(f"{run['step_ms_median']:.1f}" for run in runs) if runs else None
        row["SM MHz by round"] = (
            " / ".join(f"{run['sm_clock_mhz']:.0f}" for run in runs if run["sm_clock_mhz"]) if runs else None
        )
        row["graph breaks"] = sum(r.get("graph_breaks", {}).values())
        rows.append(row)
    return rows


def plot(results: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    real = all("real_tokens_per_s" in results[n] for n in names)
    speed = "real_tokens_per_s" if real else "tokens_per_s"
    left.barh(names, [results[n][speed] / 1e3 for n in names], color="tab:blue")
    left.set_xlabel(f"thousand {'real (non-pad) ' if real else ''}tokens / s (higher is better)")
    left.invert_yaxis()
    right.invert_yaxis()
    if not any(results[n]["gpu_ms_by_category"][c] for n in names for c in CATEGORIES):  # --profile-steps 0
        right.barh(names, [results[n]["peak_gib"] or 0.0 for n in names], color="tab:gray")
        right.set_xlabel("peak GiB allocated (lower is better)")
    else:
        offset = [0.0] * len(names)
        for category in CATEGORIES:
            values = [results[n]["gpu_ms_by_category"][category] for n in names]
            right.barh(names, values, left=offset, label=category)
            offset = [a + b for a, b in zip(offset, values)]
        right.set_xlabel("GPU ms per step, by kernel category")
        right.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pool_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One provider's result over its ``--rounds`` runs: the first run's (its cold first step, profile and
    losses) with the timed steps of every run pooled (tokens/s from their median), the unsynchronised
    steps' mean, the highest peak, the mean SM clock and power, and each run's median step, clock and
    position in its round's order under ``rounds``."""
    first = {key: value for key, value in runs[0].items() if key != "position"}
    if len(runs) == 1:
        return first
    tokens_per_step = first["tokens_per_s"] * first["step_ms_median"] / 1e3
    steps = [ms for run in runs for ms in run["step_ms"]]
    median_ms = statistics.median(steps)
    unsynced_ms = statistics.fmean(run["step_ms_unsynced"] for run in runs)
    clocks = [run["timed_steps_gpu"] for run in runs if run.get("timed_steps_gpu")]
    peaks = [run["peak_gib"] for run in runs if run["peak_gib"] is not None]
    return {
        **first,
        "step_ms": steps,
        "step_ms_median": median_ms,
        "tokens_per_s": tokens_per_step / median_ms * 1e3,
        "tokens_per_s_per_gpu": tokens_per_step / first["ranks"] / median_ms * 1e3,
        "step_ms_unsynced": unsynced_ms,
        "tokens_per_s_unsynced": tokens_per_step / unsynced_ms * 1e3,
        "peak_gib": max(peaks) if peaks else None,
        "timed_steps_gpu": {key: statistics.fmean(c[key] for c in clocks) for key in clocks[0]} if clocks else None,
        "rounds": [_round_summary(run) for run in runs],
    }


def _round_summary(run: Mapping[str, Any]) -> dict[str, Any]:
    clock = run.get("timed_steps_gpu") or {}
    return {
        "position": run["position"],
        "step_ms_median": run["step_ms_median"],
        "sm_clock_mhz": clock.get("sm_clock_mhz"),
    }


def earlier_results(path: Path, meta: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The results already in ``path`` (``--merge``); none if it does not exist. Refuses a file of other settings."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if earlier["meta"] != meta:
        differ = sorted(k for k in {*meta, *earlier["meta"]} if meta.get(k) != earlier["meta"].get(k))
        raise SystemExit(f"--merge: {path} holds a run of other settings ({', '.join(differ)} differ)")
    return dict(earlier["results"])
