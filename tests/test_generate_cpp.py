"""The C++ generation loop (``inductor_ext/csrc/generate.cpp``, ``aoti_generate``) on CPU.

A tiny float32 Llama is exported once for generation (~25 s) with an end-of-sequence token that its
greedy continuation of one prompt emits (so rows stop early), and ``aoti_generate`` is built once
(~40 s). Its greedy tokens must equal the Python loop's (``load_generation``) and transformers'
``generate``, for equal-length and left-padded batches and rows that end, at batch 1 with the package's
static decode graph (sharing the package's one copy of the weights) and at other batches with its dynamic graph; seeded sampling must be
reproducible; bad inputs and flags must be refused with a message naming the problem. ``--cuda-graph``
needs a GPU: here only its refusal on CPU is tested.
"""

import subprocess

import pytest
import torch

from inductor_ext.bench.train import build_model
from inductor_ext.runtime.cpp_runner import build_generator, run_generate
from inductor_ext.runtime.generation import export_generation, load_generation
from inductor_ext.runtime.tensor_file import write_tensors

pytest.importorskip("transformers")

MAX_BATCH, MAX_SEQ, VOCAB = 4, 40, 256
PAD = 0
EOS_PROMPT = (3, 8, 4)
"""(batch, length, seed) of the prompt whose greedy continuation gives the end token (row 0's 5th token)."""


pytestmark = pytest.mark.xdist_group("generate_cpp")  # one worker builds the module's packages once


