"""On 2 GPUs over NCCL (skipped with fewer): the vocab-parallel losses on our kernels, and every
rank taking the same route decisions with real timing.

The vocab-parallel checks are the gloo tests' (``tests/distributed/test_vocab_parallel.py``),
run with each rank's tensors on its GPU: the cross-entropy kernels instead of the ops' CPU math,
NCCL instead of gloo. FSDP2 on GPUs is measured by ``bench train --nproc 2`` (docs/distributed.md).
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import test_vocab_parallel as vocab_parallel
from tests.distributed.launch import results_of_two_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

CHECKS = [*vocab_parallel.CASES, *vocab_parallel.FLCE_CASES, "loss_parallel", "compiled"]
CPU_ONLY_ERRORS = {"labels_out_of_range"}
"""Checked on CPU only: on a GPU an out-of-range label gives a NaN row (no host sync)."""


@pytest.fixture(scope="module")
def vocab_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return results_of_two_ranks(tmp_path_factory, vocab_parallel._run, "vocab_parallel_gpu", 600, backend="nccl")


@pytest.mark.parametrize("name", CHECKS)
def test_vocab_parallel_on_two_gpus(vocab_results: dict[str, Any], name: str) -> None:
    assert vocab_results.get(name) == "", vocab_results.get(name, f"{name} did not run")


def test_vocab_parallel_errors_on_two_gpus(vocab_results: dict[str, Any]) -> None:
    errors = {case: message for case, message in vocab_results["errors"].items() if case not in CPU_ONLY_ERRORS}
    assert errors and all(message.startswith(("TypeError: ", "ValueError: ")) for message in errors.values()), errors


def _route_agreement(rank: int, world_size: int, results_path: str) -> None:
    """Both ranks decide the routes of an RMSNorm call at a benchmark shape, each with a database of its own."""
    import torch.distributed as dist

    from inductor_ext.inductor.options import parse_options
    from inductor_ext.library.registration import FAMILIES
    from inductor_ext.tuning import routes
    from inductor_ext.tuning.database import TuningDatabase

    family = next(f for f in FAMILIES.values() if f.name == "rms_norm")
    database = TuningDatabase(Path(results_path).parent / f"rank{rank}" / "tuning.json")
    args = (torch.randn(8192, 2048, dtype=torch.bfloat16), torch.randn(2048, dtype=torch.bfloat16), 1e-6, 0.0, "llama")
    decisions = routes.decide_routes(family, args, parse_options(None)[0], database, torch.device("cuda", rank))
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, [[d.op, d.route, d.reason] for d in decisions])
    if rank == 0:
        Path(results_path).write_text(json.dumps(gathered))


def test_ranks_take_the_same_timed_routes(tmp_path_factory: pytest.TempPathFactory) -> None:
    rank0, rank1 = results_of_two_ranks(tmp_path_factory, _route_agreement, "routes_gpu", 300, backend="nccl")
    assert [(op, route) for op, route, _ in rank0] == [(op, route) for op, route, _ in rank1]
    reasons = sorted({reason for *_, reason in rank0 + rank1})
    assert reasons[1] == "timed" and reasons[0].startswith("rank "), reasons  # timed once, on one rank
