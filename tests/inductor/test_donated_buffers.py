"""The post-grad pass that makes our cross-entropy backward write its gradient over donated logits,
our SwiGLU/GeGLU backward its gradients over donated gate and up, and the fused linear
cross-entropy backward's scaling its result over the donated gradients it scales
(inductor_ext.inductor.donated_buffers), on backward graphs built as AOTAutograd hands them to
Inductor's post-grad passes (the kernel route's launches only appear there on a GPU)."""

import operator

import pytest
import torch
import triton
from torch._dynamo.utils import counters
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
    scale_rows_kernel,
)
from inductor_ext.kernels.glu import glu_bwd_kernel

aten = torch.ops.aten


def _empty(graph: Graph, shape: list[int]):
    """A fresh bf16 buffer, as an op body's allocation traces."""
    node = graph.call_function(aten.empty.memory_format, (shape,), {"dtype": torch.bfloat16})
    node.meta["val"] = torch.empty(shape, dtype=torch.bfloat16)
    return node


def _functional_launch(graph: Graph, kernel, constants: dict, grid: tuple, kwargs: dict, writes: list[str]):
    """The functional launch of ``kernel`` that writes (and so clones) ``writes``, as AOTAutograd traces it."""
    return graph.call_function(
        triton_kernel_wrapper_functional,
        kwargs={
            "kernel_idx": kernel_side_table.add_kernel(kernel),
            "constant_args_idx": kernel_side_table.add_constant_args(constants),
            "grid": [grid],
            "tma_descriptor_metadata": {},
            "kwargs": kwargs,
            "tensors_to_clone": writes,
        },
    )


def _backward_graph(*, read_after: bool = False, other_shape: bool = False, kernel=cross_entropy_bwd_kernel):
    """logits (saved), lse, labels, tangents -> the functional launch of the backward kernel -> dlogits."""
    graph = Graph()
    logits = graph.placeholder("mm")
    logits.meta["val"] = torch.empty(4, 8, dtype=torch.bfloat16)
    lse, labels, tangents = (graph.placeholder(n) for n in ("getitem_1", "primals_3", "tangents_1"))
    shape = [4, 9] if other_shape else [4, 8]
    empty = _empty(graph, shape)
    arguments = {"LOGITS": logits, "DLOGITS": empty, "LSE": lse, "LABELS": labels, "GRAD_SCALE": tangents}
    launch = _functional_launch(graph, kernel, {"V": 8}, (4, 1, 1), arguments, ["DLOGITS"])
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
    """The base autotuner, or one as an op body traces it (``library.launch.pruned_autotuner``: configs narrowed)."""
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


def _glu_backward_graph(
    *, packed: bool = False, read_up_after: bool = False, same_gate_and_up: bool = False, viewed: bool = False
):
    """gate, up (saved), dy, tangents -> the functional launch of the GLU backward kernel -> dgate, dup.

    ``viewed``: the saved tensors are ``(2, 2, I)`` and the kernel reads ``(4, I)`` views of them (the op
    flattens its inputs to rows); ``read_up_after`` then reads ``up`` through another view of it."""
    graph = Graph()
    gate = graph.placeholder("mm_1")
    up = gate if same_gate_and_up else graph.placeholder("mm_2")
    dy, _ = graph.placeholder("mm_3"), graph.placeholder("tangents_1")
    shape = [4, 16] if packed else [4, 8]
    for node in {gate, up}:
        node.meta["val"] = torch.empty([2, 2, shape[1]] if viewed else shape, dtype=torch.bfloat16)
    rows = {}
    for node in {gate, up}:
        rows[node] = node
        if viewed:
            rows[node] = graph.call_function(aten.view.default, (node, shape))
            rows[node].meta["val"] = torch.empty(shape, dtype=torch.bfloat16)
    empties = {name: _empty(graph, shape) for name in (("DGATE",) if packed else ("DGATE", "DUP"))}
    arguments = {"DY": dy, "GATE": rows[gate], "UP": None if packed else rows[up], "DUP": None, **empties}
    launch = _functional_launch(graph, glu_bwd_kernel, {"n_rows": 4, "n_cols": 8}, (4, 1, 1), arguments, list(empties))
    outputs = [graph.call_function(operator.getitem, (launch, name)) for name in empties]
    if read_up_after:
        flat = graph.call_function(aten.view.default, (up, [-1])) if viewed else up
        outputs.append(graph.call_function(aten.sum.default, (flat,)))
    graph.output(tuple(outputs))
    return graph, rows[gate], rows[up]


def _mutating_launch(graph: Graph):
    (launch,) = graph.find_nodes(op="call_function", target=triton_kernel_wrapper_mutation)
    assert not graph.find_nodes(op="call_function", target=triton_kernel_wrapper_functional)
    return launch, kernel_side_table.get_kernel(launch.kwargs["kernel_idx"])


