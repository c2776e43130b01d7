"""``python -m benchmarks autotune`` on CPU: the block of its warm-vs-cold compile comparison."""

import torch

import inductor_ext  # noqa: F401  (registers the ops)
from benchmarks.autotune import block
from inductor_ext.tuning.cli.trace import calls_from_entry
from inductor_ext.tuning.routes import fastops_calls
from inductor_ext.tuning.timing import signature


def test_block_entry_traces_without_weights_the_calls_its_export_makes():
    """The warm database is filled by tracing the HF-spelled block (``--entry benchmarks.autotune:block``,
    on meta: one 8B-sized layer is ~0.9 GB of float32 weights if materialised); the export compiles the
    fastops-spelled block through ``torch.export``, which applies no rewrites. Both must make the same calls,
    or the warm export would find nothing in the database."""
    traced = {(call.op, call.signature) for call in calls_from_entry("benchmarks.autotune:block", grad=False)}
    # the residual sums' norms (after attention, and the final one) fuse the add in both spellings
    assert sorted(op for op, _ in traced) == [
        f"fastops::{op}_fwd" for op in ("add_rms_norm", "glu", "rms_norm", "rope")
    ]
    assert ("fastops::glu_fwd", "(bfloat16[2048,14336], bfloat16[2048,14336], 'silu')") in traced

    with torch.device("meta"):
        model, [(shape, dtype)] = block("fastops")
    program = torch.export.export(model, (torch.empty(shape, dtype=dtype, device="meta"),))
    exported = {(family.fwd._name, signature(args)) for family, args in fastops_calls(program.graph_module)}
    assert exported == traced
