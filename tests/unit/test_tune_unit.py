"""b70ctl tune on an appliance host: the unit-owning CandidateServers (tune/unit.py) against an emulated host.

The host is a directory standing for its root, with the unit the role's real template renders (its real filter
plugin quoting the role's ExecStart); file commands (cat, rm, mkdir, sh) run for real under that root, systemctl is
emulated: a restart reads the unit and its drop-ins the way systemd merges them (an empty ExecStart= resets) and
serves, on the unit's port, a scripted vLLM whose speed follows the --speculative-config of the ExecStart it read.
So each candidate's measured rate comes from what the drop-in really says. The drop-ins are also checked by
systemd-analyze verify beside the unit, and their ExecStart by systemd's word splitting (test_hostile_inputs).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from b70ctl.errors import BadInput
from b70ctl.host.environment import HostBundle
from b70ctl.recipes import load_recipe
from b70ctl.serve.local import free_port
from b70ctl.serve.render import render_container
from b70ctl.serve.unit import ServingContainer
from b70ctl.stops import Terminated, sigterm_ends_the_run
from b70ctl.tune.run import run_tune
from b70ctl.tune.unit import ApplianceHost, HostCommandFailed, LocalShell, SshShell, SystemdUnitServing, host_shell
from hostile import HOSTILE_UNIT_VALUES, render_unit
from scripted_server import ScriptedServer, steady_script
from systemd_words import systemd_split, systemd_verify_root
from tune_scripts import RECIPE, SERVED_RATES

REPO = Path(__file__).resolve().parents[2]
UNIT = "b70-vllm"
BASELINE_UNIT = "b70-vllm-baseline"
CONFIG_DIR = "/etc/b70/serve"
MODEL = RECIPE.serve.served_model_name


class PortServer(ScriptedServer):
    """A scripted vLLM on the unit's own port (a restart binds it again)."""

    def __init__(self, port: int):
        self.fixed_port = port
        super().__init__(model=MODEL)

    def server_bind(self) -> None:
        self.server_address = ("127.0.0.1", self.fixed_port)
        super().server_bind()


def speculative_k(argv: list[str]) -> int | None:
    if "--speculative-config" not in argv:
        return None
    return json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"]


class EmulatedHost:
    """A host root with the role's unit; systemctl emulated, every other command run for real under the root."""

    def __init__(self, root: Path, port: int, rates: dict[int, float], no_start: frozenset[int] = frozenset(),
                 on_restart=None):
        self.root, self.port, self.rates, self.no_start = root, port, rates, no_start
        self.on_restart = on_restart
        self.refused: frozenset[int] = frozenset()  # k whose start systemctl reports as failed
        # k whose container exits at start: systemd (Restart=on-failure, RestartSec=10) waits to start it again
        self.dies: frozenset[int] = frozenset()
        self.sub_state = "running"
        self.calls: list[list[str]] = []
        self.active: set[str] = {UNIT, BASELINE_UNIT}
        self.served: list[list[str]] = []  # the ExecStart argv of every start of UNIT
        self.drop_ins: list[str] = []  # every drop-in text a start read
        self.server: PortServer | None = None
        self.original_exec = self.install()

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")

    def install(self) -> list[str]:
        """What roles/vllm_serve leaves: env file, container.json, the unit from the real template, with the
        ExecStart and the record `b70ctl serve render --unit` gives the role."""
        container = ServingContainer(unit=UNIT, image="sha256:image", env_file=f"{CONFIG_DIR}/{UNIT}.env",
                                     models_dir="/var/lib/b70/models", models_label="0123456789abcdef",
                                     model_dir="/models/tiny-target", drafter_dir="/models/tiny-drafter",
                                     port=self.port)
        rendered = render_container(RECIPE, container.context(speculative=True), None)
        exec_argv = container.exec_start(rendered)
        assert exec_argv[:6] == ["/usr/bin/docker", "run", "--rm", "--name", UNIT, "--env-file"]
        unit = self.path(f"/etc/systemd/system/{UNIT}.service")
        unit.parent.mkdir(parents=True)
        unit.write_text(render_unit(RECIPE.name, exec_argv, unit=UNIT))
        config = self.path(CONFIG_DIR)
        config.mkdir(parents=True)
        (config / f"{UNIT}.env").write_text("".join(f"{k}={v}\n" for k, v in sorted(rendered.env.items())))
        (config / f"{UNIT}.container.json").write_text(container.model_dump_json(indent=2))
        self.unit_text = unit.read_text()
        return exec_argv

    # -- systemd ---------------------------------------------------------------------------------------------
    def exec_start(self, unit: str) -> list[str]:
        """ExecStart as systemd merges the unit file and its drop-ins (/etc's, then /run's; an empty one resets)."""
        lines = self.path(f"/etc/systemd/system/{unit}.service").read_text().splitlines()
        for directory in (f"/etc/systemd/system/{unit}.service.d", f"/run/systemd/system/{unit}.service.d"):
            for drop_in in sorted(self.path(directory).glob("*.conf")) if self.path(directory).is_dir() else []:
                self.drop_ins.append(drop_in.read_text())
                lines += drop_in.read_text().splitlines()
        commands: list[list[str]] = []
        for line in lines:
            if line.startswith("ExecStart="):
                value = line.removeprefix("ExecStart=")
                commands = [] if not value else [*commands, systemd_split(value)]
        assert len(commands) == 1, commands
        return commands[0]

    def start(self, unit: str) -> None:
        self.active.add(unit)
        if unit != UNIT:
            return
        argv = self.exec_start(unit)
        self.served.append(argv)
        if self.on_restart is not None:
            self.on_restart(self)
        k = speculative_k(argv)
        self.sub_state = "auto-restart" if k in self.dies else "running"
        if k in self.dies:
            return
        if k in self.refused:
            raise HostCommandFailed(["systemctl", "restart", unit], f"Job for {unit}.service failed")
        if k in self.no_start:
            return  # the container exits at once: nothing answers on the port
        env_file = argv[argv.index("--env-file") + 1]
        assert self.path(env_file).is_file(), env_file
        self.server = PortServer(self.port)
        self.server.model = argv[argv.index("--served-model-name") + 1]  # what /v1/models lists
        self.server.__enter__()
        self.server.speculates = k is not None
        self.server.default_script = steady_script(self.rates.get(k, 300.0) if k is not None else 300.0)

    def stop(self, unit: str) -> None:
        self.active.discard(unit)
        if unit == UNIT and self.server is not None:
            self.server.__exit__(None, None, None)
            self.server = None

    def systemctl(self, arguments: list[str]) -> str:
        verb, *units = arguments
        names = [unit.removesuffix(".service") for unit in units]
        if verb == "daemon-reload":
            return ""
        if verb == "show":  # a manual start sets NRestarts back to 0; the one that died has not been restarted yet
            assert arguments[1] == "--property=NRestarts,SubState", arguments
            return f"NRestarts=0\nSubState={self.sub_state if names[-1] == UNIT else 'running'}\n"
        if verb == "is-active":
            if names[0] not in self.active:
                raise HostCommandFailed(["systemctl", *arguments], "inactive")
            return "active\n"
        for name in names:
            if verb in ("restart", "stop"):
                self.stop(name)
            if verb in ("restart", "start"):
                self.start(name)
        return ""

    def run(self, argv: list[str], stdin: str | None = None) -> str:
        self.calls.append(argv)
        if argv[0] == "systemctl":
            return self.systemctl(argv[1:])
        if argv[0] == "journalctl":
            return "INFO starting\nRuntimeError: Engine core initialization failed\n"
        assert argv[0] in ("cat", "rm", "mkdir", "sh", "ls"), argv
        under_root = [argv[0], *(str(self.path(part)) if part.startswith("/") else part for part in argv[1:])]
        return LocalShell(become=False).run(under_root, stdin)

    def close(self) -> None:
        self.stop(UNIT)


