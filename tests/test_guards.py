"""``inductor_ext.guards.skip_parameter_guards`` under ``torch.compile``: only the parameters' guards go,
what it keeps safe stays safe (in-place updates, a same-metadata replacement, ``train()``/``eval()``),
and ``python -m benchmarks guards`` measures every filter on a tiny model."""

import json

import torch
from torch import nn

from benchmarks import guards as bench_guards
from inductor_ext.guards import skip_parameter_guards


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        y = self.norm(self.linear(x))
        return y * 2 if self.training else y - 1  # a module attribute the guards must keep watching


def test_only_parameter_guards_are_dropped():
    offered = []

    def recording(entries):
        offered.extend(entries)
        return skip_parameter_guards(entries)

    torch._dynamo.reset()
    torch.compile(Block(), backend="eager", options={"guard_filter_fn": recording})(torch.randn(2, 8))
    parameters = [e for e in offered if isinstance(e.value, nn.Parameter)]
    assert parameters and len(parameters) < len(offered)
    assert skip_parameter_guards(offered) == [not isinstance(e.value, nn.Parameter) for e in offered]


def test_what_it_keeps_safe_stays_correct():
    torch._dynamo.reset()
    block, x = Block(), torch.randn(3, 8)
    compiled = torch.compile(block, backend="eager", options={"guard_filter_fn": skip_parameter_guards})
    torch.testing.assert_close(compiled(x), block(x))
    with torch.no_grad():
        block.linear.weight.mul_(3)  # an optimizer step: in place
    torch.testing.assert_close(compiled(x), block(x))
    block.linear.weight = nn.Parameter(torch.randn(8, 8))  # replaced, same dtype, shape and requires_grad
    torch.testing.assert_close(compiled(x), block(x))
    block.eval()  # the module guard on `training` stays: a recompile, not the training branch
    torch.testing.assert_close(compiled(x), block(x))


def test_guard_benchmark_measures_every_filter(tmp_path):
    assert bench_guards.main(["--model", "tiny-llama", "--iters", "20", "--repeats", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "guards_tiny-llama.json").read_text())["results"]
    assert list(results) == list(bench_guards.FILTERS)
    default, ours = results["default"], results["skip_parameter_guards"]
    assert default["on_parameters"] > 0 and ours["on_parameters"] == 0
    assert ours["total"] == default["total"] - default["on_parameters"]
    assert all(r["check_us"] > 0 for r in results.values())
