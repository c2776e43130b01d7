"""The op recipe's launch helpers (what every op's traced kernel launch goes through)."""

import torch
import triton
from triton.runtime.autotuner import Autotuner

from inductor_ext.kernels.cross_entropy import (
    CrossEntropyConfig,
    cross_entropy_fwd_inplace_kernel,
    scale_rows_kernel,
    search_space,
)
from inductor_ext.ops._library import pruned_autotuner


def _inplace_args(v: int) -> tuple:
    logits = torch.empty(3, v)
    return (logits, logits, torch.empty(3), None, torch.zeros(3, dtype=torch.long), None, v, v, 0, v, -100, 0.0, 0.0, 0.0)


def test_pruned_autotuner_keeps_restore_value_and_only_the_valid_configs():
    """torch's kernel tracing re-wraps a pruning autotuner without ``restore_value``; ours must keep it."""
    for v in (100, 32000, 262144):
        pruned = pruned_autotuner(cross_entropy_fwd_inplace_kernel, _inplace_args(v), {"HAS_GRAD_SCALE": False})
        assert isinstance(pruned, Autotuner)
        assert pruned.restore_value == ["DLOGITS"]
        assert pruned.early_config_prune is None  # nothing left for the tracer to re-wrap
        assert pruned.fn is cross_entropy_fwd_inplace_kernel.fn
        assert sorted(map(CrossEntropyConfig.from_triton, pruned.configs), key=str) == sorted(search_space(v), key=str)


def test_pruned_autotuner_passes_plain_kernels_through():
    assert pruned_autotuner(scale_rows_kernel, (), {}) is scale_rows_kernel
    no_prune = triton.autotune(configs=[triton.Config({})], key=[])(scale_rows_kernel)
    assert pruned_autotuner(no_prune, (), {}) is no_prune
