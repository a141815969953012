"""The compute-runtime image variant (mtp3-int4-tp2's runtime-26.35): images/xpu-native installs exactly the release
assets the record's image installed, checked against the same sha256, and `b70ctl image build --variant` selects it.

The assets and sums are read from the record's Dockerfile as posted (tests/fixtures/published/, sources.yaml names
its URL) and from images/xpu-native/Dockerfile, and compared: neither list is written out here. The image itself
is not built by these tests (it downloads from GitHub's release pages); its install step runs under sh with a
stand-in curl and dpkg, to show that an asset whose sum differs stops the build before dpkg.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from b70ctl.errors import BadInput
from b70ctl.image.build import COMPUTE_RUNTIME_ARG, LABEL_COMPUTE_RUNTIME, plan_build, variant_runtime
from b70ctl.recipes import load_recipe
from image_fixtures import DIGEST, resolved_lock

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "tests" / "fixtures" / "published"
RECORD_DOCKERFILE = "bklinkradt-qwen-vllm-runtime-26.35-Dockerfile-297b312"
RECORD_URL = ("https://github.com/bklinkradt/arc-b70-llm-stack/blob/297b312cc9c028c0c270ad4af7a0ec310e9dffea/"
              "qwen-vllm/runtime-26.35/Dockerfile")
NATIVE = REPO / "images" / "xpu-native" / "Dockerfile"
RECIPE = "mtp3-int4-tp2"
VARIANT = "runtime-26.35"
RELEASES = {"https://github.com/intel/compute-runtime/releases/download/26.35.39758.10",
            "https://github.com/intel/intel-graphics-compiler/releases/download/v2.41.5"}
SUM_LINE = re.compile(r"(?<![0-9a-f])([0-9a-f]{64})\s+(\S+\.deb)(?!\S)")


def sums(text: str) -> dict[str, str]:
    """asset name -> sha256, from the `printf '%s  %s\\n' SHA NAME ...` lines of a Dockerfile."""
    found = SUM_LINE.findall(text)
    assert len({name for _, name in found}) == len(found)
    return {name: sha for sha, name in found}


def record_urls(text: str) -> set[str]:
    """The record's download URLs, its `$NEO/...` and `$IGC/...` expanded from its ARG lines."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    return {f"{args[arg]}/{name}" for arg, name in re.findall(r"curl -sfLO \$(\w+)/(\S+\.deb)", text)}


def native_step() -> str:
    """The RUN step of images/xpu-native that installs a variant's compute runtime."""
    steps = [item["value"] for item in DockerfileParser(path=str(NATIVE)).structure
             if item["instruction"] == "RUN" and COMPUTE_RUNTIME_ARG in item["value"]]
    assert len(steps) == 1
    return steps[0]


def native_urls(step: str) -> set[str]:
    return set(re.findall(r"https://\S+\.deb", step))


def test_the_record_dockerfile_is_kept_under_its_url() -> None:
    index = yaml.safe_load((PUBLISHED / "sources.yaml").read_text())
    assert {"url": RECORD_URL, "files": [RECORD_DOCKERFILE]} in index["documents"]


def test_the_variant_installs_exactly_the_record_assets_with_its_sums() -> None:
    record = (PUBLISHED / RECORD_DOCKERFILE).read_text()
    step = native_step()
    assert len(sums(record)) == 5
    assert sums(step) == sums(record)
    assert native_urls(step) == record_urls(record)
    # Every asset is downloaded and checked, each from its GitHub release.
    assert {url.rsplit("/", 1)[1] for url in native_urls(step)} == set(sums(step))
    assert {url.rsplit("/", 1)[0] for url in native_urls(step)} == RELEASES
    # Checked before it is installed, and installed with dpkg over the base.
    assert step.index("sha256sum -c -") < step.index("dpkg -i")


def test_the_recipe_variant_is_buildable_and_the_dockerfile_installs_its_runtime() -> None:
    (variant,) = load_recipe(RECIPE).image.variants
    assert (variant.name, variant.buildable, variant.not_buildable_reason) == (VARIANT, True, None)
    step = native_step()
    assert f"{variant.compute_runtime})" in step
    # The runtime the assets carry is the variant's.
    assert all(variant.compute_runtime in name for name in sums(step) if not name.startswith("intel-igc-"))
    assert variant_runtime(load_recipe(RECIPE), VARIANT, NATIVE) == variant.compute_runtime


