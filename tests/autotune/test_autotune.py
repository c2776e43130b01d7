"""The standalone autotuner on CPU: model tracing on meta tensors, call files, the CLI, random
inputs, and the tuning database's guarantees (concurrent writers, kill -9, versions).

GPU timing is exercised in tests/gpu; here the GPU path runs with the timing replaced by
a recorder, to check it writes what the backend's route planner reads.
"""

import json
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import inductor_ext  # noqa: F401  (registers the ops)
from inductor_ext.inductor.options import BackendOptions
from inductor_ext.ops.cross_entropy import cross_entropy_family
from inductor_ext.ops.rms_norm import rms_norm_family
from inductor_ext.ops.rope import rope_family
from inductor_ext.tuning import database as database_module
from inductor_ext.tuning import routes
from inductor_ext.tuning.cli.calls import load_calls
from inductor_ext.tuning.cli.main import main
from inductor_ext.tuning.cli.trace import calls_from_entry
from inductor_ext.tuning.database import TuningDatabase
from inductor_ext.tuning.inputs import IGNORED_FRACTION, random_inputs
from inductor_ext.tuning.timing import signature
from tests.hf_spellings import LlamaRMSNorm, rotate_half

REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRY = "tests.autotune.test_autotune:tiny_model"

# ---------------------------------------------------------------- the tiny Llama-style model


