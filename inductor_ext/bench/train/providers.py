"""What ``bench train`` compares: a :class:`Provider` is one way to train the model, built from
orthogonal axes (backend, patch, adapter, data layout, checkpointing, compile options), and
:data:`PRESETS` names the common ones for the command line.

A provider on the command line is a preset's name, a preset with overrides, or overrides alone::

    fastops_inductor
    fastops_inductor,fastops.route=kernel
    backend=fastops_inductor,patch=models.apply,apply.weight_grad_accumulation=weight_dtype

``key=value`` sets a field of :class:`Provider` when ``key`` names one, a keyword of
:func:`inductor_ext.models.apply` when it starts with ``apply.``, and a ``torch.compile`` option
otherwise (``fastops.*``, Inductor's own, ``guard_filter_fn``). Values are read as JSON where they parse
(``true``, ``8``), as strings otherwise.
"""

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, get_args

import torch

from inductor_ext import guards

Backend = Literal["eager", "torch_compile", "fastops_inductor"]
Patch = Literal["none", "models.apply", "liger"]
Adapter = Literal["none", "lora", "qlora"]
Data = Literal["tokens", "packed", "padded"]
Optimizer = Literal["fused", "compiled_foreach"]


@dataclasses.dataclass(frozen=True)
class Provider:
    """One way to train the model.

    - ``backend``: ``eager`` (no compile), ``torch_compile`` (Inductor) or ``fastops_inductor``.
    - ``patch``: ``models.apply`` (:func:`inductor_ext.models.apply` with ``apply_options``, after the
      adapters are added) or ``liger`` (Liger-Kernel's class-level patch of the model family, before
      the model is built; skipped where ``liger_kernel`` is not importable).
    - ``adapter``: PEFT LoRA adapters on every decoder linear layer (``lora``), over an NF4 base
      (``qlora``, :mod:`inductor_ext.bench.train.qlora`; needs ``bitsandbytes``).
    - ``data``: random token rows (``tokens``), packed documents with ``position_ids`` (``packed``) or the
      same documents right-padded with an ``attention_mask`` (``padded``, compiled with ``dynamic=True``).
    - ``gradient_checkpointing``: non-reentrant checkpointing of each decoder layer;
      ``checkpoint_policy`` names a selective policy of :mod:`inductor_ext.models`
      (``keep_lora_mlp_outputs``, ``keep_lora_outputs``) and needs it.
    - ``mode``, ``options``: ``torch.compile``'s (a ``guard_filter_fn`` option names a function of
      :mod:`inductor_ext.guards` or ``torch.compiler``).
    - ``optimizer``: fused AdamW, or a ``foreach`` AdamW whose step is compiled (``compiled_foreach``).
    - ``warm_db``: fill the tuning database with the standalone tuner from the model's config first.
    """

    name: str
    backend: Backend = "eager"
    patch: Patch = "none"
    adapter: Adapter = "none"
    data: Data = "tokens"
    gradient_checkpointing: bool = False
    checkpoint_policy: str | None = None
    mode: str | None = None
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    apply_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    optimizer: Optimizer = "fused"
    warm_db: bool = False

    def __post_init__(self) -> None:
        for field, kind in (("backend", Backend), ("patch", Patch), ("adapter", Adapter), ("data", Data),
                            ("optimizer", Optimizer)):  # fmt: skip
            if getattr(self, field) not in get_args(kind):
                raise ValueError(f"{self.name}: {field} must be one of {', '.join(get_args(kind))}")
        if self.backend == "eager" and (self.mode or self.options):
            raise ValueError(f"{self.name}: mode and options need a compiling backend")
        if self.checkpoint_policy is not None and not self.gradient_checkpointing:
            raise ValueError(f"{self.name}: checkpoint_policy needs gradient_checkpointing")

    @property
    def compiled(self) -> bool:
        return self.backend != "eager"

    @property
    def required_package(self) -> str | None:
        """The optional package this provider needs, if any."""
        if self.patch == "liger":
            return "liger_kernel"
        return "bitsandbytes" if self.adapter == "qlora" else None

    def compile_arguments(self) -> dict[str, Any]:
        """``torch.compile``'s keyword arguments (a fresh copy: ``torch.compile`` pops ``guard_filter_fn``
        from its options), with a ``guard_filter_fn`` given by name resolved."""
        arguments: dict[str, Any] = {}
        if self.backend == "fastops_inductor":
            arguments["backend"] = "fastops_inductor"
        if self.mode is not None:
            arguments["mode"] = self.mode
        if self.data == "padded":
            arguments["dynamic"] = True
        if self.options:
            options = dict(self.options)
            name = options.get("guard_filter_fn")
            if isinstance(name, str):
                options["guard_filter_fn"] = getattr(guards, name, None) or getattr(torch.compiler, name)
            arguments["options"] = options
        return arguments

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "options": dict(self.options), "apply_options": dict(self.apply_options)}

    @classmethod
    def from_json(cls, fields: Mapping[str, Any]) -> "Provider":
        return cls(**fields)


