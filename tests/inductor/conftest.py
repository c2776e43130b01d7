import pytest
import torch
import torch._functorch.config
import torch._inductor.config


@pytest.fixture
def fresh_compiles():
    """Every compile traced and partitioned (no FX-graph or AOTAutograd cache hit)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()
