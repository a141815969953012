"""Each stand-in base, built for real (images/standins/<name>/, as the rehearsal builds it), has the layout its
layout.yaml reads from the upstream Dockerfile: what docker says of the image (user, WORKDIR, ENV, PATH, ENTRYPOINT
and CMD) and what lies in it (the source tree in the WORKDIR, vLLM at the recipe's release in the venv the PATH
starts with, the oneCCL files and links). test_standins.py holds the stand-in's Dockerfile to the layout; this holds
the image docker built from it, which is what a recipe's own Dockerfile and the rehearsal's units meet.

Route a's own Dockerfile then builds on its stand-in, applying the patch series with the build's own `git apply` to
vLLM 0.21 carrying llm-scaler's multi-arc patch, and names the patch that does not apply when the base's vLLM moved.

These builds are the ones the rehearsal (tests/appliance/test_rehearsal.py) starts from: built here, beside the
other unit tests, they are a layer-cache lookup there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from b70ctl.cli import main
from b70ctl.image.build import LABEL_BASE_DIGEST, LABEL_SERIES_SHA256, LABEL_VLLM_VERSION
from b70ctl.image.patches import load_series
from b70ctl.recipes import load_recipe
from image_fixtures import SERIES
from rehearsal import STANDINS, build_standin, image_id

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.appliance, pytest.mark.timeout(1800)]  # a fresh machine downloads each base's vLLM


@pytest.fixture(scope="module")
def standins(engine, tmp_path_factory) -> dict[str, str]:
    """{recipe: image id} of each stand-in, built once for this file (docker's layer cache keeps them for the
    rehearsal)."""
    work_dir = tmp_path_factory.mktemp("standins")
    return {recipe: build_standin(recipe, work_dir) for recipe in sorted(STANDINS)}


def run_in(image: str, script: str) -> str:
    """SCRIPT's output in a container of IMAGE, started past its entrypoint (a stand-in's starts vLLM serve)."""
    result = subprocess.run(["docker", "run", "--rm", "--entrypoint", "bash", image, "-c", script],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("recipe", sorted(STANDINS))
def test_each_built_stand_in_has_the_layout_it_reproduces(standins, recipe) -> None:
    layout = yaml.safe_load((REPO / "images" / "standins" / STANDINS[recipe] / "layout.yaml").read_text())
    config = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config}}",
                                        standins[recipe]], check=True, capture_output=True, text=True).stdout)
    # Docker leaves out what the image does not set (no USER: root; no CMD).
    env = dict(item.split("=", 1) for item in config.get("Env") or [])
    assert (config.get("User") or "root") == layout["user"]
    assert config.get("WorkingDir") == layout["workdir"]
    for key, value in {**layout["env"], **layout.get("base_env", {})}.items():
        assert env.get(key) == value, (key, env.get(key), value)
    assert env["PATH"].split(":")[:len(layout["path_starts"])] == layout["path_starts"], env["PATH"]
    assert (config.get("Entrypoint"), config.get("Cmd")) == (layout["entrypoint"], layout["cmd"])

    # Inside: the source tree's package in the WORKDIR, the console script and the vLLM the PATH finds first, at the
    # recipe's release, and oneCCL's files as the base has them.
    venv_bin = layout["path_starts"][0]
    files = " ".join(layout["oneapi"]["files"])
    links = " ".join(layout["oneapi"]["links"])
    seen = run_in(standins[recipe], (
        f'cd "{layout["workdir"]}"; test -d "{layout["workdir_holds"]}" && echo holds; '
        'command -v vllm; '
        f'for f in {files}; do test -f "$f" && echo "file $f"; done; '
        f'for l in {links}; do echo "link $l $(readlink "$l")"; done; '
        "python -c 'import importlib.metadata as m; "
        "print(\"vllm\", m.version(m.packages_distributions()[\"vllm\"][0]))'"
    )).splitlines()
    assert "holds" in seen, seen
    assert f"{venv_bin}/vllm" in seen, seen
    for file in layout["oneapi"]["files"]:
        assert f"file {file}" in seen, (file, seen)
    for link, target in layout["oneapi"]["links"].items():
        assert f"link {link} {target}" in seen, (link, seen)
    version = next(line.split()[1] for line in seen if line.startswith("vllm "))
    release_line = ".".join(load_recipe(recipe).vllm_version.split(".")[:2]) + "."  # e.g. 0.21.1.dev0 -> "0.21."
    assert version.startswith(release_line), (version, release_line)


def _build_route_a(base_id: str, monkeypatch, capsys) -> tuple[int | str | None, str, str]:
    monkeypatch.setattr(sys, "argv", ["b70ctl", "image", "build", "--recipe", "pr620-fp8-tp2", "--base", base_id,
                                      "--no-cache", "--json"])
    try:
        main()
        code: int | str | None = 0
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


ROUTE_A = "pr620-fp8-tp2"
# What each worker of a two-rank server would start with, then the server's own mask again.
OWN_CARD_PROBE = """
import os, subprocess, sys
from vllm.v1.executor import multiproc_executor
seen = []
for rank in (0, 1):
    with multiproc_executor.b70_own_card_visibility(rank):
        child = [sys.executable, "-c", "import os; print(os.environ['ZE_AFFINITY_MASK'])"]
        seen.append(subprocess.run(child, capture_output=True, text=True, check=True).stdout.strip())
