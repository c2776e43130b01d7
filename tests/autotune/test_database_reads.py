"""The tuning database parses its file once per version of it, not once per read."""

import os
import time

from inductor_ext.tuning.database import TuningDatabase


def _age(path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_reads_parse_each_version_of_the_file_once(tmp_path, monkeypatch):
    parses = []
    real = TuningDatabase._parse
    monkeypatch.setattr(TuningDatabase, "_parse", lambda self, text: parses.append(1) or real(self, text))
    path = tmp_path / "tuning.json"
    db = TuningDatabase(path)
    db.put("a", {"config": 1})
    _age(path, 10)
    parses.clear()
    assert [db.get("a") for _ in range(5)] == [{"config": 1}] * 5 and len(parses) == 1
    db.get("a")["config"] = 99  # a caller's change to its copy reaches nobody
    assert TuningDatabase(path).get("a") == {"config": 1} and len(parses) == 1

    TuningDatabase(path).put("b", {"config": 2})  # another writer replaces the file
    _age(path, 10)
    parses.clear()
    assert db.get("a") == {"config": 1} and db.get("b") == {"config": 2} and len(parses) == 1


def test_a_recent_in_place_edit_of_the_same_size_is_seen(tmp_path):
    path = tmp_path / "tuning.json"
    db = TuningDatabase(path)
    db.put("a", {"config": 1})
    for value in (2, 3):  # within the file system's timestamp granularity, same size, same inode
        path.write_text(path.read_text().replace(f'"config": {value - 1}', f'"config": {value}'))
        assert db.get("a") == {"config": value}