@pytest.fixture
def host_factory(tmp_path):
    made: list[EmulatedHost] = []

    def make(**options) -> tuple[EmulatedHost, ApplianceHost]:
        port = free_port()
        emulated = EmulatedHost(tmp_path / "host", port, **{"rates": SERVED_RATES, **options})
        emulated.start(UNIT)
        made.append(emulated)
        appliance = ApplianceHost(name="tiny-1", address="127.0.0.1", unit=UNIT, port=port, config_dir=CONFIG_DIR,
                                  baseline_unit=BASELINE_UNIT, health_timeout_s=1.0)
        return emulated, appliance

    yield make
    for emulated in made:
        emulated.close()


def assert_restored(emulated: EmulatedHost) -> None:
    assert not emulated.path(f"/run/systemd/system/{UNIT}.service.d/b70-tune.conf").exists()
    assert not emulated.path(f"{CONFIG_DIR}/{UNIT}.tune.env").exists()
    assert emulated.path(f"/etc/systemd/system/{UNIT}.service").read_text() == emulated.unit_text
    assert emulated.served[-1] == emulated.original_exec and emulated.server is not None
    assert emulated.active == {UNIT, BASELINE_UNIT}


def test_each_candidate_is_served_by_the_roles_unit_and_the_unit_is_put_back(host_factory, tmp_path):
    emulated, appliance = host_factory(no_start=frozenset({1}))
    with SystemdUnitServing(RECIPE, appliance, emulated, poll_s=0.05) as servers:
        assert emulated.active == {UNIT}  # the baseline unit is stopped while the tune measures
        report = run_tune(RECIPE, servers, tmp_path / "tune")
    # the speeds came from the drop-ins' own --speculative-config: the fastest correct k won
    assert report.outcome == "tuned" and report.tuned_overrides["num_speculative_tokens"] == 5
    results = {c.overrides["num_speculative_tokens"]: c for c in report.candidates}
    assert results[1].disqualified.startswith("the server did not start: not healthy within 1 s")
    assert "RuntimeError: Engine core initialization failed" in results[1].disqualified
    # baseline first (no speculation), then each start's ExecStart: the role's, with the candidate's rendered part
    # and its own environment file, nothing else
    starts = emulated.served[1:-1]
    assert speculative_k(starts[0]) is None and [speculative_k(a) for a in starts[1:7]] == [1, 2, 3, 4, 5, 6]
    tune_env = f"{CONFIG_DIR}/{UNIT}.tune.env"
    for argv in starts:
        swapped = [tune_env if part == f"{CONFIG_DIR}/{UNIT}.env" else part for part in emulated.original_exec]
        assert argv[:12] == swapped[:12] and argv[12:argv.index("sha256:image")] == \
            swapped[12:swapped.index("sha256:image")]
    assert_restored(emulated)


