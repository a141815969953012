"""The real servers the other vllm tests rely on: each variant speculates the way it says it does."""

from __future__ import annotations

from b70ctl.checks.client import VllmClient


def _spec_counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:{name}{{") or line.startswith(f"vllm:{name} "))


def test_variants_serve_and_speculate(endpoints):
    for name, endpoint in endpoints.items():
        with VllmClient(endpoint) as client:
            # Sentences of the corpus repeat their phrases, so the ngram proposer finds matches to draft from.
            result = client.stream("completions", "The scheduler", max_tokens=96, temperature=0.0,
                                   ignore_eos=True)
            assert result.error is None, (name, result.error)
            assert len(result.token_ids) == 96 == result.usage["completion_tokens"]
            drafts = _spec_counter(client.metrics_text(), "spec_decode_num_drafts_total")
            if name == "baseline":
                assert drafts == 0
            else:
                assert drafts > 0, f"{name} made no drafts"
