"""What the embedded default's recipe says its generated models are (the `tiny:` section of cpu-tiny), and the
version of the generator that made them. The recipe and the lock pin models by these two; models/tiny.py generates
from them (it needs torch, transformers and tokenizers, which reading a recipe or a lock never does)."""

from __future__ import annotations

from b70ctl.documents import Pinned

# Raised when the generator's output changes for the same spec: a lock pins it, so models of another generator are
# generated again.
GENERATOR_VERSION = 1


class TinySpec(Pinned):
    """What to generate. Part of the cpu-tiny recipe; changing any field changes the models."""

    seed: int = 1234
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 4096
    train_steps: int = 300
    train_sequence_length: int = 128
    # Noise relative to each weight's own std. Measured with greedy drafting (k=4) on the corpus prompts: 0.1
    # still agrees with the target on nearly every token; 0.6 gives 40-80% acceptance falling with position.
    perturbation_std: float = 0.6
