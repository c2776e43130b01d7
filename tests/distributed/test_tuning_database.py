"""Two ranks writing one tuning database file at once (its file lock): every record of both survives."""

from pathlib import Path

import pytest

from tests.distributed.launch import run_on_two_ranks

pytestmark = pytest.mark.xdist_group("two_ranks")  # one worker runs the two-rank launches, one at a time

RECORDS = 40


def _write_and_read(rank: int, world_size: int, path: str) -> None:
    import torch.distributed as dist

    from inductor_ext.tuning.database import TuningDatabase

    database = TuningDatabase(Path(path))
    dist.barrier()  # both ranks start writing together
    for i in range(RECORDS):
        database.put(f"rank{rank}/{i}", {"value": i, "rank": rank})
    dist.barrier()
    fresh = TuningDatabase(Path(path))
    for other in range(world_size):
        for i in range(RECORDS):
            assert fresh.get(f"rank{other}/{i}") == {"value": i, "rank": other}, (other, i)


def test_two_ranks_share_one_database(tmp_path: Path) -> None:
    run_on_two_ranks(_write_and_read, str(tmp_path / "tuning.json"), timeout_s=120)
