"""``inductor_ext.export`` / ``load`` and the C++ runner (``inductor_ext/csrc/aoti_runner.cpp``) on CPU.

A Llama-style block using our RMSNorm (and SwiGLU) is exported to a ``.pt2`` package,
loaded from Python, and run by the C++ runner in a separate process with no Python;
both must match eager. The runner is built once per session with CMake (~20 s), the
packages once per module (~15 s each).
"""

import shutil

import pytest
import torch

import inductor_ext
from inductor_ext.runtime.cpp_runner import SOURCE_DIR, build_runner, default_build_dir, run_package
from tests.test_export import HIDDEN, LlamaStyleBlock
from tests.tolerances import OUTPUT, rel_err

FP32_TOL = OUTPUT[torch.float32]


pytestmark = pytest.mark.xdist_group("export_cpp")  # one worker builds the module's packages once


class SwiGLUBlock(LlamaStyleBlock):
    """The block with inductor_ext.swiglu in its MLP, so two op families go through the package."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(inductor_ext.swiglu(self.gate(h), self.up(h)))


@pytest.fixture(scope="module")
def model() -> SwiGLUBlock:
    torch.manual_seed(0)
    return SwiGLUBlock().eval()


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return build_runner(tmp_path_factory.mktemp("runner"))


@pytest.fixture(scope="module")
def dynamic_package(model, tmp_path_factory):
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=512)
    x = torch.randn(2, 8, HIDDEN)
    path = tmp_path_factory.mktemp("pkg") / "block.pt2"
    return inductor_ext.export(model, (x,), path, dynamic_shapes=({0: batch, 1: seq},))


def _eager(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("shape", [(2, 8, HIDDEN), (7, 33, HIDDEN), (1, 2, HIDDEN)], ids=str)
def test_python_load_matches_eager(model, dynamic_package, shape):
    """Far from the example size (2, 8) too: the package is compiled for the whole Dim range."""
    x = torch.randn(shape)
    compiled = inductor_ext.load(dynamic_package)
    assert rel_err(compiled(x), _eager(model, x)) < FP32_TOL


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((65, 8, HIDDEN), r"got \(65, 8, 64\) \(size 65 at dimension 0 is outside the exported range\)"),
        ((2, 513, HIDDEN), r"got \(2, 513, 64\) \(size 513 at dimension 1 is outside the exported range\)"),
        ((2, 8, HIDDEN + 1), r"got \(2, 8, 65\)$"),
    ],
    ids=["batch", "seq", "hidden"],
)
def test_python_load_refuses_sizes_outside_the_exported_ranges(dynamic_package, shape, message):
    """Each dynamic size within its ``Dim``'s range (a lower bound of 2 admits 1), each static one exact."""
    with pytest.raises(ValueError, match=r"argument 0 must have shape \(1\.\.64, 1\.\.512, 64\), " + message):
        inductor_ext.load(dynamic_package)(torch.randn(shape))


@pytest.mark.parametrize("shape", [(2, 8, HIDDEN), (5, 100, HIDDEN)], ids=str)
def test_cpp_runner_matches_eager(model, dynamic_package, runner, shape):
    x = torch.randn(shape)
    result = run_package(dynamic_package, [x], runner=runner, iters=3)
    assert len(result.outputs) == 1
    assert result.outputs[0].shape == x.shape
    assert rel_err(result.outputs[0], _eager(model, x)) < FP32_TOL
    assert result.latency_ms > 0


def test_cpp_runner_reports_a_bad_package(runner, tmp_path):
    bogus = tmp_path / "bogus.pt2"
    bogus.write_bytes(b"not a zip")
    with pytest.raises(RuntimeError, match="aoti_runner failed"):
        run_package(bogus, [torch.randn(2)], runner=runner, iters=1)


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # a branch on data: not one graph
            return inductor_ext.rms_norm(x)
        return x


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda p: inductor_ext.export(lambda x: x, (torch.randn(2),), p), TypeError, "must be a torch.nn.Module"),
        (lambda p: inductor_ext.export(torch.nn.ReLU(), torch.randn(2), p), TypeError, "args must be a tuple"),
        (lambda p: inductor_ext.export(torch.nn.ReLU(), (torch.randn(2),), p.with_suffix(".so")), ValueError, ".pt2"),
        (lambda p: inductor_ext.export(DataDependent(), (torch.randn(4, 8),), p), inductor_ext.ExportError,
         "DataDependent cannot be exported as one graph"),
        (lambda p: inductor_ext.load(p.with_name("missing.pt2")), FileNotFoundError, "no package"),
    ],
)  # fmt: skip
def test_bad_export_inputs_are_named(tmp_path, call, error, message):
    with pytest.raises(error, match=message):
        call(tmp_path / "m.pt2")


def test_cached_builds_of_two_checkouts_do_not_share_a_cmake_directory(tmp_path):
    """CMake refuses a build directory configured from another source tree (a second clone, a CI checkout)."""
    other = tmp_path / "checkout" / "csrc"
    shutil.copytree(SOURCE_DIR, other)
    assert default_build_dir(other) != default_build_dir(SOURCE_DIR)
    assert default_build_dir(SOURCE_DIR) == default_build_dir(SOURCE_DIR / ".." / "csrc")
    assert torch.__version__ in default_build_dir(other).name
