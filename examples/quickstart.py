"""Quickstart: tune, compile and export a small HF-style Llama with inductor_ext.

1. Tune: ``python -m inductor_ext.tuning tune --entry quickstart:tuning_entry`` traces the
   model on meta tensors (no weights) and tunes its fastops calls into a tuning database
   (a temporary one here; on CPU the calls are only recorded: nothing is timed there).
2. Compile: ``torch.compile(model, backend="fastops_inductor")`` on the unmodified
   HF spelling (``LlamaRMSNorm``, ``rotate_half`` RoPE, ``silu(gate) * up``,
   ``F.cross_entropy(logits.float())``). Prints which calls were rewritten into fastops
   ops and the route each took (our Triton kernels or Inductor's code), and checks loss
   and gradients against eager.
3. Export: ``inductor_ext.export`` the same weights, written with our ops, to a ``.pt2``
   AOTInductor package; ``inductor_ext.load`` it and check its logits against eager.

CPU (default there): float32, 2 layers, 2x64 tokens; our ops run their aten math and
Inductor compiles them to C++. CUDA: bfloat16, larger shapes, and median timings.

    python examples/quickstart.py [--device cuda|cpu]
"""

import argparse
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import inductor_ext

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
"""Bound on ‖compiled − eager‖ / ‖eager‖ per dtype (compiled code fuses and reorders roundings)."""

_CPU = {"vocab": 512, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 352, "layers": 2}
_CUDA = {"vocab": 32000, "hidden": 1024, "heads": 16, "kv_heads": 4, "intermediate": 2816, "layers": 2}
SIZES = {"cpu": {**_CPU, "batch": 2, "seq": 64}, "cuda": {**_CUDA, "batch": 4, "seq": 1024}}
"""Model config, sequences and tokens per sequence, per device."""


# ---------------------------------------------------------------- the model, as transformers writes it


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int, fastops: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.fastops = heads, kv_heads, hidden // heads, fastops
        norm = inductor_ext.nn.RMSNorm if fastops else LlamaRMSNorm
        self.input_layernorm, self.post_attention_layernorm = norm(hidden, eps=1e-6), norm(hidden, eps=1e-6)
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, d = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        rope = inductor_ext.apply_rotary_pos_emb if self.fastops else apply_rotary_pos_emb
        q, k = rope(q, k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, d))
        h = self.post_attention_layernorm(x)
        if self.fastops:
            mlp = inductor_ext.swiglu(self.gate_proj(h), self.up_proj(h))
        else:
            mlp = F.silu(self.gate_proj(h)) * self.up_proj(h)
        return x + self.down_proj(mlp)


class TinyLlama(nn.Module):
    """A causal LM: ``model(input_ids)`` gives logits, ``model(input_ids, labels)`` the mean loss.

    ``fastops=False`` is transformers' spelling, which ``backend="fastops_inductor"`` rewrites;
    ``fastops=True`` calls our ops directly (what ``inductor_ext.export`` needs: it applies no
    rewrites). Same parameters either way.
    """

    def __init__(self, vocab: int, hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int,
                 fastops: bool = False, max_positions: int = 4096) -> None:  # fmt: skip
        super().__init__()
        self.fastops = fastops
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderLayer(hidden, heads, kv_heads, intermediate, fastops) for _ in range(layers))
        self.norm = (inductor_ext.nn.RMSNorm if fastops else LlamaRMSNorm)(hidden, eps=1e-6)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        head_dim = hidden // heads
        inv_freq = 10000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq).repeat(1, 2)
        self.cos: Tensor
        self.sin: Tensor
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        x = self.embed_tokens(input_ids)
        s = input_ids.shape[1]
        cos, sin = self.cos[None, :s].to(x.dtype), self.sin[None, :s].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        if self.fastops:
            return inductor_ext.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))  # HF ForCausalLMLoss


def config_for(device: str) -> tuple[dict[str, Any], int, int]:
    sizes = dict(SIZES[device])
    return sizes, sizes.pop("batch"), sizes.pop("seq")


def tuning_entry() -> tuple[nn.Module, list[tuple[tuple[int, int], torch.dtype]]]:
    """For ``python -m inductor_ext.tuning tune --entry quickstart:tuning_entry`` (called on the meta device)."""
    config, batch, seq = config_for(os.environ.get("QUICKSTART_DEVICE", "cpu"))
    dtype = getattr(torch, os.environ.get("QUICKSTART_DTYPE", "float32"))
    return TinyLlama(**config).to(dtype), [((batch, seq), torch.long), ((batch, seq), torch.long)]


# ---------------------------------------------------------------- the demo


class RouteLog(logging.Handler):
    """Collects the backend's route decisions from its INFO log lines (``fastops_inductor: op(sig) -> route (why; ...)``).

    The decisions are logged on every compile, also when Inductor's caches serve the compiled code (the
    per-trace counters ``counters["inductor_ext"]["fastops::<op>-><route>"]`` then stay empty).
    """

    PATTERN = re.compile(r"fastops_inductor: fastops::(\w+)\(.*\) -> (\w+) \(([^;]*);")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.decisions: list[tuple[str, str, str]] = []
        logger = logging.getLogger("inductor_ext")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        match = self.PATTERN.match(record.getMessage())
        if match and match.groups() not in self.decisions:
            self.decisions.append(match.groups())  # type: ignore[arg-type]


