"""A model file sent to a host resumes where a cut transfer stopped: the role's b70_model_send (controller) and
b70_model_dir state=partial (host) keep NAME.partial, send only the chunks it lacks or holds wrong, and rename it
into place only when its sha256 matches the lock. The chunk code runs in-process here with the host's and the
controller's sides in two directories; the last test runs the action plugin itself through ansible-playbook."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
ROLE = REPO_ROOT / "roles" / "model_store"
_spec = importlib.util.spec_from_file_location("b70_model_dir", ROLE / "library" / "b70_model_dir.py")
assert _spec is not None and _spec.loader is not None
model_dir = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model_dir)

CHUNK = 64 << 10
BATCH = 4 * CHUNK
SIZE = 20 * CHUNK + 12_345  # 21 chunks, the last one short


class Cut(Exception):
    """The connection dropped."""


class Transport:
    """Stages chunks the way the action plugin does (one file per chunk in the host's temporary directory) and
    runs the host's step in-process; cut_after drops the connection after that many chunks were staged."""

    def __init__(self, source: Path, host_dir: Path, entry: dict, cut_after: int | None = None,
                 corrupt_once: set[int] | None = None) -> None:
        self.source, self.host_dir, self.entry = source, host_dir, entry
        self.cut_after, self.corrupt_once = cut_after, set(corrupt_once or ())
        self.staging = host_dir.parent / "ansible-tmp"
        self.staging.mkdir(exist_ok=True)
        self.staged: list[int] = []
        self.answers: list[dict] = []

    def stage(self, index: int, offset: int, length: int) -> str:
        if self.cut_after is not None and len(self.staged) >= self.cut_after:
            raise Cut()
        with open(self.source, "rb") as handle:
            handle.seek(offset)
            data = bytearray(handle.read(length))
        if index in self.corrupt_once:
            self.corrupt_once.discard(index)
            data[len(data) // 2] ^= 0x01
        staged = self.staging / f"chunk-{index}"
        staged.write_bytes(bytes(data))
        self.staged.append(index)
        return str(staged)

    def host(self, chunk_sha256: list[str], staged: dict[str, str], finish: bool) -> dict:
        answer = model_dir.transfer_chunks(str(self.host_dir), self.entry, CHUNK, chunk_sha256, staged, finish)
        self.answers.append(answer)
        return answer

    def send(self) -> dict:
        return model_dir.send_file(str(self.source), self.entry, CHUNK, BATCH, self.host, self.stage)


@pytest.fixture
def shard(tmp_path: Path) -> tuple[Path, dict, bytes]:
    data = random.Random(14).randbytes(SIZE)
    source = tmp_path / "cache" / "model-00001-of-00002.safetensors"
    source.parent.mkdir()
    source.write_bytes(data)
    entry = {"path": source.name, "size_bytes": SIZE, "sha256": hashlib.sha256(data).hexdigest()}
    return source, entry, data


def _host_dir(tmp_path: Path) -> Path:
    host_dir = tmp_path / "host" / "target"
    host_dir.mkdir(parents=True)
    return host_dir


def _chunks_from(offset: int) -> list[int]:
    return list(range(offset // CHUNK, -(-SIZE // CHUNK)))


def test_a_cut_transfer_resumes_after_the_last_whole_chunk_it_wrote(shard, tmp_path):
    source, entry, data = shard
    host_dir = _host_dir(tmp_path)
    final, partial = host_dir / source.name, host_dir / (source.name + ".partial")
    # The connection drops while the third batch is being staged (after 10 chunks: batches of 4).
    first = Transport(source, host_dir, entry, cut_after=10)
    with pytest.raises(Cut):
        first.send()
    assert not final.exists()
    assert partial.read_bytes() == data[:8 * CHUNK]  # two batches written; the staged third never was
    resumed = Transport(source, host_dir, entry)
    result = resumed.send()
    assert resumed.staged == _chunks_from(8 * CHUNK)
    assert (result["kept_bytes"], result["sent_bytes"]) == (8 * CHUNK, SIZE - 8 * CHUNK)
    assert final.read_bytes() == data and not partial.exists()
    assert oct(final.stat().st_mode & 0o777) == "0o644"
    assert sorted(os.listdir(resumed.staging)) == []  # the host's temporary space is given back


@pytest.mark.parametrize("cut_at", [1, CHUNK - 1, CHUNK, 5 * CHUNK + 777, SIZE - 1])
def test_a_file_cut_at_any_byte_sends_only_from_the_chunk_it_was_cut_in(shard, tmp_path, cut_at):
    source, entry, data = shard
    host_dir = _host_dir(tmp_path)
    (host_dir / (source.name + ".partial")).write_bytes(data[:cut_at])
    transport = Transport(source, host_dir, entry)
    result = transport.send()
    assert transport.staged == _chunks_from(cut_at)
    assert result["kept_bytes"] == cut_at // CHUNK * CHUNK
    assert (host_dir / source.name).read_bytes() == data


def test_a_partial_with_wrong_bytes_has_only_those_chunks_sent_again(shard, tmp_path):
    source, entry, data = shard
    host_dir = _host_dir(tmp_path)
    corrupt = bytearray(data)
    corrupt[3 * CHUNK + 10] ^= 0xFF
    corrupt[SIZE - 1] ^= 0xFF  # the short last chunk
    (host_dir / (source.name + ".partial")).write_bytes(bytes(corrupt))
    transport = Transport(source, host_dir, entry)
    transport.send()
    assert transport.staged == [3, 20]
    assert (host_dir / source.name).read_bytes() == data


def test_a_partial_longer_than_the_file_is_cut_to_its_size(shard, tmp_path):
    source, entry, data = shard
    host_dir = _host_dir(tmp_path)
    partial = host_dir / (source.name + ".partial")
    partial.write_bytes(data + b"bytes of another file past the end")
    transport = Transport(source, host_dir, entry)
    result = transport.send()
    assert transport.staged == [] and result["kept_bytes"] == SIZE
    assert (host_dir / source.name).read_bytes() == data and not partial.exists()
    # Longer and wrong from its middle on: the same size is not enough, the wrong chunks go again.
    (host_dir / source.name).unlink()
    partial.write_bytes(data[:7 * CHUNK] + random.Random(15).randbytes(SIZE))
    transport = Transport(source, host_dir, entry)
    transport.send()
    assert transport.staged == _chunks_from(7 * CHUNK)
    assert (host_dir / source.name).read_bytes() == data


def test_a_chunk_damaged_on_the_way_is_refused_and_sent_again(shard, tmp_path):
    source, entry, data = shard
    host_dir = _host_dir(tmp_path)
    transport = Transport(source, host_dir, entry, corrupt_once={2, 9})
    transport.send()
    assert [a["rejected"] for a in transport.answers if a["rejected"]] == [[2], [9]]
    assert transport.staged == _chunks_from(0) + [2, 9]
    assert (host_dir / source.name).read_bytes() == data


def test_wrong_bytes_are_never_renamed_into_place(shard, tmp_path):
    source, entry, data = shard
    host_dir = _host_dir(tmp_path)
    partial = host_dir / (source.name + ".partial")
    # Every copy of chunk 4 arrives damaged: the transfer stops and says so, the partial stays a partial.
    transport = Transport(source, host_dir, entry, corrupt_once=set())
    original_stage = transport.stage

    def always_damaged(index: int, offset: int, length: int) -> str:
        transport.corrupt_once.add(4)
        return original_stage(index, offset, length)

    transport.stage = always_damaged  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"chunks \[4\] still differ"):
        transport.send()
    assert not (host_dir / source.name).exists() and partial.exists()
    # Chunk hashes that agree with a wrong partial do not place it either: the whole file must match the lock.
    wrong = bytearray(data)
    wrong[0] ^= 0xFF
    partial.write_bytes(bytes(wrong))
    lying, _, _ = model_dir.chunk_sha256s(str(partial), SIZE, CHUNK)
    answer = model_dir.transfer_chunks(str(host_dir), entry, CHUNK, lying, {}, True)
    assert answer["missing"] == [] and answer["placed"] is False
    assert not (host_dir / source.name).exists()


def test_a_cache_file_that_no_longer_matches_its_manifest_is_not_sent(shard, tmp_path):
    source, entry, data = shard
    host_dir = _host_dir(tmp_path)
    source.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    transport = Transport(source, host_dir, entry)
    with pytest.raises(ValueError, match="changed after it was described"):
        transport.send()
    assert transport.answers == [] and transport.staged == []


def test_the_plan_keeps_a_cut_file_as_the_partial_and_drops_stale_ones(shard, tmp_path):
    source, entry, data = shard
    host_dir = _host_dir(tmp_path)
    small = {"path": "config.json", "size_bytes": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    (host_dir / "config.json").write_bytes(b"{}")
    (host_dir / "config.json.partial").write_bytes(b"{")  # left from an earlier cut: the file is whole now
    (host_dir / source.name).write_bytes(data[:5 * CHUNK + 3])  # cut in place (a copy that was interrupted)
    wanted = model_dir.wanted_files([entry, small])
    planned = model_dir.plan(str(host_dir), wanted)
    assert planned["send"] == [entry] and planned["verified"] == ["config.json"]
    assert planned["removed"] == ["config.json.partial"]
    assert not (host_dir / source.name).exists()
    assert (host_dir / (source.name + ".partial")).read_bytes() == data[:5 * CHUNK + 3]
    transport = Transport(source, host_dir, entry)
    transport.send()
    assert transport.staged == _chunks_from(5 * CHUNK)
    assert model_dir.record(str(host_dir), wanted, planned["verified"])["bad"] == []
    assert model_dir.plan(str(host_dir), wanted)["in_place"] is True


def test_the_action_plugin_resumes_a_corrupt_partial_through_ansible(shard, tmp_path):
    """The role's own plugin and module, run by ansible-playbook on a local connection: the module's argument
    spec, the staging in Ansible's temporary directory and the host steps as the play runs them."""
    source, entry, data = shard
    host_dir = _host_dir(tmp_path)
    corrupt = bytearray(data[:9 * CHUNK + 5])
    corrupt[6 * CHUNK] ^= 0xFF
    (host_dir / (source.name + ".partial")).write_bytes(bytes(corrupt))
    result_file = tmp_path / "result.json"
    playbook = tmp_path / "send.yml"
    playbook.write_text(json.dumps([{
        "hosts": "localhost", "connection": "local", "gather_facts": False,
        "tasks": [
            {"b70_model_send": {"src": str(source.parent), "path": str(host_dir), "file": entry,
                                "chunk_bytes": CHUNK, "batch_bytes": BATCH},
             "register": "sent"},
            # The role's verify step takes the send loop's results whole and picks its own directory's: a file
            # placed elsewhere is hashed here (check mode: nothing recorded), the one placed here is not.
            {"b70_model_dir": {"path": str(host_dir), "files": [entry], "state": "verified",
                               "sent": [{**entry, "placed": True, "directory": str(tmp_path / "elsewhere")},
                                        {"skipped": True}]},
             "check_mode": True, "register": "elsewhere"},
            {"b70_model_dir": {"path": str(host_dir), "files": [entry], "state": "verified",
                               "sent": "{{ [sent, {'skipped': true}] }}"},
             "register": "recorded"},
            {"ansible.builtin.copy": {"content": "{{ {'sent': sent, 'elsewhere': elsewhere, 'recorded': recorded}"
                                                 " | to_json }}", "dest": str(result_file)}},
        ]}]))
    env = {**os.environ, "ANSIBLE_ACTION_PLUGINS": str(ROLE / "action_plugins"),
           "ANSIBLE_LIBRARY": str(ROLE / "library"), "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-local"),
           "ANSIBLE_REMOTE_TMP": str(tmp_path / "ansible-remote"), "ANSIBLE_PYTHON_INTERPRETER": sys.executable}
    run = subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,",
                          str(playbook)], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(result_file.read_text())
    sent = results["sent"]
    assert (sent["changed"], sent["placed"], sent["directory"], sent["path"]) == (True, True, str(host_dir),
                                                                                   source.name)
    assert sent["kept_bytes"] == 8 * CHUNK  # chunks 0-8 but 6, which was wrong; 9 was cut
    assert sent["chunks_sent"] == 21 - 8
    assert (host_dir / source.name).read_bytes() == data
    assert not (host_dir / (source.name + ".partial")).exists()
    assert list((tmp_path / "ansible-remote").iterdir()) == []  # the staged chunks went with Ansible's tmp dir
    assert results["elsewhere"]["hashed_bytes"] == SIZE
    assert (results["recorded"]["changed"], results["recorded"]["hashed_bytes"]) == (True, 0)
    assert json.loads((host_dir / model_dir.MANIFEST_FILE).read_text())["files"] == [entry]
