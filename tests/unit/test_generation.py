"""The generation fast path: what makes a stage "converged" (roles/generation), checked on real files, real
commands and the sysfs fixtures, and kept honest against the roles' own tasks: every file a stage's roles write
must be part of its fingerprint, or a drifted file would never be put back."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import jinja2
import pytest
import yaml

from sysfs_trees import build_tree

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles" / "generation"
PLUGIN = ROLE / "action_plugins" / "b70_generation.py"


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generation = load("b70_generation_module", ROLE / "library" / "b70_generation.py")


def params(tmp_path: Path, **overrides) -> dict:
    base = {"stage": "host", "state": "check", "digest": "d" * 64, "paths": [str(tmp_path / "managed" / "*")],
            "probes": [], "hardware_root": "", "forget": False, "store": str(tmp_path / "store" / "generation.json")}
    return {**base, **overrides}


@pytest.fixture
def managed(tmp_path: Path) -> Path:
    directory = tmp_path / "managed"
    (directory / "conf.d").mkdir(parents=True)
    (directory / "daemon.json").write_text('{"log-driver": "journald"}\n')
    (directory / "conf.d" / "a.conf").write_text("a=1\n")
    return directory


def record(tmp_path: Path, **overrides) -> dict:
    return generation.run(params(tmp_path, state="record", **overrides), check_mode=False)


def check(tmp_path: Path, **overrides) -> dict:
    return generation.run(params(tmp_path, **overrides), check_mode=False)


def test_nothing_recorded_is_not_converged(tmp_path: Path, managed: Path) -> None:
    result = check(tmp_path)
    assert (result["converged"], result["reasons"]) == (False, ["no generation recorded"])


def test_recorded_and_unchanged_is_converged_and_the_store_is_root_only(tmp_path: Path, managed: Path) -> None:
    assert record(tmp_path)["changed"] is False
    result = check(tmp_path)
    assert result["converged"] is True and result["reasons"] == []
    assert "nothing to do" in result["msg"]
    assert (os.stat(tmp_path / "store" / "generation.json").st_mode & 0o777) == 0o600


def test_the_state_digest_is_what_the_stage_left(tmp_path: Path, managed: Path) -> None:
    """Record and check name the same state when nothing changed, and another once a file did: with the inputs
    digest, what a replication report is recorded as measuring."""
    recorded = record(tmp_path)["state_digest"]
    assert check(tmp_path)["state_digest"] == recorded
    (managed / "conf.d" / "a.conf").write_text("a=2\n")
    drifted = check(tmp_path)
    assert drifted["converged"] is False and drifted["state_digest"] != recorded
    assert record(tmp_path)["state_digest"] == drifted["state_digest"]


def test_other_inputs_are_not_converged(tmp_path: Path, managed: Path) -> None:
    record(tmp_path)
    result = check(tmp_path, digest="e" * 64)
    assert result["converged"] is False
    assert result["reasons"] == ["inputs changed (recorded dddddddddddd, now eeeeeeeeeeee)"]


@pytest.mark.parametrize("drift", ["content", "mode", "removed", "added", "nested"])
def test_drift_is_named(tmp_path: Path, managed: Path, drift: str) -> None:
    record(tmp_path)
    target = managed / "daemon.json"
    if drift == "content":
        target.write_text('{"log-driver": "json-file"}\n')
    elif drift == "mode":
        target.chmod(0o600)
    elif drift == "removed":
        target.unlink()
    elif drift == "added":
        (managed / "extra.json").write_text("{}")
    else:
        (managed / "conf.d" / "a.conf").write_text("a=2\n")
    result = check(tmp_path)
    assert result["converged"] is False
    expected = {"content": f"path {target}: changed", "mode": f"path {target}: changed",
                "removed": f"path {target}: no longer managed", "added": f"path {managed / 'extra.json'}: new",
                "nested": f"path {managed / 'conf.d' / 'a.conf'}: changed"}[drift]
    assert expected in result["reasons"]


def test_a_missing_path_counts_as_absent_and_appearing_is_drift(tmp_path: Path, managed: Path) -> None:
    missing = str(tmp_path / "grub.d" / "60-b70.cfg")
    record(tmp_path, paths=[missing])
    assert check(tmp_path, paths=[missing])["converged"] is True
    Path(missing).parent.mkdir()
    Path(missing).write_text("GRUB_CMDLINE_LINUX=x\n")
    assert check(tmp_path, paths=[missing])["reasons"] == [f"path {missing}: changed"]


def test_large_files_count_by_size_and_mtime_and_are_not_read(tmp_path: Path, managed: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    weights = managed / "model.safetensors"
    with open(weights, "wb") as handle:
        handle.truncate(generation.HASH_LIMIT_BYTES + 1)
    record(tmp_path)
    opened: list[str] = []
    real_open = open

    def watching_open(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watching_open)
    assert check(tmp_path)["converged"] is True
    assert str(weights) not in opened
    os.utime(weights, ns=(1, 1))  # rewritten in place with the same size
    assert f"path {weights}: changed" in check(tmp_path)["reasons"]


def test_probe_output_and_exit_code_are_state(tmp_path: Path, managed: Path) -> None:
    state = tmp_path / "unit-state"
    state.write_text("ActiveState=active\nMainPID=100\n")
    probe = ["cat", str(state)]
    record(tmp_path, probes=[probe])
    assert check(tmp_path, probes=[probe])["converged"] is True
    state.write_text("ActiveState=active\nMainPID=200\n")  # the service restarted
    assert check(tmp_path, probes=[probe])["reasons"] == [f"probe cat {state}: changed"]
    missing = ["/nonexistent/docker", "image", "ls"]
    record(tmp_path, probes=[missing])
    assert check(tmp_path, probes=[missing])["converged"] is True  # consistently absent is a state too


def test_pci_devices_of_the_fixture_trees(tmp_path: Path, managed: Path) -> None:
    switch = generation.pci_fingerprint(build_tree(tmp_path / "a", "b70x2-switch"))
    assert switch == generation.pci_fingerprint(build_tree(tmp_path / "b", "b70x2-switch"))
    assert switch != generation.pci_fingerprint(build_tree(tmp_path / "c", "b70x2-root-ports"))
    root = build_tree(tmp_path / "d", "b70x2-switch")
    record(tmp_path, hardware_root=root)
    devices = Path(root) / "sys" / "bus" / "pci" / "devices"
    card = next(path for path in sorted(devices.iterdir()) if (path / "class").read_text().startswith("0x03"))
    (card / "device").write_text("0xe211\n")  # another card model in the same slot
    assert check(tmp_path, hardware_root=root)["reasons"] == ["pci devices: changed"]


def test_forget_drops_a_stale_record_but_not_in_check_mode(tmp_path: Path, managed: Path) -> None:
    record(tmp_path)
    (managed / "daemon.json").write_text("{}")
    generation.run(params(tmp_path, forget=True), check_mode=True)
    assert "host" in generation.load(str(tmp_path / "store" / "generation.json"))["stages"]
    generation.run(params(tmp_path, forget=True), check_mode=False)
    assert "host" not in generation.load(str(tmp_path / "store" / "generation.json"))["stages"]
    (managed / "daemon.json").write_text('{"log-driver": "journald"}\n')
    assert check(tmp_path)["reasons"] == ["no generation recorded"]  # a put-back file is not enough


def test_absent_forgets_one_stage_only(tmp_path: Path, managed: Path) -> None:
    record(tmp_path)
    record(tmp_path, stage="serve")
    assert generation.run(params(tmp_path, state="absent"), check_mode=False)["msg"] == (
        "host: generation forgotten (a partial run)")
    assert check(tmp_path)["converged"] is False
    assert check(tmp_path, stage="serve")["converged"] is True


def test_a_corrupt_store_is_no_record(tmp_path: Path, managed: Path) -> None:
    store = tmp_path / "store" / "generation.json"
    store.parent.mkdir()
    store.write_text("{not json")
    assert check(tmp_path)["reasons"] == ["no generation recorded"]
    record(tmp_path)
    assert check(tmp_path)["converged"] is True


# The controller's half: the inputs digest. The action plugin imports ansible, which patches process-wide state
# (sys.intern: it broke torch imports in this process once), so it runs in a child process.

def action_plugin(expression: str, stdin: object = None) -> object:
    """EXPRESSION over the action plugin (as `plugin`, with `request` the JSON given on stdin), in a child process."""
    script = ("import json, sys, importlib.util\n"
              f"spec = importlib.util.spec_from_file_location('a', {str(PLUGIN)!r})\n"
              "plugin = importlib.util.module_from_spec(spec); spec.loader.exec_module(plugin)\n"
              "request = json.load(sys.stdin)\n"
              f"print(json.dumps({expression}))\n")
    result = subprocess.run([sys.executable, "-c", script], input=json.dumps(stdin), capture_output=True,
                            text=True, check=True)
    return json.loads(result.stdout)


def test_the_measured_key_names_a_whole_configuration_only() -> None:
    """A report is kept only for a configuration known whole: every stage at this run's generation. Any stage's
    state, or the inputs, is another configuration."""
    stages = ["host", "image", "models", "serve"]
    whole = {stage: stage[0] * 64 for stage in stages}
    keys = action_plugin("[plugin.measured_key(*each) for each in request]", [
        ["d" * 64, whole, stages], ["d" * 64, dict(reversed(whole.items())), stages],
        ["d" * 64, {**whole, "serve": "f" * 64}, stages], ["e" * 64, whole, stages],
        ["d" * 64, {stage: whole[stage] for stage in stages[:3]}, stages], ["d" * 64, whole, None]])
    assert isinstance(keys, list)
    same, reordered, other_serve, other_inputs, partial, no_stages = keys
    assert len(same) == 64 and same == reordered
    assert len({same, other_serve, other_inputs}) == 3
    assert partial == no_stages == ""


def digests_of(*task_vars: dict) -> list[str]:
    return action_plugin("[plugin.inputs_digest(each) for each in request]", task_vars)


def test_inputs_digest_follows_the_inventory_not_the_defaults_or_its_own_switch(tmp_path: Path) -> None:
    defaults = yaml.safe_load((REPO / "roles" / "vllm_serve" / "defaults" / "main.yml").read_text())
    base = {"b70_recipe": "cpu-tiny", "ansible_version": {"full": "2.19.4"}, "inventory_hostname": "h1"}
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("name: mine\n")
    plain, role_default, own_switch, other_unit, other_recipe, other_ansible, by_path = digests_of(
        base, {**base, "vllm_serve_unit": defaults["vllm_serve_unit"]},
        {**base, "generation_enabled": False, "ansible_host": "10.0.0.9"}, {**base, "vllm_serve_unit": "b70-other"},
        {**base, "b70_recipe": "dspark-int4-tp1"}, {**base, "ansible_version": {"full": "2.20.0"}},
        {**base, "b70_recipe": str(recipe)})
    assert plain == role_default == own_switch  # a role's own default, the fast path's switch, the address
    assert len({plain, other_unit, other_recipe, other_ansible, by_path}) == 5
    recipe.write_text("name: mine2\n")
    assert digests_of({**base, "b70_recipe": str(recipe)}) != [by_path]  # the file's content counts, not its name


# Every file a stage's roles write is in that stage's fingerprint.

STAGE_ROLES = {"host": ["locked_debs", "host_kernel", "intel_gpu", "container_engine", "gpu_topology"],
               "image": ["dspark_image"], "models": ["model_store"], "serve": ["vllm_serve"]}
# Written and removed within one run: nothing of them is left to drift.
TRANSIENT = {"dspark_image_spool_dir", "model_store_token_file"}
# Task files no stage runs: playbooks/tune.yml's install of raced recipes (their records under <b70_etc_dir>/race/,
# which no stage reads; a race installs them again each time).
NOT_A_STAGE = {"race_install.yml"}


def role_values() -> dict:
    values: dict = {"b70_recipe_spec": {"name": "cpu-tiny", "drafter": {"generated": "drafter"}}}
    for role in sorted((REPO / "roles").iterdir()):
        for kind in ("defaults", "vars"):
            if (role / kind / "main.yml").is_file():
                values.update(yaml.safe_load((role / kind / "main.yml").read_text()) or {})
    # The serve stage writes where `b70ctl serve units` says: its document for the role's defaults (the baseline
    # served too), as render.yml keeps it.
    from typer.testing import CliRunner

    from b70ctl.cli import app

    models = {"target": {"path": "/var/lib/b70/models/cpu-tiny/target", "revision": "r1"},
              "drafter": {"path": "/var/lib/b70/models/cpu-tiny/drafter", "revision": "r2"}}
    settings = {name: render(values[name], values) for name in (
        "vllm_serve_unit", "vllm_serve_port", "vllm_serve_baseline_unit", "vllm_serve_baseline_port",
        "vllm_serve_config_dir", "b70_service_user")}
    units = CliRunner().invoke(app, [
        "serve", "units", "--json", "--recipe", "cpu-tiny", "--image", "sha256:" + "a" * 64, "--models-record",
        json.dumps(models), "--config-dir", settings["vllm_serve_config_dir"], "--user", settings["b70_service_user"],
        "--unit", settings["vllm_serve_unit"], "--port", settings["vllm_serve_port"], "--baseline-unit",
        settings["vllm_serve_baseline_unit"], "--baseline-port", settings["vllm_serve_baseline_port"]])
    assert units.exit_code == 0, units.output
    values["vllm_serve_host_units"] = json.loads(units.stdout)
    values["vllm_serve_servers"] = values["vllm_serve_host_units"]["servers"]
    return values


class AnyItem(jinja2.Undefined):
    """A loop's item (or a part of it) renders as a glob wildcard: the path then covers every item."""

    def __str__(self) -> str:
        return "*"

    def __getattr__(self, name: str) -> AnyItem:
        if name.startswith("__"):
            raise AttributeError(name)
        return self


