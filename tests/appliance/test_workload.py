"""The workload stages of site.yml on the two real test hosts, after the session's full site.yml run: the CPU
image built on the controller and loaded, tiny models generated once on the controller and sent, vLLM under
systemd with draft-model speculation, verify from the controller and the fleet report; then the faults each stage
must survive without taking the serving appliance down."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import testinfra
import yaml

from b70ctl.checks.client import Endpoint, VllmClient
from b70ctl.lock.model import load_recipe_and_lock
from b70ctl.lock.resolve import resolve_and_write
from b70ctl.models.record import ModelsRecord
from b70ctl.recipes import load_recipe
from b70ctl.tune.cli import _appliance_host
from b70ctl.tune.run import candidates_of
from b70ctl.tune.unit import SshShell, SystemdUnitServing, host_shell
from provision import REPO_ROOT, Appliance, HostUnderTest, PlaybookRun, assert_recap, on, run_playbook, serving_pid
from store_fixtures import write_recipe

pytestmark = [pytest.mark.appliance, pytest.mark.timeout(2400)]

SERVED_MODEL = "tiny-qwen3"  # control/b70ctl/recipes/data/cpu-tiny.yaml serve.served_model_name
UNITS = {"b70-vllm": 8000, "b70-vllm-baseline": 8001}
B70CTL = Path(sys.executable).parent / "b70ctl"


def answers(address: str, port: int, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}:{port}{path}", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_until_serving(address: str, port: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answers(address, port):
            return
        time.sleep(5)
    raise AssertionError(f"{address}:{port} did not answer /health within {timeout_s} s")


@pytest.fixture(params=[1, 2], ids=["p2p-host", "no-p2p-host"])
def host(request: pytest.FixtureRequest, provisioned: tuple[Appliance, list[str], PlaybookRun]):
    appliance, _, _ = provisioned
    return appliance.host(request.param)


def test_image_built_once_on_the_controller_and_loaded_by_id(host) -> None:
    remote = on(host.name)
    image = json.loads(remote.file("/etc/b70/image.json").content_string)
    assert image["source"] == "build" and image["recipe"] == "cpu-tiny"
    assert image["id"].startswith("sha256:")
    assert remote.check_output(f"docker image inspect --format '{{{{.Id}}}}' {image['id']}") == image["id"]
    assert image["labels"]["org.b70.vllm.version"] == "0.32.0"
    assert remote.check_output("ls -A /var/lib/b70/spool") == ""  # the archive is not left behind


def test_tiny_models_generated_once_and_sent_to_the_host(host) -> None:
    """Generated on the controller from the lock's spec (the recipe's drafter, draft-perturbed, as drafter/) and
    sent like fetched models: the host holds the controller's bytes, checked against a manifest."""
    remote = on(host.name)
    models = json.loads(remote.file("/etc/b70/models.json").content_string)
    assert models["target"]["path"] == "/var/lib/b70/models/cpu-tiny/target"
    assert models["drafter"]["path"] == "/var/lib/b70/models/cpu-tiny/drafter"
    generator = json.loads(remote.file(f"{models['drafter']['path']}/generator.json").content_string)
    assert generator["role"] == "draft-perturbed"
    assert remote.file(f"{models['target']['path']}/.b70-manifest.json").exists
    for role in ("target", "drafter"):
        assert models[role]["revision"].startswith("generated-")
        assert remote.file(f"{models[role]['path']}/model.safetensors").size > 0


def exec_start_argv(unit_text: str) -> list[str]:
    """The ExecStart arguments as systemd reads them back: each double-quoted, with backslash escapes, % and $
    doubled (systemd.syntax(7), "Quoting"; systemd.service(7), "Command lines")."""
    line = next(line for line in unit_text.splitlines() if line.startswith("ExecStart="))
    quoted = re.findall(r'"((?:[^"\\]|\\.)*)"', line[len("ExecStart="):])
    escapes = {"n": "\n", "r": "\r", "t": "\t", '"': '"', "\\": "\\"}
    return [re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), m.group(1)), argument)
            .replace("%%", "%").replace("$$", "$") for argument in quoted]


def rendered(*extra: str) -> dict:
    return json.loads(subprocess.run([str(B70CTL), "serve", "render", "--json", "--recipe", "cpu-tiny", *extra],
                                     check=True, capture_output=True, text=True).stdout)


