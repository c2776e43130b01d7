"""A graph with no CPU tensor compiles its C++ without probing the host CPU's vector instructions.

Before Inductor compiles C++ (an AOTInductor package's wrapper, a ``cpp_wrapper`` graph's), it picks
the host's vector ISA: ``torch._inductor.cpu_vec_isa.valid_vec_isa_list``, cached for the process,
builds a small library for each ISA the CPU reports (AVX2, AVX-512 and its extensions, AMX) and
loads it in a child Python. In torch 2.11 each child imports torch, which takes seconds on a GPU host,
in every process, warm caches or cold: the probe runs inside AOTInductor's compile of an export's
first graph, outside its C++ compiles (docs/export.md splits an export's time).

The ISA selects the compiler flags and vector code of CPU kernels. A graph whose tensors are all on
a GPU has none, so while our compiles run (:func:`inductor_ext._compat.applied`), such a graph sees
no vector ISA (what Inductor picks on a CPU without one) and probes nothing; the process's cache is
left empty for the compiles that need it, and one already filled is used as it is.
``INDUCTOR_EXT_SKIP_VEC_ISA_PROBE=0`` leaves torch's function alone (for A/B timing).
"""

import functools
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

from inductor_ext._compat import Patch
from inductor_ext.env import env_flag


def graph_has_no_cpu_tensor() -> bool:
    """Whether Inductor is lowering a graph now (``V.graph``) whose tensors are all on non-CPU devices."""
    from torch._inductor.virtualized import V

    device_types: Collection[str] = getattr(V.graph, "device_types", None) or ()  # no graph: a NullHandler
    return bool(device_types) and "cpu" not in device_types


def _no_probe_for_device_graphs(original: Callable[[], list[Any]]) -> Callable[[], list[Any]]:
    @functools.wraps(original)
    def valid_vec_isa_list() -> list[Any]:
        cache_info = getattr(original, "cache_info", None)
        probed = cache_info is not None and cache_info().currsize > 0
        if not probed and graph_has_no_cpu_tensor():
            return []
        return original()

    for name in ("cache_info", "cache_clear"):  # functools.cache's methods, which callers may use
        if hasattr(original, name):
            setattr(valid_vec_isa_list, name, getattr(original, name))
    return valid_vec_isa_list


def patches(env: Mapping[str, str] = os.environ) -> list[Patch]:
    """The patch; none when the environment turns it off."""
    if not env_flag(env, "INDUCTOR_EXT_SKIP_VEC_ISA_PROBE", True):
        return []
    return [
        Patch(
            "no_vec_isa_probe_for_device_graphs",
            "torch._inductor.cpu_vec_isa:valid_vec_isa_list",
            _no_probe_for_device_graphs,
            tested=((2, 11), (2, 13)),
            upstream="torch/_inductor/cpu_vec_isa.py: VecISA.check_build loads each probe in a child Python",
        )
    ]
