"""Autotune pruning that keeps a search space's order.

Each kernel module's ``search_space`` lists the configs valid for a launch with the
heuristic's favourite first; its ``early_config_prune`` returns the autotuner's configs
that are in it **in that order** (:func:`in_search_order`), not in the order of the
autotuner's full config list. So the first pruned config is the heuristic's pick (what
a launch under the interpreter runs), and a quick first launch times the first few
(:data:`inductor_ext.tuning.launch_settings.QUICK_FIRST_LAUNCH_CONFIGS`).
"""

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import triton

Key = TypeVar("Key", bound=Hashable)


def in_search_order(
    configs: Sequence[triton.Config], space: Sequence[Key], key: Callable[[triton.Config], Key]
) -> list[triton.Config]:
    """The ``configs`` whose ``key`` is in ``space``, ordered as ``space`` is."""
    rank = {k: i for i, k in enumerate(space)}
    return sorted((c for c in configs if key(c) in rank), key=lambda c: rank[key(c)])
