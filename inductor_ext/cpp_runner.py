"""Build and call the C++ AOTInductor runner (``inductor_ext/csrc/aoti_runner.cpp``) from Python.

The runner loads a ``.pt2`` package with ``torch::inductor::AOTIModelPackageLoader``
and runs it with no Python in the process; these helpers build it with CMake against
the installed torch (once per torch version, cached) and exchange tensors with it
through :mod:`inductor_ext.tensor_file`.
"""

import dataclasses
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import filelock
import torch

from inductor_ext.tensor_file import read_tensors, write_tensors
from inductor_ext.tuning.database import cache_dir

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"


@dataclasses.dataclass(frozen=True)
class RunnerResult:
    outputs: list[torch.Tensor]
    latency_ms: float
    """Median over the timed iterations (host wall clock around each run)."""


def build_runner(build_dir: Path | None = None, source_dir: Path = SOURCE_DIR) -> Path:
    """Path of the ``aoti_runner`` executable, building it with CMake if needed (~20 s)."""
    if not (source_dir / "CMakeLists.txt").is_file():
        raise FileNotFoundError(f"build_runner: no CMakeLists.txt in {source_dir}; the package ships its sources there")
    build_dir = build_dir or cache_dir() / f"aoti_runner-torch{torch.__version__}"
    executable = build_dir / "aoti_runner"
    build_dir.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(build_dir) + ".lock"):
        sources = [source_dir / "aoti_runner.cpp", source_dir / "CMakeLists.txt"]
        if executable.exists() and all(executable.stat().st_mtime >= s.stat().st_mtime for s in sources):
            return executable
        configure = [_cmake(), "-S", str(source_dir), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                     f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"]  # fmt: skip
        for command in (configure, [_cmake(), "--build", str(build_dir), "--parallel"]):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(
                    f"build_runner: {' '.join(command[:2])} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
                )
    return executable


def _cmake() -> str:
    """``cmake`` from PATH, else the one of the ``cmake`` pip package (the test extra installs it)."""
    found = shutil.which("cmake")
    if found:
        return found
    try:
        import cmake  # type: ignore[import-not-found]
    except ImportError as error:
        raise FileNotFoundError(
            "build_runner: cmake not found; `pip install cmake` or install it system-wide"
        ) from error
    return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")


def run_package(
    package: str | Path, inputs: Sequence[torch.Tensor], *, device: str = "cpu", iters: int = 10,
    runner: Path | None = None,
) -> RunnerResult:  # fmt: skip
    """Run ``package`` in the C++ runner (a separate process) and return its outputs and latency."""
    runner = runner or build_runner()
    with tempfile.TemporaryDirectory() as tmp:
        inputs_file, outputs_file = Path(tmp) / "inputs.bin", Path(tmp) / "outputs.bin"
        write_tensors(inputs_file, inputs)
        command = [
            str(runner),
            str(package),
            str(inputs_file),
            str(outputs_file),
            "--iters",
            str(iters),
            "--device",
            device,
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"aoti_runner failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        latency = re.search(r"latency_ms median=([0-9.eE+-]+)", done.stdout)
        return RunnerResult(read_tensors(outputs_file), float(latency.group(1)) if latency else float("nan"))
