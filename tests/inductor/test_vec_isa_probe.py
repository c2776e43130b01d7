"""inductor_ext/_compat/vec_isa_probe.py: while our compiles run, a graph whose tensors are all on a GPU
picks no vector ISA and probes nothing, leaving torch's per-process cache empty; any other graph, or a
process that has probed already, gets torch's own answer."""

import functools
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from torch._inductor.virtualized import V

from inductor_ext._compat import vec_isa_probe


@pytest.fixture
def probe():
    """A stand-in for torch's cached ``valid_vec_isa_list`` that counts its probes."""
    probes = []

    @functools.cache
    def valid_vec_isa_list():
        probes.append(1)
        return ["avx512"]

    return vec_isa_probe._no_probe_for_device_graphs(valid_vec_isa_list), probes


@pytest.mark.parametrize(("device_types", "expected", "probed"), [
    ({"cuda"}, [], 0),
    ({"cuda", "cpu"}, ["avx512"], 1),
    ({"cpu"}, ["avx512"], 1),
    (set(), ["avx512"], 1),
])  # fmt: skip
def test_only_a_graph_without_cpu_tensors_skips_the_probe(probe, device_types, expected, probed):
    patched, probes = probe
    with V.set_graph_handler(SimpleNamespace(device_types=device_types)):
        assert patched() == expected
    assert len(probes) == probed
    assert patched.cache_info().currsize == probed  # the skip leaves torch's cache empty


def test_outside_a_graph_and_after_a_probe_torch_answers(probe):
    patched, probes = probe
    assert patched() == ["avx512"]  # no graph being lowered
    with V.set_graph_handler(SimpleNamespace(device_types={"cuda"})):
        assert patched() == ["avx512"]  # the process has probed: its answer, at no cost
    assert len(probes) == 1


def test_the_environment_turns_the_patch_off():
    assert vec_isa_probe.patches({"INDUCTOR_EXT_SKIP_VEC_ISA_PROBE": "0"}) == []
    assert [p.target for p in vec_isa_probe.patches({})] == ["torch._inductor.cpu_vec_isa:valid_vec_isa_list"]


def test_torch_picks_no_isa_for_a_gpu_graph_under_our_patches_and_probes_after_them():
    """A fresh process (torch's cache empty): ``pick_vec_isa`` inside our patches while a CUDA-only graph
    is lowered, then outside them."""
    script = textwrap.dedent("""
        from types import SimpleNamespace
        from torch._inductor import cpu_vec_isa
        from torch._inductor.virtualized import V
        from inductor_ext import _compat

        with _compat.applied(_compat.inductor_patches()), V.set_graph_handler(SimpleNamespace(device_types={"cuda"})):
            print(cpu_vec_isa.pick_vec_isa(), cpu_vec_isa.valid_vec_isa_list.cache_info().currsize)
        cpu_vec_isa.valid_vec_isa_list()
        print(cpu_vec_isa.valid_vec_isa_list.cache_info().currsize)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    inside, outside = proc.stdout.splitlines()[-2:]
    assert inside == "INVALID_VEC_ISA 0"
    assert outside == "1"  # probed, once our patches are gone
