"""The forward a patched HF causal LM runs: transformers' own, with the LM head and the loss as one
:func:`~inductor_ext.fused_linear_cross_entropy` in training with labels.

:func:`causal_lm_forward` takes the ``ForCausalLM`` module as ``self`` and is bound to one instance by
:func:`inductor_ext.models.apply`; its loss is transformers' ``ForCausalLMLoss`` (same shifting,
ignored labels and reductions), computed without the logits.
"""

import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from inductor_ext.ops.fused_linear_cross_entropy import WeightGradAccumulation, fused_linear_cross_entropy


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


PackedDocuments = Literal["hf", "separate"]
PACKED_DOCUMENTS: tuple[PackedDocuments, ...] = ("hf", "separate")
"""The values of :func:`inductor_ext.models.apply`'s ``packed_documents``."""

CACHE_ARGUMENTS = ("cache", "past_key_values")
"""The decoder's cache argument (transformers renamed ``past_key_values`` to ``cache`` in 5.2x)."""

_MASK_ONLY_CACHE: list[type] = []


def mask_only_cache_class() -> type | None:
    """A ``transformers.DynamicCache`` whose ``update`` stores nothing (None if this transformers has none).

    Built from the model's config as transformers builds its own cache, so before the first layer it is
    exactly the empty cache transformers' decoder would have made: the decoder's masks (which depend on
    whether a cache is present, see :func:`causal_lm_forward`) and default positions come out the same.
    Each attention layer's ``update`` then returns the layer's keys and values as they are, which is what
    an empty ``DynamicCache`` returns (``cat`` of nothing and them; a sliding-window layer returns all
    of them too, the mask does the windowing), without keeping them. Created on first use, not at import
    (``inductor_ext`` does not import transformers).
    """
    if not _MASK_ONLY_CACHE:
        try:
            from transformers.cache_utils import DynamicCache
        except ImportError:
            return None

        class MaskOnlyCache(DynamicCache):  # type: ignore[misc]  # transformers is untyped here
            """An empty ``DynamicCache`` that stays empty: the masks see a cache, no key or value is kept."""

            def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> Any:
                return key_states, value_states

        _MASK_ONLY_CACHE.append(MaskOnlyCache)
    return _MASK_ONLY_CACHE[0]


def decoder_cache_argument(decoder: Any) -> str | None:
    """The name of the cache argument of ``decoder.forward`` (see :data:`CACHE_ARGUMENTS`), or None."""
    try:
        parameters = inspect.signature(type(decoder).forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in CACHE_ARGUMENTS if name in parameters), None)


def hf_builds_cache(decoder: Any, use_cache: bool | None) -> bool:
    """Whether transformers' ``decoder.forward``, called with ``use_cache`` and no cache, builds a cache.

    transformers' ``merge_with_config_defaults`` resolves ``use_cache``: the argument, else
    ``config.use_cache``; then ``False`` under gradient checkpointing in training with gradients
    enabled. The decoder builds a ``DynamicCache`` when the result is true.
    """
    if use_cache is None:
        use_cache = getattr(decoder.config, "use_cache", None)
    if use_cache and getattr(decoder, "gradient_checkpointing", False) and decoder.training and torch.is_grad_enabled():
        return False
    return bool(use_cache)


def check_position_ids(position_ids: Any, tokens: Any) -> None:
    """Refuse ``position_ids`` that are not one per token of ``tokens`` (``input_ids`` or ``inputs_embeds``):
    their last size the token count, a 2-D batch of 1 or the tokens' batch. transformers computes RoPE's
    cos and sin from them, so a wrong length surfaces only at the rotation, as an error about ``cos``.
    A comparison of sizes (no host sync; under ``torch.compile`` a guard, not a graph break)."""
    if not isinstance(position_ids, Tensor) or not isinstance(tokens, Tensor) or tokens.dim() < 2:
        return
    batch, length = tokens.shape[0], tokens.shape[1]
    if position_ids.shape[-1] != length or (position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch)):
        raise ValueError(
            f"position_ids must give one position per token: shape (1 or {batch}, {length}) for inputs of "
            f"{length} tokens in {batch} rows, got {tuple(position_ids.shape)}"
        )


def with_class_signature(module: Any, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward(module, **arguments)`` called and inspected as ``type(module).forward``: positional arguments
    bind by the class forward's parameter order (``forward`` takes its arguments by keyword), and
    ``inspect.signature`` shows the class forward's parameters, so that callers that read a forward's
    signature (HF ``Trainer`` keeps only the dataset columns the forward names) see transformers' own."""
    signature = inspect.signature(type(module).forward)
    parameters = list(signature.parameters.values())[1:]  # without self
    positional = tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    name = f"{type(module).__name__}.forward"

    def bound_forward(*args: Any, **kwargs: Any) -> Any:
        if len(args) > len(positional):
            raise TypeError(f"{name} takes {len(positional)} positional arguments but {len(args)} were given")
        for parameter, arg in zip(positional, args):
            if parameter in kwargs:
                raise TypeError(f"{name} got multiple values for argument {parameter!r}")
            kwargs[parameter] = arg
        return forward(module, **kwargs)

    bound_forward.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return bound_forward


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

    Its attention masks stay transformers': transformers separates packed documents (``position_ids``
    restarting at 0, no ``attention_mask``) only when the decoder has no cache, so where transformers
    would have built its default cache (``use_cache`` unset, :func:`hf_builds_cache`) the decoder gets
    an empty cache that keeps nothing (:func:`mask_only_cache_class`) instead of none; where this
    transformers has no such cache, transformers' own forward runs the call. With
    ``packed_documents="separate"`` (``self._fastops_packed_documents``) every call without a cache
    object runs with ``use_cache=False``: packed documents never attend across each other.

    Evaluation, calls without labels, and ``logits_to_keep`` other than 0 run transformers' own forward.
    ``position_ids`` must be one per token (:func:`check_position_ids`).
    """
    check_position_ids(kwargs.get("position_ids"), input_ids if input_ids is not None else kwargs.get("inputs_embeds"))
    has_cache = False
    for name in CACHE_ARGUMENTS:
        if name in kwargs and kwargs[name] is None:
            del kwargs[name]  # so that a cache we pass is the only one named
        has_cache = has_cache or name in kwargs
    if self._fastops_packed_documents == "separate" and not has_cache:
        kwargs["use_cache"] = False
    fused = (
        self._fastops_fused_loss
        and labels is not None
        and self.training
        and isinstance(logits_to_keep, int)
        and logits_to_keep == 0
    )
    mask_only_cache = None
    if fused and not has_cache and kwargs.get("use_cache") is None and hf_builds_cache(self.model, None):
        if self._fastops_mask_only_cache is None or self._fastops_cache_argument is None:
            fused = False  # no cache that keeps nothing: transformers' forward, its cache included
        else:
            mask_only_cache = self._fastops_mask_only_cache(config=self.model.config)
            kwargs[self._fastops_cache_argument] = mask_only_cache
            kwargs["use_cache"] = True
    if not fused or labels is None:  # (labels: for mypy, fused implies them)
        return type(self).forward(self, input_ids=input_ids, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return_dict = kwargs.pop("return_dict", None)
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
    for cache_field in CACHE_ARGUMENTS:
        if cache_field in CausalLMOutputWithPast.__dataclass_fields__:
            cache = getattr(outputs, cache_field, None)
            fields[cache_field] = None if cache is mask_only_cache else cache
    result = CausalLMOutputWithPast(loss=loss, logits=None, **fields)
    return result.to_tuple() if return_dict is False else result
