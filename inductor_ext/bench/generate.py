"""``python -m inductor_ext.bench generate``: prefill latency and decode time per token of an HF causal
LM, per provider, each in a fresh process, against the decode step's bandwidth floor.

Providers:

- ``hf_eager``: transformers' ``generate`` with ``cache_implementation="static"``, not compiled.
- ``hf_compile``: the same, with transformers' own compile of the decode step (Inductor, ``reduce-overhead``).
- ``fastops_inductor``: the same with ``CompileConfig(backend="fastops_inductor")`` (``reduce-overhead``).
- ``fastops_inductor_cpp_wrapper``: the backend with ``cpp_wrapper`` (``mode=None``), no CUDA graphs.
- ``package_python``: :func:`inductor_ext.export_generation` + ``load_generation(...).generate``.
- ``package_cpp``: the same package run by ``aoti_generate`` with a CUDA graph around the decode step
  (on CPU: without); batch 1 decodes with the package's static decode graph.
- ``package_cpp_dynamic``: ``package_cpp`` exported with ``decode_batch_sizes=()``: every batch decodes
  with the dynamic graph (cuBLAS projections).
- ``package_cpp_untuned``: ``package_cpp`` with the static decode graph compiled without coordinate
  descent (``coordinate_descent_tuning=False``): what the tuning of its kernels earns per token, against
  what it costs the export.
- ``package_cpp_frozen``: ``package_cpp`` exported with Inductor's ``freezing``: the weights become
  constants, so Inductor's freezing passes may fold them (on a GPU it fuses the q/k/v projections
  into one GEMM, and gate/up into one, over concatenated weights); no static decode graph (freezing
  folds the weights into each graph, which then cannot share them).
- ``package_cpp_folded_sdpa`` and ``package_cpp_decode_attention``: ``package_cpp`` exported with
  ``attention="folded_sdpa"`` or ``"decode_attention"`` (:mod:`inductor_ext.runtime.generation.attention`).

Each provider generates greedily from a random ``(batch, --prompt)`` prompt, with no end token (the
weights are random). Python-loop providers are clocked from the host with the device synchronised:
``T(n)``, the median over ``--repeats`` calls of ``generate`` for ``n`` new tokens after a warm-up; the
prefill time is ``T(1)`` (the prompt and the first token), the decode time per token
``(T(--new + 1) - T(1)) / --new``. The C++ loop reports its own: the prefill call, then the time of
the decode calls (with their token choices) per call. The package
providers that export alike (``package_python`` and ``package_cpp``) share one export, made by the first
of them to run, and report its seconds (``export_s``, cold caches: each provider runs in a fresh
process with empty Inductor and Triton caches and tuning database); the exporting provider adds the
compile timers the export advanced (``export_timers``, seconds per PyTorch and fastops timer). The
floor of a decode step is the bytes it must read, the weights plus the filled part of the KV cache,
over the copy bandwidth timed in the same process.
On a GPU the Python-loop providers also profile each batch size's decode: GPU time per token, per
kernel class and the kernels that take most of it, and the gap (wall time per token less GPU time:
launches and host work the GPU waits for), as ``profile`` in the JSON.
Writes ``generate_<model>.json`` and a plot to ``--out``.
"""

import argparse
import functools
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

import inductor_ext
from inductor_ext.bench.compile_split import timer_seconds
from inductor_ext.bench.harness import (
    copy_bandwidth_gbps,
    fresh_cache_env,
    kernel_us,
    kernel_us_by_class,
    print_child_result,
    run_child,
)
from inductor_ext.bench.train import MODELS, build_model

PROVIDERS = ("hf_eager", "hf_compile", "fastops_inductor", "fastops_inductor_cpp_wrapper", "package_python",
             "package_cpp", "package_cpp_dynamic", "package_cpp_folded_sdpa", "package_cpp_decode_attention",
             "package_cpp_untuned", "package_cpp_frozen")  # fmt: skip
ATTENTION = {"package_cpp_folded_sdpa": "folded_sdpa", "package_cpp_decode_attention": "decode_attention"}
"""``export_generation``'s ``attention`` per provider (the others: ``"sdpa"``)."""


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _generate_ms(generate: Callable[..., Any], prompt: torch.Tensor, new: int, device: str, repeats: int) -> float:
    """The median over ``repeats`` calls of the wall time of ``generate`` for ``new`` tokens, synchronised."""
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        generate(prompt, new)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _prefill_and_decode_ms(generate: Callable[..., Any], prompt: torch.Tensor, new: int, device: str,
                           repeats: int) -> tuple[float, float]:  # fmt: skip
    """Milliseconds to the first token (the prefill and its token choice), and per token after it."""
    first = _generate_ms(generate, prompt, 1, device, repeats)
    whole = _generate_ms(generate, prompt, new + 1, device, repeats)
    return first, (whole - first) / new


