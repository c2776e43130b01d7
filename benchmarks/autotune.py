"""``python -m benchmarks autotune [--out DIR] [--batch 1] [--seq 4096] [--layers 1] [--parts a b c]``:
the standalone autotuner against its targets (below). (a) and (b) take about 2 minutes on an H200,
(c) over 5 (five fresh processes, each compiling from empty caches): give (c) its own device call.

What is measured:

(a) **Tuning without weights.** A Llama-3-8B ``transformers.LlamaConfig`` (built here, saved to a
    temporary folder; ``--layers`` changes only how often each call is made, not the shapes) is
    traced on the meta device (:func:`inductor_ext.tuning.cli.trace.calls_from_hf_config`, training
    step with the loss, ``--batch`` × ``--seq`` tokens), and each call is tuned into an empty
    database as ``python -m inductor_ext.tuning tune`` does (``tune_calls``). Reported: trace and
    tuning wall time (per call and total), the peak GPU memory of the tuning
    (``max_memory_allocated``) and the peak less the largest call's input bytes (target: well
    under 1 GiB).
(b) **The choice holds up.** Right after, in the same process, both routes of every call
    (forward and backward) are timed again (``measure_routes``; our kernels keep the launch
    config picked while tuning); chosen route's time over the faster one's, flagged above 1.03.
    Then every config of each of our autotuned kernels is timed the same way with the config
    forced (:func:`inductor_ext.tuning.launch_settings.force_launch_config`): the config Triton's
    autotuner picked while tuning over the fastest one's, flagged above 1.03.
(c) **Warm vs cold compile** of one Llama-8B-sized decoder layer (:mod:`benchmarks.llama_style`,
    bf16, inference forward on 1 × 2048 tokens): ``torch.compile(backend="fastops_inductor")``
    with ``cpp_wrapper`` (the HF-spelled layer, which the backend rewrites) and
    :func:`inductor_ext.export` (the fastops-spelled layer: export applies no rewrites; the calls
    are the same), each first-call / export wall time in its own fresh process with empty
    Inductor and Triton caches, against an empty tuning database (cold: routes and kernels are
    timed during the compile) and one filled beforehand by ``python -m inductor_ext.tuning tune
    --entry benchmarks.autotune:block --no-grad`` (warm). Each process counts the timing
    runs made during its compile: route timings (``measure_routes``), ``benchmark_all_configs``
    of our kernels and of Inductor's generated ones (``triton_*``), and multi-kernel picks.
    Target: warm / cold ≤ 0.70, no route timing and no benchmarking of our kernels when warm.

Results go to ``DIR/autotune_llama8b.json``.
"""

import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import inductor_ext
from benchmarks.harness import (
    fresh_cache_env,
    model_bench_parser,
    parse_on_gpu,
    print_child_result,
    rel_err,
    run_child,
    show_route_timing,
)
from benchmarks.llama_style import LlamaStyleDecoder
from inductor_ext.inductor.options import BackendOptions
from inductor_ext.tuning import routes
from inductor_ext.tuning.cli.calls import OpCall
from inductor_ext.tuning.cli.trace import calls_from_hf_config
from inductor_ext.tuning.cli.tune import tune_calls
from inductor_ext.tuning.database import TuningDatabase
from inductor_ext.tuning.first_launch import candidate_configs, tuned_launch_config
from inductor_ext.tuning.inputs import random_inputs
from inductor_ext.tuning.launch_settings import force_launch_config, record_autotuned_launches

LLAMA_3_8B: dict[str, Any] = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
}  # fmt: skip
"""``transformers.LlamaConfig`` arguments of Llama-3-8B (``num_hidden_layers`` from ``--layers``)."""

