"""The tuning database: one JSON file of measured choices, safe to share between processes.

Location: ``$INDUCTOR_EXT_CACHE_DIR/tuning.json`` (default ``~/.cache/inductor_ext``).
Each entry is keyed by what it was measured for (op, argument signature, GPU) and
stores the versions it was measured with; an entry whose versions differ from the
running ones is ignored (and dropped on the next write). Writers take a file lock,
re-read, merge and atomically replace the file, so concurrent processes lose no
entry and a process killed mid-write leaves the previous file intact.
"""

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import filelock
import torch
import triton

from inductor_ext.version import __version__


def cache_dir() -> Path:
    return Path(os.environ.get("INDUCTOR_EXT_CACHE_DIR", Path.home() / ".cache" / "inductor_ext"))


def current_versions() -> dict[str, str]:
    return {"inductor_ext": __version__, "torch": torch.__version__, "triton": triton.__version__}


class TuningDatabase:
    """``get``/``put`` of JSON-serialisable records under string keys."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_dir() / "tuning.json"
        self._lock = filelock.FileLock(str(self.path) + ".lock")

    def get(self, key: str) -> dict[str, Any] | None:
        entry = self._read().get(key)
        if entry is None or entry.get("versions") != current_versions():
            return None
        return entry["record"]

    def put(self, key: str, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            entries = {k: e for k, e in self._read().items() if e.get("versions") == current_versions()}
            entries[key] = {"versions": current_versions(), "record": record}
            self._write(entries)

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for key, entry in sorted(self._read().items()):
            if entry.get("versions") == current_versions():
                yield key, entry["record"]

    def clear(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._write({})

    def _read(self) -> dict[str, Any]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"tuning database {self.path} is not valid JSON ({error}); delete it or run "
                             "`python -m inductor_ext.autotune clear`") from error  # fmt: skip
        return data.get("entries", {}) if isinstance(data, dict) else {}

    def _write(self, entries: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"entries": entries}, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
