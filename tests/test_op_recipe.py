"""The recipe of ``docs/contributing.md``, followed with a small op: ``y = x * scale``.

Each numbered step of the recipe that an op file can take is taken here, in the library's own
terms (a ``@triton.jit`` kernel, ``define_op_family``, ``sharding_rule``, a public function, a
reference, a rewrite in ``REWRITES``), so that a step the library no longer supports fails here.
The op is registered once per session under a name no other test uses, and the registries it
entered (families, decompositions, sharding rules) are restored after the module.
"""

import operator
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.fx import Node

from inductor_ext.library.launch import Launch

NAME = "recipe_test_scale"
"""A family name no op file uses."""

BLOCK = 64


# Step 1, kernels: y = x * scale, elementwise; the backward is the same kernel (dx = dy * scale).
@triton.jit
def _scale_kernel(X, Y, n, scale, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(X + offsets, mask=mask)
    tl.store(Y + offsets, x * tl.cast(scale, tl.float32), mask=mask)


# Step 3, the op family: math (the schema), kernels, autograd.
def scale_fwd_math(x: Tensor, scale: float) -> Tensor:
    return x * scale


def scale_bwd_math(dy: Tensor, scale: float) -> Tensor:
    return dy * scale


def _launch_scale(launch: Launch, x: Tensor, scale: float) -> Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    launch(_scale_kernel, lambda meta: (triton.cdiv(n, BLOCK),), x, y, n, scale, BLOCK=BLOCK)
    return y


def scale_fwd_kernels(launch: Launch, x: Tensor, scale: float) -> Tensor:
    return _launch_scale(launch, x, scale)


def scale_bwd_kernels(launch: Launch, dy: Tensor, scale: float) -> Tensor:
    return _launch_scale(launch, dy, scale)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.scale = inputs[1]


def _backward(ctx: Any, bwd: Any, dy: Tensor | None) -> tuple[Tensor | None, None]:
    return (None if dy is None else bwd(dy, ctx.scale)), None


def scale_ref(x: Tensor, scale: float) -> Tensor:
    """Step 5, the reference: plain differentiable PyTorch."""
    return x * scale


class Recipe:
    """What the recipe's steps produced: the family, the public function, the rewrite."""

    def __init__(self) -> None:
        from inductor_ext.library.registration import define_op_family
        from inductor_ext.library.sharding import Strategy, replicated, sharding_rule

        self.family = define_op_family(
            NAME,
            fwd_math=scale_fwd_math,
            fwd_kernels=scale_fwd_kernels,
            bwd_math=scale_bwd_math,
            bwd_kernels=scale_bwd_kernels,
            setup_context=_setup_context,
            backward=_backward,
        )

        # Step 4, the sharding rule: elementwise, so any shard of x gives the same shard of y.
        @sharding_rule(self.family.fwd, self.family.bwd)
        def _scale_sharding(x: Any, scale: float) -> list[Strategy]:
            from torch.distributed.tensor import Shard

            return [replicated(1, (x,)), ([Shard(0)], [Shard(0)])]

        self.sharding = _scale_sharding
        family = self.family

        # Step 5, the public function: validate, flatten to 2-D before the autograd boundary, restore.
        def scale(x: Tensor, scale: float) -> Tensor:
            if not isinstance(x, Tensor):
                raise TypeError(f"scale: x must be a Tensor, got {type(x).__name__}")
            if x.dim() == 0:
                raise ValueError("scale: x must have at least one dim")
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return family(rows, float(scale)).view(x.shape)

        self.scale = scale

        # Step 7, the rewrite: ``x * <float>`` on a float tensor becomes the op.
        def rewrite(node: Node) -> Node | None:
            from inductor_ext.inductor.graph_queries import MUL, binary_operands, value
            from inductor_ext.inductor.rewrites.registry import insert_rows_call

            operands = binary_operands(node, MUL, "mul")
            if operands is None or not isinstance(operands[0], Node) or not isinstance(operands[1], float):
                return None
            x, factor = operands
            xv = value(x)
            if not isinstance(xv, Tensor) or xv.dim() == 0 or xv.dtype != torch.float32:
                return None
            return insert_rows_call(node, family, [x], (factor,), x)

        self.rewrite = rewrite


@pytest.fixture(scope="module")
def recipe():
    from inductor_ext.library import registration, sharding

    registries = (registration.FAMILIES, registration.FAMILY_OF, registration.DECOMPOSITIONS, sharding.RULES)
    before = [dict(r) for r in registries]
    try:
        yield Recipe()
    finally:
        for registry, saved in zip(registries, before, strict=True):
            registry.clear()
            registry.update(saved)


def test_the_family_is_a_pair_of_registered_ops(recipe):
    from inductor_ext.library.registration import DECOMPOSITIONS, FAMILIES, FAMILY_OF
    from inductor_ext.library.sharding import RULES

    family = recipe.family
    assert family.fwd is getattr(torch.ops.fastops, f"{NAME}_fwd").default
    assert family.bwd is getattr(torch.ops.fastops, f"{NAME}_bwd").default
    assert str(family.fwd._schema) == f"fastops::{NAME}_fwd(Tensor x, float scale) -> Tensor"
    assert FAMILIES[family.fwd] is family
    assert FAMILY_OF[family.fwd._name] == FAMILY_OF[family.bwd._name] == NAME
    assert DECOMPOSITIONS[family.fwd] is scale_fwd_math and DECOMPOSITIONS[family.bwd] is scale_bwd_math
    assert RULES[family.fwd] is RULES[family.bwd] is recipe.sharding


def test_opcheck_passes_on_both_ops(recipe):
    x = torch.randn(5, 37, requires_grad=True)
    torch.library.opcheck(recipe.family.fwd, (x, 0.75))
    torch.library.opcheck(recipe.family.bwd, (torch.randn(5, 37), 0.75))


def test_forward_and_backward_match_the_float64_reference(recipe):
    x = torch.randn(3, 5, 37, requires_grad=True)
    dy = torch.randn(3, 5, 37)
    y = recipe.scale(x, 0.75)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    y64 = scale_ref(x64, 0.75)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_named(recipe):
    with pytest.raises(TypeError, match="x must be a Tensor"):
        recipe.scale([1.0], 2.0)
    with pytest.raises(ValueError, match="at least one dim"):
        recipe.scale(torch.tensor(1.0), 2.0)


def test_the_public_function_compiles_with_the_backend(recipe, fresh_dynamo):
    from torch._dynamo.utils import counters

    x = torch.randn(4, 37, requires_grad=True)
    compiled = torch.compile(recipe.scale, backend="fastops_inductor", fullgraph=True)
    y = compiled(x, 0.75)
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, scale_ref(x, 0.75))
    torch.testing.assert_close(dx, torch.full_like(x, 0.75))
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_the_rewrite_puts_the_op_into_a_plain_pytorch_spelling(recipe, fresh_dynamo, monkeypatch):
    from torch._dynamo.utils import counters

    from inductor_ext.inductor.rewrites import REWRITES

    monkeypatch.setitem(REWRITES, NAME, recipe.rewrite)
    x = torch.randn(2, 3, 37, requires_grad=True)
    compiled = torch.compile(lambda t: operator.mul(t, 0.75), backend="fastops_inductor", fullgraph=True)
    y = compiled(x)
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert counters["inductor_ext"][f"rewrite_{NAME}"] == 1
    torch.testing.assert_close(y, scale_ref(x, 0.75))
    torch.testing.assert_close(dx, torch.full_like(x, 0.75))