def test_a_drop_in_passes_systemd_analyze_verify_beside_the_unit(host_factory, tmp_path):
    emulated, appliance = host_factory()
    from b70ctl.tune.model import Candidate

    hostile = RECIPE.model_copy(update={"serve": RECIPE.serve.model_copy(
        update={"served_model_name": HOSTILE_UNIT_VALUES["newline-directive"] + "%h$HOME"})})
    with SystemdUnitServing(hostile, appliance, emulated, poll_s=0.05) as servers:
        with servers.candidate(Candidate(overrides={"num_speculative_tokens": 3})) as endpoint:
            assert endpoint.model == hostile.serve.served_model_name
            drop_in = emulated.path(f"/run/systemd/system/{UNIT}.service.d/b70-tune.conf").read_text()
            # the unit's User= (not root) runs the docker CLI that reads it, as it reads the role's env file
            assert emulated.path(f"{CONFIG_DIR}/{UNIT}.tune.env").stat().st_mode & 0o777 == 0o644
        servers.recipe = RECIPE  # the unit as the role installed it serves the recipe's own name
    exec_lines = [line for line in drop_in.splitlines() if line.startswith("ExecStart")]
    assert exec_lines[0] == "ExecStart=" and len(exec_lines) == 2
    argv = systemd_split(exec_lines[1].removeprefix("ExecStart="))
    assert argv[argv.index("--served-model-name") + 1] == hostile.serve.served_model_name
    # Under a root of its own (systemd_verify_root): on this machine docker may not be installed yet.
    root = systemd_verify_root(tmp_path / "root")
    unit_dir = root / "etc/systemd/system"
    (unit_dir / f"{UNIT}.service.d").mkdir(parents=True)
    (unit_dir / f"{UNIT}.service").write_text(emulated.unit_text)
    (unit_dir / f"{UNIT}.service.d" / "b70-tune.conf").write_text(drop_in)
    verified = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}",
                               str(unit_dir / f"{UNIT}.service")],
                              capture_output=True, text=True, timeout=60)
    problems = [line for line in verified.stderr.splitlines() if "b70-tune.conf" in line or "Unknown" in line
                or "Invalid" in line or "bad" in line.lower()]
    assert verified.returncode == 0 and not problems, verified.stderr


def test_sigterm_mid_tune_puts_the_unit_back_and_keeps_the_measurements(host_factory, tmp_path):
    def terminate_at_the_fourth_candidate(emulated: EmulatedHost) -> None:
        if len(emulated.served) == 1 + 1 + 4:  # the unit as found, the baseline, three candidates, this one
            os.kill(os.getpid(), signal.SIGTERM)

    emulated, appliance = host_factory(on_restart=terminate_at_the_fourth_candidate)
    with pytest.raises(Terminated), sigterm_ends_the_run():
        with SystemdUnitServing(RECIPE, appliance, emulated, poll_s=0.05) as servers:
            run_tune(RECIPE, servers, tmp_path / "tune")
    assert_restored(emulated)
    state = (tmp_path / "tune" / "tune-state.jsonl").read_text().splitlines()
    assert len(state) == 1 + 3


def test_a_unit_that_does_not_come_back_is_said_and_fails_the_run(host_factory, tmp_path):
    emulated, appliance = host_factory()
    messages: list[str] = []
    servers = SystemdUnitServing(RECIPE, appliance.model_copy(update={"health_timeout_s": 0.2}), emulated,
                                 progress=messages.append, poll_s=0.05)
    servers.__enter__()
    emulated.no_start = frozenset({4})  # the recipe's own k=4: the unit put back never answers
    with pytest.raises(BadInput, match="the serving unit was not restored: b70-vllm: not healthy within 0 s"):
        servers.__exit__(None, None, None)
    assert BASELINE_UNIT in emulated.active  # the baseline unit is started again all the same
    assert any("run playbooks/serve.yml on this host" in message for message in messages)


def install_raced(emulated: EmulatedHost, recipe_name: str, image_recipe: str | None = None) -> None:
    """What playbooks/tune.yml leaves for a raced recipe: the image and model stages' documents under
    /etc/b70/race/<recipe>/ (b70ctl image record, b70ctl model record) and the roofline inputs read beside them."""
    from b70ctl.image.documents import ProvidedImage
    from b70ctl.models.record import ModelsRecord

    directory = emulated.path(f"/etc/b70/race/{recipe_name}")
    directory.mkdir(parents=True)
    provided = ProvidedImage(recipe=image_recipe or recipe_name, source="build", reference="b70/vllm-cpu:raced",
                             vllm_version="0.21.0", id="sha256:raced")
    (directory / "image.json").write_text(provided.installed("sha256:raced").model_dump_json())
    models = ModelsRecord.model_validate({"target": {"path": f"/var/lib/b70/models/{recipe_name}/target",
                                                    "revision": "c" * 40}})
    (directory / "models.json").write_text(models.model_dump_json())
    (directory / "roofline_inputs.json").write_text(json.dumps({
        "target_shape": {"directory": f"/var/lib/b70/models/{recipe_name}/target", "weight_files": 1,
                         "weight_bytes": 3_000_000, "num_hidden_layers": 2, "num_key_value_heads": 2,
                         "head_dim": 32, "full_attention_layers": 2},
        "memory_bandwidth_unavailable": "not measured beside the raced models"}))


