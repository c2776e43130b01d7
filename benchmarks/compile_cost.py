"""What our kernels cost to compile for sm_90 (H100/H200), and their registers and spills, on a CPU host.

For each forward op call in a call file (the standalone autotuner's format,
:mod:`inductor_ext.tuning.cli.calls`) and its backward, records the Triton launches our ops make at
those shapes without running anything (meta tensors), then compiles each launched kernel for
``sm_90`` with the first ``--configs`` configs a launch would offer (the quick first launch's
order), and prints compile seconds, registers per thread and spill bytes (``cuobjdump
-res-usage`` on the cubin; Triton's wheel ships the CUDA tools, no GPU or driver is needed).

    python -m benchmarks compile_cost [CALLS.json] [--configs 4] [--arch 90] [--stage ttir]

CALLS.json defaults to a Llama-3-8B decoder's calls (``calls_llama3_8b_decoder.json`` beside this module).

``--configs 0`` takes every config; ``--stage ttir`` runs only Triton's frontend (Python to TTIR),
whose type checks reject code the interpreter runs (CI runs it on every config of every op).

Why: a compile with our kernels waits for them when Inductor loads the output module (measured on
the H200: ~10 s of a warm-database decoder compile), and a spilling config is a slow config.
Compile seconds here are this host's, single-threaded: compare kernels with each other. A call
whose ops cannot run on fake CUDA tensors on a CPU-only torch build (fused linear cross-entropy,
whose chunk slicing reaches the CUDA backend) is reported and skipped.
"""

import argparse
import contextlib
import re
import subprocess
import tempfile
import time
import unittest.mock
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensorMode
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import create_function_from_signature

import inductor_ext.library.launch as ops_launch
from inductor_ext.library.launch import DirectLaunch
from inductor_ext.tuning.cli.calls import load_calls
from inductor_ext.tuning.cli.report import format_table
from inductor_ext.tuning.routes import capture_backward_args

COLUMNS = ("call", "kernel", "config", "seconds", "registers", "spill bytes")
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


LaunchRecord = tuple[Any, tuple[Any, ...], dict[str, Any]]
"""A launch as recorded: (kernel, args, kwargs)."""


@contextlib.contextmanager
def dry_run_launches() -> Iterator[list[LaunchRecord]]:
    """Within: the ops' direct launches (:class:`~inductor_ext.library.launch.DirectLaunch`) of every
    kernel, autotuned or not, are recorded as (kernel, args, kwargs) and not run."""
    launches: list[LaunchRecord] = []

    def record(self: DirectLaunch, kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
        launches.append((kernel, tuple(args), dict(kwargs)))

    with unittest.mock.patch.object(DirectLaunch, "__call__", record):
        yield launches


@contextlib.contextmanager
def recorded_launches(sms: int) -> Iterator[list[LaunchRecord]]:
    """Within: the ops' direct launches record (kernel, args, kwargs) instead of launching, and the
    GPU reports ``sms`` SMs. Run the ops on fake CUDA tensors (:func:`fake_cuda`): no GPU is needed,
    and every device-dependent choice (grid sizes, block sizes) takes its CUDA branch."""
    with dry_run_launches() as calls, unittest.mock.patch.object(ops_launch, "sm_count", lambda device_index: sms):
        yield calls


def fake_cuda(args: tuple[Any, ...]) -> list[Any]:
    """The call's meta tensors as fake CUDA tensors of the same layouts (call within a ``FakeTensorMode``)."""
    return [
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda") if isinstance(a, torch.Tensor) else a
        for a in args
    ]


def _source(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], backend: Any) -> tuple[ASTSource, Any]:
    """What ``fn`` (a JIT function) launched with these arguments would compile, bound by Triton's
    own binder: (its source, the parsed backend options)."""
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, None)
    return ASTSource(fn, signature, constexprs, attrs), options


