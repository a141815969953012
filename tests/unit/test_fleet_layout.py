"""fleet/layout.py: host_facts.json is read with the report's own Environment fields, so the two cannot drift."""

from __future__ import annotations

import json

from b70ctl.fleet.layout import HostFacts, read_host_facts
from b70ctl.report.model import HOST_FACT_FIELDS, NOT_HOST_FACTS, Environment


def test_host_facts_are_the_environment_fields_with_their_types():
    environment = {name: field for name, field in Environment.model_fields.items() if name not in NOT_HOST_FACTS}
    assert list(HostFacts.model_fields) == list(environment)
    for name, field in HostFacts.model_fields.items():
        assert field.annotation == environment[name].annotation, name
        assert field.default is None and not field.is_required(), name
    # One list: what verify takes from host facts is what the fleet report reads, and nothing the server says of
    # itself (vllm_version) is taken from a host's files.
    assert tuple(HostFacts.model_fields) == HOST_FACT_FIELDS
    assert "vllm_version" not in HostFacts.model_fields and "served_model" not in HostFacts.model_fields


def test_host_facts_json_round_trips_every_fact_and_ignores_other_keys(tmp_path):
    facts = {name: 2 if name == "gpu_count" else [f"{name}-value"] if name == "rehearsal" else f"{name}-value"
             for name in HostFacts.model_fields}
    path = tmp_path / "host_facts.json"
    path.write_text(json.dumps({**facts, "served_model": "not a host fact", "extra": {"x": 1}, "uptime_s": 5}))
    read = read_host_facts(path)
    assert not isinstance(read, str), read
    assert read.model_dump() == facts
    # The facts fill an Environment field by field, under the same names.
    assert Environment(**read.model_dump()).model_dump(exclude=set(NOT_HOST_FACTS)) == facts


def test_a_fact_of_the_wrong_type_is_named(tmp_path):
    path = tmp_path / "host_facts.json"
    path.write_text('{"gpu_count": "two"}')
    reason = read_host_facts(path)
    assert isinstance(reason, str) and "gpu_count" in reason and "host facts not used" in reason
