"""Forward-only FlexAttention on packed rows: which piece goes wrong under ``torch.no_grad()``.

    PYTHONPATH=. python scripts/flex_no_grad.py [--out DIR]    (a CUDA GPU)

Packed rows (``bench train --packed`` documents, 4 x 2048, 32 query and 8 key/value heads of 64, bf16)
attend under ``document_causal``. Each variant runs in its own process (a variant that corrupts memory
ends only its own CUDA context; six run at once); its output is compared with float64 SDPA on the materialised mask
(relative Frobenius error, and the worst row's; bf16 noise is about 2e-3). Variants:

- ``tables``: our block tables (:func:`~inductor_ext.ops.document_attention.document_block_mask`), built
  eagerly and compiled alone, against ``create_block_mask``'s (rows whose count or indices differ);
- ``create_block_mask``: PyTorch's own tables into the compiled ``flex_attention``;
- ``eager_tables``: our tables, built eagerly, into the compiled ``flex_attention``;
- ``in_graph_tables``: our tables built inside the compiled graph of the attention (what
  ``document_causal_attention(..., use_flex=True)`` compiles for an eager caller, and what the backend's
  document-mask rewrite puts in a model's graph);
- ``in_graph_tables_returned``: the same graph, the tables also returned (graph outputs, as a training
  graph saves them for the backward);
- ``in_graph_opaque_tables``: the tables built by an opaque custom op inside the graph;
- ``in_graph_no_buffer_reuse`` and ``in_graph_no_prologue_fusion``: ``in_graph_tables`` compiled with
  Inductor's ``allow_buffer_reuse``/``inplace_buffers`` or ``prologue_fusion`` off;
- ``in_graph_block_64``: ``in_graph_tables`` with 64 x 64 tiles;

each without gradients, and the first ones with inputs that require grad (``(grad)``).

Prints one line per variant and writes ``flex_no_grad.json`` to ``--out``.
"""

import argparse
import concurrent.futures
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from inductor_ext.bench.packing import packed_batches
from inductor_ext.ops.document_attention import (
    BLOCK_SIZE,
    FlexSettings,
    _document_causal_mod,
    _flex,
    document_block_mask,
    document_causal_mask_ref,
    document_ids,
)

BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 4, 2048, 32, 8, 64
SCALE = 1.0 / math.sqrt(HEAD_DIM)
NO_GRAD_ONLY = ("in_graph_tables_returned", "in_graph_opaque_tables", "in_graph_no_buffer_reuse",
                "in_graph_no_prologue_fusion", "in_graph_block_64")  # fmt: skip
VARIANTS = ("tables", "create_block_mask", "eager_tables", "in_graph_tables", *NO_GRAD_ONLY)


