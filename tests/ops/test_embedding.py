"""Embedding: the op's kernel route (aten's kernel behind an opaque op; taken on CPU under the interpreter)
against float64, with repeated ids, long runs of one id, ``padding_idx``, 3-D ids and no ids; bad input;
the backend's rewrite of HF's ``nn.Embedding`` and the step's gradients under ``fastops_inductor``;
opcheck of the registered ops."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import inductor_ext
from inductor_ext.library.launch import interpreter_enabled
from inductor_ext.ops.embedding import embedding
from tests.tolerances import reduced_grad, rel_err

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
needs_kernels = pytest.mark.skipif(
    not interpreter_enabled(), reason="the kernel route runs on CPU under the interpreter"
)


def _ids(shape, vocab, seed=0):
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    flat = ids.view(-1)
    flat[: flat.numel() // 2] = 5  # half the tokens one id, as a padding token repeated over a batch
    return ids


def _reference_grad(ids, dy, vocab, padding_idx):
    weight = torch.zeros(vocab, dy.shape[-1], dtype=torch.float64, requires_grad=True)
    F.embedding(ids, weight, padding_idx).backward(dy.double())
    return weight.grad


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx", [None, 5, 7, -1])
def test_weight_gradient_against_float64(dtype, padding_idx):
    vocab, hidden = 61, 40
    weight = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    ids = _ids((3, 50), vocab)
    out = embedding(ids, weight, padding_idx)
    assert torch.equal(out, F.embedding(ids, weight.detach()))
    dy = torch.randn_like(out)
    out.backward(dy)
    reference = _reference_grad(ids, dy, vocab, None if padding_idx is None else padding_idx % vocab)
    assert rel_err(weight.grad, reference) < reduced_grad(dtype, 75)
    if padding_idx is not None:
        assert not weight.grad[padding_idx % vocab].any()
    absent = torch.ones(vocab, dtype=torch.bool)
    absent[ids.unique()] = False
    assert not weight.grad[absent].any()


@needs_kernels
def test_no_tokens_give_a_zero_gradient():
    weight = torch.randn(10, 4, requires_grad=True)
    embedding(torch.empty(0, 3, dtype=torch.long), weight).sum().backward()
    assert weight.grad is not None and not weight.grad.any()


def test_bad_input_is_refused():
    weight = torch.randn(10, 4)
    with pytest.raises(ValueError, match="weight must be a 2-D"):
        embedding(torch.tensor([1]), torch.randn(10))
    with pytest.raises(TypeError, match="weight must be float32, bfloat16 or float16"):
        embedding(torch.tensor([1]), weight.double())
    with pytest.raises(TypeError, match="token_ids must be an int64 or int32 tensor"):
        embedding(torch.tensor([1.0]), weight)
    with pytest.raises(ValueError, match=r"padding_idx must be in \[-10, 10\)"):
        embedding(torch.tensor([1]), weight, padding_idx=10)


def test_backend_rewrites_a_trainable_embedding_and_keeps_the_gradients():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Embedding(100, 32, padding_idx=3), torch.nn.Linear(32, 8))
    ids = _ids((4, 16), 100, seed=3)
    ids[0, :4] = 3
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="fastops_inductor", fullgraph=True)
    compiled(ids).square().sum().backward()
    assert counters["inductor_ext"]["rewrite_embedding"] == 1
    got = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    module(ids).square().sum().backward()
    for g, want in zip(got, (p.grad for p in module.parameters()), strict=True):
        torch.testing.assert_close(g, want)
    # a frozen embedding has no backward to speed up: left as it is
    module[0].weight.requires_grad_(False)
    counters.clear()
    torch._dynamo.reset()
    torch.compile(module, backend="fastops_inductor", fullgraph=True)(ids).sum().backward()
    assert counters["inductor_ext"]["rewrite_embedding"] == 0


def test_public_function_is_exported():
    assert inductor_ext.embedding is embedding


def test_the_registered_ops_pass_opcheck():
    weight = torch.randn(40, 24, requires_grad=True)
    ids = _ids((3, 10), 40, seed=4)
    torch.library.opcheck(torch.ops.fastops.embedding_fwd.default, (weight, ids, 5))
    dy = torch.randn(3, 10, 24)
    torch.library.opcheck(torch.ops.fastops.embedding_bwd.default, (dy, ids, 40, -1))
    torch.library.opcheck(torch.ops.fastops.embedding_dense_backward_aten.default, (dy, ids, 40, 5))
