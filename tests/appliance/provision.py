"""Bring up test hosts, give each its emulated hardware, write inventories and run playbooks: shared by the
appliance tests (conftest.py) and benchmarks/host_stages_noop.py. No pytest fixtures here."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import testinfra
import yaml

from debianset import resolve_test_lock

REPO_ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
FIXTURE_ROOT = "/var/lib/b70/fixture-root"
RECAP_LINE = re.compile(r"^(?P<host>\S+)\s+:\s+(?P<counts>(?:\w+=\d+\s*)+)$", re.M)


@dataclass(frozen=True)
class HostUnderTest:
    name: str
    address: str
    scenario: str | None


@dataclass
class PlaybookRun:
    returncode: int
    output: str
    recap: dict[str, dict[str, int]] = field(default_factory=dict)


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP lines -> {host: {ok: n, changed: n, ...}} (the last recap of the output wins)."""
    recap_text = output.rsplit("PLAY RECAP", 1)[-1] if "PLAY RECAP" in output else ""
    recap: dict[str, dict[str, int]] = {}
    for match in RECAP_LINE.finditer(recap_text):
        counts = dict(pair.split("=") for pair in match.group("counts").split())
        recap[match.group("host")] = {key: int(value) for key, value in counts.items()}
    return recap


def run_playbook(inventory: Path, *args: str, playbook: str = "site.yml") -> PlaybookRun:
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO_ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_FORCE_COLOR": "0", "PYTHONUNBUFFERED": "1",
           # One line per message (the YAML result format folds long ones), so tests can search the output.
           "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}
    result = subprocess.run([str(ANSIBLE_PLAYBOOK), "-i", str(inventory), playbook, *args], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=1500)
    output = result.stdout + result.stderr
    return PlaybookRun(result.returncode, output, parse_recap(output))


def run_testhosts(*args: str) -> str:
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "testhosts"), *args], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"scripts/testhosts {' '.join(args)} failed: {result.stderr.strip()[-2000:]}")
    return result.stdout


def copy_into_host(host: str, source_dir: Path, destination: str) -> None:
    """tar keeps the fixture's symlinks (sysfs is made of them) exactly as they are."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(source_dir, arcname=".")
    subprocess.run(["docker", "exec", host, "mkdir", "-p", destination], check=True)
    subprocess.run(["docker", "exec", "-i", host, "tar", "-C", destination, "-x"], input=buffer.getvalue(),
                   check=True)


# No probe can open peer memory on a test host, so every topology chooses no-p2p by itself (p2p only when proven:
# control/b70host/topology.py). The switch host is served as an owner would serve one whose ze_peer run proved
# peer memory, with the p2p override, so both oneCCL profiles go through the roles.
SCENARIO_HOST_VARS: dict[str, dict[str, object]] = {scenario: {"b70_ccl_profile": "p2p"}
                                                     for scenario in ("b70x2-switch", "b70x2-switch-192gb")}


def write_inventory(path: Path, hosts: list[HostUnderTest], ssh_key: str, host_vars: dict[str, dict] | None = None,
                    group_vars: dict[str, object] | None = None) -> Path:
    """A YAML inventory (typed values) for the given hosts, with the test hosts' settings."""
    base_vars: dict[str, object] = {
        "ansible_user": "root",
        "ansible_ssh_private_key_file": ssh_key,
        "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR",
        "b70_recipe": "cpu-tiny",
        "b70_test_host": True,
        "b70_gpu_root_prefix": FIXTURE_ROOT,
        # Their packages: real Debian .debs, locked by content from the machine's own apt sources (debianset.py).
        "b70_host_packages_lock": str(resolve_test_lock(path.parent)),
        # The test matrix's gpu_runtime group is Debian's libze1 and gmmlib (Intel's libze-intel-gpu1 is Ubuntu's):
        # the two intel_gpu keeps at exactly their locked build, as it keeps libze1 and libze-intel-gpu1 on Ubuntu.
        "intel_gpu_hold": ["libze1", "libigdgmm12"],
        # The test hosts share this machine's cores: measured together, each host's decode rate would carry the
        # other's load and ratio claims (decode-follows-acceptance) drift toward 1.
        "replication_check_throttle": 1,
        # The tests are about what the stages do, not about precision: three requests per workload (the recipe asks
        # nine to twelve, make site measures them all), which the reports say.
        "replication_check_max_requests": 3,
    }
    base_vars.update(group_vars or {})
    inventory = {"all": {"children": {"b70_hosts": {
        "hosts": {host.name: {"ansible_host": host.address, **SCENARIO_HOST_VARS.get(host.scenario or "", {}),
                              **(host_vars or {}).get(host.name, {})} for host in hosts},
        "vars": base_vars,
    }}}}
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    return path


