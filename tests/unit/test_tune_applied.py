"""A host's tune applied by the next serving run: `b70ctl serve render --tuned` (what roles/vllm_serve calls with
the host's vllm_serve_tuned from host_vars/<host>/b70_tuned.yml) renders the overrides into the command, refuses
overrides of another recipe or another oneCCL profile, and the applied overrides change what the report measured
(its serve command), while the appliance hash, a fleet drift field, stays."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import yaml
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.errors import BadInput
from b70ctl.host.environment import HostBundle, host_environment
from b70ctl.lock.model import load_recipe_and_lock
from b70ctl.tune.model import Figures, FinalComparison, TunedSettings, TuneReport
from b70ctl.tune.render import tuned_yaml
from b70host.topology import TOPOLOGY_PATH, topology
from sysfs_trees import build_tree

RUNNER = CliRunner()


def tuned_document(recipe: str, overrides: dict, profile: str | None = None) -> str:
    return json.dumps({"recipe": recipe, "outcome": "tuned", "overrides": overrides, "profile": profile,
                       "score_tok_s": 52.0, "default_score_tok_s": 42.0, "budget_requests": 300,
                       "spent_requests": 280, "date": "2026-12-01"})


def render(*args: str) -> dict:
    result = RUNNER.invoke(app, ["serve", "render", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def refused(*args: str) -> str:
    """The one-line BadInput (exit 2 through b70ctl's main), nothing rendered."""
    result = RUNNER.invoke(app, ["serve", "render", "--json", *args])
    assert isinstance(result.exception, BadInput) and result.stdout == "", result.output
    return str(result.exception)


def k_of(command: dict) -> int:
    argv = command["argv"]
    return json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"]


def test_the_tuned_k_reaches_the_speculative_server_and_not_the_baseline():
    plain = render("--recipe", "cpu-tiny")
    tuned = render("--recipe", "cpu-tiny", "--tuned", tuned_document("cpu-tiny", {"num_speculative_tokens": 2}))
    assert k_of(plain) == 4 and k_of(tuned) == 2
    assert [a for a in tuned["argv"] if "speculative" not in a and not a.startswith("{")] == \
        [a for a in plain["argv"] if "speculative" not in a and not a.startswith("{")]
    baseline = render("--recipe", "cpu-tiny", "--baseline")
    assert render("--recipe", "cpu-tiny", "--baseline", "--tuned",
                  tuned_document("cpu-tiny", {"num_speculative_tokens": 2})) == baseline
    # a host never tuned, and a tune that kept the default, render the recipe as it is
    assert render("--recipe", "cpu-tiny", "--tuned", "{}") == plain
    kept = json.loads(tuned_document("cpu-tiny", {})) | {"outcome": "default_best"}
    assert render("--recipe", "cpu-tiny", "--tuned", json.dumps(kept)) == plain


def test_overrides_of_another_recipe_or_a_hand_edit_are_refused():
    message = refused("--recipe", "cpu-tiny", "--tuned", tuned_document("dspark-int4-tp1",
                                                                        {"num_speculative_tokens": 2}))
    assert "b70_tuned.yml tunes recipe dspark-int4-tp1, the host serves cpu-tiny" in message
    assert "run playbooks/tune.yml for this host again" in message
    message = refused("--recipe", "cpu-tiny", "--tuned", tuned_document("cpu-tiny", {"enforce_eager": True}))
    assert "not a knob b70ctl tunes" in message
    assert "not JSON" in refused("--recipe", "cpu-tiny", "--tuned", "k=2")


def test_a_oneccl_threshold_applies_on_its_profile_only(tmp_path: Path):
    threshold = {"num_speculative_tokens": 6, "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD": 262144}

    def host_topology(scenario: str, profile: str) -> str:
        root = build_tree(tmp_path / scenario, scenario)
        topology(root, 2, profile=profile, probe="never", write=True)
        return str(Path(root) / TOPOLOGY_PATH.lstrip("/"))

    # p2p is chosen only once a probe opened peer memory (b70host/topology.py); without a GPU here the switch host
    # carries it as the override a host sets after ze_peer passed.
    p2p, no_p2p = host_topology("b70x2-switch", "p2p"), host_topology("b70x2-root-ports", "auto")
    document = tuned_document("pr620-fp8-tp2", threshold, profile="p2p")
    tuned = render("--recipe", "pr620-fp8-tp2", "--topology", p2p, "--tuned", document)
    plain = render("--recipe", "pr620-fp8-tp2", "--topology", p2p)
    assert tuned["env"]["CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD"] == "262144" and k_of(tuned) == 6
    assert {n: v for n, v in tuned["env"].items() if n != "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD"} == \
        {n: v for n, v in plain["env"].items() if n != "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD"}
    message = refused("--recipe", "pr620-fp8-tp2", "--topology", no_p2p, "--tuned", document)
    assert "tuned for profile p2p, the host's profile is now no-p2p" in message


def test_applied_overrides_change_the_reported_serve_command_not_the_appliance_hash():
    """The report's environment (host environment's output) carries serve.json, the render."""
    recipe, lock, _ = load_recipe_and_lock("cpu-tiny")
    plain = render("--recipe", "cpu-tiny")
    for overrides in ({"num_speculative_tokens": 2}, {"draft_sample_method": "probabilistic"}):
        tuned = render("--recipe", "cpu-tiny", "--tuned", tuned_document("cpu-tiny", overrides))
        before = host_environment(HostBundle(hostname="tiny-1", serve=plain), recipe, lock)
        after = host_environment(HostBundle(hostname="tiny-1", serve=tuned), recipe, lock)
        assert before.serve_command != after.serve_command
        assert before.model_dump_json() != after.model_dump_json()
        assert before.appliance_hash == after.appliance_hash


def test_the_file_the_tune_writes_is_what_the_role_applies():
    now = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
    report = TuneReport(
        recipe="cpu-tiny", vllm_version="0.32.0", profile=None, knobs={"num_speculative_tokens": [1, 2, 3, 4]},
        default_overrides={"num_speculative_tokens": 4}, workloads=["short"], budget_requests=120,
        spent_requests=110, started_at=now, finished_at=now, rounds=[], candidates=[],
        final=FinalComparison(default_key="a", winner_key="b", default=Figures(n=3, score_tok_s=40.0),
                              winner=Figures(n=3, score_tok_s=50.0)),
        outcome="tuned", tuned_overrides={"num_speculative_tokens": 2}, summary="k=2 beats the default")
    document = yaml.safe_load(tuned_yaml(report))
    assert list(document) == ["vllm_serve_tuned"]  # the role's variable, set from host_vars/<host>/
    settings = TunedSettings.model_validate(document["vllm_serve_tuned"])
    assert settings.overrides == {"num_speculative_tokens": 2} and settings.score_tok_s == 50.0
    assert settings.default_score_tok_s == 40.0 and str(settings.date) == "2026-12-01"
    assert k_of(render("--recipe", "cpu-tiny", "--tuned", settings.model_dump_json())) == 2
