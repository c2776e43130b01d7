"""Fine-tuning through transformers' ``Trainer`` and TRL's ``SFTTrainer`` on packed rows (CPU, a tiny random
Llama, float32 unless a 4-bit base computes in bf16).

The backend, compiled in place with ``model.compile(backend="fastops_inductor")``, and ``models.apply`` (PEFT
LoRA and QLoRA) give the unpatched trainers' per-step losses, two accumulated micro-batches per step, and their
evaluation loss on packed rows. The compiled step compiles once: no recompile across batches. A checkpoint
resumes and loads into plain transformers. The spellings transformers and accelerate refuse fail loudly.

Compiles dominate the file's time (one C++ build per kernel on CPU): each compiled run is shared by the tests
of its module-scoped fixture, and the file runs on one xdist worker."""

import copy
from pathlib import Path

import pytest
import torch
import transformers
from torch._dynamo.utils import counters

from inductor_ext import models
from inductor_ext.bench.train import build_model
from tests.tolerances import OUTPUT

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.xdist_group("trainers")  # one worker: the module fixtures' compiled runs are shared

ROW = 16
LENGTHS = (11, 5, 9, 7, 12, 4, 10, 6)
"""Document lengths: consecutive pairs fill a row of exactly ``ROW`` tokens, as TRL's best-fit packing pairs
them too, so every batch has one shape while its documents differ."""
VOCAB = 256  # tiny-llama's
LAYERS = 2
LOSS = OUTPUT[torch.float32]
"""Relative bound on a logged float32 loss: the compiled and fused steps differ from eager by rounding only."""
BF16_LOSS = torch.finfo(torch.bfloat16).eps / 2 / (2 * ROW) ** 0.5
"""Relative bound on a logged loss of a bf16 model: each token's loss is off by up to bf16's unit roundoff
(relative), independently, and a micro-batch averages ``2 * ROW`` tokens."""


def _documents(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB - 2, (LENGTHS[i % len(LENGTHS)],), generator=generator).tolist() for i in range(count)
    ]


def _packed_rows(rows: int, seed: int) -> "datasets.Dataset":
    """Rows of two documents, laid out as a packing collator lays them: ``position_ids`` restart at each
    document, and a document's first token is no label (it is not predicted from the one before)."""
    documents = _documents(2 * rows, seed)
    columns: dict[str, list[list[int]]] = {"input_ids": [], "position_ids": [], "labels": []}
    for first, second in zip(documents[0::2], documents[1::2]):
        positions = [*range(len(first)), *range(len(second))]
        columns["input_ids"].append(first + second)
        columns["position_ids"].append(positions)
        columns["labels"].append([-100 if p == 0 else t for t, p in zip(first + second, positions)])
    assert {len(row) for row in columns["input_ids"]} == {ROW}
    return datasets.Dataset.from_dict(columns)


def _tokenizer() -> transformers.PreTrainedTokenizerBase:
    """A word-level tokenizer over the model's vocabulary: ``SFTTrainer`` needs one (the data is tokenized)."""
    import tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def _model() -> torch.nn.Module:
    model = build_model("tiny-llama", "cpu", torch.float32, num_hidden_layers=LAYERS)
    model.config.use_cache = False  # as trainers train: transformers separates packed documents only without a cache
    return model


