"""``python -m inductor_ext.bench train [--model llama-3.2-1b] [--batch 4] [--seq 2048] [--steps 10]
[--providers ...] [--out DIR]``: a training step of a real HF transformers model shape, side by side.

The model is built from a config in ``MODELS`` (random init, bf16 weights, no download), and each
provider trains it in its own fresh process (no compiled code, patched class or allocator state carried
over) on the same seeded weights and batches, with AdamW. Per provider: tokens/s (median over ``--steps``
timed steps after warm-up, wall clock), peak memory over those steps, the first step's seconds (compile
included) and its compile's split (Dynamo, AOTAutograd, Inductor, route timing, each of our passes:
:mod:`inductor_ext.bench.compile_split`), the final loss next to the eager reference's, and one profiled step's GPU time per kernel
category (GEMMs, attention, optimizer, everything else), busy and idle, and each phase's peak memory.
Writes ``train_<model>_<batch>x<seq>[suffixes].json`` and a ``.png`` under ``--out`` and prints a table.

Providers (``--providers``): a preset's name, or axes set one by one (see
:mod:`inductor_ext.bench.train.providers`), e.g. ``fastops_inductor,fastops.route=kernel``. Without
``--providers`` a group runs: the default one, or that of ``--cpp-wrapper``, ``--lora``, ``--qlora`` or
``--packed``, each of which also names the output file. Every provider of a run shares the run's adapter
(none, ``--lora``, ``--qlora``), data (tokens, or documents with ``--packed``) and checkpointing
(``--gradient-checkpointing``), so one file holds one configuration.

``--rounds N`` runs every provider N times, the order reversed each round, and pools the timed steps: a
GPU slows as it heats, so a provider run late is timed at a lower clock; reversing puts each early once.
``--nproc N`` runs each provider on N GPUs of this host (FSDP2 per decoder layer, ``--batch`` rows per
rank). ``--merge`` adds to an existing file of the same settings. ``--device cpu`` is a smoke run.
"""

import argparse
import contextlib
import importlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from inductor_ext.bench import fsdp, packing
from inductor_ext.bench.harness import fresh_cache_env, kernel_class, package_version, print_child_result, run_child
from inductor_ext.bench.train import report
from inductor_ext.bench.train.model import MODELS
from inductor_ext.bench.train.providers import GROUPS, PRESETS, Provider, parse_provider, with_checkpointing


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m inductor_ext.bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3.2-1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="steps after the first (compile) step, not timed")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps for the GPU-time table (0: none)")
    p.add_argument("--providers", nargs="+", metavar="PROVIDER",
                   help=f"presets ({' '.join(PRESETS)}) or key=value settings; "
                        f"default: {' '.join(GROUPS['default'])}")  # fmt: skip
    group = p.add_mutually_exclusive_group()
    group.add_argument("--cpp-wrapper", action="store_true", help=f"run {' '.join(GROUPS['cpp_wrapper'])}")
    group.add_argument("--lora", action="store_true", help="train LoRA adapters (default providers: the lora group)")
    group.add_argument("--qlora", action="store_true", help="train LoRA adapters over an NF4 base (bitsandbytes)")
    group.add_argument("--packed", action="store_true", help="train on packed documents and their padded baseline")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each decoder layer's activations in the backward (non-reentrant)")  # fmt: skip
    p.add_argument("--padded-batch", type=int, default=8, help="documents per batch of the padded baseline")
    p.add_argument("--loss-chunk-size", type=int, default=None,
                   help="rows of logits per chunk of models.apply's fused loss (default: its own)")  # fmt: skip
    p.add_argument("--nproc", type=int, default=1, help="GPUs of this host per provider (FSDP2; gloo ranks on CPU)")
    p.add_argument("--attention-mask", choices=("none", "ones"), default="none",
                   help="pass no attention_mask, or one of all ones (what HF's data collators pass)")  # fmt: skip
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (the benchmark), or cpu: a smoke run (e.g. --model tiny-llama), timings meaningless")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1,
                   help="run every provider this many times, the order reversed each round, and pool the timed steps")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for the JSON and PNG")
    p.add_argument("--merge", action="store_true",
                   help="add to the configuration's JSON in --out (same settings), replacing the rows of the "
                        "providers run now")  # fmt: skip
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a provider's JSON: run it in this process
    return p


def group_name(args: argparse.Namespace) -> str:
    flags = ("cpp_wrapper", "lora", "qlora", "packed")
    return next((flag for flag in flags if getattr(args, flag)), "default")


