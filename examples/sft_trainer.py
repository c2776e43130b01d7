"""Fine-tune with TRL's ``SFTTrainer`` on packed, padding-free rows, with inductor_ext.

    python examples/sft_trainer.py                       # CPU: a tiny random Llama, 40 steps (under a minute)
    python examples/sft_trainer.py --lora                # the same with PEFT LoRA adapters
    python examples/sft_trainer.py --model Qwen/Qwen3-0.6B --lora --max-length 2048 --steps 200   # a GPU

Two lines make the difference (docs/trainers.md):

- ``inductor_ext.models.apply(model)`` runs PEFT's LoRA (and QLoRA) layers on the fused LoRA ops. The loss
  is TRL's own chunked LM head from TRL 1.15 on (older TRL calls the model's forward, whose fused LM head
  + loss ``apply`` provides);
- ``model.get_decoder().compile(backend="fastops_inductor")`` compiles the decoder in place (norms, RoPE,
  the GLU and the packed-document attention on our kernels); TRL's head runs around it.

With no ``--model``, the model is a tiny Llama built from a config (random weights, no download) with a
word-level tokenizer over its 256 tokens, and the data a task it can learn in a few dozen steps: each
document counts up from a random token (``t5 t6 t7 ...``), so after its first token every next one is
predictable. The documents have different lengths; ``packing=True`` packs them into rows of
``--max-length`` tokens and ``padding_free=True`` flattens each batch into one row whose ``position_ids``
restart at every document. ``pad_to_multiple_of`` pads that row to ``--batch x --max-length`` tokens, so
every step has one shape and the decoder compiles once (without it, the second length recompiles it with
dynamic shapes).
"""

import argparse
import math
import random
import tempfile
import time

import torch

import inductor_ext
from inductor_ext import models


def counting_documents(count: int, vocab: int, max_length: int, seed: int = 0) -> list[str]:
    """``count`` documents ``t<s> t<s+1> ...`` (mod ``vocab``) of 4 to ``max_length / 2`` tokens."""
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        start, length = rng.randrange(vocab), rng.randint(4, max(4, max_length // 2))
        documents.append(" ".join(f"t{(start + i) % vocab}" for i in range(length)))
    return documents


def tiny_model_and_tokenizer(device: str):
    """A tiny random Llama (``inductor_ext.bench.train``'s ``tiny-llama``) and a word-level tokenizer over
    its vocabulary: ``t0`` ... ``t253``, then the padding and end-of-sequence tokens."""
    import tokenizers
    import transformers

    from inductor_ext.bench.train import MODELS, build_model

    vocab = MODELS["tiny-llama"]["vocab_size"]
    words = {f"t{i}": i for i in range(vocab - 2)} | {"<pad>": vocab - 2, "<eos>": vocab - 1}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    return build_model("tiny-llama", device, torch.float32), wrapped, vocab - 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a transformers causal LM (hub id or path); default: a tiny random Llama")
    parser.add_argument("--lora", action="store_true", help="train PEFT LoRA adapters (rank 16) on every linear layer")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=4, help="packed rows per step")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per packed row")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--no-compile", action="store_true", help="run the decoder eagerly")
    parser.add_argument("--output-dir", help="the trainer's output folder (default: a temporary one, removed at exit)")
    args = parser.parse_args()

    import datasets
    import transformers
    import trl

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model is None:
        model, tokenizer, words = tiny_model_and_tokenizer(device)
    else:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, device_map=device)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        words = 1000  # the counting task's words: t0 ... t999, a few tokens each
    if args.lora:
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets))

    report = models.apply(model)
    print(f"models.apply: {report.family}, {len(report.lora)} LoRA layers and {len(report.lora_mlps)} MLPs fused")
    if not args.no_compile:
        model.get_decoder().compile(backend="fastops_inductor")

    documents = counting_documents(8 * args.steps * args.batch, words, args.max_length)
    scratch = tempfile.TemporaryDirectory(prefix="sft_trainer_") if args.output_dir is None else None  # removed at exit
    config = trl.SFTConfig(
        args.output_dir if scratch is None else scratch.name,
        packing=True,
        padding_free=True,
        max_length=args.max_length,
        pad_to_multiple_of=args.batch * args.max_length,  # every batch one shape: the decoder compiles once
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        report_to="none",
        bf16=device == "cuda",  # TRL's default (bf16 autocast) is slow on CPU
        gradient_checkpointing=device == "cuda",  # TRL's default; the tiny CPU model does not need it
        use_cpu=device == "cpu",
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"text": documents}),
        processing_class=tokenizer,
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    compiled = "" if args.no_compile else " including the compile"
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (ln(vocab) = {math.log(len(tokenizer)):.4f}) in {args.steps} "
          f"steps, {seconds:.1f} s on {device}{compiled} (inductor_ext {inductor_ext.__version__})")  # fmt: skip


if __name__ == "__main__":
    main()
