"""A Llama-style decoder stack built on our ops, for model-level benchmarks and export tests.

Each layer: ``h = x + o_proj(attention(rope(q, k), v))`` on ``rms_norm(x)`` (grouped-query
attention through ``scaled_dot_product_attention``), then ``h + down(swiglu(gate_up(rms_norm(h))))``.
Hidden states in, hidden states out (no embedding or LM head): the part of a model whose
ops we replace.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import inductor_ext


class LlamaStyleLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.input_layernorm = inductor_ext.nn.RMSNorm(hidden, eps=1e-5)
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.post_attention_layernorm = inductor_ext.nn.RMSNorm(hidden, eps=1e-5)
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, d = x.shape
        qkv = self.qkv_proj(self.input_layernorm(x)).view(b, s, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.transpose(1, 2).split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        q, k = inductor_ext.apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, d))
        return h + self.down_proj(inductor_ext.swiglu_packed(self.gate_up_proj(self.post_attention_layernorm(h))))


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
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LlamaStyleLayer(hidden, heads, kv_heads, intermediate) for _ in range(layers))
        self.norm = inductor_ext.nn.RMSNorm(hidden, eps=1e-5)
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
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)
