"""Quickstart: a Llama-style decoder block on fastops RMSNorm, eager vs ``torch.compile``.

Builds one decoder block (RMSNorm -> causal attention -> RMSNorm -> SiLU-gated MLP,
with ``inductor_ext.nn.RMSNorm`` for both norms), runs forward and backward eagerly
and under ``torch.compile(block, fullgraph=True)``, checks that outputs and
gradients agree and that Dynamo hit no graph break, and prints a table.

On CPU (default there: float32, 2x64 tokens) the op's CPU branch runs aten math and
Inductor compiles it to C++; on CUDA (default: bfloat16, 4x2048 tokens) the Triton
kernels run, and the table adds the median forward+backward times.

    python examples/quickstart.py [--device cuda] [--dtype bfloat16] [--batch 4] [--tokens 2048]
"""

import argparse
import sys
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import inductor_ext

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""Bound on ‖compiled − eager‖ / ‖eager‖ per dtype (compile fuses and reorders roundings)."""


class DecoderBlock(nn.Module):
    """Pre-norm Llama decoder layer without RoPE: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, hidden: int = 256, heads: int = 4, intermediate: int = 688) -> None:
        super().__init__()
        self.heads = heads
        self.input_layernorm = inductor_ext.nn.RMSNorm(hidden, eps=1e-6)
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_attention_layernorm = inductor_ext.nn.RMSNorm(hidden, eps=1e-6)
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        qkv = self.qkv_proj(self.input_layernorm(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (b, heads, t, head_dim)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)


def forward_backward(
    fn: Callable[[Tensor], Tensor], params: Mapping[str, Tensor], x: Tensor, dy: Tensor
) -> dict[str, Tensor]:
    """Output of ``fn(x)`` and gradients of x and ``params`` for the upstream gradient ``dy``."""
    y = fn(x)
    grads = torch.autograd.grad(y, [x, *params.values()], dy)
    return {"output": y, **dict(zip(["x", *params], grads, strict=True))}


def rel_err(a: Tensor, b: Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def format_table(rows: list[tuple[str, str]]) -> str:
    try:
        from tabulate import tabulate  # optional: not a core dependency
    except ImportError:
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    return tabulate(rows, tablefmt="simple", disable_numparse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument("--batch", type=int, help="sequences (default: 4 on CUDA, 2 on CPU)")
    parser.add_argument("--tokens", type=int, help="tokens per sequence (default: 2048 on CUDA, 64 on CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_cuda else "float32"))
    batch, tokens = args.batch or (4 if on_cuda else 2), args.tokens or (2048 if on_cuda else 64)

    torch.manual_seed(0)
    block = DecoderBlock().to(device=device, dtype=dtype)
    x = torch.randn(batch, tokens, 256, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)

    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block, fullgraph=True)
    params = dict(block.named_parameters())  # shared by the compiled module
    eager_out = forward_backward(block, params, x, dy)
    compiled_out = forward_backward(compiled, params, x, dy)
    graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())

    diffs = {k: (eager_out[k] - compiled_out[k]).abs().max().item() for k in eager_out}
    errors = {k: rel_err(compiled_out[k], eager_out[k]) for k in eager_out}
    worst_grad = max((k for k in diffs if k != "output"), key=diffs.__getitem__)
    rows = [
        ("device", str(device)),
        ("dtype", str(dtype).removeprefix("torch.")),
        ("tokens", f"{batch}x{tokens}"),
        ("max |diff| output", f"{diffs['output']:.3g}"),
        ("max |diff| grads", f"{diffs[worst_grad]:.3g} ({worst_grad})"),
        ("max rel err (bound)", f"{max(errors.values()):.3g} ({TOLERANCE[dtype]:g})"),
        ("graph breaks", str(graph_breaks)),
    ]
    if on_cuda:
        import triton.testing

        for name, fn in (("eager", block), ("compiled", compiled)):
            ms = triton.testing.do_bench(lambda fn=fn: forward_backward(fn, params, x, dy), return_mode="median")
            rows.append((f"{name} fwd+bwd ms", f"{ms:.3f}"))
    print(format_table(rows))

    bad = {k: f"{e:.3g}" for k, e in errors.items() if not e <= TOLERANCE[dtype]}
    if bad:
        raise AssertionError(f"compiled and eager disagree (relative error > {TOLERANCE[dtype]:g}): {bad}")
    if graph_breaks:
        raise AssertionError(f"expected no graph breaks, got {dict(torch._dynamo.utils.counters['graph_break'])}")
    print("OK: eager and torch.compile agree, no graph breaks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
