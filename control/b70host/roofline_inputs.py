#!/usr/bin/env python3
"""What a decode-rate roofline needs that only the serving host can tell (report/roofline.py computes it).

Standard library only: the replication_check role runs this file on the host with the system Python, and
`b70ctl verify --model-dir` imports it when the server runs on the machine verify runs on (the embedded default).

- Memory bandwidth: two buffers of COPY_BUFFER_BYTES, the second overwritten from the first through memoryviews
  (one memcpy per copy), best of COPY_REPEATS copies, counting every byte read and every byte written (2 x the
  buffer per copy, as STREAM's copy counts). One thread: a memory system with many channels gives several threads
  more, so on such a host the bound built on it is low, never high. Under a second on any machine that can hold
  the buffers; the first copy also faults the pages in, the best of the rest is the figure.
- The served target: the bytes of its weight tensors, read from the safetensors headers (no weight is read), the
  input embedding table apart (decoding reads one row of it per token unless it is tied to the output head), and
  the config.json fields the KV cache's size per token follows from, named as transformers' Qwen3Config names
  them (num_hidden_layers, num_key_value_heads, head_dim, dtype or torch_dtype, layer_types, sliding_window,
  tie_word_embeddings; under text_config for a multimodal config).

    python3 roofline_inputs.py [--model-dir DIR | --models-json FILE] [--copy-benchmark]     prints one JSON object

--models-json reads the target's directory from the model store's record (/etc/b70/models.json: target.path).
Exit 0 whatever it could measure (the JSON says what is missing and why), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import struct
import sys
import time
from typing import Any, BinaryIO

COPY_BUFFER_BYTES = 128 * 2**20
COPY_REPEATS = 5
# The header of a safetensors file: an 8-byte little-endian length, then that many bytes of JSON.
HEADER_LIMIT_BYTES = 100 * 2**20
# Most bytes of a config.json or of the model store's models.json read: each is a few KiB (a config.json with an
# id2label table some hundreds of KiB); a larger file is not one, and json needs several times a text's size in
# memory, on the serving host.
JSON_LIMIT_BYTES = 16 * 2**20


def _open_regular(path: str) -> BinaryIO:
    """`path` opened for reading, refused (ValueError) when it is not a regular file: a FIFO would block the open
    and /dev/zero never ends, so it is opened non-blocking and checked before a byte is read."""
    stream = os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY), "rb")
    if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
        stream.close()
        raise ValueError(f"{path}: not a regular file")
    return stream


def _parse(text: bytes, path: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError as error:
        raise ValueError(f"{path}: JSON nested too deeply") from error


def _load_json(path: str) -> Any:
    """A JSON file of at most JSON_LIMIT_BYTES; larger, not a regular file, or too deeply nested: ValueError."""
    with _open_regular(path) as stream:
        size = os.fstat(stream.fileno()).st_size
        if size > JSON_LIMIT_BYTES:
            raise ValueError(f"{path}: {size} bytes, over the {JSON_LIMIT_BYTES} this reads")
        text = stream.read(JSON_LIMIT_BYTES + 1)
    if len(text) > JSON_LIMIT_BYTES:
        raise ValueError(f"{path}: over the {JSON_LIMIT_BYTES} bytes this reads")
    return _parse(text, path)


def copy_bandwidth(buffer_bytes: int = COPY_BUFFER_BYTES, repeats: int = COPY_REPEATS) -> dict[str, Any]:
    """Bytes per second one thread copies between two buffers too large for any cache (best of `repeats`)."""
    source = bytearray(buffer_bytes)
    destination = bytearray(buffer_bytes)
    source_view, destination_view = memoryview(source), memoryview(destination)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        destination_view[:] = source_view
        best = min(best, time.perf_counter() - started)
    method = (f"one thread copies a {buffer_bytes / 2**20:g} MiB buffer into another (memoryview slice "
              f"assignment: memcpy), best of {repeats}, bytes read + bytes written")
    return {"bytes_per_s": 2 * buffer_bytes / best, "method": method, "buffer_bytes": buffer_bytes,
            "repeats": repeats}


def safetensors_tensor_bytes(path: str) -> dict[str, int]:
    """Each tensor's data size in bytes, by name, from a safetensors file's header."""
    with _open_regular(path) as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > HEADER_LIMIT_BYTES:
            raise ValueError(f"{path}: header of {length} bytes: not a safetensors file")
        header = _parse(handle.read(length), path)
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    sizes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        sizes[name] = int(end) - int(start)
    return sizes


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def target_shape(model_dir: str) -> dict[str, Any]:
    """The weight bytes and KV-cache shape of the model in `model_dir` (its *.safetensors and config.json)."""
    outer = _load_json(os.path.join(model_dir, "config.json"))
    if not isinstance(outer, dict):
        raise ValueError(f"{model_dir}/config.json is not a JSON object")
    config = _text_config(outer)
    files = sorted(name for name in os.listdir(model_dir) if name.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weight files")
    tensors: dict[str, int] = {}
    for name in files:
        tensors.update(safetensors_tensor_bytes(os.path.join(model_dir, name)))
    layers = int(config["num_hidden_layers"])
    attention_heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or int(config["hidden_size"]) // attention_heads
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == layers:
        full = sum(1 for kind in layer_types if kind == "full_attention")
        sliding = sum(1 for kind in layer_types if kind == "sliding_attention")
    else:
        full, sliding = layers, 0
    tied = config.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))
    return {
        "directory": model_dir,
        "weight_files": len(files),
        "weight_bytes": sum(tensors.values()),
        "embedding_bytes": sum(size for name, size in tensors.items() if name.endswith("embed_tokens.weight")),
        "tie_word_embeddings": bool(tied),
        "num_hidden_layers": layers,
        "num_key_value_heads": int(config.get("num_key_value_heads") or attention_heads),
        "head_dim": int(head_dim),
        "dtype": config.get("dtype") or config.get("torch_dtype") or outer.get("dtype") or outer.get("torch_dtype"),
        "full_attention_layers": full,
        "sliding_attention_layers": sliding,
        "sliding_window": config.get("sliding_window") if sliding else None,
    }


def target_directory(models_json: str) -> str:
    """The target's directory the model store recorded (its `target.path`)."""
    record = _load_json(models_json)
    path = record.get("target", {}).get("path") if isinstance(record, dict) else None
    if not isinstance(path, str) or not path:
        raise ValueError(f"{models_json}: no target.path")
    return path