def on(name: str) -> testinfra.host.Host:
    return testinfra.get_host(f"docker://{name}")


def serving_pid(host_name: str, unit: str = "b70-vllm") -> str:
    """The main PID of a serving unit: unchanged means the unit was not restarted."""
    return on(host_name).check_output(f"systemctl show --property=MainPID --value {unit}")


def assert_recap(run: PlaybookRun, hosts: list[str], **expected: int) -> None:
    """Each host's recap counts; the controller's own play (the fleet report, on localhost) must not fail and
    never counts as a change to the hosts."""
    controller = run.recap.get("localhost")
    if controller is not None:
        assert controller["failed"] == 0 and controller["changed"] == 0, run.output[-3000:]
    assert sorted(name for name in run.recap if name != "localhost") == sorted(hosts), run.output[-3000:]
    for host in hosts:
        for key, value in expected.items():
            assert run.recap[host][key] == value, f"{host} {key}={run.recap[host][key]}\n{run.output[-4000:]}"


@dataclass
class Appliance:
    hosts: list[HostUnderTest]
    ssh_key: str
    work_dir: Path

    def host(self, index: int) -> HostUnderTest:
        return self.hosts[index - 1]

    def inventory(self, name: str, hosts: list[HostUnderTest], **kwargs: object) -> Path:
        return write_inventory(self.work_dir / f"{name}.yml", hosts, self.ssh_key, **kwargs)  # type: ignore[arg-type]


def start_hosts(prefix: str, subnet: str, scenarios: dict[int, str | None], work_dir: Path,
                fresh: bool = True) -> tuple[list[HostUnderTest], str]:
    """Hosts PREFIX-1..N (fresh ones, or the running ones kept); each with a scenario gets its sysfs tree."""
    started = json.loads(run_testhosts("up", "--count", str(len(scenarios)), "--prefix", prefix, "--subnet", subnet,
                                   *(["--fresh"] if fresh else [])))
    hosts = [HostUnderTest(h["name"], h["address"], scenarios[index])
             for index, h in enumerate(started["hosts"], start=1)]
    for host in hosts:
        if host.scenario is not None:
            give_hardware(host.name, host.scenario, work_dir)
    return hosts, started["ssh_private_key"]


def give_hardware(host: str, scenario: str, work_dir: Path) -> None:
    """The host's emulated hardware becomes `scenario`'s sysfs tree (any earlier one is removed first)."""
    tree = work_dir / f"sysfs-{host}-{scenario}"
    subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "fixtures" / "sysfs.py"), scenario, str(tree)],
                   check=True, capture_output=True)
    subprocess.run(["docker", "exec", host, "rm", "-rf", FIXTURE_ROOT], check=True)
    copy_into_host(host, tree, FIXTURE_ROOT)


DRM_MAJOR = 226  # Linux's DRM character devices: cardN = minor N, renderDN = minor N


def make_dri_nodes(host: str) -> None:
    """The group's card and render nodes as the kernel numbers them, and the udev /dev/dri/by-path links the
    topology names them by (group_devices: pci-<address>-card, -render): what udev makes on a real host."""
    topology = json.loads(on(host).file("/etc/b70/topology.json").content_string)
    by_address = {gpu["pci_address"]: gpu for gpu in topology["gpus"]}
    for node in topology["group_devices"]:
        match = re.fullmatch(r"/dev/dri/by-path/pci-(.+)-(card|render)", node)
        assert match is not None, node
        name = by_address[match.group(1)][match.group(2)]
        minor = int(re.search(r"(\d+)$", name).group(1))  # type: ignore[union-attr]
        subprocess.run(["docker", "exec", host, "sh", "-c",
                        f"mkdir -p /dev/dri/by-path && {{ test -c /dev/dri/{name} || mknod -m 0660 /dev/dri/{name} c "
                        f"{DRM_MAJOR} {minor}; }} && ln -sfn ../{name} {node}"], check=True)


def restart_host(host: str, timeout_s: float = 120) -> None:
    """What a reboot can be for a container: systemd stops, the container starts again, and every enabled unit
    (sshd among them) comes back. Its kernel stays the machine's."""
    subprocess.run(["docker", "restart", host], check=True, capture_output=True)
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        state = subprocess.run(["docker", "exec", host, "systemctl", "is-system-running"], capture_output=True,
                               text=True).stdout.strip()
        if state in ("running", "degraded"):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{host} did not come back from its restart within {timeout_s:.0f} s (systemd: {state})")
