"""``fastops.accumulate_products`` on CPU: ``fastops::sum_of_products`` (values against float64, opcheck, bad
input), which sums of matrix products the post-grad pass rewrites into it and which it leaves, and a Llama
under the backend whose backward sums q/k/v's and gate/up's input gradients with it."""

import pytest
import torch
import transformers
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import inductor_ext  # noqa: F401  (registers the backend)
from inductor_ext.inductor.options import parse_options
from inductor_ext.ops.sum_of_products import sum_of_products

pytestmark = pytest.mark.usefixtures("fresh_compiles")

OFF = {"fastops._passes_off": ("accumulate_products",)}


def test_the_pass_always_runs_unless_a_test_turns_it_off():
    assert parse_options(None, env={})[0].runs("accumulate_products")
    assert not parse_options(OFF, env={})[0].runs("accumulate_products")
    assert not parse_options(None, env={"INDUCTOR_EXT_PASSES_OFF": "accumulate_products"})[0].runs(
        "accumulate_products"
    )


def _operands(dtype: torch.dtype, widths=(3, 16, 5)) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    lhs = [torch.randn(6, k, generator=generator).to(dtype) for k in widths]
    rhs = [torch.randn(k, 7, generator=generator).to(dtype) for k in widths]
    return lhs, rhs


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.bfloat16, 2**-7)])
def test_op_sums_the_products(dtype, tolerance):
    lhs, rhs = _operands(dtype)
    reference = sum(a.double() @ b.double() for a, b in zip(lhs, rhs, strict=True))
    total = sum_of_products(lhs, rhs)
    assert total.dtype == dtype and total.shape == (6, 7)
    torch.testing.assert_close(total.double(), reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())
    torch.library.opcheck(torch.ops.fastops.sum_of_products.default, (lhs, rhs))


def test_op_compiles_in_one_graph():
    lhs, rhs = _operands(torch.float64)
    counters.clear()
    compiled = torch.compile(torch.ops.fastops.sum_of_products, fullgraph=True)
    torch.testing.assert_close(compiled(lhs, rhs), sum_of_products(lhs, rhs), rtol=1e-12, atol=1e-12)
    assert not counters["graph_break"]


@pytest.mark.parametrize(
    ("lhs", "rhs", "message"),
    [
        ([], [], "non-empty lists of one length"),
        ([torch.ones(2, 3)], [torch.ones(3, 4), torch.ones(3, 4)], "non-empty lists of one length"),
        ([torch.ones(2, 3), torch.ones(2, 5)], [torch.ones(3, 4), torch.ones(4, 4)], r"product 1 must be \(2, K\) @ \(K, 4\)"),
        ([torch.ones(2, 3), torch.ones(3, 3)], [torch.ones(3, 4), torch.ones(3, 4)], r"product 1 must be \(2, K\)"),
        ([torch.ones(3)], [torch.ones(3, 4)], r"product 0 must be"),
        ([torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)], [torch.ones(3, 4)] * 2, "every operand must be torch.float32"),
    ],
    ids=["empty", "lengths", "inner_width", "rows", "one_dimensional", "dtype"],
)  # fmt: skip
def test_op_names_what_is_wrong_with_its_operands(lhs, rhs, message):
    with pytest.raises(ValueError, match=message):
        sum_of_products(lhs, rhs)


def _compiled(fn, *args, options=None):
    """``fn(*args)`` compiled by the backend, the sums it rewrote, and the generated code."""
    counters.clear()
    out, code = run_and_get_code(torch.compile(fn, backend="fastops_inductor", fullgraph=True, options=options), *args)
    return out, counters["inductor_ext"]["sum_of_products"], "\n".join(code)


def _rows(*widths: int) -> list[torch.Tensor]:
    """``(6, w)`` left and ``(w, 7)`` right operands, float64, one pair per width."""
    generator = torch.Generator().manual_seed(1)
    return [t for w in widths for t in (torch.randn(6, w, generator=generator, dtype=torch.float64),
                                         torch.randn(w, 7, generator=generator, dtype=torch.float64))]  # fmt: skip


def _view(t: torch.Tensor) -> torch.Tensor:
    return t.view(2, 3, 7)  # a linear layer's output viewed back to (batch, tokens, features)


REWRITTEN = {
    "two": (lambda a, b, c, d: _view(a @ b) + _view(c @ d), (3, 4)),
    "three": (lambda a, b, c, d, e, f: _view(a @ b) + _view(c @ d) + _view(e @ f), (3, 4, 5)),
    "reshape": (lambda a, b, c, d: (a @ b).reshape(2, 3, 7) + (c @ d).reshape(2, 3, 7), (3, 4)),
    "nested": (lambda a, b, c, d, e, f: _view(a @ b) + (_view(c @ d) + _view(e @ f)), (3, 4, 5)),
    # the products' sum inside a sum with another term: the products' own add is rewritten
    "inside_a_larger_sum": (lambda a, b, c, d, e, f: (_view(a @ b) + _view(c @ d)) + _view(e @ f).exp(), (3, 4, 5)),
}  # fmt: skip


def _compiled_case(cases, case, options=None):
    """A case's function, its compiled output, sums rewritten and generated code, and its eager output."""
    fn, widths = cases[case]
    args = _rows(*widths)
    return (*_compiled(fn, *args, options=options), fn(*args))


@pytest.mark.parametrize("case", list(REWRITTEN))
def test_sums_of_products_become_one_call_with_the_same_value(case):
    out, rewritten, code, expected = _compiled_case(REWRITTEN, case)
    assert rewritten == 1
    assert code.count("torch.ops.fastops.sum_of_products.default(") == 1
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    _, off, off_code, _ = _compiled_case(REWRITTEN, case, options=OFF)
    assert off == 0 and "sum_of_products" not in off_code


def _product_read_twice(a, b, c, d):
    product = a @ b
    return _view(product) + _view(c @ d), product


LEFT = {
    "read_twice": (_product_read_twice, (3, 4)),
    "broadcast": (lambda a, b, c, d: _view(a @ b) + (c[:1] @ d).view(1, 1, 7), (3, 4)),
    "promotion": (lambda a, b, c, d: _view(a @ b) + _view(c.float() @ d.float()), (3, 4)),
    "scaled": (lambda a, b, c, d: _view(a @ b) + _view(c @ d) * 2, (3, 4)),
    "one_product": (lambda a, b, c, d: _view(a @ b) + _view(d[:1].expand(6, 7).exp()), (3, 4)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LEFT))
def test_other_sums_are_left_as_they_are(case):
    out, rewritten, code, expected = _compiled_case(LEFT, case)
    assert rewritten == 0 and "sum_of_products" not in code
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_cpp_wrapper_calls_the_op():
    out, rewritten, code, expected = _compiled_case(REWRITTEN, "three", options={"cpp_wrapper": True})
    assert rewritten == 1 and "sum_of_products" in code
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def _llama_step(options):
    """Loss, parameter gradients and the rewritten sums of a compiled training step of a float64 GQA Llama."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    counters.clear()
    loss = torch.compile(model, backend="fastops_inductor", options=options)(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), grads, counters["inductor_ext"]["sum_of_products"]


def test_llama_backward_sums_qkv_and_gate_up_input_gradients_in_the_gemms():
    """q/k/v's and gate/up's input gradients in each of 2 layers."""
    loss, grads, rewritten = _llama_step({})
    torch._dynamo.reset()
    loss_ref, grads_ref, rewritten_ref = _llama_step(OFF)
    assert (rewritten, rewritten_ref) == (4, 0)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=0)
    for grad, grad_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-10 * grad_ref.abs().max().item())
