"""One provider's run of ``bench train``, in its own process: build the model as the provider says,
train warm-up, timed and profiled steps, and measure them."""

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from inductor_ext.bench import fsdp, packing
from inductor_ext.bench.compile_split import compile_split, timer_seconds
from inductor_ext.bench.harness import ClockSampler, gpu_timeline, kernel_us_by_class
from inductor_ext.bench.train.model import MODELS, add_lora, apply_liger, build_model, config_for, enable_checkpointing
from inductor_ext.bench.train.providers import Provider, checkpoint_context

LEARNING_RATE = 1e-4


class PhasePeaks:
    """Peak GiB allocated in each phase of the steps taken while ``recording``: ``"forward"``,
    ``"backward"``, ``"optimizer"`` (the step and ``zero_grad``). The caching allocator's own peak, reset
    at each phase's start; its bookkeeping is the host's, in program order, so no sync is needed."""

    def __init__(self) -> None:
        self.recording = False
        self.gib: dict[str, float] = {}

    def begin(self) -> None:
        if self.recording:
            torch.cuda.reset_peak_memory_stats()

    def end(self, phase: str) -> None:
        if self.recording:
            self.gib[phase] = max(self.gib.get(phase, 0.0), torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()


def make_step(
    model: torch.nn.Module, provider: Provider, attention_mask: str, phases: PhasePeaks | None = None
) -> Callable[[torch.Tensor | packing.Batch], torch.Tensor]:
    """One optimizer step of ``provider`` on a batch of token ids (labels = ids, HF shifts them) or on a
    :class:`~inductor_ext.bench.packing.Batch`; returns the loss. ``phases``: where the step reports its
    phases' peak memory."""
    phases = phases or PhasePeaks()
    forward: Any = torch.compile(model, **provider.compile_arguments()) if provider.compiled else model
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    if provider.optimizer == "compiled_foreach":
        optimizer = torch.optim.AdamW(trained, lr=LEARNING_RATE, foreach=True)
        optimizer_step = torch.compile(optimizer.step)
    else:
        optimizer = torch.optim.AdamW(trained, lr=LEARNING_RATE, fused=trained[0].is_cuda)
        optimizer_step = optimizer.step
    cudagraphs = provider.mode == "reduce-overhead"

    def step(batch: torch.Tensor | packing.Batch) -> torch.Tensor:
        if cudagraphs:  # the graphs' outputs (the loss, the gradients) are rewritten by the next step's replay
            torch.compiler.cudagraph_mark_step_begin()
        if isinstance(batch, packing.Batch):
            # without a KV cache transformers builds the document mask from position_ids; padded: the same call
            kwargs: dict[str, Any] = {**batch.model_kwargs(), "use_cache": False}
        else:
            kwargs = {"input_ids": batch, "labels": batch}
            if attention_mask == "ones":
                kwargs["attention_mask"] = torch.ones_like(batch)
        phases.begin()
        loss = forward(**kwargs).loss
        phases.end("forward")
        loss.backward()
        phases.end("backward")
        optimizer_step()
        optimizer.zero_grad(set_to_none=True)
        phases.end("optimizer")
        return loss.detach().clone() if cudagraphs else loss.detach()

    return step


def tune_from_config(args: argparse.Namespace) -> float:
    """Fill the tuning database with the standalone tuner from the model's config and the batch shape (no
    model is built or run, as ``python -m inductor_ext.tuning tune --hf-config``); its seconds."""
    from inductor_ext.inductor.options import parse_options
    from inductor_ext.tuning.cli.trace import calls_from_hf_config
    from inductor_ext.tuning.cli.tune import tune_into_database
    from inductor_ext.tuning.database import TuningDatabase

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        config_for(args.model).to_json_file(path)
        calls = calls_from_hf_config(path, args.batch, args.seq, torch.bfloat16, grad=True)
    tune_into_database(calls, TuningDatabase(), torch.device(args.device), parse_options(None)[0])
    return time.perf_counter() - start


def prepare_model(args: argparse.Namespace, provider: Provider, device: str) -> torch.nn.Module:
    """The model ``provider`` trains: built from :data:`MODELS`, its base quantised and adapters added,
    patched, checkpointed as the provider says."""
    if provider.patch == "liger":
        apply_liger(args.model)
    model = build_model(args.model, device, torch.bfloat16)
    if provider.adapter == "qlora":
        from inductor_ext.bench.train import qlora

        qlora.quantize_base(model)
    if provider.adapter != "none":
        model = add_lora(model)  # over a quantised base, PEFT's lora.Linear4bit layers
    if provider.patch == "models.apply":
        from inductor_ext import models

        chunk = {"loss_chunk_size": args.loss_chunk_size} if args.loss_chunk_size is not None else {}
        models.apply(model, **{**chunk, **provider.apply_options})
    if provider.gradient_checkpointing:
        enable_checkpointing(model, checkpoint_context(provider))
    return model


def batches(count: int, batch: int, seq: int, vocab: int, device: str, *, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=generator).to(device) for _ in range(count)]


def training_data(
    args: argparse.Namespace, provider: Provider, count: int, device: str, rank: int = 0
) -> list[list[Any]]:
    """``count`` steps of data, each a list of batches: one token batch or packed batch, or (``padded``)
    the padded batches of one packed batch's documents."""
    vocab = MODELS[args.model]["vocab_size"]
    if provider.data == "tokens":
        return [[ids] for ids in batches(count, args.batch, args.seq, vocab, device, seed=1 + rank)]
    packed = packing.packed_batches(count, args.batch, args.seq, vocab, seed=1)
    if provider.data == "padded":
        return [[b.to(device) for b in packing.padded_batches(p, args.padded_batch)] for p in packed]
    return [[p.to(device)] for p in packed]


