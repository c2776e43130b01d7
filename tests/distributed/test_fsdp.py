"""FSDP2 with the patched model on 2 gloo ranks: the losses of training unsharded in one process.

A tiny Llama (2 layers, hidden 64, vocab 256, fp32) patched by ``inductor_ext.models.apply``,
``fully_shard`` per decoder layer then on the root, AdamW steps on a batch split across the
ranks; the reference trains the same initial model on the whole batch on rank 0 alone.
Eager, and under ``torch.compile`` with ``fastops_inductor`` and with stock Inductor; the
all-gathers and reduce-scatters each step issues are counted (``torch.distributed``'s functions
wrapped) and must be the same under both backends as in eager.
"""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.launch import results_of_two_ranks

pytestmark = pytest.mark.xdist_group("two_ranks")  # one worker runs the two-rank launches, one at a time

STEPS = 3
BATCH, SEQ = 4, 16
MODES = ("eager", "fastops_inductor", "inductor")
COUNTED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single")
"""FSDP2's collectives (torch 2.13 calls the ``*_single`` ones, older versions the others)."""


def _model() -> Any:
    import transformers

    import inductor_ext

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    inductor_ext.models.apply(model)
    return model


def _batch() -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _train(model: Any, step: Any, input_ids: torch.Tensor, reduce: Any = None) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = step(input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        detached = loss.detach()
        losses.append(float(reduce(detached) if reduce else detached))
    return losses


def _fsdp_worker(rank: int, world_size: int, results_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    counted = [name for name in COUNTED if hasattr(dist, name)]
    counts: dict[str, int] = dict.fromkeys(counted, 0)
    for name in counted:
        original = getattr(dist, name)

        def counting(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)

    def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        return t

    shard = _batch().chunk(world_size)[rank]
    results: dict[str, Any] = {}
    for mode in MODES:
        model = _model()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        run = model if mode == "eager" else torch.compile(model, backend=mode)

        def step(ids: torch.Tensor, run: Any = run) -> torch.Tensor:
            return run(input_ids=ids, labels=ids).loss

        before = dict(counts)
        losses = _train(model, lambda ids: step(ids), shard, mean_over_ranks)
        results[mode] = {"losses": losses, "collectives": {k: counts[k] - before[k] for k in counted}}
        torch._dynamo.reset()
    if rank == 0:  # the reference: the whole batch, unsharded, in this process (the ops' CPU branch)
        model = _model()
        results["unsharded"] = _train(model, lambda ids: model(input_ids=ids, labels=ids).loss, _batch())
        Path(results_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return results_of_two_ranks(tmp_path_factory, _fsdp_worker, "fsdp", timeout_s=300)


@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_losses_match_one_process(results: dict[str, Any], mode: str) -> None:
    losses, unsharded_losses = results[mode]["losses"], results["unsharded"]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(unsharded_losses), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["fastops_inductor", "inductor"])
def test_compiled_steps_issue_eager_collectives(results: dict[str, Any], mode: str) -> None:
    eager = results["eager"]["collectives"]
    assert sum(n for name, n in eager.items() if "gather" in name) > 0
    assert sum(n for name, n in eager.items() if "scatter" in name) > 0
    assert results[mode]["collectives"] == eager
