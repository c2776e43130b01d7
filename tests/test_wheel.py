"""The wheel built from this checkout: installed on its own (not the editable checkout), it carries the
C++ runner's sources and ``py.typed``, declares the tested torch/Triton range, builds the runner, and holds
only the package (no ``benchmarks/``, ``tests/`` or ``examples/``; of the benchmarks, only ``bench train``
and ``bench generate``)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)], check=True)
    (built,) = out.glob("inductor_ext-*.whl")
    return built


def test_wheel_carries_sources_and_declares_the_tested_range(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line for line in archive.read(metadata).decode().splitlines() if line.startswith("Requires-Dist")]
    for path in (
        "csrc/aoti_runner.cpp",
        "csrc/generate.cpp",
        "csrc/tensor_file.h",
        "csrc/CMakeLists.txt",
        "py.typed",
        "bench/train/cli.py",
        "bench/generate.py",
    ):
        assert f"inductor_ext/{path}" in names, path
    assert "Requires-Dist: torch<2.14,>=2.11" in requires and "Requires-Dist: triton<3.7,>=3.6" in requires


def test_wheel_holds_the_package_and_no_micro_benchmark(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if ".dist-info/" not in n]
    assert names and all(n.startswith("inductor_ext/") for n in names), [n for n in names if "/" not in n][:5]
    micro = {path.stem for path in (ROOT / "benchmarks").glob("*.py")} - {"__init__", "__main__", "harness"}
    bench = {Path(n).stem for n in names if n.startswith("inductor_ext/bench/")}
    assert micro and not micro & bench, sorted(micro & bench)
    assert bench <= {"__init__", "__main__", "compile_split", "fsdp", "generate", "harness", "llama", "packing", "train", "cli",
                     "model", "providers", "qlora", "report", "worker"}, sorted(bench)  # fmt: skip


def test_installed_wheel_builds_the_cpp_runner(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)  # fmt: skip
    script = (
        "import inductor_ext, inductor_ext.runtime.cpp_runner as r, sys; "
        f"assert inductor_ext.__file__.startswith({str(target)!r}), inductor_ext.__file__; "
        f"print(r.build_runner(build_dir=__import__('pathlib').Path({str(tmp_path / 'build')!r})))"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env={"PYTHONPATH": str(target), **_env()},
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(done.stdout.strip().splitlines()[-1]).is_file()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
