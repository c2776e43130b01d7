"""The one graph pipeline: every optimisation of a graph is a :class:`~.pass_types.GraphPass` of
:data:`~.passes.PASSES`, run here.

A pass declares its name, the stages it runs in, its default and the reason it exists; from
that one declaration come its backend option (``fastops.<name>``), its environment variable
(``INDUCTOR_EXT_<NAME>``) and its row of the options table in docs/backend.md
(:mod:`inductor_ext.inductor.options`). Every entry point runs the same passes:

- ``"dynamo"``: the torch-level graph Dynamo hands the ``fastops_inductor`` backend, before AOTAutograd;
- ``"export"``: the ATen graph of a ``torch.export`` program, before AOTInductor
  (:func:`inductor_ext.export`, ``export_generation``);
- ``"joint"``: AOTAutograd's joint forward-backward graph of a training compile, before the partitioner
  splits it (what the forward saves for the backward is decided there), through :class:`InductorPasses`
  as Inductor's ``joint_custom_post_pass``;
- ``"post_grad"``: Inductor's post-grad graphs (forward and backward), in the backend and in exports,
  through :class:`InductorPasses` as Inductor's ``post_grad_custom_post_pass``.

Passes are declared in :mod:`inductor_ext.inductor.passes`, in the order they run.
"""

from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch._dynamo.utils import dynamo_timed
from torch._inductor.custom_graph_pass import CustomGraphPass

from inductor_ext.inductor.cache_key import cache_key
from inductor_ext.inductor.pass_types import GraphPass, PassContext, Stage
from inductor_ext.inductor.passes import PASSES

INDUCTOR_SLOTS: dict[Stage, str] = {"joint": "joint_custom_post_pass", "post_grad": "post_grad_custom_post_pass"}
"""The stages Inductor runs, by the config entry that holds each one's pass."""


def passes_of(stage: Stage, enabled: Collection[str]) -> Iterator[GraphPass]:
    """The enabled passes of ``stage``, in order."""
    return (p for p in PASSES.values() if stage in p.stages and p.name in enabled)


PASS_TIMER_PREFIX = "fastops.pass."
"""Each pass's run is timed under ``PASS_TIMER_PREFIX + name`` among Inductor's compile timers
(``torch._dynamo.utils.compilation_time_metrics``; ``bench train`` reports them per first step)."""


def run_stage(stage: Stage, graph: Any, context: PassContext) -> None:
    """Run every enabled pass of ``stage`` on ``graph``, in order."""
    for graph_pass in passes_of(stage, context.options.passes):
        with dynamo_timed(PASS_TIMER_PREFIX + graph_pass.name):
            graph_pass.run(graph, context)


class InductorPasses(CustomGraphPass):
    """A stage that Inductor runs (``"joint"`` or ``"post_grad"``) as its custom pass of that slot
    (:data:`INDUCTOR_SLOTS`), then the user's pass there (torch 2.11 takes one pass per slot). Its ``uuid``
    is the compile's cache key (:func:`inductor_ext.inductor.cache_key.cache_key`): Inductor's FX-graph
    and AOTAutograd caches hash it."""

    def __init__(self, stage: Stage, context: PassContext, state: str, chained: Any = None) -> None:
        self.stage, self.context, self.state, self.chained = stage, context, state, chained

    def __call__(self, graph: torch.fx.Graph) -> None:
        run_stage(self.stage, graph, self.context)
        if self.chained is not None:
            self.chained(graph)

    def uuid(self) -> Any:
        chained = None
        if self.chained is not None:
            chained = self.chained.uuid() if isinstance(self.chained, CustomGraphPass) else repr(self.chained)
        return cache_key(f"{self.stage}|{self.state}", chained)
