"""AOTInductor export on a real GPU: a bf16 Llama-style decoder stack with our ops, exported with dynamic
batch and sequence, loaded in a fresh Python process that never imports inductor_ext (only the C++
runtime promotion, docs/export.md) and in the C++ runner; outputs match eager at sizes far from the example."""

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import inductor_ext
from benchmarks.llama_style import LlamaStyleDecoder
from inductor_ext.runtime.cpp_runner import run_package
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CXX_RUNTIME = Path(inductor_ext.__file__).parent / "runtime" / "cxx_runtime.py"
LOAD_WITHOUT_INDUCTOR_EXT = textwrap.dedent(
    """
    import importlib.util, sys, torch
    spec = importlib.util.spec_from_file_location("cxx_runtime", sys.argv[1])
    cxx_runtime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cxx_runtime)
    cxx_runtime.promote_cxx_runtime()
    run = torch._inductor.aoti_load_package(sys.argv[2])
    torch.save([run(x).cpu() for x in torch.load(sys.argv[3])], sys.argv[4])
    assert not any(name.startswith("inductor_ext") for name in sys.modules), "inductor_ext was imported"
    """
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaStyleDecoder(hidden=1024, heads=8, kv_heads=2, intermediate=2816, layers=2).cuda().eval()
    reference = LlamaStyleDecoder(hidden=1024, heads=8, kv_heads=2, intermediate=2816, layers=2).cuda().eval()
    model.to(torch.bfloat16)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    path = tmp_path_factory.mktemp("export") / "decoder.pt2"
    example = torch.randn(2, 64, 1024, device="cuda", dtype=torch.bfloat16)
    # Dim.DYNAMIC, not named ranges: on CUDA, tracing adds always-true guards on the sequence length
    # (min(128*s, 512*s) == 128*s) that torch.export rejects for a named Dim; DYNAMIC keeps them as checks
    dims = ({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},)
    inductor_ext.export(model, (example,), path, dynamic_shapes=dims)
    return model, reference, path


SHAPES = [(3, 200), (2, 1000), (8, 17)]  # far from the (2, 64) example


def _inputs():
    return [torch.randn(b, s, 1024, device="cuda", dtype=torch.bfloat16) for b, s in SHAPES]


def _check(outputs, inputs, model, reference):
    with torch.no_grad():
        for out, x in zip(outputs, inputs):
            ref = reference(x.float())
            eager = model(x)
            assert out.shape == eager.shape
            assert rel_err(out.cuda(), ref) <= 2 * rel_err(eager, ref) + 1e-3, (x.shape, rel_err(out.cuda(), ref))


def test_package_compiles_our_ops_with_no_call_back_into_them(exported):
    """Each fastops op became a compiled kernel (ours or Inductor's, as the route choice decided)."""
    with zipfile.ZipFile(exported[2]) as archive:
        names = archive.namelist()
        wrapper = "".join(archive.read(n).decode() for n in names if n.endswith(".wrapper.cpp"))
    assert wrapper, names
    assert "fastops" not in wrapper  # no proxy-executor call into a torch.ops.fastops op
    assert any(n.endswith(".cubin") for n in names), names
    ours = [k for k in ("rms_norm_fwd_kernel", "rope_kernel", "glu_fwd_kernel") if k in wrapper]
    print("our kernels in the package:", ours)


def test_fresh_python_process_without_inductor_ext_loads_and_matches_eager(exported, tmp_path):
    model, reference, path = exported
    inputs = _inputs()
    torch.save(inputs, tmp_path / "inputs.pt")
    done = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_INDUCTOR_EXT, str(CXX_RUNTIME), str(path), str(tmp_path / "inputs.pt"),
         str(tmp_path / "outputs.pt")],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    _check(torch.load(tmp_path / "outputs.pt"), inputs, model, reference)


def test_inductor_ext_load_in_process_matches_eager(exported):
    model, reference, path = exported
    run = inductor_ext.load(path)
    inputs = _inputs()
    _check([run(x) for x in inputs], inputs, model, reference)


def test_cpp_runner_matches_eager(exported):
    model, reference, path = exported
    inputs = _inputs()
    outputs = [run_package(path, [x], device="cuda", iters=3).outputs[0] for x in inputs]
    _check(outputs, inputs, model, reference)


def _package_kernels(path: Path) -> tuple[int, set[str]]:
    """The package's cubin count and the reduction launches of its wrapper: each launch goes through a
    ``call_<kernel>`` function, ``call_triton_per_*``/``call_triton_red_*`` for an Inductor reduction
    (persistent or looped) and ``call_multi_kernel_<i>`` for a multi-kernel, whose body launches the
    variant chosen at compile time. (The wrapper also declares every kernel Inductor generated,
    chosen or not, as a null handle that is never loaded: names alone prove nothing.)"""
    import re

    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        wrapper = "".join(archive.read(n).decode() for n in names if n.endswith(".wrapper.cpp"))
    cubins = sum(n.endswith(".cubin") for n in names)
    return cubins, set(re.findall(r"\bcall_(triton_(?:per|red)_fused_\w+|multi_kernel_\d+)\b", wrapper))


def test_multi_kernel_export_holds_one_variant_per_reduction(tmp_path):
    """With multi-kernel on and Inductor's route, each reduction could be persistent or looped; the
    package must hold and launch the variant chosen at export (compile-time tuning on random
    inputs), not both: as many cubins and reduction kernels as the same export with multi-kernel off
    (one variant per reduction, chosen by Inductor's heuristic)."""
    torch.manual_seed(0)
    model = LlamaStyleDecoder(hidden=1024, heads=8, kv_heads=2, intermediate=2816, layers=1).cuda().eval()
    model.to(torch.bfloat16)
    example = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16)
    exports = {
        multi_kernel: _package_kernels(inductor_ext.export(
            model, (example,), tmp_path / f"mk{multi_kernel}.pt2",
            options={"fastops.multi_kernel": multi_kernel, "fastops.route": "inductor"},
        ))
        for multi_kernel in (0, 1)
    }  # fmt: skip
    (single_cubins, single), (cubins, chosen) = exports[0], exports[1]
    assert single and all(name.startswith("triton_") for name in single), exports
    # the same number of reductions launched and cubins embedded: one variant each (on the H200 on
    # 2026-11-30: 9 cubins both ways, 3 reductions)
    assert len(chosen) == len(single) and cubins == single_cubins, exports
    path = tmp_path / "mk1.pt2"
    with torch.no_grad():
        x = torch.randn_like(example)  # exported with static shapes: the example's
        assert rel_err(inductor_ext.load(path)(x), model(x)) < 2e-2