def test_units_serve_the_rendered_command_under_systemd(host) -> None:
    remote = on(host.name)
    for unit, port in UNITS.items():
        service = remote.service(unit)
        assert service.is_running and service.is_enabled, unit
        assert answers(host.address, port, "/v1/models"), f"{unit} on {host.address}:{port}"
        text = remote.file(f"/etc/systemd/system/{unit}.service").content_string
        assert "Restart=on-failure" in text and "User=b70" in text
        argv = exec_start_argv(text)
        assert argv[argv.index("--env-file") + 1] == f"/etc/b70/serve/{unit}.env"
        # What the unit runs and the environment it gives vLLM are `b70ctl serve render`'s, to the letter.
        expected = rendered("--model-dir", "/models/target", "--drafter-dir", "/models/drafter",
                            "--port", str(port), *(["--baseline"] if unit.endswith("baseline") else []))
        env_lines = remote.file(f"/etc/b70/serve/{unit}.env").content_string.splitlines()[1:]
        assert env_lines == [f"{name}={value}" for name, value in sorted(expected["env"].items())]
        assert argv[len(argv) - len(expected["argv"]):] == expected["argv"], unit
    speculative = exec_start_argv(remote.file("/etc/systemd/system/b70-vllm.service").content_string)
    config = json.loads(speculative[speculative.index("--speculative-config") + 1])
    assert config == {"method": "draft_model", "num_speculative_tokens": 4, "model": "/models/drafter"}
    assert speculative[speculative.index("--tensor-parallel-size") + 1] == "2"  # TP=2, as on two B70s
    assert not remote.file("/etc/b70/serve/api-key.env").exists
    with urllib.request.urlopen(f"http://{host.address}:8000/v1/models", timeout=10) as response:
        assert [model["id"] for model in json.load(response)["data"]] == [SERVED_MODEL]


def test_reports_collected_on_the_controller_with_host_facts(provisioned) -> None:
    appliance, names, _ = provisioned
    reports = appliance.work_dir / "reports"
    expected_profile = {appliance.host(1).name: "p2p", appliance.host(2).name: "no-p2p"}
    for name in names:
        report = json.loads((reports / name / "report.json").read_text())
        assert (reports / name / "report.md").is_file()
        assert report["recipe"] == "cpu-tiny" and not report["partial"]
        environment = report["environment"]
        image = json.loads(on(name).file("/etc/b70/image.json").content_string)
        assert environment["image_digest"] == image["id"]
        assert environment["p2p_profile"] == expected_profile[name]
        assert environment["gpu_count"] == 2 and environment["gpu_model"] == "2x B70"
        assert environment["xe_guc_firmware"] and environment["kernel"]
        assert environment["appliance_hash"].startswith("sha256:")
        assert environment["model_revision"].startswith("generated-")
        verdicts = {claim["claim_id"]: claim for claim in report["verdicts"]}
        assert sorted(verdicts) == ["acceptance-friendly-acceptance", "decode-follows-acceptance", "greedy-identical",
                                    "speculation-vs-target-only"]
        # Token identity and draft acceptance are the engine's behaviour, the same on a loaded machine.
        assert verdicts["greedy-identical"]["verdict"] == "met"
        assert verdicts["acceptance-friendly-acceptance"]["verdict"] == "met"
        # The two rate ratios depend on how the 2 shared cores were loaded while they ran (1.09 against 1.15 was
        # seen once on CI): the pipeline must measure them and judge them by their bound, whichever way it falls.
        for claim_id in ("decode-follows-acceptance", "speculation-vs-target-only"):
            claim = verdicts[claim_id]
            assert isinstance(claim["measured"], float) and claim["measured"] > 0, claim
            bound = float(claim["bound"].split(">=")[-1].split()[0])
            assert claim["verdict"] == ("met" if claim["measured"] >= bound else "not_met"), claim
        # Timed on the engine's clock: every request of every workload, on either server.
        assert all(workload["timing_source"] == "engine" for workload in report["throughput"]["workloads"])
        # The inventory's quick check (replication_check_max_requests: 3) reached verify, and the report says so.
        assert report["throughput"]["max_requests"] == 3
        assert all(1 <= len(workload["requests"]) <= 3 for workload in report["throughput"]["workloads"])
        assert "At most 3 request(s) per workload" in (reports / name / "report.md").read_text()
    fleet = json.loads((reports / "fleet" / "fleet.json").read_text())
    assert sorted(host["host"] for host in fleet["hosts"]) == sorted(names)
    html = (reports / "fleet" / "fleet.html").read_text()
    assert "<svg" in html and "http://" not in html.split("<body", 1)[-1].replace("http://www.w3.org", "")
    assert "no-p2p" in (reports / "fleet" / "fleet.md").read_text()