def run_provider(args: argparse.Namespace, provider: Provider) -> dict[str, Any] | None:
    """Train ``provider`` for the first, warm-up, timed and profiled steps in this process; its measurements
    (None on the ranks other than 0 of a ``--nproc`` run)."""
    device = args.device
    ranks = fsdp.world_size()
    rank, device = fsdp.init(device) if ranks > 1 else (0, device)
    tune_s = tune_from_config(args) if provider.warm_db else None
    model = prepare_model(args, provider, device)
    if ranks > 1:
        fsdp.shard(model)
    phases = PhasePeaks()
    optimizer_step = make_step(model, provider, args.attention_mask, phases)
    data = training_data(args, provider, args.warmup + 2 * args.steps + 1 + args.profile_steps, device, rank)
    padded = provider.data == "padded"
    on_gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def step(unit: list[Any]) -> list[torch.Tensor]:
        return [optimizer_step(batch) for batch in unit]

    timers, start = timer_seconds(), time.perf_counter()
    losses = step(data[0])
    sync()
    first_step_s = time.perf_counter() - start
    first_step_compile = compile_split(timers)
    timed = data[1 + args.warmup : 1 + args.warmup + args.steps]
    # padded batches come in many shapes and dynamic=True compiles one graph per class of them: warming
    # up on the timed steps themselves compiles all they need before timing
    for unit in timed if padded else data[1 : 1 + args.warmup]:
        losses += step(unit)
    sync()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    step_s = []
    with ClockSampler() as clocks:
        for unit in timed:
            start = time.perf_counter()
            losses += step(unit)
            sync()
            step_s.append(time.perf_counter() - start)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None
    # the same number of steps again, synchronised once at the end: the host may run ahead of the GPU
    unsynced = timed if padded else data[1 + args.warmup + args.steps : 1 + args.warmup + 2 * args.steps]
    start = time.perf_counter()
    for unit in unsynced:
        losses += step(unit)
    sync()
    unsynced_s = (time.perf_counter() - start) / len(unsynced)
    after = 1 + args.warmup + 2 * args.steps
    profiled = timed[: args.profile_steps] if padded else data[after : after + args.profile_steps]
    timeline = None
    if rank == 0 and on_gpu and profiled:
        phases.recording = True  # the profiled steps also record their phases' peak memory
        remaining = iter(profiled)
        timeline = gpu_timeline(lambda: step(next(remaining)), len(profiled))
        phases.recording = False
    else:  # the other ranks take the same steps (their collectives pair with rank 0's), unprofiled; CPU: no kernels
        for unit in profiled:
            step(unit)
    kernels = {} if timeline is None else {name: us / 1e3 for name, us in timeline.kernel_us.items()}
    median_s = statistics.median(step_s)
    categories = kernel_us_by_class(kernels)  # the per-class sum; here in milliseconds
    loss_values = [float(loss) for loss in losses]
    if ranks > 1:
        loss_values = fsdp.mean_over_ranks(loss_values, device)
        peak_gib = fsdp.max_over_ranks(peak_gib, device) if peak_gib is not None else None
        median_s = fsdp.max_over_ranks(median_s, device)
        unsynced_s = fsdp.max_over_ranks(unsynced_s, device)
        fsdp.finish()
    if rank != 0:
        return None
    documents: dict[str, Any] = {}
    if provider.data != "tokens":
        real = sum(batch.real_tokens for unit in timed for batch in unit)
        positions = sum(batch.input_ids.numel() for unit in timed for batch in unit)
        assert real == len(timed) * args.batch * args.seq  # every step: one packed batch's document tokens
        documents = {
            "real_tokens_per_s": args.batch * args.seq / median_s,
            "pad_fraction": 1 - real / positions,
            "optimizer_steps_per_step": sum(len(unit) for unit in timed) / len(timed),
        }
    result = {
        "provider": provider.name,
        "spec": provider.to_json(),
        "ranks": ranks,
        "tokens_per_s": ranks * args.batch * args.seq / median_s,
        "tokens_per_s_per_gpu": args.batch * args.seq / median_s,
        "step_ms_median": 1e3 * median_s,
        # steps timed together, one sync at the end (the sync-per-step figures above are the ones compared)
        "step_ms_unsynced": 1e3 * unsynced_s,
        "tokens_per_s_unsynced": ranks * args.batch * args.seq / unsynced_s,
        "step_ms": [1e3 * s for s in step_s],
        "peak_gib": peak_gib,
        "first_step_s": first_step_s,
        "first_step_compile_s": first_step_compile,  # inductor_ext.bench.compile_split's phases
        "tune_s": tune_s,
        "timed_steps_gpu": clocks.mean,  # mean SM clock and power: compute-bound kernels slow with the clock
        "losses": loss_values,
        "gpu_ms_by_category": categories,
        "gpu_ms_total": sum(categories.values()),
        "kernels_ms": {name: ms for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1]) if ms >= 0.01},
        # the GPU's time a profiled step: busy, idle in launch gaps of up to 5 us and in longer host waits
        **(
            {}
            if timeline is None
            else {
                "gpu_busy_ms": timeline.busy_us / 1e3,
                "gpu_idle_ms": {"launch_gaps": timeline.launch_gap_us / 1e3, "host_waits": timeline.host_wait_us / 1e3},
            }
        ),
        **({"peak_gib_by_phase": phases.gib} if phases.gib else {}),
        # Dynamo's graph breaks over the whole run, by reason (none for eager providers)
        "graph_breaks": {str(reason): count for reason, count in counters["graph_break"].items()},
        **documents,
    }
    if documents:  # every position the model ran, padding included
        result["tokens_per_s"] = result["tokens_per_s_per_gpu"] = documents["real_tokens_per_s"] / (
            1 - documents["pad_fraction"]
        )
    return result
