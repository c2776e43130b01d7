"""DTensor sharding rules for the fastops ops, so tensor- and sequence-parallel plans run them locally.

Each rule lists, for one mesh dimension, the placements under which the op applied to each rank's
local shards gives the shards of the unsharded op's result (DTensor expands them over every mesh
dimension and redistributes inputs placed otherwise to the cheapest listed strategy). Registered
through ``torch.distributed.tensor.experimental.register_sharding`` when :mod:`inductor_ext.ops`
is imported. Every rule is checked against the unsharded op on a 2-rank gloo mesh
(``tests/distributed/test_sharding.py``); the table is in ``docs/distributed.md``.

* Row-wise ops (RMSNorm, add+RMSNorm, LayerNorm, GLU): the token rows (dim 0 of the 2-D inputs
  the public functions pass) are sharded, weights replicated; the weight and bias gradients of the
  norms' backward ops are partial sums over the token shards (``Partial("sum")``). GLU is
  elementwise: its two-input form may also be sharded on the intermediate dim (dim 1).
* RoPE: q and k sharded on batch (cos/sin sharded along with them when they carry a batch dim
  larger than 1, replicated otherwise; per-batch position ids sharded along), on the sequence
  (cos/sin rows or position ids sharded along it; a position-id table replicated) or on heads
  (tables replicated).
* Cross-entropy and fused linear cross-entropy: token rows sharded for ``reduction="none"`` and
  ``"sum"`` (the summed loss, and FLCE's weight and bias gradients, partial sums). ``"mean"``
  divides by the number of non-ignored labels of all ranks, which a local op cannot know: its
  only rule is all-replicated. No rule shards the vocabulary: a vocab-sharded softmax needs a
  cross-shard max and sum, which one op strategy cannot express; vocab-sharded logits are
  redistributed to a listed placement here, and :mod:`inductor_ext.ops.vocab_parallel` computes
  both losses on them where they are, with explicit collectives (as ``loss_parallel`` does).

Everything replicated is always allowed. The in-place ops (``rope_inplace``,
``cross_entropy_bwd_inplace``, ``accumulate_matmul_``), the LoRA ops and ``sum_of_products`` (which only
the backend's post-grad pass calls, on the local tensors of a traced graph) have no rules.
"""

import warnings
from collections.abc import Sequence
from typing import Any

import torch

Placements = list[Any]
"""One strategy half: a placement per output (or per input, None for an absent optional tensor)."""
Strategy = tuple[Placements, Placements]


def _ops() -> Any:
    return torch.ops.fastops


def _replicated(outputs: int, inputs: Sequence[Any]) -> Strategy:
    """Every output and every present input tensor replicated."""
    from torch.distributed.tensor import Replicate

    return [Replicate()] * outputs, [None if t is None else Replicate() for t in inputs]


def _on(dim: int, inputs: Sequence[Any], sharded: Sequence[bool]) -> Placements:
    """Input placements: ``Shard(dim)`` where ``sharded``, Replicate for the other present tensors."""
    from torch.distributed.tensor import Replicate, Shard

    return [None if t is None else Shard(dim) if s else Replicate() for t, s in zip(inputs, sharded, strict=True)]


def _weight_grad(weight: Any) -> Any:
    """A norm's weight (or bias) gradient over token shards: partial sums; ``(0,)`` without the parameter."""
    from torch.distributed.tensor import Partial, Replicate

    return Replicate() if weight is None else Partial()


def _rms_norm_fwd(x: Any, weight: Any, eps: float, offset: float, casting: str) -> list[Strategy]:
    from torch.distributed.tensor import Shard

    inputs = (x, weight)
    return [_replicated(2, inputs), ([Shard(0), Shard(0)], _on(0, inputs, (True, False)))]


def _rms_norm_bwd(dy: Any, x: Any, weight: Any, rstd: Any, offset: float, casting: str) -> list[Strategy]:
    from torch.distributed.tensor import Shard

    inputs = (dy, x, weight, rstd)
    return [_replicated(2, inputs), ([Shard(0), _weight_grad(weight)], _on(0, inputs, (True, True, False, True)))]


def _add_rms_norm_fwd(x: Any, residual: Any, weight: Any, eps: float, offset: float, casting: str) -> list[Strategy]:
    from torch.distributed.tensor import Shard

    inputs = (x, residual, weight)
    return [_replicated(3, inputs), ([Shard(0)] * 3, _on(0, inputs, (True, True, False)))]


def _add_rms_norm_bwd(dy: Any, dh: Any, h: Any, weight: Any, rstd: Any, offset: float, casting: str) -> list[Strategy]:
    from torch.distributed.tensor import Shard

    inputs = (dy, dh, h, weight, rstd)
    return [
        _replicated(2, inputs),
        ([Shard(0), _weight_grad(weight)], _on(0, inputs, (True, True, True, False, True))),
    ]