def tune_host_document(appliance: Appliance, host: HostUnderTest, path: Path) -> Path:
    """What playbooks/tune.yml hands `b70ctl tune --host -` for this host (roles/vllm_serve/tasks/tune.yml): the
    connection variables as the provisioning inventory has them, and the role's unit as the serving stage left it."""
    inventory = yaml.safe_load((appliance.work_dir / "provision.yml").read_text())["all"]["children"]["b70_hosts"]
    hostvars = {**inventory["vars"], **inventory["hosts"][host.name]}
    document = {"name": host.name,
                **{variable: hostvars.get(variable) for variable in (
                    "ansible_connection", "ansible_host", "ansible_port", "ansible_user",
                    "ansible_ssh_private_key_file", "ansible_ssh_common_args", "ansible_ssh_extra_args")},
                "unit": "b70-vllm", "port": UNITS["b70-vllm"], "config_dir": "/etc/b70/serve", "etc_dir": "/etc/b70",
                "baseline_unit": "b70-vllm-baseline", "api_key": None, "health_timeout_s": 900}
    path.write_text(json.dumps(document))
    return path


def drop_in_exec_start(remote: testinfra.host.Host, drop_in: str) -> list[str]:
    """The ExecStart systemd reads for the unit: one command only (the drop-in's empty ExecStart= reset the
    unit's), and it is the drop-in's, as `systemctl cat` shows the drop-in."""
    shown = remote.check_output("systemctl show -p ExecStart --value b70-vllm")
    assert shown.count("argv[]=") == 1, shown
    assert remote.check_output("systemctl show -p DropInPaths --value b70-vllm").split() == [drop_in]
    catted = remote.check_output("systemctl cat b70-vllm")
    assert f"# {drop_in}\n" in catted, catted
    section = catted.split(f"# {drop_in}\n", 1)[1].split("\n# /", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("ExecStart=")]
    assert lines[0] == "ExecStart=" and len(lines) == 2, section
    argv = exec_start_argv(lines[1])
    assert " ".join(argv[:3]) in shown and argv[argv.index("--env-file") + 1] in shown  # the one systemd runs
    return argv


def served_container(remote: testinfra.host.Host) -> dict:
    """The unit's container as docker runs it on the host."""
    return json.loads(remote.check_output("docker inspect b70-vllm"))[0]


def completes(endpoint: Endpoint) -> None:
    with VllmClient(endpoint) as client:
        answer = client.complete("completions", "0 1 2 3 4 5 6 7", max_tokens=8, ignore_eos=True)
    assert answer["model"] == SERVED_MODEL and answer["choices"][0]["text"], answer
    assert answer["usage"]["completion_tokens"] == 8, answer


