"""A tiny Triton kernel for tests/inductor/test_kernel_analysis_cache.py (Triton needs kernels
in a file). Built as a ``JITFunction`` directly, as ``@triton.jit`` makes it on a GPU host: under
``TRITON_INTERPRET=1`` the decorator returns an ``InterpretedFunction``, which torch's analysis
(and so the memo) does not take."""

import triton.language as tl
from triton.runtime.jit import JITFunction


def copy_if(X, Y, N, COPY: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < N)
    if COPY:
        tl.store(Y + i, x, mask=i < N)


copy_if_kernel = JITFunction(copy_if)