def _layer_norm_fwd(x: Any, weight: Any, bias: Any, eps: float) -> list[Strategy]:
    from torch.distributed.tensor import Shard

    inputs = (x, weight, bias)
    return [_replicated(3, inputs), ([Shard(0)] * 3, _on(0, inputs, (True, False, False)))]


def _layer_norm_bwd(dy: Any, x: Any, weight: Any, bias: Any, mean: Any, rstd: Any) -> list[Strategy]:
    from torch.distributed.tensor import Shard

    inputs = (dy, x, weight, bias, mean, rstd)
    outputs = [Shard(0), _weight_grad(weight), _weight_grad(bias)]
    return [_replicated(3, inputs), (outputs, _on(0, inputs, (True, True, False, False, True, True)))]


def _glu_fwd(gate: Any, up: Any, activation: str) -> list[Strategy]:
    from torch.distributed.tensor import Shard

    inputs = (gate, up)
    return [_replicated(1, inputs)] + [([Shard(d)], _on(d, inputs, (True, True))) for d in (0, 1)]


def _glu_bwd(dy: Any, gate: Any, up: Any, activation: str) -> list[Strategy]:
    from torch.distributed.tensor import Shard

    inputs = (dy, gate, up)
    return [_replicated(2, inputs)] + [([Shard(d)] * 2, _on(d, inputs, (True, True, True))) for d in (0, 1)]


def _glu_packed_fwd(gate_up: Any, activation: str) -> list[Strategy]:
    """Rows only: gate and up are the two halves of the last dim, which a shard of it would split."""
    from torch.distributed.tensor import Shard

    return [_replicated(1, (gate_up,)), ([Shard(0)], [Shard(0)])]


def _glu_packed_bwd(dy: Any, gate_up: Any, activation: str) -> list[Strategy]:
    from torch.distributed.tensor import Shard

    return [_replicated(1, (dy, gate_up)), ([Shard(0)], [Shard(0), Shard(0)])]


def _rope(q: Any, k: Any, cos: Any, sin: Any, position_ids: Any, unsqueeze_dim: int) -> list[Strategy]:
    """rope_fwd and rope_bwd (same arguments: the gradients of the embeddings in place of q and k).

    q, k: ``(B, H, S, D)`` (``unsqueeze_dim=1``) or ``(B, S, H, D)`` (``unsqueeze_dim=2``).
    Tables: ``(S, R)`` or ``(B or 1, S, R)``; with position ids (``(S,)``, ``(1, S)``, ``(B, S)``)
    a ``(P, R)`` table indexed by them.
    """
    from torch.distributed.tensor import Replicate, Shard

    tables = (cos, sin, position_ids)
    head_dim, seq_dim = (1, 2) if unsqueeze_dim == 1 else (2, 1)

    def strategy(qk_dim: int, table_placements: Sequence[Any]) -> Strategy:
        return [Shard(qk_dim)] * 2, [Shard(qk_dim), Shard(qk_dim), *table_placements]

    replicated_tables = [None if t is None else Replicate() for t in tables]
    if position_ids is None:
        per_batch = cos.ndim == 3 and cos.shape[0] > 1
        batch_tables: list[Any] = [Shard(0) if per_batch else Replicate()] * 2 + [None]
        seq_tables: list[Any] = [Shard(cos.ndim - 2)] * 2 + [None]
    else:
        per_batch = position_ids.ndim == 2 and position_ids.shape[0] > 1
        batch_tables = [Replicate(), Replicate(), Shard(0) if per_batch else Replicate()]
        seq_tables = [Replicate(), Replicate(), Shard(position_ids.ndim - 1)]
    return [
        _replicated(2, (q, k, *tables)),
        strategy(0, batch_tables),
        strategy(seq_dim, seq_tables),
        strategy(head_dim, replicated_tables),
    ]


def _rows_loss(reduction: str) -> Any:
    """The loss over token shards: per-row shards (``"none"``) or a partial sum (``"sum"``)."""
    from torch.distributed.tensor import Partial, Shard

    return Shard(0) if reduction == "none" else Partial()


def _cross_entropy_fwd(
    logits: Any, labels: Any, ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float,
    reduction: str,
) -> list[Strategy]:  # fmt: skip
    from torch.distributed.tensor import Shard

    inputs = (logits, labels)
    strategies = [_replicated(2, inputs)]
    if reduction != "mean":
        strategies.append(([_rows_loss(reduction), Shard(0)], _on(0, inputs, (True, True))))
    return strategies


