"""The host stages of site.yml on real systemd test hosts: what they install, idempotence and check mode of the
whole site.yml, overrides, and broken inventories stopped by preflight before any change."""

from __future__ import annotations

import json
import subprocess

import pytest

from debianset import B70CTL, TEST_HOST_SERIES
from provision import FIXTURE_ROOT, Appliance, PlaybookRun, assert_recap, on, run_playbook, serving_pid

# The first test also provisions the hosts (apt inside each): allow for a slow mirror or a busy machine.
pytestmark = [pytest.mark.appliance, pytest.mark.timeout(2400)]

EXPECTED_PROFILE = {"b70x2-switch": "p2p", "b70x2-root-ports": "no-p2p"}


@pytest.fixture(params=[1, 2], ids=["p2p-host", "no-p2p-host"])
def host(request: pytest.FixtureRequest, provisioned: tuple[Appliance, list[str], PlaybookRun]):
    appliance, _, _ = provisioned
    test_host = appliance.host(request.param)
    return test_host, on(test_host.name)


def test_first_run_changes_the_hosts_and_fails_nothing(provisioned) -> None:
    _, names, first = provisioned
    for name in names:
        assert first.recap[name]["failed"] == 0
        assert first.recap[name]["changed"] > 0


def test_b70_fact_is_installed_and_reads_the_fixture_tree(host) -> None:
    _test_host, remote = host
    fact = remote.file("/etc/ansible/facts.d/b70.fact")
    assert fact.is_file and fact.mode & 0o111
    facts = json.loads(remote.check_output("/etc/ansible/facts.d/b70.fact"))
    assert facts["root"] == FIXTURE_ROOT
    assert facts["gpu_count"] == 2
    assert facts["gpu_count_by_model"] == {"B70": 2}
    assert facts["gpu_pci_ids"] == ["8086:e223"]


def test_topology_document_and_profile(host) -> None:
    test_host, remote = host
    topology = json.loads(remote.file("/etc/b70/topology.json").content_string)
    assert topology["profile"] == EXPECTED_PROFILE[test_host.scenario]
    # p2p only when a probe opened peer memory, which no test host can: the switch host's p2p is its override.
    assert topology["auto_profile"] == "no-p2p"
    assert topology["profile_source"] == ("override" if test_host.scenario == "b70x2-switch" else "auto")
    assert "changed" not in topology and "path" not in topology
    if topology["profile"] == "p2p":
        assert topology["ccl_env"]["CCL_TOPO_P2P_ACCESS"] == "1"
    else:
        assert topology["ccl_env"]["CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD"] == "4294967296"
        assert "SYS_PTRACE" in topology["docker_args"]
    link = remote.file("/etc/ansible/facts.d/b70_topology.fact")
    assert link.is_symlink and link.linked_to == "/etc/b70/topology.json"


def test_docker_engine_runs_with_the_daemon_config(host) -> None:
    _, remote = host
    docker = remote.service("docker")
    assert docker.is_running and docker.is_enabled
    config = json.loads(remote.file("/etc/docker/daemon.json").content_string)
    assert config["log-driver"] == "json-file"
    assert remote.check_output("docker info --format '{{.LoggingDriver}}'") == "json-file"


def _locked(appliance: Appliance) -> dict:
    lock = json.loads((appliance.work_dir / "host-packages.lock.json").read_text())
    return lock["series"][TEST_HOST_SERIES]


def _dpkg(remote) -> str:
    return remote.check_output("dpkg-query --show --showformat='${db:Status-Abbrev} ${Package} ${Version} "
                               "${Architecture}\\n'")


def test_locked_packages_installed_by_content_and_only_the_gpu_runtime_held(host, provisioned) -> None:
    _, remote = host
    locked = _locked(provisioned[0])
    installed = {name: (status, version) for status, name, version, _ in
                 (line.split() for line in _dpkg(remote).splitlines())}
    for pin in locked["packages"]:
        if {"gpu_runtime", "container_engine"} & set(pin["groups"]):
            assert installed[pin["name"]][1] == pin["version"], pin["name"]
            # The very file the lock names went to the host (the role checked it there with sha256sum).
            copied = remote.file(f"/var/cache/b70/debs/{pin['name']}_{pin['version'].split(':')[-1]}_"
                                 f"{pin['architecture']}.deb")
            assert copied.sha256sum == pin["sha256"], pin["name"]
    # Held: only the GPU runtime intel_gpu keeps exact (intel_gpu_hold). The engine takes security updates.
    for name in locked["groups"]["gpu_runtime"]["requested"]:
        assert installed[name][0] == "hi", name
    for name in locked["groups"]["container_engine"]["requested"]:
        assert installed[name][0] == "ii", name
    # No apt source or version pin of ours: the lock's files are the only source.
    assert not remote.file("/etc/apt/sources.list.d/b70-intel-graphics.sources").exists
    assert not remote.file("/etc/apt/preferences.d/b70-intel-graphics.pref").exists


