"""Every rank takes the same route decisions (:func:`inductor_ext.tuning.routes.decide_routes`
through :mod:`inductor_ext.tuning.agreement`), on 2 gloo ranks.

Route timing runs only on GPUs, so the timing is replaced by one that answers differently on each
rank (``"kernel"`` on rank 0, ``"inductor"`` on rank 1): without the agreement the ranks would
disagree. Each rank has a tuning database of its own, as on two hosts.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import results_of_two_ranks

pytestmark = pytest.mark.xdist_group("two_ranks")  # one worker runs the two-rank launches, one at a time


def _run(rank: int, world_size: int, results_path: str) -> None:
    import torch.distributed as dist

    from inductor_ext.inductor.options import parse_options
    from inductor_ext.library.registration import FAMILIES
    from inductor_ext.tuning import routes
    from inductor_ext.tuning.database import TuningDatabase

    family = next(f for f in FAMILIES.values() if f.name == "rms_norm")
    options = parse_options(None)[0]
    database = TuningDatabase(Path(results_path).parent / f"rank{rank}" / "tuning.json")
    timed: list[str] = []

    def measure(family: Any, args: Any, options: Any, device: Any) -> list[Any]:
        timed.append(routes.signature(args))
        if rank == 1 and args[0].shape[0] == 7:
            raise RuntimeError("timing failed")
        route = "kernel" if rank == 0 else "inductor"
        return [routes.RouteDecision(family.fwd._name, routes.signature(args), route, "timed", 1.0, 2.0)]

    routes.measure_routes = measure  # this process only (spawned)
    cpu = torch.device("cpu")

    def decide(rows: int) -> list[dict[str, Any]]:
        args = (torch.randn(rows, 16), torch.randn(16), 1e-6, 0.0, "llama")
        return [dict(vars(d)) for d in routes.decide_routes(family, args, options, database, cpu)]

    results: dict[str, Any] = {}
    # the same key on both ranks; then two keys asked in opposite orders (no rank may wait on the other)
    results["same_key"] = decide(5)
    order = (3, 4) if rank == 0 else (4, 3)
    results["opposite_orders"] = {str(rows): decide(rows) for rows in order}
    dist.barrier()
    # a key rank 1 claims and fails to decide: rank 1 raises, rank 0 decides for itself
    if rank == 0:
        dist.barrier()  # rank 1 has claimed and failed
        results["after_failure"] = decide(7)
    else:
        try:
            decide(7)
            results["after_failure"] = "no error"
        except RuntimeError as error:
            results["after_failure"] = str(error)
        dist.barrier()
    results["timed"] = timed
    results["database"] = {key: record for key, record in database.items() if key.startswith("route|")}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(results_path).write_text(json.dumps(gathered))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return results_of_two_ranks(tmp_path_factory, _run, "route_agreement", timeout_s=120)


def test_ranks_take_one_rank_s_decision(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    assert [d["route"] for d in rank0["same_key"]] == [d["route"] for d in rank1["same_key"]]
    reasons = sorted(d["reason"] for r in ranks for d in r["same_key"])
    assert reasons[1] == "timed" and reasons[0].startswith("rank "), reasons  # one rank timed it


def test_opposite_orders_agree_without_waiting_forever(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    for rows in ("3", "4"):
        assert [d["route"] for d in rank0["opposite_orders"][rows]] == [
            d["route"] for d in rank1["opposite_orders"][rows]
        ]
    # each signature was timed once over both ranks: 5, 3, 4, then 7 by both (rank 1 failed)
    timed = sorted(rank0["timed"] + rank1["timed"])
    assert len(timed) == 5 and len(set(timed)) == 4, timed


def test_the_other_rank_stores_the_decision(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    for key in ("same_key", "opposite_orders"):
        assert rank0[key] and rank1[key]
    # each database holds the 4 route keys the ranks agreed on (5, 3, 4 and rank 0's own 7)
    assert len(rank1["database"]) == 3 and len(rank0["database"]) == 4
    for key, record in rank1["database"].items():
        assert rank0["database"][key]["decisions"][0]["route"] == record["decisions"][0]["route"]


def test_a_failed_decision_is_not_waited_for(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    assert rank1["after_failure"] == "timing failed"
    assert [d["route"] for d in rank0["after_failure"]] == ["kernel"]
