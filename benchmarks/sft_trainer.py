"""``python -m benchmarks sft_trainer [--model llama-3.2-1b] [--seq 8192] [--steps 20] [--warmup 5]
[--providers ...] [--lora | --qlora] [--out DIR]``: training through TRL's ``SFTTrainer`` on packed,
padding-free rows, with each way of making its step faster, side by side.

The model is built from a config in ``inductor_ext.bench.train.MODELS`` (random init, no download; bf16
weights and TRL's bf16 autocast on CUDA, float32 on CPU but for a QLoRA base), optionally with PEFT LoRA
adapters (``--lora``) or adapters over a bitsandbytes NF4 base (``--qlora``), both as ``bench train`` builds
them. The corpus is fixed and pre-tokenized: document lengths drawn by ``inductor_ext.bench.packing``
(seeded lognormal, median 300 tokens, clipped to ``[16, --seq]``), token ids drawn uniformly from the
model's vocabulary (its last two ids are the tokenizer's padding and end-of-sequence tokens, never drawn).
TRL packs it (best-fit decreasing) into rows of at most ``--seq`` tokens, one row per step, flattened
padding-free with ``position_ids`` that restart at each document. Everything else is TRL's default
(gradient checkpointing on, AdamW, a linear learning-rate decay), except that every step is logged. Rows
differ in length, so the compiled providers compile a second graph, with dynamic shapes, at the second
step (keep it inside ``--warmup``); ``--pad-to-multiple-of`` equal to ``--seq`` pads every row to one shape
instead.

Providers (``--providers``, default all), each in its own fresh process with empty compile caches (a patch
or a compiled graph never leaks into the next):

- ``trl``: ``SFTTrainer`` as it comes;
- ``trl_compile``: ``SFTConfig(torch_compile=True)``, the whole model compiled by the trainer (Inductor);
- ``trl_liger``: ``SFTConfig(use_liger_kernel=True)``, Liger-Kernel's layer kernels (needs the
  ``liger_kernel`` package; the run stops before it starts if it is not importable);
- ``fastops``: the spelling of the README and ``examples/sft_trainer.py``: ``inductor_ext.models.apply(model)``
  and ``model.get_decoder().compile(backend="fastops_inductor")``;
- ``fastops_stock_inductor``: the same spelling with ``backend="inductor"``, the control.

Each step is timed by a ``TrainerCallback`` from ``on_step_begin`` to ``on_step_end``, the device
synchronised at both ends (forward, backward, gradient clipping, optimizer and scheduler step; not the
fetching of the next batch before it nor the logging after it). Tokens/s is the median, over the steps
after ``--warmup``, of the step's non-pad tokens over its seconds (:class:`CountingCollator` says how they
are counted). Also per provider: the peak memory allocated over those steps, the first step's seconds
(its compile included), every step's loss from the trainer's log history, and Dynamo's graph breaks and
graphs (with PEFT and gradient checkpointing, transformers' input-gradient hook breaks the compiled
decoder's graph after the embeddings: docs/trainers.md). Writes
``sft_trainer_<model>[_<N>layers][_lora|_qlora].json`` under ``--out`` (``_<N>layers`` with ``--layers``) and
prints a table with each provider's speed as a ratio to ``trl_compile``'s and ``trl_liger``'s.

``--device cpu`` is a smoke run (e.g. ``--model tiny-llama``), its timings meaningless.
"""

import argparse
import importlib
import importlib.util
import itertools
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from inductor_ext.bench import packing
from inductor_ext.bench.harness import fresh_cache_env, package_version, print_child_result, run_child
from inductor_ext.bench.train import MODELS, build_model
from inductor_ext.bench.train.model import add_lora

