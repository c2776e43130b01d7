"""Norm outputs recomputed in the backward instead of saved (``fastops.recompute_norms``).

In a decoder layer the normalised hidden state ``y = norm(x)`` feeds matrix products (the q/k/v
projections, the gate/up projections, the LM head), whose weight gradients need ``y`` in the
backward. AOTAutograd's partitioner saves ``y`` for them: it never recomputes a value that a matmul
reads in the backward (the recompute would not fuse into it), nor an opaque op such as our norm's
kernel. Yet the norm's own backward saves its input ``x`` anyway, and ``y`` is one pass over ``x``:
recomputing it costs one norm-forward kernel in the backward and saves ``N H`` elements per norm.

This pass marks each RMSNorm and LayerNorm forward call whose output reaches a matrix product
``MUST_RECOMPUTE`` in the Dynamo graph, the checkpoint policy that ``torch.utils.checkpoint``'s
selective checkpointing sets; AOTAutograd copies it onto every node it traces from that call (on our
kernel route the Triton kernel's node, on the Inductor route the aten math) and the partitioner then
recomputes those nodes in the backward, placed just before their first use (it reorders the backward
as autograd's engine runs it), so one norm output at a time is alive there.

Each recomputed norm saves ``N H`` elements (32 MiB at ``N = 8192`` tokens, ``H = 2048``, bf16) for one
norm-forward kernel in the backward, which reads ``x`` and writes ``y``. In an HF decoder most norms follow
a residual add and become ``add_rms_norm`` (below), so there only the first layer's input norm is plain.

Not marked: ``add_rms_norm`` (the residual add fused into the norm), whose recompute would need both
summands and would recompute the residual stream's chain from the first layer at the start of the
backward; and norms whose output reaches no matrix product (Qwen3's per-head q/k norms feed RoPE,
whose backward does not read them), where a recompute would only add a kernel.
"""

import operator
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch._ops import OpOverload
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from inductor_ext.inductor.graph_queries import is_call, value
from inductor_ext.ops.layer_norm import layer_norm_family
from inductor_ext.ops.lora import lora_linear_family, lora_mlp_family, lora_qkv_family
from inductor_ext.ops.rms_norm import rms_norm_family

NORM_FORWARDS = (rms_norm_family.fwd, layer_norm_family.fwd)
"""Norm forward ops whose first output (the normalised tensor) may be recomputed; their backward saves their input."""

MATMUL_FUNCTIONS = (
    torch._C._nn.linear, F.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
    lora_linear_family.fwd, lora_qkv_family.fwd, lora_mlp_family.fwd,
)  # fmt: skip
"""Consumers whose backward reads their input (a weight's gradient): matrix products and our fused LoRA ops."""
MATMUL_METHODS = ("matmul", "mm", "bmm", "__matmul__")

SAME_VALUE_FUNCTIONS = (torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze, torch.transpose,
                        torch.permute, torch.t)  # fmt: skip
SAME_VALUE_METHODS = ("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze",
                      "transpose", "permute", "t", "contiguous")  # fmt: skip
"""Calls that pass an output on as the same values (a view or a layout)."""
CAST_METHODS = ("to", "type", "type_as", "float", "bfloat16", "half")
"""Casts: the same values when they keep the dtype; a cast to another dtype is a new tensor, which a matrix
product after it saves in the norm output's place (marking the norm would then only add a kernel)."""


def mark_recompute(gm: GraphModule, forwards: tuple[OpOverload, ...]) -> int:
    """Mark the calls of ``forwards`` in ``gm`` (a Dynamo graph) whose (first) output reaches a matrix
    product ``MUST_RECOMPUTE``; returns how many were marked."""
    marked = 0
    for node in gm.graph.nodes:
        if is_call(node, forwards) and any(
            is_call(user, MATMUL_FUNCTIONS, MATMUL_METHODS) for user in _consumers(node)
        ):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            marked += 1
    return marked


def _consumers(call: Node) -> Iterator[Node]:
    """The calls that read the op's (first) output, looking through views and casts of it."""
    assert isinstance(call.target, OpOverload)
    if len(call.target._schema.returns) == 1:
        pending = [call]
    else:
        pending = [user for user in call.users if is_call(user, (operator.getitem,)) and user.args[1] == 0]
    while pending:
        node = pending.pop()
        for user in node.users:
            if (
                user.args
                and user.args[0] is node
                and (is_call(user, SAME_VALUE_FUNCTIONS, SAME_VALUE_METHODS) or _keeps_dtype(user, node))
            ):
                pending.append(user)
            else:
                yield user


def _keeps_dtype(cast: Node, source: Node) -> bool:
    """Whether ``cast`` is one of :data:`CAST_METHODS` returning ``source``'s dtype (a no-op cast)."""
    before, after = value(source), value(cast)
    return (
        is_call(cast, (), CAST_METHODS)
        and isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.dtype == after.dtype
    )