print(*seen, os.environ["ZE_AFFINITY_MASK"])
"""


def test_route_a_builds_on_its_stand_in_applying_the_series(standins, engine, built_images, monkeypatch,
                                                            capsys) -> None:
    built_images.append("localhost/b70/vllm-xpu-dspark:0.21-dspark")
    base_id = standins[ROUTE_A]
    code, out, err = _build_route_a(base_id, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    series = load_series(SERIES)
    for entry in series.entries:
        assert f"applied {entry.file}" in err
    built = json.loads(out)
    assert built["labels"][LABEL_SERIES_SHA256] == series.series_sha256
    labels = engine.images.get(built["id"]).labels
    assert labels[LABEL_SERIES_SHA256] == series.series_sha256
    assert labels[LABEL_BASE_DIGEST] == base_id
    assert labels[LABEL_VLLM_VERSION].startswith("0.21."), labels[LABEL_VLLM_VERSION]
    # Through the image's entrypoint (a command, not options, is exec'd): oneCCL's vars.sh is sourced first, and
    # the package the venv imports is the patched one.
    seen = subprocess.run(["docker", "run", "--rm", built["id"], "bash", "-c",
                           'echo "$CCL_ROOT"; grep -c "is_sample = is_query$" "$(python -c \'import importlib.util, '
                           'pathlib; print(pathlib.Path(importlib.util.find_spec("vllm").origin).parent)\')'
                           '/v1/spec_decode/utils.py"'], capture_output=True, text=True, timeout=300)
    assert seen.returncode == 0, seen.stderr[-3000:]
    assert seen.stdout.split() == ["/opt/intel/oneapi/ccl/2021.15", "1"]
    # Patch 0006 in the image's own vLLM: its executor module, imported whole, starts each worker process (here a
    # child started inside the same context proc.start() runs in) with its rank's card of the server's mask.
    own_card = subprocess.run(["docker", "run", "--rm", "-e", "B70_WORKER_OWN_CARD=1", "-e", "ZE_AFFINITY_MASK=0,1",
                               built["id"], "python", "-c", OWN_CARD_PROBE], capture_output=True, text=True,
                              timeout=300)
    assert own_card.returncode == 0, own_card.stderr[-3000:]
    assert own_card.stdout.split()[-3:] == ["0", "1", "0,1"], own_card.stdout[-3000:]
    monkeypatch.setattr(sys, "argv", ["b70ctl", "image", "inspect", built["id"], "--json"])
    with pytest.raises(SystemExit) as inspected:
        main()
    assert inspected.value.code == 0
    assert json.loads(capsys.readouterr().out)[LABEL_SERIES_SHA256] == series.series_sha256


def test_route_a_build_fails_naming_the_patch_when_the_base_moved(standins, built_images, tmp_path,
                                                                  monkeypatch, capsys) -> None:
    """The stand-in with one line of its vLLM changed where patch 0003 edits: the build stops there, naming it."""
    built_images.append("localhost/b70-test/route-a-stand-in:moved")
    (tmp_path / "move.py").write_text(
        "import importlib.util, pathlib\n"
        "package = pathlib.Path(importlib.util.find_spec('vllm').origin).parent\n"
        "registry = package / 'model_executor' / 'models' / 'registry.py'\n"
        "text = registry.read_text()\n"
        "old = '\"DFlashDraftModel\": (\"qwen3_dflash\", \"DFlashQwen3ForCausalLM\"),'\n"
        "assert old in text, 'the registry line patch 0003 edits is not in this vLLM'\n"
        "registry.write_text(text.replace(old, old.replace('qwen3_dflash', 'dflash_v2')))\n")
    (tmp_path / "Dockerfile").write_text(f"FROM {standins[ROUTE_A]}\nCOPY move.py /tmp/move.py\n"
                                         "RUN python /tmp/move.py && rm /tmp/move.py\n")
    subprocess.run(["docker", "build", "--quiet", "--tag", "localhost/b70-test/route-a-stand-in:moved",
                    str(tmp_path)], check=True, capture_output=True, text=True)
    moved = image_id("localhost/b70-test/route-a-stand-in:moved")
    code, _, err = _build_route_a(moved, monkeypatch, capsys)
    assert code == 1
    assert "applied 0002-qwen3-dflash-dspark-draft-model.patch" in err
    assert "patch 0003-registry-dspark-draft-model.patch does not apply" in err
