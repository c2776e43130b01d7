"""``python -m inductor_ext.bench train [--model llama-3.2-1b] [--batch 4] [--seq 2048] [--steps 10]
[--providers ...] [--attention-mask none|ones] [--out DIR]``: a training step of a real HF
transformers model, side by side.

The model is built from a config in :data:`MODELS` (no download: random init, bf16 weights,
fused AdamW), and each provider trains it in its own fresh process (no compiled code, patched
class or allocator state carried over), on the same seeded weights and token batches. Per
provider: tokens/s (median over ``--steps`` timed steps after warm-up, wall clock), peak
memory over those steps, the first step's seconds (compile included), the final loss next
to ``hf_eager``'s, and one profiled step's GPU time per kernel category (GEMMs, attention,
optimizer, everything else) with the largest "everything else" kernels, and the GPU's busy and idle
time a step (idle in launch gaps of up to 5 us and in longer waits for the host) and each phase's peak
memory (forward, backward, optimizer) over the profiled steps. Writes
``train_<model>_<batch>x<seq>[_mask].json`` and a ``.png`` under ``--out`` and prints a table.
``--rounds N`` runs every provider N times, the order reversed each round, and pools the timed steps
(:func:`pool_rounds`): the H200 slows as it heats over a run (the same provider's timed steps ran at
1794 MHz first in one invocation and 1595 MHz second in another), so with one round the providers run
later are timed at a lower clock; reversing the order puts each provider early once and late once.
``--kernel-table`` adds a profiled step that gives each kernel Inductor launches its bytes, GB/s
and percent of the measured copy bandwidth (:mod:`inductor_ext.bench.kernel_table`), printed per
provider as a GitHub table and stored as ``kernel_table`` in the JSON.

``--cpp-wrapper`` runs the backend with Inductor's C++ wrapper (``options={"cpp_wrapper": True}``)
beside the Python wrapper, each with an empty tuning database and with one the standalone tuner
filled from the model's config first (``_warm_db``; the tuning's seconds are reported apart, as
``tune_s``): the step's host time (wall minus GPU time) and the first step's compile time.

``--lora`` fine-tunes PEFT LoRA adapters instead of the whole model (:data:`LORA_PROVIDERS`):
rank 16 on every linear layer of the decoder (q, k, v, o, gate, up, down), alpha 32 (scaling 2),
dropout 0.05, base weights frozen in bf16; ``get_peft_model``'s default
``autocast_adapter_dtype=True`` keeps the adapters in float32 over the bf16 base, and only the
adapters go to the optimizer. PEFT's unfused layers eager, under ``torch.compile`` and under
``fastops_inductor``, against the same model with :func:`inductor_ext.models.apply` (the fused LoRA
ops, and our norms, RoPE and loss) eager and under ``fastops_inductor``.

``--qlora`` fine-tunes the same adapters over a 4-bit base (:data:`QLORA_PROVIDERS`; ``--providers``
picks among them): every decoder linear layer the adapters target becomes a bitsandbytes NF4
``Linear4bit`` (double quantisation, blocks of 64, computing in bf16; :func:`inductor_ext.bench.qlora.quantize_base`,
on the GPU after the bf16 model is built), the LM head, embeddings and norms stay bf16, and PEFT wraps
each quantised layer as its ``lora.Linear4bit``. PEFT eager and under ``torch.compile``, against the PEFT
model patched by :func:`inductor_ext.models.apply`, eager and under ``fastops_inductor``. Speeds compare
with ``qlora_peft_torch_compile``'s and ``qlora_peft_eager``'s, losses with ``qlora_peft_eager``'s; the
output files end in ``_qlora``.

``--gradient-checkpointing`` recomputes each decoder layer's activations in the backward (transformers'
``activation_checkpointing_enable``, non-reentrant ``torch.utils.checkpoint``), for any provider; the
output files end in ``_gc``.

``--nproc N`` runs each provider on N GPUs of this host (:mod:`inductor_ext.bench.fsdp`): FSDP2
per decoder layer, ``--batch`` sequences per rank, tokens/s summed over the ranks and reported per
GPU too; the loss is the ranks' mean.

``--loss-chunk-size N`` sets the rows per chunk of the patched models' fused loss
(``models.apply(loss_chunk_size=N)``; the output files end in ``_loss_chunkN``): the trade between
the loss's memory and its weight-gradient passes.

``--packed`` trains on seeded SFT-like documents (:mod:`inductor_ext.bench.packing`: lognormal lengths,
median 300 tokens, sigma 0.75, clamped to ``[16, --seq]``) instead of full rows (:data:`PACKED_PROVIDERS`;
``--providers`` picks among them). ``*_packed`` providers train padding-free: each step is ``--batch`` rows of
``--seq`` tokens, documents packed greedily in order, with ``position_ids`` restarting at 0 at each document
and the first label of each document -100 (as ``DataCollatorWithFlattening`` builds them), called with
``use_cache=False`` (transformers builds its document mask from ``position_ids`` only when no KV cache
exists; with the default cache, packed documents attend to each other). ``*_padded`` providers train the
baseline on the same documents: a step's documents, ``--padded-batch`` (default 8) at a time, right-padded to
the longest of each group rounded up to a multiple of 8, with an ``attention_mask`` (``torch.compile(dynamic=True)``:
the length changes from batch to batch; their warm-up and profiled steps are the timed steps, so every graph
the timed steps need is compiled before timing and none compiles while profiling). A step of either covers the same ``--batch`` x ``--seq`` document tokens, so
``real_tokens_per_s`` (non-pad tokens over the median step time) compares them; ``tokens_per_s`` counts the
padding positions too, ``pad_fraction`` is their share. Losses compare with ``hf_eager_packed``'s
(``hf_eager_padded``'s for the padded providers); speeds with ``torch_compile_packed``'s real tokens/s.
Writes ``train_<model>_<batch>x<seq>_packed.json`` (and ``.png``).

``--attention-mask ones`` passes an ``attention_mask`` of ones, as HF's data collators do:
the mask then depends on a user tensor, which the backend's causal-mask rewrite cannot
prove causal unless ``fastops.assume_no_padding`` is set (provider
``fastops_inductor_no_padding``).
"""