def providers(args: argparse.Namespace) -> list[Provider]:
    """The providers of this run (``ValueError`` for an entry that names none)."""
    if args.providers is None:
        chosen = [PRESETS[name] for name in GROUPS[group_name(args)]]
        if not args.gradient_checkpointing:  # a selective policy only changes what checkpointing recomputes
            chosen = [p for p in chosen if p.checkpoint_policy is None]
    else:
        chosen = [parse_provider(text) for text in args.providers]
    return [with_checkpointing(p, args.gradient_checkpointing) for p in chosen]


def check(args: argparse.Namespace, chosen: list[Provider]) -> str | None:
    """A usage error, or None."""
    if min(args.batch, args.seq, args.steps, args.nproc, args.rounds) < 1 or min(args.warmup, args.profile_steps) < 0:
        return "--batch, --seq, --steps, --nproc and --rounds must be >= 1; --warmup and --profile-steps >= 0"
    if args.loss_chunk_size is not None and args.loss_chunk_size < 1:
        return "--loss-chunk-size must be >= 1"
    if args.padded_batch < 1:
        return "--padded-batch must be >= 1"
    if args.packed and (args.nproc > 1 or args.attention_mask != "none" or args.rounds > 1):
        return "--packed: not with --nproc > 1, --attention-mask ones or --rounds > 1 (its speeds count real tokens)"
    if args.qlora and args.nproc > 1:
        return "--qlora: not with --nproc > 1"
    adapter = "lora" if args.lora else "qlora" if args.qlora else "none"
    for p in chosen:
        if p.adapter != adapter:
            return f"{p.name}: adapter {p.adapter}, " + (f"only with --{p.adapter}" if adapter == "none" else
                                                         f"but --{adapter} runs only {adapter} providers")  # fmt: skip
        if (p.data != "tokens") != args.packed:
            return f"{p.name}: " + (
                "only with --packed" if not args.packed else "--packed runs only document providers"
            )
        if p.gradient_checkpointing and not args.gradient_checkpointing:
            return f"{p.name}: only with --gradient-checkpointing (one file holds one configuration)"
    if args.device == "cuda" and torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
        return f"--nproc {args.nproc} needs as many GPUs; this host has {torch.cuda.device_count()}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "this benchmark needs a CUDA GPU (--device cpu runs it as a smoke test, its timings meaningless)"
    return None


def stem(args: argparse.Namespace) -> str:
    """The output files' name: the settings that make a configuration."""
    name = f"train_{args.model}_{args.batch}x{args.seq}" + ("_mask" if args.attention_mask == "ones" else "")
    name += "".join(f"_{flag}" for flag in ("cpp_wrapper", "lora", "qlora", "packed") if getattr(args, flag))
    name += f"_{args.nproc}gpu" if args.nproc > 1 else ""
    name += f"_loss_chunk{args.loss_chunk_size}" if args.loss_chunk_size else ""
    return name + ("_gc" if args.gradient_checkpointing else "")


def worker_command(args: argparse.Namespace, provider: Provider) -> list[str]:
    flags = ["--model", args.model, "--batch", args.batch, "--seq", args.seq, "--steps", args.steps,
             "--warmup", args.warmup, "--profile-steps", args.profile_steps, "--attention-mask",
             args.attention_mask, "--device", args.device, "--padded-batch", args.padded_batch,
             "--worker", json.dumps(provider.to_json())]  # fmt: skip
    if args.loss_chunk_size is not None:
        flags += ["--loss-chunk-size", args.loss_chunk_size]
    module_args = ["inductor_ext.bench", "train", *map(str, flags)]
    if args.nproc > 1:
        return fsdp.launch_command(args.nproc, module_args)
    return [sys.executable, "-m", *module_args]


def available(provider: Provider) -> bool:
    if (package := provider.required_package) is None:
        return True
    try:
        importlib.import_module("liger_kernel.transformers" if package == "liger_kernel" else package)
    except ImportError:
        return False
    return True


