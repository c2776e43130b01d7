"""``python -m inductor_ext.bench train`` on CPU: a tiny HF Llama trained by each provider in its own
process (on a GPU the same command measures the real model shapes; see docs/benchmarks.md), and the
providers built from their axes."""

import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch

import inductor_ext.guards
from inductor_ext.bench import train
from inductor_ext.bench.train import cli, qlora, report, worker
from inductor_ext.bench.train.model import LORA_TARGETS
from inductor_ext.bench.train.providers import PRESETS, Provider, parse_provider, reference


def run_tiny_bench(tmp_path, *providers: str, timeout: int = 900, flags=(), stem="train_tiny-llama_2x16"):
    """``bench train`` on the tiny Llama on CPU (2 x 16 tokens, 2 timed steps) with ``flags``; its results
    and stdout (the JSON named ``stem``)."""
    command = [sys.executable, "-m", "inductor_ext.bench", "train", "--device", "cpu", "--model", "tiny-llama",
               "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "0", "--profile-steps", "0",
               "--providers", *providers, "--out", str(tmp_path), *flags]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / f"{stem}.json").read_text())["results"], proc.stdout


@pytest.mark.slow
def test_train_benchmark_runs_each_provider_on_the_same_weights_and_batches(tmp_path):
    # (the patched model's providers run in test_loss_chunk_size_reaches_the_patched_loss and the --lora,
    # --qlora and --cpp-wrapper tests)
    # (on CPU "reduce-overhead" records no CUDA graph: the _cudagraphs provider checks its step's bookkeeping)
    compiled = (
        "fastops_inductor",
        "fastops_inductor_no_parameter_guards",
        "fastops_inductor_cudagraphs",
        "fastops_inductor_compiled_adamw",
    )
    # (on CPU the profiled step runs unprofiled: no kernel times)
    flags = ("--profile-steps", "1")
    results, stdout = run_tiny_bench(tmp_path, "hf_eager", *compiled, flags=flags)
    assert list(results) == ["hf_eager", *compiled]
    assert not any("gpu_idle_ms" in r for r in results.values())
    assert all(r["spec"] == PRESETS[name].to_json() for name, r in results.items())
    eager = results["hf_eager"]
    for ours in (results[name] for name in compiled):
        # the first step, 2 timed ones synchronised each, 2 timed together
        assert len(eager["losses"]) == len(ours["losses"]) == 5
        # same weights and batches in separate processes: the losses agree to bf16 rounding, step after step
        for a, b in zip(eager["losses"], ours["losses"]):
            assert abs(a - b) <= 2e-2 * abs(a)
    assert all(r["tokens_per_s"] > 0 and r["first_step_s"] > 0 for r in results.values())
    assert all(r["tokens_per_s_unsynced"] > 0 and r["step_ms_unsynced"] > 0 for r in results.values())
    assert "fastops_inductor" in stdout and "x torch.compile" in stdout
    # the first step's compile, split: nothing compiled in eager; Dynamo, AOTAutograd, Inductor and our
    # passes (the backend's providers) within the first step's seconds
    assert results["hf_eager"]["first_step_compile_s"]["inductor"] == 0
    for name in compiled:
        split = results[name]["first_step_compile_s"]
        assert all(split[phase] > 0 for phase in ("dynamo", "aot_autograd", "inductor")), split
        assert split["dynamo"] + split["aot_autograd"] + split["inductor"] <= results[name]["first_step_s"]
        if PRESETS[name].compile_arguments().get("backend") == "fastops_inductor":
            assert "rewrites" in split["passes"], split
    assert "first step's compile (s): dynamo" in stdout


def test_rounds_reverse_the_order_and_pool_every_rounds_steps(tmp_path):
    results, stdout = run_tiny_bench(tmp_path, "hf_eager", "patched_eager", flags=("--rounds", "2"))
    # round 1 in the given order, round 2 reversed
    assert [r["position"] for r in results["hf_eager"]["rounds"]] == [0, 1]
    assert [r["position"] for r in results["patched_eager"]["rounds"]] == [1, 0]
    assert "hf_eager (round 2)" in stdout
    for result in results.values():
        assert len(result["step_ms"]) == 4  # 2 timed steps a round
        assert result["step_ms_median"] == statistics.median(result["step_ms"])
        assert len(result["losses"]) == 5  # the first round's: a later round trains the same weights again


