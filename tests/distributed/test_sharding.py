"""The DTensor sharding rules (declared in the op files, :mod:`inductor_ext.library.sharding`) against the unsharded
ops, on 2 ranks.

Each case distributes full fp32 inputs over a 1-D gloo mesh of 2 CPU ranks, runs the public
function forward and backward on the DTensors and compares every output and input gradient
(``full_tensor()``) with the same call on the full tensors. A case that expects a local rule
asserts the outputs' placements and that the forward made no collective call, so a rule that
is missing (DTensor would replicate) or wrong fails. Row counts are odd (uneven shards).
"""

import dataclasses
import json
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import results_of_two_ranks

pytestmark = pytest.mark.xdist_group("two_ranks")  # one worker runs the two-rank launches, one at a time


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    call: Callable[..., Any]
    """The public function on the inputs (returns a tensor or a tuple of tensors)."""
    inputs: Callable[[], list[torch.Tensor | None]]
    placements: Sequence[str | None]
    """Per input: ``"R"``, ``"S0"``, ``"S1"``, ... (None for an absent input)."""
    outputs: Sequence[str] | None
    """Expected output placements (``"P"``: a partial sum) with no collective in the forward; None:
    only the numbers are checked (a placement no rule lists, which DTensor redistributes)."""
    constants: tuple[int, ...] = ()
    """Float inputs that take no gradient (RoPE's tables)."""


