"""``python -m inductor_ext.bench generate`` on CPU with the tiny Llama: each provider runs in its own
process and reports prefill and decode times per batch size; the table compares with ``hf_compile``."""

import json
import math

import pytest

from inductor_ext.bench import generate

pytest.importorskip("transformers")


@pytest.mark.slow
def test_generate_benchmark_runs_hf_and_package_providers(tmp_path):
    # decode time is T(new + 1) - T(1): on a loaded CPU (the suite's other worker compiling) noise can make it
    # negative, so only its presence is checked here; its sign is the GPU benchmark's business
    argv = ["--device", "cpu", "--model", "tiny-llama", "--prompt", "8", "--new", "8", "--batches", "1", "2",
            "--repeats", "3", "--providers", "hf_eager", "package_python", "--out", str(tmp_path)]  # fmt: skip
    assert generate.main(argv) == 0
    written = json.loads((tmp_path / "generate_tiny-llama_prompt8.json").read_text())
    assert set(written["results"]) == {"hf_eager", "package_python"}
    assert written["results"]["package_python"]["export_s"] > 0
    for row in written["summary"]:
        assert row["batch"] in (1, 2) and row["prefill ms"] > 0
        assert math.isfinite(row["decode ms/token"]) and row["decode ms/token"] != 0 and row["tokens/s"] != 0
        assert row["x hf_compile"] is None and row["of floor"] is None  # no hf_compile run; no floor on CPU


def test_speed_ratios_are_against_hf_compile():
    results = {
        "hf_compile": {"batch_1": {"prefill_ms": 2.0, "decode_ms_per_token": 4.0, "of_floor": 0.25}},
        "package_cpp": {"batch_1": {"prefill_ms": 1.0, "decode_ms_per_token": 2.0, "of_floor": 0.5}},
    }
    table = generate.rows(results, [1])
    assert [(r["provider"], r["x hf_compile"], r["tokens/s"]) for r in table] == [
        ("hf_compile", 1.0, 250),
        ("package_cpp", 2.0, 500),
    ]


@pytest.mark.parametrize("argv", [["--batches", "0"], ["--new", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        generate.parse(["--device", "cpu", *argv])
    assert "must be >= 1" in capsys.readouterr().err
