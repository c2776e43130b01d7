"""PEFT LoRA layers on the fused LoRA ops (:mod:`inductor_ext.ops.lora`), for :func:`inductor_ext.models.apply`.

What is routed, per PEFT ``lora.Linear`` layer that :func:`unfusable_reason` accepts (one active
adapter, not merged, vanilla LoRA: no DoRA or other variant, no bias on B, a plain
``nn.Linear`` base, adapters of the expected shapes and dtypes), and per PEFT ``lora.bnb.Linear4bit``
(QLoRA: a bitsandbytes ``Linear4bit`` base, NF4 or FP4, double quantisation or not) under the same
conditions; a 4-bit base becomes an :class:`~inductor_ext.ops.nf4.Nf4Weight` over the layer's own
tensors on each call (no copy, nothing added to the module or its state dict):

- the layer's own ``forward`` (per instance) becomes one :func:`~inductor_ext.ops.lora.lora_linear`
  (:func:`lora_linear_forward`): the base GEMM, the low-rank term added into its output in place,
  the backward computing only ``dx`` and the adapter gradients. Attention's q/k/v/o (and Phi-3's
  packed ``qkv_proj`` and ``gate_up_proj``) run through it;
- a gated MLP whose gate, up and down projections are all such layers, with one dropout
  probability, becomes one :func:`~inductor_ext.ops.lora.lora_mlp` (:func:`lora_mlp_forward`).

Attention's q/k/v are three ``lora_linear`` calls, not one ``lora_qkv``: fusing them needs the
attention module's forward, which differs per family and per transformers version (q/k norms,
packed ``qkv_proj``, sliding windows, caches); replacing it would copy transformers' attention.
What ``lora_qkv`` saves over three ``lora_linear`` is summing the three input gradients into one
buffer (two ``(N, hidden)`` additions in the backward, which autograd does instead).

A 4-bit base runs fused when its input has the dtype it dequantises to and its ``compute_dtype``
(bitsandbytes casts the input to ``compute_dtype`` and the output back: with another dtype the layer
runs PEFT's forward). bitsandbytes' CPU inference repacking (``packing_format_for_cpu``, done by its
own forward in eval mode on AVX512-BF16 hosts) changes the layout: such a layer runs PEFT's forward.

Each forward checks the layer's PEFT state on every call and runs PEFT's own forward when it no
longer fits (adapters disabled with ``disable_adapter()``, merged, another active adapter,
``adapter_names=`` mixed batches): the state may change after :func:`apply`.

Dropout: PEFT's probability (``lora_dropout[adapter].p``) while the dropout module is in training
mode, none in eval; the keep-masks are drawn by the public ops (``bernoulli_``), one per
projection as PEFT's separate dropout modules do, so the random stream differs from PEFT's.
"""

import sys
from typing import Any, Literal

import torch
from torch import Tensor

from inductor_ext.ops.lora import SUPPORTED_DTYPES, LoraProjection, lora_linear, lora_mlp
from inductor_ext.ops.nf4 import Nf4Weight, check_nf4_weight

LoraDtype = Literal["adapters", "input"]
LORA_DTYPES: tuple[LoraDtype, ...] = ("adapters", "input")
"""``models.apply``'s ``lora_dtype``: the low-rank GEMMs in the adapters' dtype (PEFT's numerics) or in
the input's (adapters cast per call, as autocast would)."""


def lora_linear_class() -> Any:
    """PEFT's ``lora.Linear`` when PEFT is imported (a model holding PEFT layers imported it), else None."""
    if "peft" not in sys.modules:
        return None
    from peft.tuners.lora.layer import Linear

    return Linear


def lora_linear_4bit_class() -> Any:
    """PEFT's ``lora.bnb.Linear4bit`` when PEFT and bitsandbytes are imported, else None."""
    if "peft" not in sys.modules or "bitsandbytes" not in sys.modules:
        return None
    from peft.tuners.lora import bnb

    return getattr(bnb, "Linear4bit", None)