def compile_one(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: GPUTarget) -> dict[str, Any]:
    """Compile ``fn`` (a JIT function) for ``target`` as a launch with these arguments would; time,
    registers, spill bytes."""
    source, options = _source(fn, args, kwargs, make_backend(target))
    start = time.perf_counter()
    kernel = triton.compile(source, target=target, options=options.__dict__)
    seconds = time.perf_counter() - start
    cubin = Path(triton.knobs.cache.dir) / f"{kernel.hash}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([CUOBJDUMP, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    cubin.unlink()
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.DOTALL)
    if found is None:
        raise RuntimeError(f"no register and stack counts in cuobjdump's output:\n{usage}")
    registers, stack = found.groups()
    return {"seconds": seconds, "registers": int(registers), "spill bytes": int(stack)}


def lower_one(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: GPUTarget) -> dict[str, Any]:
    """Run only Triton's frontend on ``fn`` as a launch with these arguments would (Python to TTIR):
    its type checks (a loop-carried variable changing dtype, a bad cast) reject code that
    ``TRITON_INTERPRET=1`` runs. A fraction of a full compile's time."""
    backend = make_backend(target)
    source, options = _source(fn, args, kwargs, backend)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    start = time.perf_counter()
    source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    return {"seconds": time.perf_counter() - start}


DEFAULT_CALLS = Path(__file__).with_name("calls_llama3_8b_decoder.json")
"""A Llama-3-8B decoder's forward op calls (2 x 2048 tokens, bf16): norms, RoPE, SwiGLU, the loss."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks compile_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "calls", type=Path, nargs="?", default=DEFAULT_CALLS, help="call file (JSON, or YAML with PyYAML)"
    )
    parser.add_argument(
        "--configs", type=int, default=1, help="configs per launch, in the order a launch offers them (0: every one)"
    )
    parser.add_argument(
        "--stage",
        choices=("sass", "ttir"),
        default="sass",
        help="sass: compile to a cubin (registers, spills); ttir: Triton's frontend only",
    )
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 (sm_90)")
    parser.add_argument("--sms", type=int, default=132, help="SM count the grids are sized for (H100/H200: 132)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")  # Triton's binder asks
    target = GPUTarget("cuda", args.arch, 32)
    triton.knobs.cache.dir = tempfile.mkdtemp(prefix="compile_cost_")  # compile, never load from a cache
    build, columns = (compile_one, COLUMNS) if args.stage == "sass" else (lower_one, COLUMNS[:4])
    rows, seen = [], set()
    for call in load_calls(args.calls):
        try:
            with FakeTensorMode(), recorded_launches(args.sms) as launches:
                capture_backward_args(call.family, fake_cuda(call.args))  # the forward, then the backward
        except RuntimeError as error:  # e.g. fused linear CE's chunk slicing on a CPU-only torch build
            print(f"{call}: skipped, its ops do not run on fake CUDA tensors here ({str(error).splitlines()[0]})")
            continue
        for kernel, kernel_args, kwargs in launches:
            configs = (
                ops_launch.candidate_configs(kernel, kernel_args, kwargs) if isinstance(kernel, Autotuner) else [None]
            )
            fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
            types = tuple(a.dtype if isinstance(a, torch.Tensor) else type(a) for a in kernel_args)
            for config in configs[: args.configs or None]:
                meta = {**kwargs, **(config.all_kwargs() if config is not None else {})}
                key = (fn.__name__, repr(sorted(meta.items(), key=str)), types)
                if key in seen:
                    continue
                seen.add(key)
                shown = {k: v for k, v in meta.items() if k.isupper() or k == "num_warps"}
                rows.append({"call": str(call), "kernel": fn.__name__, "config": shown,
                             **build(fn, kernel_args, meta, target)})  # fmt: skip
                print(f"{fn.__name__:40s} {rows[-1]['seconds']:6.2f} s", flush=True)
    print(format_table([[f"{r[c]:.2f}" if c == "seconds" else str(r[c]) for c in columns] for r in rows], columns))
    what = "compiles" if args.stage == "sass" else "frontend runs"
    print(f"total {sum(r['seconds'] for r in rows):.1f} s for {len(rows)} {what}")
    return 0
