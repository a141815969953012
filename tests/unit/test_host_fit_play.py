"""`b70ctl host fit --hosts -`: preflight's one call for every host of a play, each host's verdicts (release, GPU
count and binding, VRAM, RAM, firmware, kernel, the model store's free space) and kernel plan over its facts from the
sysfs scenarios, and the document the b70 role hands it. The releases are the appliance's matrix and, for the Debian
test hosts, tests/fixtures/releases-testhosts.yaml (Debian's own release table)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from b70ctl.host.fit import PlayHost
from b70host.facts import collect_facts
from sysfs_trees import REPO, build_tree

B70CTL = str(Path(sys.executable).with_name("b70ctl"))
GIB = 2**30
TESTHOSTS_MATRIX = REPO / "tests" / "fixtures" / "releases-testhosts.yaml"
NOBLE = {"distribution": "Ubuntu", "codename": "noble"}
# 26.04: the shipped host package lock resolves every group there (noble's GPU runtime comes from a PPA the lock could
# not read): the release for verdicts that are not about the lock.
RESOLUTE = {"distribution": "Ubuntu", "codename": "resolute"}
# The inventory's settings as the b70 role's defaults give them.
SETTINGS = {"service_user": "b70", "model_store_dir": "/var/lib/b70/models"}


def free(facts: dict, gib: float) -> dict:
    """The facts as preflight reads them: with the model store's free space (facts.py --free-space-of)."""
    return {**facts, "free_space": {"path": "/var/lib/b70/models", "measured_at": "/var/lib",
                                    "free_bytes": int(gib * GIB)}}


