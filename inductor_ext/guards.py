"""Guard filters for ``torch.compile``: fewer of Dynamo's per-call checks, for what a training loop never changes.

Dynamo checks a compiled frame's guards on every call, on the host. For an HF model most of them are
about its modules (hook dicts, attribute types, constants) and its parameters (one tensor check each).
``torch.compile(model, backend="fastops_inductor", options={"guard_filter_fn": skip_parameter_guards})``
drops only the parameters' guards, a third of the guards' check time on a Llama structure
(``python -m benchmarks guards``).

What it trades: a parameter whose dtype, device, shape, strides or ``requires_grad`` changes after
the first call is not noticed, so the compiled code keeps treating it as before. Optimizer steps,
``load_state_dict`` and other in-place updates are safe (same tensor, same metadata); a parameter
replaced by one with the same metadata is read correctly (parameters are inputs of the compiled graph).
Not safe: ``model.to(dtype)`` or ``.half()`` after compiling, and freezing or unfreezing parameters
(``requires_grad_``) between steps; call ``torch._dynamo.reset()`` after such a change. Every module
guard stays: ``model.train()``/``eval()``, hooks and replaced submodules still recompile.
torch's own ``torch.compiler.skip_guard_on_all_nn_modules_unsafe`` removes the module guards too
(about three quarters of the check time there) and with them those checks.
"""

from collections.abc import Sequence
from typing import Any

import torch


def skip_parameter_guards(entries: Sequence[Any]) -> list[bool]:
    """A ``guard_filter_fn``: keep every guard except those on an ``nn.Parameter`` (module docstring)."""
    return [not isinstance(entry.value, torch.nn.Parameter) for entry in entries]