BLOCK = {"hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "layers": 1}
BLOCK_INPUT = (1, 2048, 4096)
"""The compiled block of (c): one Llama-8B-sized decoder layer, and its input shape (bf16)."""

PHASES = {"cpp_wrapper": "hf", "aoti_export": "fastops"}
"""Compile phases of (c) -> the block's spelling (export applies no rewrites: it needs fastops ops)."""

TIMING_RUNS = ("route", "ours", "inductor", "multi_kernel")
"""What (c) counts: route timings, ``benchmark_all_configs`` of our kernels and of Inductor's, multi-kernel picks."""

GIB = 2**30


def block(spelling: str = "hf") -> tuple[torch.nn.Module, list[Any]]:
    """The block of (c) and its input shapes: the ``--entry`` that fills the warm database (called
    under ``torch.device("meta")``); the compile processes build it under ``torch.device("cuda")``."""
    model = LlamaStyleDecoder(**BLOCK, spelling=spelling).to(torch.bfloat16).eval()
    return model, [(BLOCK_INPUT, torch.bfloat16)]


def main(argv: list[str] | None = None) -> int:
    # --batch, --seq, --layers apply to (a); --layers does not change the shapes
    parser = model_bench_parser("python -m benchmarks autotune", __doc__, layers=1, batch=1, seq=4096)
    parser.add_argument("--parts", nargs="+", choices=("a", "b", "c"), default=["a", "b", "c"],
                        help="which measurements to make ((b) needs (a))")  # fmt: skip
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="(c): which compiles")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # (c): one compile, in a child process
    args = parse_on_gpu(parser, argv)
    show_route_timing()
    if args.phase is not None:
        return _compile_phase(args.phase)
    if "b" in args.parts and "a" not in args.parts:
        parser.error("--parts b re-times what (a) tuned: give a too")
    if "a" in args.parts and importlib.util.find_spec("transformers") is None:
        parser.error("this benchmark needs transformers (pip install 'inductor-ext[hf]')")

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)

    def save(part: str, value: Any) -> None:  # each part printed and saved as soon as measured
        report[part] = value
        (args.out / "autotune_llama8b.json").write_text(json.dumps(report, indent=1))

    with tempfile.TemporaryDirectory(prefix="autotune_bench_") as scratch:
        if "a" in args.parts:
            with mock.patch.dict(os.environ, fresh_cache_env(scratch, tempfile.mkdtemp(dir=scratch))):
                tuning, tuned = _tune_llama_8b(args.batch, args.seq, args.layers, Path(scratch))
                save("tuning", tuning)
                _print_tuning(tuning)
                if "b" in args.parts:
                    save("rechecks", _recheck(tuned))
                    _print_rechecks(report["rechecks"])
                    save("config_rechecks", _recheck_configs([call for call, _ in tuned]))
                    _print_config_rechecks(report["config_rechecks"])
            torch.cuda.empty_cache()  # the compile processes get the whole GPU
        if "c" in args.parts:
            _compile_cold_and_warm(scratch, args.phases, save)
    return 0


def _print_tuning(tuning: dict[str, Any]) -> None:
    from tabulate import tabulate

    batch, seq = tuning["tokens"]
    print(f"\n(a) Llama-3-8B config, {batch} x {seq} tokens: trace {tuning['trace_s']:.1f} s, "
          f"tuning {tuning['tune_s']:.1f} s for {len(tuning['calls'])} calls")  # fmt: skip
    calls = [
        (c["op"].removeprefix("fastops::"), c["signature"], f"{c['inputs_gib']:.3f}", f"{c['peak_gib']:.3f}",
         f"{c['tune_s']:.1f}")
        for c in tuning["calls"]
    ]  # fmt: skip
    print(tabulate(calls, headers=["op", "signature", "inputs GiB", "peak GiB", "tune s"], disable_numparse=True))
    print(f"peak {tuning['peak_gib']:.3f} GiB - largest inputs {tuning['largest_inputs_gib']:.3f} GiB "
          f"= {tuning['peak_minus_largest_gib']:.3f} GiB (target: well under 1)", flush=True)  # fmt: skip


def _print_rechecks(rechecks: list[dict[str, Any]]) -> None:
    from tabulate import tabulate

    print("\n(b) the tuned choice, both routes timed again")
    rows = [(r["op"].removeprefix("fastops::"), r["signature"], r["chosen"], f"{r['kernel_ms']:.4f}",
             f"{r['inductor_ms']:.4f}", f"{r['chosen_over_best']:.3f}",
             "OVER 3%" if r["chosen_over_best"] > 1.03 else "") for r in rechecks]  # fmt: skip
    headers = ["op", "signature", "chosen", "kernel ms", "inductor ms", "chosen/best", ""]
    print(tabulate(rows, headers=headers, disable_numparse=True), flush=True)


def _print_config_rechecks(rechecks: list[dict[str, Any]]) -> None:
    from tabulate import tabulate

    print("\n(b) our kernels: the autotuner's pick against every config, each timed again")
    rows = [(r["op"].removeprefix("fastops::"), r["kernel"], r["configs"], r["picked"], f"{r['picked_ms']:.4f}",
             f"{r['best_ms']:.4f}", f"{r['picked_over_best']:.3f}", "OVER 3%" if r["picked_over_best"] > 1.03 else "")
            for r in rechecks]  # fmt: skip
    headers = ["op", "kernel", "configs", "picked", "picked ms", "best ms", "picked/best", ""]
    print(tabulate(rows, headers=headers, disable_numparse=True), flush=True)


