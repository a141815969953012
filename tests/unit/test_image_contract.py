"""The composition a host runs, end to end: the unit file `b70ctl serve units` writes, its ExecStart split as
systemd splits it, the `docker run` command line parsed by the real docker CLI (docker_rules.py), the image's
ENTRYPOINT and CMD as the recipe's own Dockerfile sets them, images/entrypoint.sh run for real in the layout of
the image's base, and real vLLM (the CPU build in this venv) parsing what reaches it.

The XPU images once exec'ed `--model` at every start: the unit's words after the image replaced the image's CMD,
and the entrypoint ran them as a command (bash: "exec: --: invalid option"). Every piece had its own test; none
composed them. Here every unit of every route is composed, the speculative server and its baseline.

The bases' layouts, from their Dockerfiles (the lines quoted as read):
- intel/llm-scaler vllm/docker/Dockerfile at 25095b41087c (the runtime stage of the 0.21 image, at the commit
  0.21.0-b3.1 was built from):
      FROM intel/pytorch:xpu-2.11.0-ubuntu24.04
      # The base already exports PATH=/opt/venv/bin:... and DEVICE=xpu.
      WORKDIR /llm-scaler/vllm
      COPY --from=builder /src/vllm ./vllm
      ln -s /opt/intel/oneapi/ccl/2021.15 /opt/intel/oneapi/ccl/latest
      ENTRYPOINT ["bash", "-c", "exec vllm serve \"$@\"", "--"]
  (no setvars.sh: its header says of the runtime stage "in /opt/venv.  No compiler.  Shipped.").
- vllm-project/vllm docker/Dockerfile.xpu at 05cb1bc2ae71 (the newest version stored; the v0.29.0 tag is not):
      RUN uv venv --python ${PYTHON_VERSION} --seed ${VIRTUAL_ENV}
      ENV PATH="$VIRTUAL_ENV/bin:$PATH"
      echo "source /opt/intel/oneapi/setvars.sh --force" >> /root/.bashrc
      WORKDIR /workspace/vllm
      COPY . .
      ENTRYPOINT ["vllm", "serve"]
- images/cpu/Dockerfile (the embedded default): /opt/vllm/bin first on PATH, no oneAPI.
Our images replace the bases' ENTRYPOINT with images/entrypoint.sh. The source trees stand in as a `vllm` package
that refuses to be imported: the server must run the installed vLLM whatever the WORKDIR holds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.recipes import load_recipe
from b70host.topology import TOPOLOGY_PATH, topology
from docker_rules import container_process, created_container, image_start
from sysfs_trees import build_tree
from systemd_words import systemd_split

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "images" / "entrypoint.sh"
IMAGE_ENTRYPOINT = "/usr/local/bin/b70-entrypoint"
SOURCE_TREE_REFUSAL = "the source tree in the image's WORKDIR was imported instead of the installed vLLM"


def route_a_base(root: Path) -> tuple[str, str]:
    """(bin directory first on PATH, WORKDIR) of llm-scaler's 0.21 runtime stage."""
    _oneccl(root)
    _source_tree(root / "llm-scaler/vllm/vllm")
    return "/opt/venv/bin", "/llm-scaler/vllm"


def route_b_base(root: Path) -> tuple[str, str]:
    """vLLM's Dockerfile.xpu: setvars.sh and oneCCL, vLLM's source tree as the WORKDIR."""
    _oneccl(root)
    (root / "opt/intel/oneapi/setvars.sh").write_text("export ONEAPI_ROOT=/opt/intel/oneapi\n")
    _source_tree(root / "workspace/vllm")
    return "/opt/venv/bin", "/workspace/vllm"


def cpu_base(root: Path) -> tuple[str, str]:
    root.mkdir(parents=True, exist_ok=True)
    return "/opt/vllm/bin", "/"


def _oneccl(root: Path) -> None:
    env = root / "opt/intel/oneapi/ccl/2021.15/env"
    env.mkdir(parents=True)
    (env / "vars.sh").write_text("export CCL_ROOT=/opt/intel/oneapi/ccl/2021.15\n")
    (root / "opt/intel/oneapi/ccl/latest").symlink_to("2021.15")


def _source_tree(checkout: Path) -> None:
    package = checkout / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise ImportError({SOURCE_TREE_REFUSAL!r})\n")


