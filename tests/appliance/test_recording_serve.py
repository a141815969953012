"""The serve stage of both B70 recipes on the emulated B70 hosts, through a recording stand-in of the serving image.

A B70 recipe cannot be served here (no GPU, no XPU image), yet its serve stage can run for real: the host stage
(playbooks/host.yml) on the P2P host (two B70s behind one switch) and the no-P2P host (two B70s on separate root
ports), then playbooks/serve.yml with `vllm_serve_image_ref` naming the stand-in (tests/appliance/recorder), which
starts through the serving images' own entrypoint (images/entrypoint.sh), records the argv and environment the
unit started it with and answers /health, /v1/models and /metrics like vLLM. What it recorded must equal `b70ctl
serve render` for that host's topology: any check in the role that refuses a recipe's own setting (route a runs with
VLLM_USE_V2_MODEL_RUNNER=0) or any change the unit makes to the command shows here.

The model stage is not run (it would fetch 30 GB per recipe): the test leaves what it would, placeholder target and
drafter directories and /etc/b70/models.json; the stand-in reads no weights. The cards' /dev/dri nodes, which
udev makes on a real host, are made with mknod: the unit bind-mounts them into the container by their by-path
names, and the test looks at them from inside.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from b70ctl.recipes import load_recipe
from provision import (
    DRM_MAJOR,
    REPO_ROOT,
    Appliance,
    HostUnderTest,
    assert_recap,
    make_dri_nodes,
    on,
    run_playbook,
    run_testhosts,
    start_hosts,
)

pytestmark = [pytest.mark.appliance, pytest.mark.timeout(1800)]

HOST_PREFIX = "b70-rec"
HOST_SUBNET = "172.30.74.0/24"
# 192 GB hosts: route a's 26.14 image mirrors both cards' memory in host RAM, which a 128 GB host has no room for
# (host/memory.py; tests/unit/test_memory.py HOST_FITS).
SCENARIOS = {1: "b70x2-switch-192gb", 2: "b70x2-root-ports-192gb"}
RECIPES = ["pr620-fp8-tp2", "dspark-int4-tp1"]
API_KEY = "recorded-stand-in-key-5f1c"
PORT = 8000  # roles/vllm_serve/defaults/main.yml vllm_serve_port
# Set by docker itself in every container, not by the unit, and by bash, which runs the image's entrypoint and
# exports its working directory and shell level to what it execs: the only variables besides the rendered env allowed.
DOCKER_ENV = {"PATH", "HOSTNAME", "HOME", "PWD", "SHLVL"}
B70CTL = Path(sys.executable).parent / "b70ctl"


# A dual-B70 TP=2 start dying at IPC open, as its owner posted it (tests/fixtures/field/index.yaml:
# https://github.com/intel/llm-scaler/issues/398); the stand-in replays it when started with the p2p set.
IPC_OPEN_LOG = REPO_ROOT / "tests/fixtures/field/logs/s-llm-scaler-398-b70-awq-tp2-ipc.log"


def build_stand_in(work_dir: Path) -> tuple[str, Path]:
    """tests/appliance/recorder FROM the debootstrapped base, on the controller's engine, with the posted log it can
    replay under field/; saved for loading by id."""
    base = run_testhosts("image").strip()
    base_id = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", base], check=True,
                             capture_output=True, text=True).stdout.strip()
    context = work_dir / "recorder-context"
    shutil.copytree(Path(__file__).parent / "recorder", context, dirs_exist_ok=True)
    (context / "field").mkdir(exist_ok=True)
    shutil.copy2(IPC_OPEN_LOG, context / "field" / IPC_OPEN_LOG.name)
    shutil.copy2(REPO_ROOT / "images" / "entrypoint.sh", context / "entrypoint.sh")
    image_id = subprocess.run(["docker", "build", "--quiet", "--build-arg", f"BASE_IMAGE={base_id}",
                               "--tag", "localhost/b70/vllm-recorder:test", str(context)],
                              check=True, capture_output=True, text=True).stdout.strip()
    archive = work_dir / "recorder.tar"
    subprocess.run(["docker", "save", "--output", str(archive), image_id], check=True)
    return image_id, archive


def prepare_serving(appliance: Appliance, host: HostUnderTest, recipe: str, image_id: str) -> None:
    """What a host needs before the serve stage, besides the host stage: device nodes, models, the stand-in."""
    make_dri_nodes(host.name)
    place_models(host.name, recipe)
    if on(host.name).run(f"docker image inspect {image_id}").rc != 0:
        with (appliance.work_dir / "recorder.tar").open("rb") as stream:
            subprocess.run(["docker", "exec", "-i", host.name, "docker", "load", "--quiet"], stdin=stream,
                           check=True, capture_output=True)


def place_models(host: str, recipe: str) -> None:
    """What the model stage leaves: the recipe's target and drafter directories and /etc/b70/models.json, in the
    schema `b70ctl model record` writes it (ModelsRecord: serve render refuses any other key)."""
    store = f"/var/lib/b70/models/{recipe}"
    models = {"target": {"path": f"{store}/target", "revision": "stand-in"},
              "drafter": {"path": f"{store}/drafter", "revision": "stand-in"}}
    subprocess.run(["docker", "exec", "-i", host, "sh", "-c",
                    f"mkdir -p {store}/target {store}/drafter /etc/b70 && cat > /etc/b70/models.json"],
                   input=json.dumps(models, indent=2).encode(), check=True)


@pytest.fixture(scope="module")
def recording_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Appliance, str]]:
    if os.geteuid() != 0:
        pytest.fail("the appliance tests need root (they install and start a docker engine): run them as root")
    work_dir = tmp_path_factory.mktemp("recording")
    try:
        hosts, ssh_key = start_hosts(HOST_PREFIX, HOST_SUBNET, SCENARIOS, work_dir,
                                     fresh=os.environ.get("B70_KEEP_TESTHOSTS") != "1")
        image_id, _archive = build_stand_in(work_dir)
        yield Appliance(hosts, ssh_key, work_dir), image_id
    finally:
        if os.environ.get("B70_KEEP_TESTHOSTS") != "1":
            run_testhosts("down", "--prefix", HOST_PREFIX)


def recorded(host: HostUnderTest) -> dict:
    request = urllib.request.Request(f"http://{host.address}:{PORT}/b70/recorded",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def rendered(host: HostUnderTest, recipe: str) -> dict:
    """`b70ctl serve render` for this host's topology, with the paths the unit mounts the models at."""
    topology = on(host.name).file("/etc/b70/topology.json").content_string
    result = subprocess.run([str(B70CTL), "serve", "render", "--json", "--recipe", recipe, "--model-dir",
                             "/models/target", "--drafter-dir", "/models/drafter", "--port", str(PORT),
                             "--topology", "-"],
                            input=topology, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


@pytest.mark.parametrize("recipe", RECIPES)
def test_serve_stage_starts_exactly_the_rendered_command(recording_hosts, recipe: str) -> None:
    appliance, image_id = recording_hosts
    hosts = appliance.hosts
    names = [host.name for host in hosts]
    tensor_parallel = load_recipe(recipe).serve.tensor_parallel_size
    # The switch host carries the p2p override (provision.SCENARIO_HOST_VARS); at TP=1 there is no peer traffic and
    # the host is left to the topology, which gives no-p2p.
    host_vars = {} if tensor_parallel == 2 else {hosts[0].name: {"b70_ccl_profile": "auto"}}
    inventory = appliance.inventory(f"recording-{recipe}", hosts, host_vars=host_vars, group_vars={
        "b70_recipe": recipe, "vllm_serve_image_ref": image_id, "vllm_serve_api_key": API_KEY,
        "vllm_serve_health_timeout": 120,
        # Required by preflight for recipes whose models come from the Hub; nothing is downloaded here.
        "b70_hf_token": "hf_unused_by_the_stand_in",
        # The shipped B70 locks are unresolved; the stand-in uses neither the locked image nor the locked models.
        "preflight_allow_unresolved_lock": True})
    started = time.monotonic()
    # The host layer as for the embedded default (a B70 recipe's preflight asks for 80 GB of free disk for its
    # weights, which the stand-in never downloads), with the GPU group sized for this recipe's TP.
    host_inventory = appliance.inventory(f"recording-host-{recipe}", hosts, host_vars=host_vars, group_vars={
        "gpu_topology_tensor_parallel_size": tensor_parallel})
    host_stage = run_playbook(host_inventory, playbook="playbooks/host.yml")
    assert host_stage.returncode == 0, host_stage.output[-6000:]
    for host in hosts:
        prepare_serving(appliance, host, recipe, image_id)
    serve = run_playbook(inventory, playbook="playbooks/serve.yml")
    assert serve.returncode == 0, serve.output[-6000:]
    assert_recap(serve, names, failed=0)
    print(f"{recipe}: host and serve stages {time.monotonic() - started:.0f} s")

    # TP=2: P2P behind the switch (its override), the fallback on separate root ports. TP=1 has no peer traffic,
    # and the topology gives the no-p2p set on both (control/b70host/topology.py).
    expected_profile = {hosts[0].name: "p2p" if tensor_parallel == 2 else "no-p2p", hosts[1].name: "no-p2p"}
    for host in hosts:
        remote = on(host.name)
        assert remote.service("b70-vllm").is_running and remote.service("b70-vllm").is_enabled
        topology = json.loads(remote.file("/etc/b70/topology.json").content_string)
        assert topology["profile"] == expected_profile[host.name]
        command = rendered(host, recipe)
        record = recorded(host)
        print(f"{recipe} on {host.name} ({topology['profile']}): argv {record['argv']}")
        print(f"{recipe} on {host.name} ({topology['profile']}): env "
              f"{ {k: v for k, v in sorted(record['env'].items()) if k not in DOCKER_ENV | {'VLLM_API_KEY'}} }")
        assert record["argv"] == command["argv"]
        assert API_KEY not in " ".join(record["argv"]) and "--api-key" not in record["argv"]
        assert record["env"].pop("VLLM_API_KEY") == API_KEY
        assert set(record["env"]) - set(command["env"]) <= DOCKER_ENV
        assert {name: record["env"][name] for name in command["env"]} == command["env"]
        unit = remote.file("/etc/systemd/system/b70-vllm.service").content_string
        assert API_KEY not in unit
        exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
        words = shlex.split(exec_start.removeprefix("ExecStart="))  # systemd's quoting, as a shell reads it
        image_at = words.index(image_id)
        assert words[image_at - len(command["docker_args"]):image_at] == command["docker_args"]
        assert words[image_at + 1:] == command["argv"]
        check_device_nodes_inside(host.name, topology)
    check_recipe_facts(recipe, {host.name: recorded(host) for host in hosts}, hosts)


# Run inside the serving container: what Level Zero would find there (compute-runtime's Drm::discoverDevices lists
# /dev/dri/by-path and opens each -render entry), whether the device cgroup lets an open through (EPERM if not;
# these nodes have no driver behind them, so the kernel answers ENXIO or ENODEV), and whether a node can be made.
NODE_PROBE = """
import errno, json, os, stat
nodes = {}
for name in sorted(os.listdir("/dev/dri/by-path")):
    path = "/dev/dri/by-path/" + name
    info = os.stat(path)
    try:
        os.close(os.open(path, os.O_RDWR))
        opened = "ok"
    except OSError as error:
        opened = errno.errorcode[error.errno]
    nodes[path] = {"char": stat.S_ISCHR(info.st_mode), "rdev": [os.major(info.st_rdev), os.minor(info.st_rdev)],
                   "open": opened}
try:
    os.mknod("/tmp/other-card", stat.S_IFCHR | 0o600, os.makedev(226, 200))
    made = "ok"
except OSError as error:
    made = errno.errorcode[error.errno]
print(json.dumps({"nodes": nodes, "mknod": made}))
"""


def check_device_nodes_inside(host: str, topology: dict) -> None:
    """The container holds exactly the group's nodes under their by-path names, as the host's devices (major 226,
    the minors udev's links lead to), openable as far as the device cgroup goes, and cannot make others."""
    probe = subprocess.run(["docker", "exec", host, "docker", "exec", "b70-vllm", "python3", "-c", NODE_PROBE],
                           capture_output=True, text=True, check=True)
    inside = json.loads(probe.stdout)
    by_address = {gpu["pci_address"]: gpu for gpu in topology["gpus"]}
    expected = {}
    for node in topology["group_devices"]:
        address, kind = re.fullmatch(r"/dev/dri/by-path/pci-(.+)-(card|render)", node).groups()
        expected[node] = [DRM_MAJOR, int(re.search(r"(\d+)$", by_address[address][kind]).group(1))]
    assert sorted(inside["nodes"]) == sorted(expected), inside
    for node, seen in inside["nodes"].items():
        assert seen["char"] and seen["rdev"] == expected[node], (node, seen)
        assert seen["open"] in ("ENXIO", "ENODEV"), (node, seen)  # EPERM: the device cgroup refused it
    assert inside["mknod"] == "EPERM", inside


def check_recipe_facts(recipe: str, records: dict[str, dict], hosts: list[HostUnderTest]) -> None:
    """What each recipe must run with, from docs/facts.md rather than from the renderer."""
    p2p, no_p2p = (records[host.name] for host in hosts)
    if recipe == "pr620-fp8-tp2":
        # docs/facts.md, route a: TP=2, dflash k=4, env VLLM_USE_V2_MODEL_RUNNER=0, ZE_AFFINITY_MASK=0,1.
        for record in (p2p, no_p2p):
            assert record["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
            assert record["env"]["ZE_AFFINITY_MASK"] == "0,1"
            argv = record["argv"]
            assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
            assert json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "dflash"
        assert p2p["env"]["CCL_TOPO_P2P_ACCESS"] == "1"
        # docs/facts.md, the no-P2P path: the simple-algorithm thresholds at 4294967296.
        assert no_p2p["env"]["CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD"] == "4294967296"
        assert "CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD" not in p2p["env"]
    else:
        # docs/facts.md, route b: dspark runs only on Model Runner V2; k=7 probabilistic on one card.
        for record in (p2p, no_p2p):
            assert record["env"].get("VLLM_USE_V2_MODEL_RUNNER", "1") != "0"
            argv = record["argv"]
            assert "--tensor-parallel-size" not in argv
            spec = json.loads(argv[argv.index("--speculative-config") + 1])
            assert (spec["method"], spec["num_speculative_tokens"]) == ("dspark", 7)


def test_a_p2p_start_that_dies_opening_peer_memory_restarts_once_with_no_p2p(recording_hosts) -> None:
    """The serve gate (issue: p2p only when proven): the switch host is served p2p by its override, and its start
    dies as intel/llm-scaler #398's dual-B70 host did, at zeMemOpenIpcHandle. The play restarts it once with
    no-p2p, serves, and records why; the host stage then keeps no-p2p for these cards, override or not."""
    appliance, image_id = recording_hosts
    switch = appliance.hosts[0]
    recipe = "pr620-fp8-tp2"
    remote = on(switch.name)
    remote.run("rm -f /etc/b70/ccl-fallback.json")
    host_inventory = appliance.inventory("fallback-host", [switch], group_vars={
        "gpu_topology_tensor_parallel_size": 2})
    host_stage = run_playbook(host_inventory, playbook="playbooks/host.yml")
    assert host_stage.returncode == 0, host_stage.output[-6000:]
    assert json.loads(remote.file("/etc/b70/topology.json").content_string)["profile"] == "p2p"
    prepare_serving(appliance, switch, recipe, image_id)
    inventory = appliance.inventory("fallback-serve", [switch], group_vars={
        "b70_recipe": recipe, "vllm_serve_image_ref": image_id, "vllm_serve_api_key": API_KEY,
        "vllm_serve_health_timeout": 30, "b70_hf_token": "hf_unused_by_the_stand_in",
        "preflight_allow_unresolved_lock": True,
        "vllm_serve_extra_env": {"B70_RECORDER_DIES_ON_P2P": f"/opt/b70/field/{IPC_OPEN_LOG.name}"}})
    serve = run_playbook(inventory, playbook="playbooks/serve.yml")
    assert serve.returncode == 0, serve.output[-6000:]
    assert_recap(serve, [switch.name], failed=0, rescued=1)
    assert "restarting once with no-p2p" in serve.output

    posted = IPC_OPEN_LOG.read_text().splitlines()
    record = json.loads(remote.file("/etc/b70/ccl-fallback.json").content_string)
    topology = json.loads(remote.file("/etc/b70/topology.json").content_string)
    assert record["signature"] == "ze-ipc-open-invalid-argument" and record["evidence"] == posted[0]
    assert record["group"] == [gpu["pci_address"] for gpu in topology["gpus"] if gpu["index"] in topology["group"]]
    assert (topology["profile"], topology["profile_source"]) == ("no-p2p", "fallback")
    assert "ze-ipc-open-invalid-argument" in topology["profile_reason"]
    assert "ccl-fallback.json" in topology["profile_reason"]

    # What serves now is the no-p2p render of the new topology, exactly.
    command = rendered(switch, recipe)
    served = recorded(switch)
    assert served["argv"] == command["argv"]
    assert served["env"]["CCL_TOPO_P2P_ACCESS"] == "0"
    assert served["env"]["CCL_SYCL_ALLREDUCE_SIMPLE_THRESHOLD"] == "4294967296"  # docs/facts.md, no-P2P path

    # The host stage again, with the p2p override still in the inventory: the record keeps these cards on no-p2p.
    again = run_playbook(host_inventory, playbook="playbooks/host.yml")
    assert again.returncode == 0, again.output[-6000:]
    kept = json.loads(remote.file("/etc/b70/topology.json").content_string)
    assert (kept["profile"], kept["profile_source"]) == ("no-p2p", "fallback")
    remote.run("rm -f /etc/b70/ccl-fallback.json")
