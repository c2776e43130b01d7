"""Sliding-window attention in a generation package: greedy tokens equal transformers' eager ``generate``
for prompts and generations longer than the window (window 8, 13-token prompts, 16 new tokens), float32
on CPU, for a left-padded batch of 2 and for batch 1, in the three ways transformers configures windows:
every layer (Mistral, no ``layer_types``), some layers by ``layer_types`` (Qwen2 with q/k/v bias, Gemma3).
A model whose attention the step cannot reproduce is refused when the step is built."""

import pytest
import torch

from inductor_ext.runtime.generation import export_generation, load_generation
from inductor_ext.runtime.generation.step import attention_windows

transformers = pytest.importorskip("transformers")

WINDOW, PROMPT, NEW, PAD = 8, 13, 16, 0
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64, "initializer_range": 0.2}  # fmt: skip
FAMILIES = {
    "mistral": {"model_type": "mistral", "sliding_window": WINDOW},
    "qwen2": {"model_type": "qwen2", "sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1},
    "gemma3": {
        "model_type": "gemma3_text",
        "sliding_window": WINDOW,
        "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}


def _model(model_type: str, **fields: object) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **SHAPE, **fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_hf_eager_beyond_the_window(family, tmp_path):
    fields = dict(FAMILIES[family])
    model = _model(fields.pop("model_type"), **fields)
    assert any(w == WINDOW for w in attention_windows(model.config))
    path = export_generation(model, tmp_path / "model.pt2", max_batch_size=2, max_seq_len=PROMPT + NEW,
                             decode_batch_sizes=())  # fmt: skip
    package = load_generation(path)
    ids = torch.randint(3, SHAPE["vocab_size"], (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    for prompt, prompt_mask in [(ids, mask), (ids[1:].contiguous(), None)]:
        with torch.no_grad():
            want = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=NEW, do_sample=False,
                                  pad_token_id=PAD)  # fmt: skip
        got = package.generate(prompt, NEW, attention_mask=prompt_mask, pad_token_id=PAD)
        assert torch.equal(got, want), f"{family}, batch {len(prompt)}: {got.tolist()} != {want.tolist()}"


def test_windows_per_layer():
    assert attention_windows(transformers.AutoConfig.for_model("llama", num_hidden_layers=3)) == [None] * 3
    assert attention_windows(transformers.AutoConfig.for_model("mistral", num_hidden_layers=2, sliding_window=4)) == [
        4,
        4,
    ]
    gemma = transformers.AutoConfig.for_model("gemma3_text", num_hidden_layers=2, sliding_window=5,
                                              layer_types=["full_attention", "sliding_attention"])  # fmt: skip
    assert attention_windows(gemma) == [None, 5]


def test_attention_it_cannot_reproduce_is_refused():
    chunked = transformers.AutoConfig.for_model("llama", num_hidden_layers=2)
    chunked.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        attention_windows(chunked)
    unknown = transformers.AutoConfig.for_model("llama", num_hidden_layers=2)
    unknown.sliding_window = 16  # a model type not known to apply it to every layer
    with pytest.raises(ValueError, match="sliding_window=16 without layer_types"):
        attention_windows(unknown)
    zero = transformers.AutoConfig.for_model("mistral", num_hidden_layers=2, sliding_window=0)
    with pytest.raises(ValueError, match="positive integer"):
        attention_windows(zero)
