"""Each stand-in base (images/standins/<name>/Dockerfile) is held to the layout read from its upstream Dockerfile
(layout.yaml beside it, with the upstream file and commit): user, WORKDIR and what lies in it, ENV, PATH, where
vLLM lives, ENTRYPOINT/CMD and the oneAPI/oneCCL files. A stand-in that assumes a layout instead of reproducing the
one read fails here; the differences it may have are the ones layout.yaml lists under `differs`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from docker_rules import image_start

REPO = Path(__file__).resolve().parents[2]
STANDINS = sorted(path.parent for path in (REPO / "images" / "standins").glob("*/Dockerfile"))
DIFFERENCES = {"python", "os", "vllm", "oneapi", "not_installed"}


def final_stage(dockerfile: Path) -> dict[str, object]:
    """USER, WORKDIR, ENV (with $VAR and ${VAR} expanded as docker expands them) and the RUN lines of the
    Dockerfile's last stage."""
    env: dict[str, str] = {}
    user, workdir, runs = "root", "/", []

    def expand(value: str) -> str:
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), ""), value)

    for instruction in DockerfileParser(path=str(dockerfile)).structure:
        name, value = instruction["instruction"], instruction["value"]
        if name == "FROM":
            env, user, workdir, runs = {}, "root", "/", []
        elif name == "ENV":
            for key, raw in re.findall(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S+)', value):
                env[key] = expand(raw.strip('"'))
        elif name == "USER":
            user = value
        elif name == "WORKDIR":
            workdir = value if value.startswith("/") else f"{workdir.rstrip('/')}/{value}"
        elif name == "RUN":
            runs.append(value)
    return {"env": env, "user": user, "workdir": workdir.rstrip("/") or "/", "runs": "\n".join(runs)}


@pytest.mark.parametrize("standin", STANDINS, ids=[path.name for path in STANDINS])
def test_a_stand_in_reproduces_the_layout_read_from_its_upstream_dockerfile(standin: Path) -> None:
    layout = yaml.safe_load((standin / "layout.yaml").read_text())
    source = layout["source"]
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"]), source
    assert Path(source["path"]).name.startswith("Dockerfile"), source
    assert set(layout["differs"]) <= DIFFERENCES, "a stand-in differs only where layout.yaml says, for a reason"

    stage = final_stage(standin / "Dockerfile")
    env = stage["env"]
    assert isinstance(env, dict)
    assert stage["user"] == layout["user"]
    assert stage["workdir"] == layout["workdir"]
    for key, value in layout["env"].items():
        assert env.get(key) == value, (key, env.get(key), value)
    path = env["PATH"].split(":")
    assert path[:len(layout["path_starts"])] == layout["path_starts"]
    entrypoint, cmd = image_start(standin / "Dockerfile")
    assert (entrypoint, cmd) == (layout["entrypoint"], layout["cmd"])

    runs = str(stage["runs"])
    # vLLM lives in the venv the PATH starts with, and the source tree's package lies in the WORKDIR.
    assert '--python "${VIRTUAL_ENV}/bin/python"' in runs and 'venv --python' in runs
    assert f'{layout["workdir"]}/{layout["workdir_holds"]}' in runs
    for file in layout["oneapi"]["files"]:
        assert f"> {file}" in runs, file
    for link, target in layout["oneapi"]["links"].items():
        assert f"ln -s {target} {link}" in runs
    for line in layout["oneapi"]["bashrc"]:
        assert f'echo "{line}" >> /root/.bashrc' in runs
    # The one allowed Python difference is the one the layout names.
    python = re.search(r"venv --python (\S+)", runs)
    assert python is not None
    assert python.group(1) == layout["python"] or python.group(1) in layout["differs"]["python"]


def test_every_rehearsed_recipe_has_a_stand_in_of_the_base_its_recipe_builds_on() -> None:
    """The rehearsal's stand-ins (tests/appliance/rehearsal.py STANDINS) are named for the base the recipe's lock
    builds on, and each reproduces that base (layout.yaml's image)."""
    import sys

    sys.path.insert(0, str(REPO / "tests" / "appliance"))
    from rehearsal import STANDINS as REHEARSED

    from b70ctl.recipes import load_recipe
    from b70ctl.serve.rehearsal import load_overlay

    assert set(REHEARSED) == set(load_overlay().recipes)
    for recipe, name in REHEARSED.items():
        layout = yaml.safe_load((REPO / "images" / "standins" / name / "layout.yaml").read_text())
        build = load_recipe(recipe).image.build
        assert build is not None and build.base == layout["image"], (recipe, json.dumps(layout["image"]))
