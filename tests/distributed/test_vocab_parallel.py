"""Vocab-parallel cross-entropy (:mod:`inductor_ext.ops.vocab_parallel`) on 2 gloo ranks.

Each case shards full fp32 logits on the vocabulary (41 classes: 21 and 20 per rank), computes
the loss and its gradient, and compares them with the unsharded ``cross_entropy`` on the full
logits, which the op tests hold to float64. It also asserts the gradient stays sharded on the
vocabulary and that the forward made two all-reduces and nothing else (no gather of the logits)
and the backward none; and checks the loss against ``loss_parallel`` + ``F.cross_entropy``, under
``torch.compile`` with the backend, and its errors on bad input.
"""

import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import results_of_two_ranks

pytestmark = pytest.mark.xdist_group("two_ranks")  # one worker runs the two-rank launches, one at a time

ROWS, CLASSES = 11, 41


def _labels(shape: tuple[int, ...], ignore_index: int = -100) -> torch.Tensor:
    labels = torch.randint(0, CLASSES, shape)
    flat = labels.view(-1)
    flat[1] = ignore_index  # an ignored row
    flat[2], flat[3] = 0, CLASSES - 1  # the first and the last class: one on each rank
    return labels


CASES: dict[str, tuple[tuple[int, ...], torch.dtype, dict[str, Any]]] = {
    "mean": ((ROWS,), torch.float32, {}),
    "sum_softcap_z_loss": ((ROWS,), torch.float32, {"reduction": "sum", "softcap": 5.0, "lse_square_scale": 1e-2}),
    "none_3d": ((3, 5), torch.float32, {"reduction": "none"}),
    "ignore_index_in_a_shard": ((ROWS,), torch.float32, {"ignore_index": 7}),
    "bf16_mean": ((ROWS,), torch.bfloat16, {}),
}
"""name -> (labels' shape, logits' dtype, keyword arguments)."""


def _check_case(mesh: Any, label_shape: tuple[int, ...], dtype: torch.dtype, kwargs: dict[str, Any]) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import inductor_ext.ops as F

    full = torch.randn(*label_shape, CLASSES).to(dtype)
    labels = _labels(label_shape, kwargs.get("ignore_index", -100))
    ref_logits = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, labels, **kwargs)
    weight = torch.randn_like(ref)
    (ref * weight).sum().backward()

    logits = distribute_tensor(full, mesh, [Shard(full.dim() - 1)]).requires_grad_()
    with CommDebugMode() as forward_comm:
        loss = F.vocab_parallel_cross_entropy(logits, labels, **kwargs)
    counts = {str(op): n for op, n in forward_comm.get_comm_counts().items()}
    assert list(counts.values()) == [2] and "all_reduce" in next(iter(counts)), counts
    with CommDebugMode() as backward_comm:
        (loss.to_local() * weight).sum().backward()
    assert backward_comm.get_total_counts() == 0, backward_comm.get_comm_counts()
    # the fp32 loss to fp32 rounding; a bf16 gradient to one bf16 rounding (assert_close's bf16 default)
    torch.testing.assert_close(loss.full_tensor(), ref.detach(), rtol=1e-5, atol=1e-5, equal_nan=True)
    assert logits.grad is not None and logits.grad.placements == (Shard(full.dim() - 1),), logits.grad
    grad_tol = {} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(logits.grad.full_tensor(), ref_logits.grad, **grad_tol)


HIDDEN = 24

FLCE_CASES: dict[str, tuple[tuple[int, ...], torch.dtype, dict[str, Any]]] = {
    "flce_mean_chunks": ((ROWS,), torch.float32, {"chunk_size": 4}),
    "flce_sum_softcap_z_loss": ((ROWS,), torch.float32, {"reduction": "sum", "softcap": 5.0, "lse_square_scale": 1e-2}),
    "flce_3d_ignore_index_in_a_shard": ((3, 5), torch.float32, {"ignore_index": 7, "chunk_size": 6}),
    "flce_bf16_weight_dtype": ((ROWS,), torch.bfloat16, {"weight_grad_accumulation": "weight_dtype", "chunk_size": 4}),
}
"""As :data:`CASES`, for ``vocab_parallel_fused_linear_cross_entropy`` against ``fused_linear_cross_entropy``."""


