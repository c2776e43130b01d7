"""The partitioner fix in inductor_ext/_compat/torch_fixes.py: a compiled fused linear cross-entropy in
``weight_grad_accumulation="weight_dtype"`` mode keeps exactly the two gradients for the backward
(every chunk's accumulation stays in the forward), and its results are eager's."""

import torch

from inductor_ext import fused_linear_cross_entropy
from tests.tolerances import rel_err

N, H, V = 512, 128, 1024  # the default chunk for this mode is H / 4 = 32 rows: 16 chunks


def _saved_shapes(fn, *args):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, shapes


def test_compiled_weight_dtype_loss_saves_only_its_gradients(fresh_dynamo):
    torch.manual_seed(0)
    hidden = torch.randn(N, H, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H) / H**0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (N,))

    def loss_fn(h, w, y):
        return fused_linear_cross_entropy(h, w, y, weight_grad_accumulation="weight_dtype")

    compiled = torch.compile(loss_fn, backend="fastops_inductor", fullgraph=True)
    loss, shapes = _saved_shapes(compiled, hidden, weight, labels)
    tensor_shapes = sorted(s for s in shapes if len(s) > 0)
    assert tensor_shapes == [(N, H), (V, H)], shapes  # not the last chunk's (V, 32) logit gradient
    grads = torch.autograd.grad(loss, [hidden, weight])
    expected_loss = loss_fn(hidden, weight, labels)
    expected = torch.autograd.grad(expected_loss, [hidden, weight])
    assert rel_err(loss, expected_loss) < 1e-3
    for got, want in zip(grads, expected):
        assert rel_err(got, want) < 2e-2, rel_err(got, want)


def test_an_opaque_mutating_ops_output_is_fusible_to_torch_and_not_with_the_fix():
    """The rule itself: torch's ``OpTypes.is_fusible`` counts a getitem of ``auto_functionalized`` as
    fusible (the bug); with the fix installed, as during our compiles, it does not."""
    import operator

    from torch._functorch import partitioners

    from inductor_ext import _compat
    from inductor_ext._compat import torch_fixes

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    opaque = graph.call_function(
        torch.ops.higher_order.auto_functionalized, (torch.ops.aten.add_.Tensor,), {"self": x, "other": x}
    )
    output = graph.call_function(operator.getitem, (opaque, 1))
    op_types = partitioners.get_default_op_list()
    assert op_types.is_fusible(output)
    with _compat.applied(torch_fixes.PATCHES):
        assert not op_types.is_fusible(output)
        assert op_types.is_fusible(graph.call_function(operator.getitem, (x, 0)))
    assert op_types.is_fusible(output)
