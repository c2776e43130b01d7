"""``inductor_ext.models.apply(model)``: what a graph pass cannot do, on an instantiated transformers model
(or a PEFT-wrapped one).

What is patched, per :data:`~inductor_ext.models.families.FAMILIES`:

- the ``ForCausalLM`` instance (:func:`~inductor_ext.models.forwards.causal_lm_forward`): in training
  with labels, the LM head and the loss become one ``fused_linear_cross_entropy`` (``outputs.logits`` is
  then None: the ``(tokens, vocab)`` logits are never built, nor transformers' default KV cache);
  otherwise transformers' own forward runs. Attention masks stay transformers' (packed documents:
  ``packed_documents`` in :func:`apply`);
- PEFT LoRA layers (``lora=True``, :mod:`inductor_ext.models.peft_lora`): each fusable ``lora.Linear``
  or ``lora.bnb.Linear4bit`` runs one fused ``lora_linear``, and a gated MLP whose three projections are
  all fusable runs one ``lora_mlp``; LoRA layers it cannot fuse stay PEFT's, with a warning naming
  them and the reason.

Everything else runs transformers' code: the norms, RoPE, the MLP's activation and attention. Under
``torch.compile(model, backend="fastops_inductor")`` the backend's graph passes fuse the norms (the
residual adds included), RoPE and the GLU, rewrite attention on causal and packed-document masks, and
mark norm outputs for recomputation in the backward, in the patched model exactly as in an unpatched
one; run eagerly, those parts are transformers' eager code.

Each patch is an instance attribute (the module's ``forward``, and the ``_fastops_*`` settings it
reads): no class, function or module attribute of transformers or PEFT is replaced, so every other
model in the process runs as it would without ``inductor_ext``, and ``torch.compile``/``torch.export``
trace our ops. Anything that cannot be patched (an unknown family, a module whose ``forward`` was
already replaced, e.g. by an accelerate hook) is left as it is with a warning naming it.
:func:`unapply` (or leaving :func:`patched`) restores the model.
"""

import contextlib
import dataclasses
import importlib
import types
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from inductor_ext.models import forwards, peft_lora
from inductor_ext.models.families import ACTIVATIONS, FAMILIES, GATED_PROJECTIONS, Family
from inductor_ext.ops.fused_linear_cross_entropy import WEIGHT_GRAD_ACCUMULATIONS, WeightGradAccumulation


class PatchWarning(UserWarning):
    """A part of the model that :func:`apply` could not patch (the message names it)."""


@dataclasses.dataclass
class PatchReport:
    """What :func:`apply` did to one model."""

    family: str | None
    loss: bool = False
    """The causal LM's training calls with labels run the fused LM head + loss."""
    lora: list[str] = dataclasses.field(default_factory=list)
    """PEFT LoRA layers running the fused ``lora_linear``."""
    lora_mlps: list[str] = dataclasses.field(default_factory=list)
    """MLPs running as one fused ``lora_mlp``."""
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    """Module name (or what) -> why it was left as it is."""

    def __bool__(self) -> bool:
        return bool(self.loss or self.lora)


@dataclasses.dataclass
class _Patched:
    report: PatchReport
    instances: list[tuple[torch.nn.Module, tuple[str, ...]]]
    """(module, instance attributes set on it)."""


_PATCHED: "weakref.WeakKeyDictionary[torch.nn.Module, _Patched]" = weakref.WeakKeyDictionary()