class Block(torch.nn.Module):
    """A Llama decoder layer: RMSNorm, attention with HF RoPE, RMSNorm, SwiGLU MLP."""

    def __init__(self, hidden: int, intermediate: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(hidden), LlamaRMSNorm(hidden)
        self.q_proj, self.k_proj = (
            torch.nn.Linear(hidden, hidden, bias=False),
            torch.nn.Linear(hidden, hidden, bias=False),
        )
        self.v_proj, self.o_proj = (
            torch.nn.Linear(hidden, hidden, bias=False),
            torch.nn.Linear(hidden, hidden, bias=False),
        )
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, h, cos, sin):
        b, s, _ = h.shape
        x = self.input_layernorm(h)
        q, k, v = (
            p(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        h = h + self.o_proj(attn)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyLlama(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, intermediate: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(Block(hidden, intermediate, heads) for _ in range(layers))
        self.norm = LlamaRMSNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.register_buffer(
            "inv_freq", 1.0 / 10000 ** (torch.arange(0, hidden // heads, 2).float() / (hidden // heads))
        )

    def forward(self, input_ids, labels):
        h = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).float()
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[None].expand(input_ids.shape[0], -1, -1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.lm_head(self.norm(h))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1), ignore_index=-100)


def tiny_model():
    """The entry the CLI tests use: (model, example input shapes)."""
    return TinyLlama(vocab=97, hidden=64, intermediate=96, heads=4, layers=2), {
        "input_ids": ((2, 16), torch.int64),
        "labels": ((2, 16), "int64"),
    }


def llama_8b_block():
    """One Llama-3.1-8B-sized layer with its embedding and LM head, bf16: ~2.5 GB if materialised."""
    model = TinyLlama(vocab=128256, hidden=4096, intermediate=14336, heads=32, layers=1).to(torch.bfloat16)
    return model, {"input_ids": ((1, 2048), torch.int64), "labels": ((1, 2048), torch.int64)}


def not_a_model():
    return 42


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", str(tmp_path / "cache"))
    torch._dynamo.reset()


def _entries() -> dict[str, dict]:
    return dict(TuningDatabase().items())


def _cli_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def _route_ops(entries: dict[str, dict]) -> list[str]:
    return sorted(key.split("|")[1] for key in entries)


# ---------------------------------------------------------------- CLI


def test_help():
    proc = subprocess.run([sys.executable, "-m", "inductor_ext.tuning", "--help"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert all(command in proc.stdout for command in ("tune", "show", "clear"))
    for command in ("tune", "show", "clear"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0


def test_the_former_command_runs_the_tuner_with_a_future_warning():
    """``python -m inductor_ext.autotune`` still works until the next release, and names its successor."""
    proc = subprocess.run([sys.executable, "-m", "inductor_ext.autotune", "--help"],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "python -m inductor_ext.tuning" in proc.stdout
    assert "FutureWarning" in proc.stderr and "python -m inductor_ext.tuning" in proc.stderr


def test_tune_tiny_model_on_cpu_records_the_rewritten_calls_untuned(capsys):
    assert main(["tune", "--entry", ENTRY, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    entries = _entries()
    # the first layer's input norm stays an RMSNorm; the norms of residual sums fuse the add and
    # share one signature (one entry); likewise RoPE and SwiGLU; the (trainable) embedding is one call
    ops = ("add_rms_norm", "cross_entropy", "embedding", "glu", "rms_norm", "rope")
    assert _route_ops(entries) == [f"fastops::{op}_fwd" for op in ops]
    assert all(record == {"status": "untuned"} and key.endswith("|cpu") for key, record in entries.items())
    keys = "\n".join(entries)
    assert "fastops::rms_norm_fwd|(float32[32,64], float32[64], 1e-06, 0.0, 'llama')|cpu" in keys
    assert "fastops::add_rms_norm_fwd|(float32[32,64], float32[32,64], float32[64], 1e-06, 0.0, 'llama')|cpu" in keys
    assert "fastops::glu_fwd|(float32[32,96], float32[32,96], 'silu')|cpu" in keys
    assert "fastops::cross_entropy_fwd|(float32[32,97], int64[32], -100, 0.0, 0.0, 0.0, 'mean')|cpu" in keys
    assert "fastops::embedding_fwd|(float32[97,64], int64[" in keys
    assert out.count("untuned") == 6

    assert main(["show"]) == 0
    shown = capsys.readouterr().out
    assert all(op in shown for op in ("rms_norm_fwd", "glu_fwd", "rope_fwd", "cross_entropy_fwd"))
    assert main(["clear"]) == 0
    assert _entries() == {}


def test_llama_8b_sized_model_is_traced_without_materialising_weights():
    """One 8B-sized layer with embedding and LM head holds ~2.5 GB of bf16 weights; tracing
    must not allocate them (the entry runs under torch.device('meta'))."""
    from inductor_ext.tuning.cli.trace import calls_from_entry

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    calls = calls_from_entry("tests.autotune.test_autotune:llama_8b_block")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kib < 512 * 1024
    sigs = {call.op: call.signature for call in calls}
    assert sigs["fastops::glu_fwd"] == "(bfloat16[2048,14336], bfloat16[2048,14336], 'silu')"
    assert sigs["fastops::cross_entropy_fwd"].startswith("(bfloat16[2048,128256], int64[2048], -100")


def test_calls_file_round_trip(tmp_path, capsys):
    calls = [
        {"op": "rms_norm_fwd", "args": [{"shape": [8192, 4096], "dtype": "bfloat16"}, None, 1e-6, 0.0, "llama"]},
        {"op": "fastops::cross_entropy_fwd", "args": [{"shape": [8192, 128256], "dtype": "bfloat16"},
                                                      {"shape": [8192], "dtype": "int64"}, -100, 0.0, 0.0, 0.0, "mean"]},
        {"op": "rms_norm_fwd", "args": [{"shape": [8192, 4096], "dtype": "bfloat16"}, None, 1e-6, 0.0, "llama"]},
    ]  # fmt: skip
    path = tmp_path / "calls.json"
    path.write_text(json.dumps(calls))
    assert main(["tune", "--calls", str(path), "--device", "cpu"]) == 0
    rms_args = (torch.empty(8192, 4096, dtype=torch.bfloat16, device="meta"), None, 1e-6, 0.0, "llama")
    expected = {
        routes.route_key("fastops::rms_norm_fwd", signature(rms_args), "cpu"),
        routes.route_key(
            "fastops::cross_entropy_fwd", "(bfloat16[8192,128256], int64[8192], -100, 0.0, 0.0, 0.0, 'mean')", "cpu"
        ),
    }
    assert set(_entries()) == expected  # the duplicate call is one entry
    capsys.readouterr()
    main(["show"])
    assert "bfloat16[8192,4096]" in capsys.readouterr().out


def test_yaml_calls_file(tmp_path, monkeypatch):
    path = tmp_path / "calls.yaml"
    path.write_text("- op: glu_fwd\n  args: [{shape: [5, 123], dtype: float16}, {shape: [5, 123], dtype: float16}, silu]\n"
                    "- op: rms_norm_fwd\n  args: [{shape: [5, 123], dtype: float32}, null, 1e-6, 1, gemma]\n")  # fmt: skip
    calls = load_calls(path)
    assert [str(c) for c in calls] == ["glu_fwd(float16[5,123], float16[5,123], 'silu')",
                                       "rms_norm_fwd(float32[5,123], None, 1e-06, 1.0, 'gemma')"]  # fmt: skip
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    with pytest.raises(ValueError, match=rf"{path}.*PyYAML"):
        load_calls(path)


_RMS_OK = [{"shape": [4, 8], "dtype": "float32"}, None, 1e-6, 0.0, "llama"]
MALFORMED_CALLS = {
    "not_json": ("[{", "is not valid JSON"),
    "not_a_list": (json.dumps({"op": "rms_norm_fwd"}), "expected a list"),
    "unknown_op": (json.dumps([{"op": "rms_norm", "args": []}]), "entry 0: unknown op 'rms_norm'"),
    "extra_key": (json.dumps([{"op": "rms_norm_fwd", "args": _RMS_OK, "x": 1}]), "entry 0: expected an object"),
    "arg_count": (json.dumps([{"op": "rms_norm_fwd", "args": _RMS_OK[:3]}]), "takes 5 args"),
    "bad_dtype": (json.dumps([{"op": "rms_norm_fwd", "args": [{"shape": [4], "dtype": "float33"}, *_RMS_OK[1:]]}]),
                  "argument 'x': unknown dtype 'float33'"),
    "bad_shape": (json.dumps([{"op": "rms_norm_fwd", "args": [{"shape": [4, -1], "dtype": "float32"}, *_RMS_OK[1:]]}]),
                  "argument 'x': shape must be"),
    "tensor_required": (json.dumps([{"op": "rms_norm_fwd", "args": [None, *_RMS_OK[1:]]}]), "argument 'x': expected a tensor"),
    "scalar_type": (json.dumps([{"op": "rms_norm_fwd", "args": [*_RMS_OK[:4], 3]}]), "argument 'casting': expected str"),
    "bool_as_float": (json.dumps([{"op": "rms_norm_fwd", "args": [*_RMS_OK[:2], True, *_RMS_OK[3:]]}]),
                      "argument 'eps': expected float"),
    "entry_1": (json.dumps([{"op": "rms_norm_fwd", "args": _RMS_OK}, {"op": "glu_fwd", "args": [1, 2, 3]}]),
                "entry 1, argument 'gate'"),
    "bad_stride": (json.dumps([{"op": "rms_norm_fwd", "args": [{"shape": [4, 8], "dtype": "float32", "stride": [1]},
                                                                *_RMS_OK[1:]]}]),
                   "argument 'x': stride must be a list of 2 non-negative ints"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MALFORMED_CALLS))
def test_malformed_calls_file_names_the_file_and_entry(tmp_path, capsys, name):
    text, message = MALFORMED_CALLS[name]
    path = tmp_path / "calls.json"
    path.write_text(text)
    err = _cli_error(capsys, "tune", "--calls", str(path), "--device", "cpu")
    assert str(path) in err and message in err, err
    assert _entries() == {}


def test_calls_file_missing_or_unsupported_suffix(tmp_path, capsys):
    assert "cannot read it" in _cli_error(capsys, "tune", "--calls", str(tmp_path / "missing.json"))
    (tmp_path / "calls.txt").write_text("[]")
    assert "expected a .json, .yaml or .yml file" in _cli_error(capsys, "tune", "--calls", str(tmp_path / "calls.txt"))


@pytest.mark.parametrize("entry,message", [
    ("tests.autotune.test_autotune", "must be written module:function"),
    ("tests.autotune.no_such_module:model", "cannot import module 'tests.autotune.no_such_module'"),
    ("tests.autotune.test_autotune:no_such_function", "has no function 'no_such_function'"),
    ("tests.autotune.test_autotune:not_a_model", "must return (model, example_input_shapes), got int"),
])  # fmt: skip
def test_unknown_or_bad_entry(capsys, entry, message):
    err = _cli_error(capsys, "tune", "--entry", entry)
    assert f"entry {entry!r}" in err and message in err, err


def test_argument_errors(capsys, tmp_path):
    assert "one of the arguments --entry --hf-config --calls is required" in _cli_error(capsys, "tune")
    assert "apply to --hf-config only" in _cli_error(capsys, "tune", "--entry", ENTRY, "--batch", "2")
    assert "expected a positive integer" in _cli_error(capsys, "tune", "--hf-config", str(tmp_path), "--seq", "0")
    assert "unknown dtype 'float33'" in _cli_error(capsys, "tune", "--hf-config", str(tmp_path), "--dtype", "float33")
    assert "--device must be cuda or cpu" in _cli_error(capsys, "tune", "--entry", ENTRY, "--device", "meta")


def test_tune_on_a_gpu_writes_what_the_backend_reads(monkeypatch, tmp_path, capsys):
    """The GPU path with the timing replaced by a recorder (no GPU here): the CLI's decisions land
    under the keys the backend's planner reads, so a compile with the warm database times nothing."""
    from inductor_ext.tuning.cli import main as cli

    measured = []

    def fake_measure(family, args, options, device):
        measured.append(family.name)
        return [routes.RouteDecision(op._name, signature(args), "kernel", "timed", 1.0, 2.5, 0.02, 0.1)
                for op in (family.fwd, family.bwd)]  # fmt: skip

    monkeypatch.setattr(routes, "measure_routes", fake_measure)
    monkeypatch.setattr(routes, "device_name", lambda device: "Fake GPU")
    monkeypatch.setattr(cli, "device_name", lambda device: "Fake GPU")
    path = tmp_path / "calls.json"
    path.write_text(json.dumps([{"op": "rms_norm_fwd", "args": _RMS_OK}]))
    assert main(["tune", "--calls", str(path), "--device", "cuda"]) == 0
    assert measured == ["rms_norm"]
    table = capsys.readouterr().out
    assert "rms_norm_bwd" in table and "2.50x" in table and "timed" in table
    assert "1.0000 ±0.0100" in table and "2.5000 ±0.0500" in table  # medians with the spread recorded
    call = load_calls(path)[0]
    assert list(_entries()) == [routes.route_key("fastops::rms_norm_fwd", call.signature, "Fake GPU")]

    decisions = routes.decide_routes(
        rms_norm_family, call.args, BackendOptions(), TuningDatabase(), torch.device("cuda")
    )
    assert measured == ["rms_norm"]  # warm: read, not timed
    assert [(d.op, d.route, d.reason) for d in decisions] == [("fastops::rms_norm_fwd", "kernel", "database"),
                                                              ("fastops::rms_norm_bwd", "kernel", "database")]  # fmt: skip


def test_a_family_without_kernels_has_no_route_to_time(monkeypatch, tmp_path):
    """LoRA linear is cuBLAS through aten on every path: nothing is timed or stored for it."""
    from torch._subclasses import FakeTensorMode

    from inductor_ext.ops.lora import lora_linear_family

    monkeypatch.setattr(routes, "measure_routes", lambda *args: pytest.fail("timed a family without kernels"))
    with FakeTensorMode():
        x, weight = torch.empty(8, 16, device="cuda"), torch.empty(32, 16, device="cuda")
        lora_a, lora_b = torch.empty(4, 16, device="cuda"), torch.empty(32, 4, device="cuda")
    args = (x, weight, None, lora_a, lora_b, 2.0, None, 0.0)
    database = TuningDatabase()
    assert not lora_linear_family.has_kernels and rms_norm_family.has_kernels
    assert routes.decide_routes(lora_linear_family, args, BackendOptions(), database, torch.device("cuda")) == []
    assert not list(_entries())


# ---------------------------------------------------------------- random inputs


def test_random_labels_and_positions_are_realistic():
    logits = torch.empty(4096, 1000, device="meta")
    labels = torch.empty(4096, dtype=torch.int64, device="meta")
    args = random_inputs(cross_entropy_family.fwd, (logits, labels, -7, 0.0, 0.0, 0.0, "mean"), "cpu")
    assert args[0].device.type == "cpu" and args[0].std() > 0.5 and args[2:] == [-7, 0.0, 0.0, 0.0, "mean"]
    out = args[1]
    ignored = out == -7
    assert abs(ignored.float().mean().item() - IGNORED_FRACTION) < 0.03
    kept = out[~ignored]
    assert kept.min() >= 0 and kept.max() < 1000 and kept.unique().numel() > 900

    q = torch.empty(2, 4, 33, 16, device="meta")
    cos = torch.empty(50, 16, device="meta")
    positions = torch.empty(3, 33, dtype=torch.int32, device="meta")
    args = random_inputs(rope_family.fwd, (q, q, cos, cos, positions, 1), "cpu")
    pos = args[4]
    assert pos.dtype == torch.int32 and pos.min() >= 0 and pos.max() < 50 and pos.any()
    assert ((pos.diff(dim=-1) == 1) | (pos.diff(dim=-1) == -49)).all()  # consecutive, wrapped into the table


def test_random_inputs_keep_the_layout_of_the_call():
    """HF's q and k are transposed views of (B, S, H, D): RoPE picks its grid (and Triton its
    autotune key) by that layout, so timing contiguous copies timed another launch, whose config
    record a compile then did not find (seen on the H200: _rope_kernel benchmarked in a warm compile)."""
    (rope_call,) = [c for c in calls_from_entry("benchmarks.autotune:block", grad=False) if c.op == "fastops::rope_fwd"]
    q_template = rope_call.args[0]
    assert q_template.device.type == "meta" and not q_template.is_contiguous()
    made = random_inputs(rope_family.fwd, rope_call.args, "cpu")
    for template, tensor in zip(rope_call.args[:4], made[:4]):  # (a stride of a size-1 dim is never used)
        assert tensor.shape == template.shape
        assert [st for n, st in zip(tensor.shape, tensor.stride()) if n > 1] == [
            st for n, st in zip(template.shape, template.stride()) if n > 1
        ]
    assert made[0].std() > 0.5
    broadcast = torch.empty(1, 4, 16, device="meta").expand(3, 4, 16)  # stride 0: one table row shared
    (table,) = random_inputs(torch.ops.aten.neg.default, (broadcast,), "cpu")
    assert table.stride() == (0, 16, 1) and table.std() > 0.5


def test_random_inputs_refuse_a_data_dependent_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from inductor_ext.ops.glu import glu_family

    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        gate = torch.empty(mode.shape_env.create_unbacked_symint(), 8)
    with pytest.raises(ValueError, match="glu_fwd: cannot build argument 'gate' of data-dependent shape"):
        random_inputs(glu_family.fwd, (gate, gate, "silu"), "cpu")


def test_call_file_tensor_may_give_its_strides(tmp_path):
    path = tmp_path / "calls.json"
    q = {"shape": [1, 4, 6, 8], "dtype": "bfloat16", "stride": [192, 8, 32, 1]}
    cos = {"shape": [1, 6, 8], "dtype": "bfloat16"}
    path.write_text(json.dumps([{"op": "rope_fwd", "args": [q, q, cos, cos, None, 1]}]))
    (call,) = load_calls(path)
    assert call.args[0].stride() == (192, 8, 32, 1) and call.args[2].is_contiguous()


def test_random_inputs_refuse_unknown_integer_arguments():
    weight = torch.empty(10, 4, device="meta")
    indices = torch.empty(3, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="embedding: no rule for integer argument 'indices'"):
        random_inputs(torch.ops.aten.embedding.default, (weight, indices, -1, False, False), "cpu")


# ---------------------------------------------------------------- database


def test_database_round_trip(tmp_path):
    db = TuningDatabase()
    assert db.path == tmp_path / "cache" / "tuning.json"
    assert db.get("a") is None and list(db.items()) == []
    db.put("b", {"x": 1.5})
    db.update({"a": {"y": [1, 2]}, "c": {}})
    reopened = TuningDatabase()
    assert reopened.get("b") == {"x": 1.5}
    assert [k for k, _ in reopened.items()] == ["a", "b", "c"]
    reopened.clear()
    assert db.get("b") is None and json.loads(db.path.read_text()) == {"entries": {}}


def test_version_bump_invalidates(monkeypatch):
    db = TuningDatabase()
    db.put("old", {"v": 1})
    bumped = {**database_module.current_versions(), "inductor_ext": "999.0"}
    monkeypatch.setattr(database_module, "current_versions", lambda: bumped)
    assert db.get("old") is None and list(db.items()) == []
    db.put("new", {"v": 2})  # a write drops the stale entry
    assert set(json.loads(db.path.read_text())["entries"]) == {"new"}


@pytest.mark.parametrize("text,message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", 'has no "entries" object'),
    ('{"entries": {"k": {"record": {}}}}', "has a malformed entry 'k'"),
])  # fmt: skip
def test_malformed_database_names_the_file(capsys, text, message):
    db = TuningDatabase()
    db.path.parent.mkdir(parents=True)
    db.path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        db.get("k")
    assert str(db.path) in str(error.value) and "clear" in str(error.value)
    err = _cli_error(capsys, "show")
    assert str(db.path) in err and message in err
    assert main(["clear"]) == 0  # the way out the message names
    assert list(db.items()) == []


def _put_many(path: Path, writer: int, count: int, start: Any) -> None:
    start.wait()
    db = TuningDatabase(path)
    for i in range(count):
        db.put(f"w{writer}/{i}", {"writer": writer, "i": i})


def test_concurrent_writers_lose_nothing(tmp_path):
    path, writers, count = tmp_path / "cache" / "tuning.json", 8, 20
    context = multiprocessing.get_context("fork")  # this process has imported torch already
    start = context.Event()
    processes = [context.Process(target=_put_many, args=(path, w, count, start)) for w in range(writers)]
    for p in processes:
        p.start()
    start.set()
    for p in processes:
        p.join(timeout=120)
        assert p.exitcode == 0
    entries = dict(TuningDatabase(path).items())
    assert len(entries) == writers * count
    assert all(entries[f"w{w}/{i}"] == {"writer": w, "i": i} for w in range(writers) for i in range(count))
    assert not list(path.parent.glob("*.tmp"))


def _write_forever(path: Path) -> None:
    db = TuningDatabase(path)
    for i in range(10**6):
        db.put(f"k{i}", {"payload": list(range(5000))})  # slow writes (pure-Python JSON encoding)


def test_kill_during_write_leaves_a_readable_database(tmp_path):
    path = tmp_path / "cache" / "tuning.json"
    context = multiprocessing.get_context("fork")
    caught_mid_write = False
    for _ in range(5):
        writer = context.Process(target=_write_forever, args=(path,))
        writer.start()
        deadline = time.monotonic() + 60
        while not (path.exists() and list(path.parent.glob("*.tmp"))) and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        caught_mid_write = bool(list(path.parent.glob("*.tmp")))
        if caught_mid_write:
            break
    assert caught_mid_write, "the writer was never killed mid-write"
    db = TuningDatabase(path)
    before = dict(db.items())
    assert before and all(record == {"payload": list(range(5000))} for record in before.values())
    db.put("after", {})  # the next writer removes the orphaned temporary
    assert not list(path.parent.glob("*.tmp"))
    assert set(dict(db.items())) == {*before, "after"}


# ---------------------------------------------------------------- kernel launch configs


def _ce_launch(v: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments of a cross_entropy_bwd_kernel launch (the autotuner's key: V)."""
    logits, lse, labels, scale = torch.randn(3, v), torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.ones(())
    args = (logits, logits, lse, labels, scale, v, v, 0, v, -100, 0.0, 0.0, 0.0)
    return args, {"HAS_SMOOTHING": False, "HAS_SOFTCAP": False}


def test_kernel_config_records_round_trip_and_narrow_traced_launches():
    """A config picked while timing comes back for the same launch key (and only for it), and a traced
    launch then offers Inductor that config alone, restore_value kept."""
    from inductor_ext.kernels.cross_entropy import cross_entropy_bwd_inplace_kernel as kernel
    from inductor_ext.library.launch import pruned_autotuner
    from inductor_ext.tuning.first_launch import launch_key
    from inductor_ext.tuning.kernel_configs import records, stored_config

    args, kwargs = _ce_launch(5000)
    key = launch_key(kernel, args, kwargs)  # what the eager autotuner's picks are keyed by
    pick = {"BLOCK_V": 4096, "num_warps": 8, "num_ctas": 1, "num_stages": 3}
    db = TuningDatabase()
    db.update(records({key: pick}, "NVIDIA H200"))
    stored = stored_config(db, kernel, args, kwargs, "NVIDIA H200")
    assert stored.all_kwargs() == pick
    assert stored_config(db, kernel, args, kwargs, "NVIDIA H100") is None  # other GPU
    assert stored_config(db, kernel, *_ce_launch(5001), "NVIDIA H200") is None  # other key
    narrowed = pruned_autotuner(kernel, args, kwargs, stored)
    assert [c.all_kwargs() for c in narrowed.configs] == [pick] and narrowed.restore_value == ["DLOGITS"]
    assert main(["show"]) == 0  # the record is listed
    # a record this launch's pruning rejects (here: chunks wider than V = 300) is not offered
    small_args, small_kwargs = _ce_launch(300)
    fallback = pruned_autotuner(kernel, small_args, small_kwargs, stored)
    assert pick not in [c.all_kwargs() for c in fallback.configs]
    assert fallback.configs == kernel.early_config_prune(kernel.configs, dict(zip(kernel.arg_names, small_args)))


def test_symbolic_launch_keys_have_no_stored_config():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from inductor_ext.kernels.cross_entropy import cross_entropy_bwd_kernel as kernel
    from inductor_ext.tuning.kernel_configs import launch_signature

    args, kwargs = _ce_launch(300)
    v = ShapeEnv().create_unbacked_symint()
    assert launch_signature(kernel, args, kwargs) is not None
    assert launch_signature(kernel, (*args[:8], v, *args[9:]), kwargs) is None


def test_tuning_skips_a_call_that_runs_out_of_gpu_memory(monkeypatch, tmp_path, caplog):
    """One call too large for the GPU's free memory is skipped with a warning; the others are tuned."""
    from inductor_ext.inductor.options import BackendOptions
    from inductor_ext.ops.rms_norm import rms_norm_family
    from inductor_ext.tuning.cli import tune
    from inductor_ext.tuning.cli.calls import meta_call
    from inductor_ext.tuning.routes import RouteDecision

    def decide(family, args, options, database, device):
        if args[0].shape[0] > 1000:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return [RouteDecision(family.fwd._name, signature(args), "kernel", "timed")]

    monkeypatch.setattr(tune, "decide_routes", decide)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    calls = [
        meta_call(rms_norm_family, (torch.empty(rows, 64), torch.empty(64), 1e-6, 0.0, "llama")) for rows in (8, 4096)
    ]
    decisions = tune.tune_calls(calls, TuningDatabase(tmp_path / "db.json"), torch.device("cuda"), BackendOptions())
    assert [d.signature for d in decisions] == [calls[0].signature]
    assert "out of GPU memory tuning fastops::rms_norm_fwd(float32[4096,64]" in caplog.text