# recipe -> (its Dockerfile, the base layout, the emulated host's sysfs scenario or None for a CPU recipe)
ROUTES = {
    "pr620-fp8-tp2": ("images/xpu-dspark-0.21/Dockerfile", route_a_base, "b70x2-switch"),
    "dspark-int4-tp1": ("images/xpu-native/Dockerfile", route_b_base, "b70x2-switch"),
    "dspark-fp8-tp2": ("images/xpu-native/Dockerfile", route_b_base, "b70x2-switch"),
    "mtp3-int4-tp2": ("images/xpu-native/Dockerfile", route_b_base, "b70x2-switch"),
    "mtp8-fp8-tp2": ("images/xpu-native/Dockerfile", route_b_base, "b70x2-switch"),
    "mtp4-int4-tp1": ("images/xpu-native/Dockerfile", route_b_base, "b70x2-switch"),
    "cpu-tiny": ("images/cpu/Dockerfile", cpu_base, None),
}
MODELS_RECORD = {"target": {"path": "/var/lib/b70/models/{recipe}/target", "revision": "r1"},
                 "drafter": {"path": "/var/lib/b70/models/{recipe}/drafter", "revision": "r1"}}


def host_units(recipe: str, scenario: str | None, work: Path) -> list[dict[str, object]]:
    """`b70ctl serve units --json` as the vllm_serve role runs it, with its environment files (the docker CLI reads
    them) and the container record (a tune reads it) written where the document names them."""
    config = work / "etc-b70"
    config.mkdir()
    (config / "api-key.env").write_text("VLLM_API_KEY=not-a-real-key\n")
    record = json.loads(json.dumps(MODELS_RECORD).replace("{recipe}", recipe))
    arguments = ["serve", "units", "--json", "--recipe", recipe, "--image", "sha256:" + "a" * 64,
                 "--models-record", json.dumps(record), "--config-dir", str(config), "--user", "root",
                 "--baseline-unit", "b70-vllm-baseline", "--api-key-env-file", str(config / "api-key.env")]
    if scenario is not None:
        root = build_tree(work, scenario)
        topology(root, load_recipe(recipe).serve.tensor_parallel_size, probe="never", write=True)
        arguments += ["--topology", str(Path(root) / TOPOLOGY_PATH.lstrip("/"))]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    Path(document["container_path"]).write_text(document["container_json"])
    servers: list[dict[str, object]] = document["servers"]
    for server in servers:
        Path(str(server["env_file_path"])).write_text(str(server["env_file"]))
    return servers


def exec_start(unit_file: str) -> list[str]:
    lines = [line.removeprefix("ExecStart=") for line in unit_file.splitlines() if line.startswith("ExecStart=")]
    assert len(lines) == 1, lines
    return systemd_split(lines[0])


def run_in_base(process: list[str], env: list[str], layout, root: Path) -> tuple[int, str]:
    """The container's first process in the base's layout: images/entrypoint.sh for the image's entrypoint,
    `python3` on the base's PATH being this venv's interpreter (real vLLM), the working directory the base's
    WORKDIR, the environment the unit's --env-file gave the container."""
    bin_dir, workdir = layout(root)
    python3 = root / bin_dir.lstrip("/") / "python3"
    python3.parent.mkdir(parents=True, exist_ok=True)
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python3.chmod(0o755)
    assert process[0] == IMAGE_ENTRYPOINT, process
    container_env = dict(item.split("=", 1) for item in env)
    # Nothing the container's mounts would hold exists here: caches go to the scratch root, and the Hub is off.
    container_env = {name: (str(root / value.lstrip("/")) if value.startswith("/var/cache/") else value)
                     for name, value in container_env.items()}
    container_env.update({"PATH": f"{root}{bin_dir}:/usr/bin:/bin", "B70_ENTRYPOINT_ROOT": str(root),
                          "HOME": str(root / "root"), "HF_HUB_OFFLINE": "1"})
    result = subprocess.run(["bash", str(ENTRYPOINT), *process[1:]], cwd=root / workdir.lstrip("/"),
                            env=container_env, capture_output=True, text=True, timeout=300, check=False)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("recipe", list(ROUTES))
def test_every_unit_of_a_route_starts_vllm_through_the_image_entrypoint(recipe: str, tmp_path: Path) -> None:
    dockerfile, layout, scenario = ROUTES[recipe]
    servers = host_units(recipe, scenario, tmp_path)
    assert [server["unit"] for server in servers] == ["b70-vllm", "b70-vllm-baseline"]
    for server in servers:
        work = tmp_path / str(server["unit"])
        work.mkdir()
        argv = exec_start(str(server["unit_file"]))
        created = created_container(argv, work)
        process = container_process(REPO / dockerfile, created)
        # The words after the image are vLLM's options, whole: docker hands them to the entrypoint.
        assert process == [IMAGE_ENTRYPOINT, *created["Cmd"]] and created["Cmd"][0] == "--model"
        code, output = run_in_base(process, created["Env"], layout, work / "rootfs")
        assert "invalid option" not in output and SOURCE_TREE_REFUSAL not in output, output[-3000:]
        assert "unrecognized arguments" not in output, output[-3000:]
        # vLLM took every option and went on to load the model the unit names, which only the host's store holds:
        # huggingface_hub's refusal of a path it cannot find locally as a repo id.
        model = created["Cmd"][1]
        assert code != 0 and f"'{model}'" in output and "Repo id must be in the form" in output, output[-3000:]


