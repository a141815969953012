"""Per-card VRAM budget and host RAM against the shipped recipes, on the sysfs scenarios."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.host.fit import host_fit
from b70ctl.host.memory import (
    RUNTIME_RESERVE_GIB,
    card_fit,
    kv_cache_gib,
    memtotal_gib_min,
    ram_fit,
)
from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import Recipe
from b70host.facts import collect_facts
from sysfs_trees import REPO, build_tree

RECIPE_DIR = REPO / "control" / "b70ctl" / "recipes" / "data"

GIB = 1024 ** 3


def with_changes(recipe: Recipe, *, tensor_parallel_size: int | None = None, target_weights_gib: float | None = None,
                 gpu_memory_utilization: float | None = None) -> Recipe:
    serve, target = recipe.serve, recipe.target
    if tensor_parallel_size is not None:
        serve = serve.model_copy(update={"tensor_parallel_size": tensor_parallel_size})
    if gpu_memory_utilization is not None:
        serve = serve.model_copy(update={"gpu_memory_utilization": gpu_memory_utilization})
    if target_weights_gib is not None:
        target = target.model_copy(update={"weights_gib": target_weights_gib})
    return recipe.model_copy(update={"serve": serve, "target": target})


def test_fp8_tp2_recipe_fits_two_b70() -> None:
    fit = card_fit(load_recipe("pr620-fp8-tp2"), 32.0, "sysfs")
    assert fit.fits
    assert fit.usable_vram_gib == pytest.approx(28.8)
    assert fit.target_weights_gib_per_gpu == pytest.approx(14.0)
    assert fit.drafter_weights_gib == pytest.approx(2.7)
    assert fit.kv_cache_gib_available == pytest.approx(28.8 - 14.0 - 2.7 - RUNTIME_RESERVE_GIB)


def test_fp8_target_does_not_fit_one_card_next_to_the_drafter() -> None:
    """docs/facts.md, route b: the FP8 target does not fit one 32 GB card next to the 2.7 GB drafter."""
    fit = card_fit(with_changes(load_recipe("pr620-fp8-tp2"), tensor_parallel_size=1), 32.0)
    assert not fit.fits
    assert fit.kv_cache_gib_available == pytest.approx(28.8 - 28.0 - 2.7 - RUNTIME_RESERVE_GIB)
    assert fit.reason.startswith("does not fit: 32.0 GiB x 0.90 = 28.8 GiB per card; target 28.0 GiB / TP 1")
    assert fit.reason.endswith("raise tensor_parallel_size, quantize the target, or raise gpu_memory_utilization")


def test_bf16_27b_does_not_fit_two_b70() -> None:
    """docs/facts.md, Known failures: 27B BF16 (about 54 GB of weights) does not fit 2x B70."""
    fit = card_fit(with_changes(load_recipe("pr620-fp8-tp2"), target_weights_gib=54.0), 32.0)
    assert not fit.fits
    assert fit.kv_cache_gib_available < 0


def test_int4_tp1_recipe_fits_one_b70_and_not_a_b50() -> None:
    recipe = load_recipe("dspark-int4-tp1")
    assert card_fit(recipe, 32.0).fits
    small = card_fit(recipe, 16.0, "model")
    assert not small.fits and small.vram_source == "model"


def test_recipe_vram_is_used_when_the_host_shows_none() -> None:
    fit = card_fit(load_recipe("pr620-fp8-tp2"), None)
    assert (fit.vram_gib_per_gpu, fit.vram_source) == (32.0, "recipe")


def test_kv_cache_budget_is_a_requirement() -> None:
    recipe = load_recipe("pr620-fp8-tp2")
    assert card_fit(recipe, 32.0, kv_cache_gib_required=11.0).fits
    assert not card_fit(recipe, 32.0, kv_cache_gib_required=11.2).fits
    # 8192 tokens x 32 attention layers x 2 (K, V) x 4 KV heads x 256 dims x 2 bytes = 1 GiB
    assert kv_cache_gib(8192, 32, 4, 256, 2) == pytest.approx(1.0)


def test_unset_utilization_takes_the_vllm_default() -> None:
    recipe = load_recipe("pr620-fp8-tp2")
    serve = recipe.serve.model_copy(update={"gpu_memory_utilization": None})
    fit = card_fit(recipe.model_copy(update={"serve": serve}), 32.0)
    assert fit.gpu_memory_utilization == 0.9


# MemTotal as hosts with 64, 32 and 128 GB installed show it (GB as sold = GiB of DIMMs): 64 GB -> ~62.6 GiB.
MEMTOTAL_64_GB_KIB = 65_657_044
MEMTOTAL_32_GB_KIB = 32_803_380
MEMTOTAL_128_GB_KIB = 131_842_412


def test_a_64_gb_host_meets_a_64_gb_minimum() -> None:
    fit = ram_fit(load_recipe("dspark-int4-tp1"), MEMTOTAL_64_GB_KIB * 1024)
    assert fit.ram_gb_min == 64
    assert fit.fits, fit.reason
    assert fit.ram_gib == pytest.approx(62.62, abs=0.01)
    # 64 GiB less the page array (1/64) and up to 5% firmware/kernel/crash-kernel reservation.
    assert fit.memtotal_gib_min == pytest.approx(64 * (1 - 1 / 64 - 0.05))
    assert fit.reason.startswith("host RAM: MemTotal 62.6 GiB >= 59.8 GiB, the least MemTotal of a host with 64 GB")


def test_a_32_gb_host_fails_a_64_gb_minimum_naming_the_units() -> None:
    fit = ram_fit(load_recipe("dspark-int4-tp1"), MEMTOTAL_32_GB_KIB * 1024)
    assert not fit.fits
    assert fit.reason.startswith("host RAM: MemTotal 31.3 GiB < 59.8 GiB, the least MemTotal of a host with 64 GB "
                                 "installed (RAM is sold in GB of 2^30 bytes")
    assert "recipe dspark-int4-tp1 needs 64 GB of RAM installed (estimate, not measured:" in fit.reason
    assert fit.reason.endswith("add RAM or choose a smaller recipe")


def test_the_fp8_tp2_minimum_and_its_source() -> None:
    """The minimum without the peer mirror rests on measurements (one card visible per worker), not an estimate;
    the mirror is host_fit's to add."""
    recipe = load_recipe("pr620-fp8-tp2")
    assert ram_fit(recipe, MEMTOTAL_64_GB_KIB * 1024).fits
    assert ram_fit(recipe, MEMTOTAL_128_GB_KIB * 1024).fits
    assert not ram_fit(recipe, None).fits
    source = recipe.host.ram_gb_min_source
    assert "measured" in source and "12.3 GiB" in source and "intel/compute-runtime #986" in source
    assert "not measured" not in source and "estimate" not in source