def test_tune_serves_its_baseline_and_a_candidate_through_the_unit_then_puts_it_back(provisioned, tmp_path) -> None:
    """b70ctl tune's own SystemdUnitServing, over SSH from the controller as playbooks/tune.yml runs it: the
    target-only baseline and the tune space's first candidate, each a runtime drop-in of the appliance's unit, are
    started for real (unit ExecStart -> docker -> the image's entrypoint -> vLLM) and answer; leaving the tune
    puts the unit back as the serving stage installed it and starts the baseline unit again."""
    appliance, _, _ = provisioned
    host = appliance.host(1)
    remote = on(host.name)
    installed_text = remote.file("/etc/systemd/system/b70-vllm.service").content_string
    installed = exec_start_argv(installed_text)
    appliance_host = _appliance_host(tune_host_document(appliance, host, tmp_path / "host.json"))
    assert isinstance(host_shell(appliance_host), SshShell)  # the controller reaches the host as Ansible does
    recipe = load_recipe("cpu-tiny")
    progress: list[str] = []
    unit = SystemdUnitServing(recipe, appliance_host, host_shell(appliance_host), progress=progress.append)
    image = json.loads(remote.file("/etc/b70/image.json").content_string)["id"]
    with unit:
        assert unit.container is not None and unit.container.image == image  # the unit's container.json
        assert not remote.service("b70-vllm-baseline").is_running  # stopped while the tune measures
        with unit.baseline() as endpoint:
            argv = drop_in_exec_start(remote, unit.drop_in)
            assert argv[argv.index("--env-file") + 1] == unit.env_file
            container = served_container(remote)
            assert container["Image"] == image  # images/entrypoint.sh, as the image installs it:
            assert container["Config"]["Entrypoint"] == ["/usr/local/bin/b70-entrypoint"]
            assert container["Config"]["Cmd"] == argv[argv.index(image) + 1:]
            assert "--speculative-config" not in container["Config"]["Cmd"]
            cmd = container["Config"]["Cmd"]
            assert recipe.serve.baseline_tensor_parallel_size == 1 and "--tensor-parallel-size" not in cmd  # TP=1
            completes(endpoint)
        grid, default = candidates_of(recipe, unit.profile)
        candidate = next(one for one in grid if one.key != default.key)
        assert candidate.overrides["num_speculative_tokens"] != 4  # another k than the installed unit's
        with unit.candidate(candidate) as endpoint:
            argv = drop_in_exec_start(remote, unit.drop_in)
            cmd = served_container(remote)["Config"]["Cmd"]
            assert cmd == argv[argv.index(image) + 1:]
            config = json.loads(cmd[cmd.index("--speculative-config") + 1])
            assert config == {"method": candidate.overrides["method"], "model": "/models/drafter",
                              "num_speculative_tokens": candidate.overrides["num_speculative_tokens"]}
            assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
            completes(endpoint)
            assert remote.check_output("systemctl show -p ActiveState --value b70-vllm") == "active"
    # The unit as installed: no drop-in, no candidate environment, the installed ExecStart, active and healthy.
    assert not remote.file(unit.drop_in).exists and not remote.file(unit.env_file).exists
    assert remote.check_output("systemctl show -p DropInPaths --value b70-vllm") == ""
    assert remote.check_output("systemctl cat b70-vllm") == (
        "# /etc/systemd/system/b70-vllm.service\n" + installed_text).strip()
    assert remote.service("b70-vllm").is_running
    assert served_container(remote)["Config"]["Cmd"] == installed[installed.index(image) + 1:]
    assert answers(host.address, 8000) and answers(host.address, 8000, "/v1/models")
    completes(Endpoint(unit.base_url, model=SERVED_MODEL))
    assert remote.service("b70-vllm-baseline").is_running
    wait_until_serving(host.address, UNITS["b70-vllm-baseline"])
    assert any("restored and healthy" in message for message in progress), progress


RECIPES_DATA = REPO_ROOT / "control" / "b70ctl" / "recipes" / "data"
RACE_BUDGET = 12  # one round of the three candidates (3 x 1 request x 2 workloads) and the final (2 x 1 x 2)


def race_recipe_file(name: str, directory: Path) -> Path:
    """The catalogue's recipe NAME as a recipe file sized for CI, as an owner would write one: two workloads of one
    request, the baseline and candidates at TP=1 (each start is then one process), and cpu-tiny's tune space cut
    to its served k=4, so the race is the embedded default's three methods: draft_model k=4, ngram, none."""
    data = load_recipe(name).model_dump(mode="json", exclude_none=True)
    data["serve"]["tensor_parallel_size"] = 1
    data["workloads"] = [{**workload, "min_requests": 1, "max_requests": 1}
                         for workload in data["workloads"] if workload["name"] in ("short", "acceptance_friendly")]
    if data.get("tune"):
        data["tune"] = {"num_speculative_tokens": [4], "budget_requests": RACE_BUDGET, "first_rung_requests": 1,
                        "final_requests": 1}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    # Its lock beside it, as for any recipe file: the catalogue's, which pins the same image and models.
    shutil.copyfile(RECIPES_DATA / f"{name}.lock.json", directory / f"{name}.lock.json")
    return path