def test_the_images_share_one_entrypoint_and_set_no_cmd() -> None:
    for dockerfile, _, _ in ROUTES.values():
        assert image_start(REPO / dockerfile) == ([IMAGE_ENTRYPOINT], None), dockerfile
        assert "COPY entrypoint.sh /usr/local/bin/b70-entrypoint" in (REPO / dockerfile).read_text()


def test_the_entrypoint_names_the_server_module_local_servers_run() -> None:
    from b70ctl.serve.render import ServeCommand

    module = ServeCommand(argv=[], env={}).local_argv("python")[2]
    assert f'server_module="{module}"' in ENTRYPOINT.read_text()


def test_a_command_after_the_image_runs_as_given(tmp_path: Path) -> None:
    """`docker run -it IMAGE bash` still opens a shell: only words starting with '-' are the server's."""
    code, output = run_in_base([IMAGE_ENTRYPOINT, "sh", "-c", 'echo "$CCL_ROOT|$ONEAPI_ROOT|$0"'], [],
                               route_b_base, tmp_path)
    assert (code, output.strip()) == (0, "/opt/intel/oneapi/ccl/2021.15|/opt/intel/oneapi|sh")


def test_no_arguments_is_refused_naming_what_to_pass(tmp_path: Path) -> None:
    code, output = run_in_base([IMAGE_ENTRYPOINT], [], cpu_base, tmp_path)
    assert code == 2 and "pass the server's options after the image" in output


def test_no_python_on_the_path_is_said(tmp_path: Path) -> None:
    cpu_base(tmp_path)
    result = subprocess.run(["/bin/bash", str(ENTRYPOINT), "--model", "/models/target"], env={
        "PATH": str(tmp_path), "B70_ENTRYPOINT_ROOT": str(tmp_path)}, capture_output=True, text=True, check=False)
    assert result.returncode == 127 and "no python3 on PATH" in result.stderr


@pytest.mark.parametrize("recipe", ["pr620-fp8-tp2", "dspark-int4-tp1"])
def test_a_tune_candidate_s_drop_in_starts_vllm_through_the_image_entrypoint(recipe: str, tmp_path: Path) -> None:
    """A tune serves each candidate through the unit with a drop-in whose ExecStart replaces the unit's (tune/unit.py):
    the same container record, the candidate's render. It composes the same way."""
    from b70ctl.host_documents import load_topology
    from b70ctl.serve.unit import ServingContainer
    from b70ctl.tune.model import Candidate
    from b70ctl.tune.serving import candidate_command
    from b70ctl.tune.unit import drop_in_text

    dockerfile, layout, scenario = ROUTES[recipe]
    host_units(recipe, scenario, tmp_path)
    container = ServingContainer.model_validate_json((tmp_path / "etc-b70/b70-vllm.container.json").read_text())
    document = load_topology(next(tmp_path.rglob("topology.json")))
    command = candidate_command(load_recipe(recipe), Candidate(overrides={"num_speculative_tokens": 3}),
                                container.context(speculative=True), document)
    env_file = tmp_path / "etc-b70/b70-vllm.tune.env"
    env_file.write_text("".join(f"{name}={value}\n" for name, value in sorted(command.env.items())))
    text = drop_in_text("k=3", container.exec_start(command, env_file=str(env_file)))
    starts = [line.removeprefix("ExecStart=") for line in text.splitlines() if line.startswith("ExecStart=")]
    assert starts[0] == "" and len(starts) == 2  # the empty one resets the unit's ExecStart
    created = created_container(systemd_split(starts[1]), tmp_path)
    process = container_process(REPO / dockerfile, created)
    assert json.loads(created["Cmd"][created["Cmd"].index("--speculative-config") + 1])["num_speculative_tokens"] == 3
    code, output = run_in_base(process, created["Env"], layout, tmp_path / "rootfs")
    assert "invalid option" not in output and "unrecognized arguments" not in output, output[-3000:]
    assert code != 0 and "Repo id must be in the form" in output, output[-3000:]