def _cross_entropy_bwd(
    grad_output: Any, logits: Any, labels: Any, lse: Any, ignore_index: int, label_smoothing: float,
    lse_square_scale: float, softcap: float, reduction: str,
) -> list[Strategy]:  # fmt: skip
    from torch.distributed.tensor import Shard

    inputs = (grad_output, logits, labels, lse)
    strategies = [_replicated(1, inputs)]
    if reduction != "mean":  # "sum": one replicated scale; "none": a gradient per row
        strategies.append(([Shard(0)], _on(0, inputs, (reduction == "none", True, True, True))))
    return strategies


def _flce_grads(bias: Any, reduction: str, grads: Sequence[bool]) -> Placements:
    """FLCE's (dhidden, dweight, dbias) over token shards; ``(0,)`` tensors (not computed) replicated."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    grad_h, grad_w, grad_b = grads
    return [
        Shard(0) if grad_h else Replicate(),
        Partial() if grad_w else Replicate(),
        Partial() if grad_b and bias is not None else Replicate(),
    ]


def _flce_fwd(
    hidden: Any, weight: Any, labels: Any, bias: Any, ignore_index: int, label_smoothing: float,
    lse_square_scale: float, softcap: float, reduction: str, chunk_size: int, weight_grad_accumulation: str,
    grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> list[Strategy]:  # fmt: skip
    """The forward computes the gradients for ``"sum"`` (scaled in the backward), nothing for ``"none"``."""
    from torch.distributed.tensor import Replicate

    inputs = (hidden, weight, labels, bias)
    strategies = [_replicated(4, inputs)]
    if reduction != "mean":
        grads = (grad_hidden, grad_weight, grad_bias)
        grad_placements = _flce_grads(bias, reduction, grads) if reduction == "sum" else [Replicate()] * 3
        strategies.append(([_rows_loss(reduction), *grad_placements], _on(0, inputs, (True, False, True, False))))
    return strategies


def _flce_bwd(
    grad_output: Any, hidden: Any, weight: Any, labels: Any, bias: Any, dhidden: Any, dweight: Any, dbias: Any,
    ignore_index: int, label_smoothing: float, lse_square_scale: float, softcap: float, reduction: str,
    chunk_size: int, weight_grad_accumulation: str, grad_hidden: bool, grad_weight: bool, grad_bias: bool,
) -> list[Strategy]:  # fmt: skip
    """``"none"`` recomputes from (grad_output, hidden, weight, labels, bias), the saved gradients being
    ``(0,)``; ``"sum"`` scales the saved gradients by grad_output, the other tensors being ``(0,)``."""
    from torch.distributed.tensor import Replicate

    inputs = (grad_output, hidden, weight, labels, bias, dhidden, dweight, dbias)
    strategies = [_replicated(3, inputs)]
    if reduction != "mean":
        grads = _flce_grads(bias, reduction, (grad_hidden, grad_weight, grad_bias))
        if reduction == "none":
            sharded = _on(0, inputs, (True, True, False, True, False, False, False, False))
        else:
            sharded = [None if t is None else Replicate() for t in inputs[:5]] + grads  # (0,) but the gradients
        strategies.append((grads, sharded))
    return strategies


def register() -> None:
    """Register every rule with DTensor (a no-op where torch is built without distributed)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor.experimental import register_sharding

    ops = _ops()
    rules = {
        ops.rms_norm_fwd.default: _rms_norm_fwd,
        ops.rms_norm_bwd.default: _rms_norm_bwd,
        ops.add_rms_norm_fwd.default: _add_rms_norm_fwd,
        ops.add_rms_norm_bwd.default: _add_rms_norm_bwd,
        ops.layer_norm_fwd.default: _layer_norm_fwd,
        ops.layer_norm_bwd.default: _layer_norm_bwd,
        ops.glu_fwd.default: _glu_fwd,
        ops.glu_bwd.default: _glu_bwd,
        ops.glu_packed_fwd.default: _glu_packed_fwd,
        ops.glu_packed_bwd.default: _glu_packed_bwd,
        ops.rope_fwd.default: _rope,
        ops.rope_bwd.default: _rope,
        ops.cross_entropy_fwd.default: _cross_entropy_fwd,
        ops.cross_entropy_bwd.default: _cross_entropy_bwd,
        ops.fused_linear_cross_entropy_fwd.default: _flce_fwd,
        ops.fused_linear_cross_entropy_bwd.default: _flce_bwd,
    }
    for op, rule in rules.items():
        try:
            register_sharding(op)(rule)
        except (TypeError, AttributeError, RuntimeError, ValueError) as error:  # a torch whose DTensor API differs
            warnings.warn(f"inductor_ext: no DTensor sharding rule for {op} ({error!r})", stacklevel=2)
