"""The peak-memory fix in inductor_ext/_compat/torch_fixes.py: Inductor's model of when a graph input is
freed counts the reads of the input after a kernel mutated it (our backward kernels write gradients over
donated inputs, and the readers of those gradients read the mutation's renamed buffer)."""

from torch._inductor import memory
from torch._inductor.dependencies import StarDep, WeakDep
from torch._inductor.virtualized import V

from inductor_ext import _compat
from inductor_ext._compat import torch_fixes


class _Node:
    """A scheduler node as ``get_freeable_input_buf`` reads it: its ``read_writes.reads``."""

    def __init__(self, *reads):
        self.read_writes = type("ReadWrites", (), {"reads": list(reads)})()


class _Graph:
    """``V.graph`` as the function reads it: the donated ``mm_3`` was mutated into ``buf2``."""

    name = None
    scheduler = type("Scheduler", (), {"mutation_real_name": {"buf2": "mm_3"}})()

    def get_dep_size_hint(self, dep):
        return 1024


def _successors(fn):
    glu_backward = _Node(StarDep("mm_3"), StarDep("tangents_1"))  # writes dgate over mm_3
    dgate_reader = _Node(StarDep("buf2"))  # an adapter-gradient GEMM reading dgate
    ordering_only = _Node(WeakDep("buf2", mutating_buf="buf5", is_fake=True))
    with V.set_graph_handler(_Graph()):
        (buffer,) = fn([glu_backward, dgate_reader, ordering_only], {"mm_3", "tangents_1"}).values()
    info = buffer.mpi_buffer
    names = {glu_backward: "glu_backward", dgate_reader: "dgate_reader", ordering_only: "ordering_only"}
    return {names[n] for n in info.succ_nodes}, {names[n] for n in info.succ_nodes_for_ordering}


def test_a_mutated_input_lives_until_the_last_read_of_its_mutation():
    assert _successors(memory.get_freeable_input_buf) == ({"glu_backward"}, {"glu_backward"})  # torch's
    with _compat.applied(torch_fixes.PATCHES):
        lifetime, ordering = _successors(memory.get_freeable_input_buf)
    assert lifetime == {"glu_backward", "dgate_reader"}
    assert ordering == {"glu_backward", "dgate_reader", "ordering_only"}
    assert _successors(memory.get_freeable_input_buf) == ({"glu_backward"}, {"glu_backward"})
