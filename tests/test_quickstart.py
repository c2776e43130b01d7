"""The README's first command: ``examples/quickstart.py`` (tune, compile, export, load) passes on CPU and
removes its scratch directory (``inductor_ext_quickstart_*`` in the temporary directory)."""

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quickstart_demo_passes_and_cleans_up():
    scratch = Path(tempfile.gettempdir())
    before = set(scratch.glob("inductor_ext_quickstart_*"))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True,
                          check=False, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK: tuned, compiled (matches eager, no graph breaks), exported and loaded" in proc.stdout
    assert set(scratch.glob("inductor_ext_quickstart_*")) <= before, "the demo left its scratch directory"
