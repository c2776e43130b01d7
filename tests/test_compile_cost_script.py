"""``python -m benchmarks compile_cost``: records our ops' launches on fake CUDA tensors and compiles them for
sm_90 on this CPU host (it leans on Triton internals, so CI runs it to catch a Triton change)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPILE_COST = [sys.executable, "-m", "benchmarks", "compile_cost"]


def test_compile_cost_compiles_each_launch_for_sm90(tmp_path):
    calls = [{"op": "rms_norm_fwd", "args": [{"shape": [64, 4096], "dtype": "bfloat16"},
                                             {"shape": [4096], "dtype": "bfloat16"}, 1e-5, 0.0, "llama"]}]  # fmt: skip
    (tmp_path / "calls.json").write_text(json.dumps(calls))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"}
    out = subprocess.run(
        [*COMPILE_COST, str(tmp_path / "calls.json")],
        capture_output=True, text=True, env=env, check=True, timeout=600,
    ).stdout  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("rms_norm_fwd(")]
    # the forward, its backward and the dW reduction, each compiled once with its first config
    kernels = sorted(re.search(r"\)\s+(\w+_kernel)\s", row).group(1) for row in rows)
    assert kernels == ["rms_norm_bwd_kernel", "rms_norm_fwd_kernel", "sum_rows_kernel"], out
    for row in rows:
        _seconds, registers, spill_bytes = row.rsplit(None, 3)[1:]
        assert int(registers) > 0 and int(spill_bytes) == 0, row
    assert "3 compiles" in out, out


def _t(shape, dtype="bfloat16", stride=None):
    return {"shape": shape, "dtype": dtype, **({"stride": stride} if stride else {})}


_LABELS = _t([64], "int64")
EVERY_VARIANT = [
    ("rms_norm_fwd", [_t([64, 4096]), _t([4096]), 1e-6, 0.0, "llama"]),
    ("rms_norm_fwd", [_t([64, 16384], "float32"), None, 1e-6, 1.0, "gemma"]),
    ("rms_norm_fwd", [_t([64, 2048], "float16"), _t([2048], "float16"), 1e-6, 0.0, "llama"]),
    ("add_rms_norm_fwd", [_t([64, 4096]), _t([64, 4096]), _t([4096]), 1e-6, 0.0, "llama"]),
    ("layer_norm_fwd", [_t([64, 16384]), _t([16384]), _t([16384]), 1e-5]),  # two-pass backward
    ("layer_norm_fwd", [_t([64, 8192]), _t([8192]), None, 1e-5]),
    ("layer_norm_fwd", [_t([64, 2048], "float32"), None, None, 1e-5]),
    *(("glu_fwd", [_t([64, 1000]), _t([64, 1000]), act]) for act in ("silu", "gelu", "gelu_tanh")),
    ("glu_fwd", [_t([64, 1000], "float32"), _t([64, 1000], "float32"), "silu"]),
    ("glu_packed_fwd", [_t([64, 2000]), "gelu_tanh"]),
    # HF's layout (q, k transposed views of (B, S, H, D)); then position ids and a partial rotary dim
    ("rope_fwd", [_t([2, 8, 16, 128], stride=[16384, 128, 1024, 1]), _t([2, 2, 16, 128], stride=[4096, 128, 256, 1]),
                  _t([2, 16, 128]), _t([2, 16, 128]), None, 1]),
    ("rope_fwd", [_t([2, 16, 8, 128], "float32"), _t([2, 16, 2, 128], "float32"), _t([64, 64], "float32"),
                  _t([64, 64], "float32"), _t([2, 16], "int64"), 2]),
    ("cross_entropy_fwd", [_t([64, 128256]), _LABELS, -100, 0.0, 0.0, 0.0, "mean"]),
    ("cross_entropy_fwd", [_t([64, 4096], "float32"), _LABELS, -100, 0.1, 1e-4, 30.0, "sum"]),
    ("cross_entropy_fwd", [_t([64, 32000], "float16"), _LABELS, 7, 0.0, 0.0, 0.0, "none"]),
]  # fmt: skip
"""Each op's forward (and so its backward) in each dtype, with the constexpr branches a model can take
(weight/bias present or not, activations, position ids, smoothing, z-loss, soft-capping)."""


def test_every_config_of_every_op_passes_tritons_frontend(tmp_path):
    """``--stage ttir --configs 0``: every config a launch could offer, through Triton's frontend for
    sm_90. The interpreter CI runs the kernels under does not check types: a loop-carried variable
    that changed dtype ran there and failed to compile on the H200 (LayerNorm's
    forward). Runs in about 20 s here."""
    (tmp_path / "calls.json").write_text(json.dumps([{"op": op, "args": args} for op, args in EVERY_VARIANT]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"}
    script = [*COMPILE_COST, str(tmp_path / "calls.json")]
    run = subprocess.run(
        [*script, "--stage", "ttir", "--configs", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "skipped" not in run.stdout, run.stdout
    kernels = set(re.findall(r"\)\s+(\w+)\s+\{", run.stdout))
    assert kernels == {
        "rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "sum_rows_kernel", "layer_norm_fwd_kernel",
        "layer_norm_bwd_kernel", "layer_norm_bwd_param_grads_kernel", "glu_fwd_kernel", "glu_bwd_kernel",
        "_rope_kernel", "_cross_entropy_fwd", "_cross_entropy_bwd",
    }, kernels  # fmt: skip
    runs = int(re.search(r"for (\d+) frontend runs", run.stdout).group(1))
    assert runs > len(kernels) * 4, run.stdout[-2000:]  # every config, not the first of each


def test_the_default_call_file_loads():
    """The call file ``compile_cost`` reads when none is given (beside it in benchmarks/)."""
    from benchmarks.compile_cost import DEFAULT_CALLS
    from inductor_ext.tuning.cli.calls import load_calls

    ops = [call.family.name for call in load_calls(DEFAULT_CALLS)]
    assert len(ops) == 5 and "cross_entropy" in ops, ops
