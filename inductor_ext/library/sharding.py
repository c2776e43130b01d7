"""DTensor sharding rules: an op file declares its op's rule beside the op (:func:`sharding_rule`), and
:func:`register_sharding_rules` hands every recorded rule to DTensor, so tensor- and sequence-parallel
plans run the fastops ops on each rank's local shards.

A rule is called by DTensor with the op's arguments (tensors as their ``DTensorSpec``, which has
``shape`` and ``ndim``; None for an absent optional tensor) and returns a list of strategies. A
strategy gives, for one mesh dimension, the placements (:data:`Strategy`) under which the op applied
to each rank's local shards gives the shards of the unsharded op's result; DTensor expands them over
every mesh dimension and redistributes inputs placed otherwise to the cheapest listed strategy.
Everything replicated is always allowed: each rule lists :func:`replicated` first. A rule states in
its docstring which placements it lists and why the others are left out.

Rules are registered through ``torch.distributed.tensor.experimental.register_sharding`` when
:mod:`inductor_ext.ops` is imported. Every rule is checked against the unsharded op on a 2-rank gloo
mesh (``tests/distributed/test_sharding.py``); the table of rules is in ``docs/distributed.md``.

The in-place ops (``rope_inplace``, ``cross_entropy_bwd_inplace``, ``accumulate_matmul_``), the LoRA ops
and ``sum_of_products`` (which only the backend's post-grad pass calls, on the local tensors of a
traced graph) have no rules.

Example, in an op file after the op's family is defined::

    @sharding_rule(rms_norm_family.fwd)
    def _rms_norm_fwd_sharding(x: Any, weight: Any, eps: float, offset: float, casting: str) -> list[Strategy]:
        from torch.distributed.tensor import Shard

        inputs = (x, weight)
        return [replicated(2, inputs), ([Shard(0), Shard(0)], shard_inputs(0, inputs, (True, False)))]

Recording imports nothing of ``torch.distributed``; the placement helpers import it when a rule runs.
"""

import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch._ops import OpOverload

Placements = list[Any]
"""One strategy half: a placement per output (or per input, None for an absent optional tensor)."""

Strategy = tuple[Placements, Placements]
"""(output placements, input placements): one way to run the op on local shards of one mesh dimension."""

ShardingRule = Callable[..., list[Strategy]]
"""The op's arguments -> the strategies DTensor may pick from."""

RULES: dict[OpOverload, ShardingRule] = {}
"""Op overload -> its sharding rule, filled by :func:`sharding_rule` as the op files are imported."""

_registered: set[OpOverload] = set()
"""Ops whose rules :func:`register_sharding_rules` has handed to DTensor (or failed to, with a warning)."""

Rule = TypeVar("Rule", bound=ShardingRule)


def sharding_rule(*ops: OpOverload | str) -> Callable[[Rule], Rule]:
    """Record the decorated function as the DTensor sharding rule of each of ``ops`` (overloads such as
    ``rms_norm_family.fwd``, or qualified names such as ``"fastops::rope_bwd"``, ``.default`` unless an
    overload is named). An op has one rule; one rule may serve several ops with the same arguments."""
    overloads = [_overload(op) for op in ops]

    def record(rule: Rule) -> Rule:
        for op in overloads:
            if op in RULES:
                raise ValueError(f"{op} already has a sharding rule ({RULES[op].__qualname__})")
            RULES[op] = rule
        return rule

    return record


def _overload(op: OpOverload | str) -> OpOverload:
    if isinstance(op, OpOverload):
        return op
    namespace, _, name = op.partition("::")
    packet_name, _, overload_name = name.partition(".")
    overload = getattr(getattr(getattr(torch.ops, namespace), packet_name), overload_name or "default")
    assert isinstance(overload, OpOverload)
    return overload


def register_sharding_rules() -> None:
    """Register with DTensor every recorded rule not registered yet (a no-op where torch is built without
    distributed). A rule that a torch with a different DTensor API refuses is skipped with a warning."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor.experimental import register_sharding

    for op, rule in RULES.items():
        if op in _registered:
            continue
        _registered.add(op)
        try:
            register_sharding(op)(rule)
        except (TypeError, AttributeError, RuntimeError, ValueError) as error:
            warnings.warn(f"inductor_ext: no DTensor sharding rule for {op} ({error!r})", stacklevel=2)


def replicated(outputs: int, inputs: Sequence[Any]) -> Strategy:
    """Every one of ``outputs`` outputs and every present input tensor replicated."""
    from torch.distributed.tensor import Replicate

    return [Replicate()] * outputs, [None if t is None else Replicate() for t in inputs]


def shard_inputs(dim: int, inputs: Sequence[Any], sharded: Sequence[bool]) -> Placements:
    """Input placements: ``Shard(dim)`` where ``sharded``, Replicate for the other present tensors."""
    from torch.distributed.tensor import Replicate, Shard

    return [None if t is None else Shard(dim) if s else Replicate() for t, s in zip(inputs, sharded, strict=True)]


def weight_grad_placement(weight: Any) -> Any:
    """A weight's (or bias's) gradient over token shards: partial sums (``Partial("sum")``); Replicate for
    the ``(0,)`` tensor an op returns without the parameter."""
    from torch.distributed.tensor import Partial, Replicate

    return Replicate() if weight is None else Partial()
