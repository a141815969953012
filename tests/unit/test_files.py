"""Atomic writes: a failure at the rename leaves the old file and no temporary beside it."""

from __future__ import annotations

import json

import pytest

from b70ctl import files


class Interrupted(Exception):
    pass


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "fleet.md"
    files.write_text_atomically(target, "first\n")

    def failing_replace(source, destination):
        raise Interrupted

    monkeypatch.setattr(files.os, "replace", failing_replace)
    with pytest.raises(Interrupted):
        files.write_text_atomically(target, "second, half-written\n")
    assert target.read_text() == "first\n"
    assert [p.name for p in tmp_path.iterdir()] == ["fleet.md"]
    assert oct(target.stat().st_mode & 0o777) == "0o644"


def test_modes_directories_and_json(tmp_path):
    secret = tmp_path / "deep" / "er" / "key"
    files.write_text_atomically(secret, "k", mode=0o600)
    assert oct(secret.stat().st_mode & 0o777) == "0o600"
    files.write_json_atomically(tmp_path / "a.json", {"b": 1, "a": [1, 2]}, compact=True, sort_keys=True)
    assert (tmp_path / "a.json").read_text() == '{"a":[1,2],"b":1}'
    files.write_json_atomically(tmp_path / "b.json", {"x": 1})
    assert json.loads((tmp_path / "b.json").read_text()) == {"x": 1}
