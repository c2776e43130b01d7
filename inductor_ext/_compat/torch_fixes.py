"""Workarounds for PyTorch bugs that the backend's defaults run into (:data:`PATCHES`); each names the
bug and the versions it was seen in, and is installed only while our compiles run
(:func:`inductor_ext._compat.applied`).

**Multi-kernels loaded from the FX-graph cache crash** (torch 2.11 on CUDA; the same code in
2.13). With the static Triton launcher (Inductor's default on CUDA), the kernels of a cached
graph come back through ``codecache.StaticAutotunerFuture``, pickled with their
``JITFunction._hash_lock`` set to None (``CachingAutotuner.prepare_for_pickle``), and its
``result()`` never restores it (``restore_after_unpickle``, which the compile-worker path
calls). A multi-kernel then reads its sub-kernels' ``fn.cache_key`` to find its cached pick,
``with self._hash_lock:`` raises ``TypeError: 'NoneType' object does not support the context
manager protocol``, and the second process that compiles the same graph under
``fastops_inductor`` (multi-kernel on by default) fails. The fix gives such kernels a fresh lock.

**A lazily compiled backward loses the cpp_wrapper config** (torch 2.11 on CUDA: an HF Llama
training step under ``torch.compile(..., options={"cpp_wrapper": True})`` failed with
``CudaKernelParamCache not populated for <the backward's first kernel>``, stock Inductor and
``fastops_inductor`` alike; fixed upstream in ``compile_fx_inner`` by
https://github.com/pytorch/pytorch/pull/178847, reported as pytorch/pytorch#178845; torch 2.13
has the fix).
``compile_fx`` applies ``get_cpp_wrapper_config()`` (``triton.store_cubin=True``, compile-time
autotuning) only while it runs, but AOTAutograd compiles the backward at the first
``.backward()``, after it returned. The backward's ``inner_compile`` still carries
``cpp_wrapper=True`` and re-enters ``options``, and ``compile_fx_backward`` re-applies the
cpp-wrapper config only when the *process-wide* ``config.cpp_wrapper`` is set, which it is not
when cpp_wrapper came in through ``options``. So the backward is generated as C++ with
``store_cubin=False``: its kernels run in the compile-time autotune block but never save their
cubin and launch parameters to ``CudaKernelParamCache`` (``CachingAutotuner.run`` saves only
when ``launcher.store_cubin``), and the C++ codegen of the first kernel asserts. Where torch's
``compile_fx_inner`` does not re-apply the config itself, the fix re-applies it around
``_compile_fx_inner`` for a ``cpp_wrapper`` graph compiled outside ``compile_fx``'s patch.

**The min-cut partitioner counts an opaque custom op's mutated output as fusible** (seen with
torch 2.13's ``torch/_functorch/partitioners.py``). Saving a tensor for the backward is weighted
twice its size when all its users are fusible ops, on the premise that its producer would
otherwise fuse into them and never be written. The partitioner already excepts the outputs of
user Triton kernels (``triton_kernel_wrapper_functional``), but not those of
``auto_functionalized`` / ``auto_functionalized_v2``, i.e. of a functionalized custom op that
mutates its inputs, which Inductor runs as an extern kernel: the result is written whatever the
partition. For the fused linear cross-entropy in ``weight_grad_accumulation="weight_dtype"``
mode this moved the last chunk's ``accumulate_matmul_`` into the backward: the final
``dweight``, whose only user is the backward's scaling, weighed ``2 V H``, against ``V H + C V +
C H`` for the partial ``dweight``, the last chunk's ``(V, C)`` logit gradient and its hidden
rows. So the forward kept that chunk's logit gradient alive until the backward, and the backward
copied the partial ``dweight`` before accumulating into it. The fix makes ``OpTypes.is_fusible``
false for the outputs of those two higher-order ops, as the partitioner's own rule for Triton
kernels does.

**Inductor's peak-memory reordering frees a mutated graph input at its mutation** (torch 2.11 on
CUDA; the same code in 2.13). ``reorder_for_peak_memory`` models each graph input as freed after
its last reader (``memory.get_freeable_input_buf``), but after a kernel mutates the input the
scheduler renames later reads to the mutation's output buffer, a rename that allocates and frees
nothing, and those reads are not traced back to the input (for a mutated *scheduler* buffer they are:
``mutation_real_name``, pytorch/pytorch#159569). Our backward kernels write their gradients over
donated inputs (:mod:`inductor_ext.inductor.donated_buffers`), so the model sees no memory freed by
the readers of those gradients and the least-peak-memory order runs them last: in a QLoRA backward
under ``keep_lora_mlp_outputs`` the adapter-gradient GEMMs that read ``dgate``, ``dup`` and ``h`` move
to the end of the graph, every layer's ``dgate``, ``dup`` and ``h`` stay allocated at once, and the
backward's peak ends far above its peak with the reordering off. The fix adds the readers of the
input's mutations to its successors.
"""