def test_lock_check_names_a_host_whose_packages_drifted(host, provisioned) -> None:
    test_host, remote = host
    appliance = provisioned[0]
    pin = next(pin for pin in _locked(appliance)["packages"] if pin["name"] == "libigdgmm12")
    deb = f"/var/cache/b70/debs/libigdgmm12_{pin['version']}_amd64.deb"

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([str(B70CTL), "lock", "check", "--host-packages", "--packages-lock",
                               str(appliance.work_dir / "host-packages.lock.json"), "--series", TEST_HOST_SERIES,
                               "--group", "gpu_runtime", "--installed", "-", "--host", test_host.name],
                              input=_dpkg(remote), capture_output=True, text=True)

    assert check().returncode == 0
    remote.check_output("apt-mark unhold libigdgmm12 && dpkg --remove libigdgmm12")
    try:
        drifted = check()
        assert drifted.returncode == 1
        assert drifted.stdout.strip() == (f"{test_host.name}: 1 package(s) differ from the lock for "
                                          f"{TEST_HOST_SERIES}: libigdgmm12 not installed (lock: {pin['version']})")
    finally:
        remote.check_output(f"dpkg --install {deb} && apt-mark hold libigdgmm12")
    assert check().returncode == 0


def test_grub_drop_in_and_reboot_left_to_the_operator(host, provisioned) -> None:
    test_host, remote = host
    drop_in = remote.file("/etc/default/grub.d/60-b70-intel-gpu.cfg").content_string
    assert 'GRUB_CMDLINE_LINUX_DEFAULT="${GRUB_CMDLINE_LINUX_DEFAULT} intel_iommu=off"' in drop_in
    # The machine's kernel runs without intel_iommu=off and b70_allow_reboot is false: the play says so.
    assert f"{test_host.name}: reboot pending: the running kernel lacks intel_iommu=off" in provisioned[2].output


def test_service_user_groups(host) -> None:
    _, remote = host
    user = remote.user("b70")
    assert {"render", "video", "docker"} <= set(user.groups)


def test_second_run_changes_nothing_keeps_serving_and_measures_nothing_new(provisioned) -> None:
    appliance, names, _ = provisioned
    pids = {name: serving_pid(name) for name in names}
    second = run_playbook(appliance.work_dir / "provision.yml")
    assert second.returncode == 0, second.output[-4000:]
    # Each task is a round of work per host, and on a converged fleet these are the whole run: one per stage (the
    # check, which shows its verdict and carries the run's state), then replication_check's decision: the argument
    # validation of its b70 dependency (on the controller, no round trip) and three that keep the standing report.
    assert_recap(second, names, changed=0, failed=0, unreachable=0, ok=4 + 1 + 3)
    assert second.output.count("already measured this serving configuration") == len(names)
    # Every stage skipped on its recorded generation: one round trip each, no role task ran.
    for stage in ("host", "image", "models", "serve"):
        assert second.output.count(f": {stage}: converged to generation ") == len(names), second.output[-4000:]
    assert "TASK [intel_gpu" not in second.output and "TASK [vllm_serve" not in second.output
    assert {name: serving_pid(name) for name in names} == pids  # not restarted


def test_every_stage_in_full_is_idempotent(provisioned) -> None:
    """The roles themselves change nothing on a converged host (what a run does once anything changed)."""
    appliance, names, _ = provisioned
    pids = {name: serving_pid(name) for name in names}
    full = run_playbook(appliance.work_dir / "provision.yml", "-e", "generation_enabled=false")
    assert full.returncode == 0, full.output[-4000:]
    assert_recap(full, names, changed=0, failed=0, unreachable=0)
    assert "TASK [intel_gpu" in full.output and "TASK [vllm_serve" in full.output
    assert full.output.count("runs in full (generation_enabled is false)") == 4 * len(names)
    assert full.output.count("already measured this serving configuration") == len(names)
    assert {name: serving_pid(name) for name in names} == pids


