"""The transformers model families :func:`inductor_ext.models.apply` patches, and what it patches in each.

Each entry names classes of the family's ``transformers.models.<name>.modeling_<name>`` module
(transformers 5.x); a class the installed transformers lacks makes the family unpatchable, with a
warning. Only instances of exactly these classes are patched: a subclass may have changed the math.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    module: str
    """``transformers.models.<module>.modeling_<module>``."""
    norm: str
    norm_kind: str
    """``"llama"``: ``weight * normed.to(dtype)``; ``"fp32_weight"``: ``(weight * normed).to(dtype)``
    (OLMo-2); ``"gemma"``: ``(normed * (1 + weight.float())).type_as(x)``."""
    mlp: str
    mlp_kind: str
    """``"gated"``: ``down(act(gate(x)) * up(x))``; ``"packed"``: Phi-3's ``gate_up_proj`` halves."""
    causal_lm: str
    activation_attribute: str = "hidden_act"
    """The config field naming the MLP activation."""
    logits_scaling: bool = False
    """Granite: logits are divided by ``config.logits_scaling``."""
    final_softcap: bool = False
    """Gemma 2/3: ``config.final_logit_softcapping`` caps the logits before the loss."""


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaRMSNorm", "llama", "LlamaMLP", "gated", "LlamaForCausalLM"),
    "mistral": Family("mistral", "MistralRMSNorm", "llama", "MistralMLP", "gated", "MistralForCausalLM"),
    "qwen2": Family("qwen2", "Qwen2RMSNorm", "llama", "Qwen2MLP", "gated", "Qwen2ForCausalLM"),
    "qwen3": Family("qwen3", "Qwen3RMSNorm", "llama", "Qwen3MLP", "gated", "Qwen3ForCausalLM"),
    "granite": Family(
        "granite", "GraniteRMSNorm", "llama", "GraniteMLP", "gated", "GraniteForCausalLM", logits_scaling=True
    ),
    "olmo2": Family("olmo2", "Olmo2RMSNorm", "fp32_weight", "Olmo2MLP", "gated", "Olmo2ForCausalLM"),
    "phi3": Family("phi3", "Phi3RMSNorm", "llama", "Phi3MLP", "packed", "Phi3ForCausalLM"),
    "gemma2": Family(
        "gemma2",
        "Gemma2RMSNorm",
        "gemma",
        "Gemma2MLP",
        "gated",
        "Gemma2ForCausalLM",
        activation_attribute="hidden_activation",
        final_softcap=True,
    ),
    "gemma3_text": Family(
        "gemma3",
        "Gemma3RMSNorm",
        "gemma",
        "Gemma3MLP",
        "gated",
        "Gemma3ForCausalLM",
        activation_attribute="hidden_activation",
        final_softcap=True,
    ),
}
"""``config.model_type`` -> what to patch."""

ACTIVATIONS: dict[str, tuple[str, str]] = {
    "silu": ("silu", "none"),
    "swish": ("silu", "none"),
    "gelu": ("gelu", "none"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "gelu_new": ("gelu", "tanh"),
}
"""HF activation name -> (our GLU activation, GELU approximation): the activations our GLU ops fuse."""