def apply(
    model: torch.nn.Module,
    *,
    loss: bool = True,
    lora: bool = True,
    weight_grad_accumulation: WeightGradAccumulation = "fp32",
    loss_chunk_size: int | None = None,
    packed_documents: forwards.PackedDocuments = "hf",
    lora_dtype: peft_lora.LoraDtype = "adapters",
) -> PatchReport:
    """Patch ``model`` in place (see the module docstring); ``loss=False`` and ``lora=False`` turn one part off.

    ``weight_grad_accumulation`` is the fused loss's memory mode for the LM head's gradient
    (:func:`inductor_ext.fused_linear_cross_entropy`): ``"fp32"`` (exact, an fp32 ``(V, H)``
    accumulator) or ``"weight_dtype"`` (accumulated in the weight's dtype, as Liger-Kernel does:
    no accumulator, one rounding per chunk). ``loss_chunk_size`` is its rows of logits per chunk
    (default: the mode's, ``H`` rows for ``"fp32"``, ``H / 4`` for ``"weight_dtype"``): fewer rows
    hold less memory at the loss and read and write the weight gradient more often.

    ``lora_dtype`` is the dtype of the fused LoRA layers' low-rank GEMMs (``x Aᵀ``, ``· Bᵀ`` and their
    gradients) when the adapters' dtype differs from the input's (PEFT's default: float32 adapters
    over a bf16 model):

    - ``"adapters"`` (default): the adapters' dtype, as PEFT's layers compute them (float32, so the
      adapters' gradients are float32-accurate; on CUDA on bf16 tensor cores, from exact bf16 parts:
      :mod:`inductor_ext.ops._split_gemm`); under ``torch.autocast`` the autocast dtype, as PEFT.
    - ``"input"``: the input's dtype (bf16), what autocast would do: the adapters are cast for each
      call and their gradients still arrive in float32. Faster (plain bf16 tensor-core GEMMs, with no
      split into bf16 parts), and the adapters' gradients are rounded to bf16 precision.

    ``lora=False`` leaves PEFT's LoRA layers as they are.

    ``packed_documents`` is how rows packing several documents (``position_ids`` restarting at 0
    at each document, no ``attention_mask``) are masked:

    - ``"hf"`` (default): exactly as transformers masks them for the same call. Beware:
      transformers separates the documents (a block-diagonal causal mask) only when the decoder has
      no KV cache, and it builds one by default (``use_cache`` unset means ``config.use_cache``,
      True for most models, except under gradient checkpointing in training). So its plain training
      call ``model(input_ids, position_ids=packed, labels=labels)`` lets every token attend to the
      earlier documents of its row, a trap when training on packed rows: pass ``use_cache=False``
      or use ``"separate"``. The fused-loss path still builds no KV cache there: the decoder gets
      an empty cache that keeps nothing, so its masks are those of transformers' default cache.
    - ``"separate"``: every call that passes no cache object runs with ``use_cache=False``, whatever
      ``use_cache`` says (no cache is built or returned), so packed documents never attend across
      each other. A call that passes a cache (``generate()`` does) is masked as transformers masks
      it. With ``loss=False`` the causal LM's forward is still patched, to do this.

    Returns a :class:`PatchReport`; what was left alone is also reported by :class:`PatchWarning`s.
    Raises ``ValueError`` if the model is already patched, ``TypeError`` if it is not a module.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"inductor_ext.models.apply: model must be a torch.nn.Module, got {type(model).__name__}")
    if weight_grad_accumulation not in WEIGHT_GRAD_ACCUMULATIONS:
        raise ValueError(
            f"inductor_ext.models.apply: weight_grad_accumulation must be one of {WEIGHT_GRAD_ACCUMULATIONS}, "
            f"got {weight_grad_accumulation!r}"
        )
    if loss_chunk_size is not None and (
        not isinstance(loss_chunk_size, int) or isinstance(loss_chunk_size, bool) or loss_chunk_size < 1
    ):
        raise ValueError(
            f"inductor_ext.models.apply: loss_chunk_size must be None or a positive int, got {loss_chunk_size!r}"
        )
    if not isinstance(lora_dtype, str) or lora_dtype not in peft_lora.LORA_DTYPES:
        raise ValueError(
            f"inductor_ext.models.apply: lora_dtype must be one of {peft_lora.LORA_DTYPES}, got {lora_dtype!r}"
        )
    if not isinstance(packed_documents, str) or packed_documents not in forwards.PACKED_DOCUMENTS:
        raise ValueError(
            f"inductor_ext.models.apply: packed_documents must be one of {forwards.PACKED_DOCUMENTS}, "
            f"got {packed_documents!r}"
        )
    hf_model = _unwrap(model)
    if hf_model in _PATCHED:
        raise ValueError(f"inductor_ext.models.apply: {type(hf_model).__name__} is already patched")
    model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    report = PatchReport(family=model_type if family else None)
    if family is None:
        known = ", ".join(sorted(FAMILIES))
        _warn(report, type(hf_model).__name__, f"unknown model family {model_type!r} (known: {known}); nothing patched")
        return report
    model_type = str(model_type)
    try:
        modeling = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
    except ImportError as error:
        _warn(report, model_type, f"transformers has no modeling_{family.module} ({error}); nothing patched")
        return report
    classes = {name: getattr(modeling, name, None) for name in (family.mlp, family.causal_lm)}
    missing = [name for name, cls in classes.items() if cls is None]
    if missing:
        _warn(report, model_type, f"this transformers lacks {', '.join(missing)}; nothing patched")
        return report
    patched = _PATCHED[hf_model] = _Patched(report, [])  # from here on unapply restores what was done

    if lora:
        activation = getattr(hf_model.config, family.activation_attribute, None)
        for name, module in hf_model.named_modules():
            if type(module) is classes[family.mlp]:
                _patch_lora_mlp(patched, name, module, family, activation)
            elif peft_lora.is_lora_layer(module):
                _patch_lora_layer(patched, name, module, lora_dtype)
    if loss or packed_documents != "hf":
        if type(hf_model) is classes[family.causal_lm]:
            decoder = getattr(hf_model, "model", None)
            attributes = {
                "_fastops_family": family,
                "_fastops_fused_loss": loss,
                "_fastops_weight_grad_accumulation": weight_grad_accumulation,
                "_fastops_loss_chunk_size": loss_chunk_size,
                "_fastops_packed_documents": packed_documents,
                "_fastops_mask_only_cache": forwards.mask_only_cache_class(),
                "_fastops_cache_argument": forwards.decoder_cache_argument(decoder) if decoder is not None else None,
            }
            if _set_forward(patched, "", hf_model, forwards.causal_lm_forward, by_keyword=True, **attributes):
                report.loss = loss
        else:
            what = "; ".join(
                (["the loss is left as it is"] if loss else [])
                + ([f"packed_documents={packed_documents!r} is not applied"] if packed_documents != "hf" else [])
            )
            _warn(report, type(hf_model).__name__, f"not a {family.causal_lm}: {what}")
    return report


def unapply(model: torch.nn.Module) -> None:
    """Undo :func:`apply` on ``model`` (the same object, or its PEFT wrapper)."""
    hf_model = _unwrap(model)
    patched = _PATCHED.pop(hf_model, None)
    if patched is None:
        raise ValueError(f"inductor_ext.models.unapply: {type(hf_model).__name__} is not patched")
    for module, attributes in patched.instances:
        for attribute in attributes:
            delattr(module, attribute)


@contextlib.contextmanager
def patched(model: torch.nn.Module, **switches: Any) -> Iterator[PatchReport]:
    """``with patched(model) as report:`` :func:`apply` on entry, :func:`unapply` on exit (when
    :func:`apply` patched anything: an unknown family is left unmarked)."""
    report = apply(model, **switches)
    try:
        yield report
    finally:
        if _unwrap(model) in _PATCHED:
            unapply(model)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT ``PeftModel`` (``get_base_model()``), else ``model``."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _warn(report: PatchReport, what: str, why: str) -> None:
    report.skipped[what or "model"] = why
    warnings.warn(f"inductor_ext.models.apply: {what or 'model'}: {why}", PatchWarning, stacklevel=3)


def _set_forward(
    patched: _Patched, name: str, module: torch.nn.Module, forward: Any, *, by_keyword: bool = False, **attributes: Any
) -> bool:
    """Give ``module`` (this instance only) ``forward``; ``by_keyword``: a forward that takes the class
    forward's arguments by keyword, bound and inspected as the class's (:func:`forwards.with_class_signature`)."""
    if "forward" in vars(module):
        _warn(patched.report, name, "its forward is already replaced (e.g. by an accelerate hook): left as it is")
        return False
    for attribute, value in attributes.items():
        setattr(module, attribute, value)
    bound = forwards.with_class_signature(module, forward) if by_keyword else types.MethodType(forward, module)
    module.forward = bound  # type: ignore[method-assign]  # per instance, on purpose
    patched.instances.append((module, ("forward", *attributes)))
    return True


def _patch_lora_mlp(patched: _Patched, name: str, module: torch.nn.Module, family: Family, activation: Any) -> None:
    """One ``lora_mlp`` for the MLP when :func:`_lora_mlp_fusable`; otherwise its LoRA layers are patched one
    by one (they are modules of their own: :func:`apply` reaches them after the MLP)."""
    if not _lora_mlp_fusable(patched, name, module, family.mlp_projections, activation):
        return
    if _set_forward(
        patched, name, module, peft_lora.lora_mlp_forward, _fastops_lora_activation=ACTIVATIONS[activation]
    ):
        patched.report.lora_mlps.append(name)


def _lora_mlp_fusable(
    patched: _Patched, name: str, module: torch.nn.Module, projections: tuple[str, ...], activation: Any
) -> bool:
    """Whether the MLP can run as one ``lora_mlp``: gate, up and down all fusable PEFT LoRA layers with one
    dropout probability, and an activation :data:`~inductor_ext.models.families.ACTIVATIONS` names. When
    some projections are LoRA layers but the MLP does not fit, warns: each fusable LoRA layer then runs
    its own ``lora_linear``."""
    layers: dict[str, Any] = {p: getattr(module, p, None) for p in projections}
    wrapped = [p for p, layer in layers.items() if peft_lora.is_lora_layer(layer)]
    if not wrapped:
        return False
    where = "its projections run one by one (each fusable LoRA layer one lora_linear)"
    if projections != GATED_PROJECTIONS:
        _warn(patched.report, name, f"not one lora_mlp: the packed gate_up_proj is not a lora_mlp input; {where}")
        return False
    reasons = {
        p: "its forward is already replaced" if "forward" in vars(layer) else peft_lora.unfusable_reason(layer)
        for p, layer in layers.items()
        if p in wrapped
    }
    plain = [p for p in projections if p not in wrapped]
    why = "; ".join(f"{p}: {reason}" for p, reason in reasons.items() if reason is not None)
    if plain:
        why = "; ".join(filter(None, [f"{', '.join(plain)} without LoRA", why]))
    if activation not in ACTIVATIONS:
        why = "; ".join(filter(None, [why, f"activation {activation!r} is not one lora_mlp fuses"]))
    if why:
        _warn(patched.report, name, f"not one lora_mlp ({why}); {where}")
        return False
    probabilities = {getattr(layers[p].lora_dropout[layers[p].active_adapters[0]], "p", 0.0) for p in projections}
    if len(probabilities) != 1:  # nn.Identity (PEFT's p = 0) has no p
        _warn(patched.report, name, f"not one lora_mlp (dropout probabilities {sorted(probabilities)} differ); {where}")
        return False
    return True


def _patch_lora_layer(patched: _Patched, name: str, layer: Any, lora_dtype: peft_lora.LoraDtype) -> None:
    reason = peft_lora.unfusable_reason(layer)
    if reason is not None:
        _warn(patched.report, name, f"{reason}: left as PEFT's")
        return
    attributes = {"_fastops_adapter": layer.active_adapters[0], "_fastops_lora_dtype": lora_dtype}
    if _set_forward(patched, name, layer, peft_lora.lora_linear_forward, **attributes):
        patched.report.lora.append(name)
