"""A Llama-style decoder stack for model-level benchmarks and export tests, in two spellings.

Each layer: ``h = x + o_proj(attention(rope(q, k), v))`` on ``rms_norm(x)`` (grouped-query
attention through ``scaled_dot_product_attention``), then ``h + down(swiglu(gate, up))`` on
``rms_norm(h)``, with HF's module layout (separate q/k/v and gate/up projections). Hidden
states in, hidden states out (no embedding or LM head): the part of a model whose ops we
replace.

``spelling="fastops"`` calls our ops (``inductor_ext.nn.RMSNorm``, with the attention's residual
add fused into the MLP's norm, ``apply_rotary_pos_emb``, ``swiglu``); ``spelling="hf"`` writes them as transformers'
Llama does (``LlamaRMSNorm``'s float upcast, ``rotate_half``, ``silu(gate) * up``), the
unmodified model that ``backend="fastops_inductor"`` rewrites. Same parameters, same math.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import inductor_ext
from inductor_ext.ops.rope import rotate_half

SPELLINGS = ("fastops", "hf")


class HFRMSNorm(nn.Module):
    """transformers' ``LlamaRMSNorm`` forward."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _hf_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (``cos``/``sin`` of shape (B, S, D), ``unsqueeze_dim=1``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class LlamaStyleLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int, spelling: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.spelling = heads, kv_heads, hidden // heads, spelling
        norm = inductor_ext.nn.RMSNorm if spelling == "fastops" else HFRMSNorm
        self.input_layernorm = norm(hidden, eps=1e-5)
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_attention_layernorm = norm(hidden, eps=1e-5)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, d = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.spelling == "fastops":
            q, k = inductor_ext.apply_rotary_pos_emb(q, k, cos, sin)
        else:
            q, k = _hf_rope(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn_out = self.o_proj(attn.transpose(1, 2).reshape(b, s, d))
        if self.spelling == "fastops":
            h, x = self.post_attention_layernorm(x, attn_out)  # the residual add inside the norm
            mlp = inductor_ext.swiglu(self.gate_proj(h), self.up_proj(h))
        else:
            x = x + attn_out
            h = self.post_attention_layernorm(x)
            mlp = F.silu(self.gate_proj(h)) * self.up_proj(h)
        return x + self.down_proj(mlp)


class LlamaStyleDecoder(nn.Module):
    """``layers`` decoder layers and the final norm; RoPE tables for up to ``max_positions`` tokens."""

    def __init__(
        self,
        hidden: int = 2048,
        heads: int = 16,
        kv_heads: int = 4,
        intermediate: int = 5632,
        layers: int = 4,
        max_positions: int = 8192,
        rope_theta: float = 500000.0,
        spelling: str = "fastops",
    ) -> None:
        super().__init__()
        if spelling not in SPELLINGS:
            raise ValueError(f"LlamaStyleDecoder: spelling must be one of {SPELLINGS}, got {spelling!r}")
        self.layers = nn.ModuleList(
            LlamaStyleLayer(hidden, heads, kv_heads, intermediate, spelling) for _ in range(layers)
        )
        self.norm = (inductor_ext.nn.RMSNorm if spelling == "fastops" else HFRMSNorm)(hidden, eps=1e-5)
        head_dim = hidden // heads
        inv_freq = rope_theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos: Tensor
        self.sin: Tensor
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        s = x.shape[1]
        cos, sin = self.cos[None, :s].to(x.dtype), self.sin[None, :s].to(x.dtype)  # (1, S, D), as HF's
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)
