"""`b70ctl model convert`: make a SpecForge-trained DSpark drafter servable by native vLLM (route b).

What vLLM does with a Qwen3 DSpark drafter (read in vLLM 0.32.0: model_executor/models/qwen3_dspark.py,
qwen3_dflash.py, config/speculative.py, v1/worker/gpu/spec_decode/utils.py and eagle/eagle3_utils.py):

- architecture: the registry maps "Qwen3DSparkModel" to Qwen3DSparkForCausalLM (from 0.25.0) and
  "DSparkDraftModel" to the DeepSeek-V4 DSpark class. 0.25-0.28 load a DSparkDraftModel drafter as DeepSeek-V4
  and fail (AttributeError 'hc_mult'); from 0.29 SpeculativeConfig renames it itself, but only when
  model_type is "qwen3" and method is dspark. We write "Qwen3DSparkModel" for every version >= 0.25: it is the
  registry name in all of them, it does not depend on that late rename, and one converted directory then
  serves on any native version. Below 0.25 there is no native DSpark: route a (0.21 + patch set) serves the
  SpecForge drafter unconverted, so converting for it is refused.
- Qwen3DSparkModel reads markov_rank (no fallback: AttributeError if absent), enable_confidence_head and
  confidence_head_with_markov (default false: silently dropped if nested) from the TOP LEVEL only. SpecForge
  nests them in dflash_config or dspark_config: they are hoisted. vLLM never reads dspark_config at all, so
  everything it needs from there (target_layer_ids, mask_token_id, block_size, use_aux_hidden_state) is hoisted
  too. dflash_config's target_layer_ids / mask_token_id stay where they are: vLLM reads them there first.
- validated (each failure names the field): model_type, the Qwen3 decoder fields the draft layers are built
  from, target_layer_ids (non-empty, unique, increasing, inside the target's layers), mask_token_id (inside the
  vocabulary), block_size, markov_rank, the confidence flags, vocab_size equal to the target's, draft_vocab_size,
  and the hidden size the drafter reads from the target.
- the target's sizes (vocab_size, num_hidden_layers, hidden_size) are read from its text config, as vLLM does
  (transformers_utils/config.py get_hf_text_config -> PreTrainedConfig.get_text_config): a composite config such
  as Qwen3.5's (Qwen3_5ForConditionalGeneration) keeps them under text_config, a plain Qwen3 config at the top.

Weights are hard links to the source (same bytes, O(1) whatever the model's size, never a copy); config.json is
rewritten and b70ctl-provenance.json records the source revision, every file's sha256 and each change made.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from b70ctl.errors import BadInput
from b70ctl.files import MAX_DOCUMENT_BYTES, read_document_text, read_json_object, read_own_json_object
from b70ctl.lock.resolve import sha256_file
from b70ctl.recipes.model import IntRange, Recipe
from b70ctl.versions import parse, version_at_least

CONVERTER_VERSION = 1
PROVENANCE_FILE = "b70ctl-provenance.json"
NATIVE_ARCHITECTURE = "Qwen3DSparkModel"
KNOWN_ARCHITECTURES = ("DSparkDraftModel", "Qwen3DSparkModel")
NESTED_SECTIONS = ("dflash_config", "dspark_config")
# Read by Qwen3DSparkModel / SpeculativeConfig from the top level only.
TOP_LEVEL_ONLY = ("markov_rank", "enable_confidence_head", "confidence_head_with_markov", "block_size")
# Read from dflash_config first, then the top level; never from dspark_config.
DFLASH_OR_TOP = ("target_layer_ids", "mask_token_id", "use_aux_hidden_state")
QWEN3_DECODER_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                      "intermediate_size", "max_position_embeddings", "vocab_size")


def _read_config(directory: Path, what: str) -> dict[str, Any]:
    path = directory / "config.json"
    return read_json_object(path, f"{what} {path}", "restore the model's config.json",
                            missing=f"{what} {directory} has no config.json: point at a model directory")


def _written_text(path: Path) -> str | None:
    """The text of a file this converter wrote, or None when it cannot be read as one (read_own_json_object)."""
    try:
        return read_document_text(path, MAX_DOCUMENT_BYTES, str(path), "")
    except BadInput:
        return None


def _fail(field: str, problem: str) -> BadInput:
    return BadInput(f"drafter config.json {field}: {problem}")


def converted_config(source: dict[str, Any], vllm_version: str) -> tuple[dict[str, Any], list[str]]:
    """Pure: the config vLLM `vllm_version` needs, and the list of changes made to get there."""
    try:
        parse(vllm_version)
    except ValueError as error:
        raise BadInput(f"--vllm-version {vllm_version!r} is not a version (e.g. 0.29.0)") from error
    if not version_at_least(vllm_version, "0.25.0"):
        raise BadInput(f"vLLM {vllm_version} has no native DSpark (needs >= 0.25.0): route a serves the "
                       "SpecForge drafter unconverted through its patch set; do not convert for it")
    config = json.loads(json.dumps(source))  # deep copy, JSON types only
    changes: list[str] = []
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise _fail("architectures", f"expected one architecture, found {architectures!r}")
    if architectures[0] not in KNOWN_ARCHITECTURES:
        raise _fail("architectures", f"unknown architecture {architectures[0]!r}: expected one of "
                                     f"{', '.join(KNOWN_ARCHITECTURES)} (a Qwen3 DSpark drafter)")
    if config.get("model_type") != "qwen3":
        raise _fail("model_type", f"{config.get('model_type')!r}: Qwen3DSparkForCausalLM is a qwen3 drafter")
    if architectures[0] != NATIVE_ARCHITECTURE:
        config["architectures"] = [NATIVE_ARCHITECTURE]
        changes.append(f"architectures: {architectures[0]} -> {NATIVE_ARCHITECTURE} (vLLM {vllm_version} maps "
                       f"{architectures[0]} to the DeepSeek-V4 DSpark class)")

    for section in NESTED_SECTIONS:
        nested = config.get(section)
        if nested is None:
            continue
        if not isinstance(nested, dict):
            raise _fail(section, "expected an object")
        hoist = TOP_LEVEL_ONLY + (DFLASH_OR_TOP if section == "dspark_config" else ())
        for name in hoist:
            if name not in nested:
                continue
            value = nested.pop(name)
            if name in config and config[name] != value:
                raise _fail(name, f"top level says {config[name]!r} but {section}.{name} says {value!r}: "
                                  "fix the drafter's config so they agree")
            config[name] = value
            changes.append(f"{section}.{name} -> {name} (vLLM reads it from the top level only)")
        if not nested:
            del config[section]
            changes.append(f"removed the empty {section}")
    return config, changes


def _layer_ids(config: dict[str, Any]) -> Any:
    dflash = config.get("dflash_config") or {}
    return dflash.get("target_layer_ids", config.get("target_layer_ids"))


# PreTrainedConfig.get_text_config() (transformers 5.x) looks for these sub-configs, in this order, when neither
# encoder nor decoder is asked for, which is how vLLM's get_hf_text_config calls it.
TEXT_CONFIG_NAMES = ("text_encoder", "decoder", "generator", "text_config")


def target_text_config(target: dict[str, Any]) -> dict[str, Any]:
    """The part of a target's config.json that holds its language model's sizes, chosen as transformers'
    get_text_config() and vLLM's get_hf_text_config() choose it: the one sub-config named in TEXT_CONFIG_NAMES
    that is set, else the config itself; two set is ambiguous; a sub-config without num_attention_heads is refused
    (vLLM refuses it too)."""
    found = [name for name in TEXT_CONFIG_NAMES if target.get(name) is not None]
    if len(found) > 1:
        raise BadInput(f"target config.json: several text configs ({', '.join(found)}): vLLM cannot tell which one "
                       "is the language model")
    if not found:
        return target
    text_config = target[found[0]]
    if not isinstance(text_config, dict):
        raise BadInput(f"target config.json {found[0]}: expected an object, found {text_config!r}")
    if "num_attention_heads" not in text_config:
        raise BadInput(f"target config.json {found[0]}: no num_attention_heads, so vLLM would refuse it as the "
                       "text config")
    return text_config


def validate_drafter(config: dict[str, Any], target: dict[str, Any]) -> None:
    """Every field vLLM reads from a converted drafter, against the target it will draft for (its text config)."""
    for name in QWEN3_DECODER_INTS:
        value = config.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise _fail(name, f"missing or not a positive integer ({value!r})")
    if "rms_norm_eps" not in config or "hidden_act" not in config:
        raise _fail("rms_norm_eps" if "rms_norm_eps" not in config else "hidden_act", "missing")
    for name in ("markov_rank", "block_size"):
        value = config.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise _fail(name, f"missing or not a positive integer ({value!r}): vLLM reads it top-level")
    for name in ("enable_confidence_head", "confidence_head_with_markov"):
        if name in config and not isinstance(config[name], bool):
            raise _fail(name, f"expected true or false, found {config[name]!r}")

    text = target_text_config(target)
    where = "" if text is target else next(f" {name}" for name in TEXT_CONFIG_NAMES if target.get(name) is text)
    target_vocab = text.get("vocab_size")
    target_layers = text.get("num_hidden_layers")
    target_hidden = text.get("hidden_size")
    if not all(isinstance(value, int) and not isinstance(value, bool)
               for value in (target_vocab, target_layers, target_hidden)) or not isinstance(target_layers, int):
        raise BadInput(f"target config.json{where}: vocab_size, num_hidden_layers and hidden_size are needed to "
                       "check the drafter against it")
    if config["vocab_size"] != target_vocab:
        raise _fail("vocab_size", f"{config['vocab_size']} does not match the target's vocab_size {target_vocab}: "
                                  "this drafter was trained for another model")
    draft_vocab = config.get("draft_vocab_size")
    if draft_vocab is not None and (not isinstance(draft_vocab, int) or not 0 < draft_vocab <= config["vocab_size"]):
        raise _fail("draft_vocab_size", f"{draft_vocab!r} must be a positive integer <= vocab_size")
    reads_hidden = config.get("target_hidden_size") or config["hidden_size"]
    if reads_hidden != target_hidden:
        raise _fail("target_hidden_size" if config.get("target_hidden_size") else "hidden_size",
                    f"the drafter reads target hidden states of size {reads_hidden}, the target's hidden_size is "
                    f"{target_hidden}: this drafter was trained for another model")

    layer_ids = _layer_ids(config)
    if layer_ids is None:
        raise _fail("target_layer_ids", "missing (top level or dflash_config): the drafter cannot know which "
                                        "target layers to read")
    if (not isinstance(layer_ids, list) or not layer_ids
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids)):
        raise _fail("target_layer_ids", f"expected a non-empty list of integers, found {layer_ids!r}")
    if layer_ids != sorted(set(layer_ids)):
        raise _fail("target_layer_ids", f"{layer_ids} must be unique and increasing")
    if layer_ids[0] < 0 or layer_ids[-1] >= target_layers:
        raise _fail("target_layer_ids", f"{layer_ids} reach outside the target's {target_layers} layers "
                                        f"(0..{target_layers - 1})")

    dflash = config.get("dflash_config") or {}
    mask = dflash.get("mask_token_id", config.get("mask_token_id", config.get("dspark_noise_token_id")))
    if mask is None:
        raise _fail("mask_token_id", "missing (dflash_config or top level): parallel drafting needs it")
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < config["vocab_size"]:
        raise _fail("mask_token_id", f"{mask!r} is outside the vocabulary (0..{config['vocab_size'] - 1})")


# --- the directory-level conversion --------------------------------------------------------------------------


def _source_files(src: Path) -> list[str]:
    return sorted(p.relative_to(src).as_posix() for p in src.rglob("*")
                  if p.is_file() and p.name != PROVENANCE_FILE and ".cache" not in p.relative_to(src).parts
                  and ".b70ctl" not in p.relative_to(src).parts)


def _fetch_verified(src: Path) -> dict[str, Any]:
    """What `model fetch` recorded when it verified SRC (DEST/.b70ctl/verified-ROLE.json), if SRC is its output."""
    marker = src.parent / ".b70ctl" / f"verified-{src.name}.json"
    data = read_own_json_object(marker)
    files = data.get("files") if data is not None else None
    return files if isinstance(files, dict) else {}


def _provenance(src: Path, vllm_version: str, source_revision: str | None, changes: list[str],
                config_text: str) -> dict[str, Any]:
    """Every source file's sha256. A file fetch verified and nobody touched since (same size, mtime, inode) takes
    the hash fetch checked against the lock: converting a fetched drafter reads none of its weights."""
    verified = _fetch_verified(src)
    files = {}
    for relative in _source_files(src):
        stat = (src / relative).stat()
        recorded = verified.get(relative) or {}
        if (recorded.get("size_bytes"), recorded.get("mtime_ns"), recorded.get("inode")) == (
                stat.st_size, stat.st_mtime_ns, stat.st_ino) and recorded.get("sha256"):
            files[relative] = {"sha256": recorded["sha256"], "size_bytes": stat.st_size,
                               "hashed_by": "model fetch (verified against the lock)"}
        else:
            files[relative] = {"sha256": sha256_file(src / relative), "size_bytes": stat.st_size,
                               "hashed_by": "model convert"}
    return {
        "converter_version": CONVERTER_VERSION,
        "vllm_version": vllm_version,
        "source": str(src.resolve()),
        "source_revision": source_revision,
        "source_files": files,
        "config_sha256": _text_sha256(config_text),
        "changes": changes,
    }


def _text_sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def _up_to_date(dst: Path, src: Path, vllm_version: str, config_text: str) -> bool:
    """Re-running is a no-op when DST was made by this converter for this version from these very files: the
    weights are still the same inodes as the source's, and config.json is what we would write now."""
    marker = dst / PROVENANCE_FILE
    if not marker.is_file() or not (dst / "config.json").is_file():
        return False
    recorded = read_own_json_object(marker)
    if recorded is None:
        return False
    if (recorded.get("converter_version") != CONVERTER_VERSION or recorded.get("vllm_version") != vllm_version
            or recorded.get("config_sha256") != _text_sha256(config_text)
            or _written_text(dst / "config.json") != config_text):
        return False
    files = _source_files(src)
    if sorted(recorded.get("source_files", {})) != files:
        return False
    for relative in files:
        if relative == "config.json":
            # Small: hash it, so the provenance never records a source config that is no longer there.
            if recorded["source_files"][relative].get("sha256") != sha256_file(src / relative):
                return False
            continue
        if not (dst / relative).is_file() or not os.path.samefile(src / relative, dst / relative):
            return False
    return True


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _check_destination(src: Path, dst: Path) -> None:
    """DST is new, empty, or an earlier conversion of this very source: anything else holds someone's data, and a
    conversion replaces its destination whole."""
    if dst.is_symlink():
        raise BadInput(f"DST {dst} is a symbolic link: give the real directory to write, nothing was touched")
    real_src, real_dst = src.resolve(), dst.resolve()
    if real_dst == real_src:
        raise BadInput("DST must differ from SRC: the source stays as downloaded (its hashes are locked)")
    if real_dst.is_relative_to(real_src):
        raise BadInput(f"DST {dst} is inside the source {src}: put it beside the source (e.g. {src}-vllm)")
    if real_src.is_relative_to(real_dst):
        raise BadInput(f"DST {dst} holds the source {src}: put it beside the source (e.g. {src}-vllm)")
    existing = next(path for path in (dst, *dst.parents) if path.exists())
    if not existing.is_dir():
        raise BadInput(f"{existing} is a file, not a directory: choose another DST, nothing was touched")
    if existing != dst or not any(dst.iterdir()):
        return
    recorded = read_own_json_object(dst / PROVENANCE_FILE)
    if recorded is None:
        raise BadInput(f"DST {dst} exists and is not a conversion of {src} (no readable {PROVENANCE_FILE}): "
                       "choose an empty or new directory; nothing was touched")
    if recorded.get("source") != str(real_src):
        raise BadInput(f"DST {dst} is a conversion of another source ({recorded.get('source')}): choose another "
                       "directory or remove it yourself; nothing was touched")


