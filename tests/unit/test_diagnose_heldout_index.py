"""The held-out splits of the field corpus (tests/fixtures/field/index.yaml) are well formed and recorded.

A held-out set measures b70ctl diagnose on logs the catalogue was not written from (benchmarks/diagnose_heldout.py);
once measured it joins the corpus and its entries keep the name of the set in `split` (heldout-2026-11: measured
in November 2026 before any entry was written from it; heldout-2026-12 and heldout-2026-12b: the second and third
collections, measured in December 2026 the same way). Entries without the key were build material from the start.
These checks hold the joined entries to what the held-out index required of them; a set still waiting to be
measured (tests/fixtures/field/heldout-next/) is not read here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

FIELD = Path(__file__).resolve().parents[1] / "fixtures" / "field"
INDEX: list[dict[str, Any]] = yaml.safe_load((FIELD / "index.yaml").read_text()) or []
# The held-out sets measured so far, and each one's size when it was measured.
MEASURED = {"heldout-2026-11": {"failure": 40, "healthy": 8}, "heldout-2026-12": {"failure": 42, "healthy": 9},
            "heldout-2026-12b": {"failure": 42, "healthy": 8}}
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
