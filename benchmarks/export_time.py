"""Where ``export_generation`` spends its time, per graph of the package and per phase.

    python -m benchmarks export_time [--model llama-3.2-1b] [--max-batch-size 8] [--max-seq-len 4096]
        [--decode-batch-sizes 1] [--layers N] [--warm] [--profile N] [--out DIR] [--package-dir DIR]

Exports the model (random weights, bf16 on a GPU, float32 on the CPU) in a fresh process, with empty
Inductor, Triton and tuning-database caches unless ``--warm`` (then a second export follows the first in
the same caches, and both are reported). Each phase is timed inclusively where it runs:

- ``trace``: ``torch.export`` of the generation step;
- ``passes``: our pipeline's graph passes (the ``export`` stage, and the ``post_grad`` stage that Inductor runs);
- ``route timing``: our kernels against Inductor's code, per fastops call not in the tuning database;
- ``inductor``: AOTInductor's compile of the graph, of which ``triton compile`` (waiting for the
  compile workers), ``autotune`` (compile-time benchmarking of kernel configs, coordinate descent
  included) and ``c++ compile`` (the wrapper and kernels' C++);
- ``weights`` and ``package``: collecting the shared weights and writing the ``.pt2``.

``inductor_timers`` holds Inductor's own timers (``torch._dynamo.utils.compilation_time_metrics``) per
graph, and ``--profile N`` adds each graph's compile under cProfile (its N costliest functions by cumulative
and by own time). A static decode graph compiles in a worker process while the dynamic graph compiles
(:mod:`inductor_ext.runtime.compile_worker`): its phases are the worker's compile timers and its wall time
from its start to its result, and ``--profile`` covers the dynamic graph only.

Writes ``export_time_<model>.json`` (rendered into docs/export.md's table by hand: the file is the data).
"""

import argparse
import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch


class PhaseClock:
    """Inclusive seconds per (graph, phase); a phase nested in itself (recursion) counts once."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
        self.graph = "package"
        self._open: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._open[name] += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._open[name] -= 1
            if not self._open[name]:
                self.seconds[self.graph][name] += time.perf_counter() - start

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return function(*args, **kwargs)

        return timed


def _graph_name(program: torch.export.ExportedProgram) -> str:
    """``prefill + decode (dynamic)`` for the dynamic graph, else ``decode batch N``."""
    if program.range_constraints:
        return "prefill + decode (dynamic)"
    args, _ = program.example_inputs or ((), {})
    return f"decode batch {args[0].shape[0]}"


def timed_export(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One ``export_generation`` of ``args.model`` under :class:`PhaseClock`'s timers."""
    import inductor_ext.runtime.generation.export as generation_export
    from inductor_ext.bench.compile_split import compile_split, timer_seconds
    from inductor_ext.bench.train import build_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(args.model, device, dtype, **overrides).eval()
    model.generation_config.eos_token_id = None  # as bench generate's packages: random weights, no end token
    clock = PhaseClock()
    inductor_timers: dict[str, dict[str, float]] = {}
    profiles: dict[str, str] = {}
    compile_program, export_program = generation_export.compile_program, generation_export.export_program

    def record_timers(graph: str, before: dict[str, float]) -> None:
        """``graph``'s phases and Inductor's timers from the compile timers advanced since ``before``."""
        split = compile_split(before)  # passes, route timing, Inductor and its parts, from the compile timers
        # no Dynamo in an export, and AOTInductor compiles the forward outside AOTAutograd's dispatcher, so
        # compile_split's subtraction does not hold: AOTAutograd's own timer is among inductor_timers
        clock.seconds[graph].update({k: v for k, v in split.items() if k not in ("dynamo", "aot_autograd", "passes")})
        clock.seconds[graph]["passes"] = sum(split["passes"].values())
        spent = {k: v - before.get(k, 0.0) for k, v in timer_seconds().items()}
        inductor_timers[graph] = {k: round(v, 2) for k, v in sorted(spent.items(), key=lambda i: -i[1]) if v > 0.2}

    def compile_graph(program: torch.export.ExportedProgram, options: Any = None) -> Any:
        clock.graph = _graph_name(program)
        before = timer_seconds()
        profile = cProfile.Profile() if args.profile else None
        with clock.phase("compile (passes, route timing, inductor)"):
            if profile is not None:
                profile.enable()
            try:
                files = compile_program(program, options)
            finally:
                if profile is not None:
                    profile.disable()
        if profile is not None:
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            stats.sort_stats("cumulative").print_stats(args.profile)  # where the time is spent, from the top
            stats.sort_stats("tottime").print_stats(args.profile)  # and the functions that spend it themselves
            profiles[clock.graph] = text.getvalue()
            # printed now as well: a run cut short keeps it
            print(f"profile of {clock.graph}:\n{profiles[clock.graph]}", file=sys.stderr, flush=True)
        record_timers(clock.graph, before)
        clock.graph = "package"
        return files

    def trace(*trace_args: Any, **kwargs: Any) -> Any:
        with clock.phase("trace"):
            program = export_program(*trace_args, **kwargs)
        clock.seconds[_graph_name(program)]["trace"] += clock.seconds["package"].pop("trace")
        return program

    class TimedJob(generation_export.CompileJob):
        """A static graph's compile in a worker process: its wall time from its start to its result (it
        overlaps the dynamic graph's compile), and the worker's compile timers, which its result adds to
        this process's."""

        def __init__(self, program: torch.export.ExportedProgram, options: Any, name: str) -> None:
            self._graph, self._start = _graph_name(program), time.perf_counter()
            super().__init__(program, options, name)

        def result(self) -> list[Any]:
            before = timer_seconds()
            files = super().result()
            clock.seconds[self._graph]["compile in a worker (from its start)"] = time.perf_counter() - self._start
            record_timers(self._graph, before)
            return files

    patches = [
        mock.patch.object(generation_export, "CompileJob", TimedJob),
        mock.patch.object(generation_export, "export_program", trace),
        mock.patch.object(generation_export, "compile_program", compile_graph),
        mock.patch.object(
            generation_export, "program_weights", clock.wrap("weights", generation_export.program_weights)
        ),
        mock.patch.object(generation_export, "write_package", clock.wrap("package", generation_export.write_package)),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        start = time.perf_counter()
        path = generation_export.export_generation(
            model, folder / "model.pt2", max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
            decode_batch_sizes=args.decode_batch_sizes,
        )  # fmt: skip
        total = time.perf_counter() - start
    return {
        "total_s": round(total, 2),
        "package_mib": round(path.stat().st_size / 2**20, 1),
        "graphs": {graph: {k: round(v, 2) for k, v in phases.items()} for graph, phases in clock.seconds.items()},
        "inductor_timers": inductor_timers,
        **({"profiles": profiles} if profiles else {}),
    }


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        kept = args.package_dir or Path(folder)
        exports = [timed_export(args, kept)]
        if args.warm:
            exports.append(timed_export(args, kept))
    return {"exports": exports}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks export_time", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default="llama-3.2-1b", help="a model of inductor_ext.bench.train.MODELS")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--decode-batch-sizes", type=int, nargs="*", default=[1])
    parser.add_argument("--layers", type=int, help="the model's decoder layers (default: its own)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="cProfile each graph's compile; keep its N costliest functions (cumulative) in the JSON")  # fmt: skip
    parser.add_argument("--warm", action="store_true", help="export twice, the second time in the first's caches")
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--package-dir", type=Path, help="keep the package there (model.pt2); default: deleted")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        print("RESULT " + json.dumps(run_child(args)), flush=True)
        return 0
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "export_time",
        *(argv if argv is not None else sys.argv[1:]),
        "--child",
    ]
    with tempfile.TemporaryDirectory() as caches:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor", "TRITON_CACHE_DIR": f"{caches}/triton",
               "INDUCTOR_EXT_CACHE_DIR": f"{caches}/inductor_ext"}  # fmt: skip
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    shown = " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"command": f"python -m benchmarks export_time {shown}".strip(), "device": device,
            "torch": torch.__version__, "model": args.model}  # fmt: skip
    for index, export in enumerate(result["exports"]):
        print(f"export {index + 1}: {export['total_s']} s, {export['package_mib']} MiB")
        for graph, phases in export["graphs"].items():
            print(f"  {graph}: " + ", ".join(f"{name} {seconds}" for name, seconds in phases.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"export_time_{args.model}.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    return 0