def test_pooled_rounds_take_the_median_of_every_step_and_the_highest_peak():
    def run(position, steps, peak, clock):
        median = statistics.median(steps)
        return {"position": position, "ranks": 1, "step_ms": steps, "step_ms_median": median,
                "tokens_per_s": 8192 / median * 1e3, "step_ms_unsynced": median, "peak_gib": peak,
                "timed_steps_gpu": {"sm_clock_mhz": clock, "power_w": 600.0}, "losses": [1.0]}  # fmt: skip

    pooled = report.pool_rounds([run(0, [100.0, 102.0], 20.0, 1700.0), run(1, [110.0, 112.0], 20.5, 1600.0)])
    assert pooled["step_ms_median"] == 106.0 and pooled["tokens_per_s"] == pytest.approx(8192 / 0.106)
    assert pooled["peak_gib"] == 20.5 and pooled["timed_steps_gpu"]["sm_clock_mhz"] == 1650.0
    assert pooled["step_ms_unsynced"] == 106.0
    assert [r["step_ms_median"] for r in pooled["rounds"]] == [101.0, 111.0]
    assert "position" not in pooled
    assert report.pool_rounds([run(0, [100.0], 20.0, 1700.0)])["tokens_per_s"] == pytest.approx(81920)


def test_compile_arguments_resolve_the_guard_filter_and_leave_the_provider_alone():
    provider = parse_provider("patched_fastops_inductor,guard_filter_fn=skip_guard_on_all_nn_modules_unsafe")
    arguments = provider.compile_arguments()
    assert arguments["backend"] == "fastops_inductor"
    assert arguments["options"]["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe
    arguments["options"].pop("guard_filter_fn")  # what torch.compile does with it
    assert provider.options == {"guard_filter_fn": "skip_guard_on_all_nn_modules_unsafe"}
    assert PRESETS["torch_compile"].compile_arguments() == {}
    ours = PRESETS["fastops_inductor_no_parameter_guards"].compile_arguments()["options"]["guard_filter_fn"]
    assert ours is inductor_ext.guards.skip_parameter_guards
    assert PRESETS["fastops_inductor_padded"].compile_arguments() == {"backend": "fastops_inductor", "dynamic": True}
    assert PRESETS["fastops_inductor_cudagraphs"].compile_arguments()["mode"] == "reduce-overhead"


def test_providers_parse_from_presets_and_key_value_settings():
    kernel = parse_provider("fastops_inductor,fastops.route=kernel,fastops.assume_no_padding=true")
    assert (kernel.name, kernel.backend, kernel.patch) == (
        "fastops_inductor,fastops.route=kernel,fastops.assume_no_padding=true", "fastops_inductor", "none"
    )  # fmt: skip
    assert kernel.options == {"fastops.route": "kernel", "fastops.assume_no_padding": True}
    assert PRESETS["fastops_inductor"].options == {}  # the preset is not changed
    built = parse_provider("backend=fastops_inductor,patch=models.apply,adapter=lora,apply.lora_dtype=input")
    assert built.apply_options == {"lora_dtype": "input"} and built.adapter == "lora" and built.compiled
    assert built.to_json() == Provider.from_json(built.to_json()).to_json()
    assert parse_provider("hf_eager") == PRESETS["hf_eager"]
    for bad, message in [("nope", "not a preset"), ("hf_eager,route", "not key=value"),
                         ("backend=tensorrt", "backend must be one of"), ("hf_eager,fastops.route=kernel", "compiling"),
                         ("hf_eager,checkpoint_policy=keep_lora_outputs", "needs gradient_checkpointing")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_provider(bad)


def test_each_provider_compares_with_the_unpatched_references_of_its_adapter_and_data():
    presets = list(PRESETS.values())
    for name, compiled, eager in [
        ("patched_fastops_inductor", "torch_compile", "hf_eager"),
        ("lora_fused_fastops_inductor", "peft_torch_compile", "peft_eager"),
        ("qlora_fused_eager", "qlora_peft_torch_compile", "qlora_peft_eager"),
        ("fastops_inductor_padded", "torch_compile_packed", "hf_eager_padded"),
        ("liger_packed", "torch_compile_packed", "hf_eager_packed"),
    ]:
        found = (reference(PRESETS[name], presets, backend) for backend in ("torch_compile", "eager"))
        assert [p.name for p in found] == [compiled, eager], name


def test_phase_peaks_keep_each_phases_largest_peak_and_reset_between_phases(monkeypatch):
    allocated = iter([5.0, 9.0, 7.0, 6.0, 8.0, 7.5])  # the allocator's peak at each phase's end, two steps
    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(allocated) * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    phases = worker.PhasePeaks()
    phases.begin()
    phases.end("forward")  # not recording: nothing read or reset
    assert phases.gib == {} and resets == []
    phases.recording = True
    for _ in range(2):
        phases.begin()
        for phase in ("forward", "backward", "optimizer"):
            phases.end(phase)
    assert phases.gib == {"forward": 6.0, "backward": 9.0, "optimizer": 7.5}
    assert len(resets) == 8  # each step's start and each phase's end


def test_built_models_match_the_registry_and_are_reproducible():
    first = train.build_model("tiny-llama", "cpu", torch.float32, seed=3)
    second = train.build_model("tiny-llama", "cpu", torch.float32, seed=3)
    assert first.config.num_hidden_layers == train.MODELS["tiny-llama"]["num_hidden_layers"]
    assert first.config._attn_implementation == "sdpa" and first.training
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("model", sorted(set(train.MODELS) - {"tiny-llama"}))
def test_registry_shapes_build_on_the_meta_device(model):
    config = train.config_for(model)
    assert config.hidden_size == train.MODELS[model]["hidden_size"]
    with torch.device("meta"):
        built = train.build_model(model, "meta", torch.bfloat16)
    assert built.config.vocab_size == train.MODELS[model]["vocab_size"]


def test_summary_rows_take_ratios_to_torch_compile_and_losses_to_hf_eager():
    def result(tokens, loss):
        return {"tokens_per_s": tokens, "peak_gib": 1.0, "first_step_s": 2.0, "losses": [loss],
                "gpu_ms_by_category": dict.fromkeys(report.CATEGORIES, 1.0), "gpu_ms_total": 4.0, "step_ms_median": 5.0}  # fmt: skip

    ours = {**result(125.0, 3.25), "graph_breaks": {"a reason": 2, "another": 1},
            "gpu_idle_ms": {"launch_gaps": 1.24, "host_waits": 0.5}}  # fmt: skip
    ours["spec"] = PRESETS["fastops_inductor"].to_json()
    results = {"hf_eager": result(50.0, 3.0), "torch_compile": result(100.0, 3.5), "ours": ours}
    for name in ("hf_eager", "torch_compile"):
        results[name]["spec"] = PRESETS[name].to_json()
    rows = report.summarize(results)
    assert [(r["provider"], r["x torch.compile"], r["loss - eager"], r["graph breaks"]) for r in rows] == [
        ("hf_eager", 0.5, 0.0, 0), ("torch_compile", 1.0, 0.5, 0), ("ours", 1.25, 0.25, 3)
    ]  # fmt: skip
    idle = [(r["GPU idle: launch gaps ms"], r["GPU idle: host waits ms"]) for r in rows]
    assert idle == [(None, None), (None, None), (1.2, 0.5)]


@pytest.mark.slow
def test_loss_chunk_size_reaches_the_patched_loss(tmp_path, monkeypatch):
    """``--loss-chunk-size``: the run writes its own file, prints each provider's headline as it finishes,
    and trains as the default chunking does (that the size reaches the loss: tests/models/test_patch.py)."""
    default, _ = run_tiny_bench(tmp_path, "patched_eager")
    chunked, stdout = run_tiny_bench(
        tmp_path, "patched_eager", flags=("--loss-chunk-size", "8"), stem="train_tiny-llama_2x16_loss_chunk8"
    )
    assert "patched_eager ... " in stdout and "tokens/s" in stdout  # the headline, printed as it finishes
    for a, b in zip(default["patched_eager"]["losses"], chunked["patched_eager"]["losses"], strict=True):
        assert abs(a - b) <= 2e-2 * abs(a)  # bf16: the chunking changes only the rounding


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "must be >= 1"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--loss-chunk-size", "0"], "--loss-chunk-size must be >= 1"),
        (["--providers", "nope"], "'nope' is not a preset"),
        (["--model", "gpt-17"], "invalid choice"),
        ([], "needs a CUDA GPU"),
    ],
)
def test_bad_arguments_are_refused_with_a_message(argv, message, capsys):
    if message == "needs a CUDA GPU" and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        train.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_fine_tuning_example_runs_and_learns():
    """examples/train_llama.py on CPU (eager here, to keep CI short; its default also compiles)."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "train_llama.py"
    command = [sys.executable, str(script), "--steps", "25", "--seq", "32", "--no-compile"]
    proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "patched llama: fused LM head + loss True" in proc.stdout
    final = float(proc.stdout.split("final loss ")[1].split()[0])
    assert final < 0.75 * 5.5452  # ln(256) at the start: the counting task is being learned


@pytest.mark.slow
def test_sft_trainer_example_runs_and_learns(tmp_path):
    """examples/sft_trainer.py on CPU: TRL's SFTTrainer on packed, padding-free rows (eager here, to keep CI
    short; its default compiles the decoder, which tests/models/test_trainers.py checks). Without
    ``--output-dir`` the trainer's folder is a temporary one: nothing is left where the example ran."""
    from pathlib import Path

    pytest.importorskip("trl")
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, str(root / "examples" / "sft_trainer.py"), "--steps", "15", "--no-compile"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not any(tmp_path.iterdir())
    assert "models.apply: llama" in proc.stdout
    first, final = (float(x) for x in re.search(r"^loss (\S+) -> (\S+) ", proc.stdout, re.MULTILINE).groups())
    assert abs(first - 5.5452) < 0.1 and final < 0.8 * first  # from ln(256): the counting task is being learned