import argparse
import contextlib
import importlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from inductor_ext import guards
from inductor_ext.bench import fsdp, packing
from inductor_ext.bench.harness import (
    ClockSampler,
    copy_bandwidth_gbps,
    fresh_cache_env,
    gpu_timeline,
    kernel_class,
    kernel_us_by_class,
    print_child_result,
    run_child,
)
from inductor_ext.bench.kernel_table import kernel_rows, markdown, profile_launches

MODELS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
                         "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True},
    "qwen3-0.6b": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                       "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True},
    "mistral-7b-4l": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4,
                          "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32768, "rms_norm_eps": 1e-5,
                          "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": None},
    "llama-3.1-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
                         "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False},
    "tiny-llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256},
    "tiny-qwen3": {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 256,
                       "tie_word_embeddings": True, "max_position_embeddings": 512},
}  # fmt: skip
"""Model shapes by name: a transformers config's fields (``model_type`` picks the class). The real
models' shapes (Llama-3.2-1B, Qwen3-0.6B, Mistral-7B's first 4 layers, Llama-3.1-8B) and tiny ones for
CPU tests (a Qwen3 with per-head q/k norms and a head_dim that is not hidden / heads)."""

PROVIDERS: dict[str, dict[str, Any] | None] = {
    "hf_eager": None,
    "torch_compile": {},
    "fastops_inductor": {"backend": "fastops_inductor"},
    "fastops_inductor_kernel": {"backend": "fastops_inductor", "options": {"fastops.route": "kernel"}},
    "fastops_inductor_no_causal_rewrite": {"backend": "fastops_inductor", "options": {"fastops.causal_mask": False}},
    "fastops_inductor_no_padding": {"backend": "fastops_inductor", "options": {"fastops.assume_no_padding": True}},
    "fastops_inductor_no_module_guards": {"backend": "fastops_inductor",
                                          "options": {"guard_filter_fn": "skip_guard_on_all_nn_modules_unsafe"}},
    "fastops_inductor_no_parameter_guards": {"backend": "fastops_inductor",
                                             "options": {"guard_filter_fn": "skip_parameter_guards"}},
    "torch_compile_cudagraphs": {"mode": "reduce-overhead"},
    "fastops_inductor_save_norms": {"backend": "fastops_inductor", "options": {"fastops.recompute_norms": False}},
    "fastops_inductor_zero_output_grads": {"backend": "fastops_inductor",
                                           "options": {"fastops.lazy_linear_outputs": False}},
    "fastops_inductor_fused_projections": {"backend": "fastops_inductor",
                                           "options": {"fastops.fuse_projections": True}},
    "fastops_inductor_separate_products": {"backend": "fastops_inductor",
                                           "options": {"fastops.accumulate_products": False}},
    "fastops_inductor_cudagraphs": {"backend": "fastops_inductor", "mode": "reduce-overhead"},
    "fastops_inductor_compiled_adamw": {"backend": "fastops_inductor"},
    "liger_eager": None,
    "patched_eager": None,
    "patched_fastops_inductor": {"backend": "fastops_inductor"},
    "patched_fastops_inductor_no_module_guards": {"backend": "fastops_inductor",
                                                  "options": {"guard_filter_fn": "skip_guard_on_all_nn_modules_unsafe"}},
    "patched_fastops_inductor_no_parameter_guards": {"backend": "fastops_inductor",
                                                     "options": {"guard_filter_fn": "skip_parameter_guards"}},
    "patched_fastops_inductor_save_norms": {"backend": "fastops_inductor", "options": {"fastops.recompute_norms": False}},
    "patched_fastops_inductor_recompute_glu": {"backend": "fastops_inductor", "options": {"fastops.recompute_glu": True}},
    "patched_eager_save_norms": None,
    "patched_eager_recompute_glu": None,
    "patched_eager_weight_dtype": None,
    "patched_fastops_inductor_weight_dtype": {"backend": "fastops_inductor"},
    "patched_fastops_inductor_cpp_wrapper": {"backend": "fastops_inductor", "options": {"cpp_wrapper": True}},
    "patched_fastops_inductor_weight_dtype_cpp_wrapper": {"backend": "fastops_inductor", "options": {"cpp_wrapper": True}},
    "fastops_inductor_cpp_wrapper": {"backend": "fastops_inductor", "options": {"cpp_wrapper": True}},
    "fastops_inductor_warm_db": {"backend": "fastops_inductor"},
    "fastops_inductor_cpp_wrapper_warm_db": {"backend": "fastops_inductor", "options": {"cpp_wrapper": True}},
    "peft_eager": None,
    "peft_torch_compile": {},
    "peft_fastops_inductor": {"backend": "fastops_inductor"},
    "lora_fused_eager": None,
    "lora_fused_fastops_inductor": {"backend": "fastops_inductor"},
    "lora_fused_fastops_inductor_input_dtype": {"backend": "fastops_inductor"},
    "hf_eager_padded": None,
    "fastops_inductor_padded": {"backend": "fastops_inductor", "dynamic": True},
    "hf_eager_packed": None,
    "torch_compile_packed": {},
    "fastops_inductor_packed": {"backend": "fastops_inductor"},
    "patched_fastops_inductor_packed": {"backend": "fastops_inductor"},
    "patched_eager_packed": None,
    "liger_packed": None,
    "qlora_peft_eager": None,
    "qlora_peft_torch_compile": {},
    "qlora_fused_eager": None,
    "qlora_fused_fastops_inductor": {"backend": "fastops_inductor"},
    "qlora_fused_fastops_inductor_input_dtype": {"backend": "fastops_inductor"},
    "qlora_fused_fastops_inductor_keep_mlp": {"backend": "fastops_inductor"},
    "qlora_fused_fastops_inductor_keep_lora": {"backend": "fastops_inductor"},
}  # fmt: skip
"""Provider -> ``torch.compile`` arguments (None: eager). ``liger_eager`` is HF with Liger-Kernel's
patch for the model family (only where ``liger_kernel`` is importable); ``patched_*`` run the model
patched by :func:`inductor_ext.models.apply` (our norms, MLPs, RoPE and fused linear cross-entropy loss;
``_weight_dtype``: its LM-head gradient accumulated in the weight's dtype, the lower-memory mode);
``_cpp_wrapper``: Inductor's C++ wrapper (for the patched model too); ``_warm_db``: the standalone
tuner fills the tuning database from the model's config before the model is built; ``peft_*`` and
``lora_fused_*`` train LoRA adapters (``--lora``), ``lora_fused_*`` on the PEFT model patched by
:func:`inductor_ext.models.apply`; ``qlora_*`` train the same adapters over the NF4-quantised base
(``--qlora``, :mod:`inductor_ext.bench.qlora`), ``qlora_peft_*`` with PEFT's ``lora.Linear4bit`` layers,
``qlora_fused_*`` on that PEFT model patched by :func:`inductor_ext.models.apply` (``*_input_dtype``: with
``lora_dtype="input"``, the float32 adapters' low-rank GEMMs in bf16; ``*_keep_mlp``: under
``--gradient-checkpointing``, the fused MLP's outputs kept rather than recomputed,
:func:`inductor_ext.models.keep_lora_mlp_outputs`; ``*_keep_lora``: the fused MLP's and QKV's,
:func:`inductor_ext.models.keep_lora_outputs`); ``*_packed`` and
``*_padded`` train on documents (``--packed``), packed with ``position_ids`` or right-padded with an
``attention_mask`` (compiled with ``dynamic=True``); ``*_no_module_guards`` compile with
``options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}`` (a ``guard_filter_fn``
option names a function of ``torch.compiler`` or :mod:`inductor_ext.guards`): Dynamo stops checking the
modules' attributes and parameters before each call, which is safe only while none is reassigned and
``train()``/``eval()`` is not switched after the first call (such a change is not seen: no
recompilation); ``*_no_parameter_guards`` with :func:`inductor_ext.guards.skip_parameter_guards`, which
drops only the parameters' guards (what that trades: :mod:`inductor_ext.guards`); ``*_cudagraphs`` compile
with ``mode="reduce-overhead"``: the forward and the backward replayed as CUDA graphs (cudagraph trees;
each step begins with ``torch.compiler.cudagraph_mark_step_begin()``); ``*_compiled_adamw`` step a
``foreach`` AdamW compiled by ``torch.compile`` (Inductor's horizontally fused kernels) instead of the
fused AdamW (one ``multi_tensor_apply`` kernel per group of tensors); ``*_save_norms`` compile with
``fastops.recompute_norms`` off (``patched_eager_save_norms``: ``models.apply(recompute_norms=False)``):
the backward reads the saved norm outputs instead of recomputing them
(:mod:`inductor_ext.inductor.recompute`, :mod:`inductor_ext.models.recompute`); ``*_recompute_glu`` with
``fastops.recompute_glu`` on (``patched_eager_recompute_glu``: ``models.apply(recompute_glu=True)``): the
GLU's output recomputed in the backward too; ``*_zero_output_grads`` with ``fastops.lazy_linear_outputs``
off: the compiled backward takes zeros for the returned, undifferentiated logits
(:mod:`inductor_ext.inductor.lazy_outputs`); ``*_fused_projections`` with ``fastops.fuse_projections``
on: GQA's q/k/v run as one product (:mod:`inductor_ext.inductor.sibling_projections`);
``*_separate_products`` with ``fastops.accumulate_products`` off: the backward's sums of input gradients
computed as separate products and a pointwise sum, not added in the GEMMs' epilogues
(:mod:`inductor_ext.inductor.product_sums`)."""