def test_a_raced_recipe_runs_the_image_and_models_tune_yml_installed_for_it(host_factory, tmp_path):
    """A raced recipe on another image is served through the same unit with the image and model store the race
    installed for it (its ExecStart: the unit's, with that image and that store mounted), is bound by its own
    target's weights, and the unit is put back as the serving stage installed it."""
    from b70ctl.report.model import RooflineInputs
    from b70ctl.tune.run import Entrant, run_race
    from b70ctl.tune.unit import RacedRecipe

    plain = load_recipe("cpu-tiny-target-only")
    other = plain.model_copy(update={"name": "cpu-tiny-elsewhere",
                                     "image": plain.image.model_copy(update={"tag": "elsewhere"})})
    emulated, appliance = host_factory()
    unit = SystemdUnitServing(RECIPE, appliance, emulated, poll_s=0.05)
    with pytest.raises(BadInput, match=r"needs image .*, and tiny-1 holds no /etc/b70/race/cpu-tiny-elsewhere/"):
        unit.serving_of(other)
    install_raced(emulated, "cpu-tiny-other-recipe")
    emulated.path("/etc/b70/race/cpu-tiny-other-recipe").rename(emulated.path("/etc/b70/race/cpu-tiny-elsewhere"))
    with pytest.raises(BadInput, match=r"image.json is recipe cpu-tiny-other-recipe's image, not cpu-tiny-elsewhere's"):
        unit.serving_of(other)
    for stale in emulated.path("/etc/b70/race/cpu-tiny-elsewhere").iterdir():
        stale.unlink()
    emulated.path("/etc/b70/race/cpu-tiny-elsewhere").rmdir()
    install_raced(emulated, "cpu-tiny-elsewhere")
    raced = unit.serving_of(other)
    assert isinstance(raced, RacedRecipe) and raced.roofline_inputs.target_shape.weight_bytes == 3_000_000
    host_inputs = RooflineInputs.model_validate({
        "memory_bandwidth": {"bytes_per_s": 20e9, "method": "a copy", "buffer_bytes": 2**27, "repeats": 5},
        "target_shape": {"directory": "/models/tiny-target", "weight_files": 1, "weight_bytes": 2_000_000,
                         "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 32,
                         "full_attention_layers": 2}})
    entrants = [Entrant(RECIPE, unit), Entrant(other, raced, raced.roofline_inputs)]
    with unit:
        report = run_race(entrants, tmp_path / "race", budget_requests=60, roofline_inputs=host_inputs)
    elsewhere = [argv for argv in emulated.served if "sha256:raced" in argv]
    assert elsewhere, "the raced recipe was never served"
    for argv in elsewhere:
        assert "/var/lib/b70/models/cpu-tiny-elsewhere:/models:ro" in argv and "sha256:image" not in argv
        assert argv[argv.index("sha256:raced") + 1:][:2] == ["--model", "/models/target"]  # its store's target
        assert argv[:6] == emulated.original_exec[:6]  # the unit's container name, environment file option
    for argv in emulated.served:
        if "sha256:raced" not in argv:
            assert "/var/lib/b70/models:/models:ro" in argv
    result = next(c for c in report.candidates if c.recipe == "cpu-tiny-elsewhere")
    assert result.bound_tok_s == pytest.approx(20e9 / 3_000_000)  # the host's bandwidth over its own weights
    assert_restored(emulated)


def test_a_host_the_serving_stage_has_not_prepared_is_refused(host_factory):
    emulated, appliance = host_factory()
    emulated.path(f"{CONFIG_DIR}/{UNIT}.container.json").unlink()
    with pytest.raises(BadInput, match=r"b70-vllm.container.json could not be read .*run the serving stage"):
        with SystemdUnitServing(RECIPE, appliance, emulated):
            pass
    assert emulated.active == {UNIT, BASELINE_UNIT}  # nothing was touched


def test_ssh_carries_each_argument_whole_and_sudo_for_another_user():
    host = ApplianceHost(name="b70-1", address="10.0.0.5", ssh_port=2222, ssh_user="ops",
                         ssh_private_key="/keys/id", ssh_common_args="-o StrictHostKeyChecking=no ")
    argv = SshShell(host).ssh_argv(["sh", "-c", 'cat > "$1"', "x", "/etc/b70/serve/a b.env"])
    assert argv[:10] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", "/keys/id", "-o",
                         "StrictHostKeyChecking=no", "--"]
    assert argv[10] == "ops@10.0.0.5"
    assert shlex.split(argv[11]) == ["sudo", "-n", "--", "sh", "-c", 'cat > "$1"', "x", "/etc/b70/serve/a b.env"]
    root = SshShell(host.model_copy(update={"ssh_user": "root"})).ssh_argv(["true"])
    assert root[-1] == "true"


