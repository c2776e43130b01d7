"""The tuning database: one JSON file of timed choices, safe to share between processes.

Location: ``$INDUCTOR_EXT_CACHE_DIR/tuning.json``; without the variable,
``$XDG_CACHE_HOME/inductor_ext/tuning.json`` (``~/.cache/inductor_ext`` when that is unset too).

Format: ``{"entries": {key: {"versions": {...}, "record": {...}}}}``. Each entry is keyed
by what it was timed for (op, argument signature, device: see
:func:`inductor_ext.tuning.routes.route_key`) and stores the versions it was timed
with; an entry whose versions differ from the running ones (:func:`current_versions`) is
ignored, and dropped on the next write.

Concurrency: writers take a file lock (``tuning.json.lock``), re-read, merge and
atomically replace the file (write a temporary in the same directory, fsync,
``os.replace``). So concurrent processes or ranks lose no entry, and a process killed
mid-write leaves the previous file intact; its orphaned temporary is removed by the
next writer (temporaries exist only while a writer holds the lock).

Reads: a parsed file is kept per process, keyed by its inode, modification time and size, so the
traced launches of one compile (each asks the database for its config) parse it once; a write
here or by another process replaces the file and so its inode, and the next read parses again.
A file modified in the last :data:`RACY_SECONDS` is parsed on every read, as git treats a racily
clean index: a second in-place edit within the file system's timestamp granularity, of the same
size, would otherwise go unseen. Records are returned as copies.
"""

import copy
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import filelock
import torch
import triton

from inductor_ext.version import __version__


def cache_dir() -> Path:
    if "INDUCTOR_EXT_CACHE_DIR" in os.environ:
        return Path(os.environ["INDUCTOR_EXT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inductor_ext"


def current_versions() -> dict[str, str]:
    return {"inductor_ext": __version__, "torch": torch.__version__, "triton": triton.__version__}


RACY_SECONDS = 2.0
"""A file modified more recently than this is not served from the parsed copy."""

_PARSED: dict[Path, tuple[tuple[int, int, int], dict[str, Any]]] = {}
"""Database path -> ((inode, mtime in ns, size) of the file when parsed, its entries)."""
_PARSED_LOCK = threading.Lock()


class TuningDatabase:
    """``get``/``put`` of JSON-serialisable records under string keys."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_dir() / "tuning.json"
        self._lock = filelock.FileLock(str(self.path) + ".lock")

    def get(self, key: str) -> dict[str, Any] | None:
        entry = self._read().get(key)
        if entry is None or entry["versions"] != current_versions():
            return None
        return copy.deepcopy(entry["record"])

    def put(self, key: str, record: dict[str, Any]) -> None:
        self.update({key: record})

    def update(self, records: Mapping[str, dict[str, Any]]) -> None:
        """Store several records in one locked read-merge-replace."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        versions = current_versions()
        with self._lock:
            entries = {k: e for k, e in self._read().items() if e["versions"] == versions}
            entries.update({k: {"versions": versions, "record": r} for k, r in records.items()})
            self._write(entries)

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Current-version ``(key, record)`` pairs, sorted by key."""
        for key, entry in sorted(self._read().items()):
            if entry["versions"] == current_versions():
                yield key, copy.deepcopy(entry["record"])

    def clear(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._write({})

    def _read(self) -> dict[str, Any]:
        """The file's entries (not to be mutated: shared by every reader of this file's version)."""
        try:
            stat = self.path.stat()
            stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            with _PARSED_LOCK:
                parsed = _PARSED.get(self.path)
            if parsed is not None and parsed[0] == stamp:
                return parsed[1]
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        entries = self._parse(text)
        if time.time_ns() - stat.st_mtime_ns > RACY_SECONDS * 1e9:
            with _PARSED_LOCK:  # replaced since the stat: the next read's stamp differs, and it parses again
                _PARSED[self.path] = (stamp, entries)
        return entries

    def _parse(self, text: str) -> dict[str, Any]:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise self._malformed(f"is not valid JSON ({error})") from error
        entries = data.get("entries") if isinstance(data, dict) else None
        if not isinstance(entries, dict):
            raise self._malformed('has no "entries" object')
        for key, entry in entries.items():
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("versions"), dict)
                and isinstance(entry.get("record"), dict)
            ):
                raise self._malformed(
                    f'has a malformed entry {key!r} (expected {{"versions": {{...}}, "record": {{...}}}})'
                )
        return entries

    def _malformed(self, problem: str) -> ValueError:
        return ValueError(
            f"tuning database {self.path} {problem}; delete it or run `python -m inductor_ext.tuning clear`"
        )

    def _write(self, entries: dict[str, Any]) -> None:
        """Atomically replace the file (called with the lock held)."""
        for orphan in self.path.parent.glob(f"{self.path.name}*.tmp"):
            orphan.unlink(missing_ok=True)  # left by a writer killed mid-write
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
