"""The embedding's weight gradient on CUDA (aten's sort-based kernel): as close to float64 as
``torch.compile`` of ``F.embedding``'s backward, the same bits on every run, with a padding id repeated
over half the batch; under ``fastops_inductor`` on the kernel route, aten's kernel called through the
opaque op (not Inductor's decomposition) and eager's gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import inductor_ext
from tests.tolerances import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

V, H, TOKENS, PAD = 128256, 2048, 8192, 128004


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(0)
    ids = (torch.rand(TOKENS, device="cuda") ** 3 * V).long()
    ids[: TOKENS // 2] = PAD
    weight = torch.randn(V, H, device="cuda", dtype=torch.bfloat16)
    return ids.view(4, -1), weight, torch.randn(4, TOKENS // 4, H, device="cuda", dtype=torch.bfloat16)


def _grad(f, ids, weight, dy):
    w = weight.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(f(ids, w), (w,), dy)
    return grad


@pytest.mark.parametrize("padding_idx", [None, PAD])
def test_as_close_to_float64_as_compiled_aten(inputs, padding_idx):
    ids, weight, dy = inputs
    reference = _grad(lambda i, w: F.embedding(i, w, padding_idx), ids, weight.double(), dy.double())
    compiled = _grad(torch.compile(lambda i, w: F.embedding(i, w, padding_idx)), ids, weight, dy)
    ours = _grad(lambda i, w: inductor_ext.embedding(i, w, padding_idx), ids, weight, dy)
    assert rel_err(ours, reference) <= 1.05 * rel_err(compiled, reference) + 1e-6
    assert torch.equal(ours, _grad(lambda i, w: inductor_ext.embedding(i, w, padding_idx), ids, weight, dy))


def test_backend_kernel_route_gives_eager_gradients(inputs):
    ids, weight, dy = inputs
    torch._dynamo.reset()
    compiled = torch.compile(lambda i, w: F.embedding(i, w), backend="fastops_inductor",
                             options={"fastops.route": "kernel"})  # fmt: skip
    got, codes = run_and_get_code(_grad, compiled, ids, weight, dy)
    assert any("embedding_dense_backward_aten" in code for code in codes), codes
    assert torch.equal(got, _grad(F.embedding, ids, weight, dy))
