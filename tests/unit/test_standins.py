"""Each stand-in base (images/standins/<name>/Dockerfile) is held to the layout read from its upstream Dockerfile
(layout.yaml beside it, with the upstream file and commit): user, WORKDIR and what lies in it, ENV, PATH, where
vLLM lives, ENTRYPOINT/CMD and the oneAPI/oneCCL files. A stand-in that assumes a layout instead of reproducing the
one read fails here; the differences it may have are the ones layout.yaml lists under `differs`.

The layout itself is held to the upstream Dockerfile, kept whole at its commit in tests/fixtures/upstream/ (named
by FIXTURE_NAME from layout.yaml's `source`): a layout assumed rather than read fails there."""

from __future__ import annotations

import copy
import io
import json
import posixpath
import re
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

REPO = Path(__file__).resolve().parents[2]
STANDINS = sorted(path.parent for path in (REPO / "images" / "standins").glob("*/Dockerfile"))
UPSTREAM = REPO / "tests" / "fixtures" / "upstream"
DIFFERENCES = {"python", "os", "vllm", "oneapi", "not_installed"}
PAIR = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)=("[^"]*"|\S*)')
VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def fixture(source: dict[str, str]) -> Path:
    """The upstream Dockerfile a layout was read from, kept at its commit: <repository name>-<path with / as
    ->-<commit's first 7>, e.g. vllm-docker-Dockerfile.xpu-05cb1bc."""
    name = source["repository"].split("/")[-1]
    return UPSTREAM / f"{name}-{source['path'].replace('/', '-')}-{source['commit'][:7]}"


