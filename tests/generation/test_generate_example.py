"""examples/generate.py on CPU: a tiny Llama exported for generation (``max_batch_size`` 2, the smallest
dynamic range export accepts only through our widening), and the package's and the C++ loop's tokens
equal HF ``generate``'s."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_generate_example_matches_hf_generate():
    script = Path(__file__).resolve().parents[2] / "examples" / "generate.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "package == HF generate: True; C++ loop == HF generate: True" in proc.stdout
