"""``python -m benchmarks document_attention [--shapes 4x2048 1x8192] [--out DIR]``: attention over
packed documents, forward and forward + backward, side by side.

The rows are the documents ``bench train --packed`` trains on (:mod:`inductor_ext.bench.packing`: seeded
lognormal lengths, median 300 tokens), and the heads Llama-3.2-1B's (32 query heads, 8 key/value heads of
64). Providers:

- ``sdpa_masked``: ``torch.compile`` of transformers' spelling, SDPA over the materialised ``(B, 1, S, S)``
  document mask (what ``torch.compile`` of an HF model runs on packed rows);
- ``flex_*``: :func:`~inductor_ext.ops.document_attention.document_causal_attention` (FlexAttention on the
  document block mask) with each of :data:`FLEX_VARIANTS` (``flex_default`` is what the op ships);
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention's variable-length kernel) on the
  exact ``cu_seqlens``, where this torch has it. It needs the number of documents on the host (a sync, and
  a new shape per packing), so it is a ceiling to compare with, not a route the rewrite can take;
- ``sdpa_causal_dense``: SDPA with ``is_causal=True`` over the whole row, documents ignored: not a correct
  answer, the cost of the dense causal step that packing should beat.

Time is the median of ``triton.testing.do_bench``; ``TF/s`` counts the useful work only, the
``document_causal`` pairs: ``4 * D * Hq * sum(len * (len + 1) / 2)`` FLOPs forward, 2.5 times that more for
the backward. ``rel_err`` is each output's (and, forward + backward, each gradient's worst)
``‖out - ref‖ / ‖ref‖`` against float32 SDPA on the materialised mask.
"""

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from benchmarks.harness import do_bench_median, rel_err
from inductor_ext.bench import packing
from inductor_ext.ops.document_attention import (
    FlexSettings,
    document_causal_attention,
    document_causal_mask_ref,
    document_ids,
)

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 64
"""Llama-3.2-1B's attention."""
SHAPES = [(4, 2048), (1, 8192)]
"""``(rows, row length)``: the ``bench train --packed`` shapes."""

FLEX_VARIANTS: dict[str, FlexSettings] = {
    "flex_default": FlexSettings(),
    "flex_safe_rows": FlexSettings(kernel_options=(("ROWS_GUARANTEED_SAFE", True),)),
    "flex_f128x64": FlexSettings(kernel_options=(("fwd_BLOCK_M", 128), ("fwd_BLOCK_N", 64))),
    "flex_b64x64": FlexSettings(kernel_options=(("bwd_BLOCK_M1", 64), ("bwd_BLOCK_N1", 64), ("bwd_BLOCK_M2", 64),
                                                ("bwd_BLOCK_N2", 64), ("bwd_num_warps", 4), ("bwd_num_stages", 3))),
    "flex_b32x64": FlexSettings(kernel_options=(("bwd_BLOCK_M1", 32), ("bwd_BLOCK_N1", 64), ("bwd_BLOCK_M2", 64),
                                                ("bwd_BLOCK_N2", 32), ("bwd_num_warps", 4), ("bwd_num_stages", 3))),
    "flex_tma": FlexSettings(kernel_options=(("USE_TMA", True),)),
    "flex_block64": FlexSettings(64, (("fwd_BLOCK_M", 64), ("fwd_BLOCK_N", 64), ("bwd_BLOCK_M1", 64),
                                      ("bwd_BLOCK_N1", 64), ("bwd_BLOCK_M2", 64), ("bwd_BLOCK_N2", 64))),
    "flex_block64_b32": FlexSettings(64, (("fwd_BLOCK_M", 64), ("fwd_BLOCK_N", 64), ("bwd_BLOCK_M1", 32),
                                          ("bwd_BLOCK_N1", 64), ("bwd_BLOCK_M2", 64), ("bwd_BLOCK_N2", 32),
                                          ("bwd_num_warps", 4))),
}  # fmt: skip
"""The FlexAttention settings compared (the op's block size and kernel options; see FlexAttention's
``kernel_options``: ``fwd_``/``bwd_`` prefixes address one pass)."""


@dataclasses.dataclass
class Row:
    shape: str
    mode: str
    provider: str
    ms: float
    tflops: float
    rel_err: float
    vs_sdpa_masked: float = float("nan")


def _document_lengths(positions: torch.Tensor) -> torch.Tensor:
    """Every document's length, row after row (on the host): the packing of ``positions``."""
    doc = document_ids(positions).cpu()
    return torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in doc])