def _print_compile(phase: str, result: dict[str, Any]) -> None:
    cold, warm = result["cold"], result["warm"]
    print(f"(c) {phase}: cold {cold['seconds']:.1f} s, warm {warm['seconds']:.1f} s, warm/cold "
          f"{result['warm_over_cold']:.2f} (target <= 0.70); timing runs {'/'.join(TIMING_RUNS)}: "
          f"cold {_timing_runs(cold)}, warm {_timing_runs(warm)}", flush=True)  # fmt: skip


def _input_bytes(call: OpCall) -> int:
    return sum(a.nbytes for a in call.args if isinstance(a, torch.Tensor))


def _tune_llama_8b(batch: int, seq: int, layers: int, scratch: Path) -> tuple[dict[str, Any], list[tuple[OpCall, Any]]]:
    """(a): trace the config on meta, tune each call into an empty database; the report and
    each call with its decisions (forward, backward)."""
    import transformers

    config_dir = scratch / "llama-3-8b"
    transformers.LlamaConfig(**LLAMA_3_8B, num_hidden_layers=layers).save_pretrained(config_dir)
    start = time.perf_counter()
    calls = calls_from_hf_config(config_dir, batch, seq, torch.bfloat16)
    trace_s = time.perf_counter() - start
    database, device, options = TuningDatabase(), torch.device("cuda"), BackendOptions()
    tuned: list[tuple[OpCall, Any]] = []
    rows: list[dict[str, Any]] = []
    for call in calls:
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        tuned.append((call, tune_calls([call], database, device, options)))
        rows.append({"op": call.op, "signature": call.signature, "inputs_gib": _input_bytes(call) / GIB,
                     "tune_s": time.perf_counter() - start, "peak_gib": torch.cuda.max_memory_allocated() / GIB})  # fmt: skip
    peak, largest = max(r["peak_gib"] for r in rows), max(map(_input_bytes, calls)) / GIB
    report = {"config": {**LLAMA_3_8B, "num_hidden_layers": layers}, "transformers": transformers.__version__,
              "tokens": [batch, seq], "trace_s": trace_s,
              "tune_s": sum(r["tune_s"] for r in rows), "calls": rows, "peak_gib": peak, "largest_inputs_gib": largest,
              "peak_minus_largest_gib": peak - largest}  # fmt: skip
    return report, tuned


def _recheck(tuned: list[tuple[OpCall, Any]]) -> list[dict[str, Any]]:
    """(b): both routes of every tuned call timed again; the tuned choice's time over the faster one's."""
    rows = []
    for call, decisions in tuned:
        again = routes.measure_routes(call.family, call.args, BackendOptions(), torch.device("cuda"))
        for chosen, now in zip(decisions, again):
            ms = {route: getattr(now, f"{route}_ms") for route in ("kernel", "inductor")}
            rows.append({"op": now.op, "signature": now.signature, "chosen": chosen.route,
                         "kernel_ms": now.kernel_ms, "inductor_ms": now.inductor_ms,
                         "tuned_kernel_ms": chosen.kernel_ms, "tuned_inductor_ms": chosen.inductor_ms,
                         "chosen_over_best": ms[chosen.route] / min(ms.values())})  # fmt: skip
    return rows


def _recheck_configs(calls: list[OpCall]) -> list[dict[str, Any]]:
    """(b), our kernels: every config each autotuned kernel of a call could launch with, timed like
    the routes (CUDA-graph replay, rotated random inputs) with the config forced; the config its
    autotuner picked while tuning over the fastest one's."""
    rows = []
    for call in calls:
        device = torch.device("cuda")
        for op, templates, direct, _math in routes.call_directions(call.family, call.args, device):
            with record_autotuned_launches() as launches:
                direct(*random_inputs(op, templates, device))
            kernels = {kernel: (kernel_args, kwargs) for kernel, kernel_args, kwargs in launches}
            for kernel, (kernel_args, kwargs) in kernels.items():
                picked = tuned_launch_config(kernel, kernel_args, kwargs)  # the first launch just made tuned it
                configs = {str(c): c.all_kwargs() for c in candidate_configs(kernel, kernel_args, kwargs)}
                picked_name = next(name for name, config in configs.items() if config == picked)
                times = {}
                for name, config in configs.items():
                    with force_launch_config(config):
                        times[name] = routes.time_direct(op, templates, direct, device)[0]
                best = min(times, key=times.__getitem__)
                rows.append({"op": op._name, "signature": call.signature, "kernel": kernel.fn.__name__,
                             "configs": len(times), "picked": picked_name, "picked_ms": times[picked_name],
                             "best": best, "best_ms": times[best], "picked_over_best": times[picked_name] / times[best]})  # fmt: skip
    return rows


