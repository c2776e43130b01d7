"""Test set-up. Without CUDA, Triton kernels run under the interpreter on CPU tensors.

``TRITON_INTERPRET`` must be set before ``inductor_ext`` (and its ``@triton.jit``
kernels) is imported, so it is decided here, at collection start.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Inductor's on-disk cache is safe to share between processes except for AOTInductor's generated files:
# a second process compiling the same graph rewrites (truncates, then writes) the metadata JSON that the
# first is packaging, which then holds an empty entry. Each xdist worker gets its own cache directory.
if (_worker := os.environ.get("PYTEST_XDIST_WORKER")) and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{_worker}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests/gpu)")
    config.addinivalue_line(
        "markers",
        "slow: runs a benchmark or example command line end to end (about 8 of the suite's minutes "
        "on 2 CPU cores); CI runs them, -m 'not slow' leaves them out of a quick local run",
    )
    # Triton 3.6's interpreter converts 1-element arrays with int() (numpy deprecates it; numpy<2.4 is
    # pinned until Triton stops): once per interpreted index, tens of thousands per run, none ours.
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning"
    )
    # torch deprecates torch.jit.script_method while its own modules still call it at import.
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture(autouse=True)
def _fresh_seed() -> None:
    # fresh but reproducible inputs per test
    torch.manual_seed(zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode()))


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters (graph breaks, ...) empty for the test, and reset after it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
