"""Helpers for the patch-series tests: load pieces of the patched vLLM 0.21.0 tree next to the installed vLLM
0.32.0 (the real native DSpark implementation), and generate a tiny SpecForge-layout DSpark drafter."""

from __future__ import annotations

import ast
import importlib.util
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 the name torch's own code uses
from torch import nn

from vllm_import import builtin_sys_intern

PATCHED_MODEL_FILE = "vllm/model_executor/models/qwen3_dflash.py"
PATCHED_PROPOSER_FILE = "vllm/v1/spec_decode/dflash.py"
HEAD_CLASSES = ("VanillaMarkov", "AcceptRatePredictor")


def extract_definitions(source_file: Path, names: tuple[str, ...], namespace: dict[str, Any]) -> dict[str, Any]:
    """Execute only the named top-level classes, functions and constants of a source file in `namespace`.

    This is how the ported heads are imported in isolation: the shipped (patched) file is the source, but none of
    its vLLM 0.21 imports run, so the heads must stand on torch alone."""
    tree = ast.parse(source_file.read_text(), filename=str(source_file))

    def defined(node: ast.stmt) -> set[str]:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            return {node.name}
        if isinstance(node, ast.Assign):
            return {target.id for target in node.targets if isinstance(target, ast.Name)}
        return set()

    wanted = [node for node in tree.body if defined(node) & set(names)]
    missing = set(names) - set().union(*(defined(node) for node in wanted))
    if missing:
        raise LookupError(f"{source_file} defines no {', '.join(sorted(missing))}")
    module = ast.Module(body=wanted, type_ignores=[])
    exec(compile(module, str(source_file), "exec"), namespace)
    return {name: namespace[name] for name in names}


def ported_heads(patched_root: Path) -> dict[str, Any]:
    return extract_definitions(patched_root / PATCHED_MODEL_FILE, HEAD_CLASSES,
                               {"torch": torch, "nn": nn, "F": F, "__name__": "ported_heads"})


def ported_proposer_functions(patched_root: Path) -> dict[str, Any]:
    """The DSpark pieces of the patched proposer that need only torch: the confidence truncation and the
    block-sampling method (called with a stand-in `self`)."""
    namespace: dict[str, Any] = {"torch": torch, "__name__": "ported_proposer"}
    found = extract_definitions(patched_root / PATCHED_PROPOSER_FILE, ("dspark_truncate_by_confidence",), namespace)
    tree = ast.parse((patched_root / PATCHED_PROPOSER_FILE).read_text())
    proposer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "DFlashProposer")
    method = next(node for node in proposer.body
                  if isinstance(node, ast.FunctionDef) and node.name == "_dspark_greedy_sample_block")
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(patched_root / PATCHED_PROPOSER_FILE), "exec"),
         namespace)
    found["_dspark_greedy_sample_block"] = namespace["_dspark_greedy_sample_block"]
    return found


def ensure_vllm_runtime() -> None:
    """A single-process tensor-parallel group, as vLLM's layers expect (gloo, file rendezvous: no port)."""
    with builtin_sys_intern():
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    rendezvous = Path(tempfile.mkdtemp(prefix="b70ctl-gloo-")) / "init"
    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                    distributed_init_method=f"file://{rendezvous}")
        parallel_state.initialize_model_parallel(1, 1)


def load_patched_module(patched_root: Path, relative: str, module_name: str) -> types.ModuleType:
    """Import a patched 0.21.0 model file as a module of the installed vllm package (0.32.0), so its relative
    imports (.qwen3, .utils) resolve against the installed vLLM."""
    spec = importlib.util.spec_from_file_location(module_name, patched_root / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def pristine_auto_weights_loader(pristine_root: Path) -> type:
    """vLLM 0.21.0's own AutoWeightsLoader (its DFlash loader passes skip_prefixes, which 0.32.0's no longer takes),
    defined over the installed vLLM's helpers, so the ported class loads checkpoints with 0.21.0's rules."""
    from vllm.model_executor.models import utils as installed_utils

    namespace = dict(vars(installed_utils))
    namespace.setdefault("support_quantized_model_reload_from_hp_weights", lambda function: function)
    namespace["__name__"] = "pristine_0210_utils"
    source = pristine_root / "vllm/model_executor/models/utils.py"
    return extract_definitions(source, ("AutoWeightsLoader",), namespace)["AutoWeightsLoader"]


TINY_DSPARK = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 1,
    "markov_rank": 8,
    "target_layer_ids": [0, 1],
    "mask_token_id": 3,
}


def tiny_dspark_config(target_config: dict[str, Any], architecture: str = "DSparkDraftModel") -> dict[str, Any]:
    """A SpecForge-style DSpark draft config for the tiny target: DSpark settings nested under dflash_config, as
    SpecForge writes them."""
    shape = TINY_DSPARK
    config = dict(target_config)
    config.update({
        "architectures": [architecture],
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "head_dim": shape["head_dim"],
        "num_hidden_layers": shape["num_hidden_layers"],
        "layer_types": ["full_attention"] * shape["num_hidden_layers"],
        "target_hidden_size": target_config["hidden_size"],
        "block_size": 4,
        "dflash_config": {
            "mask_token_id": shape["mask_token_id"],
            "target_layer_ids": shape["target_layer_ids"],
            "markov_rank": shape["markov_rank"],
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
        },
    })
    return config


def tiny_dspark_state_dict(config: dict[str, Any], seed: int = 7) -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint keys a SpecForge DSpark drafter ships: the DFlash backbone (per-layer
    q/k/v/o, q/k norms, MLP, layer norms; fc over the concatenated target layers; hidden_norm; norm), its own
    embed_tokens and lm_head, and the heads: markov_head.markov_w1/w2, confidence_head.proj."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * 0.05

    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv_heads, head_dim, vocab = config["num_key_value_heads"], config["head_dim"], config["vocab_size"]
    rank = config["dflash_config"]["markov_rank"]
    features = len(config["dflash_config"]["target_layer_ids"]) * config["target_hidden_size"]
    state: dict[str, torch.Tensor] = {
        "embed_tokens.weight": rand(vocab, hidden),
        "lm_head.weight": rand(vocab, hidden),
        "fc.weight": rand(hidden, features),
        "hidden_norm.weight": 1 + rand(hidden),
        "norm.weight": 1 + rand(hidden),
        "markov_head.markov_w1.weight": rand(vocab, rank),
        "markov_head.markov_w2.weight": rand(vocab, rank),
        "confidence_head.proj.weight": rand(1, hidden + rank),
        "confidence_head.proj.bias": rand(1),
    }
    for layer in range(config["num_hidden_layers"]):
        root = f"layers.{layer}."
        state.update({
            root + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            root + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            root + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            root + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            root + "self_attn.q_norm.weight": 1 + rand(head_dim),
            root + "self_attn.k_norm.weight": 1 + rand(head_dim),
            root + "mlp.gate_proj.weight": rand(inter, hidden),
            root + "mlp.up_proj.weight": rand(inter, hidden),
            root + "mlp.down_proj.weight": rand(hidden, inter),
            root + "input_layernorm.weight": 1 + rand(hidden),
            root + "post_attention_layernorm.weight": 1 + rand(hidden),
        })
    return state
