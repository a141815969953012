"""host_kernel on a real systemd test host: a machine whose B70s its running kernel cannot drive gets the release's
kernel and firmware from the host package lock, the play stops for the reboot saying what it installed, and after
the reboot a re-run changes nothing.

The host is Debian 12 (a container) provisioned under the test hosts' release matrix
(tests/fixtures/releases-testhosts.yaml), so `b70ctl host kernel-plan` names Debian's kernel (linux-image-amd64)
and firmware (firmware-linux-free) from the emulated sysfs tree, and the install is the one a real host gets: the
lock's real .debs, fetched through the controller cache, hash-checked on the host, installed by dpkg with the
kernel's own postinst (it builds an initramfs), and not held (security updates flow).

What no container can do is boot that kernel. The reboot is the operator's (the play's own stop says to reboot),
emulated as a container restart after which the machine shows its B70s bound to xe under a kernel that drives them
(the b70x2-switch-192gb tree, 6.17.0-1009-intel). It is not the 6.1 just installed: Debian 12's kernel is older
than the recipe's kernel_min 6.14, and preflight refuses it when the tree says so (tried). Ansible's reboot module
(b70_allow_reboot: true) cannot run on a container (its boot id is the machine's): that path is the real hosts'.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from debianset import B70CTL, TEST_HOST_MATRIX, TEST_HOST_SERIES
from provision import (
    FIXTURE_ROOT,
    REPO_ROOT,
    Appliance,
    assert_recap,
    give_hardware,
    on,
    restart_host,
    run_playbook,
    run_testhosts,
    start_hosts,
)

pytestmark = [pytest.mark.appliance, pytest.mark.timeout(1200)]

MODEL_STORE = "/var/lib/b70/models"
HOST_PREFIX = "b70-krn"
HOST_SUBNET = "172.30.76.0/24"
# An XPU recipe (a CPU one needs no GPU kernel) whose lock ships unresolved: preflight goes on, saying so.
HOST_VARS = {"b70_recipe": "pr620-fp8-tp2", "b70_hf_token": "hf_unused_nothing_is_downloaded",
             "preflight_allow_unresolved_lock": True, "b70_release_matrix": str(TEST_HOST_MATRIX)}


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    """One host of its own, two B70s under a kernel that has no xe driver for them: the kernel tests share no host
    with the others, so they run in either lane of scripts/test-lanes."""
    if os.geteuid() != 0:
        pytest.fail("the appliance tests need root (they install and start a docker engine): run them as root")
    work_dir = tmp_path_factory.mktemp("host-kernel")
    try:
        hosts, ssh_key = start_hosts(HOST_PREFIX, HOST_SUBNET, {1: "b70x2-switch-old-kernel"}, work_dir)
        yield Appliance(hosts, ssh_key, work_dir)
    finally:
        if os.environ.get("B70_KEEP_TESTHOSTS") != "1":
            run_testhosts("down", "--prefix", HOST_PREFIX)


def _model_disk(host: str) -> None:
    """The recipe's 80 GiB model disk, emulated as the GPUs are (preflight measures it before the kernel stage;
    nothing is written to it): a tmpfs reports its size, not what it holds."""
    on(host).check_output(f"mkdir -p {MODEL_STORE} && mount -t tmpfs -o size=100g b70-model-disk {MODEL_STORE}")


def _dpkg(host: str) -> dict[str, tuple[str, str]]:
    """{package: (status, version)} as dpkg-query shows them."""
    shown = on(host).check_output("dpkg-query --show --showformat='${db:Status-Abbrev} ${Package} ${Version}\\n'")
    return {name: (status, version) for status, name, version in (line.split() for line in shown.splitlines())}


def _lock_check(appliance: Appliance, host: str) -> subprocess.CompletedProcess:
    shown = on(host).check_output("dpkg-query --show --showformat='${db:Status-Abbrev} ${Package} ${Version} "
                                  "${Architecture}\\n'")
    return subprocess.run([str(B70CTL), "lock", "check", "--host-packages", "--packages-lock",
                           str(appliance.work_dir / "host-packages.lock.json"), "--series", TEST_HOST_SERIES,
                           "--group", "kernel", "--installed", "-", "--host", host],
                          input=shown, capture_output=True, text=True)


def _rerun_changes_nothing(inventory, host: str) -> None:
    """After the reboot: preflight and host_kernel again, and the host is as the plan wanted it."""
    again = run_playbook(inventory, "--tags", "preflight,host_kernel", playbook="playbooks/host.yml")
    assert again.returncode == 0, again.output[-4000:]
    assert_recap(again, [host], changed=0, failed=0)
    assert f"{host}: host_kernel: 2 GPU(s) bound to xe under kernel 6.17.0-1009-intel, firmware good." \
        in again.output


def test_a_kernel_that_cannot_drive_the_b70s_is_replaced_from_the_lock_and_the_play_stops_for_the_reboot(
        appliance: Appliance) -> None:
    host = appliance.host(1)
    assert host.scenario == "b70x2-switch-old-kernel"
    _model_disk(host.name)
    inventory = appliance.inventory("old-kernel", [host], group_vars=HOST_VARS)
    before = _dpkg(host.name)

    first = run_playbook(inventory, playbook="playbooks/host.yml")
    assert first.returncode != 0
    assert_recap(first, [host.name], failed=1)
    assert (f"{host.name}: installed linux-image-amd64 firmware-linux-free (GPU(s) 0000:05:00.0, 0000:09:00.0 not "
            "bound to xe under kernel 5.10.0-32-amd64 (older than Debian 12 (bookworm)'s 6.1 from "
            "linux-image-amd64); firmware xe/bmg_guc_70.bin, xe/bmg_huc.bin missing); no GRUB here (no "
            "update-grub): make the new kernel the boot loader's default; reboot the host and run the play again, "
            "or set b70_allow_reboot: true.") in first.output, first.output[-4000:]
    assert "TASK [intel_gpu" not in first.output  # stopped at the reboot gate, before the GPU stack

    lock = json.loads((appliance.work_dir / "host-packages.lock.json").read_text())["series"][TEST_HOST_SERIES]
    assert lock["groups"]["kernel"]["requested"] == ["linux-image-amd64", "firmware-linux-free"]
    kernel_pins = {pin["name"]: pin for pin in lock["packages"] if "kernel" in pin["groups"]}
    after = _dpkg(host.name)
    # Every package the install added is one the lock's kernel group names, at its version: its dependencies were
    # resolved inside the locked set, nothing came from an apt index.
    added = {name for name in after if name not in before}
    assert added and added <= set(kernel_pins), sorted(added - set(kernel_pins))
    remote = on(host.name)
    for name in added:
        pin = kernel_pins[name]
        assert after[name][1] == pin["version"], name
        copied = remote.file(f"/var/cache/b70/debs/{name}_{pin['version'].split(':')[-1]}_{pin['architecture']}.deb")
        assert copied.sha256sum == pin["sha256"], name
    for name in ("linux-image-amd64", "firmware-linux-free"):
        assert after[name][0] == "ii", name  # not held: the kernel and firmware take their security updates
    # The kernel's own postinst ran: the image and the initramfs it built for that exact kernel.
    image = next(name for name in added if name.startswith("linux-image-") and name != "linux-image-amd64")
    release = image.removeprefix("linux-image-")
    assert remote.file(f"/boot/vmlinuz-{release}").is_file and remote.file(f"/boot/initrd.img-{release}").is_file
    assert "GRUB_DEFAULT=0" in remote.file("/etc/default/grub.d/59-b70-kernel.cfg").content_string
    assert _lock_check(appliance, host.name).returncode == 0

    # The operator reboots; the machine comes back with its B70s bound to xe (see the module docstring).
    restart_host(host.name)
    give_hardware(host.name, "b70x2-switch-192gb", appliance.work_dir)
    _model_disk(host.name)
    _rerun_changes_nothing(inventory, host.name)
    assert _dpkg(host.name) == after


GUC_UPDATES = f"{FIXTURE_ROOT}/lib/firmware/updates/xe/bmg_guc_70.bin"


def _emulated_reboot(host: str) -> str:
    """A reboot of a host whose kernel and cards stay: the container restarts, and the driver then reports the GuC
    of the blob the firmware loader finds first, read from that blob's own header (the reader the real Debian blobs
    test, tests/unit/test_firmware_blobs.py). Returns that release."""
    restart_host(host)
    facts_script = (REPO_ROOT / "control" / "b70host" / "facts.py").read_text()  # as gpu_inventory.yml pipes it
    found = json.loads(subprocess.run(["docker", "exec", "-i", host, "python3", "-", "--root", FIXTURE_ROOT],
                                      input=facts_script, capture_output=True, text=True, check=True).stdout)
    release = found["firmware_files"]["xe/bmg_guc_70.bin"]["release_version"]
    on(host).check_output(f"for info in {FIXTURE_ROOT}/sys/kernel/debug/dri/*/gt*/uc/guc_info; do sed -i "
                          f"'s/found release version .*/found release version {release}/' \"$info\"; done")
    return release


def test_a_stock_firmware_whose_guc_is_refused_converges_in_two_runs_and_one_reboot(appliance: Appliance) -> None:
    """The stock 26.04 host (GuC 70.58.0 loaded and on disk; the release's firmware package carries it too): the
    first run puts the release matrix's good blob in /lib/firmware/updates by content and stops for the reboot;
    after it the driver loads GuC 70.72.1, and the second run changes nothing."""
    host = appliance.host(1)
    give_hardware(host.name, "b70x2-switch-192gb-guc-70.58", appliance.work_dir)
    _model_disk(host.name)
    inventory = appliance.inventory("guc-override", [host], group_vars=HOST_VARS)

    first = run_playbook(inventory, "--tags", "preflight,host_kernel", playbook="playbooks/host.yml")
    assert first.returncode != 0
    assert_recap(first, [host.name], failed=1)
    assert (f"{host.name}: installed /lib/firmware/updates/xe/bmg_guc_70.bin (GPU 0000:05:00.0 loaded GuC 70.58.0 "
            "resets engines") in first.output, first.output[-4000:]
    assert ("firmware-linux-free's own GuC is refused too (GuC 70.58.0 resets engines and faults): installing GuC "
            "70.72.1") in first.output
    installed = on(host.name).file(GUC_UPDATES)
    assert installed.sha256sum == "de81c75f46a127c33cd59f604d800e9ffc7ed3495967ba0d8767cd6985ab398b"
    assert installed.mode == 0o644

    assert _emulated_reboot(host.name) == "70.72.1"
    _model_disk(host.name)
    _rerun_changes_nothing(inventory, host.name)