@pytest.mark.parametrize("name", ["cpu-tiny", "dspark-int4-tp1", "pr620-fp8-tp2"])
def test_every_shipped_minimum_names_its_source(name: str) -> None:
    source = load_recipe(name).host.ram_gb_min_source
    assert "docs/facts.md" in source or "intel/compute-runtime #" in source


def test_a_recipe_in_gib_of_memtotal_is_refused(tmp_path: Path) -> None:
    from b70ctl.errors import BadInput

    data = yaml.safe_load((RECIPE_DIR / "dspark-int4-tp1.yaml").read_text())
    data["host"]["ram_gib_min"] = data["host"].pop("ram_gb_min")
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(BadInput, match="ram_gb_min"):
        load_recipe(str(path))


# scenario -> recipe -> (fits, which parts fail)
HOST_FITS = {
    # 128 GB hosts (MemTotal 125.7 GiB): the image's compute-runtime 26.14 mirrors both cards' device memory in
    # host RAM at TP=2 (intel/llm-scaler #618: "intel/llm-scaler-vllm:0.21.0-b3.1 bundles compute-runtime
    # 26.14.37833.4"; 57.6 GiB here, 55 GiB measured for a 2-GPU server, intel/compute-runtime #968), beside the
    # 29.9 GiB a 32 GB host shows (measured: 12.3 GiB peak without the mirror): 87.5 GiB fit.
    ("b70x2-switch", "pr620-fp8-tp2"): (True, []),
    ("b70x2-root-ports", "pr620-fp8-tp2"): (True, []),
    ("b70-igpu", "pr620-fp8-tp2"): (False, ["gpus"]),  # one B70: nothing mirrored
    ("b70-igpu", "dspark-int4-tp1"): (True, []),  # 64 GB host (MemTotal 62.6 GiB) meets a 64 GB minimum
    ("b70x4-two-switches", "pr620-fp8-tp2"): (True, []),
    ("b60x2-switch", "pr620-fp8-tp2"): (False, ["gpus"]),  # the recipe accepts 8086:e223 only
    # Both under Ubuntu 24.04's GA kernel 6.8, older than the recipe's kernel_min 6.14.
    ("xe-unbound", "pr620-fp8-tp2"): (False, ["gpus", "kernel"]),
    ("no-intel-gpu", "pr620-fp8-tp2"): (False, ["gpus", "kernel"]),
    ("no-intel-gpu", "cpu-tiny"): (True, []),
}