def rel_err(a: Tensor, b: Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def loss_and_grads(
    model: Callable[..., Tensor], params: Mapping[str, Tensor], ids: Tensor, labels: Tensor
) -> dict[str, Tensor]:
    loss = model(ids, labels)
    return {"loss": loss.detach(), **dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))}


def median_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, return_mode="median"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="inductor_ext_quickstart_") as workdir:
        # a throwaway tuning database (for the tuner and the backend) and package, removed at exit
        os.environ["INDUCTOR_EXT_CACHE_DIR"] = workdir
        return demo(args.device, Path(workdir))


def demo(device_name: str, workdir: Path) -> int:
    device, on_cuda = torch.device(device_name), device_name == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    config, batch, seq = config_for(device_name)
    print(f"device {device}, {dtype}, {config['layers']} layers x hidden {config['hidden']}, "
          f"{batch}x{seq} tokens; tuning database and package in {workdir} (removed at exit)")  # fmt: skip

    # 1. Tune from shapes alone, before any compile
    print("\n== 1. python -m inductor_ext.tuning tune --entry quickstart:tuning_entry")
    env = {**os.environ, "QUICKSTART_DEVICE": device_name, "QUICKSTART_DTYPE": str(dtype).removeprefix("torch."),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "inductor_ext.tuning", "tune", "--entry", "quickstart:tuning_entry",
                    "--device", device_name], env=env, check=True)  # fmt: skip
    print(f"({time.perf_counter() - start:.1f} s)")

    # 2. torch.compile with the backend, on the unmodified HF spelling
    print('\n== 2. torch.compile(model, backend="fastops_inductor")')
    torch.manual_seed(0)
    model = TinyLlama(**config).to(device=device, dtype=dtype)
    ids = torch.randint(0, config["vocab"], (batch, seq), device=device)
    labels = torch.randint(0, config["vocab"], (batch, seq), device=device)
    params = dict(model.named_parameters())
    counters = torch._dynamo.utils.counters
    counters.clear()
    route_log = RouteLog()
    compiled = torch.compile(model, backend="fastops_inductor", fullgraph=True)
    start = time.perf_counter()
    compiled_out = loss_and_grads(compiled, params, ids, labels)
    print(
        f"first step (compile) {time.perf_counter() - start:.1f} s, graph breaks: {sum(counters['graph_break'].values())}"
    )
    eager_out = loss_and_grads(model, params, ids, labels)
    ours = counters["inductor_ext"]
    print(
        "rewritten:",
        ", ".join(f"{k.removeprefix('rewrite_')} x{n}" for k, n in sorted(ours.items()) if k.startswith("rewrite_")),
    )
    print("routes (our kernels or Inductor's code; on CPU always Inductor's):")
    for op, route, why in route_log.decisions:
        print(f"  {op:<20} -> {route:<8} ({why})")
    errors = {k: rel_err(compiled_out[k], eager_out[k]) for k in eager_out}
    worst = max(errors, key=errors.__getitem__)
    print(f"loss eager {eager_out['loss'].item():.5f}, compiled {compiled_out['loss'].item():.5f}; "
          f"worst relative error {errors[worst]:.2e} ({worst}; bound {TOLERANCE[dtype]:g})")  # fmt: skip
    if errors[worst] > TOLERANCE[dtype] or counters["graph_break"]:
        raise AssertionError(
            f"compiled disagrees with eager or broke the graph: {errors}, {dict(counters['graph_break'])}"
        )
    if on_cuda:
        eager_ms = median_ms(lambda: loss_and_grads(model, params, ids, labels))
        compiled_ms = median_ms(lambda: loss_and_grads(compiled, params, ids, labels))
        print(f"fwd+bwd median: eager {eager_ms:.3f} ms, compiled {compiled_ms:.3f} ms")

    # 3. AOTInductor export of the same weights written with our ops, then load and run
    print("\n== 3. inductor_ext.export(...) -> .pt2, inductor_ext.load(...)")
    exportable = TinyLlama(**config, fastops=True).to(device=device, dtype=dtype).eval()
    exportable.load_state_dict(model.state_dict())
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)  # torch.export's own
    start = time.perf_counter()
    with torch.no_grad():
        path = inductor_ext.export(exportable, (ids,), workdir / "tiny_llama.pt2")
    print(f"exported {path.name} ({path.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s")
    package = inductor_ext.load(path)
    with torch.no_grad():
        expected, logits = model(ids), package(ids)
    error = rel_err(logits, expected)
    print(f"package logits vs eager: relative error {error:.2e}")
    if error > TOLERANCE[dtype]:
        raise AssertionError(f"exported package disagrees with eager: {error:.3g}")
    if on_cuda:
        with torch.no_grad():
            print(f"forward median: eager {median_ms(lambda: model(ids)):.3f} ms, "
                  f"package {median_ms(lambda: package(ids)):.3f} ms")  # fmt: skip

    print("\nOK: tuned, compiled (matches eager, no graph breaks), exported and loaded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
