"""``models.apply(recompute_norms=True, recompute_glu=...)`` in eager (CPU; our kernels under the Triton
interpreter): after the forward no decoder norm's (or GLU's) output is alive (the projections saved its
recipe instead), the backward recomputes each once, and the gradients are those of the model that saves
them, to the bit; with other saved-tensor hooks active, nothing is recomputed."""

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
def calls(monkeypatch):
    """Weak references to the output (its storage's owner) of every call of the patched norms' and MLPs' ops."""
    seen: dict[str, list[weakref.ref]] = {"rms_norm": [], "swiglu": []}
    for name, outputs in seen.items():
        op = getattr(forwards, name)

        def spy(*args, op=op, outputs=outputs, **kwargs):
            y = op(*args, **kwargs)
            outputs.append(weakref.ref(y if y._base is None else y._base))
            return y

        monkeypatch.setattr(forwards, name, spy)
    return seen


def _step(reference, calls, outer_hooks: bool = False, **switches):
    """{op: (outputs alive after the forward, calls in the backward)}, loss, gradients."""
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with models.patched(model, **switches):
        for outputs in calls.values():
            outputs.clear()
        with identity if outer_hooks else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        after_forward = {name: (len(out), sum(ref() is not None for ref in out)) for name, out in calls.items()}
        loss.backward()
    counts = {name: (alive, len(calls[name]) - n) for name, (n, alive) in after_forward.items()}
    return counts, loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("glu", [False, True])
def test_outputs_are_recomputed_once_each_with_the_same_gradients(reference, calls, glu):
    kept, kept_loss, kept_grads = _step(reference, calls, recompute_norms=False)
    counts, loss, grads = _step(reference, calls, recompute_norms=True, recompute_glu=glu)
    # saved: each layer's two norm outputs (read by q/k/v and by gate/up) and its GLU output (read by down);
    # the final norm's feeds the fused loss, which keeps gradients rather than its input
    assert kept == {"rms_norm": (2 * LAYERS, 0), "swiglu": (LAYERS, 0)}
    # recomputed once each (q, k and v share one) and freed after the forward
    assert counts == {"rms_norm": (0, 2 * LAYERS), "swiglu": (0, LAYERS) if glu else (LAYERS, 0)}
    assert torch.equal(loss, kept_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, kept_grads[name]), name


def test_other_saved_tensor_hooks_turn_it_off(reference, calls):
    counts, _, _ = _step(reference, calls, outer_hooks=True, recompute_norms=True, recompute_glu=True)
    assert counts == {"rms_norm": (2 * LAYERS, 0), "swiglu": (LAYERS, 0)}


@pytest.mark.parametrize("switch", ["recompute_norms", "recompute_glu"])
def test_switches_must_be_bools(reference, switch):
    with pytest.raises(TypeError, match=f"{switch} must be a bool"):
        models.apply(copy.deepcopy(reference), **{switch: "yes"})
