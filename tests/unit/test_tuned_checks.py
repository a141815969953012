"""A host's tuned settings (b70_tuned.yml's vllm_serve_tuned, handed to `serve render --tuned`) pass the checks a
recipe file passes: no key given twice, and nothing that would add lines to the unit's env-file."""

from __future__ import annotations

import json

import pytest

from b70ctl.errors import BadInput
from b70ctl.recipes import load_recipe
from b70ctl.serve.tuned import apply_tuned, parse_tuned

DOCUMENT = {"recipe": "cpu-tiny", "outcome": "tuned", "profile": None, "score_tok_s": 52.0,
            "default_score_tok_s": 42.0, "budget_requests": 300, "spent_requests": 280, "date": "2026-12-01"}


def test_a_knob_given_twice_is_refused():
    text = json.dumps(DOCUMENT | {"overrides": {"num_speculative_tokens": 2}})
    twice = text.replace('{"num_speculative_tokens": 2}', '{"num_speculative_tokens": 2, "num_speculative_tokens": 6}')
    assert twice != text
    with pytest.raises(BadInput) as error:
        parse_tuned(twice)
    assert "key 'num_speculative_tokens' is given twice" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("value", ["262144\nLD_PRELOAD=/tmp/x.so", "big", -1])
def test_a_threshold_that_is_not_a_byte_count_is_refused(value):
    tuned = parse_tuned(json.dumps(DOCUMENT | {"overrides": {"CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD": value}}))
    with pytest.raises(BadInput) as error:
        apply_tuned(load_recipe("cpu-tiny"), tuned, None)
    message = str(error.value)
    assert "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD" in message and "not a size in bytes" in message
    assert "\n" not in message and "LD_PRELOAD" not in message


def test_a_byte_count_threshold_applies():
    tuned = parse_tuned(json.dumps(DOCUMENT | {"overrides": {"CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD": 262144}}))
    _, env = apply_tuned(load_recipe("cpu-tiny"), tuned, None)
    assert env == {"CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD": "262144"}