def _preset(name: str, **fields: Any) -> tuple[str, Provider]:
    return name, Provider(name, **fields)


FASTOPS: dict[str, Any] = {"backend": "fastops_inductor"}
APPLY: dict[str, Any] = {"patch": "models.apply"}
CPP_WRAPPER: dict[str, Any] = {"options": {"cpp_wrapper": True}}

PRESETS: dict[str, Provider] = dict([
    _preset("hf_eager"),
    _preset("torch_compile", backend="torch_compile"),
    _preset("fastops_inductor", **FASTOPS),
    _preset("liger_eager", patch="liger"),
    _preset("patched_eager", **APPLY),
    _preset("patched_fastops_inductor", **FASTOPS, **APPLY),
    _preset("patched_fastops_inductor_weight_dtype", **FASTOPS, **APPLY,
            apply_options={"weight_grad_accumulation": "weight_dtype"}),
    _preset("fastops_inductor_kernel", **FASTOPS, options={"fastops.route": "kernel"}),
    _preset("fastops_inductor_no_padding", **FASTOPS, options={"fastops.assume_no_padding": True}),
    _preset("fastops_inductor_no_parameter_guards", **FASTOPS, options={"guard_filter_fn": "skip_parameter_guards"}),
    _preset("torch_compile_cudagraphs", backend="torch_compile", mode="reduce-overhead"),
    _preset("fastops_inductor_cudagraphs", **FASTOPS, mode="reduce-overhead"),
    _preset("fastops_inductor_compiled_adamw", **FASTOPS, optimizer="compiled_foreach"),
    # Inductor's C++ wrapper, with an empty tuning database or one the standalone tuner filled first
    _preset("fastops_inductor_cpp_wrapper", **FASTOPS, **CPP_WRAPPER),
    _preset("fastops_inductor_warm_db", **FASTOPS, warm_db=True),
    _preset("fastops_inductor_cpp_wrapper_warm_db", **FASTOPS, **CPP_WRAPPER, warm_db=True),
    _preset("patched_fastops_inductor_weight_dtype_cpp_wrapper", **FASTOPS, **APPLY, **CPP_WRAPPER,
            apply_options={"weight_grad_accumulation": "weight_dtype"}),
    # LoRA adapters: PEFT's layers, or the PEFT model patched by models.apply (the fused LoRA ops)
    _preset("peft_eager", adapter="lora"),
    _preset("peft_torch_compile", adapter="lora", backend="torch_compile"),
    _preset("peft_fastops_inductor", adapter="lora", **FASTOPS),
    _preset("lora_fused_eager", adapter="lora", **APPLY),
    _preset("lora_fused_fastops_inductor", adapter="lora", **APPLY, **FASTOPS),
    _preset("lora_fused_fastops_inductor_input_dtype", adapter="lora", **APPLY, **FASTOPS,
            apply_options={"lora_dtype": "input"}),
    # the same adapters over an NF4 base
    _preset("qlora_peft_eager", adapter="qlora"),
    _preset("qlora_peft_torch_compile", adapter="qlora", backend="torch_compile"),
    _preset("qlora_fused_eager", adapter="qlora", **APPLY),
    _preset("qlora_fused_fastops_inductor", adapter="qlora", **APPLY, **FASTOPS),
    _preset("qlora_fused_fastops_inductor_input_dtype", adapter="qlora", **APPLY, **FASTOPS,
            apply_options={"lora_dtype": "input"}),
    _preset("qlora_fused_fastops_inductor_keep_mlp", adapter="qlora", **APPLY, **FASTOPS, gradient_checkpointing=True,
            checkpoint_policy="keep_lora_mlp_outputs"),
    _preset("qlora_fused_fastops_inductor_keep_lora", adapter="qlora", **APPLY, **FASTOPS, gradient_checkpointing=True,
            checkpoint_policy="keep_lora_outputs"),
    # documents: padded with an attention_mask, or packed with position_ids
    _preset("hf_eager_padded", data="padded"),
    _preset("fastops_inductor_padded", data="padded", **FASTOPS),
    _preset("hf_eager_packed", data="packed"),
    _preset("torch_compile_packed", data="packed", backend="torch_compile"),
    _preset("fastops_inductor_packed", data="packed", **FASTOPS),
    _preset("patched_fastops_inductor_packed", data="packed", **APPLY, **FASTOPS),
    _preset("patched_eager_packed", data="packed", **APPLY),
    _preset("liger_packed", data="packed", patch="liger"),
])  # fmt: skip
"""Named providers for ``--providers``."""