@pytest.mark.parametrize("scenario, recipe_name", sorted(HOST_FITS))
def test_host_fit_per_scenario(tmp_path: Path, scenario: str, recipe_name: str) -> None:
    fits, failing = HOST_FITS[(scenario, recipe_name)]
    result = host_fit(load_recipe(recipe_name), collect_facts(build_tree(tmp_path, scenario)))
    assert result.fits is fits
    assert [name for name in ("gpus", "card", "ram", "firmware", "kernel")
            if (part := getattr(result, name)) is not None and not part.fits] == failing
    assert len(result.reasons) == len(failing)


def test_host_fit_reads_vram_from_sysfs(tmp_path: Path) -> None:
    result = host_fit(load_recipe("pr620-fp8-tp2"), collect_facts(build_tree(tmp_path, "b70x2-switch")))
    assert (result.card.vram_gib_per_gpu, result.card.vram_source) == (32.0, "sysfs")
    assert result.gpus.usable_gpu_count == 2


def test_gpu_shortage_names_what_the_host_has(tmp_path: Path) -> None:
    result = host_fit(load_recipe("pr620-fp8-tp2"), collect_facts(build_tree(tmp_path, "xe-unbound")))
    assert result.gpus.reason == (
        "recipe pr620-fp8-tp2 needs 2 GPU(s) of 8086:e223 bound to xe, host has 0 (B70 8086:e223 0000:05:00.0 "
        "driver none, B70 8086:e223 0000:09:00.0 driver none): fix the driver binding or choose a recipe for this "
        "hardware")


def test_cli_fit_exit_codes(tmp_path: Path) -> None:
    good = CliRunner().invoke(app, ["host", "fit", "--recipe", "pr620-fp8-tp2", "--root",
                                    build_tree(tmp_path, "b70x4-two-switches"), "--json"])
    assert good.exit_code == 0, good.output
    assert json.loads(good.stdout)["fits"] is True
    bad = CliRunner().invoke(app, ["host", "fit", "--recipe", "pr620-fp8-tp2", "--root",
                                   build_tree(tmp_path, "b70-igpu"), "--json"])
    assert bad.exit_code == 1
    assert json.loads(bad.stdout)["gpus"]["fits"] is False  # one B70: nothing mirrored, RAM is enough


def test_cli_fit_measures_the_store_it_is_given_and_says_when_it_did_not(tmp_path: Path) -> None:
    """On a host, as on the controller from preflight's facts: --free-space-of gives the disk verdict; without it
    the text says the disk was not measured rather than leave the line out."""
    tree, store = build_tree(tmp_path / "tree", "b70x4-two-switches"), tmp_path / "store" / "not-yet-made"
    measured = CliRunner().invoke(app, ["host", "fit", "--recipe", "pr620-fp8-tp2", "--root", tree,
                                        "--free-space-of", str(store), "--json"])
    assert measured.exit_code in (0, 1), measured.output
    disk = json.loads(measured.stdout)["disk"]
    assert "GiB free for the model store, recipe pr620-fp8-tp2 needs 80 GiB" in disk["reason"]
    unmeasured = CliRunner().invoke(app, ["host", "fit", "--recipe", "pr620-fp8-tp2", "--root", tree])
    assert unmeasured.exit_code == 0, unmeasured.output
    assert "- Disk: not measured (give --free-space-of the model store, or facts read with it)" in unmeasured.stdout
    facts = CliRunner().invoke(app, ["host", "facts", "--root", tree, "--free-space-of", str(store), "--json"])
    assert json.loads(facts.stdout)["free_space"]["measured_at"] == str(tmp_path)
    said = CliRunner().invoke(app, ["host", "facts", "--root", tree, "--free-space-of", str(store)]).stdout
    assert re.search(rf"model store {re.escape(str(store))}: \d+\.\d GiB free on the filesystem of "
                     rf"{re.escape(str(tmp_path))}\n", said), said