DEFAULT_PROVIDERS = ("hf_eager", "torch_compile", "fastops_inductor", "liger_eager")
CPP_WRAPPER_PROVIDERS = ("fastops_inductor", "fastops_inductor_cpp_wrapper", "fastops_inductor_warm_db",
                         "fastops_inductor_cpp_wrapper_warm_db")  # fmt: skip
"""What ``--cpp-wrapper`` runs."""
LORA_PROVIDERS = ("peft_eager", "peft_torch_compile", "peft_fastops_inductor", "lora_fused_eager",
                  "lora_fused_fastops_inductor", "lora_fused_fastops_inductor_input_dtype")  # fmt: skip
"""What ``--lora`` runs."""
QLORA_PROVIDERS = ("qlora_peft_eager", "qlora_peft_torch_compile", "qlora_fused_eager", "qlora_fused_fastops_inductor",
                   "qlora_fused_fastops_inductor_input_dtype", "qlora_fused_fastops_inductor_keep_mlp",
                   "qlora_fused_fastops_inductor_keep_lora")  # fmt: skip
"""What ``--qlora`` runs (``--providers`` picks among them; the ``*_keep_*`` ones with ``--gradient-checkpointing``)."""
KEEP_POLICIES = {"_keep_mlp": "keep_lora_mlp_outputs", "_keep_lora": "keep_lora_outputs"}
"""Provider suffix -> the selective checkpointing policy of :mod:`inductor_ext.models` it runs with."""
KEEP_SUFFIXES = tuple(KEEP_POLICIES)
PACKED_PROVIDERS = ("hf_eager_padded", "fastops_inductor_padded", "hf_eager_packed", "torch_compile_packed",
                    "fastops_inductor_packed", "patched_fastops_inductor_packed", "patched_eager_packed",
                    "liger_packed")  # fmt: skip
