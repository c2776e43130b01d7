"""Selective activation checkpointing for models patched by :func:`inductor_ext.models.apply`.

Under plain activation checkpointing (``gradient_checkpointing_enable``) each decoder layer's
forward runs twice: once without saving activations, once more in the backward. For a LoRA or
QLoRA model patched by :func:`~inductor_ext.models.apply`, the MLP is one fused op
(``fastops::lora_mlp_fwd``: gate, up and down projections with their adapters, and the activation)
and each attention projection another (``fastops::lora_linear_fwd``), so the recomputation repeats
their base GEMMs (and, over a 4-bit base, the dequantisations), although the backward needs only
some of their outputs.

:func:`keep_lora_outputs` is a ``context_fn`` for ``torch.utils.checkpoint`` that keeps the fused
LoRA ops' outputs instead of recomputing them, and recomputes everything else, as plain
checkpointing does; :func:`keep_lora_mlp_outputs` keeps the MLP's alone::

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": keep_lora_outputs()})

The trade, per layer at ``tokens`` tokens: the MLP keeps ``G`` and ``U``, ``2 × tokens ×
intermediate`` elements in the input's dtype (0.44 GiB at 4 × 2048 tokens of the Llama-3.1-8B
shape), for the gate and up GEMMs run once instead of twice; the attention projections keep ``q``,
``k`` and ``v``, ``tokens × (q_size + 2 kv_size)`` elements (0.09 GiB there), for the three GEMMs run
once (the attention itself is recomputed from them). Compiled, only what the backward reads is kept
(not the output projection's output, nor the MLP's); eagerly, selective checkpointing keeps every
output of a kept op (those too: 0.12 GiB more per layer there; the MLP's with
:func:`keep_lora_mlp_outputs` as well). Results are identical: the saved
tensors are the ones the recomputation would produce. Works eagerly and under ``torch.compile``
(any backend; non-reentrant checkpointing only, as selective checkpointing requires).

Under ``torch.compile`` the policy marks every node of a traced kept op "save"; the backward ops read
what they recompute (an NF4 base's dequantisation, the GLU's upcasts of ``G`` and ``U``, the dropped
input) through :func:`inductor_ext.ops._gradient_tie.tied_to_gradient`, so none of those forward
nodes is handed to the backward: the ops' outputs only.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import inductor_ext.ops.lora  # noqa: F401  (registers the fastops::lora_* ops)


def _keep_policy(kept: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save the outputs of the ops in ``kept``; recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE


def keep_lora_outputs() -> Callable[[], Any]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (and for
    transformers' ``gradient_checkpointing_kwargs``) that saves the outputs of the fused LoRA ops
    (``fastops::lora_linear_fwd``, ``lora_qkv_fwd``, ``lora_mlp_fwd``) and recomputes the rest of the
    checkpointed region. A ``functools.partial``, as ``torch.compile`` requires of a ``context_fn``."""
    ops = torch.ops.fastops
    return _keeping(ops.lora_linear_fwd.default, ops.lora_qkv_fwd.default, ops.lora_mlp_fwd.default)


def keep_lora_mlp_outputs() -> Callable[[], Any]:
    """:func:`keep_lora_outputs` for the fused LoRA MLP op alone."""
    return _keeping(torch.ops.fastops.lora_mlp_fwd.default)


def _keeping(*kept: Any) -> Callable[[], Any]:
    return functools.partial(create_selective_checkpoint_contexts, functools.partial(_keep_policy, frozenset(kept)))