import functools
import inspect
import operator
import threading
from collections.abc import Callable
from typing import Any

import torch

from inductor_ext._compat import Patch


def _with_hash_lock(result: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(result)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        kernel = result(self, *args, **kwargs)
        fn = getattr(kernel, "fn", None)
        if fn is not None and getattr(fn, "_hash_lock", None) is None:
            fn._hash_lock = threading.RLock()
        return kernel

    return wrapped


@functools.cache
def compile_fx_inner_applies_cpp_wrapper_config() -> bool:
    """Whether torch's ``compile_fx_inner`` applies ``get_cpp_wrapper_config()`` itself (the
    upstream fix, in torch 2.13; not in 2.11). Read once: every compile asks."""
    from torch._inductor import compile_fx

    try:
        return "get_cpp_wrapper_config" in inspect.getsource(compile_fx.compile_fx_inner)
    except (OSError, TypeError):  # no source: the wrapper is harmless where torch has the fix
        return False


def _with_cpp_wrapper_config(compile_graph: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(compile_graph)
    def wrapped(*args: Any, **graph_kwargs: Any) -> Any:
        from torch._inductor import compile_fx, config

        # store_cubin is set inside compile_fx's own cpp-wrapper patch: the forward needs nothing
        if not graph_kwargs.get("cpp_wrapper", False) or config.triton.store_cubin:
            return compile_graph(*args, **graph_kwargs)
        with config.patch(compile_fx.get_cpp_wrapper_config()):
            return compile_graph(*args, **graph_kwargs)

    return wrapped


def _not_fusible_if_opaque_output(is_fusible: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    higher_order = torch.ops.higher_order
    opaque = tuple(
        getattr(higher_order, n) for n in ("auto_functionalized", "auto_functionalized_v2") if hasattr(higher_order, n)
    )

    @functools.wraps(is_fusible)
    def wrapped(self: Any, node: Any) -> bool:
        if node.target is operator.getitem and getattr(node.args[0], "target", None) in opaque:
            return False
        return is_fusible(self, node)

    return wrapped


def _reads_through_mutations(get_freeable_input_buf: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(get_freeable_input_buf)
    def wrapped(nodes: Any, graph_inputs: Any) -> Any:
        from torch._inductor.dependencies import WeakDep
        from torch._inductor.virtualized import V

        freeable = get_freeable_input_buf(nodes, graph_inputs)
        real_names = V.graph.scheduler.mutation_real_name  # a mutation's buffer -> the buffer it wrote
        if not any(name in freeable for name in real_names.values()):
            return freeable  # no freeable input is mutated: nothing to add
        for node in nodes:
            for dep in node.read_writes.reads:
                buffer = freeable.get(real_names.get(dep.name))
                if buffer is None:
                    continue
                buffer.mpi_buffer.succ_nodes_for_ordering.add(node)
                if not (isinstance(dep, WeakDep) and dep.is_fake):
                    buffer.mpi_buffer.succ_nodes.add(node)
        return freeable

    return wrapped


PATCHES = (
    Patch(
        "restore_hash_locks_of_cached_kernels",
        "torch._inductor.codecache:StaticAutotunerFuture.result",
        _with_hash_lock,
        tested=((2, 11), (2, 13)),
        upstream="torch/_inductor/codecache.py: StaticAutotunerFuture.result skips restore_after_unpickle",
    ),
    Patch(
        "reapply_cpp_wrapper_config_in_lazy_compiles",
        "torch._inductor.compile_fx:_compile_fx_inner",
        _with_cpp_wrapper_config,
        tested=((2, 11), (2, 13)),
        upstream="pytorch/pytorch#178845, fixed by pytorch/pytorch#178847",
        needed=lambda: not compile_fx_inner_applies_cpp_wrapper_config(),
    ),
    Patch(
        "opaque_mutating_op_outputs_are_not_fusible",
        "torch._functorch.partitioners:OpTypes.is_fusible",
        _not_fusible_if_opaque_output,
        tested=((2, 11), (2, 13)),
        upstream="torch/_functorch/partitioners.py: OpTypes.is_fusible excepts only Triton kernels' outputs",
    ),
    Patch(
        "mutated_graph_inputs_live_until_their_last_read",
        "torch._inductor.memory:get_freeable_input_buf",
        _reads_through_mutations,
        tested=((2, 11), (2, 13)),
        upstream="torch/_inductor/memory.py: get_freeable_input_buf skips reads renamed by a mutation",
    ),
)
"""The fixes, in the order the module docstring describes them."""
