"""Common PyTorch / HF transformers spellings of the ops, reproduced verbatim (transformers is
not a test dependency): what the backend's rewrites must recognise and the autotuner traces."""

import torch


class LlamaRMSNorm(torch.nn.Module):
    """transformers.models.llama.modeling_llama.LlamaRMSNorm's forward, verbatim."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(torch.nn.Module):
    """transformers.models.gemma.modeling_gemma.GemmaRMSNorm, verbatim."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(0.1 * torch.randn(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class LlamaMLP(torch.nn.Module):
    """transformers' LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = {"silu": torch.nn.SiLU(), "gelu": torch.nn.GELU(), "gelu_tanh": torch.nn.GELU("tanh")}[act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class CausalLMLoss(torch.nn.Module):
    """The tail of HF ForCausalLMLoss: upcast, flatten, F.cross_entropy."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, labels):
        logits = logits.float()
        vocab = logits.shape[-1]
        return torch.nn.functional.cross_entropy(
            logits.view(-1, vocab), labels.view(-1), ignore_index=-100, reduction=self.reduction
        )


def rotate_half(x):
    """transformers' rotate_half, verbatim."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb, verbatim."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