"""What ``--packed`` runs (``liger_packed`` where ``liger_kernel`` is importable)."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA, LORA_DROPOUT = 16, 32, 0.05
CATEGORIES = tuple(kernel_us_by_class({}))
"""The harness's kernel classes (:func:`inductor_ext.bench.harness.kernel_class`)."""
LEARNING_RATE = 1e-4


def config_for(model: str, **overrides: Any) -> Any:
    """The transformers config of a :data:`MODELS` entry (fields replaced by ``overrides``), with SDPA attention."""
    import transformers

    fields = {**MODELS[model], **overrides}
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    return config


def build_model(model: str, device: str, dtype: torch.dtype, *, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised causal LM of the given shape (config fields replaced by ``overrides``): the
    same weights for the same seed and device."""
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        built = transformers.AutoModelForCausalLM.from_config(config_for(model, **overrides), dtype=dtype)
    return built.train()


def batches(count: int, batch: int, seq: int, vocab: int, device: str, *, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=generator).to(device) for _ in range(count)]


def packed_steps(args: argparse.Namespace, provider: str, count: int, device: str) -> list[list[packing.Batch]]:
    """``count`` steps of ``--packed`` documents: per step its packed batch, or (``*_padded``) the padded
    batches of the same documents."""
    packed = packing.packed_batches(count, args.batch, args.seq, MODELS[args.model]["vocab_size"], seed=1)
    if provider.endswith("_padded"):
        return [[b.to(device) for b in packing.padded_batches(p, args.padded_batch)] for p in packed]
    return [[p.to(device)] for p in packed]


def add_lora(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` wrapped by PEFT with the ``--lora`` adapters (the base frozen, the adapters float32)."""
    import peft

    config = peft.LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT, target_modules=list(LORA_TARGETS)
    )
    return peft.get_peft_model(model, config)  # type: ignore[arg-type]


def _checkpoint_policy(provider: str) -> Callable[[], Any] | None:
    """The selective checkpointing ``context_fn`` a provider asks for (:data:`KEEP_POLICIES`), else None."""
    from inductor_ext import models

    for suffix, policy in KEEP_POLICIES.items():
        if provider.endswith(suffix):
            return getattr(models, policy)()
    return None


def enable_checkpointing(model: torch.nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
    """Non-reentrant activation checkpointing of each decoder layer of ``model`` (a PEFT model's too), set
    up so that ``torch.compile`` traces the step whole, for every provider alike.

    transformers also makes the embeddings' output require grad (``enable_input_require_grads``), which
    a frozen base under reentrant checkpointing needs and non-reentrant checkpointing does not (the
    adapters get their gradients either way): the hook's ``requires_grad_()`` breaks Dynamo's graph, so
    it is removed. ``use_cache`` is turned off, as trainers do under checkpointing: transformers warns on
    every call otherwise, and the warning is a graph break too. ``context_fn``: selective checkpointing's
    (e.g. :func:`inductor_ext.models.keep_lora_mlp_outputs`), passed on to ``torch.utils.checkpoint``."""
    hf_model: Any = model
    if hasattr(hf_model, "get_base_model"):  # PEFT's wrapper
        hf_model = hf_model.get_base_model()
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    if hasattr(hf_model, "activation_checkpointing_enable"):  # gradient_checkpointing_enable: its deprecated alias
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if getattr(hf_model, "_require_grads_hook", None) is not None:
        hf_model.disable_input_require_grads()
    hf_model.config.use_cache = False


def compile_arguments(provider: str) -> dict[str, Any]:
    """``torch.compile``'s keyword arguments for a compiled ``provider`` (a fresh copy: ``torch.compile`` pops
    ``guard_filter_fn`` from its options), with a ``guard_filter_fn`` named in :data:`PROVIDERS` resolved."""
    arguments = dict(PROVIDERS[provider] or {})
    if "options" in arguments:
        options = arguments["options"] = dict(arguments["options"])
        name = options.get("guard_filter_fn")
        if isinstance(name, str):
            options["guard_filter_fn"] = getattr(guards, name, None) or getattr(torch.compiler, name)
    return arguments


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
    model: torch.nn.Module, provider: str, attention_mask: str, phases: PhasePeaks | None = None
) -> Callable[[torch.Tensor | packing.Batch], torch.Tensor]:
    """One optimizer step of ``provider`` on a batch of token ids (labels = ids, HF shifts them) or on a
    ``--packed`` run's :class:`~inductor_ext.bench.packing.Batch`; returns the loss. ``phases``: where the
    step reports its phases' peak memory."""
    phases = phases or PhasePeaks()
    forward: Any = model if PROVIDERS[provider] is None else torch.compile(model, **compile_arguments(provider))
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    if provider.endswith("_compiled_adamw"):
        optimizer = torch.optim.AdamW(trained, lr=LEARNING_RATE, foreach=True)
        optimizer_step = torch.compile(optimizer.step)
    else:
        optimizer = torch.optim.AdamW(trained, lr=LEARNING_RATE, fused=trained[0].is_cuda)
        optimizer_step = optimizer.step

    cudagraphs = (PROVIDERS[provider] or {}).get("mode") == "reduce-overhead"

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
    """Fill the tuning database with the standalone tuner from the model's config and the batch
    shape (no model is built or run, as ``python -m inductor_ext.autotune tune --hf-config``); its seconds."""
    from inductor_ext.autotune.trace import calls_from_hf_config
    from inductor_ext.autotune.tune import tune_into_database
    from inductor_ext.inductor.options import parse_options
    from inductor_ext.tuning.database import TuningDatabase

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.json"
        config_for(args.model).to_json_file(path)
        calls = calls_from_hf_config(path, args.batch, args.seq, torch.bfloat16, grad=True)
    tune_into_database(calls, TuningDatabase(), torch.device(args.device), parse_options(None)[0])
    return time.perf_counter() - start