def _tune_stdin(target: dict[str, object]) -> ApplianceHost:
    """roles/vllm_serve/tasks/tune.yml's stdin, rendered for a host whose hostvars hold `target`."""
    import jinja2
    import yaml

    task = next(task for task in yaml.safe_load((REPO / "roles/vllm_serve/tasks/tune.yml").read_text())
                if "b70ctl" in task)
    assert task["vars"]["vllm_serve_tune_target"] == "{{ hostvars[inventory_hostname] }}"
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined)
    environment.filters.update(to_json=json.dumps, bool=bool)
    # delegated to localhost, the task's own ansible_connection is the controller's: the host's are in hostvars
    variables = {"inventory_hostname": "b70-1", "ansible_connection": "local", "vllm_serve_tune_target": target,
                 "vllm_serve_unit": UNIT, "vllm_serve_port": 8000, "vllm_serve_config_dir": CONFIG_DIR,
                 "b70_etc_dir": "/etc/b70", "vllm_serve_baseline": True, "vllm_serve_baseline_unit": BASELINE_UNIT,
                 "vllm_serve_api_key": "", "vllm_serve_health_timeout": 900}
    # The b70ctl action sends its input as JSON: the expression's value, as Ansible's native templating gives it.
    expression = task["b70ctl"]["input"].strip()
    assert expression.startswith("{{") and expression.endswith("}}"), expression
    document = environment.compile_expression(expression[2:-2])(**variables)
    return ApplianceHost.model_validate_json(json.dumps(document))


def test_the_playbooks_host_document_is_what_b70ctl_tune_reads():
    """The stdin, rendered with an inventory's connection settings, validates as the --host document (a key it
    misses or adds would fail the tune on every host), and reaches the host as Ansible's ssh would: the port as
    the inventory wrote it (a string), the common arguments, then the extra ones."""
    host = _tune_stdin({"ansible_host": "10.0.0.5", "ansible_port": "2222", "ansible_user": "ops",
                        "ansible_ssh_private_key_file": "/keys/id", "ansible_ssh_common_args": "-o A=b",
                        "ansible_ssh_extra_args": "-o 'C=d e'"})
    assert (host.address, host.ssh_port, host.ssh_user, host.connection) == ("10.0.0.5", 2222, "ops", "ssh")
    assert host.baseline_unit == BASELINE_UNIT and host.api_key is None and host.health_timeout_s == 900
    argv = SshShell(host).ssh_argv(["true"])
    assert argv[:11] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", "/keys/id", "-o", "A=b", "-o", "C=d e"]
    assert argv[-2] == "ops@10.0.0.5"


FAKE_TUNE = """#!{python}
# b70ctl as roles/vllm_serve/tasks/tune.yml calls it: keeps the --host document it was given and leaves a result.
import pathlib, sys
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
(out / "host.json").write_text(sys.stdin.read())
(out / "argv.json").write_text(__import__("json").dumps(sys.argv[1:]))
(out / "b70_tuned.yml").write_text("vllm_serve_tuned: {{}}\\n")
sys.stderr.write("tune: kept the default\\n")
"""


