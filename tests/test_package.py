"""Packaging: import side effects, the ``torch_dynamo_backends`` entry point, backend discovery by name.

Fresh interpreters (subprocesses) are used wherever the state of *this* process (already
imported ``inductor_ext``, Dynamo's backend registry) would hide the behaviour under test.
They run from ``tmp_path``, so a package imported there comes from the installed
distribution (``pip install -e .``), not from the current directory.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import inductor_ext
import inductor_ext.inductor.backend

REPO_ROOT = Path(__file__).resolve().parents[1]
BACKEND_NAME = "fastops_inductor"
ENTRY_POINT_VALUE = "inductor_ext.inductor.backend:fastops_inductor"


def _run_python(script: str, cwd: Path, env: dict[str, str] | None = None) -> dict:
    """Run ``script`` in a fresh interpreter; it must print one JSON object as its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        check=False,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})} if env is not None else None,
        timeout=300,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("interpret", ["1", "0"], ids=["interpreter", "no-interpreter"])
def test_import_registers_ops_without_initialising_cuda(tmp_path, interpret):
    script = """
        import json
        import torch

        lazy_init_calls = []
        _lazy_init = torch.cuda._lazy_init

        def _spy():
            lazy_init_calls.append(1)
            return _lazy_init()

        torch.cuda._lazy_init = _spy  # every CUDA initialisation in torch goes through it

        import inductor_ext
        import triton

        ops = torch.ops.fastops
        print(json.dumps({
            "lazy_init_calls": len(lazy_init_calls),
            "cuda_initialized": torch.cuda.is_initialized(),
            "triton_driver_active": getattr(triton.runtime.driver, "_active", None) is not None,
            "fwd": str(ops.rms_norm_fwd.default._schema),
            "bwd": str(ops.rms_norm_bwd.default._schema),
        }))
    """
    pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {"TRITON_INTERPRET": interpret, "PYTHONPATH": pythonpath}
    result = _run_python(script, tmp_path, env)
    assert result["lazy_init_calls"] == 0
    assert result["cuda_initialized"] is False
    assert result["triton_driver_active"] is False
    assert result["fwd"].startswith("fastops::rms_norm_fwd(Tensor x, Tensor? weight, float eps, float offset, str")
    assert result["bwd"].startswith("fastops::rms_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float")


def test_entry_point_is_declared_in_installed_metadata():
    found = importlib.metadata.entry_points(group="torch_dynamo_backends", name=BACKEND_NAME)
    assert len(found) == 1, (
        f"no single {BACKEND_NAME!r} entry point in group torch_dynamo_backends ({list(found)}); "
        "is the package installed (`pip install -e .`)?"
    )
    (entry_point,) = found
    assert entry_point.value == ENTRY_POINT_VALUE
    assert entry_point.dist is not None
    assert entry_point.dist.metadata["Name"].replace("_", "-").lower() == "inductor-ext"
    assert entry_point.load() is inductor_ext.inductor.backend.fastops_inductor


def test_backend_is_listed_in_a_process_that_never_imported_the_package(tmp_path):
    script = """
        import json
        import sys
        import torch

        names = torch._dynamo.list_backends()
        print(json.dumps({"names": names, "imported": "inductor_ext" in sys.modules}))
    """
    result = _run_python(script, tmp_path)
    assert BACKEND_NAME in result["names"]
    assert result["imported"] is False  # found through the entry point's metadata alone


def test_compile_by_name_in_a_process_that_never_imported_the_package(tmp_path):
    script = """
        import json
        import sys
        import torch

        assert "inductor_ext" not in sys.modules

        def f(x, y):
            return torch.sin(x) * y + x.sum(-1, keepdim=True)

        x, y = torch.randn(5, 7), torch.randn(5, 7)
        compiled = torch.compile(f, backend="fastops_inductor", fullgraph=True)
        out = compiled(x, y)
        print(json.dumps({
            "max_abs_err": (out - f(x, y)).abs().max().item(),
            "shape": list(out.shape),
            "imported": "inductor_ext" in sys.modules,
            "backend_module": torch._dynamo.lookup_backend("fastops_inductor").__module__,
        }))
    """
    result = _run_python(script, tmp_path)
    assert result["shape"] == [5, 7]
    assert result["max_abs_err"] < 1e-5
    assert result["imported"] is True  # loaded through the entry point
    assert result["backend_module"] == "inductor_ext.inductor.backend"


def test_extras_bound_transformers_to_the_checked_range_and_both_setups_agree():
    """Every extra that installs transformers bounds it to the one tested range (``hf``'s); the test pin lies
    in that range, and the README's two set-up commands (requirements-cpu.txt, requirements-test.txt)
    install the same version."""
    import re
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (bound,) = [r for r in extras["hf"] if r.startswith("transformers")]
    found = re.fullmatch(r"transformers>=(\d+)\.(\d+),<(\d+)\.(\d+)", bound)
    assert found, bound
    low, high = (int(found[1]), int(found[2])), (int(found[3]), int(found[4]) - 1)
    for name, requirements in extras.items():
        pins = [r for r in requirements if r.startswith("transformers")]
        if name != "test":
            assert all(pin == bound for pin in pins), (name, pins)
    (test_pin,) = [r for r in extras["test"] if r.startswith("transformers")]
    version = tuple(int(part) for part in test_pin.split("==")[1].split(".")[:2])
    assert low <= version <= high, test_pin
    cpu = re.search(r"^transformers==(\S+)$", (root / "requirements-cpu.txt").read_text(), re.MULTILINE)
    assert cpu and f"transformers=={cpu.group(1)}" == test_pin
    assert "cmake>=3.18" in extras["examples"] and "cmake>=3.18" in extras["generate"]
