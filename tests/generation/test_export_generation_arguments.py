"""``export_generation`` checks every argument before any work (tracing and compiling take minutes): each
wrong call raises a ``TypeError`` (wrong type) or ``ValueError`` (wrong value) whose message starts with
``export_generation:`` and names the argument. Tracing, compiling and writing are replaced by functions
that fail, so a check that comes too late fails its test instead of running an export."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from inductor_ext.bench.train import build_model
from inductor_ext.runtime.generation import export as export_module
from inductor_ext.runtime.generation import export_generation

pytest.importorskip("transformers")

LLAMA_FIELDS = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32, "vocab_size": 64}


class _LooksLikeCausalLM(nn.Module):
    """A config and a ``forward(input_ids)`` as an HF causal LM has them, with the given parameters."""

    def __init__(self, *parameters: nn.Parameter, config: object = None) -> None:
        super().__init__()
        self.config = SimpleNamespace(**LLAMA_FIELDS) if config is None else config
        self.weights = nn.ParameterList(parameters)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids


class _NoInputIds(_LooksLikeCausalLM):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x


def _weight(**kwargs: object) -> nn.Parameter:
    return nn.Parameter(torch.zeros(2, **kwargs), requires_grad=False)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-llama", "cpu", torch.float32, hidden_size=32, vocab_size=64).eval()


@pytest.fixture(autouse=True)
def _no_export(monkeypatch):
    """Any step of the real export fails the test: the checks must come before all of them."""

    def traced(*args, **kwargs):
        raise AssertionError("traced")

    for name in ("GenerationStep", "export_program", "CompileJob", "compile_program", "write_package"):
        monkeypatch.setattr(export_module, name, traced)


# (overrides of a valid call given the model and a temporary folder, error, what the message must name)
BAD_CALLS = [
    # model
    pytest.param(lambda m, d: {"model": "llama"}, TypeError, "model must be a torch.nn.Module", id="model-str"),
    pytest.param(lambda m, d: {"model": nn.Linear(4, 4)}, TypeError, "model .*Linear has no config", id="model-linear"),
    pytest.param(lambda m, d: {"model": _LooksLikeCausalLM(_weight(), config=SimpleNamespace(hidden_size=32))},
                 TypeError, "model .*config .*has no num_hidden_layers, num_attention_heads, vocab_size",
                 id="model-config-fields"),
    pytest.param(lambda m, d: {"model": _LooksLikeCausalLM(_weight(), config=SimpleNamespace(**{**LLAMA_FIELDS,
                                                                                             "vocab_size": 0}))},
                 ValueError, r"model\.config\.vocab_size must be a positive integer", id="model-config-value"),
    pytest.param(lambda m, d: {"model": _NoInputIds(_weight())}, TypeError, "model .*forward takes input_ids",
                 id="model-forward"),
    pytest.param(lambda m, d: {"model": _LooksLikeCausalLM()}, ValueError, "model .*has no parameters",
                 id="model-no-parameters"),
    pytest.param(lambda m, d: {"model": _LooksLikeCausalLM(_weight(), _weight(device="meta"))}, ValueError,
                 "model's parameters must be on one device, got cpu, meta", id="model-two-devices"),
    pytest.param(lambda m, d: {"model": _LooksLikeCausalLM(_weight(dtype=torch.long))}, ValueError,
                 "model's first parameter .*floating point", id="model-integer-parameter"),
    # path
    pytest.param(lambda m, d: {"path": 7}, TypeError, "path must be a str or os.PathLike, got int", id="path-int"),
    pytest.param(lambda m, d: {"path": os.fsencode(d / "m.pt2")}, TypeError, "path must be a str or os.PathLike",
                 id="path-bytes"),
    pytest.param(lambda m, d: {"path": d / "m.bin"}, ValueError, r"path must end in \.pt2", id="path-suffix"),
    pytest.param(lambda m, d: {"path": d}, ValueError, r"path must end in \.pt2", id="path-folder"),
    pytest.param(lambda m, d: {"path": (d / "m.pt2").mkdir() or d / "m.pt2"}, ValueError, "path .* is a directory",
                 id="path-directory"),
    # max_batch_size, max_seq_len
    pytest.param(lambda m, d: {"max_batch_size": 2.5}, TypeError, "max_batch_size must be an integer, got 2.5",
                 id="max_batch_size-float"),
    pytest.param(lambda m, d: {"max_batch_size": True}, TypeError, "max_batch_size must be an integer",
                 id="max_batch_size-bool"),
    pytest.param(lambda m, d: {"max_batch_size": 0}, ValueError, "max_batch_size must be >= 1, got 0",
                 id="max_batch_size-zero"),
    pytest.param(lambda m, d: {"max_seq_len": 32.0}, TypeError, "max_seq_len must be an integer, got 32.0",
                 id="max_seq_len-float"),
    pytest.param(lambda m, d: {"max_seq_len": "32"}, TypeError, "max_seq_len must be an integer", id="max_seq_len-str"),
    pytest.param(lambda m, d: {"max_seq_len": torch.tensor(32.0)}, TypeError, "max_seq_len must be an integer",
                 id="max_seq_len-float-tensor"),
    pytest.param(lambda m, d: {"max_seq_len": 1}, ValueError, "max_seq_len must be >= 2, got 1", id="max_seq_len-one"),
    pytest.param(lambda m, d: {"max_seq_len": m.config.max_position_embeddings + 1}, ValueError,
                 "max_seq_len .* exceeds the model's max_position_embeddings", id="max_seq_len-too-long"),
    # attention
    pytest.param(lambda m, d: {"attention": "flash"}, ValueError, "attention must be one of", id="attention"),
    # options
    pytest.param(lambda m, d: {"options": [("freezing", True)]}, TypeError, "options must be None or a Mapping",
                 id="options-list"),
    pytest.param(lambda m, d: {"options": {1: True}}, TypeError, "options' names must be strings", id="options-name"),
    pytest.param(lambda m, d: {"options": {"fastops.no_such_option": True}}, ValueError,
                 r"options: .*unknown options \['fastops\.no_such_option'\]", id="options-unknown-fastops"),
    pytest.param(lambda m, d: {"options": {"no_such_inductor_option": True}}, ValueError,
                 r"options \['no_such_inductor_option'\] are neither", id="options-unknown-inductor"),
    pytest.param(lambda m, d: {"options": {"freezing": True}}, ValueError,
                 "freezing .*pass decode_batch_sizes=\\(\\) with it", id="options-freezing"),
    # decode_batch_sizes
    pytest.param(lambda m, d: {"decode_batch_sizes": 1}, TypeError, "decode_batch_sizes must be an iterable of int",
                 id="decode_batch_sizes-int"),
    pytest.param(lambda m, d: {"decode_batch_sizes": "12"}, TypeError, "decode_batch_sizes must be an iterable",
                 id="decode_batch_sizes-str"),
    pytest.param(lambda m, d: {"decode_batch_sizes": (True,)}, TypeError,
                 "each of decode_batch_sizes must be an integer, got True", id="decode_batch_sizes-bool"),
    pytest.param(lambda m, d: {"decode_batch_sizes": (1, 2.0)}, TypeError,
                 "each of decode_batch_sizes must be an integer, got 2.0", id="decode_batch_sizes-float"),
    pytest.param(lambda m, d: {"decode_batch_sizes": (0,)}, ValueError,
                 r"decode_batch_sizes must be integers in 1\.\.max_batch_size \(2\), got \[0\]",
                 id="decode_batch_sizes-zero"),
    pytest.param(lambda m, d: {"decode_batch_sizes": (1, 3)}, ValueError,
                 r"decode_batch_sizes must be integers in 1\.\.max_batch_size \(2\), got \[1, 3\]",
                 id="decode_batch_sizes-above-max"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "error", "names"), BAD_CALLS)
def test_a_wrong_argument_is_refused_before_tracing(model, tmp_path, overrides, error, names):
    arguments = {"model": model, "path": tmp_path / "m.pt2", "max_batch_size": 2, "max_seq_len": 32}
    arguments.update(overrides(model, tmp_path))
    with pytest.raises(error, match="^export_generation: .*" + names) as raised:
        export_generation(arguments.pop("model"), arguments.pop("path"), **arguments)
    assert raised.type is error  # that type exactly, not a subclass of it
    assert model.training is False  # refused before the export sets eval mode and restores it


def test_right_arguments_reach_the_trace(model, tmp_path):
    """The stand-ins work (a right call gets as far as them), and what the checks accept: numpy's integers,
    an os.PathLike, any iterable of sizes, options with fastops.* and Inductor entries, no decode graphs."""
    with pytest.raises(AssertionError, match="traced"):
        export_generation(model, tmp_path / "m.pt2", max_batch_size=np.int64(4), max_seq_len=np.int32(32),
                          options={"fastops.route": "inductor", "coordinate_descent_tuning": True},
                          decode_batch_sizes=(n for n in (np.int64(4), 1, 1)))  # fmt: skip
    with pytest.raises(AssertionError, match="traced"):
        export_generation(model, str(tmp_path / "m.pt2"), max_batch_size=1, max_seq_len=2,
                          options={"freezing": True}, decode_batch_sizes=())  # fmt: skip


def test_the_checked_arguments_are_python_ints(model, tmp_path):
    checked = export_module._check_arguments(
        model, tmp_path / "m.pt2", np.int64(4), torch.tensor(32), None, "sdpa", [np.int64(4), 2, 2]
    )
    assert checked == (4, 32, [2, 4])
    assert [type(v) for v in (*checked[:2], *checked[2])] == [int] * 4
