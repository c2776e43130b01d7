"""Export an HF Llama for generation and generate from Python and from C++ (no Python in that process).

    python examples/generate.py                                   # CPU: a tiny random Llama (about a minute)
    python examples/generate.py --model llama-3.2-1b --device cuda --batch 8 --prompt 2048 --new 128

``inductor_ext.export_generation`` writes one ``.pt2`` package (prefill and decode over a static KV
cache, docs/export.md); ``inductor_ext.load_generation`` runs HF ``generate``'s greedy loop on it, and
``aoti_generate`` (``inductor_ext/csrc/generate.cpp``, built here with CMake) runs the same loop
in C++. The model is built from a config with random weights (no download), so the tokens mean
nothing; what the example checks is that the package and the C++ loop generate exactly what HF's
``generate`` does for the same prompt (in float32; in bf16 on a GPU, noise can flip a near-tie).
"""

import argparse
import tempfile
import time
from pathlib import Path

import torch

import inductor_ext
from inductor_ext.bench.train import MODELS, build_model
from inductor_ext.runtime.cpp_runner import run_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny-llama")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=12, help="prompt tokens per row")
    parser.add_argument("--new", type=int, default=16, help="tokens to generate per row")
    args = parser.parse_args()
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    model = build_model(args.model, args.device, dtype).eval()
    prompt = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device=args.device)

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        path = inductor_ext.export_generation(
            model, Path(folder) / "model.pt2", max_batch_size=args.batch, max_seq_len=args.prompt + args.new
        )
        print(f"exported {path.name} ({path.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s")

        python_tokens = inductor_ext.load_generation(path).generate(prompt, args.new)
        cpp = run_generate(path, prompt.cpu(), args.new, device=args.device, iters=3)
        with torch.no_grad():
            hf_tokens = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new, do_sample=False
            )
    print("generated (first row):", python_tokens[0, args.prompt :].tolist())
    print(f"C++ loop: prefill {cpp.prefill_ms:.2f} ms, decode {cpp.decode_ms_per_token:.2f} ms/token")
    same_python = torch.equal(python_tokens.cpu(), hf_tokens.cpu())
    same_cpp = torch.equal(cpp.tokens, hf_tokens.cpu())
    print(f"package == HF generate: {same_python}; C++ loop == HF generate: {same_cpp}")
    if dtype == torch.float32 and not (same_python and same_cpp):
        raise SystemExit("the package's tokens differ from HF generate's")


if __name__ == "__main__":
    main()
