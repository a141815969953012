"""The b70ctl commands the workload roles run on the controller: image provide, serve render for the container,
host environment and host fit from a host's facts, and the standalone tiny-model generator."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.errors import BadInput
from b70ctl.image.build import save_archive
from b70ctl.lock.model import appliance_hash, load_recipe_and_lock
from b70ctl.report.model import HOST_FACT_FIELDS, Environment
from b70host.facts import collect_facts
from b70host.topology import TOPOLOGY_PATH, topology
from host_package import host_module
from store_fixtures import write_recipe
from sysfs_trees import build_tree

runner = CliRunner()


@dataclass
class Outcome:
    exit_code: int
    stdout: str
    output: str


def invoke(*args: str, stdin: str | None = None) -> Outcome:
    """As `b70ctl` runs it: BadInput becomes exit 2 with its one-line message (b70ctl.cli.main)."""
    result = runner.invoke(app, list(args), input=stdin)
    if isinstance(result.exception, BadInput):
        return Outcome(result.exception.exit_code, result.stdout, str(result.exception))
    return Outcome(result.exit_code, result.stdout, result.output)


@pytest.fixture()
def p2p_host(tmp_path: Path) -> tuple[dict, str]:
    root = build_tree(tmp_path, "b70x2-switch")
    # p2p only once a probe opened peer memory (b70host/topology.py): the host's override after ze_peer passed.
    topology(root, tensor_parallel_size=2, profile="p2p", probe="never", write=True)
    return collect_facts(root), (Path(root) / TOPOLOGY_PATH.lstrip("/")).read_text()


IMAGE_ID = "sha256:" + "a" * 64


def recorded_documents() -> dict[str, dict]:
    """/etc/b70/image.json and models.json as the image and model stages write them: `b70ctl image record` of an
    image built on the controller, `b70ctl model record` of a fetch into the host's store."""
    provided = {"recipe": "pr620-fp8-tp2", "source": "build", "reference": "localhost/b70/vllm-xpu:0.21.0",
                "vllm_version": "0.21.0", "id": IMAGE_ID, "archive": "/tmp/archive.tar", "labels": {}}
    image = invoke("image", "record", "--id", IMAGE_ID, "--json", stdin=json.dumps(provided))
    fetched = {"recipe": "pr620-fp8-tp2", "dest": "/cache", "source": "hub", "changed": False, "quarantined": [],
               "models": [{"role": role, "path": f"/cache/{role}", "revision": f"r-{role}", "changed": False,
                           "files": []} for role in ("target", "drafter")]}
    models = invoke("model", "record", "--store-dir", "/var/lib/b70/models/pr620-fp8-tp2", "--json",
                    stdin=json.dumps(fetched))
    assert image.exit_code == 0 and models.exit_code == 0, (image.output, models.output)
    return {"image": json.loads(image.stdout), "models": json.loads(models.stdout)}


