"""Real systemd test hosts, provisioned by the real site.yml host stages.

The session brings up three hosts with scripts/testhosts (docker engine, debootstrapped base image, private
network and SSH key are all made there, safe to re-run) and copies into each the hardware it emulates: a sysfs
tree from tests/fixtures/sysfs.py (host 1: 2x B70 behind one switch, host 2: 2x B70 on separate root ports) and the
host package lock of real Debian .debs (debianset.py). Host 3 stays bare: the broken-inventory tests prove that
preflight changes nothing on it. The kernel tests (test_host_kernel.py), the recording stand-in and the rehearsal
bring up hosts of their own, so each can run in either lane of scripts/test-lanes.
Everything is torn down when the last appliance test is done, before any other
test runs: the hosts serve real vLLM, and left up they would starve the real-vLLM tests of memory and cores
(B70_KEEP_TESTHOSTS=1 keeps them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from provision import Appliance, PlaybookRun, run_playbook, run_testhosts, start_hosts
from store_fixtures import hub, hub_env, registry  # noqa: F401 - the model-store fixtures, as the unit tests have them

HOST_PREFIX = "b70-app"
HOST_SUBNET = "172.30.72.0/24"
# Host name suffix -> sysfs scenario of tests/fixtures/sysfs.py (None: the bare host).
SCENARIOS = {1: "b70x2-switch", 2: "b70x2-root-ports", 3: None}


HERE = Path(__file__).resolve().parent
_hosts_up: list[str] = []


def _release_hosts() -> None:
    while _hosts_up:
        prefix = _hosts_up.pop()
        if os.environ.get("B70_KEEP_TESTHOSTS") != "1":
            run_testhosts("down", "--prefix", prefix)


# The rehearsal brings up a test host of its own and serves two routes' real images on it: it runs after every test
# of the shared hosts, which are gone by then (their four vLLM servers would hold about 10 GB of its RAM).
REHEARSAL = HERE / "test_rehearsal.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rehearsal = [item for item in items if Path(item.path).resolve() == REHEARSAL]
    rest = [item for item in items if Path(item.path).resolve() != REHEARSAL]
    here = [index for index, item in enumerate(rest) if HERE in Path(item.path).resolve().parents]
    if rehearsal and here:
        items[:] = rest[:here[-1] + 1] + rehearsal + rest[here[-1] + 1:]


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Leaving the shared hosts' tests (for the rehearsal, or this directory): their hosts go now, not at the end of
    the whole session."""
    if nextitem is None or HERE not in Path(nextitem.path).resolve().parents \
            or Path(nextitem.path).resolve() == REHEARSAL:
        _release_hosts()


@pytest.fixture(scope="session")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    if os.geteuid() != 0:
        pytest.fail("the appliance tests need root (they install and start a docker engine): run them as root, "
                    "as CI does")
    work_dir = tmp_path_factory.mktemp("appliance")
    _hosts_up.append(HOST_PREFIX)
    try:
        hosts, ssh_key = start_hosts(HOST_PREFIX, HOST_SUBNET, SCENARIOS, work_dir)
        yield Appliance(hosts, ssh_key, work_dir)
    finally:
        _release_hosts()


@pytest.fixture(scope="session")
def provisioned(appliance: Appliance) -> tuple[Appliance, list[str], PlaybookRun]:
    """The whole site.yml, once, on the P2P and the no-P2P host with the cpu-tiny recipe: host stages, the CPU
    image built on the controller and loaded, tiny models generated once on the controller and sent, vLLM under
    systemd, verify and the fleet report. Every test of the hosts' state reads what this run left."""
    hosts = [appliance.host(1), appliance.host(2)]
    inventory = appliance.inventory("provision", hosts)
    first = run_playbook(inventory)
    assert first.returncode == 0, first.output[-6000:]
    return appliance, [host.name for host in hosts], first