def _n(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _labels(n: int, v: int) -> torch.Tensor:
    labels = torch.randint(0, v, (n,))
    labels[1] = -100  # one ignored row
    return labels


def _cases() -> list[Case]:
    import inductor_ext.ops as F

    rows, n = 11, 24
    b, h, s, d = 3, 4, 5, 8
    v = 40
    cases = [
        Case("rms_norm_rows", lambda x, w: F.rms_norm(x, w), lambda: [_n(rows, n), _n(n)], ["S0", "R"], ["S0"]),
        Case("rms_norm_no_weight", lambda x: F.rms_norm(x), lambda: [_n(rows, n)], ["S0"], ["S0"]),
        Case("rms_norm_batch_3d", lambda x, w: F.rms_norm(x, w), lambda: [_n(4, 5, n), _n(n)], ["S0", "R"], ["S0"]),
        Case("rms_norm_gemma", lambda x, w: F.rms_norm(x, w, offset=1.0, casting="gemma"),
             lambda: [_n(rows, n), _n(n)], ["S0", "R"], ["S0"]),
        Case("rms_norm_replicated", lambda x, w: F.rms_norm(x, w), lambda: [_n(rows, n), _n(n)], ["R", "R"], ["R"]),
        Case("add_rms_norm_rows", lambda x, r, w: F.add_rms_norm(x, r, w),
             lambda: [_n(rows, n), _n(rows, n), _n(n)], ["S0", "S0", "R"], ["S0", "S0"]),
        Case("recomputable_norm_output_rows",
             lambda y, x, rstd, w: torch.ops.fastops.recomputable_norm_output(y, x, rstd, w, 0.0, "llama"),
             lambda: [_n(rows, n), _n(rows, n), _n(rows), _n(n)], ["S0", "S0", "S0", "R"], ["S0"],
             constants=(1, 2, 3)),
        Case("layer_norm_rows", lambda x, w, bias: F.layer_norm(x, w, bias),
             lambda: [_n(rows, n), _n(n), _n(n)], ["S0", "R", "R"], ["S0"]),
        Case("layer_norm_no_affine", lambda x: F.layer_norm(x), lambda: [_n(rows, n)], ["S0"], ["S0"]),
        Case("swiglu_rows", F.swiglu, lambda: [_n(rows, n), _n(rows, n)], ["S0", "S0"], ["S0"]),
        Case("swiglu_intermediate", F.swiglu, lambda: [_n(rows, n), _n(rows, n)], ["S1", "S1"], ["S1"]),
        Case("geglu_rows", lambda g, u: F.geglu(g, u, "tanh"), lambda: [_n(rows, n), _n(rows, n)], ["S0", "S0"],
             ["S0"]),
        Case("swiglu_packed_rows", F.swiglu_packed, lambda: [_n(rows, 2 * n)], ["S0"], ["S0"]),
        # a packed gate_up sharded on its last dim would split gate from up: redistributed
        Case("swiglu_packed_last_dim", F.swiglu_packed, lambda: [_n(rows, 2 * n)], ["S1"], None),
        Case("rope_batch_shared_table", F.apply_rotary_pos_emb,
             lambda: [_n(b, h, s, d), _n(b, 2, s, d), _n(s, d), _n(s, d)], ["S0", "S0", "R", "R"], ["S0", "S0"], constants=(2, 3)),
        Case("rope_batch_per_batch_table", F.apply_rotary_pos_emb,
             lambda: [_n(b, h, s, d), _n(b, 2, s, d), _n(b, s, d), _n(b, s, d)], ["S0", "S0", "S0", "S0"],
             ["S0", "S0"], constants=(2, 3)),
        Case("rope_sequence", F.apply_rotary_pos_emb,
             lambda: [_n(b, h, s, d), _n(b, 2, s, d), _n(s, d), _n(s, d)], ["S2", "S2", "S0", "S0"], ["S2", "S2"], constants=(2, 3)),
        Case("rope_sequence_per_batch_table", F.apply_rotary_pos_emb,
             lambda: [_n(b, h, s, d), _n(b, 2, s, d), _n(b, s, d), _n(b, s, d)], ["S2", "S2", "S1", "S1"],
             ["S2", "S2"], constants=(2, 3)),
        Case("rope_sequence_bshd", lambda q, k, c, si: F.apply_rotary_pos_emb(q, k, c, si, unsqueeze_dim=2),
             lambda: [_n(b, s, h, d), _n(b, s, 2, d), _n(s, d), _n(s, d)], ["S1", "S1", "S0", "S0"], ["S1", "S1"], constants=(2, 3)),
        Case("rope_sequence_position_ids", lambda q, k, c, si, p: F.apply_rotary_pos_emb(q, k, c, si, p),
             lambda: [_n(b, h, s, d), _n(b, 2, s, d), _n(16, d), _n(16, d), torch.randint(0, 16, (b, s))],
             ["S2", "S2", "R", "R", "S1"], ["S2", "S2"], constants=(2, 3)),
        Case("rope_batch_position_ids", lambda q, k, c, si, p: F.apply_rotary_pos_emb(q, k, c, si, p),
             lambda: [_n(b, h, s, d), _n(b, 2, s, d), _n(16, d), _n(16, d), torch.randint(0, 16, (b, s))],
             ["S0", "S0", "R", "R", "S0"], ["S0", "S0"], constants=(2, 3)),
        Case("rope_heads", F.apply_rotary_pos_emb,
             lambda: [_n(b, h, s, d), _n(b, 2, s, d), _n(s, d), _n(s, d)], ["S1", "S1", "R", "R"], ["S1", "S1"], constants=(2, 3)),
        Case("rope_partial_rotary_heads", F.apply_rotary_pos_emb,
             lambda: [_n(b, h, s, d), _n(b, 2, s, d), _n(s, d // 2), _n(s, d // 2)], ["S1", "S1", "R", "R"],
             ["S1", "S1"], constants=(2, 3)),
        Case("cross_entropy_none_rows", lambda x, y: F.cross_entropy(x, y, reduction="none"),
             lambda: [_n(rows, v), _labels(rows, v)], ["S0", "S0"], ["S0"]),
        Case("cross_entropy_sum_rows", lambda x, y: F.cross_entropy(x, y, reduction="sum", label_smoothing=0.1),
             lambda: [_n(rows, v), _labels(rows, v)], ["S0", "S0"], ["P"]),
        # the mean needs every rank's count of non-ignored labels: replicated, not local
        Case("cross_entropy_mean_rows", lambda x, y: F.cross_entropy(x, y, lse_square_scale=1e-3),
             lambda: [_n(rows, v), _labels(rows, v)], ["S0", "S0"], None),
        Case("cross_entropy_vocab_sharded", lambda x, y: F.cross_entropy(x, y, reduction="sum"),
             lambda: [_n(rows, v), _labels(rows, v)], ["S1", "R"], None),
        Case("flce_sum_rows", lambda x, w, y, bias: F.fused_linear_cross_entropy(x, w, y, bias, reduction="sum"),
             lambda: [_n(rows, n), _n(v, n), _labels(rows, v), _n(v)], ["S0", "R", "S0", "R"], ["P"]),
        Case("flce_none_rows", lambda x, w, y: F.fused_linear_cross_entropy(x, w, y, reduction="none", chunk_size=4),
             lambda: [_n(rows, n), _n(v, n), _labels(rows, v)], ["S0", "R", "S0"], ["S0"]),
        Case("flce_mean_rows", lambda x, w, y: F.fused_linear_cross_entropy(x, w, y),
             lambda: [_n(rows, n), _n(v, n), _labels(rows, v)], ["S0", "R", "S0"], None),
        Case("flce_vocab_sharded_weight", lambda x, w, y: F.fused_linear_cross_entropy(x, w, y, reduction="sum"),
             lambda: [_n(rows, n), _n(v, n), _labels(rows, v)], ["S0", "S0", "S0"], None),
    ]  # fmt: skip
    return cases


CASE_NAMES = [
    "rms_norm_rows", "rms_norm_no_weight", "rms_norm_batch_3d", "rms_norm_gemma", "rms_norm_replicated",
    "add_rms_norm_rows", "recomputable_norm_output_rows", "layer_norm_rows", "layer_norm_no_affine", "swiglu_rows", "swiglu_intermediate",
    "geglu_rows", "swiglu_packed_rows", "swiglu_packed_last_dim", "rope_batch_shared_table",
    "rope_batch_per_batch_table", "rope_sequence", "rope_sequence_per_batch_table", "rope_sequence_bshd",
    "rope_sequence_position_ids", "rope_batch_position_ids", "rope_heads", "rope_partial_rotary_heads",
    "cross_entropy_none_rows", "cross_entropy_sum_rows", "cross_entropy_mean_rows", "cross_entropy_vocab_sharded",
    "flce_sum_rows", "flce_none_rows", "flce_mean_rows", "flce_vocab_sharded_weight",
]  # fmt: skip


def _placement(code: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {"R": Replicate(), "P": Partial()}.get(code) or Shard(int(code[1:]))


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def _check(case: Case, mesh: Any) -> None:
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    full = case.inputs()

    def leaf(i: int, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone().requires_grad_(t.is_floating_point() and i not in case.constants)

    ref_inputs = [leaf(i, t) for i, t in enumerate(full)]
    ref_outputs = _as_tuple(case.call(*ref_inputs))
    weights = [torch.randn_like(o) for o in ref_outputs]
    sum(((o * w).sum() for o, w in zip(ref_outputs, weights)), torch.zeros(())).backward()

    dist_inputs = [
        None if t is None else leaf(i, distribute_tensor(t, mesh, [_placement(p)]))  # type: ignore[arg-type]
        for i, (t, p) in enumerate(zip(full, case.placements, strict=True))
    ]
    with CommDebugMode() as comm:
        dist_outputs = _as_tuple(case.call(*dist_inputs))
    if case.outputs is not None:
        assert comm.get_total_counts() == 0, f"collectives in the forward: {comm.get_comm_counts()}"
        assert [o.placements for o in dist_outputs] == [(_placement(p),) for p in case.outputs]
    loss = sum((o * distribute_tensor(w, mesh, o.placements if case.outputs else None)).sum()
               for o, w in zip(dist_outputs, weights))  # fmt: skip
    loss.backward()  # type: ignore[union-attr]
    for i, (o, r) in enumerate(zip(dist_outputs, ref_outputs)):
        torch.testing.assert_close(o.full_tensor(), r.detach(), rtol=1e-5, atol=1e-5, msg=f"output {i}")
    for i, (t, r) in enumerate(zip(dist_inputs, ref_inputs)):
        if r is not None and r.grad is not None:
            assert t is not None and t.grad is not None, f"input {i} got no gradient"
            torch.testing.assert_close(t.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-5,
                                       msg=f"input {i} gradient")  # fmt: skip


def _run_cases(rank: int, world_size: int, results_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for case in _cases():
        torch.manual_seed(0)  # the same full inputs on every rank
        try:
            _check(case, mesh)
            results[case.name] = ""
        except Exception:  # noqa: BLE001 (each case's traceback goes to its own test)
            results[case.name] = traceback.format_exc()
    if rank == 0:
        Path(results_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return results_of_two_ranks(tmp_path_factory, _run_cases, "sharding", timeout_s=150)


def test_every_case_ran(results: dict[str, str]) -> None:
    assert sorted(results) == sorted(CASE_NAMES)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_sharded_op_matches_unsharded(results: dict[str, str], name: str) -> None:
    assert results.get(name) == "", results.get(name, f"{name} did not run")