def _prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    """The tiny Llama, its end token one that it generates (found with transformers' greedy ``generate``)."""
    torch.manual_seed(0)
    model = build_model("tiny-llama", "cpu", torch.float32).eval()
    batch, length, seed = EOS_PROMPT
    with torch.no_grad():
        free = model.generate(_prompt(batch, length, seed), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    model.generation_config.eos_token_id = int(free[0, length + 4])
    model.generation_config.pad_token_id = PAD
    return model


@pytest.fixture(scope="module")
def package(model, tmp_path_factory):
    return export_generation(model, tmp_path_factory.mktemp("gen") / "tiny.pt2", max_batch_size=MAX_BATCH,
                             max_seq_len=MAX_SEQ)  # fmt: skip


@pytest.fixture(scope="module")
def python_package(package):
    return load_generation(package)


@pytest.fixture(scope="module")
def generator(tmp_path_factory):
    return build_generator(tmp_path_factory.mktemp("runner"))


def _hf(model, ids, new, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=PAD, **kwargs)


def _equal(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("batch", "length", "new"), [(1, 5, 8), (3, 7, 10), (MAX_BATCH, 1, 12)])
def test_greedy_tokens_equal_python_and_hf(model, package, python_package, generator, batch, length, new):
    ids = _prompt(batch, length, seed=1)
    result = run_generate(package, ids, new, executable=generator)
    _equal(result.tokens, python_package.generate(ids, new))
    _equal(result.tokens, _hf(model, ids, new))


def test_left_padded_greedy_tokens_equal_python_and_hf(model, package, python_package, generator):
    ids = _prompt(3, 11, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :1] = 0
    result = run_generate(package, ids, 9, attention_mask=mask, executable=generator)
    _equal(result.tokens, python_package.generate(ids, 9, attention_mask=mask))
    _equal(result.tokens, _hf(model, ids, 9, attention_mask=mask))


def test_rows_stop_at_end_of_sequence(model, package, python_package, generator):
    batch, length, seed = EOS_PROMPT
    ids = _prompt(batch, length, seed)
    eos = model.generation_config.eos_token_id
    tokens = run_generate(package, ids, 12, executable=generator).tokens
    _equal(tokens, python_package.generate(ids, 12))
    _equal(tokens, _hf(model, ids, 12))
    first = int((tokens[0, length:] == eos).nonzero()[0])  # row 0 ends at its first end token (the 5th at most)
    assert first <= 4
    assert (tokens[0, length + first + 1 :] == PAD).all()
    alone = run_generate(package, ids[:1], 12, executable=generator).tokens
    _equal(alone, tokens[:1, : length + first + 1])  # every row has ended: the loop stops there


def test_seeded_sampling_is_reproducible(package, generator):
    ids = _prompt(2, 6, seed=3)

    def sample(seed, top_k=20):
        return run_generate(package, ids, 10, sample=True, temperature=0.8, top_k=top_k, seed=seed,
                            executable=generator).tokens  # fmt: skip

    first = sample(11)
    _equal(sample(11), first)
    assert first.shape[0] == 2 and 6 < first.shape[1] <= 16
    _equal(first[:, :6], ids)
    assert ((first >= 0) & (first < VOCAB)).all()
    assert not torch.equal(sample(12), first)  # another seed, other draws
    _equal(sample(5, top_k=1), run_generate(package, ids, 10, executable=generator).tokens)  # top-1: greedy


def test_timed_runs_report_and_keep_the_first_tokens(package, generator):
    ids = _prompt(2, 5, seed=6)
    once = run_generate(package, ids, 6, executable=generator)
    timed = run_generate(package, ids, 6, iters=3, executable=generator)
    _equal(timed.tokens, once.tokens)
    assert timed.prefill_ms > 0 and timed.decode_ms_per_token > 0


@pytest.mark.parametrize(
    ("ids", "new", "kwargs", "message"),
    [
        (_prompt(MAX_BATCH + 1, 4, 0), 4, {}, f"batch {MAX_BATCH + 1} is outside the package's 1..{MAX_BATCH}"),
        (_prompt(1, 30, 0), 11, {}, f"length 30 \\+ max_new_tokens 11 exceeds the package's max_seq_len {MAX_SEQ}"),
        (_prompt(1, 4, 0).int(), 4, {}, "input_ids must be an int64 tensor"),
        (_prompt(1, 4, 0)[0], 4, {}, "input_ids must be an int64 tensor of shape \\(batch, prompt length\\)"),
        (_prompt(1, 4, 0) + VOCAB, 4, {}, "token ids in 0..255"),
        (_prompt(2, 4, 0), 4, {"attention_mask": torch.ones(2, 5, dtype=torch.long)}, "attention_mask must be int64"),
        (_prompt(2, 4, 0), 4, {"attention_mask": torch.zeros(2, 4, dtype=torch.long)}, "row without any real token"),
        (_prompt(1, 4, 0), 0, {}, "--max-new-tokens N \\(>= 1\\)"),
        (_prompt(1, 4, 0), 4, {"sample": True, "top_k": 0}, "--top-k must be >= 1"),
        (_prompt(1, 4, 0), 4, {"sample": True, "temperature": 0.0}, "--temperature must be > 0"),
        (_prompt(1, 4, 0), 4, {"iters": 0}, "--iters must be in 1"),
        (_prompt(1, 4, 0), 4, {"device": "tpu"}, "--device must be cpu or cuda"),
        (_prompt(1, 4, 0), 4, {"device": "cuda"}, "no CUDA|exported for cpu"),
        (_prompt(1, 4, 0), 4, {"cuda_graph": True}, "--cuda-graph needs --device cuda"),
    ],
    ids=["batch", "length", "dtype", "rank", "vocab", "mask-shape", "mask-empty-row", "new-tokens", "top-k",
         "temperature", "iters", "device", "cuda-device", "cuda-graph"],
)  # fmt: skip
def test_bad_inputs_are_refused_by_name(package, generator, ids, new, kwargs, message):
    with pytest.raises(RuntimeError, match=message):
        run_generate(package, ids, new, executable=generator, **kwargs)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-new-tokens", "4", "--bogus", "1"], "unknown flag --bogus"),
        (["--max-new-tokens", "four"], "--max-new-tokens expects an integer, got 'four'"),
        (["--max-new-tokens"], "--max-new-tokens expects a value"),
        (["--max-new-tokens", "4", "--seed", "3"], "--temperature, --top-k and --seed need --sample"),
    ],
)
def test_bad_flags_exit_2_with_usage(package, generator, tmp_path, flags, message):
    prompt = tmp_path / "prompt.bin"
    write_tensors(prompt, [_prompt(1, 4, 0)])
    done = subprocess.run([str(generator), str(package), str(prompt), str(tmp_path / "out.bin"), *flags],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 2
    assert message in done.stderr and "usage:" in done.stderr


def test_missing_prompt_and_bad_package_are_named(package, generator, tmp_path):
    missing = tmp_path / "missing.bin"
    done = subprocess.run([str(generator), str(package), str(missing), str(tmp_path / "out.bin"), "--max-new-tokens",
                           "4"], capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 1 and f"cannot open {missing}" in done.stderr
    bogus = tmp_path / "bogus.pt2"
    bogus.write_bytes(b"not a zip")
    with pytest.raises(RuntimeError, match="aoti_generate failed"):
        run_generate(bogus, _prompt(1, 4, 0), 4, executable=generator)