def render(template: str, values: dict, item: object = None) -> str | None:
    """TEMPLATE with the roles' values; a loop's ITEM where the loop's list is known, else a wildcard."""
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined)
    environment.filters["basename"] = lambda path: "*" if isinstance(path, AnyItem) else os.path.basename(path)
    text = str(template)
    for _ in range(5):  # defaults refer to other defaults
        if "{{" not in text:
            return text
        try:
            text = environment.from_string(text).render({**values, "item": AnyItem(name="item") if item is None
                                                         else item})
        except jinja2.UndefinedError:
            return None
    return text


def loop_items(loop: object, values: dict) -> list[object]:
    """The items of a task's `loop` where the values give its list (the servers and files of `serve units`), else
    [None]: each item then renders as a wildcard."""
    if isinstance(loop, str) and loop.startswith("{{") and loop.endswith("}}"):
        environment = jinja2.Environment(undefined=jinja2.StrictUndefined)
        try:
            items = environment.compile_expression(loop.strip("{} "))(**values)
        except (jinja2.UndefinedError, jinja2.TemplateError):
            return [None]
        if isinstance(items, list) and items:
            return items
    return [None]


def written_paths(role: str) -> list[tuple[str, str, object]]:
    found = []
    for tasks in sorted((REPO / "roles" / role / "tasks").glob("*.yml")):
        for task in yaml.safe_load(tasks.read_text()) or []:
            for inner in [task] + [step for part in ("block", "rescue", "always") for step in task.get(part, [])]:
                if inner.get("delegate_to") == "localhost":
                    continue  # the controller's files (reports, host_vars), not the host's
                for module, args in inner.items():
                    if module.startswith("ansible.builtin.") and isinstance(args, dict) and "dest" in args:
                        found.append((f"{tasks.name}: {inner.get('name')}", args["dest"], inner.get("loop")))
    return found


