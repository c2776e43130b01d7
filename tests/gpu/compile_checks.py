"""Checks shared by the GPU tests of compiled graphs (tests/gpu/test_*_gpu.py)."""

import tempfile

import pytest
import torch

ISOLATED_CUDA_COMPILES = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.usefixtures("isolated_compiles"),
]
"""``pytestmark`` of a GPU test whose tests each compile against a tuning database of their own (conftest.py)."""


def gqa_llama(hidden: int, layers: int, batch: int, seq: int, vocab: int = 32000):
    """A seeded bf16 Llama in training mode on CUDA (16 heads, 4 key/value heads, tied embeddings, MLP 4x
    wide) and a batch of token ids for it."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).train()
    return model, torch.randint(0, vocab, (batch, seq), device="cuda")


def lm_step(model, ids, **compile_args):
    """One causal-LM training step's output and parameter gradients (labels = ``ids``), eager or
    ``torch.compile(model, fullgraph=True, **compile_args)``."""
    forward = torch.compile(model, fullgraph=True, **compile_args) if compile_args else model
    output = forward(input_ids=ids, labels=ids)
    grads = torch.autograd.grad(output.loss, [p for p in model.parameters() if p.requires_grad])
    return output, grads


def run_and_get_joined_code(fn, *args):
    """``fn(*args)`` and the code Inductor generated while it ran, as one string."""
    from torch._inductor.utils import run_and_get_code

    result, codes = run_and_get_code(fn, *args)
    return result, "\n".join(codes)


def record_benchmarked_kernels(monkeypatch) -> list[str]:
    """The names of the kernels Inductor benchmarks (``CachingAutotuner.benchmark_all_configs``)
    from now on, in order, for the rest of the test."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    names: list[str] = []
    original = CachingAutotuner.benchmark_all_configs

    def counting(self, *a, **kw):
        names.append(self.fn.__name__)
        return original(self, *a, **kw)

    monkeypatch.setattr(CachingAutotuner, "benchmark_all_configs", counting)
    return names


def compile_with_cpp_wrapper_counting_tuning(monkeypatch, fn, args, kernel_name):
    """Compile ``fn`` with ``cpp_wrapper`` and compile-time autotuning, run it twice on ``args``.

    Asserts that the generated code launches ``kernel_name``, that the kernel was
    tuned while compiling, and that running the compiled C++ wrapper tunes nothing.
    Returns the outputs of the first and the second call.

    Inductor's cache (where its autotuner keeps each kernel's best config) and the tuning database
    start empty: a config found in either would skip the compile-time tuning this checks.
    """
    from torch._inductor.utils import fresh_cache

    tuned = record_benchmarked_kernels(monkeypatch)
    compiled = torch.compile(fn, fullgraph=True)
    torch._dynamo.reset()
    config = {"cpp_wrapper": True, "triton.autotune_at_compile_time": True}
    with tempfile.TemporaryDirectory() as database, fresh_cache(), torch._inductor.config.patch(config):
        monkeypatch.setenv("INDUCTOR_EXT_CACHE_DIR", database)
        first, code = run_and_get_joined_code(compiled, *args)
        assert kernel_name in code
        assert any(kernel_name in name for name in tuned), tuned  # tuned while compiling
        calls_after_compile = len(tuned)
        second = compiled(*args)
    assert len(tuned) == calls_after_compile  # running the compiled C++ wrapper tunes nothing
    return first, second
