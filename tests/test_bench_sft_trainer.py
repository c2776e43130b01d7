"""``python -m benchmarks sft_trainer`` on CPU: TRL's ``SFTTrainer`` on a tiny Llama, as it comes and with
our spelling, each in its own process (on a GPU the same command measures the real model shapes); and the
benchmark's parts: its corpus, its token count, its usage errors and its summary."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import sft_trainer
from inductor_ext.bench import packing
from tests.tolerances import OUTPUT

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parent.parent
STEPS, ROW = 3, 512


@pytest.mark.slow
def test_trl_and_fastops_train_the_same_weights_and_rows_to_the_same_first_loss(tmp_path):
    """Two processes, each importing TRL and the fastops one compiling the decoder on CPU (one C++ build per
    kernel): about a minute on 2 cores. One decoder layer and no gradient checkpointing keep the compile short;
    every row padded to ``ROW`` keeps it to one graph and gives the token count padding to leave out."""
    command = [sys.executable, "-m", "benchmarks", "sft_trainer", "--device", "cpu", "--model", "tiny-llama",
               "--layers", "1", "--seq", str(ROW), "--pad-to-multiple-of", str(ROW), "--steps", str(STEPS),
               "--warmup", "1", "--no-gradient-checkpointing", "--providers", "trl", "fastops", "--out",
               str(tmp_path)]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "sft_trainer_tiny-llama_1layers.json").read_text())
    results = report["results"]
    assert list(results) == ["trl", "fastops"] and not report["failed"]
    for r in results.values():
        assert len(r["losses"]) == STEPS and all(math.isfinite(loss) for loss in r["losses"])
        assert len(r["step_ms"]) == STEPS and r["first_step_s"] > 0 and r["tokens_per_s"] > 0
        assert r["peak_gib"] is None  # CPU
        # each step one packed row of documents, padded to ROW positions
        assert r["positions_per_step"] == [ROW] * STEPS
        assert all(packing.DOC_LENGTH_MIN <= n <= ROW for n in r["tokens_per_step"])
        timed = [n / ms * 1e3 for n, ms in zip(r["tokens_per_step"][1:], r["step_ms"][1:])]
        assert r["tokens_per_s"] == pytest.approx(statistics.median(timed))
    # the same corpus, packed and shuffled by the same seed: the same rows in the same order
    assert results["trl"]["tokens_per_step"] == results["fastops"]["tokens_per_step"]
    assert sum(results["trl"]["tokens_per_step"]) < STEPS * ROW  # padding there was, and it is not counted
    # The first loss is the same float32 weights' on the same row, before any update: the decoder compiled with
    # our kernels differs from eager by float32 rounding only (tests/models/test_trainers.py's bound).
    first, ours = results["trl"]["losses"][0], results["fastops"]["losses"][0]
    assert abs(ours - first) <= OUTPUT[torch.float32] * abs(first)
    assert abs(first - math.log(256)) < 0.1  # a random model's loss on random tokens: about ln(vocab)
    assert results["fastops"]["graphs"] == 1 and not results["fastops"]["graph_breaks"]
    assert results["trl"]["graphs"] == 0
    assert report["meta"]["device"] == "cpu" and report["meta"]["versions"]["trl"]
    assert "trl_compile" in proc.stdout and "fastops" in proc.stdout  # the table


def test_corpus_documents_are_clipped_lognormal_lengths_of_ids_below_the_special_tokens():
    dataset = sft_trainer.corpus(vocab=1000, seq=400, tokens=50_000)
    lengths = [len(ids) for ids in dataset["input_ids"]]
    assert sum(lengths) >= 50_000 and sum(lengths[:-1]) < 50_000
    assert min(lengths) >= packing.DOC_LENGTH_MIN and max(lengths) == 400  # the long tail is clipped to seq
    # clipping the tail above the median keeps the median; the sample median of the log-lengths has standard
    # deviation sqrt(pi / 2) * sigma / sqrt(n): three of them either side
    spread = math.exp(3 * math.sqrt(math.pi / 2) * packing.DOC_LENGTH_SIGMA / math.sqrt(len(lengths)))
    assert packing.DOC_LENGTH_MEDIAN / spread <= statistics.median(lengths) <= packing.DOC_LENGTH_MEDIAN * spread
    ids = torch.tensor([i for doc in dataset["input_ids"] for i in doc])
    assert ids.min() >= 0 and ids.max() < 1000 - len(sft_trainer.SPECIAL_TOKENS)
    assert sft_trainer.corpus(vocab=1000, seq=400, tokens=50_000)["input_ids"] == dataset["input_ids"]  # seeded


def test_counting_collator_counts_the_documents_tokens_not_the_padding():
    """TRL's padding-free collator, padding to a multiple of 8 with the padding token, which a document also
    holds here: the count comes from the examples, before padding."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = sft_trainer.CountingCollator(
        DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=8)
    )
    batch = collate([{"input_ids": [5, 0, 7]}, {"input_ids": [0, 9]}])
    assert batch["input_ids"].shape == (1, 8) and (batch["input_ids"] == 0).sum() == 5
    collate([{"input_ids": list(range(1, 9))}])
    assert collate.real_tokens == [5, 8] and collate.positions == [8, 8]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--steps", "5", "--warmup", "5"], "--steps greater than --warmup"),
        (["--warmup", "0"], "--warmup must be >= 1"),
        (["--seq", "8"], "shortest document"),
        (["--lora", "--qlora"], "not allowed with argument"),
    ],
)
def test_usage_errors(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        sft_trainer.main(["--device", "cpu", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_trl_liger_fails_before_the_run_naming_its_package(capsys, monkeypatch):
    real_find_spec = sft_trainer.importlib.util.find_spec
    monkeypatch.setattr(
        sft_trainer.importlib.util, "find_spec", lambda name: None if name == "liger_kernel" else real_find_spec(name)
    )
    with pytest.raises(SystemExit) as exit_info:
        sft_trainer.main(["--device", "cpu", "--providers", "trl", "trl_liger"])
    assert exit_info.value.code == 2
    assert "trl_liger needs the liger_kernel package" in capsys.readouterr().err


def test_summary_compares_every_provider_with_trl_compile_and_trl_liger():
    def result(tokens_per_s: float) -> dict:
        return {"tokens_per_s": tokens_per_s, "step_ms_median": 10.0, "peak_gib": 2.0, "first_step_s": 30.0,
                "losses": [5.5, 5.4], "pad_fraction": 0.0, "graph_breaks": {}}  # fmt: skip

    rows = sft_trainer.summarize({"trl": result(100.0), "trl_compile": result(200.0), "fastops": result(250.0)})
    assert [row["x trl_compile"] for row in rows] == [0.5, 1.0, 1.25]
    assert [row["x trl_liger"] for row in rows] == [None, None, None]  # trl_liger did not run


def test_a_failing_provider_is_reported_and_the_others_kept(tmp_path, monkeypatch, capsys):
    """Each provider's child gets fresh compile caches; one that fails is in the JSON's ``failed``, the run
    exits 1, and the providers that ran keep their rows."""
    envs = {}

    def run_child(command, env):
        provider = command[command.index("--worker") + 1]
        envs[provider] = env
        if provider == "fastops":
            raise RuntimeError("fastops's child failed (exit 1)")
        return {"tokens_per_s": 100.0, "step_ms_median": 10.0, "peak_gib": None, "first_step_s": 1.0,
                "losses": [5.5, 5.4], "pad_fraction": 0.0, "graph_breaks": {}}  # fmt: skip

    monkeypatch.setattr(sft_trainer, "run_child", run_child)
    argv = ["--device", "cpu", "--model", "tiny-llama", "--providers", "trl", "fastops", "--out", str(tmp_path)]
    assert sft_trainer.main(argv) == 1
    report = json.loads((tmp_path / "sft_trainer_tiny-llama.json").read_text())
    assert list(report["results"]) == ["trl"] and "exit 1" in report["failed"]["fastops"]
    assert report["meta"]["command"] == "python -m benchmarks sft_trainer " + " ".join(argv)
    assert envs["trl"]["TORCHINDUCTOR_CACHE_DIR"] != envs["fastops"]["TORCHINDUCTOR_CACHE_DIR"]
    assert "fastops: failed" in capsys.readouterr().out