@pytest.mark.parametrize("stage", STAGE_ROLES)
def test_every_file_a_stage_writes_is_in_its_fingerprint(stage: str) -> None:
    """Its own, or an earlier stage's: the serve gate's p2p fallback writes the host stage's topology.json and the
    record gpu_topology reads, on purpose, so that the host stage sees them changed and runs again keeping no-p2p."""
    values = role_values()
    earlier = list(STAGE_ROLES)[: list(STAGE_ROLES).index(stage) + 1]
    patterns = [render(pattern, values) for name in earlier for pattern in values[f"generation_{name}"]["paths"]]
    assert None not in patterns
    uncovered = []
    for role in STAGE_ROLES[stage]:
        for task, dest, loop in written_paths(role):
            if any(name in dest for name in TRANSIENT) or task.split(":")[0] in NOT_A_STAGE:
                continue
            for item in loop_items(loop, values):
                path = render(dest, values, item)
                assert path is not None, f"{role}/{task}: cannot render {dest}"
                assert path != "*", f"{role}/{task}: {dest} names no file: give the test its loop's items"
                # A file under a managed directory, or a loop's paths (a wildcard) that name managed files.
                if not any(fnmatch.fnmatch(path, pattern) or path.startswith(pattern.rstrip("/") + "/")
                           or ("*" in path and fnmatch.fnmatch(pattern, path)) for pattern in patterns):
                    uncovered.append(f"{role}/{task}: {path}")
    assert uncovered == []


