"""The tune's test recipe and the rates its scripted candidates serve at (test_tune, test_tune_unit)."""

from __future__ import annotations

from b70ctl.recipes import load_recipe

CPU_TINY = load_recipe("cpu-tiny")  # draft model k 1..6 (default k=4) and four ngram candidates
# The halving's tests: the draft model's k alone (six candidates), four workloads on the endpoint.
RECIPE = CPU_TINY.model_copy(update={"tune": CPU_TINY.tune.model_copy(update={"ngram": None,
                                                                               "budget_requests": 120})})
# Candidate k serves at SERVED_RATES[k] tok/s.
SERVED_RATES = {1: 150.0, 2: 240.0, 3: 220.0, 4: 200.0, 5: 400.0, 6: 160.0}