def apply_liger(model_name: str) -> None:
    """Liger-Kernel's class-level patch for the model family (before the model is built)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    MODEL_TYPE_TO_APPLY_LIGER_FN[MODELS[model_name]["model_type"]]()


def run_provider(args: argparse.Namespace) -> dict[str, Any] | None:
    """Train ``args.worker`` for warm-up + timed + profiled steps in this process; its measurements
    (None on the ranks other than 0 of a ``--nproc`` run)."""
    device, provider = args.device, args.worker
    ranks = fsdp.world_size()
    rank, device = fsdp.init(device) if ranks > 1 else (0, device)
    tune_s = tune_from_config(args) if provider.endswith("_warm_db") else None
    if provider.startswith("liger_"):
        apply_liger(args.model)
    from inductor_ext import models

    model = build_model(args.model, device, torch.bfloat16)
    if provider.startswith("patched_"):
        models.apply(
            model,
            weight_grad_accumulation="weight_dtype" if "_weight_dtype" in provider else "fp32",
            loss_chunk_size=args.loss_chunk_size,
            recompute_norms=not provider.endswith("_save_norms"),
            recompute_glu=provider.endswith("_recompute_glu"),
        )
    if provider in QLORA_PROVIDERS:
        from inductor_ext.bench import qlora  # it reads this module's LORA_TARGETS: imported once this one is

        qlora.quantize_base(model)
    if provider in LORA_PROVIDERS or provider in QLORA_PROVIDERS:
        model = add_lora(model)  # over a quantised base, PEFT's lora.Linear4bit layers
    if provider.startswith(("lora_fused_", "qlora_fused_")):
        models.apply(
            model, loss_chunk_size=args.loss_chunk_size,
            lora_dtype="input" if provider.endswith("_input_dtype") else "adapters",
        )  # fmt: skip
    if args.gradient_checkpointing:
        enable_checkpointing(model, _checkpoint_policy(provider))
    if ranks > 1:
        fsdp.shard(model)
    phases = PhasePeaks()
    optimizer_step = make_step(model, provider, args.attention_mask, phases)
    sized_steps = 1 if args.kernel_table else 0  # --kernel-table: one more step, for the kernels' bytes
    count = args.warmup + 2 * args.steps + 1 + args.profile_steps + sized_steps
    # a step is a list of batches: one, or (``*_padded``) the padded batches of one packed batch's documents
    data: list[list[Any]]
    if provider in PACKED_PROVIDERS:
        data = packed_steps(args, provider, count, device)
    else:
        data = [[ids] for ids in batches(count, args.batch, args.seq, MODELS[args.model]["vocab_size"], device,
                                         seed=1 + rank)]  # fmt: skip
    on_gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def step(unit: list[Any]) -> list[torch.Tensor]:
        return [optimizer_step(batch) for batch in unit]

    start = time.perf_counter()
    losses = step(data[0])
    sync()
    first_step_s = time.perf_counter() - start
    timed = data[1 + args.warmup : 1 + args.warmup + args.steps]
    # padded batches come in many shapes and dynamic=True compiles one graph per class of them (Inductor
    # guards on size thresholds): warming up on the timed steps themselves compiles all they need first
    for unit in timed if provider.endswith("_padded") else data[1 : 1 + args.warmup]:
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
    unsynced = data[1 + args.warmup + args.steps : 1 + args.warmup + 2 * args.steps]
    if provider.endswith("_padded"):
        unsynced = timed  # graphs compiled for these shapes only (see the warm-up)
    start = time.perf_counter()
    for unit in unsynced:
        losses += step(unit)
    sync()
    unsynced_s = (time.perf_counter() - start) / len(unsynced)
    # the padded providers profile steps they already compiled for (a new step could compile new graphs)
    after = 1 + args.warmup + 2 * args.steps
    profiled = timed[: args.profile_steps] if provider.endswith("_padded") else data[after : after + args.profile_steps]
    # --kernel-table: one more step, with the host-side records that give each Inductor kernel's bytes
    sized = (timed if provider.endswith("_padded") else data[after + args.profile_steps :])[:sized_steps]
    timeline = table = None
    if rank == 0 and on_gpu:
        phases.recording = True  # the profiled steps also record their phases' peak memory
        remaining = iter(profiled)
        timeline = gpu_timeline(lambda: step(next(remaining)), len(profiled)) if profiled else None
        phases.recording = False
        if sized and timeline is not None:
            launched = profile_launches(lambda: step(sized[0]))
            table = kernel_rows(timeline, launched, copy_bandwidth_gbps())
    else:  # the other ranks take the same steps (their collectives pair with rank 0's), unprofiled; CPU: no kernels
        for unit in [*profiled, *sized]:
            step(unit)
    kernels = {} if timeline is None else {name: us / 1e3 for name, us in timeline.kernel_us.items()}
    median_s = statistics.median(step_s)
    categories = kernel_us_by_class(kernels)  # the per-class sum; here in ms
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
    if provider in PACKED_PROVIDERS:
        real = sum(batch.real_tokens for unit in timed for batch in unit)
        positions = sum(batch.input_ids.numel() for unit in timed for batch in unit)
        assert real == len(timed) * args.batch * args.seq  # every step: one packed batch's document tokens
        documents = {
            "real_tokens_per_s": args.batch * args.seq / median_s,
            "pad_fraction": 1 - real / positions,
            "optimizer_steps_per_step": sum(len(unit) for unit in timed) / len(timed),
        }
    result = {
        "provider": provider,
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
        "tune_s": tune_s,
        "timed_steps_gpu": clocks.mean,  # mean SM clock and power: compute-bound kernels slow with the clock
        "losses": loss_values,
        "gpu_ms_by_category": categories,
        "gpu_ms_total": sum(categories.values()),
        "kernels_ms": {name: ms for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1]) if ms >= 0.01},
        # the GPU's time a profiled step: busy (any kernel running), idle in gaps of up to 5 us between
        # kernels (launch latency) and in longer ones (waiting for the host); harness.gpu_timeline
        **(
            {}
            if timeline is None
            else {
                "gpu_busy_ms": timeline.busy_us / 1e3,
                "gpu_idle_ms": {"launch_gaps": timeline.launch_gap_us / 1e3, "host_waits": timeline.host_wait_us / 1e3},
            }
        ),
        **({} if table is None else {"kernel_table": table}),
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m inductor_ext.bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3.2-1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="steps after the first (compile) step, not timed")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps for the GPU-time table (0: none)")
    p.add_argument(
        "--kernel-table",
        action="store_true",
        help="one more profiled step: each kernel's bytes, GB/s and %% of the copy bandwidth (needs --profile-steps)",
    )
    p.add_argument("--providers", nargs="+", choices=sorted(PROVIDERS),
                   help=f"default: {' '.join(DEFAULT_PROVIDERS)}; with --packed, {' '.join(PACKED_PROVIDERS)}")  # fmt: skip
    p.add_argument(
        "--cpp-wrapper", action="store_true", help=f"run {' '.join(CPP_WRAPPER_PROVIDERS)} (instead of --providers)"
    )
    p.add_argument("--lora", action="store_true", help=f"run {' '.join(LORA_PROVIDERS)} (instead of --providers)")
    p.add_argument(
        "--qlora",
        action="store_true",
        help=f"LoRA over an NF4 base (bitsandbytes): run {' '.join(QLORA_PROVIDERS)} (--providers among them)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each decoder layer's activations in the backward (non-reentrant), for every provider",
    )
    p.add_argument(
        "--packed",
        action="store_true",
        help="train on packed documents and their padded baseline (--providers among PACKED_PROVIDERS)",
    )
    p.add_argument("--padded-batch", type=int, default=8, help="documents per batch of the --packed padded baseline")
    p.add_argument(
        "--loss-chunk-size",
        type=int,
        default=None,
        help="rows of logits per chunk of the patched models' fused loss (default: the memory mode's)",
    )
    p.add_argument("--nproc", type=int, default=1, help="GPUs of this host per provider (FSDP2; gloo ranks on CPU)")
    p.add_argument("--attention-mask", choices=("none", "ones"), default="none",
                   help="pass no attention_mask, or one of all ones (what HF's data collators pass)")  # fmt: skip
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (the benchmark), or cpu: a smoke run (e.g. --model tiny-llama), timings meaningless")  # fmt: skip
    p.add_argument("--worker", choices=sorted(PROVIDERS), help=argparse.SUPPRESS)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every provider this many times, the order reversed each round (the given order, then "
        "reversed, ...), and pool the timed steps: the H200 slows as it heats over a run, so a provider run "
        "later than another is timed at a lower SM clock",
    )
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for the JSON and PNG")
    p.add_argument("--merge", action="store_true",
                   help="add to the configuration's JSON in --out (same settings and machine), replacing the rows "
                        "of the providers run now: a long provider list split over several invocations")  # fmt: skip
    return p


def _check(args: argparse.Namespace) -> str | None:
    if min(args.batch, args.seq, args.steps, args.nproc, args.rounds) < 1 or min(args.warmup, args.profile_steps) < 0:
        return "--batch, --seq, --steps, --nproc and --rounds must be >= 1; --warmup and --profile-steps >= 0"
    if args.kernel_table and not args.profile_steps:
        return "--kernel-table needs --profile-steps >= 1 (the kernels' times)"
    if args.loss_chunk_size is not None and args.loss_chunk_size < 1:
        return "--loss-chunk-size must be >= 1"
    packed = [p for p in args.providers or () if p in PACKED_PROVIDERS]
    if args.packed:
        if args.lora or args.qlora or args.cpp_wrapper or args.nproc > 1 or args.attention_mask != "none":
            return "--packed runs alone: not with --lora, --qlora, --cpp-wrapper, --nproc > 1 or --attention-mask ones"
        if args.rounds > 1:
            return "--rounds > 1 pools plain tokens/s: not with --packed (its speeds count real tokens)"
        if args.padded_batch < 1:
            return "--padded-batch must be >= 1"
        if args.providers is not None and len(packed) < len(args.providers):
            return f"--packed runs only {' '.join(PACKED_PROVIDERS)}"
    elif packed:
        return f"{' '.join(packed)}: only with --packed"
    quantized = [p for p in args.providers or () if p in QLORA_PROVIDERS]
    if args.qlora:
        if args.lora or args.packed or args.cpp_wrapper or args.nproc > 1:
            return "--qlora runs alone: not with --lora, --packed, --cpp-wrapper or --nproc > 1"
        if args.providers is not None and len(quantized) < len(args.providers):
            return f"--qlora runs only {' '.join(QLORA_PROVIDERS)}"
    elif quantized:
        return f"{' '.join(quantized)}: only with --qlora"
    kept = [p for p in args.providers or () if p.endswith(KEEP_SUFFIXES)]
    if kept and not args.gradient_checkpointing:
        return f"{' '.join(kept)}: only with --gradient-checkpointing (it changes what checkpointing recomputes)"
    if args.device == "cuda" and torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
        return f"--nproc {args.nproc} needs as many GPUs; this host has {torch.cuda.device_count()}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "this benchmark needs a CUDA GPU (--device cpu runs it as a smoke test, its timings meaningless)"
    return None


def _worker_command(args: argparse.Namespace, provider: str) -> list[str]:
    flags = ["--model", args.model, "--batch", args.batch, "--seq", args.seq, "--steps", args.steps,
             "--warmup", args.warmup, "--profile-steps", args.profile_steps, "--attention-mask",
             args.attention_mask, "--device", args.device, "--worker", provider]  # fmt: skip
    if args.kernel_table:
        flags += ["--kernel-table"]
    if args.loss_chunk_size is not None:
        flags += ["--loss-chunk-size", args.loss_chunk_size]
    if args.packed:
        flags += ["--packed", "--padded-batch", args.padded_batch]
    if args.gradient_checkpointing:
        flags += ["--gradient-checkpointing"]
    module_args = ["inductor_ext.bench", "train", *map(str, flags)]
    if args.nproc > 1:
        return fsdp.launch_command(args.nproc, module_args)
    return [sys.executable, "-m", *module_args]


def required_package(provider: str) -> str | None:
    """The optional package ``provider`` needs: ``liger_kernel`` (``liger_*``), ``bitsandbytes`` (``qlora_*``)."""
    packages = {"liger_": "liger_kernel", "qlora_": "bitsandbytes"}
    return next((package for prefix, package in packages.items() if provider.startswith(prefix)), None)


def available(provider: str) -> bool:
    if (package := required_package(provider)) is None:
        return True
    try:
        importlib.import_module("liger_kernel.transformers" if package == "liger_kernel" else package)
    except ImportError:
        return False
    return True


def references(provider: str, results: Mapping[str, Any]) -> tuple[str, str]:
    """The providers whose speed and loss ``provider``'s are compared with: ``torch_compile`` and ``hf_eager``
    (with LoRA, when those did not run: ``peft_torch_compile`` and ``peft_eager``; with ``--qlora``:
    ``qlora_peft_torch_compile`` and ``qlora_peft_eager``; with ``--packed``: ``torch_compile_packed`` and
    ``hf_eager_packed``, or ``hf_eager_padded`` for the padded providers)."""
    if provider in PACKED_PROVIDERS:
        return "torch_compile_packed", "hf_eager_padded" if provider.endswith("_padded") else "hf_eager_packed"
    if provider in QLORA_PROVIDERS:
        return "qlora_peft_torch_compile", "qlora_peft_eager"
    compiled = "torch_compile" if "torch_compile" in results else "peft_torch_compile"
    return compiled, "hf_eager" if "hf_eager" in results else "peft_eager"


def summarize(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per provider: the ratios to the compiled reference's speed (real tokens/s in ``--packed``
    runs; ``--qlora`` rows also to the eager reference's) and the final loss's difference from the eager
    reference's (:func:`references`)."""
    rows = []
    for name, r in results.items():
        compiled, eager = references(name, results)
        packed = "real_tokens_per_s" in r
        speed = "real_tokens_per_s" if packed else "tokens_per_s"
        base = results.get(compiled, {}).get(speed)
        eager_speed = results.get(eager, {}).get(speed)
        qlora = name in QLORA_PROVIDERS
        real = (
            {"real tokens/s": round(r["real_tokens_per_s"]), "pad %": round(100 * r["pad_fraction"], 1)}
            if packed
            else {}
        )
        reference_loss = results.get(eager, {}).get("losses", [None])[-1]
        row = {
            "provider": name,
            "tokens/s": round(r["tokens_per_s"]),
            **({"tokens/s per GPU": round(r["tokens_per_s_per_gpu"])} if r.get("ranks", 1) > 1 else {}),
            **real,
            "x torch.compile": round(r[speed] / base, 3) if base else None,
            **({"x qlora_peft_eager": round(r[speed] / eager_speed, 3) if eager_speed else None} if qlora else {}),
            "peak GiB": round(r["peak_gib"], 2) if r["peak_gib"] is not None else None,
            "first step s": round(r["first_step_s"], 1),
            "final loss": round(r["losses"][-1], 4),
            "- hf_eager": round(r["losses"][-1] - reference_loss, 4) if reference_loss is not None else None,
            **({"loss reference": eager} if name in PACKED_PROVIDERS else {}),
        }
        row.update({f"{c} ms": round(r["gpu_ms_by_category"][c], 1) for c in CATEGORIES})
        row["GPU ms"] = round(r["gpu_ms_total"], 1)
        row["wall ms"] = round(r["step_ms_median"], 1)
        row["wall ms no sync"] = round(r["step_ms_unsynced"], 1) if "step_ms_unsynced" in r else None
        row["wall - GPU ms"] = round(r["step_ms_median"] - r["gpu_ms_total"], 1) if r["gpu_ms_total"] else None
        idle = r.get("gpu_idle_ms")  # absent in files written before it, and on CPU
        row["GPU idle: launch gaps ms"] = round(idle["launch_gaps"], 1) if idle else None
        row["GPU idle: host waits ms"] = round(idle["host_waits"], 1) if idle else None
        row["tune s"] = round(r["tune_s"], 1) if r.get("tune_s") is not None else None
        row["SM MHz"] = round(r["timed_steps_gpu"]["sm_clock_mhz"]) if r.get("timed_steps_gpu") else None
        runs = r.get("rounds")  # --rounds > 1: each run's median step and clock, in the order of the rounds
        row["wall ms by round"] = " / ".join(f"{run['step_ms_median']:.1f}" for run in runs) if runs else None
        row["SM MHz by round"] = (
            " / ".join(f"{run['sm_clock_mhz']:.0f}" for run in runs if run["sm_clock_mhz"]) if runs else None
        )
        row["graph breaks"] = sum(r.get("graph_breaks", {}).values())  # absent in files written before it
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


