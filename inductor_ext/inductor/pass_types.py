"""What a graph pass is: the stages it may run in, what it may read besides its graph, and its declaration.

:mod:`inductor_ext.inductor.passes` declares every pass with these types, in the order they run;
:mod:`inductor_ext.inductor.pipeline` runs them.
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

Stage = Literal["dynamo", "export", "joint", "post_grad"]
STAGES: tuple[Stage, ...] = ("dynamo", "export", "joint", "post_grad")


@dataclasses.dataclass
class PassContext:
    """What a pass may read besides its graph: the compile's options, the example inputs (the Dynamo
    stage), and what a pass leaves for the caller (``lazy_outputs``, for the compiled function)."""

    options: Any  # inductor_ext.inductor.options.BackendOptions (which imports the passes)
    example_inputs: tuple[Any, ...] = ()
    lazy_outputs: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class GraphPass:
    """One pass. ``run(graph_module_or_graph, context)``: a ``GraphModule`` in the ``"dynamo"`` and
    ``"export"`` stages, an ``fx.Graph`` in ``"joint"`` and ``"post_grad"``."""

    name: str
    stages: tuple[Stage, ...]
    default: bool
    reason: str
    """Why the pass exists and is on by default: what it saves, in words, or a number together with the
    ``docs/benchmarks/*.json`` file that holds it (the reason is a row of docs/backend.md's options table)."""
    run: Callable[[Any, PassContext], object]
    option: bool = True
    """Whether users can turn it off or on (``fastops.<name>``); False: it always runs."""

    def __post_init__(self) -> None:
        if unknown := set(self.stages) - set(STAGES):
            raise ValueError(f"GraphPass: unknown stages {sorted(unknown)} for {self.name!r}")

    @property
    def env_var(self) -> str:
        return f"INDUCTOR_EXT_{self.name.upper()}"


def in_order(*passes: GraphPass) -> dict[str, GraphPass]:
    """``passes`` by name, in the order given (the order they run); a name given twice raises."""
    named: dict[str, GraphPass] = {}
    for graph_pass in passes:
        if graph_pass.name in named:
            raise ValueError(f"in_order: two passes named {graph_pass.name!r}")
        named[graph_pass.name] = graph_pass
    return named
