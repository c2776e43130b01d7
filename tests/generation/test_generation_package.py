"""``export_generation`` + ``load_generation`` on CPU: the package generates the tokens transformers'
``generate`` does for the same call (float32 tiny Llama, so greedy and seeded sampling agree token
for token), for equal-length and left-padded batches, batch sizes 1..max and one-token prompts, and
stops at end-of-sequence tokens as ``generate`` does; batches 1 and 3 decode with the package's static
decode graphs, the others with its dynamic graph. One export (~25 s) is shared by the module."""

import pytest
import torch

import inductor_ext
from inductor_ext.bench.train import build_model
from inductor_ext.runtime.export import load_models
from inductor_ext.runtime.generation import export_generation, load_generation
from inductor_ext.runtime.generation.cache_layout import kv_cache_shape, layer_caches
from inductor_ext.runtime.generation.step import GenerationStep
from inductor_ext.runtime.package_inputs import METADATA_KEY
from inductor_ext.runtime.shared_weights import read_weights

pytest.importorskip("transformers")

MAX_BATCH, MAX_SEQ = 4, 48
PAD = 0


pytestmark = pytest.mark.xdist_group("generation_package")  # one worker builds the module's packages once


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny-llama", "cpu", torch.float32).eval()


@pytest.fixture(scope="module")
def package_path(model, tmp_path_factory):
    return export_generation(model, tmp_path_factory.mktemp("gen") / "tiny.pt2", max_batch_size=MAX_BATCH,
                             max_seq_len=MAX_SEQ, decode_batch_sizes=(1, 3))  # fmt: skip


@pytest.fixture(scope="module")
def package(package_path):
    return load_generation(package_path)


def _prompt(model, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=generator)


def _hf(model, ids, new, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, pad_token_id=PAD, **kwargs)


@pytest.mark.parametrize(("batch", "length"), [(1, 7), (3, 12), (MAX_BATCH, 1)])
def test_greedy_tokens_equal_hf_generate(model, package, batch, length):
    ids = _prompt(model, batch, length)
    ours = package.generate(ids, 10, pad_token_id=PAD)
    torch.testing.assert_close(ours, _hf(model, ids, 10, do_sample=False), rtol=0, atol=0)


def test_left_padded_batch_equals_hf_generate(model, package):
    ids = _prompt(model, 3, 11, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :1] = 0
    ours = package.generate(ids, 9, attention_mask=mask, pad_token_id=PAD)
    torch.testing.assert_close(ours, _hf(model, ids, 9, attention_mask=mask, do_sample=False), rtol=0, atol=0)
    as_bool = package.generate(ids, 9, attention_mask=mask.bool(), pad_token_id=PAD)
    torch.testing.assert_close(as_bool, ours, rtol=0, atol=0)


def test_seeded_sampling_equals_hf_generate(model, package):
    ids = _prompt(model, 2, 6, seed=3)
    torch.manual_seed(11)
    ours = package.generate(ids, 8, do_sample=True, temperature=0.8, top_k=20, pad_token_id=PAD)
    torch.manual_seed(11)
    theirs = _hf(model, ids, 8, do_sample=True, temperature=0.8, top_k=20)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_rows_stop_at_end_of_sequence_as_hf(model, package):
    ids = _prompt(model, 3, 8, seed=4)
    free = package.generate(ids, 12, pad_token_id=PAD)
    eos = int(free[0, 8 + 2])  # the third token row 0 generates: it ends there, the others run on or end too
    ours = package.generate(ids, 12, pad_token_id=PAD, eos_token_id=eos)
    theirs = _hf(model, ids, 12, do_sample=False, eos_token_id=eos)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert (ours[0, 8 + 3 :] == PAD).all()