def test_race_on_the_test_host_through_playbooks_tune_yml(provisioned, tmp_path) -> None:
    """playbooks/tune.yml with b70_tune_recipes, as an owner runs the race: b70ctl tune on the controller serves the
    host recipe's k=4, cpu-tiny-ngram and cpu-tiny-target-only one after the other through the host's own unit
    (unit ExecStart -> docker -> the image's entrypoint -> vLLM), gates each against silent garbage, measures them
    on the same workloads, places the winner's b70_tuned.yml beside the inventory and puts the unit back. Which
    recipe wins is this machine's measurement: that each candidate was served, gated and measured is asserted."""
    appliance, _, _ = provisioned
    host = appliance.host(1)
    remote = on(host.name)
    installed_text = remote.file("/etc/systemd/system/b70-vllm.service").content_string
    records = {name: remote.file(f"/etc/b70/{name}").content_string for name in ("image.json", "models.json")}
    race_started = remote.check_output("date +%s")
    recipes = [race_recipe_file(name, tmp_path) for name in ("cpu-tiny", "cpu-tiny-ngram", "cpu-tiny-target-only")]
    tune_dir, host_vars = tmp_path / "tune", tmp_path / "host_vars" / host.name
    inventory = appliance.inventory("tune-race", [host], group_vars={
        "b70_recipe": str(recipes[0]), "b70_tune_recipes": [str(path) for path in recipes[1:]],
        "vllm_serve_tune_budget_requests": RACE_BUDGET,
        # The report and host_vars/ away from the inventories the other tests share, whose runs would apply them.
        "vllm_serve_tune_dir": str(tune_dir), "vllm_serve_tune_host_vars_dir": str(host_vars)})
    run = run_playbook(inventory, playbook="playbooks/tune.yml")
    assert run.returncode == 0, run.output[-4000:]
    assert_recap(run, [host.name], failed=0)

    report = json.loads((tune_dir / "tune.json").read_text())
    assert report["race"] == ["cpu-tiny", "cpu-tiny-ngram", "cpu-tiny-target-only"]
    candidates = report["candidates"]
    assert sorted(candidate["recipe"] for candidate in candidates) == report["race"], candidates
    assert next(c for c in candidates if c["recipe"] == "cpu-tiny")["overrides"]["num_speculative_tokens"] == 4
    # Greedy speculation is lossless: each candidate matched the target-only baseline token for token, and the gate
    # (repeats, the long shared prefix from the cache, runs of one token) passed at its first serve on the host.
    for candidate in candidates:
        assert candidate["disqualified"] is None and candidate["correctness"] == "5/5 identical", candidate
        assert candidate["gate"] is not None and candidate["gate"].startswith("gate passed"), candidate
        assert candidate["halving"]["n"] == 2 and candidate["halving"]["score_tok_s"] > 0, candidate
    assert report["outcome"] in ("tuned", "default_best") and report["final"] is not None
    assert report["spent_requests"] <= RACE_BUDGET
    winner = next(c for c in candidates if c["key"] == report["final"]["winner_key"])
    assert report["winner_recipe"] == (winner["recipe"] if report["outcome"] == "tuned" else "cpu-tiny")
    # The winner's recipe and settings, placed where the next site.yml reads them, and the play said so.
    placed = yaml.safe_load((host_vars / "b70_tuned.yml").read_text())
    assert placed == yaml.safe_load((tune_dir / "b70_tuned.yml").read_text())
    assert placed["b70_recipe"] == report["winner_recipe"] == placed["vllm_serve_tuned"]["recipe"]
    assert f"report {tune_dir}/tune.md; apply it with site.yml or playbooks/serve.yml" in run.output
    # Each beside its roofline: the bandwidth and target files the replication check measured on this host (its
    # roofline_inputs.json, which the play found and passed), over which no decode rate can go.
    assert report["roofline"]["not_measured"] is None, report["roofline"]
    assert report["roofline"]["bandwidth_bytes_per_s"]["source"].startswith("measured on the serving machine")
    for candidate in candidates:
        assert candidate["bound_tok_s"] > candidate["halving"]["median_tok_s"] > 0, candidate
    # Each raced recipe ran what the play installed for it beside the host recipe's (race_install.yml): its image
    # and models records under /etc/b70/race/<recipe>/, its weights in its own store directory, its target read for
    # its roofline; docker started its candidates' containers with that store's label. The host's records stay.
    started_labels = remote.check_output(
        f"docker events --since {race_started} --until $(date +%s) --filter event=start "
        "--format '{{index .Actor.Attributes \"org.b70.models\"}}'").split()
    for name in ("cpu-tiny-ngram", "cpu-tiny-target-only"):
        image = json.loads(remote.file(f"/etc/b70/race/{name}/image.json").content_string)
        assert image["recipe"] == name and image["id"].startswith("sha256:"), image
        stored = ModelsRecord.model_validate_json(remote.file(f"/etc/b70/race/{name}/models.json").content_string)
        assert stored.target.path == f"/var/lib/b70/models/{name}/target"
        assert remote.file(f"{stored.target.path}/config.json").exists
        inputs = json.loads(remote.file(f"/etc/b70/race/{name}/roofline_inputs.json").content_string)
        assert inputs["target_shape"]["directory"] == stored.target.path, inputs
        assert stored.label() in started_labels, (name, started_labels)
    assert {name: remote.file(f"/etc/b70/{name}").content_string for name in records} == records
    # Each candidate's row beside the others in the report.
    table = (tune_dir / "tune.md").read_text()
    assert all(candidate["label"] in table for candidate in candidates), table
    # The unit as the serving stage installed it, serving again, and the baseline unit started again.
    assert remote.check_output("systemctl show -p DropInPaths --value b70-vllm") == ""
    assert remote.check_output("systemctl cat b70-vllm") == (
        "# /etc/systemd/system/b70-vllm.service\n" + installed_text).strip()
    assert remote.service("b70-vllm").is_running and answers(host.address, 8000, "/v1/models")
    wait_until_serving(host.address, UNITS["b70-vllm-baseline"])
    print(f"\n{report['summary']}\n{table}")


