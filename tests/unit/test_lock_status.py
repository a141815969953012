"""`b70ctl lock status`, what preflight asks before any change: the shipped B70 locks are unresolved (their JSON
carries no revision and no digest), cpu-tiny's is resolved by generation (its models are a generator spec, its
base image is built on the host)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from b70ctl.cli import app

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "control" / "b70ctl" / "recipes" / "data"


def _status(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["lock", "status", *args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_shipped_b70_locks_pin_nothing_downloadable_and_cpu_tiny_is_generated():
    for name in ("pr620-fp8-tp2", "dspark-int4-tp1"):
        lock = json.loads((DATA / f"{name}.lock.json").read_text())
        assert lock["resolved"] is False
        assert lock["target"]["revision"] is None and lock["drafter"]["revision"] is None
        assert lock["image"]["base_digest"] is None and lock["image"]["digest"] is None
    tiny = json.loads((DATA / "cpu-tiny.lock.json").read_text())
    assert tiny["resolved"] is True
    assert tiny["target"]["generated"]["generator"] == "b70ctl.models.tiny" and tiny["image"]["local_build"] is True


def test_an_unresolved_lock_fails_naming_the_command_and_the_network():
    code, status = _status("--recipe", "pr620-fp8-tp2")
    assert code == 1
    assert status["resolved"] is False and status["ok"] is False
    assert status["resolve_command"] == "b70ctl lock resolve --recipe pr620-fp8-tp2"
    assert [item["part"] for item in status["unresolved"]] == ["image", "target", "drafter"]
    message = status["message"]
    assert "run `b70ctl lock resolve --recipe pr620-fp8-tp2` on the controller" in message
    # The base image is on Docker Hub (intel/llm-scaler-vllm), the models on the Hugging Face hub.
    assert "registry-1.docker.io" in message and "for intel/llm-scaler-vllm:0.21.0-b3.1" in message
    assert "Hugging Face hub https://huggingface.co" in message


def test_opting_in_goes_on_and_still_says_so():
    code, status = _status("--recipe", "dspark-int4-tp1", "--allow-unresolved")
    assert code == 0
    assert status["ok"] is True and status["resolved"] is False
    assert "is NOT resolved" in status["message"] and "preflight_allow_unresolved_lock is true" in status["message"]


def test_a_resolved_lock_passes():
    code, status = _status("--recipe", "cpu-tiny")
    assert code == 0
    assert status == {**status, "resolved": True, "ok": True, "unresolved": [], "resolve_command": None}


def test_without_json_the_message_is_for_people():
    result = CliRunner().invoke(app, ["lock", "status", "--recipe", "pr620-fp8-tp2"])
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("lock ") and "is NOT resolved" in lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == ["  image", "  target", "  drafter"]


def test_recipes_check_answers_preflight_for_every_recipe_of_a_play_keyed_as_the_inventory_names_them():
    """One controller call for the play (roles/b70/tasks/recipe.yml): each distinct recipe once; an unknown recipe
    is its own entry's error (exit 0 with --json, so only the hosts naming it fail); a valid one carries its spec as
    `recipes show --json` prints it and its lock's status as `lock status --json` does."""
    file = str(DATA / "cpu-tiny.yaml")
    result = CliRunner().invoke(app, ["recipes", "check", "--json", "--", "cpu-tiny", "no-such-recipe",
                                      "pr620-fp8-tp2", file, "cpu-tiny"])
    assert result.exit_code == 0, result.output
    checked = json.loads(result.stdout)["recipes"]
    assert list(checked) == ["cpu-tiny", "no-such-recipe", "pr620-fp8-tp2", file]
    shown = CliRunner().invoke(app, ["recipes", "show", "--json", "cpu-tiny"])
    assert checked["cpu-tiny"]["spec"] == checked[file]["spec"] == json.loads(shown.stdout)
    assert checked["cpu-tiny"]["lock"]["resolved"] is True and checked["cpu-tiny"]["lock_warning"] is None
    assert checked["no-such-recipe"] == {"spec": None, "lock": None, "lock_warning": None, "hub_repos": [],
                                         "error": "unknown recipe 'no-such-recipe': choose one of cpu-tiny, "
                                                  "cpu-tiny-ngram, cpu-tiny-target-only, dspark-fp8-tp2, "
                                                  "dspark-int4-tp1, mtp3-int4-tp2, mtp4-int4-tp1, "
                                                  "mtp8-fp8-tp2, pr620-fp8-tp2 (b70ctl recipes list)"}
    _, status = _status("--recipe", "pr620-fp8-tp2")
    assert checked["pr620-fp8-tp2"]["lock"] == status
    # Whether preflight asks for the Hugging Face token: cpu-tiny generates both models, the B70 recipes download.
    assert checked["cpu-tiny"]["hub_repos"] == []
    spec = checked["pr620-fp8-tp2"]["spec"]
    assert checked["pr620-fp8-tp2"]["hub_repos"] == [spec["target"]["repo"], spec["drafter"]["repo"]]
    assert all(checked["pr620-fp8-tp2"]["hub_repos"])
    _, allowed = _status("--recipe", "pr620-fp8-tp2", "--allow-unresolved")
    assert checked["pr620-fp8-tp2"]["lock_warning"] == allowed["message"]
    # b70_recipe travels on command lines and keys the play's documents: only plain names and paths.
    odd = json.loads(CliRunner().invoke(app, ["recipes", "check", "--json", "--", "cpu tiny", "cpu-tiny\n"]).stdout)
    assert odd["recipes"]["cpu tiny"]["error"] == ('"cpu tiny" holds characters it may not: a recipe name or file '
                                                   'path of letters, digits and . _ / + -')
    assert odd["recipes"]["cpu-tiny\n"]["error"].startswith('"cpu-tiny\\n" holds characters')
    people = CliRunner().invoke(app, ["recipes", "check", "cpu-tiny", "pr620-fp8-tp2"])
    assert people.exit_code == 1 and "is NOT resolved" in people.stdout.splitlines()[1]