class _Recorder:
    """A streamer keeping what ``generate`` hands it."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value)

    def end(self) -> None:
        self.ended += 1


def test_a_streamer_gets_what_hf_generate_gives_it(model, package):
    """The prompt, then each new token (rows ending early padded), then ``end``: as HF's ``generate``."""
    ids = _prompt(model, 2, 5, seed=5)
    ours, theirs = _Recorder(), _Recorder()
    free = package.generate(ids, 6, pad_token_id=PAD)
    eos = int(free[0, 5 + 1])
    package.generate(ids, 6, pad_token_id=PAD, eos_token_id=eos, streamer=ours)
    _hf(model, ids, 6, do_sample=False, eos_token_id=eos, streamer=theirs)
    assert len(ours.puts) == len(theirs.puts) > 2 and ours.ended == theirs.ended == 1
    for mine, hf in zip(ours.puts, theirs.puts):
        assert mine.device.type == "cpu"
        torch.testing.assert_close(mine, hf, rtol=0, atol=0)


def test_step_matches_the_model_and_writes_the_cache(model):
    """The exported module itself, eager: prefill logits are the model's, and the cache holds exactly
    the prompt's keys and values in its first slots."""
    ids = _prompt(model, 2, 9, seed=5)
    cache = torch.zeros(kv_cache_shape(model.config, 2, MAX_SEQ))
    slots = torch.zeros(2, MAX_SEQ, dtype=torch.long)
    slots[:, :9] = 1
    with torch.no_grad():
        logits = GenerationStep(model)(
            ids, torch.arange(9).expand(2, 9), torch.arange(9), slots, layer_caches(cache, 2)
        )
        out = model(ids, use_cache=True)
    torch.testing.assert_close(logits, out.logits[:, -1], rtol=1e-5, atol=1e-5)
    keys = out.past_key_values.layers[0].keys
    torch.testing.assert_close(cache[0, 0, :, :, :9], keys, rtol=1e-6, atol=1e-6)
    assert not cache[..., 9:, :].any()