def _hf_generate(model: Any, provider: str) -> Callable[..., Any]:
    """transformers' static-cache ``generate`` as ``provider`` runs it."""
    from transformers import CompileConfig

    compile_all: dict[str, dict[str, Any]] = {"hf_compile": {}, "fastops_inductor": {"backend": "fastops_inductor"},
                   "fastops_inductor_cpp_wrapper": {"backend": "fastops_inductor", "mode": None,
                                                    "options": {"cpp_wrapper": True}}}  # fmt: skip
    if provider in compile_all:
        config = CompileConfig(fullgraph=True, **compile_all[provider])
        config._compile_all_devices = True  # type: ignore[assignment]  # compiles on CPU too (a smoke run)
        model.generation_config.compile_config = config

    def generate(ids: torch.Tensor, new: int) -> Any:
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, cache_implementation="static",
                                  disable_compile=provider == "hf_eager")  # fmt: skip

    return generate


def decode_profile(generate: Callable[..., Any], prompt: torch.Tensor, new: int) -> dict[str, Any]:
    """GPU µs per decode token: in total, per kernel class, and the 12 costliest kernels (a profiled
    ``generate`` of ``new + 1`` tokens less one of a single token, the prefill)."""
    whole = kernel_us(functools.partial(generate, prompt, new + 1), steps=1)
    prefill = kernel_us(functools.partial(generate, prompt, 1), steps=1)
    per_token = {name: (us - prefill.get(name, 0.0)) / new for name, us in whole.items()}
    top = sorted(per_token.items(), key=lambda item: -item[1])[:12]
    return {"gpu_us_per_token": sum(per_token.values()), "by_class_us": kernel_us_by_class(per_token),
            "top_kernels_us": [[name[:120], round(us, 2)] for name, us in top]}  # fmt: skip


def _export_settings(provider: str) -> dict[str, Any]:
    """``export_generation``'s arguments for a package provider (those with equal settings share an export)."""
    frozen = provider.endswith("_frozen")
    options = {"freezing": True} if frozen else None
    if provider.endswith("_untuned"):
        options = {"coordinate_descent_tuning": False}
    return {"options": options, "attention": ATTENTION.get(provider, "sdpa"),
            "decode_batch_sizes": () if frozen or provider.endswith("_dynamic") else (1,)}  # fmt: skip


def _shared_export(
    model: Any, provider: str, args: argparse.Namespace, max_seq: int
) -> tuple[Path, float, dict[str, float]]:
    """The package for ``provider`` in ``args.packages`` (exported now unless a provider with the same
    settings exported it), the seconds its export took and, when this call exported it, the compile timers
    it advanced (:func:`inductor_ext.bench.compile_split.timer_seconds`: seconds per timer, the largest
    first), else an empty dict."""
    settings = _export_settings(provider)
    name = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    path, seconds = args.packages / f"{name}.pt2", args.packages / f"{name}.export_s"
    timers: dict[str, float] = {}
    if not path.exists():
        before, start = timer_seconds(), time.perf_counter()
        inductor_ext.export_generation(model, path, max_batch_size=max(args.batches), max_seq_len=max_seq, **settings)
        seconds.write_text(str(time.perf_counter() - start))
        spent = {key: value - before.get(key, 0.0) for key, value in timer_seconds().items()}
        timers = {key: round(value, 2) for key, value in sorted(spent.items(), key=lambda i: -i[1]) if value >= 0.5}
    return path, float(seconds.read_text()), timers


