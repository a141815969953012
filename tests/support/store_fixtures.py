"""Fixtures for the lock and model-store tests: a local hub serving a generated tiny target and a SpecForge-style
DSpark drafter, a local OCI registry, and a recipe file pointing at both."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import save as safetensors_bytes

from b70ctl.recipes import recipe_path
from local_endpoints import LocalHub, LocalRegistry

TARGET_REPO = "acme/tiny-target"
DRAFTER_REPO = "acme/tiny-dspark"
IMAGE_REFERENCE = "registry.example/b70/vllm-native"
TARGET_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


def drafter_config(**overrides: Any) -> dict[str, Any]:
    """A drafter config as SpecForge writes it: DSparkDraftModel, the DSpark fields nested in dflash_config."""
    config: dict[str, Any] = {
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "float32", "block_size": 7,
        "dflash_config": {"target_layer_ids": [1, 3, 5], "mask_token_id": 1000, "markov_rank": 16,
                          "enable_confidence_head": True, "confidence_head_with_markov": True},
    }
    config.update(overrides)
    return config


def weights(seed: int, tensors: dict[str, tuple[int, ...]]) -> bytes:
    rng = np.random.default_rng(seed)
    return safetensors_bytes({name: rng.standard_normal(shape).astype(np.float32) for name, shape in tensors.items()})


def target_files(seed: int = 1) -> dict[str, bytes]:
    return {
        "config.json": json.dumps(TARGET_CONFIG, indent=2).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}).encode(),
        # ~400 KB: large enough that a cut body or a small file-size limit stops it half-way
        "model.safetensors": weights(seed, {"model.embed_tokens.weight": (1024, 64),
                                            "lm_head.weight": (512, 64)}),
        "README.md": b"# tiny target\n",  # not matched by the recipe's include patterns: never pinned
    }


def drafter_files(seed: int = 2, config: dict[str, Any] | None = None) -> dict[str, bytes]:
    return {
        "config.json": json.dumps(config or drafter_config(), indent=2).encode(),
        "model.safetensors": weights(seed, {"markov_head.markov_w1.weight": (1024, 16),
                                            "markov_head.markov_w2.weight": (1024, 16),
                                            "fc.weight": (64, 192)}),
    }


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def hub() -> Iterator[LocalHub]:
    server = LocalHub()
    server.repo(TARGET_REPO).commit(target_files())
    server.repo(DRAFTER_REPO).commit(drafter_files())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def registry() -> Iterator[LocalRegistry]:
    server = LocalRegistry(require_token=True)
    server.push("b70/vllm-native", "v1", {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                                          "manifests": [{"digest": "sha256:" + "1" * 64, "size": 1}]})
    server.start()
    yield server
    server.stop()


@pytest.fixture
def hub_env(hub: LocalHub, registry: LocalRegistry, monkeypatch: pytest.MonkeyPatch) -> tuple[LocalHub, LocalRegistry]:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("B70CTL_REGISTRY_URL", registry.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return hub, registry


def write_recipe(directory: Path, name: str = "store-test", **changes: Any) -> Path:
    """The cpu-tiny recipe, pointed at the local hub's repos and the local registry's image."""
    data = yaml.safe_load(recipe_path("cpu-tiny").read_text())
    data.pop("tiny")
    data.update(name=name, target={"repo": TARGET_REPO, "revision": "main"},
                drafter={"repo": DRAFTER_REPO, "revision": "main", "needs_conversion": True},
                image={"reference": IMAGE_REFERENCE, "tag": "v1", "source": "pull"})
    data.update(changes)
    path = directory / f"{name}.yaml"
    buffer = io.StringIO()
    yaml.safe_dump(data, buffer, sort_keys=False)
    path.write_text(buffer.getvalue())
    return path
