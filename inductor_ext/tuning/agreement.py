"""One answer per key for every rank of a ``torch.distributed`` job: the first rank to ask decides,
the others read its answer.

The backend decides each fastops call's route at compile time by timing
(:mod:`inductor_ext.tuning.routes`). Every rank of a data- or tensor-parallel job compiles the same
graphs, and timing noise alone could route an op differently on two ranks, giving them different
code and different rounding. With a default process group of more than one rank, :func:`agreed`
makes the decision once for all of them through the group's store (the key-value store the ranks
rendezvoused with, shared across hosts): the first rank to need a key claims it
(``compare_set``), decides it as a single process would (its tuning database, or timing) and
publishes the answer; the other ranks wait for that answer instead of deciding. A rank that needs
a key no other rank needs claims it and decides it itself, so no rank waits for a decision nobody
makes, and no collective is issued: ranks that compile at different times, or different graphs,
cannot deadlock. A rank that fails while deciding publishes the failure, and the ranks waiting on
it decide for themselves.
"""

import datetime
import json
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

KEY_PREFIX = "inductor_ext/agreed/"
FAILED = "failed"
"""What a deciding rank publishes when its decision raised."""
WAIT_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a rank waits for the deciding rank's answer (a decision is a few seconds of timing)."""


def _store() -> Any:
    """The default process group's store, or None without a process group of more than one rank."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()


def agreed(key: str, decide: Callable[[], Any]) -> tuple[Any, int | None]:
    """``decide()``'s answer (JSON-serialisable), or the answer of the rank that claimed ``key``
    first; with the rank whose answer it is (None outside a process group of several ranks, where
    ``decide()`` simply runs)."""
    store = _store()
    if store is None:
        return decide(), None
    import torch.distributed as dist

    rank = dist.get_rank()
    claim, answer = f"{KEY_PREFIX}{key}/claim", f"{KEY_PREFIX}{key}/answer"
    if not store.check([answer]):
        owner = int(store.compare_set(claim, "", str(rank)).decode())
        if owner == rank:
            try:
                value = decide()
            except BaseException:
                store.set(answer, FAILED)
                raise
            store.set(answer, json.dumps(value))
            return value, rank
    store.wait([answer], WAIT_TIMEOUT)
    published = store.get(answer).decode()
    owner = int(store.get(claim).decode())
    if published == FAILED:
        log.warning("inductor_ext: rank %d failed to decide %s; rank %d decides it itself", owner, key, rank)
        return decide(), rank
    return json.loads(published), owner
