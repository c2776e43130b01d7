"""H200 experiment, not part of the library: cross-entropy fwd+bwd in two passes over the logits
(read them once, write the gradient once), each row split over programs that keep their chunk in
registers, packed two bf16 values per 32-bit register.

Why this variant. Session 7 measured the first split-row design (commit 087c6b2, reverted; numbers
in docs/benchmarks.md): correct, but 2.226 ms at 8192 x 128256 against the three-pass kernels'
1.660 ms and ``torch.compile``'s 2.593 ms, and 1.092 ms against 0.834 ms at 16384 x 32000. A
latency model fits both measurements:

* a row is done when its chunks have loaded, published their log-sum-exps, seen the others' and
  stored: about 2.1 us whatever the row's length;
* rows in flight: R = (resident programs x BLOCK_V) / V. The best config (2048 classes, 4 warps,
  111 registers per thread, fp32 values) fits 4 programs per SM: 528 x 2048 / 128256 = 8.4 rows,
  so 8192 rows take 8192 / 8.4 x 2.1 us = 2.05 ms (measured 2.23); at V = 32000, R = 34 and
  16384 rows take 1.02 ms (measured 1.09).

Reaching the two-pass floor (0.98 ms at 8192 x 128256, copy speed) needs R >= ~20: more classes
resident per register. Here each thread keeps its classes as packed bf16 words (one register per
two classes) and unpacks them to fp32 only while computing; an opaque ``mov`` after the wait stops
the compiler from keeping the first phase's fp32 values alive instead. ``--plan`` compiles every
config for sm_90 on this machine (no GPU), reads registers and spills from ptxas, and prints the
occupancy, R and the model's time; the H200 run then tests the model. Written in session 7
without device time left; ``--plan`` there gave, at 8192 x 128256: 72 registers for 32 classes
per thread (2048 words, 4 warps: 7 programs per SM, R = 29.5; 33.7 with ``maxnreg`` 64 and no
spills), against the reverted design's 111 registers for 16 classes (R = 8.4). Keeping the word
indices and the gradient's addresses out of the wait (recomputed from an opaque chunk start)
took them from 138 to 72. The model then puts every config at the copy-speed floor (≈ 1.0 ms,
2.6x ``torch.compile``); the prediction for the measured best is 1.05-1.2 ms (2.2-2.5x) at
8192 x 128256 and 0.55-0.6 ms at 16384 x 32000 (floor 0.49 ms; three passes: 0.834 ms).

Plain cross-entropy (mean over non-ignored labels, ``ignore_index``), bf16 logits with an even
number of classes; the backward multiplies the saved gradient by ``grad_output`` in place and
returns at once on the device when it is 1 (a library version would recompute from the logits when
it is not 1, so that a bf16 gradient is rounded once; see the session-7 notes).

    python scripts/experiment_ce_split_row.py --plan                         # CPU: ptxas, model
    TRITON_INTERPRET=1 python scripts/experiment_ce_split_row.py --check     # CPU: numerics, one chunk per row
    python scripts/experiment_ce_split_row.py [--shapes 8192x128256 16384x32000] [--out DIR]   # H200
"""

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

MAX_CHUNKS = 64
"""Most programs per row: all of a row's programs must be resident at once (ticket order then
guarantees every wait ends)."""

# (words per program, warps, maxnreg or None): words are bf16 pairs, 4-16 words per thread
CONFIGS = [
    (512, 1, None), (1024, 2, None), (1024, 1, None), (2048, 4, None), (2048, 2, None),
    (4096, 8, None), (4096, 4, None), (1024, 2, 64), (2048, 4, 64), (4096, 8, 64), (4096, 4, 96), (8192, 8, 96),
]  # fmt: skip

MEASURED_ROW_LATENCY_US = 2.1
"""Session 7's fit to the fp32 design (module docstring)."""


@triton.jit
def _publish(SLOT, value):
    """SLOT (int64, zeroed before the launch) = fp32 bits of ``value`` with bit 32 set, in one atomic."""
    bits = value.to(tl.uint32, bitcast=True).to(tl.int64)
    tl.atomic_xchg(SLOT, bits | (1 << 32), sem="release")