def test_cli_fit_refuses_to_measure_here_for_facts_read_elsewhere(tmp_path: Path) -> None:
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps(collect_facts(build_tree(tmp_path / "tree", "b70x2-switch"))))
    result = subprocess.run([str(Path(sys.executable).with_name("b70ctl")), "host", "fit", "--recipe",
                             "pr620-fp8-tp2", "--facts", str(facts), "--free-space-of", str(tmp_path)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --free-space-of measures this machine, --facts was read on another")
    assert result.stderr.count("\n") == 1 and result.stdout == ""


# intel/compute-runtime #953 (https://github.com/intel/compute-runtime/issues/953), as intel/llm-scaler #618
# (https://github.com/intel/llm-scaler/issues/618) sums it up: from "26.09+", "every large device allocation on one
# GPU gets an eagerly-pinned host-RAM mirror registered on the peer GPU's context"; the maintainer recommended
# "downgrading to compute-runtime 26.05" as "the safest option for production". docs/facts.md (Field reports):
# "~1 GiB of host RAM per GiB of device memory with ZE_AFFINITY_MASK=0,1, none with one GPU visible".
def test_the_peer_mirror_is_added_with_its_numbers_and_sources(tmp_path: Path) -> None:
    recipe = load_recipe("pr620-fp8-tp2")
    result = host_fit(recipe, collect_facts(build_tree(tmp_path, "b70x2-switch")))
    usable = result.card.usable_vram_gib
    assert result.ram.compute_runtime == "26.14.37833.4"
    assert result.ram.peer_mirror_gib == pytest.approx(2 * usable)
    assert result.ram.memtotal_gib_min == pytest.approx(memtotal_gib_min(recipe.host.ram_gb_min) + 2 * usable)
    reason = result.ram.reason
    assert f"plus {2 * usable:.1f} GiB that compute-runtime 26.14.37833.4 pins" in reason
    for source in ("intel/compute-runtime #986", "55 GiB for a 2-GPU inference server, #968", "#953",
                   "intel/torch-xpu-ops #5428", "intel/llm-scaler #618", "page cache is reclaimable and not counted"):
        assert source in reason
    assert result.ram.fits and "\n" not in reason  # a 128 GB host (MemTotal 125.7 GiB) holds 87.5 GiB
    # A 64 GB dual-B70 host does not: refused with the measured numbers and the ways out.
    refused = ram_fit(recipe, MEMTOTAL_64_GB_KIB * 1024, result.ram.peer_mirror_gib)
    assert not refused.fits and "run an image with compute-runtime 26.05" in refused.reason
    assert "55 GiB for a 2-GPU inference server" in refused.reason and "12.3 GiB" in refused.reason


def test_no_mirror_with_26_05_or_one_visible_gpu(tmp_path: Path) -> None:
    recipe = load_recipe("pr620-fp8-tp2")
    facts = collect_facts(build_tree(tmp_path, "b70x2-switch"))
    variant = recipe.image.variants[0]
    assert (variant.name, variant.compute_runtime, variant.buildable) == ("umd-26.05", "26.05", False)
    on_26_05 = recipe.model_copy(update={"image": recipe.image.model_copy(update={"compute_runtime": "26.05"})})
    result = host_fit(on_26_05, facts)
    assert result.ram.peer_mirror_gib == 0.0 and result.fits
    one_gpu = load_recipe("dspark-int4-tp1")  # TP=1: one GPU visible to the server
    assert host_fit(one_gpu, facts).ram.peer_mirror_gib == 0.0


def own_cards(recipe: Recipe) -> Recipe:
    return recipe.model_validate({**recipe.model_dump(), "serve": {**recipe.serve.model_dump(),
                                                                    "worker_card_visibility": "own"}})


def test_one_card_per_worker_pins_no_mirror_and_a_64_gb_host_fits(tmp_path: Path) -> None:
    """The option the refusal offers: with each worker seeing its own card (route a's patch 0006) the mirror is
    none, "none with one GPU visible" (docs/facts.md, Field reports), so the host needs what it needs without it."""
    facts = collect_facts(build_tree(tmp_path, "b70x2-switch"))
    shared = host_fit(load_recipe("pr620-fp8-tp2"), facts)
    own = host_fit(own_cards(load_recipe("pr620-fp8-tp2")), facts)
    assert shared.ram.peer_mirror_gib > 50 and own.ram.peer_mirror_gib == 0.0
    assert "each worker sees its own card only, serve.worker_card_visibility: own" in own.ram.reason
    refused = ram_fit(load_recipe("pr620-fp8-tp2"), MEMTOTAL_64_GB_KIB * 1024, shared.ram.peer_mirror_gib)
    assert "give each worker its own card (serve.worker_card_visibility: own, route a)" in refused.reason
    fits = ram_fit(own_cards(load_recipe("pr620-fp8-tp2")), MEMTOTAL_64_GB_KIB * 1024, own.ram.peer_mirror_gib)
    assert fits.fits and fits.memtotal_gib_min == pytest.approx(memtotal_gib_min(32))


def test_one_card_per_worker_is_refused_where_no_image_carries_the_patch() -> None:
    for name in ("dspark-int4-tp1", "cpu-tiny"):
        with pytest.raises(ValueError, match="worker_card_visibility 'own' needs route a's image"):
            own_cards(load_recipe(name))
