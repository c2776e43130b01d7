"""AOTInductor on CPU: ``torch.export`` a small Llama-style block using ``inductor_ext.nn.RMSNorm``,
compile it into a ``.pt2`` package and run the package.

The exported program keeps ``fastops::rms_norm_fwd`` as a real op (torch.export does not
decompose triton_ops); AOTInductor then compiles the op's CPU branch into the package's
C++, so the package runs without ``inductor_ext`` (and, from C++, without Python).
One export + AOTI compile costs ~15 s on two cores: the static one is shared by the module.
"""

import json
import random
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import inductor_ext
from inductor_ext.ops.lora import LoraProjection, lora_linear
from inductor_ext.runtime.package_inputs import METADATA_KEY
from tests.tolerances import OUTPUT, rel_err

HIDDEN = 64
FP32_TOL = OUTPUT[torch.float32]


pytestmark = pytest.mark.xdist_group("export")  # one worker builds the module's packages once


class LlamaStyleBlock(torch.nn.Module):
    """Embedding-free Llama-style block: pre-norm linear mixer and pre-norm SwiGLU MLP, with residuals."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.attn_norm = inductor_ext.nn.RMSNorm(hidden, eps=1e-6)
        self.mixer = torch.nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = inductor_ext.nn.RMSNorm(hidden, eps=1e-5)
        self.gate = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():  # non-trivial norm weights, so a dropped weight would show
            self.attn_norm.weight.uniform_(0.5, 1.5)
            self.mlp_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def _eager(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


@pytest.fixture(scope="module")
def model() -> LlamaStyleBlock:
    torch.manual_seed(0)
    return LlamaStyleBlock().eval()


@pytest.fixture(scope="module")
def static_package(model, tmp_path_factory):
    """(exported program, package path, example input) for a static (2, 8, HIDDEN) input; the package is
    ``inductor_ext.export``'s (``torch.export`` and the AOTInductor compile, which costs the seconds)."""
    x = torch.randn(2, 8, HIDDEN)
    ep = torch.export.export(model, (x,))
    path = inductor_ext.export(model, (x,), tmp_path_factory.mktemp("aoti") / "block.pt2")
    return ep, path, x


def _targets(ep: torch.export.ExportedProgram) -> list:
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


def test_exported_graph_keeps_the_fastops_op(static_package):
    ep, _, _ = static_package
    targets = _targets(ep)
    # one call per RMSNorm: the op survives export as a real op, not as its decomposition
    assert targets.count(torch.ops.fastops.rms_norm_fwd.default) == 2
    assert torch.ops.aten.rsqrt.default not in targets


def test_exported_program_module_matches_eager(model, static_package):
    ep, _, x = static_package
    out = ep.module()(x)
    assert rel_err(out, _eager(model, x)) < FP32_TOL


def test_package_file_is_written(static_package):
    _, path, _ = static_package
    assert path.is_file() and path.name == "block.pt2"
    assert zipfile.is_zipfile(path)
    names = zipfile.ZipFile(path).namelist()
    assert any(n.endswith(".so") for n in names), names


def test_package_has_no_call_back_into_the_fastops_op(static_package):
    """The op was compiled to C++ (its CPU branch), not left as a proxy-executor call that
    would need the Python registration (and fails in pure C++: "Could not find schema")."""
    _, path, _ = static_package
    _assert_no_python_op_call(path)


def _assert_no_python_op_call(path: Path) -> None:
    with zipfile.ZipFile(path) as z:
        sources = {n: z.read(n).decode(errors="replace") for n in z.namelist() if n.endswith(".cpp")}
    assert any(n.endswith("wrapper.cpp") for n in sources), list(sources)
    for name, src in sources.items():
        assert "fastops" not in src, name
        assert "aoti_torch_proxy_executor_call_function" not in src, name


def test_loaded_package_matches_eager(model, static_package):
    _, path, x = static_package
    runner = torch._inductor.aoti_load_package(str(path))
    out = runner(x)
    expected = _eager(model, x)
    assert isinstance(out, torch.Tensor) and out.shape == expected.shape == x.shape
    assert rel_err(out, expected) < FP32_TOL
    # fresh values at the compiled shape, too
    x2 = torch.randn_like(x)
    assert rel_err(runner(x2), _eager(model, x2)) < FP32_TOL