GROUPS: dict[str, tuple[str, ...]] = {
    "default": ("hf_eager", "torch_compile", "fastops_inductor", "liger_eager"),
    "cpp_wrapper": ("fastops_inductor", "fastops_inductor_cpp_wrapper", "fastops_inductor_warm_db",
                    "fastops_inductor_cpp_wrapper_warm_db"),
    "lora": tuple(name for name, p in PRESETS.items() if p.adapter == "lora"),
    "qlora": tuple(name for name, p in PRESETS.items() if p.adapter == "qlora"),
    "packed": tuple(name for name, p in PRESETS.items() if p.data != "tokens"),
}  # fmt: skip
"""What runs without ``--providers``: the default set, or the set of ``--cpp-wrapper``, ``--lora``,
``--qlora`` or ``--packed``."""

_FIELDS = {field.name: field for field in dataclasses.fields(Provider)}


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_provider(text: str) -> Provider:
    """The provider a ``--providers`` entry names (see the module's docstring); ``ValueError`` if it names none."""
    head, *rest = text.split(",")
    if "=" in head:
        base, assignments = Provider(text), [head, *rest]
    elif head in PRESETS:
        base, assignments = PRESETS[head], rest
    else:
        raise ValueError(f"{head!r} is not a preset ({', '.join(PRESETS)}) nor a key=value setting")
    fields: dict[str, Any] = {}
    options, apply_options = dict(base.options), dict(base.apply_options)
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"{text!r}: {assignment!r} is not key=value")
        if key == "name" or key in ("options", "apply_options"):
            raise ValueError(f"{text!r}: {key} cannot be set (set its entries one by one)")
        if key in _FIELDS:
            fields[key] = _value(raw)
        elif key.startswith("apply."):
            apply_options[key.removeprefix("apply.")] = _value(raw)
        else:
            options[key] = _value(raw)
    return dataclasses.replace(base, name=text, options=options, apply_options=apply_options, **fields)


def with_checkpointing(provider: Provider, on: bool) -> Provider:
    """``provider`` with gradient checkpointing on (``--gradient-checkpointing``), else as it is."""
    return dataclasses.replace(provider, gradient_checkpointing=True) if on else provider


def reference(provider: Provider, candidates: Iterable[Provider], backend: Backend) -> Provider | None:
    """The unpatched, option-free provider of ``backend`` that ``provider`` compares with: same adapter and
    checkpointing, and for documents the packed baseline for speed and the same layout for loss (a padded
    run's loss is compared with the eager padded run's)."""
    data = provider.data if backend == "eager" else ("packed" if provider.data != "tokens" else "tokens")
    for candidate in candidates:
        if (candidate.backend, candidate.patch, candidate.adapter, candidate.data) == (backend, "none",
                provider.adapter, data) and not candidate.options and candidate.mode is None:  # fmt: skip
            return candidate
    return None


def checkpoint_context(provider: Provider) -> Callable[[], Any] | None:
    """The selective checkpointing ``context_fn`` ``provider.checkpoint_policy`` names, else None."""
    if provider.checkpoint_policy is None:
        return None
    from inductor_ext import models

    return getattr(models, provider.checkpoint_policy)()
