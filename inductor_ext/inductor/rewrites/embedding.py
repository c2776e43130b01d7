"""Rewrite of ``F.embedding`` (HF's ``nn.Embedding``) into the embedding op, whose backward route is aten's
sort-based kernel or Inductor's decomposition, chosen by route timing (:mod:`inductor_ext.ops.embedding`)."""

import inspect

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from inductor_ext.inductor.graph_queries import is_call, value, with_value
from inductor_ext.inductor.rewrites.registry import SUPPORTED_FLOATS
from inductor_ext.ops.embedding import embedding_family

_PARAMETERS = list(inspect.signature(F.embedding).parameters)


def embedding(node: Node) -> Node | None:
    """``F.embedding(ids, weight, padding_idx)`` with a trainable 2-D weight, no ``max_norm``, no
    ``scale_grad_by_freq``, dense gradients, int64 ids (a frozen weight has no backward to speed up)."""
    if not is_call(node, (F.embedding,)) or len(node.args) > len(_PARAMETERS):
        return None
    bound = {**dict(zip(_PARAMETERS, node.args)), **node.kwargs}
    if set(bound) - set(_PARAMETERS) or bound.get("max_norm") is not None:
        return None
    if bound.get("scale_grad_by_freq", False) or bound.get("sparse", False):
        return None
    ids, weight, padding_idx = bound.get("input"), bound.get("weight"), bound.get("padding_idx")
    iv, wv = value(ids), value(weight)
    if not isinstance(ids, Node) or not isinstance(iv, torch.Tensor) or not isinstance(wv, torch.Tensor):
        return None
    if iv.dtype != torch.int64 or wv.dim() != 2 or wv.dtype not in SUPPORTED_FLOATS or not wv.requires_grad:
        return None
    if padding_idx is not None and not isinstance(padding_idx, int):
        return None
    rows = wv.shape[0]
    index = -1 if padding_idx is None else padding_idx % rows
    graph: Graph = node.graph
    with graph.inserting_before(node):
        return with_value(graph.call_function(embedding_family.fwd, (weight, ids, index)))