def _losses(trainer: transformers.Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _assert_close_losses(actual: list[float], expected: list[float], rtol: float = LOSS) -> None:
    assert len(actual) == len(expected) > 0
    for step, (a, b) in enumerate(zip(actual, expected)):
        assert abs(a - b) <= rtol * abs(b), f"step {step + 1}: {a} vs {b}"


def _graph_counts() -> dict[str, object]:
    return {
        "graph_breaks": dict(counters["graph_break"]),
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": dict(counters["recompiles"]),
    }


# ---- transformers.Trainer ---------------------------------------------------------------------------------------

STEPS = 4
TRAINER_ARGS = {
    "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "gradient_accumulation_steps": 2,
    "max_steps": STEPS, "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "steps", "save_steps": 2,
    "report_to": "none", "use_cpu": True, "seed": 0, "disable_tqdm": True,
}  # fmt: skip


def _hf_trainer(model: torch.nn.Module, out: Path, **overrides) -> transformers.Trainer:
    return transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(str(out), **{**TRAINER_ARGS, **overrides}),
        train_dataset=_packed_rows(2 * 2 * STEPS, seed=1),
        eval_dataset=_packed_rows(4, seed=2),
    )


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """One Trainer run unpatched and eager, and the same run compiled in place with the backend: the second's
    graph counts after training and after evaluating, and its weights at the end of training."""
    reference = _model()
    compiled = copy.deepcopy(reference)
    expected = _hf_trainer(reference, tmp_path_factory.mktemp("hf-eager"))
    expected.train()

    torch._dynamo.reset()
    counters.clear()
    compiled.compile(backend="fastops_inductor")
    trainer = _hf_trainer(compiled, tmp_path_factory.mktemp("hf-backend"))
    trainer.train()
    trained = _graph_counts()
    state = {name: tensor.clone() for name, tensor in compiled.state_dict().items()}
    eval_loss = trainer.evaluate()["eval_loss"]
    yield {
        "expected": expected,
        "trainer": trainer,
        "trained": trained,
        "evaluated": _graph_counts(),
        "state": state,
        "eval_loss": eval_loss,
        "expected_eval_loss": expected.evaluate()["eval_loss"],
    }
    torch._dynamo.reset()


def test_trainer_with_the_backend_compiled_in_place_gives_the_trainers_losses(hf_runs):
    """Four optimizer steps of two accumulated micro-batches each: every logged loss is the unpatched run's."""
    assert hf_runs["trainer"].args.gradient_accumulation_steps == 2
    _assert_close_losses(_losses(hf_runs["trainer"]), _losses(hf_runs["expected"]))


def test_trainer_step_compiles_once_with_no_graph_break(hf_runs):
    """Eight micro-batches of packed rows (other documents, one shape): one graph, no break, no recompile.
    Evaluation (no backward, ``training`` false) adds one graph for all its batches."""
    assert hf_runs["trained"] == {"graph_breaks": {}, "graphs": 1, "recompiles": {}}
    assert hf_runs["evaluated"]["graphs"] == 2 and not hf_runs["evaluated"]["graph_breaks"]


def test_trainer_evaluates_packed_rows_as_the_unpatched_trainer(hf_runs):
    expected = hf_runs["expected_eval_loss"]
    assert abs(hf_runs["eval_loss"] - expected) <= LOSS * expected


def test_trainer_checkpoint_loads_into_plain_transformers_with_the_trained_weights(hf_runs):
    """Compiled in place, the module keeps its names: the checkpoint's state dict has no ``_orig_mod.``."""
    checkpoint = Path(hf_runs["trainer"].args.output_dir) / f"checkpoint-{STEPS}"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert type(loaded) is transformers.LlamaForCausalLM
    saved, trained = loaded.state_dict(), hf_runs["state"]
    assert list(saved) == list(trained)
    for name, tensor in trained.items():
        assert torch.equal(saved[name], tensor), name