def default_providers(args: argparse.Namespace) -> list[str]:
    """What runs without ``--providers``: the ``*_keep_*`` providers only with ``--gradient-checkpointing``
    (their policies change what checkpointing recomputes; without it they would repeat the plain row)."""
    providers = PACKED_PROVIDERS if args.packed else QLORA_PROVIDERS if args.qlora else DEFAULT_PROVIDERS
    return [p for p in providers if args.gradient_checkpointing or not p.endswith(KEEP_SUFFIXES)]


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if (error := _check(args)) is not None:
        p.error(error)
    if args.providers is None:
        args.providers = default_providers(args)
    if args.cpp_wrapper:
        args.providers = list(CPP_WRAPPER_PROVIDERS)
    if args.lora:
        args.providers = list(LORA_PROVIDERS)
    if args.worker:
        if (result := run_provider(args)) is not None:
            print_child_result(result)
        return 0
    from tabulate import tabulate

    from inductor_ext.bench import qlora  # it reads this module's LORA_TARGETS: imported once this one is

    stem = f"train_{args.model}_{args.batch}x{args.seq}" + ("_mask" if args.attention_mask == "ones" else "")
    stem += "_cpp_wrapper" if args.cpp_wrapper else ""
    stem += "_lora" if args.lora else ""
    stem += "_qlora" if args.qlora else ""
    stem += "_packed" if args.packed else ""
    stem += f"_{args.nproc}gpu" if args.nproc > 1 else ""
    stem += f"_loss_chunk{args.loss_chunk_size}" if args.loss_chunk_size else ""
    stem += "_gc" if args.gradient_checkpointing else ""
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "attention_mask": args.attention_mask, "loss_chunk_size": args.loss_chunk_size, "torch": torch.__version__,
            **({"packed": True, "padded_batch": args.padded_batch, "doc_length_median": packing.DOC_LENGTH_MEDIAN,
                "doc_length_sigma": packing.DOC_LENGTH_SIGMA, "doc_length_min": packing.DOC_LENGTH_MIN}
               if args.packed else {}),
            **({"qlora": qlora.quantization_meta(), "peft": _version("peft")} if args.qlora else {}),
            **({"gradient_checkpointing": True} if args.gradient_checkpointing else {}),
            **({"rounds": args.rounds} if args.rounds > 1 else {}),
            "transformers": _version("transformers"),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device}  # fmt: skip
    results = _earlier_results(args.out / f"{stem}.json", meta) if args.merge else {}
    runnable = [provider for provider in args.providers if available(provider)]
    for provider in args.providers:
        if provider not in runnable:
            print(f"{provider}: skipped ({required_package(provider)} is not importable)")
    rounds: dict[str, list[dict[str, Any]]] = {provider: [] for provider in runnable}
    # each provider's compile caches are empty in its first round (a cold first step) and its own after
    with contextlib.ExitStack() as scratch_dirs:
        scratch = {provider: scratch_dirs.enter_context(tempfile.TemporaryDirectory()) for provider in runnable}
        for round_index in range(args.rounds):
            order = runnable if round_index % 2 == 0 else runnable[::-1]
            label = f" (round {round_index + 1})" if args.rounds > 1 else ""
            for position, provider in enumerate(order):
                print(f"{provider}{label} ...", end=" ", flush=True)
                env = fresh_cache_env(scratch[provider], scratch[provider])
                result = run_child(_worker_command(args, provider), env)
                rounds[provider].append({**result, "position": position})
                results[provider] = pool_rounds(rounds[provider])
                peak = f", {result['peak_gib']:.2f} GiB" if result["peak_gib"] is not None else ""
                speed = f"{result['tokens_per_s']:,.0f} tokens/s"
                if "real_tokens_per_s" in result:
                    speed = f"{result['real_tokens_per_s']:,.0f} real tokens/s ({speed})"
                print(f"{speed}{peak}, first step {result['first_step_s']:.1f} s", flush=True)
                # written after every provider: a run stopped early keeps what it measured
                (args.out / f"{stem}.json").write_text(
                    json.dumps({"meta": meta, "results": results, "summary": summarize(results)}, indent=1)
                )
    rows = summarize(results)
    print(tabulate(rows, headers="keys"))
    for name, r in results.items():
        for category in ("attention", "other"):
            top = [(k, v) for k, v in r["kernels_ms"].items() if kernel_class(k) == category][:6]
            print(f"{name}, largest {category} kernels (ms/step): " + ", ".join(f"{k[:70]} {v:.2f}" for k, v in top))
        if "peak_gib_by_phase" in r:
            print(f"{name}, peak GiB by phase: " + ", ".join(f"{k} {v:.2f}" for k, v in r["peak_gib_by_phase"].items()))
        if "kernel_table" in r:
            print(f"\n{name}: kernels of a step\n{markdown(r['kernel_table'])}\n")
    if results and args.device == "cuda":
        documents = ", packed documents" if args.packed else ""
        quantised = " QLoRA (NF4)" if args.qlora else ""
        checkpointing = ", gradient checkpointing" if args.gradient_checkpointing else ""
        title = f"{args.model}{quantised}, {args.batch} x {args.seq} tokens{documents}{checkpointing}, bf16, AdamW"
        plot(results, args.out / f"{stem}.png", title)
    return 0


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


def _earlier_results(path: Path, meta: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The results already in ``path`` (``--merge``); none if it does not exist. Refuses a file of other settings."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if earlier["meta"] != meta:
        differ = sorted(k for k in {*meta, *earlier["meta"]} if meta.get(k) != earlier["meta"].get(k))
        raise SystemExit(f"--merge: {path} holds a run of other settings ({', '.join(differ)} differ)")
    return dict(earlier["results"])


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
