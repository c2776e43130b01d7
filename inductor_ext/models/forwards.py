"""The forwards a patched HF model runs: our ops in place of transformers' norms, MLPs, RoPE and loss.

Each function takes the HF module as ``self`` and is bound to one instance by
:func:`inductor_ext.models.apply`; its math is the HF forward it replaces (same casting, same loss
semantics), computed by our kernels.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from inductor_ext.ops.fused_linear_cross_entropy import WeightGradAccumulation, fused_linear_cross_entropy
from inductor_ext.ops.glu import geglu, geglu_packed, swiglu, swiglu_packed
from inductor_ext.ops.rms_norm import rms_norm
from inductor_ext.ops.rope import apply_rotary_pos_emb


def llama_norm_forward(self: Any, hidden_states: Tensor) -> Tensor:
    """``LlamaRMSNorm``: normalise in fp32, cast to the input's dtype, multiply by the weight."""
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def fp32_weight_norm_forward(self: Any, hidden_states: Tensor) -> Tensor:
    """``Olmo2RMSNorm``: ``(weight * normed).to(dtype)``, the product in fp32."""
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, casting="gemma")


def gemma_norm_forward(self: Any, x: Tensor) -> Tensor:
    """``GemmaRMSNorm``: ``(normed * (1 + weight.float())).type_as(x)``."""
    return rms_norm(x, self.weight, self.eps, offset=1.0, casting="gemma")


NORM_FORWARDS = {"llama": llama_norm_forward, "fp32_weight": fp32_weight_norm_forward, "gemma": gemma_norm_forward}


def gated_mlp_forward(self: Any, x: Tensor) -> Tensor:
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with the activation and product fused; the
    projections' outputs are this function's own, so the eager backward writes their gradients over them."""
    gate, up = self.gate_proj(x), self.up_proj(x)
    activation, approximate = self._fastops_activation
    if activation == "silu":
        hidden = swiglu(gate, up, overwrite_inputs_in_backward=True)
    else:
        hidden = geglu(gate, up, approximate, overwrite_inputs_in_backward=True)
    return self.down_proj(hidden)


def packed_mlp_forward(self: Any, hidden_states: Tensor) -> Tensor:
    """Phi-3: ``down_proj(up * act(gate))`` with ``gate, up = gate_up_proj(x).chunk(2, -1)``."""
    gate_up = self.gate_up_proj(hidden_states)
    activation, approximate = self._fastops_activation
    if activation == "silu":
        hidden = swiglu_packed(gate_up, overwrite_inputs_in_backward=True)
    else:
        hidden = geglu_packed(gate_up, approximate, overwrite_inputs_in_backward=True)
    return self.down_proj(hidden)


MLP_FORWARDS = {"gated": gated_mlp_forward, "packed": packed_mlp_forward}


def hf_apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Any:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (partial rotary when
    ``cos`` is narrower than the head, as Phi-3's), on our RoPE kernel."""
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def causal_lm_loss(
    hidden_states: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    logits_scaling: float | None = None,
    softcap: float | None = None,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: Tensor | None = None,
    weight_grad_accumulation: WeightGradAccumulation = "fp32",
    chunk_size: int | None = None,
) -> Tensor:
    """transformers' ``ForCausalLMLoss`` on ``lm_head(hidden_states)``, without the logits.

    Labels are shifted (``shift_labels`` given or ``labels`` padded with ``ignore_index`` and
    shifted left); the mean is over non-ignored tokens, or the sum divided by
    ``num_items_in_batch`` when given (gradient accumulation). Granite's ``logits / scaling``
    is applied to the hidden states (the same product); Gemma's final soft-cap
    ``cap * tanh(logits / cap)`` is applied inside the loss kernel.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    if logits_scaling is not None:
        hidden = hidden / logits_scaling
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = fused_linear_cross_entropy(
        hidden, weight, shift_labels.reshape(-1).to(hidden.device), ignore_index=ignore_index, reduction=reduction,
        softcap=softcap, weight_grad_accumulation=weight_grad_accumulation, chunk_size=chunk_size,
    )  # fmt: skip
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def causal_lm_forward(
    self: Any, input_ids: Tensor | None = None, labels: Tensor | None = None, logits_to_keep: Any = 0, **kwargs: Any
) -> Any:
    """``<Family>ForCausalLM.forward``; in training with labels, the LM head and the loss are one
    :func:`~inductor_ext.fused_linear_cross_entropy` and ``logits`` is None (never materialised).

    That path builds no KV cache unless the caller passes ``use_cache=True`` (transformers builds one
    by default): under ``torch.compile`` each cached key and value is an output of the forward graph,
    so the backward receives a zero gradient for each and adds it in (two ``(tokens, kv heads x
    head dim)`` tensors per layer, 256 MiB at Llama-3.2-1B with 8192 tokens, alive at the backward's
    start, the step's peak).

    Evaluation, calls without labels, and ``logits_to_keep`` other than 0 run transformers' own forward.
    """
    if labels is None or not self.training or not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        return type(self).forward(self, input_ids=input_ids, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return_dict = kwargs.pop("return_dict", None)
    kwargs.setdefault("use_cache", False)
    outputs = self.model(input_ids=input_ids, **kwargs)
    config = self.config
    loss = causal_lm_loss(
        outputs.last_hidden_state, self.lm_head.weight, labels,
        logits_scaling=config.logits_scaling if self._fastops_family.logits_scaling else None,
        softcap=config.final_logit_softcapping if self._fastops_family.final_softcap else None,
        num_items_in_batch=kwargs.get("num_items_in_batch"), ignore_index=kwargs.get("ignore_index", -100),
        shift_labels=kwargs.get("shift_labels"), weight_grad_accumulation=self._fastops_weight_grad_accumulation,
        chunk_size=self._fastops_loss_chunk_size,
    )  # fmt: skip
    fields = {name: getattr(outputs, name, None) for name in ("hidden_states", "attentions")}
    for cache_field in ("cache", "past_key_values"):  # transformers renamed it in 5.2x
        if cache_field in CausalLMOutputWithPast.__dataclass_fields__:
            fields[cache_field] = getattr(outputs, cache_field, None)
    result = CausalLMOutputWithPast(loss=loss, logits=None, **fields)
    return result.to_tuple() if return_dict is False else result
