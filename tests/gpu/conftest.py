"""Fixtures shared by the GPU tests."""

import pytest
import torch
from torch._dynamo.utils import counters


@pytest.fixture
def isolated_compiles(tmp_path, monkeypatch):
    """Each test compiles against an empty tuning database of its own (``INDUCTOR_EXT_CACHE_DIR``), with
    Dynamo reset and the counters cleared."""
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    counters.clear()