def final_stage(dockerfile: Path) -> dict[str, object]:
    """What the Dockerfile's last stage gives its image, as docker builds it: USER, WORKDIR, ENV (with $VAR and
    ${VAR} expanded from the ENV and ARG defaults in scope, every KEY=VALUE of an instruction against the values
    before it), ENTRYPOINT and CMD (a CMD inherited from the base is dropped once ENTRYPOINT is set), the COPY/ADD
    instructions (sources, destination resolved against the WORKDIR of the moment) and the RUN lines, with the
    variables ENV and ARG define expanded. A stage FROM an earlier stage's name starts from that stage; one FROM an
    image starts empty (what the image itself sets is not in this file)."""
    empty = {"env": {}, "user": "root", "workdir": "/", "entrypoint": None, "cmd": None, "copies": [], "runs": []}
    stages: dict[str, dict[str, object]] = {}
    global_args: dict[str, str] = {}
    state: dict | None = None
    args: dict[str, str] = {}
    shell, cmd_set = ["/bin/sh", "-c"], False

    def expand(value: str) -> str:
        """Docker's substitution: a name ENV or ARG does not define is empty."""
        def one(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            return state["env"].get(name, args.get(name, ""))
        return VARIABLE.sub(one, value)

    def expand_known(value: str) -> str:
        """The shell's view of a RUN line: ENV and ARG in its environment, its own variables left as written."""
        def one(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            return state["env"].get(name, args.get(name, match.group(0)))
        return VARIABLE.sub(one, value)

    def pairs(value: str) -> list[tuple[str, str]]:
        found = [(key, raw[1:-1] if raw.startswith('"') else raw) for key, raw in PAIR.findall(value)]
        if not found and value.split():  # the legacy `ENV KEY value` / `ARG KEY` forms
            key, _, rest = value.strip().partition(" ")
            found = [(key, rest.strip())] if rest.strip() else []
        return found

    def words(value: str) -> list[str]:
        try:
            form = json.loads(value)
        except json.JSONDecodeError:
            form = None
        return form if isinstance(form, list) else [*shell, value]

    for instruction in DockerfileParser(fileobj=io.BytesIO(dockerfile.read_bytes())).structure:
        name, value = instruction["instruction"], instruction["value"]
        if name == "FROM":
            parts = [word for word in value.split() if not word.startswith("--")]
            alias = parts[2].lower() if len(parts) == 3 and parts[1].lower() == "as" else ""
            state = copy.deepcopy(stages.get(parts[0].lower(), empty))
            args, shell, cmd_set = {}, ["/bin/sh", "-c"], False
            if alias:
                stages[alias] = state
        elif state is None:
            if name == "ARG":
                global_args.update((key, val) for key, val in pairs(value))
        elif name == "ARG":
            for key, val in pairs(value) or [(value.strip(), "")]:
                args[key] = expand(val) if "=" in value else global_args.get(key, "")
        elif name == "ENV":
            state["env"].update([(key, expand(val)) for key, val in pairs(value)])
        elif name == "USER":
            state["user"] = expand(value)
        elif name == "WORKDIR":
            state["workdir"] = posixpath.normpath(posixpath.join(state["workdir"], expand(value)))
        elif name in ("COPY", "ADD"):
            paths = [word for word in expand(value).split() if not word.startswith("--")]
            destination = posixpath.normpath(posixpath.join(state["workdir"], paths[-1]))
            state["copies"].append((paths[:-1], destination))
        elif name == "RUN":
            state["runs"].append(expand_known(value))
        elif name == "SHELL":
            shell = json.loads(value)
        elif name == "ENTRYPOINT":
            state["entrypoint"] = words(value)
            if not cmd_set:
                state["cmd"] = None
        elif name == "CMD":
            state["cmd"], cmd_set = words(value), True
    assert state is not None, f"{dockerfile}: no FROM"
    return {**state, "runs": "\n".join(state["runs"])}


def venv_python(runs: str, venv: str, layout: dict) -> str:
    """The Python of the venv at VENV the stand-in's RUN lines make: `uv venv --python X ... VENV`, or
    `pythonX -m venv VENV` (a bare python3 is the stand-in's base's own, which differs.python must name)."""
    end = r'"?(?=[\s;&"]|$)'
    pinned = re.search(rf'uv venv --python (\S+)[^;&]*?\s"?{re.escape(venv)}{end}', runs)
    if pinned:
        return pinned.group(1)
    made = re.search(rf'\bpython(3(?:\.\d+)?)? -m venv "?{re.escape(venv)}{end}', runs)
    assert made is not None, f"no venv is made at {venv}"
    if made.group(1) and "." in made.group(1):
        return made.group(1)
    named = re.match(r"(\d+\.\d+):", str(layout["differs"].get("python", "")))
    assert named is not None, "the base's python3 makes the venv: differs.python names its version"
    return named.group(1)


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
    # The upstream final stage's ENV and, where the upstream file says its base sets them, the base's.
    for key, value in {**layout["env"], **layout.get("base_env", {})}.items():
        assert env.get(key) == value, (key, env.get(key), value)
    path = env["PATH"].split(":")
    assert path[:len(layout["path_starts"])] == layout["path_starts"]
    assert (stage["entrypoint"], stage["cmd"]) == (layout["entrypoint"], layout["cmd"])

    runs = str(stage["runs"])
    # vLLM is installed into the venv the PATH starts with, and the source tree's package lies in the WORKDIR.
    venv = posixpath.dirname(layout["path_starts"][0])
    python = venv_python(runs, venv, layout)
    installed = rf'--python "?{re.escape(venv)}/bin/python"?\s[^;&]*\bvllm(?:-cpu)?=='
    assert re.search(installed, runs), f"vLLM is not installed with {venv}/bin/python"
    assert f'{layout["workdir"]}/{layout["workdir_holds"]}' in runs
    for file in layout["oneapi"]["files"]:
        assert f"> {file}" in runs, file
    for link, target in layout["oneapi"]["links"].items():
        assert f"ln -s {target} {link}" in runs
    for line in layout["oneapi"]["bashrc"]:
        assert f'echo "{line}" >> /root/.bashrc' in runs
    # The one allowed Python difference is the one the layout names.
    assert python == layout["python"] or str(layout["differs"]["python"]).startswith(f"{python}:"), python


@pytest.mark.parametrize("standin", STANDINS, ids=[path.name for path in STANDINS])
def test_each_layout_is_the_one_its_upstream_dockerfile_gives(standin: Path) -> None:
    """layout.yaml against a parse of the upstream Dockerfile it names, kept whole at that commit: the final stage's
    user, WORKDIR and what is copied into it, every ENV it sets, the PATH's start, ENTRYPOINT/CMD, how vLLM is
    installed, the Python of the venv and the oneAPI/oneCCL files, links and .bashrc lines."""
    layout = yaml.safe_load((standin / "layout.yaml").read_text())
    source = layout["source"]
    dockerfile = fixture(source)
    assert dockerfile.is_file(), f"keep {source['repository']}'s {source['path']} at {source['commit']} as {dockerfile}"
    url = f"https://github.com/{source['repository']}/blob/{source['commit']}/{source['path']}"
    readme = (UPSTREAM / "README.md").read_text()
    assert re.search(rf"\| `{re.escape(dockerfile.name)}` \| {re.escape(url)}\b", readme), "a README row names it"
    text = dockerfile.read_text()
    upstream = final_stage(dockerfile)
    env = upstream["env"]
    assert isinstance(env, dict)

    assert upstream["user"] == layout["user"]
    assert upstream["workdir"] == layout["workdir"]
    assert {key: value for key, value in env.items() if key != "PATH"} == layout["env"]
    # What the upstream file says its base sets (the final stage does not set it again).
    for key, value in layout.get("base_env", {}).items():
        assert key not in env and f"{key}={value}" in text, (key, value)
    if "PATH" in env:
        assert env["PATH"].split(":")[:len(layout["path_starts"])] == layout["path_starts"], env["PATH"]
    else:
        assert f"PATH={':'.join(layout['path_starts'])}:" in text, "the file says its base's PATH starts so"
    assert (upstream["entrypoint"], upstream["cmd"]) == (layout["entrypoint"], layout["cmd"])

    # The WORKDIR holds what is copied into it: `./<holds>`, or `. .` (the source tree, its package at the top).
    workdir, holds = layout["workdir"], layout["workdir_holds"]
    copies = upstream["copies"]
    assert isinstance(copies, list)
    assert any(
        destination == f"{workdir}/{holds}" or (sources == ["."] and destination == workdir)
        for sources, destination in copies
    ), copies

    runs = str(upstream["runs"])
    assert layout["vllm_install"] in runs, layout["vllm_install"]
    venv = posixpath.dirname(layout["path_starts"][0])
    python = layout["python"]
    assert f"venv --python {python} " in runs or f"{venv}/lib/python{python}/site-packages" in "\n".join(
        [runs, *env.values()]
    ), python
    # The oneAPI/oneCCL scripts the final stage names are the layout's files, no more and no fewer.
    assert set(re.findall(r"/opt/intel/oneapi/[\w./-]+\.sh\b", runs)) == set(layout["oneapi"]["files"])
    for link, target in layout["oneapi"]["links"].items():
        assert f"ln -s {target} {link}" in runs, link
    for line in layout["oneapi"]["bashrc"]:
        assert f'echo "{line}" >> /root/.bashrc' in runs, line


def test_every_rehearsed_recipe_has_a_stand_in_of_the_base_its_recipe_builds_on() -> None:
    """The rehearsal's stand-ins (tests/appliance/rehearsal.py STANDINS) are named for the base the recipe's lock
    builds on, and each reproduces that base (layout.yaml's image)."""
    from b70ctl.recipes import load_recipe
    from b70ctl.serve.rehearsal import load_overlay
    from rehearsal import STANDINS as REHEARSED

    assert set(REHEARSED) == set(load_overlay().recipes)
    for recipe, name in REHEARSED.items():
        layout = yaml.safe_load((REPO / "images" / "standins" / name / "layout.yaml").read_text())
        build = load_recipe(recipe).image.build
        assert build is not None and build.base == layout["image"], (recipe, json.dumps(layout["image"]))
