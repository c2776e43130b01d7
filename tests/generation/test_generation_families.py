"""A generation package's greedy tokens equal transformers' eager ``generate`` token for token over 32 new
tokens, for two model families (Llama; Qwen3, with per-head q/k norms and its own head_dim), float32 on
CPU, from Python (``load_generation``) and from the C++ loop (``aoti_generate``), at batch 1 (the
package's static decode graph) and for a left-padded batch of 2 (its dynamic graph)."""

import pytest
import torch

from inductor_ext.bench.train import build_model
from inductor_ext.cpp_runner import run_generate
from inductor_ext.generation import export_generation, load_generation

pytest.importorskip("transformers")

NEW, PAD = 32, 0


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3"])
def exported(request, tmp_path_factory):
    torch.manual_seed(0)
    model = build_model(request.param, "cpu", torch.float32).eval()
    path = export_generation(model, tmp_path_factory.mktemp(request.param) / "model.pt2", max_batch_size=2,
                             max_seq_len=48)  # fmt: skip
    return model, path


def _prompts(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return [(ids[:1].contiguous(), mask[:1].contiguous()), (ids, mask)]


@pytest.mark.parametrize("runtime", ["python", "cpp"])
def test_greedy_tokens_equal_hf_eager(exported, runtime):
    model, path = exported
    package = load_generation(path) if runtime == "python" else None
    for ids, mask in _prompts(model.config.vocab_size):
        with torch.no_grad():
            want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
        if package is not None:
            got = package.generate(ids, NEW, attention_mask=mask, pad_token_id=PAD)
        else:
            got = run_generate(path, ids, NEW, attention_mask=mask).tokens
        assert torch.equal(got, want), f"batch {len(ids)}: {got.tolist()} != transformers' {want.tolist()}"