def test_build_selects_the_variant_by_its_build_argument_and_tag() -> None:
    recipe = load_recipe(RECIPE)
    stock = plan_build(recipe, resolved_lock(RECIPE), REPO)
    assert COMPUTE_RUNTIME_ARG not in stock.build_args()
    assert LABEL_COMPUTE_RUNTIME not in stock.expected_labels()
    assert stock.image_tag == "localhost/b70/vllm-xpu-native:0.30.0"
    plan = plan_build(recipe, resolved_lock(RECIPE), REPO, variant=VARIANT)
    assert plan.build_args()[COMPUTE_RUNTIME_ARG] == "26.35.39758.10"
    assert plan.expected_labels()[LABEL_COMPUTE_RUNTIME] == "26.35.39758.10"
    assert plan.image_tag == f"localhost/b70/vllm-xpu-native:0.30.0-{VARIANT}"
    assert plan.base_image == f"vllm/vllm-openai-xpu@{DIGEST}"
    assert plan.context_paths() == stock.context_paths()


def test_a_variant_that_cannot_be_built_is_refused() -> None:
    with pytest.raises(BadInput, match=r"has no image variant 'runtime-9.99'"):
        plan_build(load_recipe(RECIPE), resolved_lock(RECIPE), REPO, variant="runtime-9.99")
    # llm-scaler's older runtime: the recipe says why not.
    (older,) = load_recipe("pr620-fp8-tp2").image.variants
    assert not older.buildable
    with pytest.raises(BadInput, match=f"image variant '{older.name}' of recipe pr620-fp8-tp2 cannot be built"):
        plan_build(load_recipe("pr620-fp8-tp2"), resolved_lock("pr620-fp8-tp2"), REPO, variant=older.name)


def test_a_dockerfile_without_the_runtime_is_refused(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nRUN true\n")
    with pytest.raises(BadInput, match=r"installs no compute runtime 26.35.39758.10"):
        variant_runtime(load_recipe(RECIPE), VARIANT, dockerfile)
    # Declared, but no packages pinned for this runtime.
    dockerfile.write_text("ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nARG COMPUTE_RUNTIME=\nRUN case x in 26.27) ;; esac\n")
    with pytest.raises(BadInput, match="installs no compute runtime"):
        variant_runtime(load_recipe(RECIPE), VARIANT, dockerfile)


def run_step(tmp_path: Path, runtime: str, stand_in_curl: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The install step under sh, in tmp_path instead of /tmp/neo, with stand-ins for curl and dpkg."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "curl").write_text(f"#!/bin/sh\n{stand_in_curl}\n")
    dpkg_log = tmp_path / "dpkg.log"
    (bin_dir / "dpkg").write_text(f'#!/bin/sh\necho "$@" >> {dpkg_log}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    script = native_step().replace("/tmp/neo", str(tmp_path / "neo")).replace("/opt/b70", str(tmp_path / "b70"))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", COMPUTE_RUNTIME_ARG: runtime}
    return subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=False), dpkg_log


def test_the_step_keeps_the_base_runtime_without_a_variant(tmp_path: Path) -> None:
    result, dpkg_log = run_step(tmp_path, "", "exit 1")
    assert result.returncode == 0 and not dpkg_log.exists() and not (tmp_path / "neo").exists()


def test_the_step_refuses_a_runtime_it_pins_no_packages_for(tmp_path: Path) -> None:
    result, dpkg_log = run_step(tmp_path, "26.27.39122.11", "exit 1")
    assert result.returncode == 1 and "no release assets pinned" in result.stderr and not dpkg_log.exists()


def test_an_asset_whose_sum_differs_stops_the_step_before_dpkg(tmp_path: Path) -> None:
    # Every download "succeeds" with content that is not the release's.
    result, dpkg_log = run_step(tmp_path, "26.35.39758.10", 'for a; do :; done; echo not-the-asset > "${a##*/}"')
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr
    assert not dpkg_log.exists()
