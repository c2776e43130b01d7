"""The decode loop's stop watch on CPU: with the pinned-flag ring of a GPU run (its events replaced by
fakes that check the ring's invariant), the sequences' length is the step at which every row had
finished, learnt :data:`STOP_CHECK_LAG` steps later or at the end, and no slot of the ring is written
again before the host has read it."""

import pytest
import torch

from inductor_ext.runtime.generation.decode_loop import STOP_CHECK_LAG, _StopFlags, _StopWatch


class _CheckedEvent:
    """Stands in for ``torch.cuda.Event``: fails if recorded again before the host waited on it."""

    def __init__(self) -> None:
        self.waiting = False

    def record(self) -> None:
        assert not self.waiting, "a ring slot was overwritten before the host read it"
        self.waiting = True

    def synchronize(self) -> None:
        self.waiting = False


class _CpuStopFlags(_StopFlags):
    def __init__(self) -> None:  # the ring in ordinary memory, with checked events
        self.slots = [(torch.empty(1, dtype=torch.bool), _CheckedEvent()) for _ in range(STOP_CHECK_LAG + 1)]


def _watch(finished_at: int | None, steps: int) -> tuple[int, int]:
    """(the length the watch returns, the step after which it returned it) for rows that all finish at
    step ``finished_at`` (never: ``None``), ``steps`` steps at most."""
    watch = _StopWatch(watching=True, flags=_CpuStopFlags())
    for made in range(1, steps + 1):
        unfinished = torch.tensor([finished_at is None or made < finished_at])
        length = watch.after(made, unfinished)
        if length is not None:
            return length, made
    return watch.finish(steps), steps


@pytest.mark.parametrize("finished_at", [1, 2, 5, 17])
def test_length_is_the_step_every_row_finished_learnt_lag_steps_later(finished_at):
    assert _watch(finished_at, steps=40) == (finished_at, finished_at + STOP_CHECK_LAG)


@pytest.mark.parametrize("finished_at", [39, 40])
def test_a_finish_within_the_last_lag_steps_is_read_at_the_end(finished_at):
    assert _watch(finished_at, steps=40) == (finished_at, 40)


def test_without_a_finish_every_step_is_generated():
    assert _watch(None, steps=40) == (40, 40)


def test_the_synchronous_watch_returns_at_the_finishing_step():
    watch = _StopWatch(watching=True, flags=None)
    lengths = [watch.after(made, torch.tensor([made < 3])) for made in range(1, 4)]
    assert lengths == [None, None, 3]
