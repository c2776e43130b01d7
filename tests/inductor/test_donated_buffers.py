"""The post-grad pass that makes our cross-entropy backward write its gradient over donated logits
(inductor_ext.inductor.donated_buffers), on backward graphs built as AOTAutograd hands them to
Inductor's post-grad passes (the kernel route's launches only appear there on a GPU)."""

import operator

import pytest
import torch
import triton
from torch._higher_order_ops.triton_kernel_wrap import (
    kernel_side_table,
    triton_kernel_wrapper_functional,
    triton_kernel_wrapper_mutation,
)
from torch.fx import Graph

from inductor_ext.inductor.donated_buffers import write_over_donated_inputs
from inductor_ext.kernels.cross_entropy import (
    _cross_entropy_bwd,
    cross_entropy_bwd_inplace_kernel,
    cross_entropy_bwd_kernel,
    cross_entropy_fwd_kernel,
)

aten = torch.ops.aten


def _backward_graph(*, read_after: bool = False, other_shape: bool = False, kernel=cross_entropy_bwd_kernel):
    """logits (saved), lse, labels, tangents -> the functional launch of the backward kernel -> dlogits."""
    graph = Graph()
    logits = graph.placeholder("mm")
    logits.meta["val"] = torch.empty(4, 8, dtype=torch.bfloat16)
    lse, labels, tangents = (graph.placeholder(n) for n in ("getitem_1", "primals_3", "tangents_1"))
    shape = [4, 9] if other_shape else [4, 8]
    empty = graph.call_function(aten.empty.memory_format, (shape,), {"dtype": torch.bfloat16})
    empty.meta["val"] = torch.empty(shape, dtype=torch.bfloat16)
    launch = graph.call_function(
        triton_kernel_wrapper_functional,
        kwargs={
            "kernel_idx": kernel_side_table.add_kernel(kernel),
            "constant_args_idx": kernel_side_table.add_constant_args({"V": 8}),
            "grid": [(4, 1, 1)],
            "tma_descriptor_metadata": {},
            "kwargs": {"LOGITS": logits, "DLOGITS": empty, "LSE": lse, "LABELS": labels, "GRAD_SCALE": tangents},
            "tensors_to_clone": ["DLOGITS"],
        },
    )
    dlogits = graph.call_function(operator.getitem, (launch, "DLOGITS"))
    outputs = [dlogits]
    if read_after:
        outputs.append(graph.call_function(aten.sum.default, (logits,)))
    graph.output(tuple(outputs))
    return graph, logits


@pytest.mark.parametrize(
    "traced",
    [
        cross_entropy_bwd_kernel,
        triton.autotune(configs=cross_entropy_bwd_kernel.configs[:2], key=[])(_cross_entropy_bwd),
    ],
)
def test_gradient_is_written_over_donated_logits(traced):
    """The base autotuner, or one as an op body traces it (``ops._library.pruned_autotuner``: configs narrowed)."""
    graph, logits = _backward_graph(kernel=traced)

    assert write_over_donated_inputs(graph, [0]) == 1

    (launch,) = graph.find_nodes(op="call_function", target=triton_kernel_wrapper_mutation)
    kernel = kernel_side_table.get_kernel(launch.kwargs["kernel_idx"])
    assert kernel.fn is cross_entropy_bwd_kernel.fn and kernel.restore_value == ["DLOGITS"]
    assert [c.all_kwargs() for c in kernel.configs] == [c.all_kwargs() for c in traced.configs]
    assert launch.kwargs["kwargs"]["DLOGITS"] is logits and launch.kwargs["kwargs"]["LOGITS"] is logits
    assert not graph.find_nodes(op="call_function", target=triton_kernel_wrapper_functional)
    assert not graph.find_nodes(op="call_function", target=aten.empty.memory_format)
    assert graph.output_node().args[0] == (logits,)
    graph.lint()


@pytest.mark.parametrize(
    ("build", "donated"),
    [
        ({}, []),  # nothing donated (e.g. retain_graph, or the logits are also an output)
        ({}, None),  # outside a compile
        ({"read_after": True}, [0]),  # the logits are read after the backward kernel
        ({"other_shape": True}, [0]),  # the output buffer is not the logits' layout
        ({"kernel": cross_entropy_bwd_inplace_kernel}, [0]),  # already in place
        ({"kernel": cross_entropy_fwd_kernel}, [0]),  # a kernel with no in-place form
    ],
)
def test_launch_left_alone(build, donated):
    graph, _ = _backward_graph(**build)
    before = str(graph)
    assert write_over_donated_inputs(graph, donated) == 0
    assert str(graph) == before


def test_forward_graph_left_alone():
    """Donated indices number the backward's inputs: a graph with no tangents is not rewritten."""
    graph, _ = _backward_graph()
    tangents = next(n for n in graph.nodes if n.name == "tangents_1")
    tangents.name = tangents.target = "primals_9"
    assert write_over_donated_inputs(graph, [0]) == 0
