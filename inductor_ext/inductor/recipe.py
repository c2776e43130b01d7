"""One compile's recipe, the same for the ``fastops_inductor`` backend and for exports: parse the options,
run the passes of the graph's stage, plan each fastops call's route, and build Inductor's config
patches with the ``"joint"`` and ``"post_grad"`` stages installed (:mod:`inductor_ext.inductor.pipeline`)."""

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.fx import GraphModule

from inductor_ext import _compat
from inductor_ext.inductor.options import BackendOptions, parse_options
from inductor_ext.inductor.pass_types import PassContext, Stage
from inductor_ext.inductor.pipeline import INDUCTOR_SLOTS, InductorPasses, run_stage
from inductor_ext.inductor.route_planner import RoutePlanner
from inductor_ext.library.registration import route_ops
from inductor_ext.tuning.database import TuningDatabase


@dataclasses.dataclass
class CompileRecipe:
    """What to hand Inductor for one graph: ``patches`` (config patches, our post-grad passes among them),
    to compile inside :meth:`tracing`; ``context.lazy_outputs`` for the compiled function."""

    options: BackendOptions
    context: PassContext
    planner: RoutePlanner
    patches: dict[str, Any]

    @classmethod
    def prepare(
        cls,
        gm: GraphModule,
        stage: Stage,
        options: Mapping[str, Any] | None,
        example_inputs: Sequence[Any] = (),
        *,
        mode: str | None = None,
        default_multi_kernel: int | None = 1,
    ) -> "CompileRecipe":
        """Rewrite ``gm`` in place by the passes of ``stage`` and plan its routes; ``mode`` as
        ``torch.compile``'s, ``default_multi_kernel`` as :func:`~inductor_ext.inductor.options.parse_options`'."""
        from torch._inductor import config as inductor_config
        from torch._inductor import list_mode_options

        ours, inductor_options = parse_options(options, default_multi_kernel=default_multi_kernel)
        context = PassContext(ours, tuple(example_inputs))
        run_stage(stage, gm, context)
        planner = RoutePlanner(ours, TuningDatabase())
        planner.plan_graph(gm)
        # torch.compile passes mode only when it is neither None nor "default";
        # list_mode_options(None) would return every mode's options.
        patches = {**(list_mode_options(mode) if mode else {}), **inductor_options, **ours.inductor_patches()}
        state = json.dumps(
            {"options": repr(ours), "decisions": sorted(repr(d) for d in planner.decisions.values())}, sort_keys=True
        )
        for inductor_stage, slot in INDUCTOR_SLOTS.items():
            user_pass = patches.get(slot, getattr(inductor_config, slot))
            patches[slot] = InductorPasses(inductor_stage, context, state, chained=user_pass)
        return cls(ours, context, planner, patches)

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """The op bodies trace the planned routes, and :mod:`inductor_ext._compat`'s fixes are installed."""
        with route_ops(self.planner.traces_math), _compat.applied(_compat.inductor_patches()):
            yield
