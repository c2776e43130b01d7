"""The op calls the standalone tuner tunes, and the call-file format that lists them by hand.

A call file (JSON, or YAML when PyYAML is installed) is a list of forward op calls;
each backward is tuned with its forward::

    - op: rms_norm_fwd                      # or fastops::rms_norm_fwd
      args: [{shape: [8192, 4096], dtype: bfloat16}, {shape: [4096], dtype: bfloat16}, 1.0e-6, 0.0, llama]
    - op: cross_entropy_fwd
      args: [{shape: [8192, 128256], dtype: bfloat16}, {shape: [8192], dtype: int64},
             -100, 0.0, 0.0, 0.0, mean]

``args`` follow the op's schema (``torch.ops.fastops.<op>.default._schema``): a tensor
is ``{shape, dtype}`` (row-major) or ``{shape, dtype, stride}`` (another layout, e.g. HF's
q and k, transposed views of (B, S, H, D): ``{shape: [1, 32, 2048, 128], dtype: bfloat16,
stride: [8388608, 128, 4096, 1]}``), an optional tensor may be ``null``, scalars are written as
themselves (a float may be a string, since YAML 1.1 reads ``1e-6`` as one).
"""

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from inductor_ext.library.registration import FAMILIES, OpFamily
from inductor_ext.tuning.timing import meta_templates, signature


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One forward call to tune: the family and its arguments in schema order."""

    family: OpFamily
    args: tuple[Any, ...]
    """Meta tensors (shapes and dtypes only, nothing allocated) and plain values."""

    @property
    def op(self) -> str:
        return self.family.fwd._name

    @property
    def signature(self) -> str:
        return signature(self.args)

    def __str__(self) -> str:
        return f"{self.op.removeprefix('fastops::')}{self.signature}"


def meta_call(family: OpFamily, values: Iterable[Any]) -> OpCall:
    """An :class:`OpCall` from example values (fake, meta or real tensors; symbolic sizes at their hints)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        args = tuple(meta_templates(list(values)))
    return OpCall(family, args)


def dedup(calls: Iterable[OpCall]) -> list[OpCall]:
    """One call per (op, signature), in first-seen order."""
    unique: dict[tuple[str, str], OpCall] = {}
    for call in calls:
        unique.setdefault((call.op, call.signature), call)
    return list(unique.values())


def load_calls(path: Path) -> list[OpCall]:
    """Parse a call file; ``ValueError`` naming the file (and the entry and argument) when malformed."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"call file {path}: cannot read it ({error.strerror})") from error
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise ValueError(
                f"call file {path}: YAML needs the PyYAML package (pip install pyyaml), or write JSON"
            ) from None
        try:
            entries = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ValueError(f"call file {path} is not valid YAML: {error}") from error
    elif path.suffix == ".json":
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"call file {path} is not valid JSON: {error}") from error
    else:
        raise ValueError(f"call file {path}: expected a .json, .yaml or .yml file")
    if not isinstance(entries, list):
        raise ValueError(f"call file {path}: expected a list of {{op, args}} entries, got {type(entries).__name__}")  # noqa: TRY004  (a malformed file)
    return dedup(_parse_entry(entry, f"call file {path}, entry {i}") for i, entry in enumerate(entries))


def _families_by_name() -> dict[str, OpFamily]:
    return {family.fwd._name.removeprefix("fastops::"): family for family in FAMILIES.values()}


def _parse_entry(entry: Any, where: str) -> OpCall:
    if not isinstance(entry, dict) or set(entry) != {"op", "args"}:
        raise ValueError(f"{where}: expected an object with keys 'op' and 'args', got {entry!r}")
    families = _families_by_name()
    family = families.get(str(entry["op"]).removeprefix("fastops::"))
    if family is None:
        raise ValueError(f"{where}: unknown op {entry['op']!r}; forward ops: {', '.join(sorted(families))}")
    schema = family.fwd._schema.arguments
    values = entry["args"]
    if not isinstance(values, list) or len(values) != len(schema):
        raise ValueError(f"{where}: {family.fwd._name} takes {len(schema)} args "
                         f"({', '.join(a.name for a in schema)}), got {values!r}")  # fmt: skip
    args = tuple(_parse_argument(str(a.type), v, f"{where}, argument {a.name!r}") for a, v in zip(schema, values))
    return OpCall(family, args)


_SCALARS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}
"""Schema type (as ``str(argument.type)`` spells it; SymInt reads ``int``) -> accepted Python types."""


def _parse_argument(schema_type: str, value: Any, where: str) -> Any:
    if schema_type in ("Tensor", "Optional[Tensor]"):
        if value is None and schema_type == "Optional[Tensor]":
            return None
        return _parse_tensor(value, where)
    if schema_type == "float" and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{where}: expected a float, got {value!r}") from None
    expected = _SCALARS.get(schema_type)
    if expected is None:
        raise ValueError(f"{where}: arguments of type {schema_type} cannot be written in a call file")
    if not isinstance(value, expected) or (isinstance(value, bool) and schema_type != "bool"):
        raise ValueError(f"{where}: expected {schema_type}, got {value!r}")
    return float(value) if isinstance(value, (int, float)) and schema_type == "float" else value


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value)


def _parse_tensor(value: Any, where: str) -> torch.Tensor:
    """``{shape, dtype}``, or ``{shape, dtype, stride}`` for a tensor that is not row-major."""
    if not isinstance(value, dict) or not {"shape", "dtype"} <= set(value) <= {"shape", "dtype", "stride"}:
        raise ValueError(f"{where}: expected a tensor {{shape: [...], dtype: ...[, stride: [...]]}}, got {value!r}")
    shape = value["shape"]
    if not _int_list(shape):
        raise ValueError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    stride = value.get("stride")
    if stride is not None and not (_int_list(stride) and len(stride) == len(shape)):
        raise ValueError(
            f"{where}: stride must be a list of {len(shape)} non-negative ints (one per dim), got {stride!r}"
        )
    try:
        dtype = parse_dtype(value["dtype"])
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if stride is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def parse_dtype(name: Any) -> torch.dtype:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")  # noqa: TRY004  (a bad value in a file)
    return dtype