def test_the_roles_tune_tasks_hand_b70ctl_each_hosts_connection_through_ansible(tmp_path: Path) -> None:
    """roles/vllm_serve/tasks/tune.yml run by ansible-playbook over an inventory, b70ctl stood in for by a script
    that keeps its stdin: what Ansible's own templating makes of hostvars (a port written as a string, a host with
    no settings, a local connection) is the --host document ApplianceHost reads. No host is contacted: every task
    that runs a command is delegated to the controller (the raced recipes' install, which is not, is left off)."""
    import os
    import sys

    fake = tmp_path / "b70ctl"
    fake.write_text(FAKE_TUNE.format(python=sys.executable))
    fake.chmod(0o755)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"b70_hosts": {"hosts": {
        "b70-remote": {"ansible_host": "10.0.0.5", "ansible_port": "2222", "ansible_user": "ops",
                       "ansible_ssh_private_key_file": "/keys/id", "ansible_ssh_common_args": "-o A=b",
                       "ansible_ssh_extra_args": "-o 'C=d e'",
                       # a race: the host's own recipe listed too, in another place
                       "vllm_serve_tune_recipes": ["cpu-tiny-ngram", "cpu-tiny", "cpu-tiny-target-only"]},
        "b70-bare": {},
        "b70-here": {"ansible_connection": "local"},
    }}}))
    playbook = tmp_path / "tune.yml"
    playbook.write_text(json.dumps([{
        "hosts": "b70_hosts", "gather_facts": False,
        "vars": {"b70_ctl": str(fake), "b70_recipe": "cpu-tiny", "b70_etc_dir": "/etc/b70",
                 "vllm_serve_tune_dir": str(tmp_path / "reports") + "/{{ inventory_hostname }}/tune",
                 "vllm_serve_tune_host_vars_dir": str(tmp_path / "host_vars") + "/{{ inventory_hostname }}",
                 "vllm_serve_tune_roofline_inputs": str(tmp_path / "reports") + "/{{ inventory_hostname }}/"
                                                    "roofline_inputs.json",
                 # The raced recipes' install contacts the host (tests/appliance/test_workload.py runs it).
                 "vllm_serve_tune_install_raced": False,
                 "vllm_serve_tune_budget_requests": 0, "vllm_serve_tune_throttle": 0, "vllm_serve_unit": UNIT,
                 "vllm_serve_port": 8000, "vllm_serve_config_dir": CONFIG_DIR, "vllm_serve_baseline": False,
                 "vllm_serve_baseline_unit": BASELINE_UNIT, "vllm_serve_api_key": "",
                 "vllm_serve_health_timeout": 900},
        "tasks": [{"ansible.builtin.include_tasks": str(REPO / "roles/vllm_serve/tasks/tune.yml"),
                   "vars": {"vllm_serve_tune_recipes": "{{ hostvars[inventory_hostname].vllm_serve_tune_recipes "
                                                       "| default([]) }}"}}]}]))
    # The replication check measured b70-remote's roofline inputs; the other hosts were not checked yet.
    measured = tmp_path / "reports" / "b70-remote" / "roofline_inputs.json"
    measured.parent.mkdir(parents=True)
    measured.write_text("{}")
    env = {**os.environ, "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-local"), "ANSIBLE_REMOTE_TMP": str(tmp_path / "remote")}
    run = subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "-i", str(inventory),
                          str(playbook)], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    def handed(host: str) -> ApplianceHost:
        return ApplianceHost.model_validate_json((tmp_path / "reports" / host / "tune" / "host.json").read_text())

    remote = handed("b70-remote")
    assert SshShell(remote).ssh_argv(["true"]) == [
        "ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", "/keys/id", "-o", "A=b", "-o", "C=d e", "--",
        "ops@10.0.0.5", "sudo -n -- true"]
    assert (remote.unit, remote.baseline_unit, remote.api_key) == (UNIT, None, None)
    bare = handed("b70-bare")
    assert (bare.connection, bare.address, bare.ssh_port, bare.ssh_user) == ("ssh", "b70-bare", 22, None)
    assert handed("b70-here").connection == "local"
    assert (tmp_path / "host_vars" / "b70-here" / "b70_tuned.yml").is_file()

    # The command line as b70ctl's own parser reads it: the host's recipe first, then the race's others once.
    import typer.main

    from b70ctl.cli import app

    group = typer.main.get_command(app)
    tune = group.get_command(group.make_context("b70ctl", ["tune"]), "tune")  # type: ignore[attr-defined]

    def raced(host: str) -> list[str]:
        argv = json.loads((tmp_path / "reports" / host / "tune" / "argv.json").read_text())
        assert argv[0] == "tune"
        return list(tune.make_context("tune", argv[1:]).params["recipe"])

    assert raced("b70-remote") == ["cpu-tiny", "cpu-tiny-ngram", "cpu-tiny-target-only"]
    assert raced("b70-bare") == ["cpu-tiny"]

    def inputs(host: str) -> Path | None:
        argv = json.loads((tmp_path / "reports" / host / "tune" / "argv.json").read_text())
        return tune.make_context("tune", argv[1:]).params["roofline_inputs"]

    assert inputs("b70-remote") == measured and inputs("b70-bare") is None


def test_a_host_with_no_connection_settings_is_reached_by_its_inventory_name_as_ssh_would():
    host = _tune_stdin({})
    assert (host.address, host.ssh_port, host.ssh_user, host.ssh_private_key, host.connection) == (
        "b70-1", 22, None, None, "ssh")
    assert SshShell(host).ssh_argv(["true"]) == ["ssh", "-o", "BatchMode=yes", "-p", "22", "--", "b70-1", "true"]


@pytest.mark.parametrize(("plugin", "connection"), [
    ("local", "local"), ("ansible.builtin.local", "local"), ("ssh", "ssh"), ("ansible.builtin.ssh", "ssh"),
    ("ansible.builtin.paramiko_ssh", "ssh"),
])
def test_the_inventorys_connection_plugin_decides_local_or_ssh(plugin, connection):
    host = _tune_stdin({"ansible_connection": plugin})
    assert host.connection == connection
    assert isinstance(host_shell(host), LocalShell if connection == "local" else SshShell)


def test_the_local_connection_names_are_the_ones_ansible_resolves_to_its_local_plugin():
    """LOCAL_CONNECTIONS against ansible-core's own plugin loader (the installed ansible-core, not this repo): each
    name resolves to ansible/plugins/connection/local.py, and the ssh plugins do not."""
    from b70ctl.tune.unit import LOCAL_CONNECTIONS

    names = sorted(LOCAL_CONNECTIONS) + ["ssh", "ansible.builtin.ssh", "ansible.builtin.paramiko_ssh"]
    program = ("import json, sys\n"
               "from ansible.plugins.loader import connection_loader, init_plugin_loader\n"
               "init_plugin_loader()\n"
               "print(json.dumps({name: connection_loader.find_plugin_with_context(name).plugin_resolved_path\n"
               "                  for name in sys.argv[1:]}))\n")
    done = subprocess.run([sys.executable, "-c", program, *names], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)
    local = {name for name, path in resolved.items() if path and path.endswith("/ansible/plugins/connection/local.py")}
    assert local == LOCAL_CONNECTIONS
    assert all(resolved[name] for name in names)  # each a real plugin of the installed ansible-core


def test_a_hand_written_host_document_in_the_fields_own_names_still_reads():
    """`--host FILE` documents written before the playbook passed Ansible's names keep working."""
    host = ApplianceHost.model_validate({"name": "b70-1", "connection": "local", "address": "127.0.0.1",
                                         "ssh_port": 2200, "ssh_common_args": "-o A=b"})
    assert (host.connection, host.address, host.ssh_port, host.ssh_common_args) == ("local", "127.0.0.1", 2200,
                                                                                     "-o A=b")


