"""Generation on a real GPU: a tiny HF Llama's package (``export_generation``, with each attention choice:
transformers' SDPA, folded SDPA, our decode-attention op) generates transformers' tokens in float32 (TF32
off: greedy argmax agrees token for token), from Python and from the C++ loop, at batch 1 with its static
decode graph and at other batches with its dynamic graph; its bf16 package's logits are as close to
float64 as transformers' bf16 eager ones at the prefill and at a decode step (batches 2 and 1); and
static-cache ``generate`` with the decode step under ``fastops_inductor`` (CUDA graphs,
``reduce-overhead``; and ``cpp_wrapper``) gives eager's tokens."""

import pytest
import torch

from inductor_ext.bench.train import build_model
from inductor_ext.runtime.cpp_runner import run_generate
from inductor_ext.runtime.generation import export_generation, load_generation
from inductor_ext.runtime.generation.cache_layout import kv_cache_shape, layer_caches
from inductor_ext.runtime.generation.step import GenerationStep
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
transformers = pytest.importorskip("transformers")

MAX_BATCH, MAX_SEQ, PAD = 4, 96, 0


@pytest.fixture(autouse=True)
def _no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def _model(dtype):
    torch.manual_seed(0)
    return build_model("tiny-llama", "cuda", dtype).eval()


def _prompt(batch, length, seed=1):
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed)).cuda()


def _hf(model, ids, new, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=PAD, **kwargs)