def test_inductor_ext_load_runs_a_generation_graph_on_the_shared_weights(model, package_path):
    """``inductor_ext.load`` of a generation package gives its dynamic graph the package's weights too."""
    ids = _prompt(model, 2, 9, seed=6)
    slots = torch.zeros(2, MAX_SEQ, dtype=torch.long)
    slots[:, :9] = 1
    inputs = (ids, torch.arange(9).expand(2, 9).contiguous(), torch.arange(9), slots)
    cache = torch.zeros(kv_cache_shape(model.config, 2, MAX_SEQ))
    with torch.no_grad():
        want = GenerationStep(model)(*inputs, layer_caches(cache.clone(), 2))
    got = inductor_ext.load(package_path)(*inputs, layer_caches(cache, 2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_graph_refuses_inputs_unlike_its_own(model, package_path):
    """Every graph of the package records its own inputs: the static decode graph for batch 1 refuses a
    batch of 2; the dynamic graph a cache tensor of another dtype (named by its index in the list) and
    ``position_ids`` whose token count is not ``input_ids``' (one dimension of the exported program)."""
    graphs = load_models(package_path)
    assert sorted(graphs) == ["decode_batch_1", "decode_batch_3", "model"]
    assert all(METADATA_KEY in graph.get_metadata() for graph in graphs.values())
    ids = _prompt(model, 2, 9, seed=6)
    slots = torch.ones(2, MAX_SEQ, dtype=torch.long)
    caches = layer_caches(torch.zeros(kv_cache_shape(model.config, 2, MAX_SEQ)), 2)
    positions = torch.arange(9).expand(2, 9).contiguous()
    one_token = (ids[:, :1].contiguous(), positions[:, :1].contiguous(), torch.arange(1), slots, caches)
    with pytest.raises(ValueError, match=r"argument 0 must have shape \(1, 1\), got \(2, 1\)"):
        graphs["decode_batch_1"](*one_token)
    caches_with_a_double = [cache.double() if i == 1 else cache for i, cache in enumerate(caches)]
    with pytest.raises(ValueError, match=r"argument 4\[1\] must be torch.float32, got torch.float64"):
        graphs["model"](ids, positions, torch.arange(9), slots, caches_with_a_double)
    with pytest.raises(ValueError, match=r"argument 1 must have shape .* got \(2, 8\) .*where argument 0 has 9"):
        graphs["model"](ids, positions[:, :8].contiguous(), torch.arange(9), slots, caches)


def test_a_frozen_package_holds_its_own_weights_and_generates_hf_tokens(model, tmp_path):
    """Inductor's ``freezing`` (no static decode graphs): one graph with its weights, no shared record."""
    path = export_generation(model, tmp_path / "frozen.pt2", max_batch_size=2, max_seq_len=24,
                             options={"freezing": True}, decode_batch_sizes=())  # fmt: skip
    assert read_weights(path, torch.device("cpu")) is None
    ids = _prompt(model, 1, 5, seed=7)
    torch.testing.assert_close(load_generation(path).generate(ids, 8, pad_token_id=PAD),
                               _hf(model, ids, 8, do_sample=False), rtol=0, atol=0)  # fmt: skip


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p, ids: p.generate(ids.expand(MAX_BATCH + 1, -1), 2), "batch 5 is outside"),
        (lambda p, ids: p.generate(ids, MAX_SEQ), "exceeds the package's max_seq_len"),
        (lambda p, ids: p.generate(ids.int(), 2), "int64 tensor"),
        (lambda p, ids: p.generate(ids, 0), "max_new_tokens must be an int >= 1, got 0"),
        (lambda p, ids: p.generate(ids[:, :0], 2), r"the prompt is empty \(input_ids of shape \(1, 0\)\)"),
        (lambda p, ids: p.generate(ids, 2, pad_token_id=256), r"pad_token_id must lie in \[0, 256\), got 256"),
        (lambda p, ids: p.generate(ids, 2, attention_mask=torch.ones(1, 3)), "attention_mask must have"),
        (lambda p, ids: p.generate(ids, 2, do_sample=True, temperature=0.0), "temperature must be > 0"),
        (lambda p, ids: p.generate(ids + 1000, 2), "must lie in \\[0, 256\\)"),
        (lambda p, ids: p.generate(ids, 2, attention_mask=torch.zeros_like(ids)), "needs a real token"),
        # 0.5 would pass for a real token and then be cast to 0 (padding); 2 would count twice in the positions
        (lambda p, ids: p.generate(ids, 2, attention_mask=torch.full((1, 4), 0.5)), "attention_mask must hold only 0"),
        (lambda p, ids: p.generate(ids, 2, attention_mask=torch.full((1, 4), 2)), "attention_mask must hold only 0"),
    ],
)
def test_bad_generate_arguments_are_refused(model, package, call, message):
    with pytest.raises(ValueError, match=message):
        call(package, _prompt(model, 1, 4))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an int >= 1, got 2.5"),
        ({"max_new_tokens": True}, "max_new_tokens must be an int >= 1, got True"),
        ({"eos_token_id": "foo"}, "eos_token_id must be an int or a list of ints, got 'foo'"),
        ({"eos_token_id": [2, 3.0]}, r"eos_token_id must be an int or a list of ints, got \[2, 3.0\]"),
        ({"pad_token_id": 0.0}, "pad_token_id must be an int, got 0.0"),
        ({"do_sample": True, "top_k": 2.5}, "top_k must be an int >= 1 or None, got 2.5"),
        ({"do_sample": True, "temperature": "hot"}, "temperature must be a finite number, got 'hot'"),
        ({"do_sample": True, "temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"do_sample": "yes"}, "do_sample must be True or False, got 'yes'"),
        ({"streamer": 1}, r"streamer must have put\(tokens\) and end\(\) methods .*got int"),
    ],
)
def test_generate_arguments_of_the_wrong_type_are_named(model, package, arguments, message):
    with pytest.raises(TypeError, match=message):
        package.generate(_prompt(model, 1, 4), **{"max_new_tokens": 2, **arguments})


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("meta", "device must be of the package's device type 'cpu' .*got 'meta'"),
        ("cuda:1", "device must be of the package's device type 'cpu' .*got 'cuda:1'"),
        ("gpu", "device must be a torch.device or its name, got 'gpu'"),
    ],
)
def test_a_device_other_than_the_package_s_is_refused(package_path, device, message):
    """A package exported for the CPU runs there only (on meta, generate crashed the process)."""
    with pytest.raises(ValueError, match=message):
        load_generation(package_path, device=device)


