"""Fine-tune a transformers Llama with inductor_ext: the model patch and the ``fastops_inductor`` backend.

    python examples/train_llama.py                      # CPU: a tiny random Llama, 30 steps (about a minute)
    python examples/train_llama.py --model llama-3.2-1b --batch 4 --seq 2048 --steps 100   # on a GPU

``inductor_ext.models.apply(model)`` puts the model's LM head + loss (in training with labels) on one
fused kernel that never builds the ``(tokens, vocab)`` logits. ``torch.compile(model,
backend="fastops_inductor")`` then compiles the step: its graph passes put the RMSNorms (with the
residual adds), RoPE and the SwiGLU on our kernels and recompute the norms' outputs in the backward.
The model is built from a config (random weights, no download; shapes in
``inductor_ext.bench.train.MODELS``). The data is a task it can learn in a few dozen steps: each
sequence counts up from a random token (``t, t+1, t+2, ...`` modulo the vocabulary), so after the
first token every next one is predictable and the loss falls from ``ln(vocab)`` towards
``ln(vocab) / seq`` (the unpredictable first token).
"""

import argparse
import math
import time

import torch
from tqdm import tqdm

import inductor_ext
from inductor_ext import models
from inductor_ext.bench.train import MODELS, build_model


def counting_batches(steps: int, batch: int, seq: int, vocab: int, device: str) -> list[torch.Tensor]:
    """Sequences ``t, t+1, ..., t+seq-1`` (mod vocab) from random ``t``: learnable next tokens."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, vocab, (steps, batch, 1), generator=generator)
    return list(((starts + torch.arange(seq)) % vocab).to(device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny-llama")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--no-compile", action="store_true", help="run the patched model eagerly")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(args.model, device, dtype)
    report = models.apply(model)
    print(f"patched {report.family}: fused LM head + loss {report.loss}")
    step_model = model if args.no_compile else torch.compile(model, backend="fastops_inductor")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device == "cuda")
    data = counting_batches(args.steps, args.batch, args.seq, MODELS[args.model]["vocab_size"], device)

    start = time.perf_counter()
    progress = tqdm(data, desc=f"training on {device} (inductor_ext {inductor_ext.__version__})", unit="step")
    for ids in progress:
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress.set_postfix(loss=f"{loss.item():.4f}")
    seconds = time.perf_counter() - start
    start_loss = math.log(MODELS[args.model]["vocab_size"])
    print(f"final loss {loss.item():.4f} (from about ln(vocab) = {start_loss:.4f}); "
          f"{args.steps * args.batch * args.seq / seconds:,.0f} tokens/s including the first step's compile")  # fmt: skip
    models.unapply(model)


if __name__ == "__main__":
    main()
