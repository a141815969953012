"""The tune's documents: a candidate, one measurement of it (a line of the state file), and the tune report
(tune.json). One model each; the report is what tune.md, the plot and b70_tuned.yml are rendered from."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Final, Literal

from pydantic import Field

from b70ctl.documents import Document as _Model
from b70ctl.documents import Pinned
from b70ctl.report.model import RooflineInput

# The applied tune's document is serve's to read (serve/tuned.py); the tune writes it.
from b70ctl.serve.tuned import TunedSettings as TunedSettings
from b70ctl.serve.tuned import Value as Value
from b70ctl.serve.tuned import ccl_env

TUNE_SCHEMA_VERSION: Final = 1


class Candidate(Pinned):
    """One point of the tune space: the value of every tuned knob (None: the recipe leaves vLLM's default). In a
    race, also the recipe it belongs to (None in a one-recipe tune, whose state files predate races)."""

    overrides: dict[str, Value]
    recipe: str | None = None

    @property
    def key(self) -> str:
        """Stable across runs: the overrides as sorted JSON (the state file refers to candidates by it)."""
        if self.recipe is None:
            return json.dumps(self.overrides, sort_keys=True, separators=(",", ":"))
        return json.dumps({"overrides": self.overrides, "recipe": self.recipe}, sort_keys=True,
                          separators=(",", ":"))

    @property
    def label(self) -> str:
        settings = self.settings_label
        return settings if self.recipe is None else f"{self.recipe}: {settings}"

    @property
    def settings_label(self) -> str:
        shown = []
        for name, value in self.overrides.items():
            if not knob_applies(name, self.overrides):
                continue
            if name == "method":
                shown.append(str(value))  # "ngram, k=2, ..." reads better than "method=ngram, k=2"
            else:
                shown.append(f"{SHORT_NAMES.get(name, name)}={'default' if value is None else value}")
        return ", ".join(shown) or "the recipe as it is"

    @property
    def probes_prefix_cache(self) -> bool:
        """Served with prefix caching on whatever the host's record: the gate at its first serve is the
        prefix-cache probe for it (serve/tuned.py: a winner with it on is the record that the probe passed)."""
        return self.overrides.get("prefix_caching") == "on"

    @property
    def host_env(self) -> dict[str, str]:
        """The oneCCL variables among the overrides: host environment on top of the profile's, not recipe fields."""
        return ccl_env(self.overrides)


SHORT_NAMES = {"num_speculative_tokens": "k", "draft_sample_method": "draft sampling",
               "max_num_batched_tokens": "batched tokens", "prompt_lookup_min": "lookup min",
               "prompt_lookup_max": "lookup max", "prefix_caching": "prefix caching"}


def knob_applies(name: str, overrides: dict[str, Value]) -> bool:
    """False for the n-gram window of a candidate that drafts with a model (vLLM reads it for ngram only)."""
    return name not in ("prompt_lookup_min", "prompt_lookup_max") or overrides.get("method") == "ngram"


class Measurement(_Model):
    """One stage of one candidate: served once, checked (first time only) and measured. A line of the state file."""

    kind: Literal["measurement"] = "measurement"
    candidate: str = Field(description="Candidate.key")
    stage: str = Field(description="round-N of the halving, or final")
    requests: int = Field(0, ge=0, description="Measured requests (what the budget counts; warm-ups are not)")
    decode_tok_s: list[float] = Field(default_factory=list, description="Per-request decode rates, engine clock")
    client_timed: int = Field(0, ge=0, description="Requests the engine did not time (rate from arrivals)")
    correctness: str | None = Field(None, description="identical/total greedy outputs, when checked here")
    gate: str | None = Field(None, description="The gate against silent garbage: its verdict at the first serve, "
                                               "the restart comparison at a later one")
    disqualified: str | None = Field(None, description="Why the candidate is out, whatever its speed")
    mean_acceptance_length: dict[str, float] = Field(default_factory=dict, description="Per workload")
    measured_at: datetime


class Figures(_Model):
    n: int
    median_tok_s: float | None = None
    mad_tok_s: float | None = None
    score_tok_s: float | None = None


class CandidateResult(_Model):
    key: str
    label: str
    recipe: str | None = Field(None, description="In a race, the recipe the candidate belongs to")
    overrides: dict[str, Value]
    is_default: bool
    rounds: int = Field(description="Rounds of the halving it was measured in")
    halving: Figures = Field(description="Over all its requests of the halving")
    correctness: str | None = None
    gate: str | None = Field(None, description="The gate's verdict at the candidate's first serve")
    disqualified: str | None = None
    mean_acceptance_length: float | None = Field(
        None, description="Tokens per decode step over its halving measurements: 1 without speculation; None when "
                          "the counters gave none")
    bound_tok_s: float | None = Field(None, description="The decode roofline at that acceptance length (tok/s)")

    @property
    def settings_label(self) -> str:
        """The label without its recipe (a race's candidates are labelled "recipe: settings")."""
        return self.label.removeprefix(f"{self.recipe}: ") if self.recipe else self.label


class Round(_Model):
    index: int
    requests_per_workload: int
    measured: list[str] = Field(description="Candidate keys measured in this round")
    kept: list[str] = Field(description="The best half, measured again in the next round")


class FinalComparison(_Model):
    """The winner of the halving and the recipe's default, measured back to back at the end (same window)."""

    default_key: str
    winner_key: str
    default: Figures | None = Field(None, description="None when the default was disqualified")
    winner: Figures


class PublishedRecord(_Model):
    """A raced recipe's published decode figure, shown beside the candidates' measured ones."""

    recipe: str
    claim: str = Field(description="The claim's id in the recipe")
    description: str
    tok_s: float
    source: str
    url: str | None = None


class RaceRoofline(_Model):
    """The decode roofline of the candidates (report/roofline.py): the host's bandwidth per memory domain over the
    target's weights read per step, times each candidate's acceptance length. The KV cache's reads are left out
    (the tune does not record each request's context), so the bound is higher than verify's per workload: still a
    ceiling, never a rate to reach."""

    bandwidth_bytes_per_s: RooflineInput
    weight_bytes: RooflineInput = Field(description="The target's weights read per step, over all cards")
    not_measured: str | None = Field(None, description="Why no candidate has a bound")


class TuneReport(_Model):
    schema_version: Literal[1] = TUNE_SCHEMA_VERSION
    recipe: str = Field(description="The recipe tuned; in a race, the host's recipe (the first raced), which the "
                                    "final comparison's default belongs to")
    race: list[str] = Field(default_factory=list, description="The recipes raced, the host's first; empty: a tune "
                                                              "of one recipe")
    published: list[PublishedRecord] = Field(default_factory=list, description="The raced recipes' records")
    vllm_version: str
    profile: str | None = Field(None, description="The host's oneCCL profile the space was taken for")
    knobs: dict[str, list[Value]] = Field(description="Knob -> values tried")
    default_overrides: dict[str, Value] = Field(description="The recipe's own value of every knob")
    workloads: list[str] = Field(description="The recipe's workloads measured (those run on the served endpoint)")
    budget_requests: int
    spent_requests: int
    started_at: datetime
    finished_at: datetime
    rounds: list[Round]
    candidates: list[CandidateResult]
    final: FinalComparison | None = None
    roofline: RaceRoofline | None = Field(None, description="None: a report written before the roofline was in it")
    outcome: Literal["tuned", "default_best", "no_candidate"]
    tuned_overrides: dict[str, Value] = Field(description="What to apply; empty when the default stays")
    winner_recipe: str | None = Field(None, description="In a race, the recipe to serve: the winner's, or the "
                                                        "host's when its default stays")
    summary: str
