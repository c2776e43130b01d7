"""inductor_ext/_compat: importing the package patches nothing of torch, our compiles install their fixes
only while they run, and stock ``torch.compile`` emits the same code with and without the package."""

import json
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from inductor_ext import _compat
from inductor_ext._compat import Patch

_ATTRIBUTES = """
import importlib, json, sys
def attributes(targets):
    found = {}
    for target in targets:
        module, _, path = target.partition(":")
        owner = importlib.import_module(module)
        *owners, name = path.split(".")
        for part in owners:
            owner = getattr(owner, part)
        found[target] = repr(getattr(owner, name, None))
    return found
"""


def _run(script: str) -> str:
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_and_our_compiles_leave_every_patched_attribute_as_torch_has_it():
    """In a fresh process: each attribute the seam patches, before ``import inductor_ext``, after it, and
    after a compile (forward and backward) under ``fastops_inductor``: the same object each time."""
    targets = [patch.target for patch in _compat.inductor_patches()]
    assert len(targets) >= 4
    script = _ATTRIBUTES + textwrap.dedent(f"""
        import torch
        targets = {targets!r}
        before = attributes(targets)
        import inductor_ext
        after_import = attributes(targets)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU())
        torch.compile(net, backend="fastops_inductor")(torch.randn(4, 8)).sum().backward()
        assert inductor_ext._compat.installed() == []
        print(json.dumps([before, after_import, attributes(targets)]))
    """)
    before, after_import, after_compile = json.loads(_run(script).splitlines()[-1])
    assert before == after_import == after_compile


_STOCK_COMPILE = """
import torch
from torch._inductor.utils import run_and_get_code
{setup}
torch.manual_seed(0)
x = torch.randn(16, 32, requires_grad=True)
w = torch.randn(32, 32, requires_grad=True)

def step(x, w):
    y = torch.nn.functional.silu(x @ w)
    loss = torch.nn.functional.cross_entropy(y, torch.arange(16) % 32)
    loss.backward()
    return loss

_, code = run_and_get_code(torch.compile(step), x, w)
print("\\n=====\\n".join(code))
"""


def test_stock_torch_compile_emits_the_same_code_with_the_package_imported_and_used(tmp_path):
    """Fresh processes, each with its own empty Inductor cache: stock Inductor's generated code for a
    training step, without the package, and after importing it and compiling with our backend."""
    ours = """
import inductor_ext
net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU())
torch.compile(net, backend="fastops_inductor")(torch.randn(4, 8)).sum().backward()
torch._dynamo.reset()
"""
    codes = []
    for name, setup in (("plain", ""), ("ours", ours)):
        cache = tmp_path / name
        script = f"import os; os.environ['TORCHINDUCTOR_CACHE_DIR'] = {str(cache)!r}\n" + _STOCK_COMPILE
        code = _run(script.format(setup=setup)).replace(str(cache), "<cache>")
        codes.append(re.sub(r"AOT ID: \['\d+_", "AOT ID: ['", code))  # graphs count up per process
    assert "def call(" in codes[0] and codes[0] == codes[1]


def _patch(name: str, owner: type, tested: tuple, **kwargs) -> Patch:
    return Patch(name, f"{__name__}:{owner.__name__}.value", lambda old: f"patched {old}", tested, "none", **kwargs)


class _Target:
    value = "torch's"


def test_patches_nest_across_blocks_and_undo_when_the_last_block_leaves():
    patch = _patch("nesting", _Target, ((2, 0), (9, 99)))
    with _compat.applied([patch]):
        assert _Target.value == "patched torch's" and _compat.installed() == ["nesting"]
        with _compat.applied([patch]):
            assert _Target.value == "patched torch's"
        assert _Target.value == "patched torch's"
    assert _Target.value == "torch's" and _compat.installed() == []


def test_an_untested_torch_or_a_torch_that_has_the_fix_gets_no_patch(monkeypatch):
    untested = _patch("untested", _Target, ((1, 0), (1, 9)))
    message = r"outside the versions the patch 'untested' was tested on \(1\.0-1\.9\)"
    with pytest.warns(RuntimeWarning, match=message), _compat.applied([untested]):
        assert _Target.value == "torch's"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        with _compat.applied([untested]):
            pass
    fixed_upstream = _patch("fixed", _Target, ((2, 0), (9, 99)), needed=lambda: False)
    with _compat.applied([fixed_upstream]):
        assert _Target.value == "torch's"


def test_every_patch_names_its_versions_and_upstream_reference():
    for patch in _compat.inductor_patches():
        first, last = patch.tested
        assert (2, 11) <= first <= last and patch.upstream and ":" in patch.target, patch
    assert _compat.package_version("torch") == tuple(int(n) for n in torch.__version__.split(".")[:2])