def test_host_environment_maps_every_collected_fact(p2p_host) -> None:
    facts, topology_text = p2p_host
    bundle = {"hostname": "b70-a", "facts": facts, "topology": json.loads(topology_text), **recorded_documents(),
              "compute_runtime": "26.14.37833.4-1~24.04~ppa1",
              "serve": {"argv": ["--model", "/models/target", "--speculative-config", '{"k": 4}'],
                        "env": {"ZE_AFFINITY_MASK": "0,1", "CCL_TOPO_P2P_ACCESS": "1"},
                        "exec_start_line": '"/usr/bin/docker" "run" "image" "--model" "/models/target"',
                        "prefix_caching": "off: a hybrid target speculating",
                        "rehearsal": {"models": "tiny", "drop": [{"option": "--speculative-config", "why": "refused",
                                                                  "refusal": "no"}],
                                      "replace": [{"option": "--port", "value": "1", "why": "taken"}]}}}
    result = invoke("host", "environment", "--recipe", "pr620-fp8-tp2", "--json", stdin=json.dumps(bundle))
    assert result.exit_code == 0, result.output
    environment = json.loads(result.stdout)
    # host_facts.json's bytes: the replication_check role writes stdout as it is.
    assert result.stdout == json.dumps(environment, indent=2, sort_keys=True) + "\n"
    recipe, lock, _ = load_recipe_and_lock("pr620-fp8-tp2", None)
    assert environment == {
        "hostname": "b70-a", "appliance_hash": appliance_hash(recipe, lock), "image_digest": "sha256:" + "a" * 64,
        "vllm_version": "0.21.0", "model_revision": "r-target", "drafter_revision": "r-drafter",
        "kernel": facts["kernel_release"], "xe_guc_firmware": "70.54.0 (loaded)", "xe_huc_firmware": "8.2.10 (loaded)",
        "compute_runtime": "26.14.37833.4-1~24.04~ppa1", "gpu_count": 2, "gpu_model": "2x B70", "p2p_profile": "p2p",
        "p2p_profile_reason": environment["p2p_profile_reason"],
        "serve_command": "CCL_TOPO_P2P_ACCESS=1 ZE_AFFINITY_MASK=0,1 vllm serve --model /models/target "
                         "--speculative-config '{\"k\": 4}'", "hardware_root": facts["root"],
        "serve_exec_start": '"/usr/bin/docker" "run" "image" "--model" "/models/target"',
        "serve_prefix_caching": "off: a hybrid target speculating",
        "rehearsal": ["models: tiny", "removed --speculative-config: refused", "--port 1: taken"]}
    # The profile is p2p because the host's override said so, not because the topology proved it: the report says so.
    assert environment["p2p_profile_reason"].startswith("override: p2p")
    assert "no probe opened peer memory" in environment["p2p_profile_reason"]
    # Everything the report takes from host facts is produced here (no field named twice differently).
    assert set(HOST_FACT_FIELDS) <= set(environment)
    assert set(environment) <= set(Environment.model_fields)