def _check_flce_case(mesh: Any, label_shape: tuple[int, ...], dtype: torch.dtype, kwargs: dict[str, Any]) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import inductor_ext.ops as F

    hidden, weight = torch.randn(*label_shape, HIDDEN).to(dtype), torch.randn(CLASSES, HIDDEN).to(dtype)
    labels = _labels(label_shape, kwargs.get("ignore_index", -100))
    ref_hidden, ref_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.fused_linear_cross_entropy(ref_hidden, ref_weight, labels, **kwargs)
    (ref * 0.7).backward()

    # hidden as a replicated DTensor for 2-D inputs, a plain tensor otherwise
    dist_hidden = distribute_tensor(hidden, mesh, [Replicate()]) if hidden.dim() == 2 else hidden.clone()
    dist_hidden.requires_grad_()
    dist_weight = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    loss = F.vocab_parallel_fused_linear_cross_entropy(dist_hidden, dist_weight, labels, **kwargs)
    (loss * 0.7).backward()
    torch.testing.assert_close(loss.full_tensor(), ref.detach(), rtol=1e-5, atol=1e-5)
    assert dist_weight.grad is not None and dist_weight.grad.placements == (Shard(0),), dist_weight.grad
    dhidden = dist_hidden.grad.full_tensor() if hidden.dim() == 2 else dist_hidden.grad
    if dtype != torch.bfloat16:
        torch.testing.assert_close(dhidden, ref_hidden.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dist_weight.grad.full_tensor(), ref_weight.grad, rtol=1e-5, atol=1e-5)
        return
    # bf16: each rank's share of dhidden is rounded before the sum, so compare errors against float64
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    (torch.nn.functional.cross_entropy(h64 @ w64.T, labels) * 0.7).backward()
    for ours, unsharded, exact in (
        (dhidden, ref_hidden.grad, h64.grad),
        (dist_weight.grad.full_tensor(), ref_weight.grad, w64.grad),
    ):
        error, unsharded_error = (ours.double() - exact).abs().max(), (unsharded.double() - exact).abs().max()
        assert error <= 2 * unsharded_error, (float(error), float(unsharded_error))


