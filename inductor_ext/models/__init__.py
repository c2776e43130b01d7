"""What graph passes cannot do for an instantiated HF transformers model: :func:`apply` (the fused LM head + loss
without logits, PEFT LoRA layers on the fused LoRA ops), :func:`unapply`, :func:`patched`; :func:`keep_lora_outputs`
and :func:`keep_lora_mlp_outputs`, selective activation checkpointing for the patched LoRA ops."""

from inductor_ext.models.checkpointing import keep_lora_mlp_outputs, keep_lora_outputs
from inductor_ext.models.families import FAMILIES
from inductor_ext.models.patch import PatchReport, PatchWarning, apply, patched, unapply

__all__ = [
    "FAMILIES",
    "PatchReport",
    "PatchWarning",
    "apply",
    "keep_lora_mlp_outputs",
    "keep_lora_outputs",
    "patched",
    "unapply",
]
