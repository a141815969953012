"""Generate the embedded default's models: a tiny Qwen3 target and its draft models.

No model hub is reachable where the appliance is developed and tested, yet every check must run against real
vLLM behaviour. So the `cpu-tiny` recipe makes its own models: a byte-level BPE tokenizer trained on a fixed
corpus, a small Qwen3 (same architecture class vLLM serves for the real target) trained for a few hundred steps
so that greedy decoding follows sequences instead of looping on one token, and drafts derived from it:

- ``draft-exact``: the target's own weights (draft acceptance ~100%),
- ``draft-perturbed``: the target with noise added to every weight (acceptance well below 100%, and falling
  with the draft position, like a real drafter).

Everything is seeded; a ``generator.json`` beside the weights records the spec so a re-run with the same spec
is a no-op. This module needs torch, transformers and tokenizers (the vLLM CPU environment has them); it is
imported lazily so the control plane does not.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from b70ctl.files import read_own_json_object

# The spec and the generator version are the recipe's (recipes/tiny.py), named here beside what they make.
from b70ctl.recipes.tiny import GENERATOR_VERSION as GENERATOR_VERSION
from b70ctl.recipes.tiny import TinySpec as TinySpec

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen's chat format, trimmed to what a tiny model needs: role headers and an end-of-turn token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus_lines() -> list[str]:
    """A fixed, generated corpus: counting and alphabet runs (what the acceptance-friendly workload asks for),
    and plain sentences about serving models (what the natural-text prompts look like)."""
    lines = [" ".join(str(n) for n in range(start, start + 64)) for start in range(0, 512, 7)]
    lines += [", ".join(str(n) for n in range(start, start + 48)) for start in range(0, 300, 11)]
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    lines += [" ".join(alphabet[i:] + alphabet[:i]) for i in range(26)]
    subjects = ["The server", "A drafter", "The target model", "Each card", "The scheduler", "The kernel"]
    verbs = ["reads", "writes", "verifies", "accepts", "proposes", "streams"]
    objects = ["the tokens", "a block of drafts", "the hidden states", "every request", "the cache", "the logits"]
    reasons = ["before the next step", "in one pass", "without copying", "at full speed", "for each position"]
    for i, subject in enumerate(subjects):
        for j, verb in enumerate(verbs):
            obj = objects[(i + j) % len(objects)]
            reason = reasons[(i * 3 + j) % len(reasons)]
            lines.append(f"{subject} {verb} {obj} {reason}.")
    return lines


def _train_tokenizer(spec: TinySpec, out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=spec.max_position_embeddings,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def _config(spec: TinySpec, tokenizer: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        dtype="float32",  # transformers 5 names it dtype (torch_dtype is deprecated): config.json says "dtype"
    )


def _train(model: Any, tokenizer: Any, spec: TinySpec) -> float:
    """A few hundred steps of next-token training on the corpus; returns the final loss."""
    import torch

    ids: list[int] = []
    for line in corpus_lines():
        ids += tokenizer.encode(line + "\n", add_special_tokens=False)
    data = torch.tensor(ids, dtype=torch.long)
    length = spec.train_sequence_length
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss_value = float("nan")
    for _ in range(spec.train_steps):
        starts = torch.randint(0, len(data) - length - 1, (16,), generator=generator)
        batch = torch.stack([data[s : s + length] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    model.eval()
    return loss_value


def _perturbed_copy(model: Any, std: float, seed: int) -> Any:
    import copy

    import torch

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * std * parameter.std())
    return draft


def _save(model: Any, tokenizer: Any, spec: TinySpec, out: Path, role: str, extra: dict[str, Any]) -> None:
    """Write one model directory atomically: build it beside the target and rename into place."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "generator.json").write_text(
        json.dumps({"generator_version": GENERATOR_VERSION, "role": role, "spec": spec.model_dump(), **extra},
                   indent=2, sort_keys=True) + "\n"
    )
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def is_generated(path: Path, spec: TinySpec, role: str) -> bool:
    recorded = read_own_json_object(path / "generator.json")
    if recorded is None:
        return False
    return bool(
        recorded.get("generator_version") == GENERATOR_VERSION
        and recorded.get("spec") == spec.model_dump()
        and recorded.get("role") == role
    )


ROLES = ("target", "draft-exact", "draft-perturbed")


def generate(out_dir: Path, spec: TinySpec | None = None) -> dict[str, Any]:
    """Generate target, draft-exact and draft-perturbed under out_dir. Returns {"changed": bool, "paths": {...},
    "final_loss": float | None}. A directory already generated from the same spec is left alone. Several
    processes generating into one directory at once (a play's forks, a test run's lanes) take turns: the first
    generates, the others find it generated."""
    import fcntl

    spec = spec or TinySpec()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(out_dir.name + ".lock"), "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        return _generate_locked(out_dir, spec)


def _generate_locked(out_dir: Path, spec: TinySpec) -> dict[str, Any]:
    paths = {role: out_dir / role for role in ROLES}
    if all(is_generated(paths[role], spec, role) for role in ROLES):
        return {"changed": False, "paths": {k: str(v) for k, v in paths.items()}, "final_loss": None}

    import torch
    from transformers import Qwen3ForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the caller reports progress; a bar per tiny shard is noise
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    tokenizer_dir = out_dir / ".tokenizer.partial"
    shutil.rmtree(tokenizer_dir, ignore_errors=True)
    tokenizer = _train_tokenizer(spec, tokenizer_dir)
    model = Qwen3ForCausalLM(_config(spec, tokenizer))
    final_loss = _train(model, tokenizer, spec)
    shutil.rmtree(tokenizer_dir, ignore_errors=True)

    _save(model, tokenizer, spec, paths["target"], "target", {"final_loss": final_loss})
    _save(model, tokenizer, spec, paths["draft-exact"], "draft-exact", {})
    perturbed = _perturbed_copy(model, spec.perturbation_std, spec.seed)
    _save(perturbed, tokenizer, spec, paths["draft-perturbed"], "draft-perturbed", {})
    return {"changed": True, "paths": {k: str(v) for k, v in paths.items()}, "final_loss": final_loss}
