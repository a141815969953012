"""b70ctl diagnose against the field corpus: real failures and healthy runs as B70/B60/B580 owners posted them in
public issues (tests/fixtures/field/index.yaml says where each came from and what its thread settled on).

Each failure must be named with the fix its thread settled on (or, where its log holds nothing that shows that
cause, with no specific fix at all); each healthy log must come out clean. The logs are the reporters' own lines, so
these expectations are not ours to shape: a miss here is a miss in the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from b70ctl.diagnose import diagnose_lines, load_catalogue
from b70ctl.diagnose.collect import read_log
from b70ctl.diagnose.model import Match

FIELD = Path(__file__).resolve().parents[1] / "fixtures" / "field"
INDEX = yaml.safe_load((FIELD / "index.yaml").read_text()) or []
FAILURES = [entry for entry in INDEX if entry["kind"] == "failure"]
HEALTHY = [entry for entry in INDEX if entry["kind"] == "healthy"]
KEYS = {"id", "kind", "url", "date", "reporter", "versions", "hardware", "thread_fix", "expect", "fix_mentions"}
# The entries joined from a measured held-out set keep its name (split) and, failures, the layer the thread placed
# the fault in (expect_layer); test_diagnose_heldout_index.py checks those keys.
JOINED_KEYS = {"split"}
JOINED_FAILURE_KEYS = {"split", "expect_layer"}
# A set split in halves before any entry was written from it keeps each entry's half (build or measure).
HALVED_SPLITS = {"heldout-2026-12c"}


def fix_text(match: Match) -> str:
    """Everything diagnose prints as the way out of a match: the fix, its command and env, and its causes."""
    return json.dumps(match.model_dump(include={"fix", "causes"}, mode="json"))


def diagnose(entry: dict):
    log = FIELD / "logs" / f"{entry['id']}.log"
    return diagnose_lines(load_catalogue(), read_log(str(log)), [log.name])


def test_the_corpus_is_large_enough_and_every_log_has_its_index_entry() -> None:
    # A floor under what has been gathered (42 failures and 8 healthy runs built from, 40 failures and 8 healthy
    # runs joined from the November held-out set, 42 and 9 from the first December one, 42 and 8 from the second,
    # 41 and 8 from the third), so no case is lost unnoticed; the corpus grows from here.
    assert len(FAILURES) >= 207 and len(HEALTHY) >= 41
    ids = [entry["id"] for entry in INDEX]
    assert len(ids) == len(set(ids))
    assert sorted(ids) == sorted(path.stem for path in (FIELD / "logs").glob("*.log"))
    for entry in INDEX:
        joined = set()
        if "split" in entry:
            joined = JOINED_FAILURE_KEYS if entry["kind"] == "failure" else JOINED_KEYS
            joined = joined | ({"half"} if entry["split"] in HALVED_SPLITS else set())
        assert set(entry) == KEYS | joined, entry["id"]
        assert entry["url"].startswith("https://github.com/"), entry["id"]


def test_a_failure_expects_an_entry_unless_its_log_cannot_show_the_fix() -> None:
    # A failure names the entries diagnose must give. An empty expect says the log holds no line that shows the
    # thread's cause (a bare exception any bug could raise): then the honest answer is no specific entry.
    for entry in FAILURES:
        if entry["expect"]:
            continue
        assert (entry["thread_fix"] and entry["fix_mentions"]) or not thread_settled(entry), entry["id"]
        named = [match.id for match in diagnose(entry).failures if not match.generic]
        assert not named, f"{entry['url']}: a specific fix {named} where the log shows none"


@pytest.mark.parametrize("entry", FAILURES, ids=[entry["id"] for entry in FAILURES])
def test_each_field_failure_is_named_with_the_fix_its_thread_settled_on(entry: dict) -> None:
    diagnosis = diagnose(entry)
    named = {match.id: match for match in diagnosis.failures}
    missing = set(entry["expect"]) - set(named)
    assert not missing, f"{entry['url']}: not named {sorted(missing)}; named {sorted(named)}"
    if not entry["expect"]:
        return  # no line of this log shows its cause: test_a_failure_expects_an_entry_unless_... holds it
    printed = " ".join(fix_text(named[expected]) for expected in entry["expect"])
    for mention in entry["fix_mentions"]:
        assert mention in printed, f"{entry['url']}: the fix diagnose prints does not say {mention!r}"


@pytest.mark.parametrize("entry", HEALTHY, ids=[entry["id"] for entry in HEALTHY])
def test_each_healthy_field_log_comes_out_clean(entry: dict) -> None:
    diagnosis = diagnose(entry)
    assert not diagnosis.failures, f"{entry['url']}: {[match.id for match in diagnosis.failures]}"


# ---------------------------------------------------------------- each cited thread's settled fix

def without_anchor(url: str) -> str:
    return url.split("#", 1)[0].rstrip("/")


def thread_settled(entry: dict) -> bool:
    """Whether index.yaml records a fix the thread settled on ("none settled ..." and "not read ..." record none)."""
    return not entry["thread_fix"].startswith(("none settled", "not read"))


THREADS: dict[str, list[dict]] = {}
for _entry in FAILURES:
    THREADS.setdefault(without_anchor(_entry["url"]), []).append(_entry)
CITED = [(signature.id, source) for signature in load_catalogue().signatures for source in signature.sources
         if source.kind == "issue" and without_anchor(source.ref) in THREADS]


def test_every_thread_with_a_settled_fix_ties_it_to_what_diagnose_prints() -> None:
    # A settled fix without fix_mentions could not be compared with an entry's.
    loose = [entry["id"] for entry in FAILURES if thread_settled(entry) and not entry["fix_mentions"]]
    assert not loose
    assert len(CITED) >= 30  # the entries cite most of the corpus's threads


@pytest.mark.parametrize("signature_id, source", CITED, ids=[f"{s}:{src.ref}" for s, src in CITED])
def test_an_entry_citing_a_thread_agrees_with_the_fix_it_settled_on(signature_id: str, source) -> None:
    """Each entry that cites a thread of the corpus says how: `settled` (its fix or one of its causes' is the
    thread's settled fix: every string tying that fix, fix_mentions, is in what diagnose prints), `unsettled` (the
    thread's logs this entry names ended without a fix) or `context` (cited for a line or a version: none of the
    thread's logs is this failure)."""
    [signature] = [entry for entry in load_catalogue().signatures if entry.id == signature_id]
    printed = json.dumps(signature.model_dump(include={"fix", "causes"}, mode="json"))
    thread = THREADS[without_anchor(source.ref)]
    naming = [entry for entry in thread if signature_id in entry["expect"]]
    assert source.thread is not None, f"{signature_id} cites {source.ref} without saying what the thread settled"
    if source.thread == "context":
        assert not naming, f"{signature_id} names {[e['id'] for e in naming]} of {source.ref}: not mere context"
        return
    judged = naming or thread
    if source.thread == "unsettled":
        assert naming and not any(thread_settled(entry) for entry in naming), source.ref
        return
    settled = [entry for entry in judged if thread_settled(entry)]
    assert settled, f"{source.ref}: index.yaml records no settled fix"
    for entry in settled:
        missing = [mention for mention in entry["fix_mentions"] if mention not in printed]
        assert not missing, f"{signature_id}'s fix does not say {missing}, what {entry['url']} settled on"