def test_image_digest_that_does_not_exist_fails_and_serving_stays(provisioned) -> None:
    appliance, _, _ = provisioned
    host = appliance.host(1)
    missing = "127.0.0.1:5999/b70/missing@sha256:" + "0" * 64
    pid = serving_pid(host.name)
    run = run_playbook(appliance.inventory("missing-digest", [host]), "-e", f"dspark_image_pull_reference={missing}",
                       "-e", "dspark_image_source=pull", playbook="playbooks/image.yml")
    assert run.returncode != 0
    assert_recap(run, [host.name], failed=1)
    assert f"cannot pull {missing} (digest sha256:{'0' * 64}" in run.output
    assert "dspark_image_source: build" in run.output and "b70ctl lock resolve" in run.output
    assert serving_pid(host.name) == pid and answers(host.address, 8000)
    assert json.loads(on(host.name).file("/etc/b70/image.json").content_string)["source"] == "build"


def test_drafter_of_another_model_is_refused_before_serving_changes(provisioned, tmp_path) -> None:
    """The controller's drafter (a copy of its model cache, its config given another vocabulary) is refused before
    any file reaches the host: the host's store and its serving stay as they were."""
    appliance, _, _ = provisioned
    host = appliance.host(2)
    remote = on(host.name)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "b70ctl" / "models"
    shutil.copytree(cache / "cpu-tiny", tmp_path / "models" / "cpu-tiny", symlinks=True)
    config = tmp_path / "models" / "cpu-tiny" / "drafter" / "config.json"
    foreign = json.loads(config.read_text()) | {"vocab_size": 151936}
    config.unlink()  # a file of its own: the original may be a hard link into the cache
    config.write_text(json.dumps(foreign))
    on_host = "/var/lib/b70/models/cpu-tiny/drafter/config.json"
    before = remote.file(on_host).sha256sum
    pid = serving_pid(host.name)
    run = run_playbook(appliance.inventory("foreign-drafter", [host], group_vars={
        "model_store_controller_dir": str(tmp_path / "models")}), playbook="playbooks/models.yml")
    assert run.returncode != 0
    assert_recap(run, [host.name], failed=1)
    assert "has vocab_size 151936, the target 1024: it is a drafter of another model" in run.output
    assert remote.file(on_host).sha256sum == before
    assert serving_pid(host.name) == pid and answers(host.address, 8000)


def test_serving_that_never_becomes_healthy_rolls_back_to_the_last_good(provisioned) -> None:
    appliance, _, _ = provisioned
    host = appliance.host(1)
    remote = on(host.name)
    good_env = remote.file("/etc/b70/serve/b70-vllm.env").content_string
    # A KV cache far larger than the machine: vLLM exits at start-up, and systemd would restart it in vain. The gate
    # stops at the first death (vllm_serve_start_deaths: 1), however long the health timeout.
    started = time.monotonic()
    run = run_playbook(appliance.inventory("never-healthy", [host],
                                           group_vars={"vllm_serve_extra_env": {"VLLM_CPU_KVCACHE_SPACE": "100000"},
                                                       "vllm_serve_health_timeout": 1200}),
                       playbook="playbooks/serve.yml")
    assert run.returncode != 0
    assert time.monotonic() - started < 1200, "the gate waited out its timeout instead of stopping at the death"
    assert_recap(run, [host.name], failed=1)
    # Whichever server died first (both are given the KV cache; the TP=1 baseline often starts, and dies, sooner).
    died = re.search(r"vLLM is not serving: Wait for /health failed \((b70-vllm(?:-baseline)?) died while starting "
                     r"\(1 time\(s\); systemd: ", run.output)
    assert died and died.group(0).startswith("vLLM is not serving"), run.output[-4000:]
    assert f"{host.name}: {died.group(0)}" in run.output
    assert "The last healthy configuration was put back and restarted." in run.output
    assert "Last log lines: [b70-vllm]" in run.output and "(100000.0 GiB)" in run.output  # vLLM's own reason
    # ... and the known failure it is, with its fix, from b70ctl diagnose's catalogue on the dead unit's journal.
    assert (f"[{died.group(1)}] kv-cache-larger-than-host-memory: Lower VLLM_CPU_KVCACHE_SPACE"
            in run.output.split("Diagnosis: ", 1)[-1]), run.output[-4000:]
    assert remote.file("/etc/b70/serve/b70-vllm.env").content_string == good_env
    wait_until_serving(host.address, 8000)
    wait_until_serving(host.address, 8001)