@torch.library.custom_op("flex_no_grad::document_tables", mutates_args=())
def document_tables(doc: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The eight block tables of :func:`document_block_mask`, computed by an op Inductor cannot see into."""
    tables = document_block_mask(doc, None).as_tuple()[2:10]
    return tuple(t.clone() for t in tables)  # type: ignore[return-value]


@document_tables.register_fake
def _(doc: Tensor) -> tuple[Tensor, ...]:
    blocks = (doc.shape[1] + BLOCK_SIZE - 1) // BLOCK_SIZE
    count = doc.new_empty((doc.shape[0], 1, blocks), dtype=torch.int32)
    indices = doc.new_empty((doc.shape[0], 1, blocks, blocks), dtype=torch.int32)
    return (count, indices) * 4


def _opaque_table_attention(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor) -> Tensor:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    doc = document_ids(position_ids)

    def document_causal(b: Any, h: Any, q_index: Any, kv_index: Any) -> Any:
        return _document_causal_mod(b, h, q_index, kv_index, doc)

    kv_num, kv_indices, full_kv_num, full_kv_indices, q_num, q_indices, full_q_num, full_q_indices = document_tables(
        doc
    )
    block_mask = BlockMask(
        seq_lengths=(LENGTH, LENGTH), kv_num_blocks=kv_num, kv_indices=kv_indices, full_kv_num_blocks=full_kv_num,
        full_kv_indices=full_kv_indices, q_num_blocks=q_num, q_indices=q_indices, full_q_num_blocks=full_q_num,
        full_q_indices=full_q_indices, BLOCK_SIZE=(BLOCK_SIZE, BLOCK_SIZE), mask_mod=document_causal,
    )  # fmt: skip
    out = flex_attention(q, k, v, block_mask=block_mask, scale=SCALE, enable_gqa=True)
    assert isinstance(out, Tensor)
    return out


def errors(out: Tensor, reference: Tensor) -> dict[str, float]:
    """Relative Frobenius error over the whole output and over the worst (batch, head, query) row."""
    difference = (out.double() - reference).flatten(0, 1)
    rows = difference.norm(dim=-1) / reference.flatten(0, 1).norm(dim=-1).clamp_min(1e-12)
    return {"rel_err": (difference.norm() / reference.norm()).item(), "worst_row_rel_err": rows.max().item()}


def table_mismatches(tables: tuple[Any, ...], reference: tuple[Any, ...]) -> dict[str, int]:
    """Rows of the forward tables (``BlockMask.as_tuple()[2:6]``: kv counts and indices, full kv counts and
    indices) whose count, or whose set of indices up to the count, differs from the reference tables'."""
    mismatched = {}
    for name, (count, indices), (ref_count, ref_indices) in (
        ("kv", tables[0:2], reference[0:2]),
        ("full_kv", tables[2:4], reference[2:4]),
    ):
        slot = torch.arange(indices.shape[-1], device=indices.device)
        ours = torch.where(slot < count[..., None], indices, -1).sort(-1).values
        theirs = torch.where(slot < ref_count[..., None], ref_indices[..., : slot.numel()], -1).sort(-1).values
        mismatched[f"{name}_num_blocks"] = int((count != ref_count).sum().item())
        mismatched[f"{name}_indices"] = int((ours != theirs).any(-1).sum().item())
    return mismatched


def run_variant(variant: str, grad: bool) -> dict[str, Any]:
    """One variant's result in this process."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    position_ids = packed_batches(1, BATCH, LENGTH, 1000)[0].position_ids.to(device)  # type: ignore[union-attr]
    doc = document_ids(position_ids)
    q = torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM, device=device, dtype=dtype, requires_grad=grad)
    k = torch.randn(BATCH, KV_HEADS, LENGTH, HEAD_DIM, device=device, dtype=dtype, requires_grad=grad)
    v = torch.randn(BATCH, KV_HEADS, LENGTH, HEAD_DIM, device=device, dtype=dtype, requires_grad=grad)

    def document_causal(b: Any, h: Any, q_index: Any, kv_index: Any) -> Any:
        return _document_causal_mod(b, h, q_index, kv_index, doc)

    theirs = create_block_mask(document_causal, BATCH, None, LENGTH, LENGTH, device=device)
    if variant == "tables":

        def build(d: Tensor) -> tuple[Tensor, ...]:
            return document_block_mask(d, document_causal).as_tuple()[2:6]

        return {"eager": table_mismatches(build(doc), theirs.as_tuple()[2:6]),
                "compiled": table_mismatches(torch.compile(build, fullgraph=True)(doc), theirs.as_tuple()[2:6])}  # fmt: skip
    compiled_flex = torch.compile(flex_attention, fullgraph=True, dynamic=False)

    def in_graph(a: Tensor, b: Tensor, c: Tensor, pos: Tensor, settings: FlexSettings | None = None) -> Tensor:
        return _flex(a, b, c, pos, SCALE, settings or FlexSettings())

    def returned(a: Tensor, b: Tensor, c: Tensor, pos: Tensor) -> tuple[Any, ...]:
        d = document_ids(pos)
        tables = document_block_mask(d, lambda b, h, qi, ki: _document_causal_mod(b, h, qi, ki, d)).as_tuple()[2:10]
        return (_flex(a, b, c, pos, SCALE, FlexSettings()), *tables)

    calls = {
        "create_block_mask": lambda: compiled_flex(q, k, v, block_mask=theirs, scale=SCALE, enable_gqa=True),
        "eager_tables": lambda: compiled_flex(
            q, k, v, block_mask=document_block_mask(doc, document_causal), scale=SCALE, enable_gqa=True
        ),
        "in_graph_tables": lambda: torch.compile(in_graph, fullgraph=True, dynamic=False)(q, k, v, position_ids),
        "in_graph_tables_returned": lambda: torch.compile(returned, fullgraph=True, dynamic=False)(
            q, k, v, position_ids
        )[0],
        "in_graph_opaque_tables": lambda: torch.compile(_opaque_table_attention, fullgraph=True, dynamic=False)(
            q, k, v, position_ids
        ),
        "in_graph_no_buffer_reuse": lambda: torch.compile(
            in_graph, fullgraph=True, dynamic=False, options={"allow_buffer_reuse": False, "inplace_buffers": False}
        )(q, k, v, position_ids),
        "in_graph_no_prologue_fusion": lambda: torch.compile(
            in_graph, fullgraph=True, dynamic=False, options={"prologue_fusion": False}
        )(q, k, v, position_ids),
        "in_graph_block_64": lambda: torch.compile(in_graph, fullgraph=True, dynamic=False)(
            q, k, v, position_ids, FlexSettings(kernel_options=(("BLOCK_M", 64), ("BLOCK_N", 64)))
        ),
    }
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                               attn_mask=document_causal_mask_ref(position_ids), enable_gqa=True)  # fmt: skip
    with torch.set_grad_enabled(grad):
        out = calls[variant]()
    torch.cuda.synchronize()
    return errors(out.detach(), reference.detach())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in this process
    parser.add_argument("--grad", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, args.grad)), flush=True)
        return 0
    runs = [(v, False) for v in VARIANTS] + [(v, True) for v in VARIANTS[1:] if v not in NO_GRAD_ONLY]

    def run(variant: str, grad: bool) -> dict[str, Any]:
        command = [sys.executable, __file__, "--variant", variant, *(["--grad"] if grad else [])]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if lines:
            return json.loads(lines[-1][7:])
        return {"error": [line for line in done.stderr.splitlines() if "Error" in line][-1:]}

    results: dict[str, Any] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:  # a process per variant, 6 at a time
        futures = {variant + (" (grad)" if grad else ""): pool.submit(run, variant, grad) for variant, grad in runs}
        for name, future in futures.items():
            results[name] = future.result()
            print(f"{name:36s} {json.dumps(results[name])}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    (args.out / "flex_no_grad.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