def test_clock_and_power_are_averaged_over_nvidia_smi_samples():
    from inductor_ext.bench.harness import ClockSampler, mean_clock_and_power

    assert mean_clock_and_power("1980, 120.5\n1500, 699.5\n17") == {"sm_clock_mhz": 1740.0, "power_w": 410.0}
    assert mean_clock_and_power("[N/A], [N/A]\n") is None
    with ClockSampler() as clocks:
        pass
    if not torch.cuda.is_available():
        assert clocks.mean is None


@pytest.mark.slow
def test_cpp_wrapper_providers_tune_from_the_config_and_train_like_eager(tmp_path):
    """``--cpp-wrapper``'s C++-wrapper provider with a database the standalone tuner filled first (on
    CPU the tuner records the calls untuned; on a GPU it times them), and the patched model (its
    fused loss's in-place accumulation included) under the C++ wrapper."""
    patched = "patched_fastops_inductor_weight_dtype_cpp_wrapper"
    results, _ = run_tiny_bench(tmp_path, "hf_eager", "fastops_inductor_cpp_wrapper_warm_db", patched)
    eager, warm, ours = results["hf_eager"], results["fastops_inductor_cpp_wrapper_warm_db"], results[patched]
    assert eager["tune_s"] is None and warm["tune_s"] > 0
    for losses in (warm["losses"], ours["losses"]):
        for a, b in zip(eager["losses"], losses, strict=True):
            assert abs(a - b) <= 2e-2 * abs(a)


