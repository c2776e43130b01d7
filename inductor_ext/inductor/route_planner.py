"""The backend's route of every fastops op call in a graph: our kernels or Inductor's code, decided
before the graph is compiled.

For each forward op call in a Dynamo graph, :class:`RoutePlanner` takes the route the options fix
for its op, or under ``"auto"`` the decisions of :func:`inductor_ext.tuning.routes.decide_routes` (the
tuning database's, or timed on random inputs); on CPU ``"auto"`` is the Inductor route. While the
graph is compiled, :meth:`RoutePlanner.traces_math` answers each op body (see
:func:`inductor_ext.library.registration.route_ops`).
"""

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch._dynamo.utils import counters

from inductor_ext.inductor.options import BackendOptions
from inductor_ext.library.registration import FAMILY_OF, OpFamily
from inductor_ext.tuning.database import TuningDatabase
from inductor_ext.tuning.routes import RouteDecision, decide_routes, fastops_calls
from inductor_ext.tuning.timing import signature

log = logging.getLogger(__name__)


class RoutePlanner:
    """The route decisions of one graph's fastops calls (:meth:`plan_graph`), and the answer each op
    body asks for while the graph is traced (:meth:`traces_math`)."""

    def __init__(self, options: BackendOptions, database: TuningDatabase | None = None) -> None:
        self.options = options
        self.database = database
        self.decisions: dict[tuple[str, str], RouteDecision] = {}

    def plan_graph(self, gm: torch.fx.GraphModule) -> None:
        for family, args in fastops_calls(gm):
            self.plan_call(family, args)

    def plan_call(self, family: OpFamily, args: Sequence[Any]) -> None:
        route = self.options.route_for(family.name)
        if route != "auto":
            return  # fixed routes need no per-call decision
        fwd_name, sig = family.fwd._name, signature(args)
        if (fwd_name, sig) in self.decisions:
            return
        if args[0].device.type != "cuda":
            self._record(RouteDecision(fwd_name, sig, "inductor", "cpu"))
            return
        try:
            decisions = decide_routes(family, args, self.options, self.database, args[0].device)
        except torch.OutOfMemoryError:
            # the timing's random inputs did not fit beside what the process already holds
            torch.cuda.empty_cache()
            log.warning("fastops_inductor: out of GPU memory while timing the routes of %s%s; using our kernels "
                        "untimed (tune it beforehand with python -m inductor_ext.tuning)", fwd_name, sig)  # fmt: skip
            decisions = [RouteDecision(fwd_name, sig, "kernel", "untimed: out of GPU memory")]
        for decision in decisions:
            self._record(decision)

    def traces_math(self, qualname: str, args: Sequence[Any]) -> bool:
        """Asked by each fastops op body while the graph is traced: True for the Inductor route."""
        route = self.options.route_for(FAMILY_OF[qualname])
        if args[0].device.type != "cuda":
            route = "inductor"  # the only route off the GPU
        elif route == "auto":
            decision = self.decisions.get((qualname, signature(args)))
            if decision is None:
                log.warning("fastops_inductor: no route decision for %s%s; using the kernel", qualname, signature(args))
                route = "kernel"
            else:
                route = decision.route
        counters["inductor_ext"][f"{qualname}->{route}"] += 1
        return route == "inductor"

    def _record(self, decision: RouteDecision) -> None:
        self.decisions[(decision.op, decision.signature)] = decision
        log.info("fastops_inductor: %s%s -> %s (%s; kernel %s ms, inductor %s ms)", decision.op,
                 decision.signature, decision.route, decision.reason, decision.kernel_ms, decision.inductor_ms)  # fmt: skip
