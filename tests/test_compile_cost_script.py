"""scripts/compile_cost.py: records our ops' launches on fake CUDA tensors and compiles them for
sm_90 on this CPU host (it leans on Triton internals, so CI runs it to catch a Triton change)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_compile_cost_compiles_each_launch_for_sm90(tmp_path):
    calls = [{"op": "rms_norm_fwd", "args": [{"shape": [64, 4096], "dtype": "bfloat16"},
                                             {"shape": [4096], "dtype": "bfloat16"}, 1e-5, 0.0, "llama"]}]  # fmt: skip
    (tmp_path / "calls.json").write_text(json.dumps(calls))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_cost.py"), str(tmp_path / "calls.json")],
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
