"""inductor_ext/_compat/kernel_analysis_cache.py: torch's per-launch read/write analysis of user-defined Triton
kernels is answered once per (kernel, dtypes, plain values), and never for a launch whose answer
could differ. The analysis itself needs a GPU driver (on CPU torch falls back to "every tensor
is written"), so these tests count calls to a stand-in; tests/gpu/test_backend_gpu.py runs the
real one under the kernel route."""

import pytest
import torch
import triton
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.runtime.autotuner import Autotuner
from triton.runtime.interpreter import InterpretedFunction

from inductor_ext import _compat
from inductor_ext._compat import kernel_analysis_cache
from tests.inductor.kernels_for_analysis import copy_if, copy_if_kernel


@pytest.fixture
def counted():
    calls = []

    def analysis(kernel, kwargs, tma_descriptor_metadata):
        """Like torch's: an autotuner's launch is analysed with its first config's meta-parameters."""
        calls.append(dict(kwargs))
        meta = kernel.configs[0].kwargs if isinstance(kernel, Autotuner) else {}
        return ["Y"] if {**kwargs, **meta}["COPY"] else []

    return kernel_analysis_cache.memoized(analysis), calls


@pytest.fixture(scope="module")
def fake():
    with FakeTensorMode():
        return {
            "f32": torch.empty(16),
            "f32_other": torch.empty(32),  # another size, same dtype: same TTIR
            "bf16": torch.empty(16, dtype=torch.bfloat16),
        }


def launch(x, y, n=16, copy=True):
    return {"X": x, "Y": y, "N": n, "COPY": copy, "BLOCK": 16}


def test_the_memo_is_on_torchs_analysis_only_while_our_compiles_run():
    from torch._higher_order_ops import triton_kernel_wrap

    def current():
        return {name: getattr(triton_kernel_wrap, name) for name in kernel_analysis_cache.ANALYSIS_FUNCTIONS
                if hasattr(triton_kernel_wrap, name)}  # fmt: skip

    torchs = current()
    assert len(torchs) == 1 and not any(f in kernel_analysis_cache._MEMOS.values() for f in torchs.values())
    with _compat.applied(kernel_analysis_cache.patches({})):
        ((name, memo),) = current().items()
        assert memo is kernel_analysis_cache.memo_of(torchs[name]) and memo.__wrapped__ is torchs[name]
    assert current() == torchs


def test_repeated_launches_are_analysed_once(counted, fake):
    memo, calls = counted
    first = memo(copy_if_kernel, launch(fake["f32"], fake["f32"]), {})
    again = memo(copy_if_kernel, launch(fake["f32_other"], fake["f32_other"]), {})
    assert first == again == ["Y"]
    assert len(calls) == 1 and memo.hits == 1


@pytest.mark.parametrize(
    "change",
    [
        {"X": "bf16"},  # a dtype changes the TTIR's pointer types
        {"COPY": False},  # a constexpr changes what is stored
        {"N": 17},  # an int: Triton may specialise on it
    ],
)
def test_what_the_ttir_depends_on_is_in_the_key(counted, fake, change):
    memo, calls = counted
    base = launch(fake["f32"], fake["f32"])
    memo(copy_if_kernel, base, {})
    changed = {**base, **{k: fake[v] if k == "X" else v for k, v in change.items()}}
    memo(copy_if_kernel, changed, {})
    assert len(calls) == 2 and memo.hits == 0


def test_an_autotuners_first_config_is_in_the_key(counted, fake):
    memo, calls = counted
    no_copy = triton.autotune(configs=[triton.Config({"COPY": False, "BLOCK": 16})], key=[])(copy_if_kernel)
    copies = triton.autotune(configs=[triton.Config({"COPY": True, "BLOCK": 16})], key=[])(copy_if_kernel)
    kwargs = {"X": fake["f32"], "Y": fake["f32"], "N": 16}
    assert memo(no_copy, kwargs, {}) == []
    assert memo(copies, kwargs, {}) == ["Y"]
    assert memo(copies, kwargs, {}) == ["Y"]
    assert len(calls) == 2 and memo.hits == 1


def test_symbolic_values_share_an_entry(counted, fake):
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    sym = shape_env.create_unbacked_symint()
    memo, calls = counted
    memo(copy_if_kernel, launch(fake["f32"], fake["f32"], n=sym), {})
    memo(copy_if_kernel, launch(fake["f32"], fake["f32"], n=shape_env.create_unbacked_symint()), {})
    assert len(calls) == 1


@pytest.mark.parametrize("uncacheable", ["real tensor", "tma", "unknown type", "interpreted kernel"])
def test_launches_it_cannot_key_are_analysed_every_time(counted, fake, uncacheable):
    memo, calls = counted
    kernel, kwargs, tma = copy_if_kernel, launch(fake["f32"], fake["f32"]), {}
    if uncacheable == "real tensor":
        kwargs["X"] = torch.empty(16)
    elif uncacheable == "tma":
        tma = {"X": ("stable", ([16],))}
    elif uncacheable == "unknown type":
        kwargs["N"] = object()
    else:
        kernel = InterpretedFunction(copy_if)
    memo(kernel, kwargs, tma)
    memo(kernel, kwargs, tma)
    assert len(calls) == 2 and not memo.answers


def test_each_caller_gets_its_own_copy(counted, fake):
    memo, _calls = counted
    memo(copy_if_kernel, launch(fake["f32"], fake["f32"]), {}).append("mutated by a caller")
    assert memo(copy_if_kernel, launch(fake["f32"], fake["f32"]), {}) == ["Y"]


def test_the_environment_can_leave_torch_alone():
    assert kernel_analysis_cache.patches({"INDUCTOR_EXT_CACHE_KERNEL_ANALYSIS": "0"}) == []
    assert len(kernel_analysis_cache.patches({})) == len(kernel_analysis_cache.ANALYSIS_FUNCTIONS)


def test_the_least_recently_used_answer_goes_first(counted, fake, monkeypatch):
    monkeypatch.setattr(kernel_analysis_cache, "MAX_ANSWERS", 2)
    memo, calls = counted
    base = launch(fake["f32"], fake["f32"])
    for n in (1, 2):  # two entries
        memo(copy_if_kernel, {**base, "N": n}, {})
    memo(copy_if_kernel, {**base, "N": 1}, {})  # N=1 is now the most recent
    memo(copy_if_kernel, {**base, "N": 3}, {})  # a third: N=2 goes
    assert len(memo.answers) == 2 and len(calls) == 3
    memo(copy_if_kernel, {**base, "N": 1}, {})
    assert len(calls) == 3
    memo(copy_if_kernel, {**base, "N": 2}, {})
    assert len(calls) == 4
