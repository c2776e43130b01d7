"""AOTInductor compiles of exported programs in worker processes, beside the caller's own compile.

``export_generation`` compiles several independent graphs of one model: the dynamic graph, and a static
decode graph per batch size. Each static graph compiles in a process of its own (:class:`CompileJob`)
while the caller compiles the dynamic graph, so the export waits for the longest compile, not their sum.

A worker gets the program through ``torch.export.save`` (its weights included, loaded onto their own
device), Inductor's config as the caller has it (``save_config``: a patch the caller made to
``torch._inductor.config`` holds in the worker too), the compile options, and the caller's environment
(the Inductor, Triton and tuning-database caches are shared). It runs
:func:`~inductor_ext.runtime.export.compile_program`, as the caller would, and hands back the paths of
the files it wrote and its compile timers, which are added to the caller's
(``torch._dynamo.utils.compilation_time_metrics``), so that the export's timers count every graph.

A graph whose weights would not fit twice more in its GPU's free memory compiles in the caller. Where a
job cannot cross the process boundary (a program ``torch.export.save`` refuses, an option that
does not pickle) or its worker fails, the program compiles in the caller, after a warning that says why:
the same files, later.

    python -m inductor_ext.runtime.compile_worker FOLDER    (the worker: run by CompileJob, not by users)
"""

import json
import logging
import pickle
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import compilation_time_metrics

from inductor_ext.runtime.export import compile_program

log = logging.getLogger(__name__)

_LOG_TAIL_LINES = 30
"""How many of a failed worker's last output lines its warning quotes."""


def _room_for_a_copy(program: torch.export.ExportedProgram) -> bool:
    """Whether a worker can load ``program``'s weights beside the caller's: on a GPU, free memory for twice
    their size (the copy, and as much again for the worker's compile); elsewhere always."""
    tensors = [t for t in (*program.state_dict.values(), *program.constants.values()) if isinstance(t, torch.Tensor)]
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    if not devices:
        return True
    size = sum(t.numel() * t.element_size() for t in tensors)
    return all(torch.cuda.mem_get_info(device)[0] >= 2 * size for device in devices)


class CompileJob:
    """``compile_program(program, options)`` started now in a worker process; :meth:`result` waits for it.

    ``name`` names the graph in warnings. Use as a context manager: leaving it stops a worker whose
    result was never asked for (the caller's own compile failed) and removes the job's folder.
    """

    def __init__(self, program: torch.export.ExportedProgram, options: Mapping[str, Any], name: str) -> None:
        self._program, self._options, self._name = program, dict(options), name
        self._folder = tempfile.TemporaryDirectory(prefix="inductor_ext_compile_")
        self._process: subprocess.Popen[bytes] | None = None
        folder = Path(self._folder.name)
        if not _room_for_a_copy(program):
            log.info("export: the graph %s compiles in this process: its device has no room for a second copy of "
                     "the weights", name)  # fmt: skip
            return
        try:
            job = pickle.dumps({"options": self._options, "inductor_config": torch._inductor.config.save_config()})
            torch.export.save(program, folder / "program.pt2")
        except Exception as error:  # noqa: BLE001  (any refusal to serialise: compiled in this process instead)
            self._in_caller_because(f"it cannot be handed to a worker process ({type(error).__name__}: {error})")
            return
        (folder / "job.pkl").write_bytes(job)
        with open(folder / "log.txt", "wb") as output:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "inductor_ext.runtime.compile_worker", str(folder)],
                stdout=output,
                stderr=subprocess.STDOUT,
            )

    def _in_caller_because(self, why: str) -> None:
        warnings.warn(f"export: the graph {self._name} compiles in this process: {why}", RuntimeWarning, stacklevel=3)
        self._process = None

    def result(self) -> list[Any]:
        """The compiled files, as ``compile_program`` returns them."""
        if self._process is not None:
            code = self._process.wait()
            folder = Path(self._folder.name)
            if code == 0:
                done = json.loads((folder / "result.json").read_text())
                for key, seconds in done["timers"].items():
                    compilation_time_metrics.setdefault(key, []).extend(seconds)
                return list(done["files"])
            tail = (folder / "log.txt").read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
            self._in_caller_because(f"its worker process failed (exit code {code}):\n" + "\n".join(tail))
        return compile_program(self._program, self._options)

    def __enter__(self) -> "CompileJob":  # noqa: PYI034  (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._folder.cleanup()


def main(argv: list[str] | None = None) -> int:
    """The worker: compile the job in ``FOLDER`` and write ``result.json`` there."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m inductor_ext.runtime.compile_worker FOLDER", file=sys.stderr)
        return 2
    folder = Path(args[0])
    job = pickle.loads((folder / "job.pkl").read_bytes())  # written by CompileJob in the calling process
    torch._inductor.config.load_config(job["inductor_config"])
    program = torch.export.load(folder / "program.pt2")
    counts = {key: len(values) for key, values in compilation_time_metrics.items()}
    files = compile_program(program, job["options"])
    if not all(isinstance(file, str) for file in files):
        raise TypeError(f"compile_worker: compile_program returned non-path files {[type(f).__name__ for f in files]}")
    # the timings this compile added to each timer, as the caller's own compile would have added them
    timers = {key: values[counts.get(key, 0) :] for key, values in compilation_time_metrics.items()}
    result = {"files": files, "timers": {key: seconds for key, seconds in timers.items() if seconds}}
    (folder / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
