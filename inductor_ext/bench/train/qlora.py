"""The frozen base of ``bench train``'s ``qlora`` providers: the decoder's linear layers as bitsandbytes NF4
:class:`bitsandbytes.nn.Linear4bit` (4-bit NormalFloat, blocks of :data:`NF4_BLOCKSIZE` weights, double
quantisation), computing in the model's dtype, as transformers loads a model with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)``.
PEFT then wraps each as its ``lora.Linear4bit``.

PEFT's ``prepare_model_for_kbit_training`` is not called: it upcasts every parameter that is not 4-bit
to float32, and every provider keeps one model dtype (bf16), so QLoRA rows differ from LoRA rows by the
quantised base only."""

from collections.abc import Iterable
from typing import Any

import torch

from inductor_ext.bench.train.model import LORA_TARGETS

NF4: dict[str, Any] = {"quant_type": "nf4", "compress_statistics": True, "quant_storage": torch.uint8}
"""The quantisation of every base weight: NF4, double quantisation, packed two codes a byte."""
NF4_BLOCKSIZE = 64
"""Weights per absmax block (bitsandbytes' and the QLoRA paper's default)."""


def quantize_base(model: torch.nn.Module, targets: Iterable[str] = LORA_TARGETS) -> list[str]:
    """Replace, in place, each ``nn.Linear`` of ``model``'s decoder layers whose name is one of ``targets``
    by a :class:`bitsandbytes.nn.Linear4bit` holding its weight quantised to NF4 on the weight's device
    (the same bias, ``compute_dtype`` the weight's dtype); the names replaced.

    The LM head, the embeddings and the norms are left as they are. The layers are done one decoder
    layer at a time, so the model needs its unquantised weights plus one layer's quantised copies at
    most (an 8B model in bf16 quantises on one GPU). Marks the model ``is_loaded_in_4bit``, as
    transformers' bitsandbytes quantizer does: PEFT wraps a ``Linear4bit`` in its ``lora.Linear4bit``
    only on a model that says so."""
    import bitsandbytes as bnb

    targets = frozenset(targets)
    layers = _decoder_layers(model)
    prefix = next(name for name, module in model.named_modules() if module is layers)
    replaced = []
    for index, layer in enumerate(layers):
        for name, module in list(layer.named_modules()):
            parent, _, child = name.rpartition(".")
            if child not in targets or type(module) is not torch.nn.Linear:
                continue
            weight = module.weight
            quantized = bnb.nn.Linear4bit(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                compute_dtype=weight.dtype,
                device="meta",  # no allocation: the weight and bias are set next
                **NF4,
            )
            # Params4bit quantises when it is moved to a device (.to), the same device included
            params: Any = bnb.nn.Params4bit(
                weight.data, requires_grad=False, blocksize=NF4_BLOCKSIZE, module=quantized, **NF4
            )
            params = params.to(weight.device)
            assert params.bnb_quantized, f"{name}: bitsandbytes did not quantise the weight"
            quantized.weight = params
            if module.bias is not None:
                quantized.bias = module.bias
            setattr(layer.get_submodule(parent) if parent else layer, child, quantized)
            replaced.append(f"{prefix}.{index}.{name}")
    model.is_loaded_in_4bit = True  # type: ignore[assignment]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 weights' blocks: reserved memory the run should not carry
    return replaced


def quantization_meta() -> dict[str, Any]:
    """The base's quantisation, for a run's JSON metadata (the bitsandbytes version None where it is not
    installed: the ``qlora_*`` providers are then skipped)."""
    import importlib.metadata

    try:
        version: str | None = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "quant_type": NF4["quant_type"],
        "double_quant": NF4["compress_statistics"],
        "blocksize": NF4_BLOCKSIZE,
        "bitsandbytes": version,
    }


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM."""
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if get_decoder is not None else None
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no decoder layers (get_decoder().layers) to quantise")
    return layers
