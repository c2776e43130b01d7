"""Put the C++ runtime this process already uses into the global symbol scope before an
AOTInductor package is loaded (the fix for the H200 image's load segfault).

Cause (evidence in docs/export.md): the image's
``g++`` (``/opt/gcc/bin/g++``, a wrapper around ``g++-real`` 13.3) links the package's
wrapper ``.so`` with its own static copy of libstdc++: the ``.so`` lists no
``libstdc++.so.6`` among its NEEDED libraries yet defines 535 locale and 28 regex
symbols. Python loads torch's libraries, and with them ``libstdc++.so.6``, with
``RTLD_LOCAL``, so when ``aoti_load_package`` opens the wrapper, its C++ runtime
symbols bind to the static copy while torch uses the shared one: two runtimes with
separate state, and the process dies with SIGSEGV. A process in which the shared
libstdc++ is global (``LD_PRELOAD``, a C++ executable such as our runner, or
:func:`promote_cxx_runtime`) binds the wrapper's references to the shared copy and runs.
"""

import ctypes
import os
import sys


def loaded_cxx_runtimes() -> list[str]:
    """Paths of the libstdc++ files mapped into this process (Linux; elsewhere none)."""
    if not sys.platform.startswith("linux"):
        return []
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})


def promote_cxx_runtime() -> list[str]:
    """Make every loaded libstdc++ global: ``dlopen(path, RTLD_NOLOAD | RTLD_GLOBAL)`` loads no
    new copy, it only adds the one in memory to the scope that later libraries bind to.
    Returns the promoted paths."""
    paths = loaded_cxx_runtimes()
    for path in paths:
        ctypes.CDLL(path, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
    return paths
