"""Put the C++ runtime this process already uses into the global symbol scope before an
AOTInductor package is loaded (the fix for a load segfault of packages whose wrapper carries its own
static libstdc++).

Cause (evidence in docs/benchmarks/aoti_load_diag_h200.json): a ``g++`` such as
``/opt/gcc/bin/g++`` (a wrapper around ``g++-real`` 13.3) links the package's
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
import struct
import sys
import zipfile
from pathlib import Path


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


_RUNTIME_SYMBOL = b"_ZNSt6locale"
"""Part of the C++ runtime's locale symbols: in a library that defines them (a static copy of libstdc++)
or imports them."""


def needed_libraries(elf: bytes) -> list[str] | None:
    """The ``DT_NEEDED`` entries of a 64-bit little-endian ELF shared library; None for anything else."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        return None
    (section_offset,) = struct.unpack_from("<Q", elf, 0x28)
    entry_size, count = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, section_offset + i * entry_size) for i in range(count)]
    dynamic = next((sec for sec in sections if sec[1] == 6), None)  # SHT_DYNAMIC
    if dynamic is None:
        return []
    strings = sections[dynamic[6]]  # sh_link: the dynamic string table
    needed = []
    for offset in range(dynamic[4], dynamic[4] + dynamic[5], 16):
        tag, value = struct.unpack_from("<qQ", elf, offset)
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED
            start = strings[4] + value
            needed.append(elf[start : elf.index(b"\0", start)].decode())
    return needed


def carries_static_cxx_runtime(package: str | Path) -> bool:
    """Whether a shared library inside the AOTInductor ``package`` (a zip) has C++ runtime symbols but
    does not need ``libstdc++.so.6``: its own static copy, the case that crashes without
    :func:`promote_cxx_runtime` (module docstring)."""
    with zipfile.ZipFile(package) as archive:
        for name in archive.namelist():
            if name.endswith(".so"):
                data = archive.read(name)
                needed = needed_libraries(data)
                if needed is not None and _RUNTIME_SYMBOL in data and "libstdc++.so.6" not in needed:
                    return True
    return False