def model_dir_plans(run: PlaybookRun) -> list[dict]:
    """The b70_model_dir plans of a -v run (one per installed directory), from its JSON results."""
    section = run.output.split("TASK [model_store : Compare the host's target and drafter with their manifests]")[1]
    section = section.split("TASK [")[0]
    return [json.loads(line.split(" => ", 2)[2]) for line in section.splitlines()
            if line.startswith(("ok:", "changed:"))]


def task_items(run: PlaybookRun, task: str) -> list[str]:
    """The labels of the loop items a task changed."""
    section = run.output.split(f"TASK [model_store : {task}]")[1].split("TASK [")[0]
    return sorted(re.findall(r"^changed: \[[^]]+\] => \(item=(\S+)\)", section, re.M))


def test_hub_recipe_models_fetched_once_on_the_controller_verified_and_converted(provisioned, hub_env,
                                                                                  tmp_path) -> None:
    """A recipe whose models come from the hub (a local hub-compatible endpoint here): the controller fetches the
    locked revisions and converts the drafter; the host receives exactly the locked bytes. A re-run reads no
    weight, and an interrupted transfer resumes with what it had delivered."""
    appliance, _, _ = provisioned
    host = appliance.host(1)
    remote = on(host.name)
    recipe_file = write_recipe(tmp_path)
    resolve_and_write(str(recipe_file))
    _, lock, _ = load_recipe_and_lock(str(recipe_file))
    inventory = appliance.inventory("hub-models", [host], group_vars={
        "b70_recipe": str(recipe_file), "b70_hf_token": "hf_local_hub",
        "model_store_controller_dir": str(tmp_path / "cache")})
    try:
        run = run_playbook(inventory, playbook="playbooks/models.yml")
        assert run.returncode == 0, run.output[-4000:]
        assert "hf_local_hub" not in run.output
        store = "/var/lib/b70/models/store-test"
        for pin, directory in ((lock.target, "target"), (lock.drafter, "drafter")):
            for locked in pin.files:
                if directory == "drafter" and locked.path == "config.json":
                    continue  # rewritten by the conversion; its provenance names the source's hash
                assert remote.file(f"{store}/{directory}/{locked.path}").sha256sum == locked.sha256, locked.path
        drafter = json.loads(remote.file(f"{store}/drafter/config.json").content_string)
        assert drafter["architectures"] == ["Qwen3DSparkModel"]
        assert remote.file(f"{store}/drafter/b70ctl-provenance.json").is_file
        models = json.loads(remote.file("/etc/b70/models.json").content_string)
        assert models["target"]["revision"] == lock.target.revision
        assert models["drafter"]["revision"] == lock.drafter.revision
        weight = f"{store}/target/model.safetensors"
        weight_inode = remote.check_output(f"stat -c %i {weight}")
        # A no-op re-run compares manifests and file sizes: no weight is hashed (hashed_bytes 0), none is sent. (The
        # role's own no-op path: with its generation on, the converged stage would not run at all.)
        again = run_playbook(inventory, "-v", "-e", "generation_enabled=false", playbook="playbooks/models.yml")
        assert_recap(again, [host.name], changed=0, failed=0)
        assert [plan["hashed_bytes"] for plan in model_dir_plans(again)] == [0, 0], again.output[-4000:]
        assert all(plan["in_place"] for plan in model_dir_plans(again))
        assert task_items(again, "Send the files the host lacks") == []
        assert remote.check_output(f"stat -c %i {weight}") == weight_inode
        # A transfer cut after the drafter and the target's config.json arrived, half-way through the weights: no
        # manifest yet. The re-run keeps what arrived and sends only the rest.
        remote.check_output(f"rm {store}/target/.b70-manifest.json {store}/target/tokenizer.json"
                            f" && truncate -s 1000 {weight}")
        config_inode = remote.check_output(f"stat -c %i {store}/target/config.json")
        resumed = run_playbook(inventory, "-v", playbook="playbooks/models.yml")
        assert resumed.returncode == 0, resumed.output[-4000:]
        assert task_items(resumed, "Send the files the host lacks") == sorted(
            [weight, f"{store}/target/tokenizer.json"])
        assert remote.file(weight).sha256sum == next(f.sha256 for f in lock.target.files
                                                     if f.path == "model.safetensors")
        assert remote.check_output(f"stat -c %i {store}/target/config.json") == config_inode
        recorded = json.loads(remote.file(f"{store}/target/.b70-manifest.json").content_string)
        assert {f["path"]: f["sha256"] for f in recorded["files"]} == {f.path: f.sha256 for f in lock.target.files}
    finally:  # the host serves cpu-tiny: its models.json goes back to saying so
        restored = run_playbook(appliance.work_dir / "provision.yml", "--limit", host.name,
                                playbook="playbooks/models.yml")
        assert restored.returncode == 0, restored.output[-3000:]