def _compile_cold_and_warm(scratch: str, phases: list[str], save: Callable[[str, Any], None]) -> None:
    """(c): fill a warm database for the block, then each compile phase in fresh processes, cold and warm."""
    warm_db = tempfile.mkdtemp(dir=scratch)
    start = time.perf_counter()
    tune = [sys.executable, "-m", "inductor_ext.tuning", "tune", "--entry", "benchmarks.autotune:block",
            "--no-grad"]  # fmt: skip
    subprocess.run(tune, env={**os.environ, **fresh_cache_env(scratch, warm_db)}, check=True)
    report: dict[str, Any] = {"block": {**BLOCK, "input": BLOCK_INPUT}, "warm_db_tune_s": time.perf_counter() - start,
                              "phases": {}}  # fmt: skip
    print(f"\n(c) block {BLOCK} on {BLOCK_INPUT}, one fresh process per compile; "
          f"warm database filled in {report['warm_db_tune_s']:.1f} s", flush=True)  # fmt: skip
    for phase in phases:
        cold = _run_phase(phase, scratch, tempfile.mkdtemp(dir=scratch))
        warm = _run_phase(phase, scratch, warm_db)
        report["phases"][phase] = {"cold": cold, "warm": warm, "warm_over_cold": warm["seconds"] / cold["seconds"]}
        save("compile", report)
        _print_compile(phase, report["phases"][phase])


def _run_phase(phase: str, scratch: str, tuning_dir: str) -> dict[str, Any]:
    print(f"{phase} compile, tuning database {tuning_dir} ...", flush=True)
    command = [sys.executable, "-m", "benchmarks", "autotune", "--phase", phase]
    return run_child(command, fresh_cache_env(scratch, tuning_dir))


def _timing_runs(result: dict[str, Any]) -> str:
    runs = result["timing_runs"]
    return "/".join(str(runs[k]) for k in TIMING_RUNS)


def _compile_phase(phase: str) -> int:
    """One compile of (c) in this (fresh) process: its wall time and the timing runs made during it."""
    runs = _count_timing_runs()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model, [(shape, dtype)] = block(PHASES[phase])
        x = torch.randn(shape, dtype=dtype)
    result: dict[str, Any] = {}
    with torch.no_grad(), tempfile.TemporaryDirectory() as package_dir:
        start = time.perf_counter()
        if phase == "cpp_wrapper":
            out = torch.compile(model, backend="fastops_inductor", options={"cpp_wrapper": True})(x)
        else:
            inductor_ext.export(model, (x,), Path(package_dir) / "block.pt2")
        torch.cuda.synchronize()
        result["seconds"] = time.perf_counter() - start
        if phase == "cpp_wrapper":
            result["rel_err_vs_eager"] = rel_err(out, model(x))
    result["timing_runs"] = {k: sum(runs[k].values()) for k in TIMING_RUNS}
    result["timed"] = {k: dict(v) for k, v in runs.items()}
    print_child_result(result)
    return 0


def _count_timing_runs() -> dict[str, collections.Counter[str]]:
    """Count, from now on in this process, the timing runs a compile can make (by what was timed):
    route timings, ``benchmark_all_configs`` of our kernels and of Inductor's (``triton_*``), multi-kernel picks."""
    from torch._inductor.codegen.multi_kernel import MultiKernelCall
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    runs: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in TIMING_RUNS}
    measure_routes = routes.measure_routes
    benchmark_all_configs = CachingAutotuner.benchmark_all_configs
    benchmark_sub_kernels = MultiKernelCall.benchmark_sub_kernels

    def counted_measure_routes(family: Any, *args: Any, **kwargs: Any) -> Any:
        runs["route"][family.name] += 1
        return measure_routes(family, *args, **kwargs)

    def counted_benchmark_all_configs(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = self.fn.__name__
        runs["inductor" if name.startswith("triton_") else "ours"][name] += 1
        return benchmark_all_configs(self, *args, **kwargs)

    def counted_benchmark_sub_kernels(self: Any, *args: Any, **kwargs: Any) -> Any:
        runs["multi_kernel"][self.multi_kernel_name] += 1
        return benchmark_sub_kernels(self, *args, **kwargs)

    routes.measure_routes = counted_measure_routes  # type: ignore[assignment]
    CachingAutotuner.benchmark_all_configs = counted_benchmark_all_configs  # type: ignore[method-assign]
    MultiKernelCall.benchmark_sub_kernels = counted_benchmark_sub_kernels  # type: ignore[method-assign]
    return runs


if __name__ == "__main__":
    raise SystemExit(main())
