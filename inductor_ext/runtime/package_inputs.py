"""What a package's model takes, recorded at export and checked on every call from Python.

An AOTInductor model reads its inputs as the exported example's shapes, dtypes and layout without
checking them (unless built with ``AOTI_RUNTIME_CHECK_INPUTS``): a model exported for a batch of 2 and
called with 3 returns 3 rows, the last one garbage, with only torch's "output was resized" warning.
:func:`record_inputs` writes, for each flattened user input, its dtype, device type and sizes (static
ones, and each dynamic one's range from the program's ``range_constraints``) as a compact JSON string
under the package metadata key :data:`METADATA_KEY`; :class:`ExpectedInputs` reads it once when the
package is loaded and checks each call with Python compares of sizes, dtypes and devices only (no
tensor op, no host sync: it runs per decode step of the generation loop, so its cost is host time of
every step). A package without the record (exported by an older version) is not checked.
"""

import json
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.export.graph_signature import InputKind, TensorArgument
from torch.utils import _pytree as pytree
from torch.utils._sympy.value_ranges import bound_sympy

METADATA_KEY = "inductor_ext.inputs"
"""The package metadata entry (of each model of the package) that holds :func:`record_inputs`' JSON."""

Size = int | list[Any]
"""A recorded size: an int where static, ``[min, max or None, symbol or None]`` where dynamic."""


def _recorded_size(size: Any, ranges: Mapping[Any, Any]) -> Size:
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if expr.is_number:
        return int(expr)
    bounds = bound_sympy(expr, dict(ranges))
    lower = 0 if math.isinf(bounds.lower) else int(bounds.lower)
    upper = None if math.isinf(bounds.upper) else int(bounds.upper)
    # export gives a dimension it did not specialise at 0 or 1 a lower bound of 2 (its sizes are assumed
    # not to be 0 or 1, as AOTInductor's own `check_lowerbound` option notes), though the model runs at 1:
    # the generation packages' dynamic graph decodes one token at a time
    if lower == 2:
        lower = 1
    return [lower, upper, str(expr) if expr.is_Symbol else None]


