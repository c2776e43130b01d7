"""Every op family has what the recipe of ``docs/contributing.md`` asks of it, or says here why not.

:data:`COVERAGE` is the one list: per family registered in ``FAMILY_OF``, its reference (a name in
``inductor_ext.reference``), its benchmark (an op in ``benchmarks/__main__.py``'s ``OPS`` or a
model-level benchmark in ``MODEL_BENCHES``) and its rewrite (a name in ``REWRITES``), each either
named or :class:`No` with the reason. A family registered without an entry fails here.
"""

import dataclasses
import inspect
from pathlib import Path

import pytest

import inductor_ext.ops  # registers the families
import inductor_ext.reference
from benchmarks.__main__ import MODEL_BENCHES, OPS
from inductor_ext.inductor.rewrites import REWRITES
from inductor_ext.library.registration import FAMILY_OF, OpFamily

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class No:
    """None on purpose, and why."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Coverage:
    reference: str | No
    benchmark: str | No
    rewrite: str | No


_PACKED_GLU = No(
    "the glu rewrite matches the two-tensor spelling; the packed op serves callers that hold one "
    "concatenated gate-up tensor (swiglu_packed, geglu_packed)"
)
_LM_HEAD = No(
    "the LM head and its loss are wired in inductor_ext/models/ (forwards.py), so that the model never "
    "returns the logits a graph rewrite would start from"
)
_PEFT = No("PEFT LoRA layers are modules, patched in inductor_ext/models/ (patch.py)")

COVERAGE: dict[str, Coverage] = {
    "rms_norm": Coverage("rms_norm_ref", "rms_norm", "rms_norm_hf_llama"),
    "add_rms_norm": Coverage("add_rms_norm_ref", "add_rms_norm", "add_rms_norm"),
    "layer_norm": Coverage("layer_norm_ref", "layer_norm", "layer_norm"),
    "glu": Coverage("swiglu_ref", "glu", "glu"),
    "glu_packed": Coverage("swiglu_ref", "glu", _PACKED_GLU),
    "rope": Coverage("apply_rotary_pos_emb_ref", "rope", "rope_hf"),
    "cross_entropy": Coverage("cross_entropy_ref", "cross_entropy", "cross_entropy"),
    "fused_linear_cross_entropy": Coverage("fused_linear_cross_entropy_ref", "fused_linear_cross_entropy", _LM_HEAD),
    "embedding": Coverage(No("torch.nn.functional.embedding, the spelling it replaces, is its reference"),
                          "embedding", "embedding"),
    "lora_linear": Coverage("lora_linear_ref", "sft_trainer", _PEFT),
    "lora_qkv": Coverage("lora_qkv_ref", "sft_trainer", _PEFT),
    "lora_mlp": Coverage("lora_mlp_ref", "sft_trainer", _PEFT),
}  # fmt: skip
"""Family name -> its reference, benchmark and rewrite, or the reason it has none."""


def _named(field: str) -> list[tuple[str, str]]:
    return [(family, getattr(c, field)) for family, c in COVERAGE.items() if isinstance(getattr(c, field), str)]


def test_every_registered_family_is_listed():
    families = set(FAMILY_OF.values())
    missing = sorted(families - set(COVERAGE))
    assert not missing, (
        f"families without an entry in COVERAGE: {missing}; give each a reference, a benchmark and a rewrite "
        "(docs/contributing.md, the recipe) or state why it has none"
    )
    assert not sorted(set(COVERAGE) - families), "COVERAGE lists families that are not registered"


def test_every_none_states_its_reason():
    for family, coverage in COVERAGE.items():
        for field in dataclasses.fields(coverage):
            entry = getattr(coverage, field.name)
            if isinstance(entry, No):
                assert len(entry.reason.split()) >= 5, f"{family}: {field.name} needs a reason"


@pytest.mark.parametrize(("family", "name"), _named("reference"))
def test_the_reference_is_gathered_in_reference_py(family, name):
    assert name in inductor_ext.reference.__all__, f"{family}: {name} is not in inductor_ext/reference.py"
    assert callable(getattr(inductor_ext.reference, name))


@pytest.mark.parametrize(("family", "name"), _named("benchmark"))
def test_the_benchmark_is_listed(family, name):
    if name in OPS:
        assert (ROOT / "benchmarks" / f"{name}.py").is_file(), f"{family}: OPS lists {name} without a module"
    else:
        assert name in MODEL_BENCHES, f"{family}: {name} is neither in OPS nor in MODEL_BENCHES"


@pytest.mark.parametrize(("family", "name"), _named("rewrite"))
def test_the_rewrite_is_declared_and_builds_the_family(family, name):
    assert name in REWRITES, f"{family}: {name} is not in REWRITES (inductor/rewrites/__init__.py)"
    module = inspect.getmodule(REWRITES[name])
    built = {value.name for value in vars(module).values() if isinstance(value, OpFamily)}
    assert family in built, f"{family}: the module of rewrite {name} does not use the family"
