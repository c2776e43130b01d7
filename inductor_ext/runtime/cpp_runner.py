"""Build and call the C++ AOTInductor executables from Python: the runner (``inductor_ext/csrc/aoti_runner.cpp``)
and the generation loop (``inductor_ext/csrc/generate.cpp``).

Both load a ``.pt2`` package with ``torch::inductor::AOTIModelPackageLoader`` and run it
with no Python in the process; these helpers build them with CMake against the installed
torch (once per torch version, cached) and exchange tensors with them through
:mod:`inductor_ext.runtime.tensor_file`.
"""

import dataclasses
import hashlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import filelock
import torch

from inductor_ext.runtime.tensor_file import read_tensors, write_tensors
from inductor_ext.tuning.database import cache_dir

SOURCE_DIR = Path(__file__).resolve().parent.parent / "csrc"


@dataclasses.dataclass(frozen=True)
class RunnerResult:
    outputs: list[torch.Tensor]
    latency_ms: float
    """Median over the timed iterations (host wall clock around each run)."""


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    tokens: torch.Tensor
    """``(batch, prompt + generated)`` int64: the prompt and its continuation (the first timed run's)."""
    prefill_ms: float
    """Median over the runs of the prefill call (host wall clock, the device synchronised)."""
    decode_ms_per_token: float
    """Median over the runs of the time after the prefill over the decode calls (nan without any)."""


def build_runner(build_dir: Path | None = None, source_dir: Path = SOURCE_DIR) -> Path:
    """Path of the ``aoti_runner`` executable, building it and ``aoti_generate`` with CMake where either is
    missing or older than its sources (under a file lock, so concurrent callers build once).

    The default ``build_dir`` is per torch version and per ``source_dir`` under the cache directory.
    """
    if not (source_dir / "CMakeLists.txt").is_file():
        raise FileNotFoundError(f"build_runner: no CMakeLists.txt in {source_dir}; the package ships its sources there")
    build_dir = build_dir or default_build_dir(source_dir)
    executable = build_dir / "aoti_runner"
    executables = [executable, build_dir / "aoti_generate"]
    build_dir.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(build_dir) + ".lock"):
        sources = [source_dir / name for name in ("aoti_runner.cpp", "generate.cpp", "tensor_file.h", "CMakeLists.txt")]
        newest = max(s.stat().st_mtime for s in sources)
        if all(e.exists() and e.stat().st_mtime >= newest for e in executables):
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


def default_build_dir(source_dir: Path = SOURCE_DIR) -> Path:
    """The cached build directory for ``source_dir`` and this torch: CMake binds a build directory to one source."""
    source_key = hashlib.sha1(str(source_dir.resolve()).encode()).hexdigest()[:12]
    return cache_dir() / f"aoti_runner-torch{torch.__version__}-{source_key}"


def build_generator(build_dir: Path | None = None, source_dir: Path = SOURCE_DIR) -> Path:
    """Path of the ``aoti_generate`` executable (built with ``aoti_runner`` by :func:`build_runner`)."""
    return build_runner(build_dir, source_dir).with_name("aoti_generate")


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


def run_generate(
    package: str | Path, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
    device: str = "cpu", sample: bool = False, temperature: float = 1.0, top_k: int | None = None, seed: int = 0,
    cuda_graph: bool = False, iters: int = 1, executable: Path | None = None,
) -> GenerateResult:  # fmt: skip
    """Generate with ``package`` (from :func:`inductor_ext.runtime.generation.export_generation`) in ``aoti_generate``.

    The loop of :meth:`inductor_ext.runtime.generation.GenerationPackage.generate` in a separate process with no
    Python: greedy unless ``sample`` (then ``temperature``, ``top_k`` (None: the whole vocabulary) and
    ``seed`` apply; the draws are reproducible but not Python's). ``attention_mask`` marks a left-padded
    batch's real tokens. The generation runs ``iters`` times for the timings; the tokens are the first run's.
    """
    executable = executable or build_generator()
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file, out_file = Path(tmp) / "prompt.bin", Path(tmp) / "out.bin"
        write_tensors(prompt_file, [input_ids] if attention_mask is None else [input_ids, attention_mask])
        command = [str(executable), str(package), str(prompt_file), str(out_file),
                   "--max-new-tokens", str(max_new_tokens), "--device", device, "--iters", str(iters)]  # fmt: skip
        if sample:
            command += ["--sample", "--temperature", repr(float(temperature)), "--seed", str(seed)]
            command += [] if top_k is None else ["--top-k", str(top_k)]
        if cuda_graph:
            command.append("--cuda-graph")
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"aoti_generate failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        timing = re.search(r"prefill_ms median=(\S+) decode_ms_per_token median=(\S+)", done.stdout)
        if timing is None:
            raise RuntimeError(f"aoti_generate printed no timing line:\n{done.stdout[-3000:]}")
        (tokens,) = read_tensors(out_file)
        return GenerateResult(tokens, float(timing.group(1)), float(timing.group(2)))