def run_provider(args: argparse.Namespace) -> dict[str, Any]:
    """This process's measurements for ``args.worker``: per batch size, prefill and decode milliseconds."""
    device, provider = args.device, args.worker
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model: Any = build_model(args.model, device, dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: generate exactly the tokens asked for
    vocab = int(model.config.vocab_size)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    result: dict[str, Any] = {"weight_bytes": weights, "copy_gbps": copy_bandwidth_gbps() if device == "cuda" else None}
    max_seq = args.prompt + args.new + 1
    if provider.startswith("package_"):
        path, result["export_s"], timers = _shared_export(model, provider, args, max_seq)
        if timers:
            result["export_timers"] = timers
        generate: Callable[..., Any] = inductor_ext.load_generation(path).generate
    else:
        generate = _hf_generate(model, provider)
    for batch in args.batches:
        ids = torch.randint(0, vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(batch))
        if provider.startswith("package_cpp"):
            from inductor_ext.runtime.cpp_runner import run_generate

            ran = run_generate(path, ids, args.new, device=device, cuda_graph=device == "cuda",
                               iters=args.repeats + 1)  # fmt: skip
            prefill_ms, decode_ms = ran.prefill_ms, ran.decode_ms_per_token
        else:
            prompt = ids.to(device)
            generate(prompt, args.new + 1)  # warm-up (and compiles)
            prefill_ms, decode_ms = _prefill_and_decode_ms(generate, prompt, args.new, device, args.repeats)
        config: Any = model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        filled = args.prompt + args.new // 2  # the cache's mean filled length over the decode steps
        kv_bytes = batch * config.num_hidden_layers * 2 * kv_heads * head_dim * filled * model.dtype.itemsize
        floor_ms = (weights + kv_bytes) / (result["copy_gbps"] * 1e9) * 1e3 if result["copy_gbps"] else None
        result[f"batch_{batch}"] = {"prefill_ms": prefill_ms, "decode_ms_per_token": decode_ms,
                                    "floor_ms": floor_ms,
                                    "of_floor": floor_ms / decode_ms if floor_ms else None}  # fmt: skip
        if device == "cuda" and not provider.startswith("package_cpp"):
            profile = decode_profile(generate, prompt, args.new)
            profile["gap_us_per_token"] = decode_ms * 1e3 - profile["gpu_us_per_token"]
            result[f"batch_{batch}"]["profile"] = profile
    return result


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m inductor_ext.bench generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3.2-1b")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens per row")
    parser.add_argument("--new", type=int, default=64, help="decode steps timed per run")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="batch sizes")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (the median is kept)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (the benchmark), or cpu: a smoke run (e.g. --model tiny-llama), timings meaningless")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for the JSON and PNG")
    parser.add_argument("--worker", choices=PROVIDERS, help=argparse.SUPPRESS)
    parser.add_argument("--packages", type=Path, help=argparse.SUPPRESS)  # the run's exports, shared by workers
    args = parser.parse_args(argv)
    if min(args.prompt, args.new, args.repeats, *args.batches) < 1:
        parser.error("--prompt, --new, --repeats and --batches must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU (--device cpu runs it as a smoke test, its timings meaningless)")
    return args


def _worker_command(args: argparse.Namespace, provider: str) -> list[str]:
    flags = ["--model", args.model, "--prompt", args.prompt, "--new", args.new, "--repeats", args.repeats,
             "--device", args.device, "--worker", provider, "--packages", args.packages,
             "--batches", *args.batches]  # fmt: skip
    return [sys.executable, "-m", "inductor_ext.bench", "generate", *map(str, flags)]


def rows(results: Mapping[str, Mapping[str, Any]], batches: list[int]) -> list[dict[str, Any]]:
    """One row per provider and batch size, with the decode speed against ``hf_compile``'s."""
    table = []
    for provider, result in results.items():
        for batch in batches:
            r = result[f"batch_{batch}"]
            reference = results.get("hf_compile", {}).get(f"batch_{batch}")
            table.append({
                "provider": provider, "batch": batch, "prefill ms": round(r["prefill_ms"], 2),
                "decode ms/token": round(r["decode_ms_per_token"], 3),
                "tokens/s": round(batch * 1e3 / r["decode_ms_per_token"]),
                "x hf_compile": round(reference["decode_ms_per_token"] / r["decode_ms_per_token"], 3) if reference else None,
                "of floor": round(r["of_floor"], 3) if r["of_floor"] else None,
                "export s": round(result["export_s"], 1) if "export_s" in result else None,
            })  # fmt: skip
    return table


def plot(table: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in table})
    providers = list(dict.fromkeys(r["provider"] for r in table))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(batches), 4))
    width = 0.8 / len(providers)
    for i, provider in enumerate(providers):
        values = [next(r["tokens/s"] for r in table if r["provider"] == provider and r["batch"] == b) for b in batches]
        ax.bar([j + i * width for j in range(len(batches))], values, width, label=provider)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from tabulate import tabulate

    args = parse(argv)
    if args.worker:
        with tempfile.TemporaryDirectory() as packages:  # used by a worker run by hand: its export is its own
            args.packages = args.packages or Path(packages)
            print_child_result(run_provider(args))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"generate_{args.model}_prompt{args.prompt}"
    meta = {"model": args.model, "prompt": args.prompt, "new": args.new, "batches": args.batches,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}  # fmt: skip
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as packages, tempfile.TemporaryDirectory() as scratch:
        args.packages = Path(packages)
        for provider in args.providers:
            print(f"{provider} ...", flush=True)
            caches = fresh_cache_env(scratch, tempfile.mkdtemp(dir=scratch))  # cold: nothing compiled or tuned
            results[provider] = run_child(_worker_command(args, provider), caches)
            table = rows(results, args.batches)
            # written after each provider: a run cut short keeps the providers it ran
            (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results, "summary": table},
                                                              indent=1))  # fmt: skip
    print(tabulate(table, headers="keys"))
    if args.device == "cuda":  # the CPU smoke run has no timings worth a plot (nor, maybe, matplotlib)
        plot(table, args.out / f"{stem}.png", f"{args.model}: decode after a {args.prompt}-token prompt")
    return 0