def _check_matches_loss_parallel(mesh: Any) -> None:
    """Against PyTorch's own vocab-parallel loss (``loss_parallel`` + ``F.cross_entropy``)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    import inductor_ext.ops as F

    full, labels = torch.randn(ROWS, CLASSES), _labels((ROWS,))
    ours_logits = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
    theirs_logits = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
    ours = F.vocab_parallel_cross_entropy(ours_logits, labels)
    ours.backward()
    with loss_parallel():
        theirs = torch.nn.functional.cross_entropy(theirs_logits, labels)
        theirs.backward()
    torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_logits.grad.full_tensor(), theirs_logits.grad.full_tensor(), rtol=1e-5, atol=1e-6)


def _check_compiled(mesh: Any) -> None:
    """Both losses under ``torch.compile(fullgraph=True)`` with the backend: the collectives trace,
    the results are eager's."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import inductor_ext.ops as F

    full, labels = torch.randn(ROWS, CLASSES), _labels((ROWS,))
    eager_logits = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
    compiled_logits = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
    eager = F.vocab_parallel_cross_entropy(eager_logits, labels, lse_square_scale=1e-3)
    eager.backward()
    compiled_fn = torch.compile(
        lambda x, y: F.vocab_parallel_cross_entropy(x, y, lse_square_scale=1e-3),
        backend="fastops_inductor",
        fullgraph=True,
    )
    compiled = compiled_fn(compiled_logits, labels)
    compiled.backward()
    torch.testing.assert_close(compiled.full_tensor(), eager.full_tensor(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        compiled_logits.grad.full_tensor(), eager_logits.grad.full_tensor(), rtol=1e-5, atol=1e-6
    )

    hidden, weight = torch.randn(ROWS, HIDDEN), torch.randn(CLASSES, HIDDEN)
    runs = []
    for compile_it in (False, True):
        h, w = hidden.clone().requires_grad_(), distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()

        def flce(h: torch.Tensor, w: Any) -> Any:
            return F.vocab_parallel_fused_linear_cross_entropy(h, w, labels, chunk_size=4)

        loss = (torch.compile(flce, backend="fastops_inductor", fullgraph=True) if compile_it else flce)(h, w)
        loss.backward()
        runs.append((loss.full_tensor(), h.grad, w.grad.full_tensor()))
    for eager_value, compiled_value in zip(*runs, strict=True):
        torch.testing.assert_close(compiled_value, eager_value, rtol=1e-5, atol=1e-6)


def _error_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _bad_inputs(mesh: Any) -> dict[str, str]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import inductor_ext.ops as F

    full, labels = torch.randn(ROWS, CLASSES), _labels((ROWS,))
    sharded = distribute_tensor(full, mesh, [Shard(1)])
    hidden, weight = torch.randn(ROWS, HIDDEN), torch.randn(CLASSES, HIDDEN)
    sharded_weight = distribute_tensor(weight, mesh, [Shard(0)])
    return {
        "plain_tensor": _error_of(lambda: F.vocab_parallel_cross_entropy(full, labels)),
        "replicated": _error_of(
            lambda: F.vocab_parallel_cross_entropy(distribute_tensor(full, mesh, [Replicate()]), labels)
        ),
        "row_sharded": _error_of(
            lambda: F.vocab_parallel_cross_entropy(distribute_tensor(full, mesh, [Shard(0)]), labels)
        ),
        "labels_shape": _error_of(lambda: F.vocab_parallel_cross_entropy(sharded, labels[:-1])),
        "labels_dtype": _error_of(lambda: F.vocab_parallel_cross_entropy(sharded, labels.float())),
        "labels_sharded": _error_of(
            lambda: F.vocab_parallel_cross_entropy(sharded, distribute_tensor(labels, mesh, [Shard(0)]))
        ),
        "labels_out_of_range": _error_of(lambda: F.vocab_parallel_cross_entropy(sharded, labels + CLASSES)),
        "reduction": _error_of(lambda: F.vocab_parallel_cross_entropy(sharded, labels, reduction="max")),
        "flce_plain_weight": _error_of(lambda: F.vocab_parallel_fused_linear_cross_entropy(hidden, weight, labels)),
        "flce_weight_on_hidden_dim": _error_of(
            lambda: F.vocab_parallel_fused_linear_cross_entropy(
                hidden, distribute_tensor(weight, mesh, [Shard(1)]), labels
            )
        ),
        "flce_none": _error_of(
            lambda: F.vocab_parallel_fused_linear_cross_entropy(hidden, sharded_weight, labels, reduction="none")
        ),
        "flce_hidden_size": _error_of(
            lambda: F.vocab_parallel_fused_linear_cross_entropy(hidden[:, :-1], sharded_weight, labels)
        ),
        "flce_hidden_dtype": _error_of(
            lambda: F.vocab_parallel_fused_linear_cross_entropy(hidden.double(), sharded_weight, labels)
        ),
    }


def _run(rank: int, world_size: int, results_path: str) -> None:
    """Every check on a 1-D mesh of the ranks: CPU over gloo, or their GPUs over NCCL
    (``tests/gpu/test_distributed_gpu.py``, where new tensors default to the rank's GPU)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", (world_size,))
    results: dict[str, Any] = {}
    cases = [(name, _check_case, case) for name, case in CASES.items()]
    cases += [(name, _check_flce_case, case) for name, case in FLCE_CASES.items()]
    for name, check, (shape, dtype, kwargs) in cases:
        torch.manual_seed(0)  # the same full inputs on every rank
        try:
            check(mesh, shape, dtype, kwargs)
            results[name] = ""
        except Exception:  # noqa: BLE001 (each case's traceback goes to its own test)
            results[name] = traceback.format_exc()
    for name, check in (("loss_parallel", _check_matches_loss_parallel), ("compiled", _check_compiled)):
        torch.manual_seed(0)
        try:
            check(mesh)
            results[name] = ""
        except Exception:  # noqa: BLE001
            results[name] = traceback.format_exc()
    results["errors"] = _bad_inputs(mesh)
    if rank == 0:
        Path(results_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return results_of_two_ranks(tmp_path_factory, _run, "vocab_parallel", timeout_s=150)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_unsharded_cross_entropy(results: dict[str, Any], name: str) -> None:
    assert results.get(name) == "", results.get(name, f"{name} did not run")


@pytest.mark.parametrize("name", list(FLCE_CASES))
def test_fused_linear_matches_unsharded(results: dict[str, Any], name: str) -> None:
    assert results.get(name) == "", results.get(name, f"{name} did not run")


def test_matches_torch_loss_parallel(results: dict[str, Any]) -> None:
    assert results["loss_parallel"] == "", results["loss_parallel"]


def test_compiles_with_the_backend(results: dict[str, Any]) -> None:
    assert results["compiled"] == "", results["compiled"]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("plain_tensor", "TypeError: vocab_parallel_cross_entropy: logits must be a DTensor sharded on the vocabulary"),
        ("replicated", "ValueError: vocab_parallel_cross_entropy: logits must be sharded on dim 1 (the vocabulary)"),
        ("row_sharded", "ValueError: vocab_parallel_cross_entropy: logits must be sharded on dim 1 (the vocabulary)"),
        ("labels_shape", "ValueError: vocab_parallel_cross_entropy: labels must have shape (11,)"),
        ("labels_dtype", "TypeError: vocab_parallel_cross_entropy: labels must be int64 or int32"),
        (
            "labels_sharded",
            "ValueError: vocab_parallel_cross_entropy: labels must be a Tensor or a DTensor replicated on the vocabulary",
        ),
        ("labels_out_of_range", "ValueError: vocab_parallel_cross_entropy: labels must be in [0, 41)"),
        ("reduction", "ValueError: vocab_parallel_cross_entropy: reduction"),
        ("flce_plain_weight", "TypeError: vocab_parallel_fused_linear_cross_entropy: weight must be a DTensor"),
        (
            "flce_weight_on_hidden_dim",
            "ValueError: vocab_parallel_fused_linear_cross_entropy: weight must be sharded on dim 0",
        ),
        ("flce_none", "ValueError: vocab_parallel_fused_linear_cross_entropy: reduction must be 'mean' or 'sum'"),
        (
            "flce_hidden_size",
            "ValueError: vocab_parallel_fused_linear_cross_entropy: hidden must be a (..., 24) Tensor",
        ),
        ("flce_hidden_dtype", "TypeError: vocab_parallel_fused_linear_cross_entropy: hidden must have weight's dtype"),
    ],
)
def test_bad_input_is_named(results: dict[str, Any], case: str, expected: str) -> None:
    assert results["errors"][case].startswith(expected), results["errors"][case]
