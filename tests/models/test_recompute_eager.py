"""``models.apply(recompute_norms=True)`` in eager (CPU; our kernels under the Triton interpreter): after the
forward no decoder norm's output is alive (the projections saved its recipe instead), the backward
recomputes each once, and the gradients are those of the model that saves them, to the bit; with other
saved-tensor hooks active, nothing is recomputed."""

import contextlib
import copy
import gc
import weakref

import pytest
import torch
import transformers

from inductor_ext import models
from inductor_ext.models import forwards

H, LAYERS = 64, 2


@pytest.fixture(scope="module")
def reference():
    config = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).train()


@pytest.fixture
def norm_calls(monkeypatch):
    """Weak references to the output (its storage's owner) of every call of the patched norms' op."""
    calls: list[weakref.ref] = []
    rms_norm = forwards.rms_norm

    def spy(*args, **kwargs):
        y = rms_norm(*args, **kwargs)
        calls.append(weakref.ref(y if y._base is None else y._base))
        return y

    monkeypatch.setattr(forwards, "rms_norm", spy)
    return calls


def _step(reference, norm_calls, recompute: bool, outer_hooks: bool = False):
    """(norm outputs alive after the forward, norm calls in the backward, loss, gradients)."""
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with models.patched(model, recompute_norms=recompute):
        norm_calls.clear()
        with identity if outer_hooks else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        forward_calls = len(norm_calls)
        alive = sum(ref() is not None for ref in norm_calls)
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return alive, len(norm_calls) - forward_calls, loss.detach(), grads


def test_norm_outputs_are_recomputed_once_each_with_the_same_gradients(reference, norm_calls):
    kept_alive, kept_recomputes, kept_loss, kept_grads = _step(reference, norm_calls, recompute=False)
    alive, recomputes, loss, grads = _step(reference, norm_calls, recompute=True)
    # saved: each layer's two norm outputs (read by q/k/v and by gate/up); the final norm's feeds the fused
    # loss, which keeps gradients rather than its input
    assert (kept_alive, kept_recomputes) == (2 * LAYERS, 0)
    assert (alive, recomputes) == (0, 2 * LAYERS)  # q, k and v share one recompute
    assert torch.equal(loss, kept_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, kept_grads[name]), name


def test_other_saved_tensor_hooks_turn_it_off(reference, norm_calls):
    alive, recomputes, _, _ = _step(reference, norm_calls, recompute=True, outer_hooks=True)
    assert (alive, recomputes) == (2 * LAYERS, 0)


def test_recompute_norms_must_be_a_bool(reference):
    with pytest.raises(TypeError, match="recompute_norms must be a bool"):
        models.apply(copy.deepcopy(reference), recompute_norms="yes")
