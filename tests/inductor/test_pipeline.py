"""The pass pipeline: one declaration per pass gives its option, environment variable and docs row; the
compile-cache key follows code, not docstrings; shape calls reach the rewrites in one canonical form."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import inductor_ext
from inductor_ext.inductor import cache_key
from inductor_ext.inductor.options import OPTION_NAMES, SETTINGS, parse_options
from inductor_ext.inductor.pass_types import STAGES, GraphPass, in_order
from inductor_ext.inductor.passes import PASSES
from tests.inductor.test_backend import rel_err

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("fresh_compiles", "fresh_dynamo")


def test_every_pass_declares_stages_a_default_and_a_measured_reason():
    assert list(PASSES)[:2] == ["causal_mask", "document_mask"]  # proofs first, on the graph as traced
    for graph_pass in PASSES.values():
        assert graph_pass.stages and set(graph_pass.stages) <= set(STAGES), graph_pass.name
        assert any(ch.isdigit() for ch in graph_pass.reason), f"{graph_pass.name}: its reason has no number"
    switchable = {name for name, graph_pass in PASSES.items() if graph_pass.option}
    assert set(OPTION_NAMES) == set(SETTINGS) | switchable
    for name in switchable:  # each switchable pass: its option and its environment variable, derived
        flipped = not PASSES[name].default
        assert parse_options({f"fastops.{name}": flipped}, env={})[0].runs(name) is flipped
        assert parse_options(None, env={PASSES[name].env_var: str(int(flipped))})[0].runs(name) is flipped
    with pytest.raises(ValueError, match="two passes named 'causal_mask'"):
        in_order(PASSES["causal_mask"], PASSES["rewrites"], PASSES["causal_mask"])
    with pytest.raises(ValueError, match="unknown stages"):
        GraphPass("late", ("pre_grad",), True, "1", lambda gm, context: None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown options"):
        parse_options({"fastops.canonical_shapes": False}, env={})  # always runs: no option


def test_options_table_in_the_docs_is_the_registry():
    spec = importlib.util.spec_from_file_location("options_table", ROOT / "scripts" / "options_table.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = (ROOT / "docs" / "backend.md").read_text()
    assert page == script.with_table(page), "docs/backend.md's options table is stale: run scripts/options_table.py"
    for name in OPTION_NAMES:
        assert f"`fastops.{name}`" in page


def test_cache_key_keeps_docstrings_and_comments_out_and_code_in():
    source = '"""Module."""\n\ndef f(x):\n    """Doubles."""\n    return x * 2  # twice\n'
    reworded = '"""Another module text."""\n\n\ndef f(x):\n    """Twice x."""\n    # a comment\n    return x * 2\n'
    changed = '"""Module."""\n\ndef f(x):\n    """Doubles."""\n    return x * 3\n'
    assert cache_key.code_fingerprint(source) == cache_key.code_fingerprint(reworded)
    assert cache_key.code_fingerprint(source) != cache_key.code_fingerprint(changed)
    assert cache_key.cache_key("a") != cache_key.cache_key("b")


class OpNormBlock(torch.nn.Module):
    """A pre-norm block written with our public ``rms_norm`` (which flattens with ``flatten(0, -2)``)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(n, n)
        self.weight = torch.nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(x)
        return h + self.proj(inductor_ext.rms_norm(h, self.weight, 1e-6))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_flattened_norm_gets_the_residual_add_fused_like_a_reshaped_one(dynamic):
    module = OpNormBlock(32)
    x = torch.randn(2, 5, 32)
    compiled = torch.compile(module, backend="fastops_inductor", fullgraph=True, dynamic=dynamic)
    got = compiled(x)
    assert counters["inductor_ext"]["rewrite_add_rms_norm"] >= 1  # (Dynamo may call the backend again when dynamic)
    assert not any(key.startswith("fastops::rms_norm_fwd") for key in counters["inductor_ext"])  # no unfused norm
    assert rel_err(got, module(x)) < 1e-5


def test_view_by_dtype_and_keyword_calls_are_left_alone():
    def f(x):
        return x.view(torch.int32).flatten(start_dim=1).float() + x.view(-1).sum()

    x = torch.randn(2, 3, 4)
    assert torch.equal(torch.compile(f, backend="fastops_inductor", fullgraph=True)(x), f(x))
