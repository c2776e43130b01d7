"""Our kernels' launch configs in the tuning database: chosen by timing real launches (the eager
autotuner, while a route is timed), read back when a graph is traced, so that Inductor's
generated code (Python or ``cpp_wrapper``/AOTInductor C++) launches the chosen config and tunes nothing.

Record: ``config|<kernel>|<autotune key values>|<tensor dtypes>|<device name>`` →
``{"config": {<meta-parameter>: value, ..., "num_warps": w, "num_stages": s, ...}}``, the
key being what Triton's autotuner keys its cache on (its ``key`` arguments and the
tensors' dtypes), so a record applies exactly where the autotuner would reuse its pick.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import triton

from inductor_ext.tuning.database import TuningDatabase

LAUNCH_OPTIONS = frozenset({*triton.Config({}).all_kwargs(), "maxnreg"})
"""Keys of a config's ``all_kwargs()`` that are launch options (``num_warps``, ...), not kernel parameters."""

LaunchSignature = tuple[tuple[Any, ...], tuple[Any, ...]]
"""(the autotuner's key argument values, the tensor arguments' dtypes: ``torch.dtype`` or their names)."""


def config_key(kernel_name: str, signature: LaunchSignature, device_name: str) -> str:
    key_values, dtypes = signature
    return f"config|{kernel_name}|{key_values}|{tuple(str(d) for d in dtypes)}|{device_name}"


_KEY_POSITIONS: dict[Any, list[tuple[int | None, str]]] = {}
"""Per autotuned kernel: where each of its ``key`` arguments is passed (a position, or None: a keyword)."""


def key_signature(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> LaunchSignature:
    """What ``kernel``'s (an ``Autotuner``) cache is keyed on for this launch: its ``key`` argument
    values and the tensors' dtypes. Every eager launch computes it, so it is kept cheap (positions
    cached per kernel, list comprehensions, dtype objects)."""
    positions = _KEY_POSITIONS.get(kernel)
    if positions is None:
        index = {name: i for i, name in enumerate(kernel.arg_names)}
        positions = _KEY_POSITIONS[kernel] = [(index[k], k) if index[k] < len(args) else (None, k) for k in kernel.keys]
    values = tuple([args[i] if i is not None else kwargs.get(k) for i, k in positions])
    return values, tuple([a.dtype for a in args if isinstance(a, torch.Tensor)])


def launch_signature(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> LaunchSignature | None:
    """:func:`key_signature` of a traced launch; None when a key value is symbolic (a dynamic
    shape: no single config was chosen for it)."""
    signature = key_signature(kernel, args, kwargs)
    if any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) for v in signature[0]):
        return None
    return signature


def device_name_of(args: Sequence[Any]) -> str | None:
    """The name of the GPU the launch's tensors are on (None if none is on a GPU)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type == "cuda":
            return torch.cuda.get_device_name(a.device)
    return None


def records(tuned: Mapping[tuple[Any, LaunchSignature], Mapping[str, Any]], device_name: str) -> dict[str, Any]:
    """Database records of ``{(kernel, signature): config kwargs}`` picks made on ``device_name``."""
    return {
        config_key(kernel.fn.__name__, signature, device_name): {"config": dict(config)}
        for (kernel, signature), config in tuned.items()
    }


def stored_config(
    database: TuningDatabase, kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any], device_name: str
) -> Any:
    """The ``triton.Config`` recorded for this launch of ``kernel`` on ``device_name``, or None."""
    signature = launch_signature(kernel, args, kwargs)
    if signature is None:
        return None
    record = database.get(config_key(kernel.fn.__name__, signature, device_name))
    if record is None:
        return None
    config = record["config"]
    meta = {k: v for k, v in config.items() if k not in LAUNCH_OPTIONS}
    return triton.Config(meta, **{k: v for k, v in config.items() if k in LAUNCH_OPTIONS and v is not None})