def test_the_graphs_share_one_copy_of_the_weights(model, package, package_path):
    """Static decode graphs for batches 1 and 3; the weights stored once, every parameter by its name."""
    assert sorted(package.decode_steps) == [1, 3]
    weights = read_weights(package_path, torch.device("cpu"))
    assert weights is not None
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(weights[f"model.{name}"], parameter.detach(), rtol=0, atol=0)
    for graph in [package.step, *package.decode_steps.values()]:
        assert set(graph.get_constant_fqns()) <= set(weights)


def test_a_package_without_static_decode_graphs_generates_hf_tokens(model, tmp_path):
    """Also: no end-of-sequence token in the generation config means none, as in ``generate``, though the
    model's config names one (it did stop the package's rows early)."""
    assert model.config.eos_token_id is not None
    model.generation_config.eos_token_id = None
    try:
        path = export_generation(model, tmp_path / "dynamic.pt2", max_batch_size=2, max_seq_len=24,
                                 decode_batch_sizes=())  # fmt: skip
    finally:
        model.generation_config.eos_token_id = model.config.eos_token_id
    package = load_generation(path)
    assert package.decode_steps == {}
    assert package.eos_token_ids == ()
    ids = _prompt(model, 1, 5, seed=4)
    torch.testing.assert_close(package.generate(ids, 8, pad_token_id=PAD), _hf(model, ids, 8, do_sample=False),
                               rtol=0, atol=0)  # fmt: skip


def test_bad_export_arguments_are_refused(model, tmp_path):
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        export_generation(model, tmp_path / "x.pt2", max_batch_size=0, max_seq_len=8)
    for sizes in [(0,), (3,)]:
        with pytest.raises(ValueError, match="decode_batch_sizes must be integers in 1..max_batch_size"):
            export_generation(model, tmp_path / "x.pt2", max_batch_size=2, max_seq_len=8, decode_batch_sizes=sizes)
    with pytest.raises(ValueError, match="freezing folds the weights"):
        export_generation(model, tmp_path / "x.pt2", max_batch_size=2, max_seq_len=8, options={"freezing": True})
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        export_generation(model, tmp_path / "x.pt2", max_batch_size=1,
                          max_seq_len=model.config.max_position_embeddings + 1)  # fmt: skip


def test_export_leaves_the_model_in_training_mode(model, tmp_path):
    """Exporting sets eval mode for the trace and restores the caller's mode (checked with a failing export)."""
    model.train()
    try:
        with pytest.raises(ValueError):
            export_generation(model, tmp_path / "not-a-package.txt", max_batch_size=1, max_seq_len=8)
        assert model.training
    finally:
        model.eval()


@pytest.mark.parametrize("name", ["input_ids", "attention_mask"])
def test_a_prompt_on_the_meta_device_is_named(model, package, name):
    ids = _prompt(model, 1, 4)
    arguments = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    arguments[name] = arguments[name].to("meta")
    with pytest.raises(ValueError, match=f"generate: {name} must be on the CPU or on the package's device type 'cpu'"):
        package.generate(arguments.pop("input_ids"), 2, **arguments)


def test_generate_is_repeatable_across_batch_sizes_and_settings(model, package):
    """The decode loop keeps per-batch state between calls: calls at other batches and settings in between
    change nothing (greedy, sampled with a seed, and with end tokens)."""
    ids = _prompt(model, 2, 6)
    greedy = package.generate(ids, 7, pad_token_id=PAD)
    torch.manual_seed(3)
    sampled = package.generate(ids, 7, do_sample=True, temperature=0.7, top_k=5, pad_token_id=PAD)
    package.generate(_prompt(model, 3, 9), 5, pad_token_id=PAD, eos_token_id=int(greedy[0, 7]))
    package.generate(ids[:1], 4, do_sample=True, top_k=None, pad_token_id=PAD)
    torch.testing.assert_close(package.generate(ids, 7, pad_token_id=PAD), greedy, rtol=0, atol=0)
    torch.manual_seed(3)
    again = package.generate(ids, 7, do_sample=True, temperature=0.7, top_k=5, pad_token_id=PAD)
    torch.testing.assert_close(again, sampled, rtol=0, atol=0)
