"""images/entrypoint.sh, run for real (bash) against each XPU base's filesystem layout as its Dockerfile builds it.

The layouts are written from the bases' own Dockerfiles, quoted below (repo + path + commit):

intel/llm-scaler, vllm/docker/Dockerfile at 25095b41087caaeba31691287346532ea5019624 (the commit 0.21.0-b3.1 was
built from, after PR #600 "docker: remove invalid oneAPI setvars sourcing", c22f27a), the runtime stage of the 0.21
image route a builds on:
    # Stage 2: runtime -- lightweight serving image (no compiler, no /opt/intel/oneapi)
    mkdir -p /opt/intel/oneapi/ccl && \\
    cp -a /tmp/oneccl-runtime/_installdir/ccl/2021.15 /opt/intel/oneapi/ccl/ && \\
    echo "source /opt/intel/oneapi/ccl/2021.15/env/vars.sh --force" >> /root/.bashrc && \\
    ln -s /opt/intel/oneapi/ccl/2021.15 /opt/intel/oneapi/ccl/latest && \\

vllm-project/vllm, docker/Dockerfile.xpu at 05cb1bc2ae71c406574afe51f4cd91f2a33e2891 (the newest version stored; the
v0.29.0 tag route b pins is not in the stored history), vLLM's own XPU image:
    FROM intel/deep-learning-essentials:2025.3.2-0-devel-ubuntu24.04 AS vllm-base
    echo "source /opt/intel/oneapi/setvars.sh --force" >> /root/.bashrc && \\
    echo "source /opt/intel/oneapi/ccl/2021.15/env/vars.sh --force" >> /root/.bashrc
    ln -s /opt/intel/oneapi/ccl/2021.15 /opt/intel/oneapi/ccl/latest
Both put the environment in /root/.bashrc only, which `docker run` with an exec-form ENTRYPOINT never reads; a base
with no oneAPI files at all (vLLM's later XPU images) must start too.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "images" / "entrypoint.sh"
CCL = "opt/intel/oneapi/ccl"


def ccl_runtime(root: Path) -> Path:
    """oneCCL 2021.15 under /opt/intel/oneapi/ccl with ccl/latest pointing at it (both Dockerfiles above)."""
    env = root / CCL / "2021.15" / "env"
    env.mkdir(parents=True)
    # Like oneCCL's vars.sh: exports its root and library path; records the arguments it was sourced with.
    (env / "vars.sh").write_text('export CCL_ROOT=/opt/intel/oneapi/ccl/2021.15\n'
                                 'export LD_LIBRARY_PATH="$CCL_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\n'
                                 'export B70_TEST_CCL_ARGS="$*"\n')
    (root / CCL / "latest").symlink_to("2021.15")
    return env / "vars.sh"


def llm_scaler_runtime(root: Path) -> Path:
    """intel/llm-scaler's 0.21 runtime stage: oneCCL only, no setvars.sh."""
    ccl_runtime(root)
    return root


def vllm_xpu_on_deep_learning_essentials(root: Path) -> Path:
    """vLLM's Dockerfile.xpu on deep-learning-essentials: the oneAPI setvars.sh and oneCCL."""
    ccl_runtime(root)
    (root / "opt/intel/oneapi/setvars.sh").write_text('export ONEAPI_ROOT=/opt/intel/oneapi\n'
                                                     'export B70_TEST_SETVARS_ARGS="$*"\n')
    return root


def run(root: Path, *command: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "B70_ENTRYPOINT_ROOT": str(root)}
    return subprocess.run(["bash", str(ENTRYPOINT), *command], env=env, capture_output=True, text=True, check=False)


PRINT_ENV = ['sh', '-c', 'printf "%s|%s|%s|%s|%s|%s\\n" "$PPID" "${CCL_ROOT-unset}" "${ONEAPI_ROOT-unset}" '
             '"${B70_TEST_CCL_ARGS-unset}" "$1" "$2"', 'sh', 'two words', '--port=8000']


def test_llm_scaler_base_gets_oneccl_and_the_command_is_execed(tmp_path: Path) -> None:
    result = run(llm_scaler_runtime(tmp_path), *PRINT_ENV)
    assert result.returncode == 0, result.stderr
    ppid, ccl_root, oneapi_root, ccl_args, first, second = result.stdout.strip().split("|")
    # exec: the server's parent is whoever started the container's process (here this test), not a wrapper shell.
    assert int(ppid) == os.getpid()
    assert ccl_root == "/opt/intel/oneapi/ccl/2021.15" and ccl_args == "--force"
    assert oneapi_root == "unset"
    assert (first, second) == ("two words", "--port=8000")


def test_vllm_xpu_base_gets_setvars_and_oneccl(tmp_path: Path) -> None:
    result = run(vllm_xpu_on_deep_learning_essentials(tmp_path), "sh", "-c",
                 'echo "$ONEAPI_ROOT|$B70_TEST_SETVARS_ARGS|$CCL_ROOT|$LD_LIBRARY_PATH"')
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "/opt/intel/oneapi|--force|/opt/intel/oneapi/ccl/2021.15|" \
        "/opt/intel/oneapi/ccl/2021.15/lib"


def test_a_base_without_any_oneapi_file_starts(tmp_path: Path) -> None:
    result = run(tmp_path, *PRINT_ENV)
    assert result.returncode == 0, result.stderr
    ppid, ccl_root, oneapi_root, _, first, _ = result.stdout.strip().split("|")
    assert int(ppid) == os.getpid()
    assert (ccl_root, oneapi_root, first) == ("unset", "unset", "two words")
    assert result.stderr == ""


def test_the_server_exit_status_is_the_container_s(tmp_path: Path) -> None:
    assert run(llm_scaler_runtime(tmp_path), "sh", "-c", "exit 7").returncode == 7


def test_a_broken_environment_script_stops_the_start_naming_it(tmp_path: Path) -> None:
    vars_sh = ccl_runtime(tmp_path)
    vars_sh.write_text("return 3\n")
    result = run(tmp_path, "sh", "-c", "echo started")
    assert result.returncode == 1 and result.stdout == ""
    assert "ccl/latest/env/vars.sh failed" in result.stderr


def test_no_command_is_refused(tmp_path: Path) -> None:
    result = run(llm_scaler_runtime(tmp_path))
    assert result.returncode == 2 and "no arguments" in result.stderr


def test_the_images_default_root_is_slash() -> None:
    # B70_ENTRYPOINT_ROOT unset: the paths are the image's own.
    text = ENTRYPOINT.read_text()
    assert 'root="${B70_ENTRYPOINT_ROOT:-}"' in text
    assert '"${root}/opt/intel/oneapi/setvars.sh"' in text
    assert '"${root}/opt/intel/oneapi/ccl/latest/env/vars.sh"' in text