def _is_4bit(layer: Any) -> bool:
    cls = lora_linear_4bit_class()
    return cls is not None and type(layer) is cls


def _unusable_4bit_base(base: Any) -> str | None:
    """Why a bitsandbytes ``Linear4bit`` base cannot be read as an :class:`Nf4Weight`, or None."""
    import bitsandbytes

    if type(base) not in (bitsandbytes.nn.Linear4bit, bitsandbytes.nn.LinearNF4, bitsandbytes.nn.LinearFP4):
        return f"its base layer is {type(base).__name__}, not bitsandbytes' Linear4bit"
    if getattr(getattr(base.weight, "quant_state", None), "packing_format_for_cpu", False):
        return "its 4-bit base is in bitsandbytes' CPU inference layout (packing_format_for_cpu)"
    try:  # from_bnb refuses a base not quantised yet (bitsandbytes quantises when it moves to its device)
        check_nf4_weight("models.apply", "the base weight", Nf4Weight.from_bnb(base.weight))
    except (ValueError, TypeError) as error:
        return f"its 4-bit base does not fit the fused ops ({error})"
    if base.bias is not None and base.bias.requires_grad:
        return "its base bias requires_grad: the ops take a frozen base"
    return None


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A PEFT ``LoraLayer`` of any kind (Linear, Embedding, Conv, quantized Linear, ...)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.lora.layer import LoraLayer

    return isinstance(module, LoraLayer)


def unfusable_reason(layer: Any) -> str | None:
    """Why the PEFT LoRA layer ``layer`` cannot run on :func:`lora_linear`, or None when it can."""
    linear = lora_linear_class()
    quantized = _is_4bit(layer)
    if not quantized and (linear is None or type(layer) is not linear):
        return (
            f"{type(layer).__name__} is not PEFT's lora.Linear or lora.bnb.Linear4bit "
            "(LoRA on Embedding, Conv or an 8-bit or other quantised base)"
        )
    active = list(layer.active_adapters)
    if len(active) != 1:
        return f"{len(active)} active adapters {active}: the fused ops take one"
    name = active[0]
    if name not in layer.lora_A:
        return f"the active adapter {name!r} has no LoRA weights in this layer"
    if layer.merged:
        return "its adapter is merged into the base weight"
    if layer.use_dora.get(name, False):
        return "DoRA (use_dora): the fused ops implement plain LoRA"
    if name in getattr(layer, "lora_variant", {}):
        return f"a LoRA variant ({type(layer.lora_variant[name]).__name__}): the fused ops implement plain LoRA"
    if getattr(layer, "lora_bias", {}).get(name, False):
        return "a bias on lora_B (lora_bias): the fused ops have none"
    base = layer.base_layer
    if quantized:
        reason = _unusable_4bit_base(base)
        if reason is not None:
            return reason
    elif type(base) is not torch.nn.Linear or getattr(layer, "fan_in_fan_out", False):
        return f"its base layer is {type(base).__name__}, not a plain nn.Linear"
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    if type(lora_a) is not torch.nn.Linear or type(lora_b) is not torch.nn.Linear or lora_b.bias is not None:
        return "its adapters are not bias-free nn.Linear layers"
    weight, a, b = _base_weight(base), lora_a.weight, lora_b.weight
    if not quantized and (
        weight.dtype not in SUPPORTED_DTYPES
        or weight.requires_grad
        or (base.bias is not None and base.bias.requires_grad)
    ):
        return (
            f"its base weight is {weight.dtype}, requires_grad={weight.requires_grad}: the ops take a frozen float base"
        )
    if (
        a.dim() != 2
        or tuple(a.shape) != (a.shape[0], weight.shape[1])
        or tuple(b.shape) != (weight.shape[0], a.shape[0])
    ):
        return f"adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit the base weight {tuple(weight.shape)}"
    if a.dtype not in (weight.dtype, torch.float32) or b.dtype not in (weight.dtype, torch.float32):
        return f"adapter dtypes A {a.dtype}, B {b.dtype}: the ops take the base's dtype or float32"
    dropout = layer.lora_dropout[name]
    if type(dropout) not in (torch.nn.Dropout, torch.nn.Identity):
        return f"its dropout is {type(dropout).__name__}, not nn.Dropout"
    if not isinstance(layer.scaling.get(name), (int, float)):
        return f"its scaling {layer.scaling.get(name)!r} is not a number"
    return None


