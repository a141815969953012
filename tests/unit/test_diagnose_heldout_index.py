"""The held-out splits of the field corpus (tests/fixtures/field/index.yaml) are well formed and recorded.

A held-out set measures b70ctl diagnose on logs the catalogue was not written from (benchmarks/diagnose_heldout.py);
once measured it joins the corpus and its entries keep the name of the set in `split` (heldout-2026-11: measured
in November 2026 before any entry was written from it; heldout-2026-12 and heldout-2026-12b: the second and third
collections, measured in December 2026 the same way; heldout-2026-12c: the fourth, measured whole, then split in
halves by the sha256 of each id before any entry was written, each entry keeping its `half`). Entries without the key
were build material from the start.
These checks hold the joined entries to what the held-out index required of them; a set still waiting to be
measured (tests/fixtures/field/heldout-next/) is not read here."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import yaml

FIELD = Path(__file__).resolve().parents[1] / "fixtures" / "field"
INDEX: list[dict[str, Any]] = yaml.safe_load((FIELD / "index.yaml").read_text()) or []
# The held-out sets measured so far, and each one's size when it was measured.
MEASURED = {"heldout-2026-11": {"failure": 40, "healthy": 8}, "heldout-2026-12": {"failure": 42, "healthy": 9},
            "heldout-2026-12b": {"failure": 42, "healthy": 8}, "heldout-2026-12c": {"failure": 41, "healthy": 8}}
# Sets split before any entry was written from them: new entries came from the build half's logs alone.
HALVED = {"heldout-2026-12c"}
JOINED = [entry for entry in INDEX if "split" in entry]
BUILD = [entry for entry in INDEX if "split" not in entry]
KEYS = {"id", "kind", "split", "url", "date", "reporter", "versions", "hardware", "thread_fix", "expect",
        "fix_mentions"}
LAYERS = {"kernel-firmware-pcie", "level-zero-ur-sycl", "oneccl", "torch-triton-kernels-abi", "vllm-config-scheduler",
          "model-loader", "container-device", "host-memory"}


def thread(url: str) -> str:
    """An issue or file address without the comment anchor: two comments of one thread are one source."""
    return url.split("#", 1)[0]


def test_every_split_is_a_measured_held_out_set() -> None:
    assert {entry["split"] for entry in JOINED} == set(MEASURED)
    assert all(entry.get("split", "build") == "build" or entry["split"] in MEASURED for entry in INDEX)


def test_every_joined_entry_has_the_keys_of_its_kind() -> None:
    for entry in JOINED:
        expected = KEYS | {"expect_layer"} if entry["kind"] == "failure" else KEYS
        expected = expected | ({"half"} if entry["split"] in HALVED else set())
        assert set(entry) == expected, entry["id"]
        assert entry["kind"] in {"failure", "healthy"}, entry["id"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}|unknown", str(entry["date"])), entry["id"]
        assert entry["url"].startswith("https://github.com/"), entry["id"]
        assert all(isinstance(mention, str) and mention for mention in entry["fix_mentions"]), entry["id"]
        if entry["kind"] == "failure":
            assert entry["expect_layer"] in LAYERS, entry["id"]
        else:
            assert entry["expect"] == [] and entry["fix_mentions"] == [], entry["id"]


def test_every_joined_entry_has_its_log() -> None:
    for entry in JOINED:
        assert (FIELD / "logs" / f"{entry['id']}.log").read_text().strip(), entry["id"]


def test_a_held_out_set_shared_no_source_with_what_was_built_before_it() -> None:
    # Measured held out means none of its threads had been read for the catalogue: no thread of a set is a thread
    # of the build entries (ids are unique across the whole index: test_diagnose_field.py).
    build_threads = {thread(entry["url"]) for entry in BUILD}
    for split in MEASURED:
        joined_threads = {thread(entry["url"]) for entry in JOINED if entry["split"] == split}
        assert not joined_threads & build_threads, split


def test_each_held_out_set_is_as_large_as_when_it_was_measured() -> None:
    # At least 40 real failures and 8 healthy runs: fewer would have made the figures swing by a case or two.
    for split, size in MEASURED.items():
        kinds = [entry["kind"] for entry in JOINED if entry["split"] == split]
        assert kinds.count("failure") == size["failure"] >= 40, split
        assert kinds.count("healthy") == size["healthy"] >= 8, split


def test_a_halved_set_was_split_by_the_hash_of_each_id_before_any_entry_was_written() -> None:
    # Each kind sorted by the sha256 of its id, the first half (rounded up) build: a split anyone can recompute from
    # the ids alone, so no case was moved between halves after its diagnosis was seen.
    for split in HALVED:
        for kind in ("failure", "healthy"):
            entries = sorted((entry for entry in JOINED if entry["split"] == split and entry["kind"] == kind),
                             key=lambda entry: hashlib.sha256(entry["id"].encode()).hexdigest())
            build = (len(entries) + 1) // 2
            assert [entry["half"] for entry in entries] == ["build"] * build + ["measure"] * (len(entries) - build)