def test_a_drifted_host_runs_the_stage_in_full_and_is_put_back(provisioned) -> None:
    appliance, _names, _ = provisioned
    drifted = appliance.host(1)
    remote = on(drifted.name)
    topology = remote.file("/etc/b70/topology.json").content_string
    remote.run("sh -c 'echo >> /etc/b70/topology.json'")  # a file nothing restarts for: serving goes on
    run = run_playbook(appliance.work_dir / "provision.yml", "--limit", drifted.name, playbook="playbooks/host.yml")
    assert run.returncode == 0, run.output[-4000:]
    assert f"{drifted.name}: host: runs in full: path /etc/b70/topology.json: changed" in run.output
    assert_recap(run, [drifted.name], changed=1, failed=0)
    assert remote.file("/etc/b70/topology.json").content_string == topology
    again = run_playbook(appliance.work_dir / "provision.yml", "--limit", drifted.name, playbook="playbooks/host.yml")
    assert f"{drifted.name}: host: converged to generation " in again.output
    assert_recap(again, [drifted.name], changed=0, failed=0, ok=1)


def test_check_mode_with_diff_reports_no_change(provisioned) -> None:
    appliance, names, _ = provisioned
    check = run_playbook(appliance.work_dir / "provision.yml", "--check", "--diff")
    assert check.returncode == 0, check.output[-4000:]
    assert_recap(check, names, changed=0, failed=0)


def test_profile_override_per_host(provisioned) -> None:
    appliance, _, _ = provisioned
    p2p_host = appliance.host(1)
    remote = on(p2p_host.name)
    overridden = appliance.inventory("override", [p2p_host], host_vars={p2p_host.name: {"b70_ccl_profile": "no-p2p"}})
    check = run_playbook(overridden, "--check", "--diff", "--tags", "gpu_topology")
    assert_recap(check, [p2p_host.name], changed=1, failed=0)
    assert '-  "profile": "p2p",' in check.output and '+  "profile": "no-p2p",' in check.output
    assert json.loads(remote.file("/etc/b70/topology.json").content_string)["profile"] == "p2p"  # check changed nothing

    applied = run_playbook(overridden, "--tags", "gpu_topology")
    assert_recap(applied, [p2p_host.name], changed=1, failed=0)
    topology = json.loads(remote.file("/etc/b70/topology.json").content_string)
    assert (topology["profile"], topology["auto_profile"], topology["profile_source"]) == ("no-p2p", "no-p2p",
                                                                                            "override")

    restored = run_playbook(appliance.work_dir / "provision.yml", "--limit", p2p_host.name, "--tags", "gpu_topology")
    assert_recap(restored, [p2p_host.name], changed=1, failed=0)
    assert json.loads(remote.file("/etc/b70/topology.json").content_string)["profile"] == "p2p"


BROKEN_INVENTORIES = {
    "unknown-recipe": ({"b70_recipe": "no-such-recipe"},
                       "b70_recipe 'no-such-recipe' cannot be used: unknown recipe 'no-such-recipe'"),
    # b70ctl host fit's verdicts, on the bare host's own tree (it has no fixture one): the lock is let through to
    # reach them.
    "tp2-on-one-gpu": ({"b70_recipe": "pr620-fp8-tp2", "b70_gpus": 1, "b70_hf_token": "hf_dummy",
                        "b70_gpu_root_prefix": "/", "preflight_allow_unresolved_lock": True},
                       "recipe pr620-fp8-tp2 runs tensor-parallel 2 on 2 GPU(s), but b70_gpus is 1"),
    "missing-secret": ({"b70_recipe": "dspark-int4-tp1"},
                       "secret b70_hf_token is missing or empty; recipe dspark-int4-tp1 downloads"),
    "too-little-ram": ({"b70_recipe": "dspark-int4-tp1", "b70_hf_token": "hf_dummy", "b70_gpu_root_prefix": "/",
                        "preflight_allow_unresolved_lock": True},
                       "recipe dspark-int4-tp1 needs 64 GB of RAM installed"),
}


@pytest.mark.parametrize("case", BROKEN_INVENTORIES, ids=list(BROKEN_INVENTORIES))
def test_broken_inventory_fails_in_preflight_and_changes_nothing(appliance: Appliance, case: str) -> None:
    bare = appliance.host(3)
    overrides, message = BROKEN_INVENTORIES[case]
    inventory = appliance.inventory(f"broken-{case}", [bare], group_vars=overrides)
    run = run_playbook(inventory)
    assert run.returncode != 0
    assert_recap(run, [bare.name], failed=1, changed=0)
    assert f"{bare.name}: " in run.output and message in run.output, run.output[-3000:]
    assert "Fix:" in run.output
    assert "TASK [intel_gpu" not in run.output  # preflight stopped the host before any other role
    remote = on(bare.name)
    for path in ("/etc/ansible/facts.d", "/var/cache/b70/debs", "/etc/b70",
                 "/etc/default/grub.d/60-b70-intel-gpu.cfg", "/etc/docker/daemon.json"):
        assert not remote.file(path).exists, path
    assert not remote.user("b70").exists