def test_the_bundle_collected_on_the_host_maps_as_the_documents_say(tmp_path: Path) -> None:
    """replication_check runs b70host.bundle on the host (its GPU inventory, the stages' documents, the runtime's
    version) and pipes it into `host environment`: what the documents say reaches the report's environment; a
    document that is not JSON stops the run in one line instead of describing the host from it."""
    root = build_tree(tmp_path, "b70x2-switch")
    topology(root, tensor_parallel_size=2, profile="p2p", probe="never", write=True)
    etc = Path(root) / "etc" / "b70"
    for name, document in recorded_documents().items():
        (etc / f"{name}.json").write_text(json.dumps(document, indent=2))
    collected = subprocess.run(host_module("bundle", "--hostname", "b70-a", "--root", root, "--etc-dir", str(etc)),
                               capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert collected.returncode == 0, collected.stderr
    bundle = json.loads(collected.stdout)
    assert bundle["facts"] == collect_facts(root) and bundle["serve"] == {}  # serving has not run
    result = invoke("host", "environment", "--recipe", "pr620-fp8-tp2", "--json", stdin=collected.stdout)
    assert result.exit_code == 0, result.output
    environment = json.loads(result.stdout)
    assert (environment["hostname"], environment["image_digest"], environment["model_revision"],
            environment["drafter_revision"], environment["p2p_profile"]) == (
        "b70-a", "sha256:" + "a" * 64, "r-target", "r-drafter", "p2p")
    assert environment["gpu_model"] == "2x B70" and environment["kernel"] == bundle["facts"]["kernel_release"]

    # The serve stage's read (roles/vllm_serve/tasks/inputs.yml): a document it needs and no stage wrote names the
    # stage to run first.
    required = subprocess.run(host_module("bundle", "--hostname", "b70-a", "--root", root, "--etc-dir", str(etc),
                                          "--require", "models", "--require", "serve"),
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert required.returncode == 2 and required.stdout == ""
    assert required.stderr == f"error: {etc}/serve.json is missing: run playbooks/serve.yml first\n"
    (etc / "serve.json").write_text("{half")
    broken = subprocess.run(host_module("bundle", "--hostname", "b70-a", "--root", root, "--etc-dir", str(etc)),
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert broken.returncode == 2 and broken.stdout == ""
    assert broken.stderr.startswith(f"error: {etc}/serve.json cannot be read as JSON")
    assert broken.stderr.rstrip().endswith("run playbooks/serve.yml again") and broken.stderr.count("\n") == 1


def test_host_environment_of_a_bare_host_and_bad_input() -> None:
    result = invoke("host", "environment", "--recipe", "cpu-tiny", "--json", stdin=json.dumps({"hostname": "h"}))
    assert result.exit_code == 0 and json.loads(result.stdout)["hostname"] == "h"
    people = invoke("host", "environment", "--recipe", "cpu-tiny", stdin=json.dumps({"hostname": "h"}))
    assert people.exit_code == 0 and "hostname: h" in people.stdout.splitlines()
    bad = invoke("host", "environment", "--recipe", "cpu-tiny", stdin=json.dumps({"facts": [1]}))
    assert bad.exit_code == 2 and "host bundle on stdin is invalid" in bad.output
    # Each stage's document is read with the model of the command that wrote it: an image.json of another schema
    # (hand-written, or left by an older release) is named, not reported as an image without a digest.
    stale = invoke("host", "environment", "--recipe", "cpu-tiny", stdin=json.dumps(
        {"hostname": "h", "image": {"image_id": IMAGE_ID}}))
    assert stale.exit_code == 2 and stale.output.startswith("host bundle on stdin is invalid (image.recipe: Field "
                                                            "required)"), stale.output


def test_host_fit_reads_another_hosts_facts_from_stdin(p2p_host) -> None:
    facts, _ = p2p_host
    # 256 GiB: at TP=2 the image's compute-runtime 26.14 pins a host-RAM mirror of both cards (host/memory.py).
    roomy = dict(facts, ram_total_bytes=256 * 2 ** 30)
    fits = invoke("host", "fit", "--recipe", "pr620-fp8-tp2", "--facts", "-", "--json", stdin=json.dumps(roomy))
    assert fits.exit_code == 0, fits.output
    assert json.loads(fits.stdout)["fits"] is True
    one_card = dict(facts, gpus=facts["gpus"][:1], gpu_count=1)
    refused = invoke("host", "fit", "--recipe", "pr620-fp8-tp2", "--facts", "-", "--json",
                     stdin=json.dumps(one_card))
    assert refused.exit_code == 1 and json.loads(refused.stdout)["fits"] is False
    garbage = invoke("host", "fit", "--recipe", "pr620-fp8-tp2", "--facts", "-", stdin="{not json")
    assert garbage.exit_code == 2 and "give the output of `b70ctl host facts --json`" in garbage.output


def test_serve_render_takes_the_topology_on_stdin_and_site_env(p2p_host, tmp_path: Path) -> None:
    _, topology_text = p2p_host
    path = tmp_path / "topology.json"
    path.write_text(topology_text)
    from_file = invoke("serve", "render", "--recipe", "pr620-fp8-tp2", "--topology", str(path), "--json")
    from_stdin = invoke("serve", "render", "--recipe", "pr620-fp8-tp2", "--topology", "-", "--env", "SITE_X=1=2",
                        "--json", stdin=topology_text)
    assert from_file.exit_code == 0 and from_stdin.exit_code == 0, from_stdin.output
    file_command, stdin_command = json.loads(from_file.stdout), json.loads(from_stdin.stdout)
    assert stdin_command["env"] == {**file_command["env"], "SITE_X": "1=2"}
    assert stdin_command["argv"] == file_command["argv"] and stdin_command["docker_args"] == file_command["docker_args"]
    bad_env = invoke("serve", "render", "--recipe", "cpu-tiny", "--env", "NOEQUALS")
    assert bad_env.exit_code == 2 and "write it as --env NAME=VALUE" in bad_env.output
    # A role's vllm_serve_extra_env, passed whole as --env-json: the same environment (a YAML number is text).
    from_json = invoke("serve", "render", "--recipe", "pr620-fp8-tp2", "--topology", "-", "--json",
                       "--env-json", '{"SITE_X": "1=2", "SITE_N": 8}', stdin=topology_text)
    assert from_json.exit_code == 0, from_json.output
    assert json.loads(from_json.stdout)["env"] == {**file_command["env"], "SITE_X": "1=2", "SITE_N": "8"}
    for bad, problem in (('["SITE_X=1"]', "expected a JSON object of NAME: value, found list"),
                         ('{"SITE_X": null}', "--env-json SITE_X: None is not a string or a number"),
                         ('{"SITE_X": ', "--env-json is not JSON"),
                         ('{"1ST": "x"}', "not an environment variable name"),
                         ('{"SITE=EVIL": "x"}', "'SITE=EVIL': not an environment variable name")):
        refused = invoke("serve", "render", "--recipe", "cpu-tiny", "--env-json", bad)
        assert refused.exit_code == 2 and problem in refused.output, (bad, refused.output)
    bad_topology = invoke("serve", "render", "--recipe", "pr620-fp8-tp2", "--topology", "-", stdin="{}")
    assert bad_topology.exit_code == 2 and "is not a topology document" in bad_topology.output


def test_serve_render_cpu_container_options() -> None:
    result = invoke("serve", "render", "--recipe", "cpu-tiny", "--drafter-dir", "/models/draft-perturbed", "--json")
    command = json.loads(result.stdout)
    assert command["docker_args"] == ["--network", "host", "--shm-size", "1g"]
    assert '"model":"/models/draft-perturbed"' in command["argv"][-1]
    # Without --json: the same, shell-quoted for people.
    people = invoke("serve", "render", "--recipe", "cpu-tiny", "--drafter-dir", "/models/draft-perturbed")
    lines = people.stdout.splitlines()
    assert lines[lines.index("server arguments:") + 1] == "  " + shlex.join(command["argv"])
    assert lines[lines.index("docker run options:") + 1] == "  --network host --shm-size 1g"


def test_image_provide_refuses_an_unresolved_lock() -> None:
    result = invoke("image", "provide", "--recipe", "pr620-fp8-tp2")
    assert result.exit_code == 2
    assert "run b70ctl lock resolve --recipe pr620-fp8-tp2" in result.output


def test_a_hosts_mirror_is_pulled_by_digest_and_recorded_as_installed() -> None:
    """The dspark_image role's two calls for a host given dspark_image_pull_reference: `image provide` names the
    mirror's digest (a tag is refused), and `image record` turns it, with the id the host's engine gave the
    image, into /etc/b70/image.json."""
    digest = "sha256:" + "ab" * 32
    mirror = f"registry.example:5000/b70/vllm@{digest}"
    provided = invoke("image", "provide", "--recipe", "pr620-fp8-tp2", "--pull-reference", mirror, "--json")
    assert provided.exit_code == 0, provided.output
    document = json.loads(provided.stdout)
    assert (document["source"], document["reference"], document["digest"]) == ("pull", mirror, digest)
    tagged = invoke("image", "provide", "--recipe", "pr620-fp8-tp2", "--pull-reference", "b70/vllm:latest")
    assert tagged.exit_code == 2 and "is not name@sha256:<64 hex digits>" in tagged.output

    image_id = "sha256:" + "cd" * 32
    recorded = invoke("image", "record", "--json", "--id", image_id, stdin=provided.stdout)
    assert recorded.exit_code == 0, recorded.output
    assert json.loads(recorded.stdout) == {"recipe": "pr620-fp8-tp2", "source": "pull", "reference": mirror,
                                           "id": image_id, "digest": digest, "vllm_version": document["vllm_version"],
                                           "labels": {}}
    not_an_id = invoke("image", "record", "--id", "b70/vllm", stdin=provided.stdout)
    assert not_an_id.exit_code == 2 and "is not an image id" in not_an_id.output
    garbage = invoke("image", "record", "--id", image_id, stdin="{}")
    assert garbage.exit_code == 2 and "pipe in the output of `b70ctl image provide --json`" in garbage.output


def test_image_provide_keys_the_plays_images_by_recipe_as_the_inventory_names_them(hub_env, tmp_path) -> None:
    """The dspark_image role's one controller call for the play: each distinct recipe once, keyed by the name or
    file each host's b70_recipe gives, so a host reads its own image by that key; any refusal fails the call."""
    from b70ctl.lock.resolve import resolve_and_write

    recipe_file = str(write_recipe(tmp_path))
    resolve_and_write(recipe_file)  # the local registry's b70/vllm-native:v1, pinned by digest
    digest = load_recipe_and_lock(recipe_file)[1].image.digest
    keyed = invoke("image", "provide", "--json", "--", recipe_file, recipe_file)
    assert keyed.exit_code == 0, keyed.output
    images = json.loads(keyed.stdout)["recipes"]
    assert list(images) == [recipe_file]
    assert images[recipe_file]["source"] == "pull" and images[recipe_file]["recipe"] == "store-test"
    assert digest and images[recipe_file]["reference"].endswith(f"@{digest}")
    # Each entry is what `image record` reads on stdin, as --recipe's single document is.
    single = invoke("image", "provide", "--json", "--recipe", recipe_file)
    assert json.loads(single.stdout) == images[recipe_file]
    recorded = invoke("image", "record", "--json", "--id", "sha256:" + "cd" * 32, stdin=json.dumps(images[recipe_file]))
    assert recorded.exit_code == 0, recorded.output

    unresolved = invoke("image", "provide", "--json", "--", recipe_file, "pr620-fp8-tp2")
    assert unresolved.exit_code == 2 and "run b70ctl lock resolve --recipe pr620-fp8-tp2" in unresolved.output
    both = invoke("image", "provide", "--json", "--recipe", recipe_file, recipe_file)
    assert both.exit_code == 2 and "not both and not neither" in both.output
    mirror = "registry.example:5000/b70/vllm@sha256:" + "ab" * 32
    keyed_mirror = invoke("image", "provide", "--pull-reference", mirror, "--", recipe_file)
    assert keyed_mirror.exit_code == 2 and "give it with --recipe NAME" in keyed_mirror.output


class _FakeImage:
    def __init__(self, chunks: list[bytes], fail_after: int | None = None) -> None:
        self.chunks, self.fail_after = chunks, fail_after

    def save(self, named: bool = False):
        for index, chunk in enumerate(self.chunks):
            if self.fail_after is not None and index == self.fail_after:
                raise OSError("engine went away")
            yield chunk


class _FakeClient:
    def __init__(self, image: _FakeImage) -> None:
        self.images = self
        self.image = image
        self.saves = 0

    def get(self, image_id: str) -> _FakeImage:
        self.saves += 1
        return self.image


def test_save_archive_names_by_id_is_atomic_and_done_once(tmp_path: Path) -> None:
    image_id = "sha256:" + "b" * 64
    broken = _FakeClient(_FakeImage([b"layer1", b"layer2"], fail_after=1))
    with pytest.raises(OSError):
        save_archive(broken, image_id, tmp_path, lambda line: None)
    assert not (tmp_path / f"{'b' * 64}.tar").exists()  # an interrupted save leaves no archive that looks whole
    client = _FakeClient(_FakeImage([b"layer1", b"layer2"]))
    archive = save_archive(client, image_id, tmp_path, lambda line: None)
    assert archive == tmp_path / f"{'b' * 64}.tar" and archive.read_bytes() == b"layer1layer2"
    assert save_archive(client, image_id, tmp_path, lambda line: None) == archive and client.saves == 1


@pytest.mark.parametrize("marker", [b"[1]", b"\xff\xfe", b'{"generator_version": 1'])
def test_a_generator_record_that_is_not_one_reads_as_not_generated(tmp_path: Path, marker: bytes) -> None:
    """generator.json holding a list or bytes that are not UTF-8 (a disk error, a hand edit) crashed `lock check`
    and the tiny-model check (AttributeError, UnicodeDecodeError): the models are not the locked ones, and are
    reported as drift and generated again."""
    from b70ctl.lock.check import check_model
    from b70ctl.models import tiny

    _, lock, _ = load_recipe_and_lock("cpu-tiny")
    assert lock.target.generated is not None
    directory = tmp_path / "target"
    directory.mkdir()
    (directory / "generator.json").write_bytes(marker)
    assert [drift.kind for drift in check_model(lock.target, directory)] == ["generator"]
    assert not tiny.is_generated(directory, tiny.TinySpec.model_validate(lock.target.generated.spec), "target")


def test_fetching_generated_models_once_generated_is_a_no_op_naming_their_revisions(tmp_path: Path) -> None:
    """The model_store role runs `model fetch` for cpu-tiny on the controller at every models stage: with the locked
    spec already generated it answers without importing torch, and names each model by its generator record (the
    revision /etc/b70/models.json carries)."""
    import hashlib

    from b70ctl.models import tiny

    _, lock, _ = load_recipe_and_lock("cpu-tiny")
    assert lock.target.generated is not None and lock.drafter.generated is not None
    spec = tiny.TinySpec.model_validate(lock.target.generated.spec)
    for role in tiny.ROLES:
        (tmp_path / "generated" / role).mkdir(parents=True)
        (tmp_path / "generated" / role / "generator.json").write_text(json.dumps(
            {"generator_version": tiny.GENERATOR_VERSION, "spec": spec.model_dump(), "role": role}))
    result = subprocess.run([sys.executable, "-c", (
        "import sys\nfrom b70ctl.cli import main\nsys.argv = ['b70ctl', 'model', 'fetch', '--json', '--recipe', "
        f"'cpu-tiny', '--dest', {str(tmp_path)!r}]\n"
        "try:\n    main()\nexcept SystemExit as end:\n    print('torch' in sys.modules, end.code, file=sys.stderr)")],
        capture_output=True, text=True, timeout=120)
    assert result.stderr.strip().splitlines()[-1] == "False 0", result.stderr
    fetched = json.loads(result.stdout)
    assert fetched["changed"] is True  # the links target -> generated/target, drafter -> the recipe's draft
    revisions = {model["role"]: model["revision"] for model in fetched["models"]}
    for role, generated in (("target", lock.target.generated.role), ("drafter", lock.drafter.generated.role)):
        assert (tmp_path / role).resolve() == tmp_path / "generated" / generated
        record = (tmp_path / "generated" / generated / "generator.json").read_bytes()
        assert revisions[role] == f"generated-{hashlib.sha256(record).hexdigest()[:12]}"

    # The host's models.json: the role pipes the fetch into `model record` with the host's store directory.
    b70ctl = [sys.executable, "-c", "import sys; from b70ctl.cli import main; sys.argv[0] = 'b70ctl'; main()"]
    store = "/var/lib/b70/models/cpu-tiny"
    recorded = subprocess.run([*b70ctl, "model", "record", "--json", "--store-dir", store], input=result.stdout,
                              capture_output=True, text=True, timeout=120)
    assert recorded.returncode == 0, recorded.stderr
    assert json.loads(recorded.stdout) == {role: {"path": f"{store}/{role}", "revision": revisions[role]}
                                           for role in ("target", "drafter")}
    relative = subprocess.run([*b70ctl, "model", "record", "--store-dir", "models"], input=result.stdout,
                              capture_output=True, text=True, timeout=120)
    assert relative.returncode == 2 and "--store-dir models: target.path: not an absolute path" in relative.stderr
    garbage = subprocess.run([*b70ctl, "model", "record", "--store-dir", store], input="{}", capture_output=True,
                             text=True, timeout=120)
    assert garbage.returncode == 2 and "pipe in the output of `b70ctl model fetch --json`" in garbage.stderr


def test_container_affinity_mask_counts_the_cards_the_container_is_given(p2p_host) -> None:
    """The serving container receives only the group's device nodes, which Level Zero numbers from 0: a group of
    the host's third and fourth cards is "0,1" inside it, not the host's "2,3"."""
    from b70ctl.host_documents import TopologyDocument

    _, topology_text = p2p_host
    document = TopologyDocument.model_validate_json(topology_text)
    assert document.serve_env()["ZE_AFFINITY_MASK"] == "0,1"
    later_cards = document.model_copy(update={"group": [2, 3], "affinity_mask": "2,3"})
    assert later_cards.serve_env()["ZE_AFFINITY_MASK"] == "0,1"


def test_serve_render_refuses_site_env_the_recipe_rules_reject(p2p_host) -> None:
    """The recipe model's dspark rule (docs/facts.md, route b: DSpark runs only on Model Runner V2) applies to a site's
    --env as to the recipe file; route a runs with VLLM_USE_V2_MODEL_RUNNER=0 (docs/facts.md, route a env)."""
    _, topology_text = p2p_host
    refused = invoke("serve", "render", "--recipe", "dspark-int4-tp1", "--topology", "-",
                     "--env", "VLLM_USE_V2_MODEL_RUNNER=0", stdin=topology_text)
    assert refused.exit_code == 2 and refused.stdout == ""
    assert "dspark-int4-tp1" in refused.output and "Model Runner V2" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
    allowed = invoke("serve", "render", "--recipe", "dspark-int4-tp1", "--topology", "-",
                     "--env", "VLLM_USE_V2_MODEL_RUNNER=1", "--json", stdin=topology_text)
    assert allowed.exit_code == 0 and json.loads(allowed.stdout)["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    route_a = invoke("serve", "render", "--recipe", "pr620-fp8-tp2", "--topology", "-",
                     "--env", "VLLM_USE_V2_MODEL_RUNNER=0", "--json", stdin=topology_text)
    assert route_a.exit_code == 0 and json.loads(route_a.stdout)["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_serve_units_gives_every_unit_of_a_host_as_the_role_writes_them() -> None:
    """The vllm_serve role's one render: the speculative server, then its target-only baseline, each as a unit file
    and an environment file at their paths; the baseline is the recipe's target alone; a rollback puts back exactly
    those files. Names and ports that would collide, and a User= that is not a user name, are refused."""
    models = json.dumps({"target": {"path": "/var/lib/b70/models/cpu-tiny/target", "revision": "r1"},
                         "drafter": {"path": "/var/lib/b70/models/cpu-tiny/drafter", "revision": "r2"}})
    common = ["serve", "units", "--recipe", "cpu-tiny", "--image", IMAGE_ID, "--models-record", models,
              "--config-dir", "/etc/b70/serve", "--compile-cache-dir", ""]
    result = invoke(*common, "--json", "--user", "b70", "--baseline-unit", "b70-vllm-baseline",
                    "--env-json", '{"SITE": "1"}')
    assert result.exit_code == 0, result.output
    units = json.loads(result.stdout)
    speculative, baseline = units["servers"]
    assert (speculative["unit"], speculative["port"], speculative["baseline"]) == ("b70-vllm", 8000, False)
    assert (baseline["unit"], baseline["port"], baseline["baseline"]) == ("b70-vllm-baseline", 8001, True)
    assert units["config_files"] == ["/etc/systemd/system/b70-vllm.service",
                                     "/etc/systemd/system/b70-vllm-baseline.service",
                                     "/etc/b70/serve/b70-vllm.env", "/etc/b70/serve/b70-vllm-baseline.env"]
    assert "--speculative-config" in speculative["exec_start_line"]
    assert "--speculative-config" not in baseline["exec_start_line"]
    for server in units["servers"]:
        lines = server["unit_file"].splitlines()
        assert "User=b70" in lines and f"ExecStart={server['exec_start_line']}" in lines
        assert f'ExecStop=/usr/bin/docker stop --time 30 "{server["unit"]}"' in lines
        assert "SITE=1" in server["env_file"].splitlines()
        assert f'"--env-file" "{server["env_file_path"]}"' in server["exec_start_line"]
    served = json.loads(units["serve_json"])
    assert "--speculative-config" in served["argv"] and json.loads(units["container_json"])["unit"] == "b70-vllm"
    # The record's store is mounted at /models: the servers are given its target and drafter below it.
    assert '"--volume" "/var/lib/b70/models/cpu-tiny:/models:ro"' in speculative["exec_start_line"]
    assert served["argv"][served["argv"].index("--model") + 1] == "/models/target"
    assert json.loads(served["argv"][served["argv"].index("--speculative-config") + 1])["model"] == "/models/drafter"
    elsewhere = json.dumps({"target": {"path": "/srv/store/target", "revision": "r1"},
                            "drafter": {"path": "/srv/other/drafter", "revision": "r2"}})
    refused = invoke(*[elsewhere if part == models else part for part in common], "--user", "b70")
    assert refused.exit_code == 2 and "the drafter is not in the target's store directory /srv/store" in refused.output
    # docker's --volume SRC:/models:ro: moby refuses a spec with more than two ':' (volume/mounts/linux_parser.go,
    # linuxSplitRawSpec), so a ':' in the store (from a recipe named so) is refused here first, by the rule host fit
    # applies to b70_model_store_dir.
    no_drafter = json.dumps({"target": {"path": "/var/lib/b70/models/cpu-tiny/target", "revision": "r1"}})
    missing = invoke(*[no_drafter if part == models else part for part in common], "--user", "b70")
    assert missing.exit_code == 2 and "--models-record holds no drafter, and recipe cpu-tiny has one" in missing.output
    colon = json.dumps({"target": {"path": "/var/lib/b70/models/x:rw/target", "revision": "r1"},
                        "drafter": {"path": "/var/lib/b70/models/x:rw/drafter", "revision": "r2"}})
    mount = invoke(*[colon if part == models else part for part in common], "--user", "b70")
    assert mount.exit_code == 2 and "'/var/lib/b70/models/x:rw' cannot be mounted as it is" in mount.output
    override = invoke(*common, "--user", "b70", "--drafter-dir", "/models/draft-perturbed", "--json")
    assert "/models/draft-perturbed" in json.loads(override.stdout)["servers"][0]["exec_start_line"]

    collide = invoke(*common, "--user", "b70", "--baseline-unit", "b70-vllm-baseline", "--baseline-port", "8000")
    assert collide.exit_code == 2 and "collides with --unit b70-vllm on port 8000" in collide.output
    hostile_user = invoke(*common, "--user", "b70\nExecStartPre=/bin/sh")
    assert hostile_user.exit_code == 2 and "is not a user name" in hostile_user.output
    hostile_unit = invoke(*common, "--user", "b70", "--unit", "b70 vllm")
    assert hostile_unit.exit_code == 2 and "is not a unit and container name" in hostile_unit.output
    # The unit is also the container's --name: docker refuses a one-character name (moby daemon/names/names.go,
    # RestrictedNamePattern ^[a-zA-Z0-9][a-zA-Z0-9_.-]+$), so it is refused before a unit is written with it.
    assert invoke(*common, "--user", "b70", "--unit", "b").exit_code == 2
    assert invoke(*common, "--user", "b70", "--unit", "b7", "--json").exit_code == 0


def test_two_processes_generating_one_directory_take_turns(tmp_path: Path) -> None:
    """Two runs generating the same tiny models at once (a play's forks; the test lanes, which share the user's
    cache) once raced on the same files: the second now waits, then finds them generated and leaves them."""
    spec = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 128, "train_steps": 2,
            "train_sequence_length": 16}
    program = ("import json, sys\nfrom b70ctl.models import tiny\n"
               f"result = tiny.generate(sys.argv[1], tiny.TinySpec(**{spec!r}))\n"
               "print(json.dumps(result['changed']))")
    runs = [subprocess.Popen([sys.executable, "-c", program, str(tmp_path / "models")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outcomes = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outcomes]
    assert sorted(json.loads(out) for out, _ in outcomes) == [False, True]
    from b70ctl.models import tiny

    assert all(tiny.is_generated(tmp_path / "models" / role, tiny.TinySpec(**spec), role) for role in tiny.ROLES)