@pytest.fixture(scope="module", params=["sdpa", "folded_sdpa", "decode_attention"])
def float32_package(request, tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(torch.float32)
    return model, export_generation(model, tmp_path_factory.mktemp("gen") / "g.pt2", max_batch_size=MAX_BATCH,
                                    max_seq_len=MAX_SEQ, attention=request.param)  # fmt: skip


def test_float32_package_generates_hf_tokens(float32_package):
    model, path = float32_package
    package = load_generation(path)
    for batch, length in ((1, 17), (MAX_BATCH, 40)):
        ids = _prompt(batch, length)
        torch.testing.assert_close(package.generate(ids, 24, pad_token_id=PAD), _hf(model, ids, 24), rtol=0, atol=0)
    ids = _prompt(3, 20, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    ours = package.generate(ids, 16, attention_mask=mask, pad_token_id=PAD)
    torch.testing.assert_close(ours, _hf(model, ids, 16, attention_mask=mask), rtol=0, atol=0)


class _Kept:
    """A streamer keeping what ``generate`` hands it."""

    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.append(value.cpu())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("batch", [1, 3])  # 1: the static decode graph captured; 3: the dynamic graph captured
def test_replayed_decode_steps_give_hf_samples_end_tokens_and_stream(float32_package, batch):
    """The Python loop replays each decode step as a CUDA graph (token choice and input updates inside):
    seeded samples, rows that stop at an end token (the loop reading the stop flag steps behind), a
    left-padded row and a streamer give transformers' results, on repeated calls too."""
    model, path = float32_package
    package = load_generation(path)
    ids = _prompt(batch, 21, seed=4)
    mask = torch.ones_like(ids)
    mask[-1, :5] = 0
    for seed in (0, 1):  # the second call replays the graphs the first one captured
        sampled = {"do_sample": True, "temperature": 0.7, "top_k": 20, "attention_mask": mask}
        torch.manual_seed(seed)
        ours = package.generate(ids, 20, pad_token_id=PAD, **sampled)
        torch.manual_seed(seed)
        with torch.no_grad():
            theirs = model.generate(ids, max_new_tokens=20, pad_token_id=PAD, **sampled)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert any(key[0] == batch for key in package._loop._graphs), "no decode graph was captured"
    free = _hf(model, ids, 20, attention_mask=mask)
    for at in (0, 2, 11):  # row 0 ends with its first token, its third, its twelfth; the others run on or end too
        eos = int(free[0, 21 + at])
        ours = package.generate(ids, 20, attention_mask=mask, pad_token_id=PAD, eos_token_id=eos)
        torch.testing.assert_close(ours, _hf(model, ids, 20, attention_mask=mask, eos_token_id=eos), rtol=0, atol=0)
    eos = int(free[-1, 21 + 6])
    kept, theirs = _Kept(), _Kept()
    package.generate(ids, 20, attention_mask=mask, pad_token_id=PAD, eos_token_id=eos, streamer=kept)
    _hf(model, ids, 20, attention_mask=mask, eos_token_id=eos, streamer=theirs)
    assert kept.ended and theirs.ended and len(kept.tokens) == len(theirs.tokens)
    for got, want in zip(kept.tokens, theirs.tokens):
        torch.testing.assert_close(got.reshape(want.shape), want, rtol=0, atol=0)


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["launches", "cuda_graph"])
@pytest.mark.parametrize("batch", [3, 1])  # batch 1: the static decode graph, captured in the CUDA graph
def test_cpp_loop_generates_the_python_loops_tokens(float32_package, cuda_graph, batch):
    _, path = float32_package
    ids = _prompt(batch, 20, seed=3)
    mask = torch.ones_like(ids)
    mask[-1, :4] = 0
    want = load_generation(path).generate(ids, 24, attention_mask=mask).cpu()
    got = run_generate(path, ids.cpu(), 24, attention_mask=mask.cpu(), device="cuda", cuda_graph=cuda_graph, iters=2)
    torch.testing.assert_close(got.tokens, want, rtol=0, atol=0)
    assert got.decode_ms_per_token > 0


@pytest.mark.parametrize("attention", ["sdpa", "folded_sdpa", "decode_attention"])
def test_bf16_package_logits_are_as_close_to_float64_as_hf_eager(tmp_path, attention):
    model = _model(torch.bfloat16)
    exact = _model(torch.float64)
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    package = load_generation(export_generation(model, tmp_path / "g.pt2", max_batch_size=MAX_BATCH,
                                                max_seq_len=MAX_SEQ, attention=attention))  # fmt: skip
    long = {"dtype": torch.long, "device": "cuda"}
    for batch in (2, 1):  # batch 1 decodes with the package's static decode graph
        ids = _prompt(batch, 34)
        prefill = (ids[:, :33].contiguous(), torch.arange(33, **long).expand(batch, 33).contiguous(),
                   torch.arange(33, **long), torch.ones(batch, MAX_SEQ, **long))  # fmt: skip
        decode = (ids[:, 33:].contiguous(), torch.full((batch, 1), 33, **long), torch.tensor([33], **long), prefill[3])
        shape = kv_cache_shape(model.config, batch, MAX_SEQ)
        ours_cache = layer_caches(torch.zeros(shape, device="cuda", dtype=torch.bfloat16), batch)
        exact_cache = layer_caches(torch.zeros(shape, device="cuda", dtype=torch.float64), batch)
        steps = ((prefill, 33, package.step), (decode, 34, package.decode_steps.get(batch, package.step)))
        with torch.no_grad():
            for inputs, hf_tokens, step in steps:
                ours = step(*inputs, ours_cache)
                truth = GenerationStep(exact)(*inputs, exact_cache)
                hf = model(ids[:, :hf_tokens]).logits[:, -1].float()
                assert rel_err(ours, truth) <= 2 * rel_err(hf, truth) + 1e-3, (batch, hf_tokens)


@pytest.fixture(scope="module")
def bf16_package(tmp_path_factory):
    model = _model(torch.bfloat16)
    model.generation_config.eos_token_id = None  # random weights: every row generates all its tokens
    exact = _model(torch.float64)
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    path = export_generation(model, tmp_path_factory.mktemp("bf16") / "g.pt2", max_batch_size=MAX_BATCH,
                             max_seq_len=MAX_SEQ)  # fmt: skip
    return model, exact, load_generation(path)


@pytest.mark.parametrize("batch", [1, 4])  # batch 1: the static decode graph; 4: the dynamic graph
def test_bf16_tokens_follow_hf_eager_until_a_tie_within_bf16_noise(bf16_package, batch):
    """32 greedy tokens of 4 seeded prompts: equal to HF eager's in bf16, or, where a token first differs,
    the two tokens' float64 logits (of HF's prefix) within the bf16 noise of HF's own logits there."""
    model, exact, package = bf16_package
    for seed in range(4) if batch == 1 else [0]:
        ids = torch.cat([_prompt(1, 24, seed=10 + s) for s in ([seed] if batch == 1 else range(batch))])
        ours, hf = package.generate(ids, 32, pad_token_id=PAD), _hf(model, ids, 32)
        for row in range(batch):
            differ = (ours[row] != hf[row]).nonzero()
            if not len(differ):
                continue
            at = int(differ[0])
            prefix = hf[row : row + 1, :at]
            with torch.no_grad():
                truth = exact(prefix).logits[0, -1]
                noise = (model(prefix).logits[0, -1].double() - truth).abs().max()
            gap = (truth[hf[row, at]] - truth[ours[row, at]]).abs()
            print(
                f"seed {seed} row {row}: first difference at token {at - 24}, float64 logit gap {gap:.4f}, "
                f"bf16 noise {noise:.4f}"
            )
            assert gap <= noise, (seed, row, at, float(gap), float(noise))


@pytest.mark.parametrize(
    "compile_kwargs",
    [{}, {"mode": None, "options": {"cpp_wrapper": True}}],
    ids=["reduce_overhead", "cpp_wrapper"],
)
def test_static_cache_decode_under_the_backend_gives_eager_tokens(compile_kwargs):
    torch._dynamo.reset()
    model = _model(torch.float32)
    ids = _prompt(2, 30)
    eager = _hf(model, ids, 20, cache_implementation="static", disable_compile=True)
    model.generation_config.compile_config = transformers.CompileConfig(
        backend="fastops_inductor", fullgraph=True, **compile_kwargs
    )
    compiled = _hf(model, ids, 20, cache_implementation="static")
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