def test_a_setting_given_under_both_names_is_refused_in_one_line(tmp_path):
    document = tmp_path / "host.json"
    document.write_text(json.dumps({"name": "b70-1", "address": "10.0.0.5", "ansible_host": "10.0.0.6"}))
    result = subprocess.run([sys.executable, "-c", "from b70ctl.cli import main; main()", "tune", "--out",
                             str(tmp_path / "out"), "--host", str(document)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "ansible_host and address both given: pass one of them" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_candidate_systemd_refuses_to_start_is_disqualified_not_a_crash(host_factory):
    from b70ctl.tune.model import Candidate
    from b70ctl.tune.serving import CandidateFailed

    emulated, appliance = host_factory()
    emulated.refused = frozenset({6})
    with SystemdUnitServing(RECIPE, appliance, emulated, poll_s=0.05) as servers:
        with pytest.raises(CandidateFailed, match=r"systemctl restart failed: Job for b70-vllm.service failed; "
                                                  r"last log line: RuntimeError"):
            with servers.candidate(Candidate(overrides={"num_speculative_tokens": 6})):
                pass
    assert_restored(emulated)


def test_a_candidate_whose_server_exits_at_start_is_disqualified_at_once_not_after_the_timeout(host_factory):
    """The role's gate stops at the first death; so does the tune's. Here the health timeout is 30 s: a
    disqualification that names the death (not "not healthy within 30 s") did not wait for it."""
    from b70ctl.tune.model import Candidate
    from b70ctl.tune.serving import CandidateFailed

    emulated, appliance = host_factory()
    emulated.dies = frozenset({6})
    with SystemdUnitServing(RECIPE, appliance.model_copy(update={"health_timeout_s": 30.0}), emulated,
                            poll_s=0.05) as servers:
        with pytest.raises(CandidateFailed) as failed:
            with servers.candidate(Candidate(overrides={"num_speculative_tokens": 6})):
                pass
    assert failed.value.reason.startswith("b70-vllm's server exited (systemd: auto-restart, 0 restarts) before it "
                                          "was healthy (no answer"), failed.value.reason
    assert "last log line: RuntimeError" in failed.value.reason
    assert_restored(emulated)


def test_the_roles_container_record_is_what_tune_serves_its_candidates_with(tmp_path):
    """roles/vllm_serve/tasks/render.yml runs `b70ctl serve units` and copies its `container_json` into
    <unit>.container.json: it validates as ServingContainer, reproduces the unit's
    ExecStart, and a candidate's render mounts the role's compile-cache directory with the role's NEO cap: a
    tune's restarts reuse what the served configuration compiled (the field reports' "every restart
    recompiles")."""
    import yaml
    from typer.testing import CliRunner

    from b70ctl.cli import app
    from b70ctl.host_documents import load_topology
    from b70ctl.serve.render import render_xpu_container
    from b70host.topology import topology
    from sysfs_trees import build_tree

    tasks = yaml.safe_load((REPO / "roles/vllm_serve/tasks/render.yml").read_text())
    record = next(task for task in tasks if task["name"] == "Record the speculative server's container for a tune")
    assert record["ansible.builtin.copy"] == {"content": "{{ vllm_serve_host_units.container_json }}",
                                              "dest": "{{ vllm_serve_host_units.container_path }}", "mode": "0644"}
    render = next(task for task in tasks if task["name"] == "Render the serving units on the controller")
    for flag in ("'units'", "'--unit'", "'--image'", "'--config-dir'", "'--models-record'", "'--api-key-env-file'"):
        assert flag in render["b70ctl"]["command"], flag

    root = build_tree(tmp_path, "b70-igpu")
    topology(root, 1, probe="never", write=True)
    topology_file = Path(root) / "etc/b70/topology.json"
    models = {"target": {"path": "/var/lib/b70/models/dspark/target", "revision": "a" * 40},
              "drafter": {"path": "/var/lib/b70/models/dspark/drafter", "revision": "b" * 40}}
    common = ["--recipe", "dspark-int4-tp1", "--topology", str(topology_file), "--compile-cache-dir",
              "/srv/b70-cache", "--neo-cache-max-bytes", str(2**30), "--unit", UNIT, "--image", "sha256:image",
              "--models-record", json.dumps(models), "--api-key-env-file", f"{CONFIG_DIR}/api-key.env", "--env",
              "SITE_SETTING=1"]
    result = CliRunner().invoke(app, ["serve", "units", "--json", *common, "--config-dir", CONFIG_DIR,
                                      "--user", "b70"])
    assert result.exit_code == 0, result.output
    host_units = json.loads(result.stdout)
    assert host_units["container_path"] == f"{CONFIG_DIR}/{UNIT}.container.json"
    assert [server["unit"] for server in host_units["servers"]] == [UNIT]
    assert host_units["config_files"] == [f"/etc/systemd/system/{UNIT}.service", f"{CONFIG_DIR}/{UNIT}.env"]
    server = host_units["servers"][0]
    # `serve render --unit` is the same server, one at a time.
    single = CliRunner().invoke(app, ["serve", "render", "--json", *common, "--env-file", f"{CONFIG_DIR}/{UNIT}.env"])
    assert single.exit_code == 0, single.output
    rendered = json.loads(single.stdout)
    assert server["exec_start_line"] == rendered["exec_start_line"]
    assert f"ExecStart={rendered['exec_start_line']}" in server["unit_file"].splitlines()
    container = ServingContainer.model_validate_json(host_units["container_json"])
    assert container == ServingContainer.model_validate(rendered["container"])
    assert (container.compile_cache_dir, container.neo_cache_max_bytes) == ("/srv/b70-cache", 2**30)
    assert container.models_dir == "/var/lib/b70/models/dspark" and container.extra_env == {"SITE_SETTING": "1"}
    assert rendered["exec_start"][:8] == ["/usr/bin/docker", "run", "--rm", "--name", UNIT, "--env-file",
                                          f"{CONFIG_DIR}/{UNIT}.env", "--env-file"]
    assert "/var/lib/b70/models/dspark:/models:ro" in rendered["exec_start"]
    assert rendered["exec_start"][-len(rendered["argv"]):] == rendered["argv"]
    assert systemd_split(rendered["exec_start_line"]) == rendered["exec_start"]
    # The files the role copies, byte for byte: the environment file as systemd reads it (systemd.exec(7),
    # EnvironmentFile=: '#' comments, NAME=VALUE), serve.json as the report's host bundle reads it, and the container
    # record b70ctl tune reads back.
    lines = server["env_file"].splitlines()
    assert lines[0].startswith("# ") and server["env_file"].endswith("\n")
    assert dict(line.split("=", 1) for line in lines[1:]) == rendered["env"]
    served = HostBundle.model_validate({"serve": json.loads(host_units["serve_json"])}).serve
    assert served is not None and (served.argv, served.env, served.docker_args) == (
        rendered["argv"], rendered["env"], rendered["docker_args"])

    recipe = load_recipe("dspark-int4-tp1")
    document = load_topology(topology_file)
    command = render_xpu_container(recipe, container.context(speculative=True), document)
    assert container.exec_start(command) == rendered["exec_start"]  # the tune's ExecStart is the role's
    assert "/srv/b70-cache/neo:/var/cache/b70/neo" in command.docker_args
    assert command.env["NEO_CACHE_MAX_SIZE"] == str(2**30)


def test_a_unit_needs_its_image_environment_and_model_store():
    """BadInput (main() turns it into exit 2), naming the flags and the fix."""
    from typer.testing import CliRunner

    from b70ctl.cli import app

    runner = CliRunner()
    missing = runner.invoke(app, ["serve", "render", "--json", "--recipe", "cpu-tiny", "--unit", UNIT])
    assert isinstance(missing.exception, BadInput)
    assert "--unit b70-vllm needs --image, --env-file, --models-record" in str(missing.exception)
    stray = runner.invoke(app, ["serve", "render", "--recipe", "cpu-tiny", "--image", "sha256:image"])
    assert isinstance(stray.exception, BadInput) and "give --unit NAME" in str(stray.exception)
    relative = runner.invoke(app, ["serve", "render", "--recipe", "cpu-tiny", "--unit", UNIT, "--image", "x",
                                   "--env-file", "/e", "--models-record", '{"target": {"path": "models/t"}}'])
    assert isinstance(relative.exception, BadInput)
    assert "--models-record: target.path: not an absolute path" in str(relative.exception)
    broken = runner.invoke(app, ["serve", "render", "--recipe", "cpu-tiny", "--unit", UNIT, "--image", "x",
                                 "--env-file", "/e", "--models-record", '{"target": {"path": "/m/t"}}',
                                 "--env", "SITE=a\nEVIL=1"])
    assert isinstance(broken.exception, BadInput)
    assert "--env SITE: the value holds a line break" in str(broken.exception)


def test_the_race_directory_the_role_writes_is_the_one_tune_reads() -> None:
    """roles/vllm_serve/tasks/race_install.yml writes a raced recipe's records where SystemdUnitServing.race_dir
    looks for them, for a site's own b70_etc_dir too: the path is rendered from the role's template, not restated."""
    import jinja2
    import yaml

    tasks = yaml.safe_load((REPO / "roles/vllm_serve/tasks/race_install.yml").read_text())
    named = next(task for task in tasks if task["name"] == "Name the raced recipe's directory of records")
    template = named["ansible.builtin.set_fact"]["vllm_serve_race_dir"]
    recipe = load_recipe("cpu-tiny-ngram")
    for etc_dir in ("/etc/b70", "/srv/site/b70"):
        rendered = jinja2.Template(template).render(b70_etc_dir=etc_dir,
                                                    vllm_serve_race_check={"spec": {"name": recipe.name}})
        host = ApplianceHost(name="b70-1", etc_dir=etc_dir)
        assert rendered == SystemdUnitServing(RECIPE, host, LocalShell(become=False)).race_dir(recipe)
    writes = [task for task in tasks for module in ("dspark_image", "model_store")
              if task.get("ansible.builtin.include_role", {}).get("name") == module]
    assert all(task["vars"]["b70_etc_dir"] == "{{ vllm_serve_race_dir }}" for task in writes) and len(writes) == 2
