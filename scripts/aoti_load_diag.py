"""Diagnose AOTInductor package loading (issue 6: loading any CUDA package segfaults on the H200 image).

One call gathers the evidence: the C++ runtimes the Python process has mapped, the
compile/link commands Inductor ran for a trivial model's wrapper, the wrapper ``.so``'s
dynamic section and the C++ runtime symbols it defines itself, and the outcome of
loading the package in fresh processes under several variants (plain, LD_PRELOAD of the
system libstdc++, the runtime pre-loaded with ctypes, a package linked with -lstdc++,
the C++ runner). Writes ``$OUT/aoti_load_diag.json`` and prints a summary.

    PYTHONPATH=$PWD python scripts/aoti_load_diag.py [--device cuda]
"""

import argparse
import ctypes.util
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

LOAD_AND_RUN = """
import sys, torch
if len(sys.argv) > 3: import ctypes; ctypes.CDLL(sys.argv[3], mode=ctypes.RTLD_GLOBAL)
run = torch._inductor.aoti_load_package(sys.argv[1])
x = torch.randn(8, 16, device=sys.argv[2])
y = run(x)
assert torch.allclose(y, (x * 2).relu() + 1), "wrong result"
print("ok")
"""


START = time.monotonic()


def progress(message: str) -> None:
    print(f"[{time.monotonic() - START:6.1f} s] {message}", file=sys.stderr, flush=True)


def mapped_runtimes() -> list[str]:
    """C++/gcc runtime libraries mapped into this process (after importing torch)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libstdc++" in line or "libgcc_s" in line}
    return sorted(paths)


def shell(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=False, timeout=120).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired) as error:
        return f"<{error}>"


def export_trivial(device: str, directory: Path, patches: dict) -> tuple[Path, list[str]]:
    """A package of (x * 2).relu() + 1, and every compiler command Inductor ran for it."""
    import torch
    from torch._inductor import cpp_builder

    commands: list[str] = []
    original = cpp_builder.run_compile_cmd

    def recording(cmd_line: str, cwd: str) -> None:
        commands.append(cmd_line)
        original(cmd_line, cwd)

    cpp_builder.run_compile_cmd = recording
    try:

        class Model(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return (x * 2).relu() + 1

        program = torch.export.export(Model(), (torch.randn(8, 16, device=device),))
        path = torch._inductor.aoti_compile_and_package(
            program, package_path=str(directory / "trivial.pt2"), inductor_configs=patches
        )
    finally:
        cpp_builder.run_compile_cmd = original
    return Path(path), commands


def wrapper_report(package: Path, directory: Path) -> dict:
    """NEEDED/RUNPATH of each .so in the package and how many C++ runtime symbols it defines."""
    out = {}
    with zipfile.ZipFile(package) as archive:
        for name in archive.namelist():
            if name.endswith(".so"):
                target = directory / Path(name).name
                target.write_bytes(archive.read(name))
                dynamic = shell(["readelf", "-d", str(target)])
                defined = shell(["nm", "-DC", "--defined-only", str(target)])
                symbols = defined.splitlines()
                regex = ("std::__cxx11::basic_regex", "std::__detail::_Compiler")
                out[name] = {
                    "needed_and_paths": [l.strip() for l in dynamic.splitlines() if "NEEDED" in l or "PATH" in l],
                    "defined_regex_symbols": sum(any(r in l for r in regex) for l in symbols),
                    "defined_locale_symbols": sum("codecvt" in l or "std::locale" in l for l in symbols),
                }
    return out


def load_in_fresh_process(package: Path, device: str, env_extra: dict, preload: str | None = None) -> dict:
    env = {**os.environ, **env_extra}
    args = [sys.executable, "-c", LOAD_AND_RUN, str(package), device] + ([preload] if preload else [])
    done = subprocess.run(args, capture_output=True, text=True, env=env, check=False, timeout=120)
    return {
        "returncode": done.returncode,
        "segfault": done.returncode == -11,
        "tail": (done.stdout + done.stderr)[-800:],
    }


def run_cpp(package: Path, device: str) -> dict:
    import torch

    try:
        from inductor_ext.cpp_runner import build_runner, run_package

        result = run_package(package, [torch.randn(8, 16)], device=device, runner=build_runner())
        return {"ok": True, "latency_ms": result.latency_ms}
    except Exception as error:  # noqa: BLE001  (a diagnostic: record whatever happens)
        return {"ok": False, "error": str(error)[-800:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    args = parser.parse_args()
    import torch

    system_stdcxx = ctypes.util.find_library("stdc++")
    ldconfig = [l.strip() for l in shell(["ldconfig", "-p"]).splitlines() if "libstdc++" in l]
    report: dict = {
        "python": sys.executable, "torch": torch.__version__, "cxx": shell([os.environ.get("CXX", "g++"), "--version"]).splitlines()[:1],
        "ldconfig_libstdcxx": ldconfig, "process_runtimes_after_import_torch": mapped_runtimes(),
        "find_library_stdcxx": system_stdcxx,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every step: a run cut short still leaves its evidence
        (args.out / "aoti_load_diag.json").write_text(json.dumps(report, indent=1))

    save()
    system_path = next((l.split("=>")[-1].strip() for l in ldconfig if "x86-64" in l or "x86_64" in l), None)
    work = Path(tempfile.mkdtemp())
    variants = {"default": {}, "link_stdcxx": {"aot_inductor.custom_op_libs": ["stdc++"]}}
    for name, patches in variants.items():
        directory = work / name
        directory.mkdir()
        progress(f"{name}: exporting")
        package, commands = export_trivial(args.device, directory, patches)
        progress(f"{name}: exported; loading in fresh processes")
        report[f"{name}_link_commands"] = [c for c in commands if " -shared" in c or " -o " in c]
        report[f"{name}_wrapper"] = wrapper_report(package, directory)
        report[f"{name}_load_plain"] = load_in_fresh_process(package, args.device, {})
        save()
        if name == "default":  # the C++ runner before the second variant: the more telling result
            progress("C++ runner")
            report["cpp_runner"] = run_cpp(package, args.device)
            save()
        if system_path:
            report[f"{name}_load_ld_preload"] = load_in_fresh_process(package, args.device, {"LD_PRELOAD": system_path})
            report[f"{name}_load_ctypes_preload"] = load_in_fresh_process(package, args.device, {}, preload=system_path)
        save()
    save()
    progress("done")
    print(json.dumps(report, indent=1)[-6000:])


if __name__ == "__main__":
    main()