def _useful_flops(lengths: torch.Tensor) -> float:
    """Forward FLOPs of the ``document_causal`` pairs of documents of these lengths."""
    pairs = float((lengths * (lengths + 1) // 2).sum())
    return 4.0 * HEAD_DIM * HEADS * pairs


def _inputs(batch: int, length: int) -> dict[str, torch.Tensor]:
    positions = packing.packed_batches(1, batch, length, 2, seed=1)[0].position_ids
    assert positions is not None
    q = torch.randn(batch, length, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(batch, length, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            for _ in "kv")  # fmt: skip
    return {"q": q, "k": k, "v": v, "positions": positions.cuda(), "grad": torch.randn_like(q)}


def _sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask_ref(positions), enable_gqa=True)


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *, settings: FlexSettings
) -> torch.Tensor:
    return document_causal_attention(q, k, v, positions, enable_gqa=True, flex_settings=settings)


def _causal_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _varlen(positions: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """FlashAttention's varlen kernel on the exact documents of ``positions`` (built here, on the host)."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    varlen_attn: Any = varlen.varlen_attn  # its signature differs between torch versions
    import inspect

    counts = _document_lengths(positions)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)]).cuda()
    longest = int(counts.max())
    causal: dict[str, Any] = (
        {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else {"window_size": (-1, 0)}
    )

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        flat = [t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (q, k, v)]
        if flat[1].shape[1] != flat[0].shape[1]:  # FlashAttention takes fewer key heads, but not every wrapper
            flat[1:] = [t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in flat[1:]]
        out = varlen_attn(*flat, cu, cu, longest, longest, **causal)
        assert isinstance(out, torch.Tensor)
        return out.reshape(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)

    return run


def _forward_backward(
    fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor], positions: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(fn(*leaves, positions), leaves, grad)


def providers(positions: torch.Tensor) -> dict[str, Callable[..., torch.Tensor]]:
    result: dict[str, Callable[..., torch.Tensor]] = {
        "sdpa_masked": cast(Callable[..., torch.Tensor], torch.compile(_sdpa_masked, fullgraph=True))
    }
    for name, settings in FLEX_VARIANTS.items():
        result[name] = torch.compile(functools.partial(_flex, settings=settings), fullgraph=True)
    varlen = _varlen(positions)
    if varlen is not None:
        result["varlen"] = varlen
    result["sdpa_causal_dense"] = _causal_dense
    return result


def run_shape(batch: int, length: int) -> list[Row]:
    inputs = _inputs(batch, length)
    q, k, v, positions, grad = (inputs[n] for n in ("q", "k", "v", "positions", "grad"))
    flops = _useful_flops(_document_lengths(positions))
    exact = [t.float().requires_grad_() for t in (q, k, v)]
    reference = _sdpa_masked(exact[0], exact[1], exact[2], positions)
    reference_grads = torch.autograd.grad(reference, exact, grad.float())
    rows = []
    for name, fn in providers(positions).items():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        try:
            out = fn(*leaves, positions)
            grads = torch.autograd.grad(out, leaves, grad)
        except Exception as error:  # noqa: BLE001  # one provider that fails must not end the run
            print(f"{batch}x{length} {name}: failed ({type(error).__name__}: {str(error)[:300]})", flush=True)
            continue
        errors = {"fwd": rel_err(out, reference),
                  "fwd_bwd": max(rel_err(g, r) for g, r in zip(grads, reference_grads, strict=True))}  # fmt: skip
        # the forward as training runs it (inputs that need gradients: no inference graph)
        forward_ms = do_bench_median(functools.partial(fn, *leaves, positions))[0]
        both_ms = do_bench_median(functools.partial(_forward_backward, fn, leaves, positions, grad))[0]
        for mode, ms, work in (("fwd", forward_ms, flops), ("fwd_bwd", both_ms, 3.5 * flops)):
            rows.append(Row(f"{batch}x{length}", mode, name, ms, work / ms / 1e9, errors[mode]))
            print(f"{batch}x{length} {mode} {name}: {ms:.4f} ms, {work / ms / 1e9:.0f} TF/s, rel_err {errors[mode]:.2e}",
                  flush=True)  # fmt: skip
    for mode in ("fwd", "fwd_bwd"):
        base = next((r.ms for r in rows if r.mode == mode and r.provider == "sdpa_masked"), float("nan"))
        for r in rows:
            if r.mode == mode:
                r.vs_sdpa_masked = base / r.ms
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks document_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--shapes", nargs="*", default=[f"{b}x{s}" for b, s in SHAPES], help="ROWSxLENGTH")
    parser.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for the JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the attention benchmark needs a CUDA GPU")
    from tabulate import tabulate

    rows: list[Row] = []
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}  # fmt: skip
    path = args.out / "document_attention_bfloat16.json"
    for shape in args.shapes:
        batch, length = (int(n) for n in shape.split("x"))
        torch._dynamo.reset()
        rows += run_shape(batch, length)
        path.write_text(json.dumps({**meta, "results": [dataclasses.asdict(r) for r in rows]}, indent=1))
    print(tabulate([dataclasses.astuple(r) for r in rows], headers=[f.name for f in dataclasses.fields(Row)],
                   floatfmt=".4g"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
