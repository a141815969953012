"""The real servers the other vllm tests rely on: each variant speculates the way it says it does."""

from __future__ import annotations

from b70ctl.checks.client import VllmClient


def _spec_counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"vllm:{name}{{") or line.startswith(f"vllm:{name} "))


def test_variants_serve_and_speculate(endpoints):
    for name, endpoint in endpoints.items():
        with VllmClient(endpoint) as client:
            result = client.stream("completions", "0 1 2 3 4 5 6 7", max_tokens=32, temperature=0.0,
                                   ignore_eos=True)
            assert result.error is None, (name, result.error)
            assert len(result.token_ids) == 32 == result.usage["completion_tokens"]
            drafts = _spec_counter(client.metrics_text(), "spec_decode_num_drafts_total")
            if name == "baseline":
                assert drafts == 0
            else:
                assert drafts > 0, f"{name} made no drafts"