@triton.jit
def _wait_published(SLOTS, count, MAX_CHUNKS: tl.constexpr):
    """The ``count`` values published at SLOTS[0:count] once all are (spinning until then); -inf past count."""
    ks = tl.arange(0, MAX_CHUNKS)
    mask = ks < count
    packed = tl.load(SLOTS + ks, mask=mask, other=1 << 32, volatile=True)
    while tl.min(packed, axis=0) == 0:
        packed = tl.load(SLOTS + ks, mask=mask, other=1 << 32, volatile=True)
    values = (packed & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    return tl.where(mask, values, float("-inf"))


@triton.jit
def _unpack(words):
    """fp32 (even class, odd class) of packed bf16 pairs (little-endian: the even class is the low half)."""
    return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _pack(even, odd):
    """Packed bf16 pairs of two fp32 tensors, each rounded once (to nearest even)."""
    lo = even.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo | (odd.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def ce_split_row_fwd(
    X, X_WORDS, DX_WORDS, LOSS, LABELS, GRAD_SCALE, SYNC,
    stride_x, stride_words, WORDS, ignore_index,
    BLOCK_W: tl.constexpr, MAX_CHUNKS: tl.constexpr, OPAQUE: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk) in ticket order: the gradient of the mean loss for grad_output = 1
    (GRAD_SCALE = 1 / non-ignored count) over BLOCK_W words (2 * BLOCK_W classes), and for chunk 0
    LOSS[row]. SYNC: int64 zeros, 1 + rows * chunks: the ticket counter, then the published
    log-sum-exps. OPAQUE (not under the interpreter): unpack again after the wait."""
    chunks = tl.cdiv(WORDS, BLOCK_W)
    ticket = tl.atomic_add(SYNC, 1)
    row = ticket // chunks
    chunk = ticket % chunks
    start = chunk * BLOCK_W
    label = tl.load(LABELS + row).to(tl.int64)
    if label == ignore_index:
        words = start + tl.arange(0, BLOCK_W)
        tl.store(DX_WORDS + row * stride_words + words, tl.zeros([BLOCK_W], tl.int32), mask=words < WORDS)
        if chunk == 0:
            tl.store(LOSS + row, 0.0)
    else:
        # masked words: a pair of bf16 -inf (0xFF80FF80)
        words = start + tl.arange(0, BLOCK_W)
        packed = tl.load(
            X_WORDS + row * stride_words + words, mask=words < WORDS, other=-8323200, eviction_policy="evict_first"
        )
        even, odd = _unpack(packed)
        m = tl.maximum(tl.max(even, axis=0), tl.max(odd, axis=0))
        s = tl.sum(tl.exp(even - m), axis=0) + tl.sum(tl.exp(odd - m), axis=0)
        slots = SYNC + 1 + row * chunks
        _publish(slots + chunk, m + tl.log(s))
        parts = _wait_published(slots, chunks, MAX_CHUNKS)
        top = tl.max(parts, axis=0)
        lse = top + tl.log(tl.sum(tl.exp(parts - top), axis=0))
        scale = tl.load(GRAD_SCALE)
        if OPAQUE:
            packed = tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [packed], dtype=tl.int32, is_pure=False, pack=1
            )
        even, odd = _unpack(packed)
        # word indices again after the wait (through the opaque start), not kept alive across it
        start32 = start.to(tl.int32)
        if OPAQUE:
            start32 = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [start32], dtype=tl.int32,
                                                is_pure=False, pack=1)  # fmt: skip
        local = start32 + tl.arange(0, BLOCK_W)
        g_even = (tl.exp(even - lse) - tl.where(2 * local == label, 1.0, 0.0)) * scale
        g_odd = (tl.exp(odd - lse) - tl.where(2 * local + 1 == label, 1.0, 0.0)) * scale
        tl.store(DX_WORDS + row * stride_words + local, _pack(g_even, g_odd), mask=local < WORDS,
                 eviction_policy="evict_first")  # fmt: skip
        if chunk == 0:
            x_y = tl.load(X + row * stride_x + label).to(tl.float32)
            tl.store(LOSS + row, lse - x_y)


@triton.jit
def scale_unless_one(X, GRAD_OUTPUT, numel, BLOCK: tl.constexpr):
    """X *= GRAD_OUTPUT in place, grid-stride; every program returns at once when it is 1."""
    g = tl.load(GRAD_OUTPUT).to(tl.float32)
    if g != 1.0:
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(X + offs, mask=offs < numel).to(tl.float32)
            tl.store(X + offs, (x * g).to(X.dtype.element_ty), mask=offs < numel)


class SplitRowCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, config):
        n, v = logits.shape
        if logits.dtype != torch.bfloat16 or v % 2 or not logits.is_contiguous():
            raise ValueError("logits must be contiguous bf16 with an even number of classes")
        block_w, warps, maxnreg = config
        words = v // 2
        chunks = triton.cdiv(words, block_w)
        if chunks > MAX_CHUNKS:
            raise ValueError(f"{chunks} chunks per row > {MAX_CHUNKS}: use a wider config")
        count = (labels != -100).sum()
        scale = count.clamp_min(1).float().reciprocal()
        dlogits = torch.empty_like(logits)
        loss_rows = torch.empty(n, device=logits.device)
        sync = torch.zeros(1 + n * chunks, dtype=torch.int64, device=logits.device)
        options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
        ce_split_row_fwd[(n * chunks,)](
            logits, logits.view(torch.int32), dlogits.view(torch.int32), loss_rows, labels, scale, sync,
            logits.stride(0), logits.stride(0) // 2, words, -100,
            BLOCK_W=block_w, MAX_CHUNKS=MAX_CHUNKS, OPAQUE=logits.is_cuda, **options,
        )  # fmt: skip
        ctx.dlogits = dlogits
        return loss_rows.sum() / count

    @staticmethod
    def backward(ctx, dloss):
        dlogits, ctx.dlogits = ctx.dlogits, None
        programs = min(triton.cdiv(dlogits.numel(), 4096), 528)
        scale_unless_one[(programs,)](dlogits, dloss.float(), dlogits.numel(), BLOCK=4096, num_warps=4)
        return dlogits, None, None


def check() -> None:
    """Numerics under the interpreter: one chunk per row (programs run one after another there)."""
    from inductor_ext.ops.cross_entropy import cross_entropy_ref
    from tests.tolerances import rel_err

    torch.manual_seed(0)
    for v, config in [(1000, (512, 1, None)), (4096, (2048, 4, None))]:
        logits = (3 * torch.randn(9, v)).to(torch.bfloat16)
        labels = torch.randint(0, v, (9,))
        labels[::4] = -100
        x = logits.clone().requires_grad_()
        loss = SplitRowCrossEntropy.apply(x, labels, config)
        (grad,) = torch.autograd.grad(loss, x, torch.tensor(0.5))
        xd = logits.double().requires_grad_()
        ref = cross_entropy_ref(xd, labels)
        (ref_grad,) = torch.autograd.grad(ref, xd, torch.tensor(0.5, dtype=torch.float64))
        print(f"V {v}: loss err {rel_err(loss, ref):.1e}, grad err {rel_err(grad, ref_grad):.1e}")
        assert rel_err(loss, ref) < 1e-6 and rel_err(grad, ref_grad) < 1e-2


def plan(v: int = 128256, n: int = 8192, sms: int = 132, copy_gbps: float = 4274.0) -> list[dict]:
    """Registers and spills (ptxas, sm_90) per config, occupancy, rows in flight and the model's ms."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    signature = {
        "X": "*bf16", "X_WORDS": "*i32", "DX_WORDS": "*i32", "LOSS": "*fp32", "LABELS": "*i64",
        "GRAD_SCALE": "*fp32", "SYNC": "*i64", "stride_x": "i64", "stride_words": "i64", "WORDS": "i32",
        "ignore_index": "i64", "BLOCK_W": "constexpr", "MAX_CHUNKS": "constexpr", "OPAQUE": "constexpr",
    }  # fmt: skip
    fn = ce_split_row_fwd
    floor_ms = 2 * n * v * 2 / copy_gbps / 1e6
    rows = []
    for block_w, warps, maxnreg in CONFIGS:
        constexprs = {"BLOCK_W": block_w, "MAX_CHUNKS": MAX_CHUNKS, "OPAQUE": True}
        src = ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): c for k, c in constexprs.items()})
        options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(compiled.asm["ptx"])
        cap = [f"--maxrregcount={maxnreg}"] if maxnreg else []
        out = subprocess.run(
            [ptxas, "-v", "-arch=sm_90a", *cap, f.name, "-o", os.devnull], capture_output=True, text=True, check=True
        )
        os.unlink(f.name)
        info = out.stderr
        regs = int(info.split("Used ")[1].split(" registers")[0])
        spill = int(info.split("bytes spill stores")[0].split(",")[-1].strip())
        threads = 32 * warps
        regs_per_warp = -(-regs * 32 // 256) * 256
        per_sm = min(32, 2048 // threads, 65536 // (regs_per_warp * warps))
        chunks = triton.cdiv(v // 2, block_w)
        in_flight = sms * per_sm * 2 * block_w / v
        model_ms = max(floor_ms, n / in_flight * MEASURED_ROW_LATENCY_US / 1000) if chunks <= MAX_CHUNKS else None
        row = {"block_w": block_w, "warps": warps, "maxnreg": maxnreg, "classes_per_thread": 2 * block_w // threads,
               "registers": regs, "spill_bytes": spill, "programs_per_sm": per_sm, "chunks": chunks,
               "rows_in_flight": in_flight, "model_ms": model_ms}  # fmt: skip
        rows.append(row)
        print(", ".join(f"{k} {val:.1f}" if isinstance(val, float) else f"{k} {val}" for k, val in row.items()))
    return rows


def measure(n: int, v: int) -> dict:
    from inductor_ext.bench.harness import bench_graph_median, rel_err
    from inductor_ext.ops.cross_entropy import cross_entropy, cross_entropy_ref

    torch.manual_seed(0)
    sets = []
    for _ in range(2):
        logits = (3 * torch.randn(n, v, device="cuda")).to(torch.bfloat16).requires_grad_()
        labels = torch.randint(0, v, (n,), device="cuda")
        labels[::8] = -100
        sets.append((logits, labels))
    ref_loss = cross_entropy_ref(sets[0][0].detach().double(), sets[0][1])
    ref_grad = torch.autograd.grad(cross_entropy(*sets[0]), sets[0][0])[0]
    result = {"shape": [n, v], "rows": []}

    def timed(name, f, **extra):
        state = {"i": 0}

        def run():
            state["i"] ^= 1
            logits, labels = sets[state["i"]]
            return torch.autograd.grad(f(logits, labels), logits)

        ms, p20, p80 = bench_graph_median(run)
        result["rows"].append({"name": name, "ms": ms, "p20": p20, "p80": p80, **extra})
        print(f"{n}x{v} {name:50s} {ms:.4f} ms  {result['rows'][0]['ms'] / ms:.2f}x compile  {extra}", flush=True)

    timed("torch.compile(F.cross_entropy(logits.float()))", torch.compile(cross_entropy_ref, fullgraph=True))
    timed("inductor_ext.cross_entropy (three passes)", cross_entropy)
    for config in CONFIGS:
        if triton.cdiv(v // 2, config[0]) > MAX_CHUNKS:
            continue
        x = sets[0][0].detach().clone().requires_grad_()
        loss = SplitRowCrossEntropy.apply(x, sets[0][1], config)
        (grad,) = torch.autograd.grad(loss, x)
        errors = {"loss_err": rel_err(loss, ref_loss), "grad_vs_three_pass": rel_err(grad, ref_grad)}
        timed(f"split rows, packed {config}", lambda x, y, c=config: SplitRowCrossEntropy.apply(x, y, c), **errors)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="store_true", help="ptxas registers, occupancy and the model's time (no GPU)")
    parser.add_argument("--check", action="store_true", help="numerics under TRITON_INTERPRET=1 (no GPU)")
    parser.add_argument("--shapes", nargs="*", default=["8192x128256", "16384x32000"])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.check:
        check()
        return
    results = {"plan": plan()} if args.plan else {"runs": [measure(*map(int, s.split("x"))) for s in args.shapes]}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "experiment_ce_split_row.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
