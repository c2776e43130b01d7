"""Tune collected op calls into the tuning database.

On a GPU each call's forward and backward are timed on both routes (our kernels,
autotuned over their persistent and looped configs, against Inductor's code for the
op's math) by :func:`inductor_ext.tuning.routes.decide_routes`, the function the
``fastops_inductor`` backend decides through; so the decisions land under the keys the
backend reads, and a later compile of these shapes times nothing. Calls already in
the database are not timed again.

On CPU nothing is timed (the backend's route there is always Inductor's): each call
is recorded as ``{"status": "untuned"}`` under its route key with device ``"cpu"``,
so ``show`` lists what a GPU run would tune.
"""

import logging
from collections.abc import Sequence

import torch

from inductor_ext.inductor.options import BackendOptions
from inductor_ext.tuning.cli.calls import OpCall
from inductor_ext.tuning.cli.report import progress
from inductor_ext.tuning.database import TuningDatabase
from inductor_ext.tuning.launch_settings import thorough_benchmarks
from inductor_ext.tuning.routes import RouteDecision, decide_routes, route_key

UNTUNED = {"status": "untuned"}

log = logging.getLogger(__name__)


def record_untuned(calls: Sequence[OpCall], database: TuningDatabase) -> None:
    """Record ``calls`` as untuned CPU entries, in one database write."""
    database.update({route_key(call.op, call.signature, "cpu"): dict(UNTUNED) for call in calls})


def tune_calls(
    calls: Sequence[OpCall], database: TuningDatabase, device: torch.device, options: BackendOptions
) -> list[RouteDecision]:
    """Decisions (forward and backward) for every call on ``device``, a GPU. A call whose
    random inputs do not fit in the GPU's free memory is skipped with a warning (nothing stored).
    Our kernels' configs are timed with Triton's full benchmark budget (:func:`thorough_benchmarks`)."""
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device to time on, got {device}")
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()  # Inductor's compile workers, as the backend starts them on entry (see its note)
    decisions: list[RouteDecision] = []
    for call in progress(calls, "tuning"):
        try:
            with thorough_benchmarks():
                decisions.extend(decide_routes(call.family, call.args, options, database, device))
        except torch.OutOfMemoryError as error:
            torch.cuda.empty_cache()
            log.warning(
                "out of GPU memory tuning %s%s, skipped: %s", call.op, call.signature, str(error).splitlines()[0]
            )
    return decisions


def tune_into_database(
    calls: Sequence[OpCall], database: TuningDatabase, device: torch.device, options: BackendOptions
) -> list[RouteDecision] | None:
    """:func:`tune_calls` on a GPU; elsewhere :func:`record_untuned` (None: nothing is timed)."""
    if device.type == "cuda":
        return tune_calls(calls, database, device, options)
    record_untuned(calls, database)
    return None