def record_inputs(program: torch.export.ExportedProgram) -> str | None:
    """The JSON record of ``program``'s user inputs: ``{"args": [leaves, ...], "kwargs": {name: leaves}}``,
    where an argument's leaves are its pytree leaves in order, each ``null`` (not a tensor) or
    ``{"shape": [size, ...], "dtype": ..., "device": ..., "path": ...}`` (``path``: the leaf's place in
    its argument, e.g. ``"[3]"``, for an argument that is not one tensor). None where the program's
    inputs do not line up with its call spec (then nothing is recorded)."""
    in_spec = program.call_spec.in_spec
    user_inputs = [spec.arg for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    if in_spec is None or in_spec.num_leaves != len(user_inputs):
        return None
    values = {node.name: node.meta.get("val") for node in program.graph.nodes if node.op == "placeholder"}

    def leaf(index: int, path: tuple[Any, ...]) -> dict[str, Any] | None:
        argument = user_inputs[index]
        value = values.get(argument.name) if isinstance(argument, TensorArgument) else None
        if not isinstance(value, Tensor):
            return None
        found = {
            "shape": [_recorded_size(size, program.range_constraints) for size in value.shape],
            "dtype": str(value.dtype).removeprefix("torch."),
            "device": value.device.type,
        }
        return {**found, "path": pytree.keystr(path)} if path else found

    def leaves(argument: Any) -> list[dict[str, Any] | None]:
        return [leaf(index, path) for path, index in pytree.tree_flatten_with_path(argument)[0]]

    # the call spec's leaves numbered in order: each argument's leaves are the indices of its user inputs
    args, kwargs = pytree.tree_unflatten(list(range(in_spec.num_leaves)), in_spec)
    record = {"args": [leaves(a) for a in args], "kwargs": {name: leaves(a) for name, a in kwargs.items()}}
    return json.dumps(record, separators=(",", ":"))


def check_contiguous(label: str, tensor: Tensor) -> None:
    """Refuse a non-contiguous ``tensor``: the package reads it in its example's contiguous layout."""
    if not tensor.is_contiguous():
        raise ValueError(
            f"inductor_ext package: {label} must be contiguous, got strides {tensor.stride()} for shape "
            f"{tuple(tensor.shape)} (the package reads inputs in its example's contiguous layout; "
            "call .contiguous() first)"
        )


class _Dynamic(NamedTuple):
    dim: int
    lower: int
    upper: int | None
    symbol: str | None


class _Expected(NamedTuple):
    """One tensor input: its sizes, precomputed for the per-call compare."""

    label: str
    rank: int
    shape: tuple[int, ...] | None
    """Every size, where all are static (one tuple compare)."""
    static: tuple[tuple[int, int], ...]
    """(dimension, size) of the static sizes."""
    dynamic: tuple[_Dynamic, ...]
    dtype: torch.dtype
    device: str
    on_device: Callable[[Tensor], bool]
    text: str
    """The expected shape as the error messages print it, e.g. ``(1..4, 16)``."""


def _expected(label: str, leaf: Mapping[str, Any]) -> _Expected:
    sizes: list[Size] = leaf["shape"]
    static = tuple((dim, size) for dim, size in enumerate(sizes) if isinstance(size, int))
    dynamic = tuple(_Dynamic(dim, *size) for dim, size in enumerate(sizes) if not isinstance(size, int))
    device = leaf["device"]
    # `tensor.device.type` builds a device object on every call; `tensor.is_cpu` (and friends) reads a flag
    flag = f"is_{device}"
    on_device = operator.attrgetter(flag) if hasattr(Tensor, flag) else lambda t: t.device.type == device
    text = ", ".join(str(s) if isinstance(s, int) else f"{s[0]}..{'' if s[1] is None else s[1]}" for s in sizes)
    return _Expected(
        label=label,
        rank=len(sizes),
        shape=None if dynamic else tuple(s for _, s in static),
        static=static,
        dynamic=dynamic,
        dtype=getattr(torch, leaf["dtype"]),
        device=device,
        on_device=on_device,
        text=f"({text}{',' if len(sizes) == 1 else ''})",
    )


def _leaves(value: Any) -> Sequence[Any]:
    if isinstance(value, Tensor):
        return (value,)
    if type(value) in (list, tuple) and all(isinstance(v, Tensor) for v in value):
        return value  # type: ignore[no-any-return]  # a list or tuple of tensors
    return pytree.tree_leaves(value)


class ExpectedInputs:
    """A package model's recorded inputs (:func:`record_inputs`), checked by :meth:`check`."""

    def __init__(self, record: str) -> None:
        found = json.loads(record)

        def arguments(label: str, leaves: list[Any]) -> tuple[_Expected | None, ...]:
            return tuple(None if leaf is None else _expected(label + leaf.get("path", ""), leaf) for leaf in leaves)

        self._args = tuple(arguments(f"argument {i}", leaves) for i, leaves in enumerate(found["args"]))
        self._kwargs = {name: arguments(name, leaves) for name, leaves in found["kwargs"].items()}

    @classmethod
    def of(cls, metadata: Mapping[str, str]) -> "ExpectedInputs | None":
        """The record in a package model's metadata, or None where it has none."""
        record = metadata.get(METADATA_KEY)
        return None if record is None else cls(record)

    def check(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Raise a ValueError naming the first input that is not as recorded (the positional count, a
        tensor's device type, dtype, rank, static sizes, dynamic sizes' ranges, sizes that are one
        dimension of the program in several inputs, or its layout; a TypeError for a non-tensor)."""
        if len(args) != len(self._args):
            raise ValueError(
                f"inductor_ext package: was exported with {len(self._args)} positional arguments, got {len(args)}"
            )
        seen: dict[str, tuple[int, str, int]] = {}
        for index, value in enumerate(args):
            self._check_argument(f"argument {index}", self._args[index], value, seen)
        for name, value in kwargs.items():
            expected = self._kwargs.get(name)
            if expected is not None:  # an unknown keyword: the loader names it
                self._check_argument(name, expected, value, seen)

    @staticmethod
    def _check_argument(
        label: str, expected: tuple[_Expected | None, ...], value: Any, seen: dict[str, tuple[int, str, int]]
    ) -> None:
        leaves = _leaves(value)
        if len(leaves) != len(expected):
            raise ValueError(
                f"inductor_ext package: {label} must hold {len(expected)} values as exported, got {len(leaves)}"
            )
        for want, tensor in zip(expected, leaves):
            if want is None:
                continue
            if not isinstance(tensor, Tensor):
                raise TypeError(f"inductor_ext package: {want.label} must be a tensor, got {type(tensor).__name__}")
            if not want.on_device(tensor):
                raise ValueError(f"inductor_ext package: {want.label} must be on {want.device}, got {tensor.device}")
            if tensor.dtype != want.dtype:
                raise ValueError(f"inductor_ext package: {want.label} must be {want.dtype}, got {tensor.dtype}")
            shape = tensor.shape
            if want.shape is not None:
                if shape != want.shape:
                    _wrong_shape(want, shape)
            else:
                _check_sizes(want, shape, seen)
            check_contiguous(want.label, tensor)


def _wrong_shape(want: _Expected, shape: torch.Size, why: str = "") -> None:
    raise ValueError(f"inductor_ext package: {want.label} must have shape {want.text}, got {tuple(shape)}{why}")


def _check_sizes(want: _Expected, shape: torch.Size, seen: dict[str, tuple[int, str, int]]) -> None:
    if len(shape) != want.rank:
        _wrong_shape(want, shape)
    for dim, size in want.static:
        if shape[dim] != size:
            _wrong_shape(want, shape)
    for dim, lower, upper, symbol in want.dynamic:
        size = shape[dim]
        if size < lower or (upper is not None and size > upper):
            _wrong_shape(want, shape, f" (size {size} at dimension {dim} is outside the exported range)")
        if symbol is not None:
            first = seen.setdefault(symbol, (size, want.label, dim))
            if first[0] != size:
                _wrong_shape(
                    want,
                    shape,
                    f" (size {size} at dimension {dim}, where {first[1]} has {first[0]} at dimension {first[2]}: "
                    "the exported program has one size for both)",
                )
