"""The held-out field corpus (tests/fixtures/field/heldout/) is well formed and really held out.

Its cases measure b70ctl diagnose on logs the catalogue was not written from (benchmarks/diagnose_heldout.py):
nothing here runs diagnose or expects a held-out case to be named, only that every entry can be measured and
cites a source the main corpus does not."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

FIELD = Path(__file__).resolve().parents[1] / "fixtures" / "field"
HELDOUT = FIELD / "heldout"
ENTRIES: list[dict[str, Any]] = yaml.safe_load((HELDOUT / "index.yaml").read_text()) or []
MAIN: list[dict[str, Any]] = yaml.safe_load((FIELD / "index.yaml").read_text()) or []
KEYS = {"id", "kind", "split", "url", "date", "reporter", "versions", "hardware", "thread_fix", "expect",
        "fix_mentions"}
LAYERS = {"kernel-firmware-pcie", "level-zero-ur-sycl", "oneccl", "torch-triton-kernels-abi", "vllm-config-scheduler",
          "model-loader", "container-device", "host-memory"}


def thread(url: str) -> str:
    """An issue or file address without the comment anchor: two comments of one thread are one source."""
    return url.split("#", 1)[0]


def test_every_entry_has_the_keys_of_its_kind() -> None:
    for entry in ENTRIES:
        expected = KEYS | {"expect_layer"} if entry["kind"] == "failure" else KEYS
        assert set(entry) == expected, entry["id"]
        assert entry["kind"] in {"failure", "healthy"} and entry["split"] == "heldout", entry["id"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}|unknown", str(entry["date"])), entry["id"]
        assert entry["url"].startswith("https://github.com/"), entry["id"]
        assert all(isinstance(mention, str) and mention for mention in entry["fix_mentions"]), entry["id"]
        if entry["kind"] == "failure":
            assert entry["expect_layer"] in LAYERS, entry["id"]
        else:
            assert entry["expect"] == [] and entry["fix_mentions"] == [], entry["id"]


def test_every_entry_has_its_log_and_every_log_its_entry() -> None:
    ids = [entry["id"] for entry in ENTRIES]
    assert len(ids) == len(set(ids))
    assert sorted(ids) == sorted(path.stem for path in (HELDOUT / "logs").glob("*.log"))
    for entry in ENTRIES:
        assert (HELDOUT / "logs" / f"{entry['id']}.log").read_text().strip(), entry["id"]


def test_the_held_out_cases_share_no_id_and_no_source_with_the_main_corpus() -> None:
    assert not {entry["id"] for entry in ENTRIES} & {entry["id"] for entry in MAIN}
    assert not {thread(entry["url"]) for entry in ENTRIES} & {thread(entry["url"]) for entry in MAIN}


def test_the_split_is_as_large_as_the_issue_asks() -> None:
    # At least 40 real failures and 8 healthy runs: fewer would make the figures swing by a case or two.
    kinds = [entry["kind"] for entry in ENTRIES]
    assert kinds.count("failure") >= 40 and kinds.count("healthy") >= 8
