"""``bench train --nproc N``: each provider's worker as N ranks under ``torch.distributed.run``,
the model sharded with FSDP2 (``fully_shard`` per decoder layer, then the root), each rank on
its own batches. Rank 0 reports; the loss is the mean over ranks and the peak memory the
largest rank's."""

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch


def world_size() -> int:
    """Ranks of this process's group, from the launcher's environment (1 outside one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_command(nproc: int, module_args: Sequence[str]) -> list[str]:
    """``python -m <module_args...>`` under ``torch.distributed.run`` with ``nproc`` ranks on this host."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", *module_args]  # fmt: skip


def init(device: str) -> tuple[int, str]:
    """Join the launcher's process group (NCCL on CUDA, gloo on CPU); (rank, this rank's device)."""
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return dist.get_rank(), device


def shard(model: torch.nn.Module) -> None:
    """FSDP2 on a transformers causal LM (or a PEFT model around one): each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    base: Any = model.get_base_model() if hasattr(model, "get_base_model") else model  # type: ignore[operator]
    for layer in base.model.layers:
        fully_shard(layer)
    fully_shard(model)


def mean_over_ranks(values: Sequence[float], device: str) -> list[float]:
    import torch.distributed as dist

    total = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def max_over_ranks(value: float, device: str) -> float:
    import torch.distributed as dist

    largest = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return float(largest.item())


def finish() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