def fit(hosts: list[dict], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([B70CTL, "host", "fit", "--hosts", "-", *args], input=json.dumps(hosts),
                          capture_output=True, text=True, timeout=60)


def test_each_host_of_the_play_gets_every_verdict(tmp_path: Path) -> None:
    igpu = collect_facts(build_tree(tmp_path / "igpu", "b70-igpu"))
    unbound = collect_facts(build_tree(tmp_path / "unbound", "xe-unbound"))
    hosts = [
        # One B70 on a 64 GB host, but 10 GiB free where the models go.
        {"host": "small-disk", "recipe": "dspark-int4-tp1", "facts": free(igpu, 10), "gpus": 1,
         **RESOLUTE, **SETTINGS},
        # Cards without xe under 24.04's GA kernel 6.8: the plan brings the HWE kernel that binds them, so the
        # binding, firmware and kernel verdicts wait for it.
        {"host": "pending", "recipe": "pr620-fp8-tp2", "facts": free(unbound, 500), "gpus": 2,
         **NOBLE, **SETTINGS},
        # The same host on a release past its end of life: nothing else is judged.
        {"host": "eol", "recipe": "pr620-fp8-tp2", "facts": free(unbound, 500), "gpus": 2,
         "distribution": "Ubuntu", "codename": "oracular", **SETTINGS},
        {"host": "cpu", "recipe": "cpu-tiny", "facts": free(igpu, 500), "gpus": 0, **RESOLUTE, **SETTINGS},
    ]
    result = fit(hosts, "--json")
    assert result.returncode == 1, result.stderr
    fits = json.loads(result.stdout)
    assert list(fits) == ["small-disk", "pending", "eol", "cpu"]
    assert fits["small-disk"]["reasons"] == ["10.0 GiB free for the model store, recipe dspark-int4-tp1 needs 40 GiB: "
                                             "free space there, or set b70_model_store_dir to a larger filesystem"]
    assert not fits["small-disk"]["kernel_plan"]["needed"] and fits["small-disk"]["release"]["fits"]
    pending = fits["pending"]
    assert pending["kernel"] is None and pending["firmware"] is None, pending["reasons"]
    assert pending["kernel_plan"]["needed"] and pending["kernel_plan"]["packages"][0] == "linux-generic-hwe-24.04"
    # ...but the shipped lock cannot install noble's GPU runtime (the PPA was unreachable where it was resolved):
    # decided here, before host_kernel installs and reboots, with the one command to run.
    assert not pending["fits"] and pending["reasons"] == [pending["packages"]["reason"]]
    assert pending["packages"]["reason"].startswith("noble: the host package lock cannot install gpu_runtime "
                                                    "(intel-omix: https://repositories.intel.com/gpu/ubuntu/dists/noble/intel-omix/0.4/")
    assert pending["packages"]["reason"].endswith(
        "run `b70ctl lock resolve --host-packages --series noble` on a controller that reaches those indexes, keep "
        "the lock it writes (b70_host_packages_lock), and run the play again")
    assert fits["small-disk"]["packages"]["fits"]  # resolute: every group resolved
    assert pending["gpus"]["usable_gpu_count"] == 2
    assert not fits["eol"]["fits"] and len(fits["eol"]["reasons"]) == 1
    assert "oracular" in fits["eol"]["reasons"][0].lower()
    assert fits["cpu"]["fits"] and fits["cpu"]["reasons"] == []
    people = fit(hosts)
    assert people.returncode == 1 and people.stdout.splitlines()[0].startswith("FAIL small-disk: 10.0 GiB free")
    assert "FAIL pending: noble: the host package lock cannot install gpu_runtime" in people.stdout


def test_the_disk_verdict_reads_the_free_space_the_facts_script_measured(tmp_path: Path) -> None:
    """What the b70 role hands over: the facts as the script piped to the host printed them with --free-space-of.
    Facts read without it (the installed local fact, `b70ctl host facts`) have no disk verdict rather than a guess."""
    piped = subprocess.run(["python3", "-", "--root", build_tree(tmp_path / "tree", "b70-igpu"), "--free-space-of",
                            str(tmp_path / "models")], input=(REPO / "control" / "b70host" / "facts.py").read_text(),
                           capture_output=True, text=True, check=True)
    facts = json.loads(piped.stdout)
    facts["free_space"]["free_bytes"] = 12 * GIB  # what this machine has free is not the point; the path it takes is
    host = {"host": "h", "recipe": "dspark-int4-tp1", "facts": facts, "gpus": 1, **RESOLUTE, **SETTINGS}
    fitted = json.loads(fit([host], "--json").stdout)["h"]
    assert fitted["disk"]["reason"].startswith("12.0 GiB free for the model store, recipe dspark-int4-tp1 needs 40 GiB")
    assert not fitted["fits"]
    del facts["free_space"]
    assert json.loads(fit([host], "--json").stdout)["h"]["disk"] is None
    stale = fit([{**host, "disk_free_bytes": 500 * GIB}], "--json")  # the field the role once sent is refused
    assert stale.returncode == 2 and "disk_free_bytes: Extra inputs are not permitted" in stale.stderr, stale.stderr


def test_settings_that_would_break_a_unit_mount_or_env_file_are_refused_before_anything_else(tmp_path: Path) -> None:
    """b70_service_user becomes User=, b70_model_store_dir docker's --volume SRC:/models:ro, vllm_serve_extra_env
    environment-file lines: each is judged by the rule of what it is written into (the same rules `serve units`
    applies), and first: even a host on a release past its end of life names them."""
    facts = free(collect_facts(build_tree(tmp_path, "no-intel-gpu")), 500)
    base = {"recipe": "cpu-tiny", "facts": facts, "gpus": 0, **RESOLUTE, **SETTINGS}
    cases = {
        "quote-in-user": {"service_user": "b7'0"},
        "newline-in-store": {"model_store_dir": "/var/lib/b70\nExecStartPre=+/bin/sh"},
        "colon-in-store": {"model_store_dir": "/srv/models:rw"},
        "relative-store": {"model_store_dir": "models"},
        "dotdot-store": {"model_store_dir": "/var/lib/../../etc"},
        "env-name": {"extra_env": {"BAD NAME": "1"}},
        "env-line": {"extra_env": {"VLLM_LOGGING_LEVEL": "DEBUG\nEVIL=1"}},
        "env-bool": {"extra_env": {"VLLM_FLAG": True}},
        "eol-and-user": {"service_user": "Root", "codename": "oracular"},
        "fine": {"extra_env": {"VLLM_CPU_KVCACHE_SPACE": 8, "SCALE": 0.9}},
    }
    fits = json.loads(fit([{**base, "host": name, **change} for name, change in cases.items()], "--json").stdout)
    reasons = {name: fits[name]["settings"]["reason"] for name in cases}
    assert reasons["quote-in-user"].startswith('b70_service_user "b7\'0" holds characters it may not: a user name')
    assert reasons["newline-in-store"].startswith('b70_model_store_dir "/var/lib/b70\\nExecStartPre=+/bin/sh" holds')
    for name in ("colon-in-store", "relative-store", "dotdot-store"):
        assert reasons[name].startswith("b70_model_store_dir "), reasons[name]
    assert reasons["env-name"].startswith("vllm_serve_extra_env 'BAD NAME': not an environment variable name")
    assert reasons["env-line"] == ("vllm_serve_extra_env VLLM_LOGGING_LEVEL: the value holds a line break or control "
                                   "character: give one line")
    assert reasons["env-bool"] == "vllm_serve_extra_env VLLM_FLAG: True is not a string or a number: quote it"
    eol = fits["eol-and-user"]
    assert eol["reasons"][0] == eol["settings"]["reason"] and "oracular" in eol["reasons"][1].lower()
    assert all(not fits[name]["fits"] for name in cases if name != "fine")
    assert fits["fine"]["fits"] and fits["fine"]["settings"]["fits"], fits["fine"]["reasons"]
    # The same rule as the command that writes the env file: what one refuses, the other does.
    units = subprocess.run([B70CTL, "serve", "units", "--recipe", "cpu-tiny", "--image", "sha256:" + "a" * 64,
                            "--models-record", json.dumps({"target": {"path": "/m/target", "revision": "r"}}),
                            "--config-dir", "/etc/b70/serve", "--user", "b70", "--env-json",
                            json.dumps({"VLLM_FLAG": True})], capture_output=True, text=True, timeout=60)
    assert units.returncode == 2 and "VLLM_FLAG: True is not a string or a number: quote it" in units.stderr


def test_fewer_gpus_in_the_inventory_than_the_recipes_tensor_parallel_size_is_refused(tmp_path: Path) -> None:
    """b70_gpus below the recipe's TP size: refused even on a host with the cards (vLLM would be started on one card
    with --tensor-parallel-size 2). A CPU recipe asks for none, whatever b70_gpus says."""
    two_b70 = collect_facts(build_tree(tmp_path, "b70x2-switch"))
    hosts = [{"host": name, "recipe": recipe, "facts": free(two_b70, 500), "gpus": gpus, **RESOLUTE, **SETTINGS}
             for name, recipe, gpus in [("one", "pr620-fp8-tp2", 1), ("two", "pr620-fp8-tp2", 2),
                                        ("cpu", "cpu-tiny", 1)]]
    fits = json.loads(fit(hosts, "--json").stdout)
    assert fits["one"]["gpus"]["reason"] == (
        "recipe pr620-fp8-tp2 runs tensor-parallel 2 on 2 GPU(s), but b70_gpus is 1: set b70_gpus: 2 on a host with "
        "that many cards, or choose a recipe for 1 GPU(s) (b70ctl recipes list)")
    assert not fits["one"]["fits"] and fits["one"]["gpus"]["usable_gpu_count"] == 2
    assert fits["two"]["gpus"]["fits"] and fits["cpu"]["gpus"]["fits"]


def test_a_test_hosts_debian_is_accepted_only_on_a_test_host(tmp_path: Path) -> None:
    old_kernel = collect_facts(build_tree(tmp_path, "b70x2-switch-old-kernel"))
    host = {"host": "b70-app-4", "recipe": "pr620-fp8-tp2", "facts": free(old_kernel, 500), "gpus": 2,
            "distribution": "Debian", "codename": "bookworm",
            "test_host_distributions": ["Debian"], **SETTINGS}
    # Debian's own matrix plans the kernel that binds the cards (what host_kernel's appliance test installs).
    accepted = json.loads(fit([{**host, "test_host": True}], "--releases", str(TESTHOSTS_MATRIX), "--json").stdout)
    assert accepted["b70-app-4"]["release"]["fits"] and accepted["b70-app-4"]["kernel_plan"]["needed"]
    # The appliance's own lock has no Debian packages (the appliance tests resolve one: tests/appliance/debianset.py).
    assert accepted["b70-app-4"]["reasons"] == [
        "the host package lock has no packages for bookworm: run `b70ctl lock resolve --host-packages --series "
        "bookworm` on a controller that reaches those indexes, keep the lock it writes (b70_host_packages_lock), and "
        "run the play again"]
    refused = fit([host], "--json")
    assert refused.returncode == 1
    reason = json.loads(refused.stdout)["b70-app-4"]["reasons"]
    assert len(reason) == 1 and reason[0].endswith("(Debian is accepted only on test hosts, b70_test_host: true)")


def test_the_b70_role_hands_over_exactly_a_play_host() -> None:
    tasks = yaml.safe_load((REPO / "roles/b70/tasks/host_fit.yml").read_text())
    handed = next(task for task in tasks if task["name"] == "Name what the fit needs of this host")
    assert set(handed["ansible.builtin.set_fact"]["b70_host_fit_input"]) == set(PlayHost.model_fields)
    call = next(task for task in tasks if task["name"] == "Fit every host of the play")
    argv = call["b70ctl"]["command"]
    assert "['host', 'fit', '--hosts', '-', '--releases', b70_release_matrix, '--json']" in argv
    assert "['--packages-lock', b70_host_packages_lock] if b70_host_packages_lock" in argv


@pytest.mark.parametrize(("args", "stdin", "named"), [
    ([], [{"host": "a"}], "--hosts -: 0.recipe: Field required"),
    ([], {"host": "a"}, "--hosts -: (top level): Input should be a valid array"),
    (["--recipe", "cpu-tiny"], [], "--hosts names each host's recipe and facts"),
])
def test_a_bad_play_is_one_line_and_exit_2(args: list[str], stdin: object, named: str) -> None:
    result = subprocess.run([B70CTL, "host", "fit", "--hosts", "-", *args], input=json.dumps(stdin),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and named in result.stderr, result.stderr


@pytest.mark.parametrize(("name", "problem"), [("absent.json", "No such file or directory"), (".", "Is a directory")])
def test_a_hosts_file_that_cannot_be_read_is_one_line_and_exit_2(tmp_path: Path, name: str, problem: str) -> None:
    path = tmp_path / name
    result = subprocess.run([B70CTL, "host", "fit", "--hosts", str(path), "--json"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    fix = "pass preflight's list of {host, recipe, facts, ...} objects"
    assert result.stderr == f"error: --hosts {path}: {problem}: {fix}\n", result.stderr


def test_a_kernel_older_than_the_recipes_names_each_releases_kernel_package(tmp_path: Path) -> None:
    """No card to bind (so no kernel plan) under 24.04's GA kernel 6.8: refused against the recipe's kernel_min 6.14,
    with the kernel package of each release the matrix provisions (test_host_releases ties them to Ubuntu's
    archive: the 24.04 HWE meta-package, 26.04's linux-generic)."""
    facts = collect_facts(build_tree(tmp_path, "no-intel-gpu"))
    result = fit([{"host": "h", "recipe": "pr620-fp8-tp2", "facts": free(facts, 500), "gpus": 2,
                   **RESOLUTE, **SETTINGS}], "--json")
    fitted = json.loads(result.stdout)["h"]
    assert not fitted["kernel_plan"]["needed"]
    assert fitted["kernel"]["reason"] == (
        "kernel 6.8.0-45-generic is older than 6.14, the oldest recipe pr620-fp8-tp2 works with: boot a newer kernel "
        "of the distribution (24.04: linux-generic-hwe-24.04; 26.04: linux-generic) and make it the GRUB default")