def test_api_key_from_a_0600_file_then_verify_yml_reports_every_host_even_unreachable(provisioned) -> None:
    """Last: it leaves the no-P2P host serving with an API key. verify.yml on its own measures again, with the key
    from a 0600 file, and a host that cannot be reached becomes a row with its reason instead of stopping the run."""
    appliance, _, _ = provisioned
    host = appliance.host(2)
    remote = on(host.name)
    key = "sk-test-" + "7" * 24
    keyed = {"vllm_serve_api_key": key}
    served = run_playbook(appliance.inventory("api-key", [host], group_vars=keyed), playbook="playbooks/serve.yml")
    assert served.returncode == 0, served.output[-4000:]
    assert key not in served.output
    key_file = remote.file("/etc/b70/serve/api-key.env")
    assert key_file.mode == 0o600 and key_file.user == "b70"
    assert key not in remote.file("/etc/systemd/system/b70-vllm.service").content_string
    assert key not in remote.check_output("ps -eo args")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://{host.address}:8000/v1/models", timeout=10)
    assert refused.value.code == 401

    ghost = HostUnderTest("b70-app-ghost", "172.30.72.250", None)  # an address on the test network nobody holds
    inventory = appliance.inventory("fleet-with-ghost", [host, ghost], group_vars=keyed)
    reports = appliance.work_dir / "reports"
    before = (reports / host.name / "report.json").stat().st_mtime
    run = run_playbook(inventory, playbook="playbooks/verify.yml")
    assert run.returncode != 0  # the ghost is unreachable; the real host is verified regardless
    assert run.recap[host.name]["failed"] == 0 and run.recap[ghost.name]["unreachable"] == 1
    assert key not in run.output
    assert (reports / host.name / "report.json").stat().st_mtime > before  # measured again, with the key
    # Measured in full with the key: the lossless and acceptance claims hold whatever the load; the throughput ratios
    # are timings on 2 shared cores (0.20 against >= 0.4 once in a fresh-clone CI run), so they are asserted measured.
    report = json.loads((reports / host.name / "report.json").read_text())
    assert not report["partial"] and report["smoke"]["passed"] and report["correctness"]["passed"]
    verdicts = {verdict["claim_id"]: verdict["verdict"] for verdict in report["verdicts"]}
    assert verdicts["greedy-identical"] == verdicts["acceptance-friendly-acceptance"] == "met", verdicts
    assert set(verdicts.values()) <= {"met", "not_met"}, verdicts
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    # The controller held the key in a 0600 file only while verify ran.
    assert not (cache / "b70ctl" / "secrets" / f"{host.name}.api-key").exists()
    marker = json.loads((reports / ghost.name / "unreachable.json").read_text())
    assert marker["kind"] == "unreachable" and "172.30.72.250" in marker["reason"]
    fleet = json.loads((reports / "fleet" / "fleet.json").read_text())
    rows = {entry["host"]: entry for entry in fleet["hosts"]}
    assert rows[ghost.name]["status"] == "unreachable" and rows[host.name]["status"] == "verified"