def metadata(args: argparse.Namespace) -> dict[str, Any]:
    """What the run's JSON records of its settings and software (``--merge`` refuses other settings)."""
    meta: dict[str, Any] = {
        "model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
        "attention_mask": args.attention_mask, "loss_chunk_size": args.loss_chunk_size, "torch": torch.__version__,
    }  # fmt: skip
    if args.packed:
        meta.update(packed=True, padded_batch=args.padded_batch, doc_length_median=packing.DOC_LENGTH_MEDIAN,
                    doc_length_sigma=packing.DOC_LENGTH_SIGMA, doc_length_min=packing.DOC_LENGTH_MIN)  # fmt: skip
    if args.qlora:
        from inductor_ext.bench.train import qlora

        meta.update(qlora=qlora.quantization_meta(), peft=package_version("peft"))
    if args.gradient_checkpointing:
        meta["gradient_checkpointing"] = True
    if args.rounds > 1:
        meta["rounds"] = args.rounds
    meta["transformers"] = package_version("transformers")
    meta["device"] = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    meta["command"] = "python -m inductor_ext.bench train " + " ".join(_argv_of(args))
    return meta


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The command-line arguments that reproduce ``args`` (the providers apart: each row names its own)."""
    defaults = parser().parse_args([])
    argv = []
    for key in ("model", "batch", "seq", "steps", "warmup", "profile_steps", "attention_mask", "padded_batch",
                "loss_chunk_size", "nproc", "rounds"):  # fmt: skip
        if getattr(args, key) != getattr(defaults, key):
            argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    flags = ("cpp_wrapper", "lora", "qlora", "packed", "gradient_checkpointing")
    return argv + [f"--{flag.replace('_', '-')}" for flag in flags if getattr(args, flag)]


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.worker:
        from inductor_ext.bench.train.worker import run_provider

        if (result := run_provider(args, Provider.from_json(json.loads(args.worker)))) is not None:
            print_child_result(result)
        return 0
    try:
        chosen = providers(args)
    except ValueError as bad:
        p.error(f"--providers: {bad}")
    if (error := check(args, chosen)) is not None:
        p.error(error)
    from tabulate import tabulate

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{stem(args)}.json"
    meta = metadata(args)
    results = report.earlier_results(path, meta) if args.merge else {}
    runnable = [provider for provider in chosen if available(provider)]
    for provider in chosen:
        if provider not in runnable:
            print(f"{provider.name}: skipped ({provider.required_package} is not importable)")
    rounds: dict[str, list[dict[str, Any]]] = {provider.name: [] for provider in runnable}
    # each provider's compile caches are empty in its first round (a cold first step) and its own after
    with contextlib.ExitStack() as scratch_dirs:
        scratch = {p.name: scratch_dirs.enter_context(tempfile.TemporaryDirectory()) for p in runnable}
        for round_index in range(args.rounds):
            order = runnable if round_index % 2 == 0 else runnable[::-1]
            label = f" (round {round_index + 1})" if args.rounds > 1 else ""
            for position, provider in enumerate(order):
                print(f"{provider.name}{label} ...", end=" ", flush=True)
                env = fresh_cache_env(scratch[provider.name], scratch[provider.name])
                result = run_child(worker_command(args, provider), env)
                rounds[provider.name].append({**result, "position": position})
                results[provider.name] = report.pool_rounds(rounds[provider.name])
                _print_headline(result)
                # written after every provider: a run stopped early keeps the providers it finished
                path.write_text(json.dumps({"meta": meta, "results": results,
                                            "summary": report.summarize(results)}, indent=1))  # fmt: skip
    print(tabulate(report.summarize(results), headers="keys"))
    for name, r in results.items():
        for category in ("attention", "other"):
            top = [(k, v) for k, v in r["kernels_ms"].items() if kernel_class(k) == category][:6]
            print(f"{name}, largest {category} kernels (ms/step): " + ", ".join(f"{k[:70]} {v:.2f}" for k, v in top))
        if "peak_gib_by_phase" in r:
            print(f"{name}, peak GiB by phase: " + ", ".join(f"{k} {v:.2f}" for k, v in r["peak_gib_by_phase"].items()))
    if results and args.device == "cuda":
        settings = [f"{args.batch} x {args.seq} tokens", "bf16", "AdamW"]
        settings += ["QLoRA (NF4)"] * args.qlora + ["LoRA"] * args.lora + ["packed documents"] * args.packed
        settings += ["gradient checkpointing"] * args.gradient_checkpointing
        report.plot(results, args.out / f"{stem(args)}.png", f"{args.model}, " + ", ".join(settings))
    return 0


def _print_headline(result: dict[str, Any]) -> None:
    peak = f", {result['peak_gib']:.2f} GiB" if result["peak_gib"] is not None else ""
    speed = f"{result['tokens_per_s']:,.0f} tokens/s"
    if "real_tokens_per_s" in result:
        speed = f"{result['real_tokens_per_s']:,.0f} real tokens/s ({speed})"
    print(f"{speed}{peak}, first step {result['first_step_s']:.1f} s", flush=True)
    split = result.get("first_step_compile_s")
    if split and split["inductor"] > 0:  # a compiled provider
        phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in split.items() if name != "passes")
        passes = ", ".join(f"{name} {seconds:.2f}" for name, seconds in split["passes"].items())
        print(f"  first step's compile (s): {phases}; our passes: {passes or 'none'}", flush=True)
