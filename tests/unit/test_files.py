"""Atomic writes: a failure at the rename leaves the old file and no temporary beside it. Reading the YAML
documents a user hands in: one line for each way a file is not one."""

from __future__ import annotations

import json

import pytest

from b70ctl import files
from b70ctl.errors import BadInput


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


@pytest.mark.parametrize(("content", "problem"), [
    (None, "where: No such file or directory: fix"),
    (b"a: 1\n b: [\n", "where: not valid YAML (line 2: mapping values are not allowed here): fix"),
    (b"a: 1\nb: 2\na: 3\n", "where: key 'a' on line 3 is given already on line 1: keep one"),
    (b"name: caf\xe9\n", "where: not UTF-8 text (byte 9): fix"),
    (b"- a\n", "where: expected a mapping, found a list: fix"),
    (b"", "where: expected a mapping, found an empty document: fix"),
    (b"# " + b"x" * 100 + b"\n", "where: 103 bytes, over the 64 bytes cap: fix"),
])
def test_a_yaml_file_that_is_not_a_mapping_is_one_line(tmp_path, content, problem):
    """Recipes, release matrices, package sets and diagnose catalogues are read by this one function: each way a
    file is not the mapping its caller validates is one BadInput line, `where` first and `fix` last."""
    path = tmp_path / "document.yaml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(BadInput) as refused:
        files.read_yaml_mapping(path, "where", "fix", limit=64)
    assert problem in str(refused.value) and "\n" not in str(refused.value)


def test_a_yaml_mapping_reads_as_safe_load_reads_it(tmp_path):
    path = tmp_path / "document.yaml"
    path.write_text("a: 1\nb: [yes, '2', null]\nc: {d: 1.5}\n")
    assert files.read_yaml_mapping(path, "where", "fix") == {"a": 1, "b": [True, "2", None], "c": {"d": 1.5}}


@pytest.mark.parametrize("content", [None, b"{cut short", b"[1]", b"\xff{}", b"{}" + b" " * 64])
def test_a_file_that_is_not_one_b70ctl_wrote_reads_as_none(tmp_path, content):
    """Markers, state files and records (generator.json, verified-ROLE.json, the conversion's provenance, a
    report left "running"): what such a file would have said is found again, never a reason to stop."""
    path = tmp_path / "marker.json"
    if content is not None:
        path.write_bytes(content)
    assert files.read_own_json_object(path, limit=64) is None
    assert files.read_own_json_object(tmp_path, limit=64) is None  # a directory where the file should be


def test_a_file_b70ctl_wrote_reads_as_its_object(tmp_path):
    path = tmp_path / "marker.json"
    files.write_json_atomically(path, {"generator_version": 1, "spec": {"seed": 1}})
    assert files.read_own_json_object(path) == {"generator_version": 1, "spec": {"seed": 1}}