@pytest.mark.slow
def test_lora_providers_train_the_adapters_with_equal_losses(tmp_path):
    """``--lora``'s PEFT eager and ours (the PEFT model patched by models.apply) on the same weights,
    adapters and batches: dropout draws different masks, which moves the loss by far less than bf16's
    rounding at this size, so the losses agree to bf16 tolerance, step after step."""
    results, stdout = run_tiny_bench(
        tmp_path, "peft_eager", "lora_fused_eager", flags=("--lora",), stem="train_tiny-llama_2x16_lora"
    )
    peft_losses, ours = results["peft_eager"]["losses"], results["lora_fused_eager"]["losses"]
    assert len(peft_losses) == len(ours) == 5
    for a, b in zip(peft_losses, ours, strict=True):
        assert abs(a - b) <= 2e-2 * abs(a)
    assert "lora_fused_eager" in stdout


@pytest.mark.slow
def test_qlora_providers_train_the_adapters_over_the_nf4_base_with_equal_losses(tmp_path):
    """``--qlora``'s PEFT eager and ours (the PEFT model patched by models.apply) on the same NF4 base,
    adapters and batches: the same math on the same quantised weights, so the losses agree to bf16
    tolerance, the first step's (the adapters' B is zero there: the base's loss) and those after it."""
    pytest.importorskip("bitsandbytes")
    results, stdout = run_tiny_bench(
        tmp_path, "qlora_peft_eager", "qlora_fused_eager", flags=("--qlora",), stem="train_tiny-llama_2x16_qlora"
    )
    assert list(results) == ["qlora_peft_eager", "qlora_fused_eager"]
    peft_losses, ours = results["qlora_peft_eager"]["losses"], results["qlora_fused_eager"]["losses"]
    assert len(peft_losses) == len(ours) == 5
    assert all(math.isfinite(loss) for loss in (*peft_losses, *ours))
    assert ours[0] == pytest.approx(peft_losses[0], rel=2e-2)
    for a, b in zip(peft_losses, ours, strict=True):
        assert abs(a - b) <= 2e-2 * abs(a)
    meta = json.loads((tmp_path / "train_tiny-llama_2x16_qlora.json").read_text())["meta"]
    assert meta["qlora"]["quant_type"] == "nf4" and meta["qlora"]["double_quant"]
    assert "x eager" in stdout