def test_trainer_resumes_from_a_checkpoint_with_the_same_losses(hf_runs, tmp_path):
    """A new Trainer over the compiled model, resumed at step 2 (weights, optimizer, scheduler, data order),
    trains steps 3 and 4 as the uninterrupted run did, without compiling again."""
    trainer = hf_runs["trainer"]
    graphs = counters["stats"]["unique_graphs"]
    resuming = _hf_trainer(trainer.model, tmp_path)
    resuming.train(resume_from_checkpoint=str(Path(trainer.args.output_dir) / "checkpoint-2"))
    uninterrupted, resumed = _losses(trainer), _losses(resuming)
    assert len(resumed) == STEPS  # steps 1 and 2 from the checkpoint's log
    _assert_close_losses(resumed[2:], uninterrupted[2:])
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_spellings_trainer_and_accelerate_refuse_fail_loudly(tmp_path):
    """``torch_compile_backend`` must name one of accelerate's ``DynamoBackend`` members; a
    ``torch.compile`` wrapper's ``forward(*args, **kwargs)`` hides the model's arguments, so ``Trainer``
    drops every dataset column. Nothing is compiled: both fail before the first step."""
    args = transformers.TrainingArguments(
        str(tmp_path / "a"),
        torch_compile=True,
        torch_compile_backend="fastops_inductor",
        use_cpu=True,
        report_to="none",
    )
    with pytest.raises(ValueError, match="'FASTOPS_INDUCTOR' is not a valid DynamoBackend"):
        transformers.Trainer(model=_model(), args=args, train_dataset=_packed_rows(4, seed=1))
    wrapped = torch.compile(_model(), backend="fastops_inductor")
    trainer = _hf_trainer(wrapped, tmp_path / "b")
    with pytest.raises(ValueError, match="No columns in the dataset match the model's forward method signature"):
        trainer.train()


def test_trainer_keeps_the_dataset_columns_of_a_patched_model(tmp_path):
    """Pre-packed rows (a ``position_ids`` column) through Trainer's defaults, eager: the patched model must
    see the columns the unpatched one sees, and so train with its losses."""
    reference = _model()
    patched = copy.deepcopy(reference)
    models.apply(patched)
    expected = _hf_trainer(reference, tmp_path / "hf", max_steps=1, save_strategy="no")
    expected.train()
    trainer = _hf_trainer(patched, tmp_path / "patched", max_steps=1, save_strategy="no")
    trainer.train()
    _assert_close_losses(_losses(trainer), _losses(expected))


# ---- TRL's SFTTrainer, packing and padding-free ------------------------------------------------------------------

SFT_STEPS = 3
SFT_ARGS = {
    "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "gradient_accumulation_steps": 2,
    "max_steps": SFT_STEPS, "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
    "use_cpu": True, "seed": 0, "disable_tqdm": True, "packing": True, "padding_free": True, "max_length": ROW,
    "bf16": False,  # TRL's default is bf16 autocast, on CPU too
}  # fmt: skip


def _sft_trainer(model: torch.nn.Module, out: Path, **overrides) -> "trl.SFTTrainer":
    return trl.SFTTrainer(
        model=model,
        args=trl.SFTConfig(str(out), **{**SFT_ARGS, **overrides}),
        train_dataset=datasets.Dataset.from_dict({"input_ids": _documents(2 * 2 * 2 * SFT_STEPS, seed=3)}),
        eval_dataset=datasets.Dataset.from_dict({"input_ids": _documents(8, seed=4)}),
        processing_class=_tokenizer(),
    )


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    """One SFTTrainer run unpatched and eager, and the same run with the decoder compiled in place with the
    backend. TRL (since 1.15) computes the loss in its own chunked LM head, called around the decoder rather
    than through the model's forward: the decoder is what there is to compile. Without TRL's default gradient
    checkpointing, which would double the compile time (tests/models/test_checkpointing.py compiles it)."""
    reference = _model()
    compiled = copy.deepcopy(reference)
    expected = _sft_trainer(reference, tmp_path_factory.mktemp("sft-eager"), gradient_checkpointing=False)
    expected.train()

    torch._dynamo.reset()
    counters.clear()
    compiled.get_decoder().compile(backend="fastops_inductor")
    trainer = _sft_trainer(compiled, tmp_path_factory.mktemp("sft-backend"), gradient_checkpointing=False)
    trainer.train()
    yield {"expected": expected, "trainer": trainer, "trained": _graph_counts()}
    torch._dynamo.reset()