def check_against_recipe(config: dict[str, Any], recipe: Recipe) -> None:
    """The converted drafter against the recipe that serves it: k above the drafter's block size collapses
    acceptance (k=7 on a block-5 drafter: 4.4%, vllm PR #41834), so neither the recipe's k nor any k its tune
    tries may exceed it, and the block size the recipe declares must be this drafter's."""
    block = config["block_size"]
    declared = recipe.drafter.block_size if recipe.drafter is not None else None
    if declared is not None and declared != block:
        raise _fail("block_size", f"{block}, recipe {recipe.name} declares drafter.block_size {declared}: this is "
                                  "not the drafter the recipe was written for; fetch the recipe's drafter or fix "
                                  "drafter.block_size")
    spec = recipe.serve.speculative
    tried = [spec.num_speculative_tokens] if spec is not None else []
    if recipe.tune is not None and recipe.tune.num_speculative_tokens is not None:
        tuned = recipe.tune.num_speculative_tokens
        tried += tuned.values() if isinstance(tuned, IntRange) else list(tuned)
    if tried and max(tried) > block:
        raise _fail("block_size", f"{block}, recipe {recipe.name} serves or tunes num_speculative_tokens up to "
                                  f"{max(tried)}: acceptance collapses past the block (vllm PR #41834); lower "
                                  f"num_speculative_tokens (and tune's range) to <= {block}")