def test_quantize_base_replaces_the_decoder_linears_with_nf4_and_leaves_the_rest():
    """Each targeted linear of each decoder layer becomes a quantised ``Linear4bit`` whose dequantised
    weight is the original to NF4's error (4-bit codes on blocks of 64: about 9% relative here); the
    embeddings, norms and LM head keep their tensors."""
    bnb = pytest.importorskip("bitsandbytes")
    model = train.build_model("tiny-llama", "cpu", torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    kept = {name: p for name, p in model.named_parameters() if not name.endswith("_proj.weight")}
    replaced = qlora.quantize_base(model)
    layers = train.MODELS["tiny-llama"]["num_hidden_layers"]
    expected = [f"model.layers.{i}.{block}.{target}" for i in range(layers)
                for block, targets in (("self_attn", LORA_TARGETS[:4]), ("mlp", LORA_TARGETS[4:]))
                for target in targets]  # fmt: skip
    assert sorted(replaced) == sorted(expected)
    quantized = {name for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert quantized == set(expected) and model.is_loaded_in_4bit
    for name in expected:
        linear = model.get_submodule(name)
        weight = linear.weight
        assert weight.bnb_quantized and weight.dtype == torch.uint8 and not weight.requires_grad
        assert weight.quant_state.quant_type == "nf4" and weight.quant_state.nested  # double quantisation
        assert linear.compute_dtype == torch.bfloat16
        original = before[f"{name}.weight"].float()
        restored = bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
        assert restored.shape == original.shape
        assert float((restored - original).norm() / original.norm()) < 0.15
    for name, p in model.named_parameters():
        if name in kept:
            assert p is kept[name], name
            torch.testing.assert_close(p, before[name], rtol=0, atol=0)
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding


@pytest.mark.slow
def test_nproc_shards_each_provider_with_fsdp2_over_gloo_ranks(tmp_path):
    """``--nproc 2`` on CPU: each provider as 2 gloo ranks under torch.distributed.run, FSDP2 per
    decoder layer, each rank on its own batches; rank 0 reports the ranks' mean loss."""
    command = [sys.executable, "-m", "inductor_ext.bench", "train", "--device", "cpu", "--model", "tiny-llama",
               "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "0", "--profile-steps", "0", "--nproc", "2",
               "--providers", "hf_eager", "patched_eager", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "train_tiny-llama_2x16_2gpu.json").read_text())["results"]
    for r in results.values():
        assert r["ranks"] == 2 and r["tokens_per_s"] == pytest.approx(2 * r["tokens_per_s_per_gpu"])
    single, _ = run_tiny_bench(tmp_path / "one", "hf_eager")
    eager, ours = results["hf_eager"]["losses"], results["patched_eager"]["losses"]
    # rank 0 sees the single-process batches, rank 1 others: the mean differs from one rank's loss
    assert eager != single["hf_eager"]["losses"]
    for a, b in zip(eager, ours, strict=True):
        assert abs(a - b) <= 2e-2 * abs(a)
    assert "tokens/s per GPU" in proc.stdout


def test_packed_rows_are_full_with_positions_and_labels_restarting_at_each_document():
    from inductor_ext.bench import packing

    steps = packing.packed_batches(4, 3, 1024, 256, seed=5)
    assert len(steps) == 4
    lengths = []
    for packed in steps:
        assert packed.input_ids.shape == packed.labels.shape == packed.position_ids.shape == (3, 1024)
        assert packed.attention_mask is None and packed.real_tokens == 3 * 1024
        assert int(packed.input_ids.min()) >= 0 and int(packed.input_ids.max()) < 256
        for ids, positions, labels in zip(packed.input_ids, packed.position_ids, packed.labels):
            starts = (positions == 0).nonzero().flatten().tolist()
            assert starts[0] == 0  # every row starts a document: none spans two rows
            ends = [*starts[1:], 1024]
            for a, b in zip(starts, ends):
                torch.testing.assert_close(positions[a:b], torch.arange(b - a), rtol=0, atol=0)
                assert labels[a] == -100  # as DataCollatorWithFlattening: no label across documents
                torch.testing.assert_close(labels[a + 1 : b], ids[a + 1 : b], rtol=0, atol=0)
            lengths += [b - a for a, b in zip(starts, ends)]
    assert max(lengths) <= 1024 and len(lengths) > 3 * 4  # several documents per row, at median 300 tokens
    whole = [n for n in lengths if n >= packing.DOC_LENGTH_MIN]  # the cut ones can be shorter
    assert 150 < sorted(whole)[len(whole) // 2] < 500


def test_document_lengths_are_seeded_lognormal_and_clamped():
    import itertools
    import statistics

    from inductor_ext.bench import packing

    drawn = list(itertools.islice(packing.document_lengths(2048, seed=0), 4000))
    assert drawn == list(itertools.islice(packing.document_lengths(2048, seed=0), 4000))
    assert drawn != list(itertools.islice(packing.document_lengths(2048, seed=1), 4000))
    assert min(drawn) >= packing.DOC_LENGTH_MIN and max(drawn) == 2048  # P(> 2048) is 0.5%: clamped
    assert abs(statistics.median(drawn) - packing.DOC_LENGTH_MEDIAN) < 20
    short = list(itertools.islice(packing.document_lengths(64, seed=0), 100))
    assert max(short) == 64 and min(short) >= packing.DOC_LENGTH_MIN


def test_the_same_seed_packs_the_same_batches():
    from inductor_ext.bench import packing

    first, second = (packing.packed_batches(3, 2, 700, 1000, seed=7) for _ in range(2))
    other = packing.packed_batches(3, 2, 700, 1000, seed=8)
    for a, b in zip(first, second, strict=True):
        for name in ("input_ids", "labels", "position_ids"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0)
    assert not torch.equal(first[0].position_ids, other[0].position_ids)


@pytest.mark.parametrize("padded_batch", [1, 3, 8])
def test_padded_batches_hold_exactly_the_packed_documents(padded_batch):
    from inductor_ext.bench import packing

    for packed in packing.packed_batches(3, 4, 900, 512, seed=2):
        docs = packing.documents(packed)
        padded = packing.padded_batches(packed, padded_batch)
        assert sum(b.real_tokens for b in padded) == packed.real_tokens == 4 * 900
        assert sum(b.input_ids.shape[0] for b in padded) == len(docs)
        assert all(b.position_ids is None and b.input_ids.shape[0] > 1 for b in padded[:-1] if padded_batch > 1)
        rows = []
        for b in padded:
            mask = b.attention_mask.bool()
            assert mask.any(dim=1).all() and mask[:, 0].all()  # right-padded, no empty row
            longest = int(mask.sum(dim=1).max())  # padded to the group's longest, rounded up to a multiple of 8
            assert b.input_ids.shape[1] == -(-longest // 8) * 8
            assert (b.labels[~mask] == -100).all() and (b.labels[:, 0] == -100).all()
            torch.testing.assert_close(b.labels[:, 1:][mask[:, 1:]], b.input_ids[:, 1:][mask[:, 1:]], rtol=0, atol=0)
            rows += [ids[m] for ids, m in zip(b.input_ids, mask)]
        for doc, row in zip(docs, rows, strict=True):  # the same documents, in the same order
            torch.testing.assert_close(doc, row, rtol=0, atol=0)


def test_packed_and_padded_batches_give_the_model_the_same_loss():
    """The tiny Llama in float32, called as the benchmark calls it: the packed batch (``use_cache=False``:
    documents do not attend to each other) has the padded batches' loss, token for token."""
    from inductor_ext.bench import packing

    model = train.build_model("tiny-llama", "cpu", torch.float32).eval()
    packed = packing.packed_batches(1, 2, 600, 256, seed=3)[0]
    padded = packing.padded_batches(packed, 3)
    assert len(padded) > 1

    def summed(batch):  # HF's loss is the mean over the labelled (shifted) tokens
        with torch.no_grad():
            loss = model(**batch.model_kwargs(), use_cache=False).loss
        return loss * int((batch.labels[:, 1:] != -100).sum())

    total = sum(summed(b) for b in padded)
    torch.testing.assert_close(summed(packed), total, rtol=1e-5, atol=0)
    with torch.no_grad():  # with HF's default KV cache the documents attend to each other: another loss
        crossed = model(**packed.model_kwargs()).loss * int((packed.labels[:, 1:] != -100).sum())
    assert abs(float(crossed - total)) > 1e-4 * abs(float(total))  # at random init: 5e-4 here, 50x the tolerance


@pytest.mark.slow
def test_packed_run_reports_real_tokens_and_losses_next_to_each_reference(tmp_path):
    """``--packed`` on CPU: the packed and padded providers on the same documents (2 x 512 tokens a step,
    several documents per row, 2 padded documents per batch), each loss next to its eager reference's;
    the last provider run by a second invocation that merges into the first one's file."""
    providers = ("hf_eager_padded", "hf_eager_packed", "patched_eager_packed")
    flags = ("--packed", "--seq", "512", "--padded-batch", "2")
    stem = "train_tiny-llama_2x512_packed"
    first, _ = run_tiny_bench(tmp_path, *providers[:2], flags=flags, stem=stem)
    results, stdout = run_tiny_bench(tmp_path, providers[2], flags=(*flags, "--merge"), stem=stem)
    assert list(results) == list(providers) and results["hf_eager_packed"] == first["hf_eager_packed"]
    for r in results.values():
        assert r["real_tokens_per_s"] > 0 and len(r["losses"]) >= 3
        assert all(math.isfinite(loss) for loss in r["losses"])
    padded, packed = results["hf_eager_padded"], results["hf_eager_packed"]
    assert packed["pad_fraction"] == 0 and packed["tokens_per_s"] == packed["real_tokens_per_s"]
    assert 0 < padded["pad_fraction"] < 1 and padded["tokens_per_s"] > padded["real_tokens_per_s"]
    assert padded["optimizer_steps_per_step"] > 1 and packed["optimizer_steps_per_step"] == 1
    assert len(packed["losses"]) == 5 < len(padded["losses"])
    for a, b in zip(packed["losses"], results["patched_eager_packed"]["losses"], strict=True):
        assert abs(a - b) <= 2e-2 * abs(a)
    summary = {
        row["provider"]: row
        for row in json.loads((tmp_path / "train_tiny-llama_2x512_packed.json").read_text())["summary"]
    }
    assert summary["hf_eager_padded"]["loss reference"] == "hf_eager_padded"
    assert summary["patched_eager_packed"]["loss reference"] == "hf_eager_packed"
    assert summary["patched_eager_packed"]["loss - eager"] is not None
    assert "real tokens/s" in stdout


def test_merge_refuses_a_file_of_other_settings(tmp_path):
    stem = "train_tiny-llama_2x16"
    (tmp_path / f"{stem}.json").write_text(json.dumps({"meta": {"model": "tiny-llama", "batch": 3}, "results": {}}))
    command = [sys.executable, "-m", "inductor_ext.bench", "train", "--device", "cpu", "--model", "tiny-llama",
               "--batch", "2", "--seq", "16", "--providers", "hf_eager", "--out", str(tmp_path), "--merge"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode != 0 and "holds a run of other settings (" in proc.stderr and " batch, " in proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--packed", "--lora"], "not allowed with argument"),
        (["--packed", "--providers", "hf_eager"], "--packed runs only document providers"),
        (["--providers", "hf_eager_packed"], "only with --packed"),
        (["--packed", "--padded-batch", "0"], "--padded-batch must be >= 1"),
        (["--packed", "--rounds", "2"], "--packed: not with"),
    ],
)
def test_packed_arguments_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        train.main(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--qlora", "--lora"], "not allowed with argument"),
        (["--qlora", "--packed"], "not allowed with argument"),
        (["--qlora", "--cpp-wrapper"], "not allowed with argument"),
        (["--qlora", "--nproc", "2"], "--qlora: not with --nproc > 1"),
        (["--qlora", "--providers", "qlora_peft_eager", "peft_eager"], "--qlora runs only qlora providers"),
        (["--providers", "qlora_fused_eager"], "only with --qlora"),
        (["--lora", "--providers", "qlora_peft_eager"], "--lora runs only lora providers"),
        (["--qlora", "--providers", "qlora_fused_fastops_inductor_keep_mlp"], "only with --gradient-checkpointing"),
        (["--qlora", "--providers", "qlora_fused_fastops_inductor_keep_lora"], "only with --gradient-checkpointing"),
    ],
)
def test_qlora_arguments_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        train.main(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_qlora_rows_take_ratios_to_both_peft_references_and_losses_to_peft_eager():
    def result(tokens, loss):
        return {"tokens_per_s": tokens, "peak_gib": 1.0, "first_step_s": 2.0, "losses": [loss],
                "gpu_ms_by_category": dict.fromkeys(report.CATEGORIES, 1.0), "gpu_ms_total": 4.0, "step_ms_median": 5.0}  # fmt: skip

    results = {"qlora_peft_eager": result(40.0, 3.0), "qlora_peft_torch_compile": result(80.0, 3.5),
               "qlora_fused_fastops_inductor": result(100.0, 3.25)}  # fmt: skip
    for name, r in results.items():
        r["spec"] = PRESETS[name].to_json()
    rows = report.summarize(results)
    assert [(r["provider"], r["x torch.compile"], r["x eager"], r["loss - eager"]) for r in rows] == [
        ("qlora_peft_eager", 0.5, 1.0, 0.0), ("qlora_peft_torch_compile", 1.0, 2.0, 0.5),
        ("qlora_fused_fastops_inductor", 1.25, 2.5, 0.25)
    ]  # fmt: skip


def test_selective_checkpointing_providers_run_by_default_only_with_gradient_checkpointing():
    plain = cli.providers(cli.parser().parse_args(["--qlora"]))
    checkpointed = cli.providers(cli.parser().parse_args(["--qlora", "--gradient-checkpointing"]))
    assert [p.name for p in checkpointed] == [name for name, p in PRESETS.items() if p.adapter == "qlora"]
    assert all(p.gradient_checkpointing for p in checkpointed) and not any(p.gradient_checkpointing for p in plain)
    assert [p.name for p in plain] == [p.name for p in checkpointed if p.checkpoint_policy is None]
    assert "qlora_fused_fastops_inductor_keep_lora" in {p.name for p in checkpointed}