PROVIDERS = {
    "trl": "SFTTrainer as it comes",
    "trl_compile": "SFTConfig(torch_compile=True): the whole model compiled by the trainer (Inductor)",
    "trl_liger": "SFTConfig(use_liger_kernel=True): Liger-Kernel's layer kernels",
    "fastops": 'models.apply(model); model.get_decoder().compile(backend="fastops_inductor")',
    "fastops_stock_inductor": 'models.apply(model); model.get_decoder().compile(backend="inductor")',
}
"""The providers, in the order they run."""
REQUIRED_PACKAGES = {"trl_liger": "liger_kernel"}
"""The package a provider needs beyond the ``train`` extra (pip install liger-kernel)."""
BASELINES = ("trl_compile", "trl_liger")
"""The providers every speed is compared with in the summary."""
CORPUS_SEED = 0
"""Seed of the document lengths and token ids (the same corpus for every provider)."""
SPECIAL_TOKENS = ("<pad>", "<eos>")
"""The tokenizer's padding and end-of-sequence tokens: the vocabulary's last two ids."""
ROOT = Path(__file__).resolve().parent.parent


def corpus(vocab: int, seq: int, tokens: int, *, seed: int = CORPUS_SEED) -> Any:
    """A ``datasets.Dataset`` of pre-tokenized documents (an ``input_ids`` column) of ``tokens`` tokens at
    least: lengths from :func:`inductor_ext.bench.packing.document_lengths` (lognormal, median
    :data:`~inductor_ext.bench.packing.DOC_LENGTH_MEDIAN`, clipped to ``[DOC_LENGTH_MIN, seq]``), ids uniform
    below ``vocab`` minus the special tokens."""
    import datasets

    lengths = packing.document_lengths(seq, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    documents: list[list[int]] = []
    total = 0
    while total < tokens:
        length = next(lengths)
        documents.append(torch.randint(0, vocab - len(SPECIAL_TOKENS), (length,), generator=generator).tolist())
        total += length
    return datasets.Dataset.from_dict({"input_ids": documents})


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over ``vocab`` ids (``t0`` ... then :data:`SPECIAL_TOKENS`): ``SFTTrainer`` needs
    one for its padding token, and a model built from a config has none (the corpus is tokenized already)."""
    import tokenizers
    import transformers

    words = {f"t{i}": i for i in range(vocab - len(SPECIAL_TOKENS))}
    words |= {token: vocab - len(SPECIAL_TOKENS) + i for i, token in enumerate(SPECIAL_TOKENS)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token=SPECIAL_TOKENS[0]))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, pad_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1]
    )


class CountingCollator:
    """The trainer's data collator, wrapped to count each batch's tokens as it builds it: the non-pad tokens
    (the examples' lengths, counted before the collator pads) and the positions (the batch's ``input_ids``).

    Counting in the collator is exact where reading the batch would not be: a padding-free row has no
    attention mask, and telling its padding (``--pad-to-multiple-of``) by the padding token's id is right only
    while no document holds that id. It adds nothing to the step on the device (no ``.item()``, no sync),
    where the trainer's own ``include_num_input_tokens_seen`` reads a device tensor back in every step.

    Batches map to steps by order: the dataloader (``dataloader_num_workers=0``: the collator runs in this
    process) builds the batches in the order the trainer trains them, one batch per optimizer step
    (``gradient_accumulation_steps=1``), so step ``i`` trained batch ``i``, however far ahead the dataloader
    fetches. ``run_provider`` checks the mapping against the running total of positions TRL logs (its
    ``num_tokens``, counted from the batches it trains). ``SFTTrainer`` refuses a custom collator with
    ``padding_free``, so the wrapper replaces the trainer's ``data_collator`` after the trainer is built, before
    ``train()`` builds the dataloader."""

    def __init__(self, collate: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
        self.collate = collate
        self.real_tokens: list[int] = []
        self.positions: list[int] = []

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collate(examples)
        self.real_tokens.append(sum(len(example["input_ids"]) for example in examples))
        self.positions.append(batch["input_ids"].numel())
        return batch


def step_timer(warmup: int, on_gpu: bool) -> Any:
    """A ``TrainerCallback`` that times each optimizer step (see the module's docstring) into ``seconds`` and,
    on the GPU, keeps the peak memory allocated since the first step after ``warmup`` in ``peak_bytes``."""
    import transformers

    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    class StepTimer(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.peak_bytes: int | None = None
            self._start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync()
            if on_gpu and state.global_step == warmup:  # the first timed step
                torch.cuda.reset_peak_memory_stats()
            self._start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            sync()
            self.seconds.append(time.perf_counter() - self._start)
            if on_gpu and state.global_step > warmup:  # the allocator's bookkeeping is the host's: no sync
                self.peak_bytes = torch.cuda.max_memory_allocated()

    return StepTimer()


def adapter(args: argparse.Namespace) -> str:
    return "qlora" if args.qlora else "lora" if args.lora else "none"


def prepare_model(args: argparse.Namespace, provider: str) -> torch.nn.Module:
    """The model ``provider`` trains: built from ``MODELS``, its base quantised to NF4 and adapters added as
    ``bench train`` does (:mod:`inductor_ext.bench.train.qlora`, ``add_lora``), and for the ``fastops``
    providers patched and its decoder compiled in place."""
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    # TRL casts a 4-bit model's adapters to bf16: the base computes in bf16 too (docs/trainers.md), on CPU also
    dtype = torch.bfloat16 if args.device == "cuda" or args.qlora else torch.float32
    model = build_model(args.model, args.device, dtype, **overrides)
    if args.qlora:
        from inductor_ext.bench.train import qlora

        qlora.quantize_base(model)
    if args.qlora or args.lora:
        model = add_lora(model)
    if provider.startswith("fastops"):
        from inductor_ext import models

        models.apply(model)
        backend = "fastops_inductor" if provider == "fastops" else "inductor"
        model.get_decoder().compile(backend=backend)  # type: ignore[operator]
    return model


def sft_config(args: argparse.Namespace, provider: str, output_dir: str) -> Any:
    """The trainer's settings: the same for every provider but for ``torch_compile`` and ``use_liger_kernel``."""
    import trl

    on_gpu = args.device == "cuda"
    return trl.SFTConfig(
        output_dir,
        packing=True,
        padding_free=True,
        max_length=args.seq,
        pad_to_multiple_of=args.pad_to_multiple_of,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,  # one batch per step: CountingCollator's batches are the steps'
        dataloader_num_workers=0,  # the collator runs in this process
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        bf16=on_gpu,  # TRL's default is bf16 autocast on CPU too
        use_cpu=not on_gpu,
        gradient_checkpointing=not args.no_gradient_checkpointing,
        torch_compile=provider == "trl_compile",
        use_liger_kernel=provider == "trl_liger",
    )


def run_provider(args: argparse.Namespace, provider: str) -> dict[str, Any]:
    """Train ``provider`` for ``--steps`` steps in this process; its measurements."""
    import datasets
    import trl
    from torch._dynamo.utils import counters

    datasets.disable_progress_bars()
    if (package := REQUIRED_PACKAGES.get(provider)) is not None:
        importlib.import_module(package)  # fails here, naming the package, rather than inside the trainer
    vocab = MODELS[args.model]["vocab_size"]
    on_gpu = args.device == "cuda"
    model = prepare_model(args, provider)
    dataset = corpus(vocab, args.seq, 2 * (args.steps + 1) * args.seq)  # rows to spare: few partly filled
    timer = step_timer(args.warmup, on_gpu)
    with tempfile.TemporaryDirectory(prefix="sft_trainer_") as output_dir:
        trainer = trl.SFTTrainer(
            model=model,
            args=sft_config(args, provider, output_dir),
            train_dataset=dataset,
            processing_class=tokenizer(vocab),
            callbacks=[timer],
        )
        counting = trainer.data_collator = CountingCollator(trainer.data_collator)
        counters.clear()
        trainer.train()
    history = trainer.state.log_history
    losses = [entry["loss"] for entry in history if "loss" in entry]
    step_s = timer.seconds
    assert len(step_s) == len(losses) == args.steps, (len(step_s), len(losses), args.steps)
    real, positions = counting.real_tokens[: args.steps], counting.positions[: args.steps]
    # TRL logs the positions it trained so far: the batches counted are the ones the steps trained
    trained = [entry["num_tokens"] for entry in history if "num_tokens" in entry]
    assert not trained or trained == list(itertools.accumulate(positions)), (trained, positions)
    timed = range(args.warmup, args.steps)
    return {
        "provider": provider,
        "tokens_per_s": statistics.median(real[i] / step_s[i] for i in timed),
        "step_ms_median": 1e3 * statistics.median(step_s[i] for i in timed),
        "peak_gib": timer.peak_bytes / 2**30 if timer.peak_bytes is not None else None,
        "first_step_s": step_s[0],
        "losses": losses,
        "step_ms": [1e3 * s for s in step_s],
        "tokens_per_step": real,
        "positions_per_step": positions,
        "pad_fraction": 1 - sum(real[i] for i in timed) / sum(positions[i] for i in timed),
        "graph_breaks": {str(reason): count for reason, count in counters["graph_break"].items()},
        "graphs": counters["stats"]["unique_graphs"],
    }


def summarize(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per provider: tokens/s and its ratio to each of :data:`BASELINES` (None where the baseline did
    not run), peak memory, first step, the first and last losses."""
    rows = []
    for name, r in results.items():
        row: dict[str, Any] = {"provider": name, "tokens/s": round(r["tokens_per_s"])}
        for baseline in BASELINES:
            base = results.get(baseline)
            row[f"x {baseline}"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base else None
        row.update({
            "step ms": round(r["step_ms_median"], 1),
            "peak GiB": round(r["peak_gib"], 2) if r["peak_gib"] is not None else None,
            "first step s": round(r["first_step_s"], 1),
            "first loss": round(r["losses"][0], 4),
            "final loss": round(r["losses"][-1], 4),
            "pad %": round(100 * r["pad_fraction"], 1),
            "graph breaks": sum(r["graph_breaks"].values()),
        })  # fmt: skip
        rows.append(row)
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks sft_trainer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3.2-1b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    p.add_argument("--seq", type=int, default=8192, help="SFTConfig's max_length: tokens per packed row and step")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps in all (SFTConfig's max_steps)")
    p.add_argument("--warmup", type=int, default=5, help="the first steps, not timed (the compile among them)")
    p.add_argument("--providers", nargs="+", choices=list(PROVIDERS), default=list(PROVIDERS), metavar="PROVIDER",
                   help=f"any of {' '.join(PROVIDERS)} (default: all)")  # fmt: skip
    group = p.add_mutually_exclusive_group()
    group.add_argument("--lora", action="store_true", help="train PEFT LoRA adapters (rank 16, every linear layer)")
    group.add_argument("--qlora", action="store_true", help="the same adapters over an NF4 base (bitsandbytes)")
    p.add_argument("--no-gradient-checkpointing", action="store_true", help="turn off TRL's default checkpointing")
    p.add_argument("--pad-to-multiple-of", type=int, default=None,
                   help="SFTConfig's: pad each row to a multiple of this (--seq: one shape, one compile); default "
                        "none (TRL's): each row its own length, compiled with dynamic shapes from the second row")  # fmt: skip
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (the benchmark), or cpu: a smoke run (e.g. --model tiny-llama), timings meaningless")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for the JSON")
    p.add_argument("--worker", choices=list(PROVIDERS), help=argparse.SUPPRESS)  # run one provider in this process
    return p


def check(args: argparse.Namespace) -> str | None:
    """A usage error, or None."""
    if min(args.seq, args.warmup) < 1 or args.steps <= args.warmup:
        return "--seq and --warmup must be >= 1 and --steps greater than --warmup (the timed steps come after it)"
    if (args.layers is not None and args.layers < 1) or (args.pad_to_multiple_of or 1) < 1:
        return "--layers and --pad-to-multiple-of must be >= 1"
    if args.seq < packing.DOC_LENGTH_MIN:
        return f"--seq must hold the shortest document ({packing.DOC_LENGTH_MIN} tokens)"
    for provider in args.providers:
        package = REQUIRED_PACKAGES.get(provider)
        if package is not None and importlib.util.find_spec(package) is None:
            return (f"{provider} needs the {package} package, which is not importable here (pip install "
                    f"{package.replace('_', '-')}); leave {provider} out of --providers to run the others")  # fmt: skip
    if args.device == "cuda" and not torch.cuda.is_available():
        return "this benchmark needs a CUDA GPU (--device cpu runs it as a smoke test, its timings meaningless)"
    return None


def stem(args: argparse.Namespace) -> str:
    """The JSON's name: the model and its adapters (and the layers when ``--layers`` changes them)."""
    layers = f"_{args.layers}layers" if args.layers is not None else ""
    return f"sft_trainer_{args.model}{layers}" + ("" if adapter(args) == "none" else f"_{adapter(args)}")


def worker_command(argv: list[str], provider: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks", "sft_trainer", *argv, "--worker", provider]


def metadata(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    packages = ["torch", "trl", "transformers", "datasets", "accelerate", "inductor-ext"]
    packages += ["peft"] * (args.lora or args.qlora) + ["bitsandbytes"] * args.qlora
    packages += ["liger-kernel"] * ("trl_liger" in args.providers)
    return {
        "command": shlex.join(["python", "-m", "benchmarks", "sft_trainer", *argv]),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "versions": {package: package_version(package) for package in packages},
        "model": args.model,
        "layers": args.layers if args.layers is not None else MODELS[args.model].get("num_hidden_layers"),
        "adapter": adapter(args),
        "dtype": "bfloat16" if args.device == "cuda" or args.qlora else "float32",
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "gradient_checkpointing": not args.no_gradient_checkpointing,
        "pad_to_multiple_of": args.pad_to_multiple_of,
        "corpus": {
            "doc_length_median": packing.DOC_LENGTH_MEDIAN,
            "doc_length_sigma": packing.DOC_LENGTH_SIGMA,
            "doc_length_min": packing.DOC_LENGTH_MIN,
            "seed": CORPUS_SEED,
        },
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    if (error := check(args)) is not None:
        p.error(error)
    if args.worker:
        print_child_result(run_provider(args, args.worker))
        return 0
    from tabulate import tabulate

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{stem(args)}.json"
    meta = metadata(args, argv)
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    # a child imports this repository's benchmarks package from wherever the command was run
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # our kernels' eager launches on CPU tensors
    for provider in args.providers:
        print(f"{provider} ...", end=" ", flush=True)
        try:
            with tempfile.TemporaryDirectory(prefix=f"sft_trainer_{provider}_") as scratch:
                results[provider] = result = run_child(worker_command(argv, provider),
                                                       {**env, **fresh_cache_env(scratch, scratch)})  # fmt: skip
        except RuntimeError as failure:
            failed[provider] = str(failure)
            print(f"failed:\n{failure}", flush=True)
        else:
            peak = f", {result['peak_gib']:.2f} GiB" if result["peak_gib"] is not None else ""
            print(f"{result['tokens_per_s']:,.0f} tokens/s{peak}, first step {result['first_step_s']:.1f} s, "
                  f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}", flush=True)  # fmt: skip
        # written after every provider: a run stopped early keeps what it measured
        report = {"meta": meta, "results": results, "summary": summarize(results), "failed": failed}
        path.write_text(json.dumps(report, indent=1))
    print(tabulate(summarize(results), headers="keys"))
    for provider in failed:
        print(f"{provider}: failed (its output is above)")
    return 1 if failed else 0
