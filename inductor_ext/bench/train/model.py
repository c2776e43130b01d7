"""The models ``bench train`` trains: transformers configs of real model shapes (random init, no
download), PEFT LoRA adapters, gradient checkpointing and Liger-Kernel's patch."""

from collections.abc import Callable
from typing import Any

import torch

MODELS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
                         "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True},
    "qwen3-0.6b": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                       "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True},
    "qwen2.5-1.5b-16l": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 16,
                             "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6,
                             "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True},
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
models' shapes (Llama-3.2-1B, Qwen3-0.6B, Qwen2.5-1.5B's first 16 layers, Mistral-7B's first 4 layers,
Llama-3.1-8B) and tiny ones for
CPU tests (a Qwen3 with per-head q/k norms and a head_dim that is not hidden / heads)."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA, LORA_DROPOUT = 16, 32, 0.05
"""The adapters: rank 16 on every decoder linear layer, alpha 32 (scaling 2), dropout 0.05."""


def config_for(model: str, **overrides: Any) -> Any:
    """The transformers config of a :data:`MODELS` entry (fields replaced by ``overrides``), with SDPA attention."""
    import transformers

    fields = {**MODELS[model], **overrides}
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    return config


def build_model(model: str, device: str, dtype: torch.dtype, *, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised causal LM of the given shape (config fields replaced by ``overrides``) in
    training mode: the same weights for the same seed and device."""
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        built = transformers.AutoModelForCausalLM.from_config(config_for(model, **overrides), dtype=dtype)
    return built.train()


def add_lora(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` wrapped by PEFT with the adapters of :data:`LORA_TARGETS`: the base frozen, the adapters
    float32 (``get_peft_model``'s default ``autocast_adapter_dtype=True``)."""
    import peft

    config = peft.LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=LORA_DROPOUT, target_modules=list(LORA_TARGETS)
    )
    return peft.get_peft_model(model, config)  # type: ignore[arg-type]


def enable_checkpointing(model: torch.nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
    """Non-reentrant activation checkpointing of each decoder layer of ``model`` (a PEFT model's too), set
    up so that ``torch.compile`` traces the step whole.

    The input-require-grads hook transformers adds (needed by reentrant checkpointing only) is removed:
    its ``requires_grad_()`` breaks Dynamo's graph. ``use_cache`` is turned off, as trainers do under
    checkpointing (transformers' warning otherwise is a graph break too). ``context_fn``: a selective
    checkpointing policy (e.g. :func:`inductor_ext.models.keep_lora_mlp_outputs`)."""
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


def apply_liger(model_name: str) -> None:
    """Liger-Kernel's class-level patch for the model family (before the model is built)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    MODEL_TYPE_TO_APPLY_LIGER_FN[MODELS[model_name]["model_type"]]()