@pytest.mark.parametrize("viewed", [False, True])
def test_glu_gradients_are_written_over_donated_gate_and_up(viewed):
    graph, gate, up = _glu_backward_graph(viewed=viewed)

    counters.clear()
    assert write_over_donated_inputs(graph, [0, 1]) == 2

    assert dict(counters["inductor_ext"]) == {
        "in_place_over_donated:glu_bwd_kernel.DGATE": 1,
        "in_place_over_donated:glu_bwd_kernel.DUP": 1,
    }
    launch, kernel = _mutating_launch(graph)
    assert kernel.fn is glu_bwd_kernel.fn and kernel.restore_value == ["DGATE", "DUP"]
    arguments = launch.kwargs["kwargs"]
    assert arguments["DGATE"] is gate and arguments["DUP"] is up
    assert not graph.find_nodes(op="call_function", target=aten.empty.memory_format)
    assert graph.output_node().args[0] == (gate, up)
    graph.lint()


@pytest.mark.parametrize("viewed", [False, True])
def test_glu_up_read_after_keeps_its_own_gradient_buffer(viewed):
    """Only the pair whose input is dead after the launch is written in place; the other output is
    written straight into its fresh buffer."""
    graph, gate, _ = _glu_backward_graph(read_up_after=True, viewed=viewed)

    assert write_over_donated_inputs(graph, [0, 1]) == 1

    launch, kernel = _mutating_launch(graph)
    assert kernel.restore_value == ["DGATE"]
    (dup,) = graph.find_nodes(op="call_function", target=aten.empty.memory_format)
    assert launch.kwargs["kwargs"]["DGATE"] is gate and launch.kwargs["kwargs"]["DUP"] is dup
    assert graph.output_node().args[0][:2] == (gate, dup)
    graph.lint()


def test_packed_glu_gradient_is_written_over_donated_gate_up():
    graph, gate_up, _ = _glu_backward_graph(packed=True)

    assert write_over_donated_inputs(graph, [0]) == 1

    launch, _ = _mutating_launch(graph)
    assert launch.kwargs["kwargs"]["DGATE"] is gate_up
    assert graph.output_node().args[0] == (gate_up,)


def test_glu_input_passed_twice_is_left_alone():
    """gate and up the same tensor: writing both gradients over it would corrupt one of them."""
    graph, _, _ = _glu_backward_graph(same_gate_and_up=True)
    before = str(graph)
    assert write_over_donated_inputs(graph, [0]) == 0
    assert str(graph) == before


def _scale_graph(*, donated_is_output: bool = False):
    """As the fused linear cross-entropy backward traces its scaling of the saved ``dweight``: the kernel
    reads ``X`` and writes ``OUT`` through ``(1, -1)`` views of the saved tensor and of a fresh buffer,
    and the result is read through views of the launch's ``OUT``."""
    graph = Graph()
    saved = graph.placeholder("getitem_61")
    grad_output = graph.placeholder("tangents_1")
    saved.meta["val"] = torch.empty(10, 8, dtype=torch.bfloat16)

    def viewed(node, *shapes):
        for shape in shapes:
            node = graph.call_function(aten.view.default, (node, shape))
            node.meta["val"] = torch.empty(shape if -1 not in shape else [1, 80], dtype=torch.bfloat16)
        return node

    x = viewed(saved, [1, -1], [1, -1])
    out = viewed(_empty(graph, [10, 8]), [1, -1], [1, -1])
    arguments = {"X": x, "OUT": out, "SCALE": grad_output}
    launch = _functional_launch(graph, scale_rows_kernel, {"V": 80, "BLOCK_V": 128}, (1, 1, 1), arguments, ["OUT"])
    scaled = viewed(graph.call_function(operator.getitem, (launch, "OUT")), [1, 80], [10, 8])
    graph.output((scaled, saved) if donated_is_output else (scaled,))
    return graph, x, launch.kwargs["kernel_idx"]


def test_scaled_gradient_is_written_over_the_donated_one_through_views():
    graph, x, kernel_idx = _scale_graph()

    assert write_over_donated_inputs(graph, [0]) == 1

    launch, kernel = _mutating_launch(graph)
    assert kernel is scale_rows_kernel and launch.kwargs["kernel_idx"] == kernel_idx  # no timing: no restore
    assert launch.kwargs["kwargs"]["OUT"] is x and launch.kwargs["kwargs"]["X"] is x
    assert not graph.find_nodes(op="call_function", target=aten.empty.memory_format)
    (scaled,) = graph.output_node().args[0]
    assert scaled.args[0].args[0] is x  # the result's views now view the donated gradient
    graph.lint()


def test_scaling_left_alone_when_the_saved_gradient_is_read_after():
    graph, _, _ = _scale_graph(donated_is_output=True)
    before = str(graph)
    assert write_over_donated_inputs(graph, [0]) == 0
    assert str(graph) == before