def test_the_check_catches_an_uncovered_file() -> None:
    values = role_values()
    patterns = [render(pattern, values) for pattern in values["generation_serve"]["paths"]]
    assert not any(fnmatch.fnmatch("/etc/docker/daemon.json", pattern) for pattern in patterns)


def test_the_host_program_runs_the_module_on_a_bare_python(tmp_path: Path, managed: Path) -> None:
    """What the action plugin sends: the module's own source on stdin of a python3 with no Ansible (-I: none of
    this checkout's packages), the same results as the module, failures as results rather than tracebacks."""
    program, source = action_plugin("plugin.HOST_PROGRAM"), (ROLE / "library" / "b70_generation.py").read_text()

    def on_host(check_mode: bool = False, **overrides) -> dict:
        request = {"source": source, "params": params(tmp_path, **overrides), "check_mode": check_mode}
        answer = subprocess.run(["/usr/bin/python3", "-I", "-c", program], input=json.dumps(request),
                                capture_output=True, text=True, check=True)
        return json.loads(answer.stdout)

    assert on_host()["reasons"] == ["no generation recorded"]
    assert on_host(check_mode=True, state="record")["entries"] == 3
    assert not (tmp_path / "store" / "generation.json").exists()  # check mode writes nothing
    assert on_host(state="record")["msg"].startswith("host: generation dddddddddddd recorded")
    assert on_host()["converged"] is True
    (managed / "daemon.json").write_text("{}")
    assert on_host()["reasons"] == [f"path {managed / 'daemon.json'}: changed"]
    assert on_host(digest="")["msg"] == (
        "b70_generation: no inputs digest (run it through the role's action plugin)")
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    failed = on_host(state="record", store=str(blocked / "generation.json"))
    assert failed["failed"] is True and failed["msg"].startswith(f"b70_generation: {blocked}")
