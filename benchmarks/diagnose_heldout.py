"""b70ctl diagnose on the held-out field corpus: logs its catalogue was not written from.

    .venv/bin/python benchmarks/diagnose_heldout.py [--index INDEX] [--json]

With no --index it measures the set waiting to be measured, tests/fixtures/field/heldout-next/index.yaml, which the
next collector creates; when there is none (every set gathered so far has been measured and joined the corpus) it
says so on one line and exits 2.

Runs the real `b70ctl.diagnose` (diagnose_lines over read_log, as tests/unit/test_diagnose_field.py does) on every
entry of the held-out index and sorts each case by what an owner would be told:

  named right    a failure where a match's id is in `expect` and the fix it gives holds every `fix_mentions`
                 string: its fix (text, command, env), or the cause it picked from the log's own evidence; a cause
                 it only lists does not count. Where `expect` is [] (none of the entries the collector was
                 shown had the failure's subject) but the thread settled on a fix, any specific entry whose given
                 fix holds them. Or `expect` is [] and the thread settled on nothing and diagnose names nothing
                 (an honest "not known")
  named wrong    a failure where diagnose names something, but not that: a confident fix the thread disagrees
                 with, or any fix where the catalogue has no entry for the case
  layer only     a failure where diagnose gives only a layer's generic entry (its first step whatever the cause):
                 the honest "not known" with the layer, neither a settled fix nor a wrong one
  missed         a failure where diagnose names nothing and a named fix was due
  healthy flagged a healthy run where diagnose names a failure

An index is a list of entries with the keys of tests/fixtures/field/index.yaml (id, kind, url, expect,
fix_mentions, thread_fix) and, where the set records it, expect_layer; the logs are in logs/ beside it. The
default is the set waiting to be measured (heldout-next); a set that has been measured joins
tests/fixtures/field/index.yaml with its name in `split`, and can be measured again (as build material, no longer
held out) from an index of those entries written elsewhere with a logs/ link to tests/fixtures/field/logs.

The layer column compares `expect_layer` with the layers diagnose gives (its matches' layers, else the layers
of the lines it could not name), where this version of diagnose gives any.

To measure the committed code rather than a working tree, run it against an export of HEAD:
    git archive HEAD control | tar -x -C /tmp/head && PYTHONPATH=/tmp/head/control .venv/bin/python ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from b70ctl.diagnose import Diagnosis, Match, diagnose_lines, load_catalogue
from b70ctl.diagnose.collect import read_log

REPO = Path(__file__).resolve().parents[1]
# Where the next held-out set is gathered; absent while no set waits to be measured (each measured set joins
# tests/fixtures/field/index.yaml and its directory is removed).
DEFAULT_INDEX = REPO / "tests" / "fixtures" / "field" / "heldout-next" / "index.yaml"
VERDICTS = ("named right", "named wrong", "layer only", "missed", "healthy clean", "healthy flagged")
# Catalogue entries renamed after the index was written: the same entry under its new id.
RENAMED = {"ur-out-of-device-memory-multi-gpu": "device-out-of-memory"}
# The held-out index has its own names for the eight layers; diagnose's model uses short ones for the same eight.
HELDOUT_LAYER = {"kernel-driver": "kernel-firmware-pcie", "level-zero": "level-zero-ur-sycl", "oneccl": "oneccl",
                 "torch": "torch-triton-kernels-abi", "vllm": "vllm-config-scheduler", "model-loader": "model-loader",
                 "container": "container-device", "host-memory": "host-memory"}


def fix_text(match: Match) -> str:
    """The way out diagnose gives for a match: its fix (the picked cause's where it picked one) and the cause it
    picked from the log's evidence. The causes it only lists are not a fix given, so they are left out (the field
    test, which holds an entry's whole text to its thread, reads them too)."""
    picked = getattr(match, "picked_cause", None)
    given: dict[str, Any] = {"fix": match.fix.model_dump(mode="json")}
    causes = getattr(match, "causes", None) or []
    if picked is not None and 0 <= picked < len(causes):
        given["picked_cause"] = causes[picked].model_dump(mode="json")
    return json.dumps(given)


def settled_on_nothing(entry: dict[str, Any]) -> bool:
    return not entry["fix_mentions"] and str(entry["thread_fix"]).startswith("none settled")


def verdict(entry: dict[str, Any], diagnosis: Diagnosis) -> str:
    if entry["kind"] == "healthy":
        return "healthy flagged" if diagnosis.failures else "healthy clean"
    # A generic entry (diagnose's model marks them) names a layer, not a cause.
    named = [match for match in diagnosis.failures if not getattr(match, "generic", False)]
    expect = {RENAMED.get(name, name) for name in entry["expect"]}
    # `expect` was chosen from the entries the collector was shown. Where none was the failure's subject ([]) but
    # the thread settled on a fix, an entry written since is right when the fix it gives is the thread's.
    any_entry = not expect and bool(entry["fix_mentions"])
    agreeing = [match for match in named if (match.id in expect or any_entry)
                and all(mention in fix_text(match) for mention in entry["fix_mentions"])]
    if agreeing:
        return "named right"
    if not named:
        if not entry["expect"] and settled_on_nothing(entry):
            return "named right"
        return "layer only" if diagnosis.failures else "missed"
    return "named wrong"


def layers_given(diagnosis: Diagnosis) -> list[str]:
    """The layers this diagnose names, in the held-out index's words, if its model carries layers at all."""
    layers = [layer for match in diagnosis.failures if (layer := getattr(match, "layer", None))]
    unknown = getattr(diagnosis, "unknown", None)
    if not layers and unknown is not None:
        layers = list(getattr(unknown, "layers", []) or [])
    return list(dict.fromkeys(HELDOUT_LAYER.get(layer, layer) for layer in layers))


def run(index: Path, half: str | None = None) -> dict[str, Any]:
    entries: list[dict[str, Any]] = yaml.safe_load(index.read_text()) or []
    if half is not None:
        entries = [entry for entry in entries if entry.get("half") == half]
    catalogue = load_catalogue()
    cases = []
    for entry in entries:
        log = index.parent / "logs" / f"{entry['id']}.log"
        diagnosis = diagnose_lines(catalogue, read_log(str(log)), [log.name])
        layers = layers_given(diagnosis)
        cases.append({
            "id": entry["id"],
            "kind": entry["kind"],
            "url": entry["url"],
            "expect_layer": entry.get("expect_layer"),
            "expect": entry["expect"],
            "fix_mentions": entry["fix_mentions"],
            "named": [match.id for match in diagnosis.failures],
            "layers": layers,
            "layer_right": None if entry["kind"] == "healthy" or not layers else entry.get("expect_layer") in layers,
            "verdict": verdict(entry, diagnosis),
            "thread_settled": not settled_on_nothing(entry),
        })
    failures = [case for case in cases if case["kind"] == "failure"]
    healthy = [case for case in cases if case["kind"] == "healthy"]
    counts = {name: sum(case["verdict"] == name for case in cases) for name in VERDICTS}
    return {
        "index": str(index.resolve().relative_to(REPO)) if index.resolve().is_relative_to(REPO) else str(index),
        "half": half,
        "failures": len(failures),
        "healthy": len(healthy),
        "counts": counts,
        "named_right_share": counts["named right"] / len(failures) if failures else None,
        "named_wrong_share": counts["named wrong"] / len(failures) if failures else None,
        # Of the named wrong: a specific fix where the thread settled nothing (not known to be wrong, but a
        # confidence the evidence does not back), and a fix other than the one the thread settled on.
        "wrong_where_nothing_settled": sum(case["verdict"] == "named wrong" and not case["thread_settled"]
                                           for case in failures),
        "layer_given": sum(case["layer_right"] is not None for case in failures),
        "layer_right": sum(case["layer_right"] is True for case in failures),
        "cases": cases,
    }


def share(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else f"{part}/0"


def render(result: dict[str, Any]) -> str:
    rows = ["| case | layer (held-out) | expect | diagnose names | layers given | verdict |",
            "|---|---|---|---|---|---|"]
    for case in result["cases"]:
        rows.append("| {} | {} | {} | {} | {} | {} |".format(
            case["id"], case["expect_layer"] or "-", ", ".join(case["expect"]) or "[]",
            ", ".join(case["named"]) or "nothing", ", ".join(case["layers"]) or "-", case["verdict"]))
    counts, failures, healthy = result["counts"], result["failures"], result["healthy"]
    rows += [
        "",
        f"Held-out failures {failures}, healthy runs {healthy} ({result['index']}"
        f"{', half ' + result['half'] if result['half'] else ''})",
        f"named with the settled fix: {share(counts['named right'], failures)}",
        f"named wrong:                {share(counts['named wrong'], failures)}"
        f" ({result['wrong_where_nothing_settled']} where the thread settled nothing,"
        f" {counts['named wrong'] - result['wrong_where_nothing_settled']} against the fix it settled on)",
        f"layer only:                 {share(counts['layer only'], failures)}",
        f"missed:                     {share(counts['missed'], failures)}",
        f"healthy flagged:            {share(counts['healthy flagged'], healthy)}",
        f"layer given / right:        {result['layer_given']} given, {result['layer_right']} right",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog=f"With no --index and no held-out set waiting to be measured ({DEFAULT_INDEX.relative_to(REPO)}, "
               "which the next collector creates), it says so and exits 2.")
    parser.add_argument("--index", type=Path, default=None,
                        help="the held-out index.yaml (default: the set waiting to be measured, "
                             f"{DEFAULT_INDEX.relative_to(REPO)}, when there is one)")
    parser.add_argument("--half", choices=("build", "measure"), default=None,
                        help="only the entries of this half of a set split before any entry was written from it "
                             "(the index's `half` key): new entries are written from the build half's logs alone, "
                             "and the measure half says how they generalize")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = parser.parse_args(argv)
    index = args.index
    if index is None:
        if not DEFAULT_INDEX.is_file():
            print(f"diagnose_heldout: no held-out set is waiting to be measured ({DEFAULT_INDEX.relative_to(REPO)}"
                  " does not exist); give --index", file=sys.stderr)
            return 2
        index = DEFAULT_INDEX
    result = run(index, args.half)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