def _base_weight(base: Any) -> Tensor | Nf4Weight:
    """A PEFT layer's base weight as the ops take it: the tensor, or a 4-bit one's :class:`Nf4Weight`."""
    weight = base.weight
    return Nf4Weight.from_bnb(weight) if getattr(weight, "quant_state", None) is not None else weight


def _active(layer: Any, kwargs: dict[str, Any], dtype: torch.dtype) -> tuple[LoraProjection, float] | None:
    """``(projection, dropout p)`` of the layer's adapter when the layer's state still fits the fused op
    on an input of ``dtype`` (not under autocast with a base of another dtype, base still frozen; a 4-bit
    base: dequantising to ``dtype``, computing in it, in bitsandbytes' training layout)."""
    name = layer._fastops_adapter
    if layer.disable_adapters or layer.merged or kwargs or layer.active_adapters != [name]:
        return None
    base = layer.base_layer
    if base.bias is not None and base.bias.requires_grad:
        return None
    state = getattr(base.weight, "quant_state", None)
    weight: Tensor | Nf4Weight = base.weight
    if state is not None:
        if (
            state.dtype != dtype
            or base.compute_dtype not in (None, dtype)
            or getattr(state, "packing_format_for_cpu", False)
            or (base.bias is not None and base.bias.dtype != dtype)
        ):
            return None
        weight = Nf4Weight.from_bnb(base.weight)
    elif base.weight.dtype != dtype or base.weight.requires_grad:
        return None
    lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
    if layer._fastops_lora_dtype == "input":  # differentiable casts: the gradients arrive in the adapters' dtype
        lora_a, lora_b = lora_a.to(dtype), lora_b.to(dtype)
    projection = LoraProjection(weight, lora_a, lora_b, layer.scaling[name], base.bias)
    dropout = layer.lora_dropout[name]
    p = float(dropout.p) if isinstance(dropout, torch.nn.Dropout) and dropout.training else 0.0
    return projection, p


def lora_linear_forward(self: Any, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """PEFT ``lora.Linear``: ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` as one :func:`lora_linear`
    (the adapters cast to ``x``'s dtype for the GEMMs); PEFT's own forward when the layer's state changed."""
    active = None if args else _active(self, kwargs, x.dtype)
    if active is None:
        return type(self).forward(self, x, *args, **kwargs)
    projection, p = active
    return lora_linear(x, projection, dropout_p=p)


def lora_mlp_forward(self: Any, x: Tensor) -> Tensor:
    """A gated MLP over three PEFT ``lora.Linear`` layers: ``down(act(gate(x)) * up(x))`` as one
    :func:`lora_mlp` (``self._fastops_lora_activation``); when a layer's state no longer fits, the MLP
    class's own forward, whose projections run their own forwards (:func:`lora_linear_forward` or PEFT's)."""
    layers = (self.gate_proj, self.up_proj, self.down_proj)
    active = [_active(layer, {}, x.dtype) for layer in layers]
    if any(a is None for a in active) or len({a[1] for a in active if a is not None}) != 1:
        return type(self).forward(self, x)
    (gate, p), (up, _), (down, _) = (a for a in active if a is not None)
    return lora_mlp(x, gate, up, down, activation=self._fastops_lora_activation, dropout_p=p)
