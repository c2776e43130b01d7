"""Diagnostics for the H200: host-overhead profile and per-kernel GPU times of RMSNorm fwd+bwd."""
import cProfile, pstats, io, time, sys
import torch, triton.testing
from inductor_ext.ops.rms_norm import rms_norm, rms_norm_ref, rms_norm_bwd_kernels, rms_norm_fwd_kernels
from inductor_ext.ops._library import DirectLaunch

def prof(name, fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / n * 1e6
    pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"==== {name}: {dt:.1f} us/call (under cProfile)"); print(s.getvalue()[-4000:])

x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
def fwd():
    with torch.no_grad(): rms_norm(x, w)
prof("fastops fwd no-grad", fwd)
L = DirectLaunch()
def bare():
    with torch.no_grad(): rms_norm_fwd_kernels(L, x, w, 1e-6, 0.0, "llama")
prof("direct kernels fwd", bare)
def empty_only():
    torch.empty(4, 4096, device="cuda")
prof("torch.empty", empty_only, 1000)
prof("fastops fwd+bwd", lambda: torch.autograd.grad(rms_norm(x, w), (x, w), dy), 200)

M, N = 32768, 4096
x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
cref = torch.compile(rms_norm_ref)
_, rstd = rms_norm_fwd_kernels(L, x.detach(), w.detach(), 1e-6, 0.0, "llama")
cases = {
    "fwd kernels only": lambda: rms_norm_fwd_kernels(L, x.detach(), w.detach(), 1e-6, 0.0, "llama"),
    "bwd kernels only": lambda: rms_norm_bwd_kernels(L, dy, x.detach(), w.detach(), rstd, 0.0, "llama"),
    "compile ref autograd.grad": lambda: torch.autograd.grad(cref(x, w), (x, w), dy),
    "fastops autograd.grad": lambda: torch.autograd.grad(rms_norm(x, w), (x, w), dy),
    "compile ref fwd no-grad": lambda: cref(x.detach(), w.detach()),
}
for k, f in cases.items():
    print(f"{k:30s} {triton.testing.do_bench(f, warmup=50, rep=200, return_mode='median'):.4f} ms")
for k in ("compile ref autograd.grad", "fastops autograd.grad"):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as p:
        for _ in range(10): cases[k]()
        torch.cuda.synchronize()
    print("====", k); print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12))