def test_sft_trainer_packing_padding_free_with_the_backend_gives_its_losses(sft_runs):
    """Two packed rows flattened into one padding-free row per micro-batch, two micro-batches per step."""
    batch = next(iter(sft_runs["trainer"].get_train_dataloader()))
    assert batch["input_ids"].shape == (1, 2 * ROW) and "attention_mask" not in batch
    assert batch["position_ids"].eq(0).sum() == 4  # four documents
    _assert_close_losses(_losses(sft_runs["trainer"]), _losses(sft_runs["expected"]))


def test_sft_trainer_decoder_compiles_once_with_no_graph_break(sft_runs):
    """The documents and the ``cu_seq_lens_*``/``max_length_*`` keywords TRL's collator adds change per batch
    (SDPA ignores the keywords): one graph, no break, no recompile."""
    assert sft_runs["trained"] == {"graph_breaks": {}, "graphs": 1, "recompiles": {}}


# ---- PEFT LoRA and QLoRA patched by models.apply, through SFTTrainer ----------------------------------------------

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _add_lora(base: torch.nn.Module) -> torch.nn.Module:
    """Rank-4 adapters on every linear layer, B random (PEFT's zeros would give A no gradient)."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    generator = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def _nf4_base(path: Path) -> torch.nn.Module:
    """The tiny Llama saved, then loaded as QLoRA loads it: NF4 with double quantisation, computing in bf16
    (TRL casts a quantised model's adapters to bf16; a float32-computing base would mix dtypes)."""
    pytest.importorskip("bitsandbytes")
    _model().save_pretrained(path)
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, device_map="cpu", dtype=torch.bfloat16
    )
    model.config.use_cache = False
    return model


@pytest.fixture
def calls(monkeypatch):
    """Calls of the fused LoRA ops by the patched PEFT layers, and of models.apply's fused LM head + loss."""
    from inductor_ext.models import forwards, peft_lora

    counts: dict[str, int] = {}

    def counting(module, name: str) -> None:
        real = getattr(module, name)

        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    counting(peft_lora, "lora_linear")
    counting(peft_lora, "lora_mlp")
    counting(forwards, "causal_lm_loss")
    return counts


@pytest.mark.parametrize("base", ["dense", "nf4"])
def test_sft_trainer_trains_a_patched_lora_model_with_peft_losses(base, calls, tmp_path):
    """With TRL's default gradient checkpointing (each forward runs twice), eager. Every LoRA layer runs the
    fused ops; the loss is TRL's own LM head's, around models.apply's (``causal_lm_loss`` never runs), and
    equals the unpatched PEFT model's, in training and in evaluation on packed rows."""
    steps = 2 if base == "dense" else 1  # the fused ops run under the Triton interpreter: slow
    model = _add_lora(_model() if base == "dense" else _nf4_base(tmp_path / "base"))
    reference = copy.deepcopy(model)
    expected = _sft_trainer(reference, tmp_path / "peft", max_steps=steps, gradient_checkpointing=True)
    expected.train()
    report = models.apply(model)
    assert len(report.lora) == len(LORA_TARGETS) * LAYERS and len(report.lora_mlps) == LAYERS
    trainer = _sft_trainer(model, tmp_path / "patched", max_steps=steps, gradient_checkpointing=True)
    trainer.train()

    forwards = 2 * 2 * steps  # two micro-batches a step, each forward recomputed in the backward
    assert calls == {"lora_linear": 4 * LAYERS * forwards, "lora_mlp": LAYERS * forwards}  # q, k, v, o; the MLP
    rtol = LOSS if base == "dense" else BF16_LOSS
    _assert_close_losses(_losses(trainer), _losses(expected), rtol)
    if base == "dense":
        eval_loss, expected_eval_loss = trainer.evaluate()["eval_loss"], expected.evaluate()["eval_loss"]
        assert abs(eval_loss - expected_eval_loss) <= LOSS * expected_eval_loss
        assert "causal_lm_loss" not in calls
