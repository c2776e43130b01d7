"""Selective activation checkpointing for models patched by :func:`inductor_ext.models.apply`.

Under plain activation checkpointing (``gradient_checkpointing_enable``) each decoder layer's
forward runs twice: once without saving activations, once more in the backward. For a LoRA or
QLoRA model patched by :func:`~inductor_ext.models.apply`, the MLP is one fused op
(``fastops::lora_mlp_fwd``: gate, up and down projections with their adapters, and the activation),
so its recomputation repeats all three base GEMMs (and, over a 4-bit base, all three
dequantisations), although the backward needs only the gate and up projections' outputs.

:func:`keep_lora_mlp_outputs` is a ``context_fn`` for ``torch.utils.checkpoint`` that keeps that op's
outputs instead of recomputing it, and recomputes everything else, as plain checkpointing does::

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
        "use_reentrant": False, "context_fn": keep_lora_mlp_outputs()})

The trade: the gate and up projections' forward GEMMs run once instead of twice, for
``2 × tokens × intermediate`` saved elements per layer in the input's dtype (0.44 GiB per layer at
4 × 2048 tokens of the Llama-3.1-8B shape). Results are identical: the saved tensors are the ones
the recomputation would produce. Works eagerly and under ``torch.compile`` (any backend;
non-reentrant checkpointing only, as selective checkpointing requires).

Under ``torch.compile`` the policy marks every node of the traced op "save"; the backward op reads
what it recomputes (an NF4 base's dequantisation, the GLU's upcasts of ``G`` and ``U``, the dropped
input) through :func:`inductor_ext.ops._gradient_tie.tied_to_gradient`, so none of those forward
nodes is handed to the backward: ``G`` and ``U`` only.

Compiled on the H200 (torch 2.11) the backward holds each layer's MLP gradients until its end, so
the peak is well above ``G`` and ``U``'s share (docs/benchmarks.md has the measurement).
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import inductor_ext.ops.lora  # noqa: F401  (registers fastops::lora_mlp_fwd)


def _keep_lora_mlp_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save the fused LoRA MLP's outputs; recompute every other op."""
    if op is torch.ops.fastops.lora_mlp_fwd.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def keep_lora_mlp_outputs() -> Callable[[], Any]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (and for
    transformers' ``gradient_checkpointing_kwargs``) that saves the fused LoRA MLP op's outputs and
    recomputes the rest of the checkpointed region. A ``functools.partial``, as ``torch.compile``
    requires of a ``context_fn``."""
    return functools.partial(create_selective_checkpoint_contexts, _keep_lora_mlp_policy)
