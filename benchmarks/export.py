"""``python -m benchmarks.export [--out DIR] [--layers 4] [--batch 4] [--seq 1024]``: a Llama-style
decoder stack (:mod:`benchmarks.llama_style`, bf16, inference forward) exported with
:func:`inductor_ext.export`, side by side with eager, ``torch.compile`` and
``torch.compile(backend="fastops_inductor")``.

Reports export time, package size, the cubins in the package, and per-call latency
(median of ``do_bench``: host and device, the way a server sees it) of each provider in
this process, plus the C++ runner's median (its own process, one-element device sync).
Outputs are checked against a float32 copy of the model.
"""

import functools
import json
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import inductor_ext
from benchmarks.harness import do_bench_median, model_bench_parser, parse_on_gpu, rel_err
from benchmarks.llama_style import LlamaStyleDecoder


def main(argv: list[str] | None = None) -> int:
    parser = model_bench_parser("python -m benchmarks export", __doc__, layers=4, batch=4, seq=1024)
    args = parse_on_gpu(parser, argv)
    from tabulate import tabulate

    from inductor_ext.runtime.cpp_runner import run_package

    torch.manual_seed(0)
    model = LlamaStyleDecoder(layers=args.layers).cuda().to(torch.bfloat16).eval()
    x = torch.randn(args.batch, args.seq, 2048, device="cuda", dtype=torch.bfloat16)
    reference = LlamaStyleDecoder(layers=args.layers).cuda().eval()
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        ref = reference(x.float())
    args.out.mkdir(parents=True, exist_ok=True)
    package = Path(tempfile.mkdtemp()) / "llama_decoder.pt2"  # weights included: not a result file
    start = time.perf_counter()
    # Dim.DYNAMIC: see tests/gpu/test_export_gpu.py
    dynamic = ({0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC},)
    inductor_ext.export(model, (x,), package, dynamic_shapes=dynamic)
    export_s = time.perf_counter() - start
    with zipfile.ZipFile(package) as archive:
        cubins = sorted(Path(n).name for n in archive.namelist() if n.endswith(".cubin"))
    loaded = inductor_ext.load(package)

    providers: dict[str, Callable[..., Any]] = {
        "eager": model,
        "torch_compile": torch.compile(model),
        "fastops_backend": torch.compile(model, backend="fastops_inductor"),
        "aoti_package": loaded,
    }
    rows, report = [], {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "export_s": export_s,
                        "package_mb": package.stat().st_size / 2**20, "cubins": cubins, "shape": [args.batch, args.seq],
                        "layers": args.layers, "providers": {}}  # fmt: skip
    with torch.no_grad():
        for name, fn in providers.items():
            out = fn(x)
            ms, p20, p80 = do_bench_median(functools.partial(fn, x))
            report["providers"][name] = {"ms": ms, "p20": p20, "p80": p80, "rel_err_vs_fp32": rel_err(out, ref)}
        cpp = run_package(package, [x], device="cuda", iters=50)
        report["providers"]["cpp_runner"] = {
            "ms": cpp.latency_ms,
            "rel_err_vs_fp32": rel_err(cpp.outputs[0].cuda(), ref),
        }
    base = report["providers"]["fastops_backend"]["ms"]
    for name, r in report["providers"].items():
        rows.append((name, f"{r['ms']:.3f}", f"{r['ms'] / base:.3f}", f"{r['rel_err_vs_fp32']:.2e}"))
    (args.out / "export_llama.json").write_text(json.dumps(report, indent=1))
    print(f"export {export_s:.1f} s, package {report['package_mb']:.1f} MiB, {len(cubins)} cubins: {cubins}")
    print(tabulate(rows, headers=["provider", "ms", "vs fastops_backend", "rel err vs fp32"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
