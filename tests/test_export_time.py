"""``python -m benchmarks export_time``'s clock: inclusive seconds per graph and phase, a phase that calls
itself (a wrapped function reached again inside it) counted once."""

import time

from benchmarks.export_time import PhaseClock


def test_a_phase_is_counted_once_when_it_nests_in_itself():
    clock = PhaseClock()

    def work(depth: int) -> None:
        time.sleep(0.02)
        if depth:
            timed(depth - 1)

    timed = clock.wrap("passes", work)
    clock.graph = "decode batch 1"
    timed(2)
    seconds = clock.seconds["decode batch 1"]["passes"]
    assert 0.06 <= seconds < 0.12, seconds  # three sleeps, once each: not 0.06 + 0.04 + 0.02


def test_phases_are_kept_per_graph():
    clock = PhaseClock()
    for graph in ("prefill + decode (dynamic)", "decode batch 1"):
        clock.graph = graph
        with clock.phase("trace"):
            time.sleep(0.01)
    assert set(clock.seconds) == {"prefill + decode (dynamic)", "decode batch 1"}
    assert all(phases["trace"] >= 0.01 for phases in clock.seconds.values())
