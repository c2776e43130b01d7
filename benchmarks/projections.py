"""``python -m benchmarks projections [--models llama-3.2-1b llama-3.1-8b] [--tokens 8192] [--out DIR]``:
whether one decoder layer's sibling projections (q/k/v, gate/up) train faster as one matrix product over
concatenated weights than as separate ones, measured before the backend or the patch fuses them.

Each spelling below does a layer's whole projection work of a training step, forward and backward, for
``x`` of ``N`` tokens and weights ``W_i`` (``out_i x H``) given the outputs' gradients ``dy_i``::

    separate:       y_i = x W_i^T;  dW_i = dy_i^T x;  dx = sum_i dy_i W_i   (3n products and a sum)
    fused:          W = cat(W_i);  y = x W^T, split;  dy = cat(dy_i);  dW = dy^T x, split;  dx = dy W
    fused_in_place: as fused, with ``dy`` given concatenated (its producers wrote into their slices)

``fused`` pays two copies ``separate`` does not: the weights' concatenation (they change every step:
``2 H sum(out)`` elements moved) and the gradients' (``2 N sum(out)``), which Inductor removes only when
every ``dy_i`` comes from its own pointwise code (not from an opaque kernel such as SDPA's backward
or our RoPE's); ``fused_in_place`` is that best case. Both remove the sum of the input gradients
(``(n + 1) N H``, unless Inductor fuses it into the norm's backward) and merge the narrow key/value
products of grouped-query attention into one wide product. Each spelling is compiled by Inductor and
timed by CUDA-graph replay, the spellings interleaved round by round (:func:`harness.interleaved_graph_ms`).
"""

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from inductor_ext.bench.train import MODELS

Spelling = Callable[[torch.Tensor, Sequence[torch.Tensor], Sequence[torch.Tensor]], tuple[Any, ...]]


def separate(x: torch.Tensor, weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """Outputs, weight gradients and the input gradient, one product per projection."""
    outputs = [x @ w.T for w in weights]
    weight_grads = [dy.T @ x for dy in grads]
    input_grad = grads[0] @ weights[0]
    for dy, w in zip(grads[1:], weights[1:]):
        input_grad = input_grad + dy @ w
    return outputs, weight_grads, input_grad


def fused(x: torch.Tensor, weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """The same values from one product each way, over the concatenated weights and gradients."""
    return fused_in_place(x, weights, [torch.cat(list(grads), dim=-1)])


def fused_in_place(x: torch.Tensor, weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """:func:`fused` with the gradients given as one ``(N, sum(out))`` tensor (``grads[0]``)."""
    (dy,) = grads
    sections = [w.shape[0] for w in weights]
    w = torch.cat(list(weights))
    outputs = (x @ w.T).split(sections, dim=-1)
    weight_grads = (dy.T @ x).split(sections)
    return outputs, weight_grads, dy @ w


SPELLINGS: dict[str, Spelling] = {"separate": separate, "fused": fused, "fused_in_place": fused_in_place}


def group_widths(model: str) -> dict[str, list[int]]:
    """Output widths of the sibling projections of one of :data:`MODELS`' layers."""
    cfg = MODELS[model]
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {"qkv": [q, kv, kv], "gate_up": [cfg["intermediate_size"]] * 2}


def make_inputs(
    tokens: int, hidden: int, widths: Sequence[int], dtype: torch.dtype, device: str, *, seed: int = 0
) -> dict[str, Any]:
    """``x``, the weights, the outputs' gradients apart and concatenated (scaled as a layer's would be)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)).to(dtype)

    grads = [randn(tokens, n, scale=tokens**-0.5) for n in widths]
    return {
        "x": randn(tokens, hidden),
        "weights": [randn(n, hidden, scale=hidden**-0.5) for n in widths],
        "grads": grads,
        "packed_grads": [torch.cat(grads, dim=-1)],
    }


def call(name: str, spelling: Spelling, inputs: dict[str, Any]) -> Callable[[], Any]:
    grads = inputs["packed_grads"] if name == "fused_in_place" else inputs["grads"]
    return lambda: spelling(inputs["x"], inputs["weights"], grads)


def max_rel_err(result: tuple[Any, ...], reference: tuple[Any, ...]) -> float:
    """Largest ``‖a − b‖ / ‖b‖`` over the outputs, weight gradients and the input gradient."""
    flat = [torch.utils._pytree.tree_leaves(r) for r in (result, reference)]
    return max(harness.rel_err(a, b) for a, b in zip(*flat))


def measure(model: str, group: str, tokens: int, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    """Every spelling of one projection group, compiled and timed side by side."""
    cfg = MODELS[model]
    widths = group_widths(model)[group]
    inputs = make_inputs(tokens, cfg["hidden_size"], widths, dtype, "cuda")
    torch._dynamo.reset()
    calls = {name: call(name, torch.compile(fn, fullgraph=True), inputs) for name, fn in SPELLINGS.items()}
    reference = calls["separate"]()
    errors = {name: max_rel_err(fn(), reference) for name, fn in calls.items()}
    times = harness.interleaved_graph_ms(calls, rounds=rounds)
    ms = {name: statistics.median(t) for name, t in times.items()}
    flops = 3 * 2 * tokens * cfg["hidden_size"] * sum(widths)
    return {
        "model": model, "group": group, "tokens": tokens, "widths": widths, "hidden": cfg["hidden_size"],
        "ms": ms, "tflops": {name: flops / t / 1e9 for name, t in ms.items()},
        "vs_separate": {name: ms["separate"] / t for name, t in ms.items()}, "rel_err_vs_separate": errors,
    }  # fmt: skip


def table(rows: Sequence[dict[str, Any]]) -> str:
    from tabulate import tabulate

    lines = [
        (r["model"], r["group"], r["tokens"], name, f"{ms:.3f}", f"{r['tflops'][name]:.0f}", f"{r['vs_separate'][name]:.3f}x")
        for r in rows
        for name, ms in r["ms"].items()
    ]  # fmt: skip
    return tabulate(lines, headers=["model", "group", "tokens", "spelling", "ms", "TFLOP/s", "vs separate"])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks projections", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["llama-3.2-1b", "llama-3.1-8b"])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192], help="tokens per step (batch x sequence)")
    p.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds")
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for projections_bfloat16.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = harness.parse_on_gpu(parser(), argv)
    rows = []
    for model in args.models:
        for tokens in args.tokens:
            for group in ("qkv", "gate_up"):
                rows.append(measure(model, group, tokens, torch.bfloat16, args.rounds))
                print(table(rows[-1:]), flush=True)
    print(table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    (args.out / "projections_bfloat16.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    return 0
