"""models.keep_lora_mlp_outputs and models.keep_lora_outputs (selective activation checkpointing) on a
patched PEFT LoRA model (CPU): the fused MLP's (and QKV's) forward runs once per layer instead of twice,
the backward graph under torch.compile recomputes fewer GEMMs, and the loss and adapter gradients are
plain checkpointing's."""

import copy

import pytest
import torch
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import inductor_ext.ops.lora as lora_ops
from inductor_ext import models
from inductor_ext.bench.train import enable_checkpointing
from tests.models.test_patch import _batches
from tests.models.test_peft_lora import LAYERS, _adapter_grads, lora_model

pytest.importorskip("peft")


POLICIES = {"keep_lora_mlp_outputs": models.keep_lora_mlp_outputs, "keep_lora_outputs": models.keep_lora_outputs}
KEPT_FORWARD_MMS = {"keep_lora_mlp_outputs": 5, "keep_lora_outputs": 10}
"""At least so many fewer mm per layer in the compiled backward: the gate and up projections' base GEMMs
and A products (and the B products, traced as aten.mm on CPU), and then the query, key and value ones."""


@pytest.fixture
def patched_pair():
    """Two copies of a patched tiny LoRA Llama: plain checkpointing, and keeping the MLP's outputs;
    unpatched afterwards."""
    yield from _patched_pair("keep_lora_mlp_outputs")


@pytest.fixture(params=list(POLICIES))
def policy_and_pair(request):
    pairs = _patched_pair(request.param)
    yield request.param, *next(pairs)
    next(pairs, None)  # unpatches


def _patched_pair(policy: str):
    plain = lora_model("llama")
    kept = copy.deepcopy(plain)
    for model, context_fn in ((plain, None), (kept, POLICIES[policy]())):
        models.apply(model)
        enable_checkpointing(model, context_fn)
        model.train()
    yield plain, kept
    for model in (plain, kept):
        models.unapply(model)


def _assert_same_step(plain: torch.nn.Module, kept: torch.nn.Module, plain_loss, kept_loss) -> None:
    """Equal up to float32 rounding: under selective checkpointing's dispatch modes the patched ops run
    their aten math on CPU, without them (plain eager) their kernels under the Triton interpreter."""
    torch.testing.assert_close(kept_loss, plain_loss, rtol=1e-6, atol=1e-6)
    expected = _adapter_grads(plain)
    assert list(_adapter_grads(kept)) == list(expected)
    for name, grad in _adapter_grads(kept).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_eager_runs_the_mlp_forward_once_per_layer(patched_pair, monkeypatch):
    calls = []
    mlp_fwd = lora_ops._mlp_fwd
    monkeypatch.setattr(lora_ops, "_mlp_fwd", lambda *args: calls.append(1) or mlp_fwd(*args))
    plain, kept = patched_pair
    ids = _batches(1)[0]
    losses, counts = [], []
    for model in (plain, kept):
        calls.clear()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
        counts.append(len(calls))
    assert counts == [2 * LAYERS, LAYERS]
    _assert_same_step(plain, kept, *losses)


def test_compiled_backward_recomputes_no_kept_gemm(policy_and_pair):
    """On CPU the ops are traced through into aten (their decomposition): the partitioner then keeps
    the kept ops' outputs (the gate and up projections': base GEMM, A and B products, 6 mm per layer;
    and the query, key and value projections') instead of recomputing them, and the backward graph has that
    many fewer mm."""
    backward_mms = []

    def count_backward_mms(gm: torch.fx.GraphModule, _inputs) -> torch.fx.GraphModule:
        backward_mms.append(sum(node.target is torch.ops.aten.mm.default for node in gm.graph.nodes))
        return gm

    backend = aot_autograd(
        fw_compiler=lambda gm, _: gm, bw_compiler=count_backward_mms, partition_fn=min_cut_rematerialization_partition
    )
    ids = _batches(1)[0]
    losses = []
    policy, plain, kept = policy_and_pair
    for model in (plain, kept):
        torch._dynamo.reset()
        loss = torch.compile(model, backend=backend, fullgraph=True)(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    plain_mms, kept_mms = backward_mms
    assert plain_mms - kept_mms >= KEPT_FORWARD_MMS[policy] * LAYERS, backward_mms
    _assert_same_step(plain, kept, *losses)
