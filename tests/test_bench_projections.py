"""``bench projections``' spellings of a layer's projection work compute the same values, eager in
float64 and compiled by Inductor (the GPU benchmark times them; here only what they compute)."""

import pytest
import torch

from benchmarks import projections


def _expected(x, weights, grads):
    """The projection work written out from its definition: ``y_i = x W_i^T``, ``dW_i = dy_i^T x``,
    ``dx = sum_i dy_i W_i``."""
    outputs = [torch.einsum("nh,oh->no", x, w) for w in weights]
    weight_grads = [torch.einsum("no,nh->oh", dy, x) for dy in grads]
    input_grad = sum(torch.einsum("no,oh->nh", dy, w) for dy, w in zip(grads, weights))
    return outputs, weight_grads, input_grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_spellings_compute_the_projection_work(model, compiled):
    for group, widths in projections.group_widths(model).items():
        hidden = projections.MODELS[model]["hidden_size"]
        inputs = projections.make_inputs(24, hidden, widths, torch.float64, "cpu")
        expected = _expected(inputs["x"], inputs["weights"], inputs["grads"])
        torch._dynamo.reset()
        for name, spelling in projections.SPELLINGS.items():
            fn = torch.compile(spelling, fullgraph=True) if compiled else spelling
            result = projections.call(name, fn, inputs)()
            assert projections.max_rel_err(result, expected) < 1e-12, (group, name)
            assert [tuple(t.shape) for t in result[0]] == [(24, n) for n in widths]


def test_group_widths_follow_the_config():
    assert projections.group_widths("llama-3.2-1b") == {"qkv": [2048, 512, 512], "gate_up": [8192, 8192]}
    # Qwen3's head_dim (128) is not hidden / heads (1024 / 16 = 64)
    assert projections.group_widths("qwen3-0.6b") == {"qkv": [2048, 1024, 1024], "gate_up": [3072, 3072]}