def convert(src: Path, dst: Path, vllm_version: str, target_dir: Path,
            source_revision: str | None = None, recipe: Recipe | None = None) -> dict[str, Any]:
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise BadInput(f"source {src} is not a directory")
    _check_destination(src, dst)
    if not any(name.endswith(WEIGHT_SUFFIXES) for name in _source_files(src)):
        raise BadInput(f"drafter {src} has no weights (*.safetensors): fetch the complete drafter first")
    config, changes = converted_config(_read_config(src, "drafter"), vllm_version)
    validate_drafter(config, _read_config(target_dir, "target"))
    if recipe is not None:
        check_against_recipe(config, recipe)
    config_text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    if _up_to_date(dst, src, vllm_version, config_text):
        return {"changed": False, "dst": str(dst), "vllm_version": vllm_version, "changes": changes}

    provenance = _provenance(src, vllm_version, source_revision, changes, config_text)
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=dst.name + ".", suffix=".partial", dir=dst.parent))
    try:
        for relative in _source_files(src):
            if relative == "config.json":
                continue
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src / relative, staging / relative)
            except OSError as error:
                if error.errno == errno.EXDEV:
                    raise BadInput(f"{dst} is on another filesystem than {src}: hard links (never copies) need "
                                   "one filesystem; put DST beside SRC") from error
                raise
        (staging / "config.json").write_text(config_text)
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
        if dst.exists():
            # Swap: the old conversion is only links and small files, removing it frees nothing of the source.
            retired = dst.with_name(dst.name + ".retired")
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(dst, retired)
            os.replace(staging, dst)
            shutil.rmtree(retired)
        else:
            os.replace(staging, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"changed": True, "dst": str(dst), "vllm_version": vllm_version, "changes": changes}