def collect(model_dir: str | None, copy_benchmark: bool, models_json: str | None = None) -> dict[str, Any]:
    """The JSON this file prints: each part, or why it is missing (never a guessed figure)."""
    result: dict[str, Any] = {}
    if copy_benchmark:
        try:
            result["memory_bandwidth"] = copy_bandwidth()
        except MemoryError:
            result["memory_bandwidth_unavailable"] = (f"no memory for two {COPY_BUFFER_BYTES // 2**20} MiB copy "
                                                      "buffers")
    if model_dir is None and models_json is not None:
        try:
            model_dir = target_directory(models_json)
        except Exception as error:  # noqa: BLE001 whatever the record holds, the report goes on saying so
            result["target_shape_unavailable"] = f"the model store's record: {error.__class__.__name__}: {error}"
    if model_dir is not None:
        try:
            result["target_shape"] = target_shape(model_dir)
        except Exception as error:  # noqa: BLE001 a config no loader would take (no attention heads): said, not a crash
            result["target_shape_unavailable"] = f"{model_dir}: {error.__class__.__name__}: {error}"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="The served target's directory (config.json, *.safetensors)")
    parser.add_argument("--models-json", help="The model store's record, naming the target's directory")
    parser.add_argument("--copy-benchmark", action="store_true", help="Measure this machine's copy bandwidth")
    args = parser.parse_args(argv)
    found = collect(args.model_dir, args.copy_benchmark, args.models_json)
    sys.stdout.write(json.dumps(found, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