def test_load_refuses_a_strided_input_that_the_package_would_misread(model, static_package):
    """A package reads each input in its example's (contiguous) layout without checking; ``load``'s callable
    names the argument instead. Contiguous inputs pass through unchanged."""
    _, path, x = static_package
    run = inductor_ext.load(path)
    wide = torch.cat([x, x], dim=-1)
    with pytest.raises(ValueError, match=r"argument 0 must be contiguous, got strides"):
        run(wide[..., : x.shape[-1]])
    assert rel_err(run(x), _eager(model, x)) < FP32_TOL
    assert run.get_metadata() == torch._inductor.aoti_load_package(str(path)).get_metadata()


@pytest.mark.parametrize(
    ("shape", "dtype", "device", "message"),
    [
        # a static package given another batch returns that many rows, the extra ones garbage
        ((3, 8, HIDDEN), torch.float32, "cpu", r"argument 0 must have shape \(2, 8, 64\), got \(3, 8, 64\)"),
        ((2, 8), torch.float32, "cpu", r"argument 0 must have shape \(2, 8, 64\), got \(2, 8\)"),
        ((2, 8, HIDDEN), torch.float64, "cpu", r"argument 0 must be torch.float32, got torch.float64"),
        ((2, 8, HIDDEN), torch.float32, "meta", r"argument 0 must be on cpu, got meta"),
    ],
)
def test_load_refuses_inputs_unlike_the_exported_ones(static_package, shape, dtype, device, message):
    """The package records its inputs at export (``inductor_ext.runtime.package_inputs``); ``load``'s callable checks them."""
    _, path, x = static_package
    run = inductor_ext.load(path)
    assert json.loads(run.get_metadata()[METADATA_KEY]) == {
        "args": [[{"shape": list(x.shape), "dtype": "float32", "device": "cpu"}]],
        "kwargs": {},
    }
    with pytest.raises(ValueError, match=message):
        run(torch.randn(shape, dtype=dtype, device=device))
    with pytest.raises(ValueError, match="exported with 1 positional argument"):
        run(x, x)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("random", "is not an AOTInductor package: not a zip archive"),
        ("truncated", "is not an AOTInductor package: not a zip archive"),
        ("corrupt", "is a corrupt AOTInductor package \\(Bad CRC-32 for file"),
    ],
)
def test_load_names_a_file_that_is_not_a_package(static_package, tmp_path, damage, message):
    _, path, _ = static_package
    package = path.read_bytes()
    if damage == "random":
        package = random.Random(0).randbytes(4096)
    elif damage == "truncated":
        package = package[: len(package) // 2]
    else:  # a byte flipped inside the compiled library's data
        with zipfile.ZipFile(path) as archive:
            library = next(info for info in archive.infolist() if info.filename.endswith(".so"))
        flipped = library.header_offset + 100 + library.compress_size // 2
        package = package[:flipped] + bytes([package[flipped] ^ 0xFF]) + package[flipped + 1 :]
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(package)
    with pytest.raises(ValueError, match=re.escape(str(bad)) + " " + message):
        inductor_ext.load(bad)


def test_load_runs_a_package_on_its_own_device_type_only(model, static_package):
    _, path, x = static_package
    assert rel_err(inductor_ext.load(path, device=torch.device("cpu"))(x), _eager(model, x)) < FP32_TOL
    with pytest.raises(ValueError, match=r"device must be of the package's device type 'cpu' .*got 'meta'"):
        inductor_ext.load(path, device="meta")


def test_package_runs_in_a_process_without_inductor_ext(model, static_package, tmp_path):
    _, path, x = static_package
    torch.save({"x": x, "expected": _eager(model, x)}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        io = torch.load({str(tmp_path / "io.pt")!r})
        out = torch._inductor.aoti_load_package({str(path)!r})(io["x"])
        err = ((out.double() - io["expected"].double()).norm() / io["expected"].double().norm()).item()
        assert "inductor_ext" not in sys.modules
        print("REL_ERR", err)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = float(proc.stdout.split("REL_ERR")[-1])
    assert err < FP32_TOL


def test_dynamic_batch_package(model, tmp_path):
    x = torch.randn(3, 8, HIDDEN)
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (x,), dynamic_shapes={"x": {0: batch}})
    assert _targets(ep).count(torch.ops.fastops.rms_norm_fwd.default) == 2
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "block_dyn.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    for b in (3, 5):
        xb = torch.randn(b, 8, HIDDEN)
        out = runner(xb)
        assert out.shape == (b, 8, HIDDEN)
        assert rel_err(out, _eager(model, xb)) < FP32_TOL
    # a package without inductor_ext's record of its inputs (torch's own export) loads, unchecked
    package = inductor_ext.load(path)
    assert METADATA_KEY not in package.get_metadata()
    assert rel_err(package(xb), _eager(model, xb)) < FP32_TOL


PROMOTION_CHECK = textwrap.dedent(
    """
    import ctypes, torch
    from inductor_ext.runtime.cxx_runtime import loaded_cxx_runtimes, promote_cxx_runtime
    symbol = "_ZNSt6locale7classicEv"  # std::locale::classic(), defined only by libstdc++
    before = hasattr(ctypes.CDLL(None), symbol)
    paths = promote_cxx_runtime()
    after = hasattr(ctypes.CDLL(None), symbol)
    print(len(paths), before, after, loaded_cxx_runtimes() == paths)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_promote_cxx_runtime_makes_the_loaded_libstdcxx_global():
    """What ``inductor_ext.load`` does before loading a package (the H200 segfault's fix, docs/export.md)."""
    done = subprocess.run([sys.executable, "-c", PROMOTION_CHECK], capture_output=True, text=True, check=True)
    count, _before, after, same = done.stdout.split()
    assert int(count) >= 1  # torch's libraries need libstdc++
    assert after == "True" and same == "True"  # global now, and no second copy was mapped


@pytest.mark.skipif(shutil.which("g++") is None, reason="builds small shared libraries with g++")
def test_load_promotes_the_runtime_only_for_a_wrapper_with_its_own_static_libstdcxx(tmp_path):
    """``inductor_ext.load``'s check (docs/export.md): a library linked with its own static libstdc++
    (C++ runtime symbols, ``libstdc++.so.6`` not needed) against one linked with the shared runtime and
    one in C, each alone in a package."""
    from inductor_ext.runtime.cxx_runtime import carries_static_cxx_runtime

    (tmp_path / "wrapper.cpp").write_text(
        '#include <locale>\nextern "C" int classic_locale_size() { return (int)std::locale::classic().name().size(); }\n'
    )
    (tmp_path / "plain.c").write_text("int twice(int x) { return 2 * x; }\n")
    builds = {
        "static": ["g++", "-shared", "-fPIC", "-static-libstdc++", "wrapper.cpp"],
        "shared": ["g++", "-shared", "-fPIC", "wrapper.cpp"],
        "plain_c": ["g++", "-x", "c", "-shared", "-fPIC", "plain.c"],
    }
    found = []
    for name, command in builds.items():
        subprocess.run([*command, "-o", f"{name}.so"], cwd=tmp_path, check=True, capture_output=True)
        with zipfile.ZipFile(tmp_path / f"{name}.pt2", "w") as package:
            package.write(tmp_path / f"{name}.so", "model/data/aotinductor/model/wrapper.so")
        found.append(carries_static_cxx_runtime(tmp_path / f"{name}.pt2"))
    assert found == [True, False, False]


class LoraBlock(torch.nn.Module):
    """A fused LoRA projection (``lora_linear``: its low-rank term accumulated in place), as a PEFT model
    patched by ``models.apply`` runs it."""

    def __init__(self, hidden: int = HIDDEN, rank: int = 4) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2 * hidden, hidden) / hidden**0.5, requires_grad=False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, hidden) / hidden**0.5)
        self.lora_b = torch.nn.Parameter(torch.randn(2 * hidden, rank) / rank**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora_linear(x, LoraProjection(self.weight, self.lora_a, self.lora_b, 2.0, None))


def test_lora_package_is_all_cpp(tmp_path):
    """The LoRA op's in-place accumulation is an opaque op under ``torch.compile`` (Inductor reinplaces
    it); compiled for AOTInductor it is traced as aten instead, so the package calls back into nothing."""
    torch.manual_seed(0)
    model = LoraBlock().eval()
    x = torch.randn(16, HIDDEN)
    ep = torch.export.export(model, (x,))
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "lora.pt2"))
    _assert_no_python_op_call(Path(path))
    assert rel_err(torch._inductor.aoti_load_package(str(path))(x), _eager(model, x)) < FP32_TOL
