"""Realistic random inputs for a fastops op call, built from shapes alone.

Timing an op on unrealistic inputs times another kernel: labels all zero make every
row gather the same logit, positions all zero make every token read one table row.
(Inductor's own compile-time autotuning fills integer inputs with zeros.) So every
argument is filled by what it *means*, read from the op's schema:

* floating point: ``randn`` (unit scale: the scale of normalised activations, logits
  and their gradients), in the argument's own strides (a transposed view stays one);
* bool: fair coin flips;
* uint8: uniform bytes. The ops' uint8 tensors are quantised weights (two 4-bit codes a byte,
  absmax constants as indices into a 256-entry table): every byte is a valid value;
* a list of tensors (a quantised weight's constants): each tensor by these same rules;
* integer: by the argument's **name** in the schema, through :data:`INDEX_ARGUMENTS`:

  ``labels``
      uniform in ``[0, V)``, V the classes they index (the last dim of ``logits``,
      or the first of ``weight``, an LM head of shape (V, H)); a fraction
      :data:`IGNORED_FRACTION` of them set to the op's ``ignore_index`` argument
      (-100 when the op has none), as padding and masked prompts are.
  ``position_ids``
      consecutive positions from a random start per sequence (the last dim),
      wrapped into the rows of the ``cos`` table: in range, never all zero.
  ``token_ids``
      uniform in ``[0, V)``, V the rows of the embedding ``weight`` (or ``num_weights``).

An op with an integer argument of another name must name it here (or rename it to a
convention); :func:`random_inputs` raises a ``ValueError`` naming the op and argument
rather than guess.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._ops import OpOverload

from inductor_ext.tuning.timing import meta_like, size_hint

IGNORED_FRACTION = 0.1
"""Fraction of labels set to ``ignore_index``."""

IndexRule = Callable[[list[int], torch.dtype, torch.device, Mapping[str, Any]], torch.Tensor]
"""``(shape, dtype, device, the call's arguments by name) -> integer tensor``."""


def _labels(shape: list[int], dtype: torch.dtype, device: torch.device, bound: Mapping[str, Any]) -> torch.Tensor:
    if "logits" in bound:
        classes = size_hint(bound["logits"].shape[-1])
    elif "weight" in bound:
        classes = size_hint(bound["weight"].shape[0])
    else:
        raise ValueError("labels need a `logits` or `weight` argument to give the number of classes")
    labels = torch.randint(0, max(classes or 1, 1), shape, dtype=dtype, device=device)
    ignored = torch.rand(shape, device=device) < IGNORED_FRACTION
    return labels.masked_fill(ignored, int(bound.get("ignore_index", -100)))


def _position_ids(shape: list[int], dtype: torch.dtype, device: torch.device, bound: Mapping[str, Any]) -> torch.Tensor:
    if not isinstance(bound.get("cos"), torch.Tensor):
        raise ValueError("position_ids need a `cos` table argument to give the number of positions")  # noqa: TRY004
    rows = max(size_hint(bound["cos"].shape[0]) or 1, 1)
    length = shape[-1] if shape else 1
    starts = torch.randint(0, rows, (*shape[:-1], 1), device=device)
    return ((starts + torch.arange(length, device=device)) % rows).to(dtype).reshape(shape)


def _token_ids(shape: list[int], dtype: torch.dtype, device: torch.device, bound: Mapping[str, Any]) -> torch.Tensor:
    if isinstance(bound.get("weight"), torch.Tensor):
        rows = size_hint(bound["weight"].shape[0])
    elif "num_weights" in bound:
        rows = int(bound["num_weights"])
    else:
        raise ValueError("token_ids need a `weight` or `num_weights` argument to give the number of rows")
    return torch.randint(0, max(rows or 1, 1), shape, dtype=dtype, device=device)


INDEX_ARGUMENTS: dict[str, IndexRule] = {"labels": _labels, "position_ids": _position_ids, "token_ids": _token_ids}
"""Integer argument name (in op schemas) -> how to fill it."""


def random_inputs(op: OpOverload, args: Sequence[Any], device: torch.device | str | None = None) -> list[Any]:
    """Fresh random tensors shaped like ``args``' tensors (real, fake or meta) for a call of ``op``.

    Non-tensor arguments pass through. Tensors are made on ``device`` (default: each
    argument's own device).
    """
    names = [argument.name for argument in op._schema.arguments]
    if len(args) != len(names):
        raise ValueError(f"{op._name}: expected {len(names)} arguments ({', '.join(names)}), got {len(args)}")
    bound = dict(zip(names, args))
    return [_random_argument(op, name, value, bound, device) for name, value in bound.items()]


def _random_argument(
    op: OpOverload, name: str, value: Any, bound: Mapping[str, Any], device: torch.device | str | None
) -> Any:
    if isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
        return [_random_argument(op, f"{name}[{i}]", item, bound, device) for i, item in enumerate(value)]
    if not isinstance(value, torch.Tensor):
        return value
    try:
        template = meta_like(value)
    except ValueError:
        raise ValueError(
            f"{op._name}: cannot build argument {name!r} of data-dependent shape {tuple(value.shape)}"
        ) from None
    shape = list(template.shape)
    target = torch.device(device) if device is not None else value.device
    if value.dtype.is_floating_point:
        if template.is_contiguous():
            return torch.randn(shape, dtype=value.dtype, device=target)
        # the argument's own layout (a transposed view, a broadcast table): one random storage
        # as long as the layout needs (the meta template's), viewed with its strides
        span = template.untyped_storage().nbytes() // template.element_size()
        return torch.randn(span, dtype=value.dtype, device=target).as_strided(shape, template.stride())
    if value.dtype == torch.bool:
        return torch.rand(shape, device=target) < 0.5
    if value.dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=target)
    rule = INDEX_ARGUMENTS.get(name)
    if rule is None:
        raise ValueError(f"{op._name}: no rule for integer argument {name!r}; "
                         f"name it one of {sorted(INDEX_ARGUMENTS)} or add a rule to inductor_ext.tuning.inputs.INDEX_ARGUMENTS")  # fmt: skip
    try:
        return rule(shape, value.dtype, target, bound)
    except ValueError as error:
        raise ValueError(f"{op._name}: argument {name!r}: {error}") from error
