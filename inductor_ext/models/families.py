"""The transformers model families :func:`inductor_ext.models.apply` knows, and what it needs of each.

Each entry names classes of the family's ``transformers.models.<name>.modeling_<name>`` module
(transformers 5.x); a class the installed transformers lacks makes the family unpatchable, with a
warning. Only instances of exactly these classes are patched: a subclass may have changed the math.
"""

import dataclasses

GATED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The projections of a gated MLP, ``down(act(gate(x)) * up(x))``: what one ``lora_mlp`` takes."""


@dataclasses.dataclass(frozen=True)
class Family:
    module: str
    """``transformers.models.<module>.modeling_<module>``."""
    mlp: str
    """The MLP class: an instance whose projections are all fusable LoRA layers becomes one ``lora_mlp``."""
    causal_lm: str
    """The ``ForCausalLM`` class: its forward gets the fused LM head + loss."""
    mlp_projections: tuple[str, ...] = GATED_PROJECTIONS
    """The MLP's projection attributes (Phi-3 packs gate and up into ``gate_up_proj``)."""
    activation_attribute: str = "hidden_act"
    """The config field naming the MLP activation."""
    logits_scaling: bool = False
    """Granite: logits are divided by ``config.logits_scaling``."""
    final_softcap: bool = False
    """Gemma 2/3: ``config.final_logit_softcapping`` caps the logits before the loss."""


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaMLP", "LlamaForCausalLM"),
    "mistral": Family("mistral", "MistralMLP", "MistralForCausalLM"),
    "qwen2": Family("qwen2", "Qwen2MLP", "Qwen2ForCausalLM"),
    "qwen3": Family("qwen3", "Qwen3MLP", "Qwen3ForCausalLM"),
    "granite": Family("granite", "GraniteMLP", "GraniteForCausalLM", logits_scaling=True),
    "olmo2": Family("olmo2", "Olmo2MLP", "Olmo2ForCausalLM"),
    "phi3": Family("phi3", "Phi3MLP", "Phi3ForCausalLM", mlp_projections=("gate_up_proj", "down_proj")),
    "gemma2": Family(
        "gemma2", "Gemma2MLP", "Gemma2ForCausalLM", activation_attribute="hidden_activation", final_softcap=True
    ),
    "gemma3_text": Family(
        "gemma3", "Gemma3MLP", "Gemma3ForCausalLM", activation_attribute="hidden_activation", final_softcap=True
    ),
}
"""``config.model_type`` -> what to patch."""

ACTIVATIONS: dict[str, str] = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}
"""HF activation name -> :func:`~inductor_ext.ops.lora.lora_mlp`'s ``activation``: the activations it fuses."""
