"""Graphs compiled in worker processes (:mod:`inductor_ext.runtime.compile_worker`): the same files as a
compile in the caller, the worker's compile timers counted in the caller, and a compile in the caller,
after a warning, wherever a job cannot go to a worker or its worker fails."""

import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import compilation_time_metrics

from inductor_ext.runtime import compile_worker
from inductor_ext.runtime.compile_worker import CompileJob
from inductor_ext.runtime.export import compile_program, export_program


class Block(torch.nn.Module):
    """Small enough to compile in seconds on CPU; an in-place cache write, as a decode step has."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.copy_(x)
        return torch.nn.functional.silu(self.proj(x)) * cache


@pytest.fixture(scope="module")
def program() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return export_program(Block().eval(), (torch.randn(4, 32), torch.zeros(4, 32)))


def test_a_worker_compiles_the_files_the_caller_would_and_reports_its_timers(program):
    before = sum(len(values) for values in compilation_time_metrics.values())
    with CompileJob(program, {}, "block") as job:
        files = job.result()
    assert all(Path(file).is_file() for file in files), files
    assert sum(len(values) for values in compilation_time_metrics.values()) > before  # the worker's timers
    # file names are hashes of their code: the same program and options compile to the same names
    assert sorted(Path(f).name for f in files) == sorted(Path(f).name for f in compile_program(program, {}))


def test_a_job_that_cannot_be_pickled_compiles_in_the_caller_after_a_warning(program, monkeypatch):
    compiled = []
    monkeypatch.setattr(compile_worker, "compile_program", lambda p, o: compiled.append(o) or ["in-caller"])
    options = {"post_grad_custom_post_pass": lambda graph: None}  # a callable does not pickle
    with pytest.warns(RuntimeWarning, match="the graph block compiles in this process: it cannot be handed"):
        job = CompileJob(program, options, "block")
    with job:
        assert job.result() == ["in-caller"] and compiled == [options]


def test_a_failed_worker_is_named_and_the_graph_compiles_in_the_caller(program, monkeypatch):
    monkeypatch.setattr(compile_worker, "compile_program", lambda p, o: ["in-caller"])
    with monkeypatch.context() as patched:
        patched.setattr(sys, "executable", "false")  # a worker that exits 1 at once, whatever its arguments
        job = CompileJob(program, {}, "block")
    with job, pytest.warns(RuntimeWarning, match=r"the graph block .* its worker process failed \(exit code 1\)"):
        assert job.result() == ["in-caller"]


def test_a_graph_whose_weights_would_not_fit_twice_compiles_in_the_caller(program, monkeypatch, recwarn):
    monkeypatch.setattr(compile_worker, "compile_program", lambda p, o: ["in-caller"])
    monkeypatch.setattr(compile_worker, "_room_for_a_copy", lambda p: False)
    with CompileJob(program, {}, "block") as job:
        assert job._process is None and job.result() == ["in-caller"]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]  # a routine case: logged, no warning


def test_leaving_the_job_stops_a_worker_whose_result_was_never_asked_for(program):
    job = CompileJob(program, {}, "block")
    with job:
        process = job._process
        assert process is not None
    assert process.poll() is not None  # killed, or already done
    assert not Path(job._folder.name).exists()


def test_the_worker_refuses_a_call_without_its_folder(capsys):
    assert compile_worker.main([]) == 2
    assert "usage: python -m inductor_ext.runtime.compile_worker FOLDER" in capsys.readouterr().err
