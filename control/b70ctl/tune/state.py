"""The tune's state file: every measurement appended as one JSON line, so a tune killed at any point resumes
from what it measured.

The first line names the space (recipe, knobs, workloads, budget) by a hash; a re-run whose space differs is
refused instead of mixing two searches. Each line is written whole and flushed to disk; a line cut by a kill is
the last one and is dropped on reading (that measurement is simply taken again).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from b70ctl.errors import BadInput
from b70ctl.files import write_text_atomically
from b70ctl.tune.model import Measurement

STATE_FILE = "tune-state.jsonl"


def space_hash(description: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:16]


class TuneState:
    """Measurements by (candidate key, stage), backed by the append-only file."""

    def __init__(self, path: Path, space: dict[str, Any]):
        self.path = Path(path)
        self.space = space
        self.measurements: dict[tuple[str, str], Measurement] = {}
        self.resumed = 0
        expected = space_hash(space)
        if self.path.exists():
            self._load(expected)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"kind": "space", "hash": expected, "space": space})

    def _load(self, expected: str) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        records = []
        for number, line in enumerate(lines, start=1):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if number == len(lines):
                    break  # cut by a kill mid-write: measured again
                raise BadInput(f"{self.path}: line {number} is not JSON: the file was edited; delete it to start "
                               "the tune over") from None
        if not records or records[0].get("kind") != "space":
            raise BadInput(f"{self.path}: not a tune state file (no space line): choose another --out")
        if records[0].get("hash") != expected:
            raise BadInput(f"{self.path} holds a tune of another space (the recipe, its tune section or the budget "
                           "changed): choose another --out, or delete the file to start over")
        for record in records[1:]:
            try:
                measurement = Measurement.model_validate(record)
            except ValidationError as error:
                raise BadInput(f"{self.path}: a measurement line does not read ({error.errors()[0]['msg']}): "
                               "delete the file to start the tune over") from None
            self.measurements[(measurement.candidate, measurement.stage)] = measurement
        self.resumed = len(self.measurements)
        if len(records) < len(lines):
            # Rewrite without the cut line, so the next append starts on a line of its own.
            kept = "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records)
            write_text_atomically(self.path, kept)

    def _append(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record, separators=(",", ":")) + "\n")
            out.flush()
            os.fsync(out.fileno())

    def get(self, candidate: str, stage: str) -> Measurement | None:
        return self.measurements.get((candidate, stage))

    def add(self, measurement: Measurement) -> None:
        self._append(measurement.model_dump(mode="json"))
        self.measurements[(measurement.candidate, measurement.stage)] = measurement

    def of(self, candidate: str) -> list[Measurement]:
        return [m for (key, _), m in self.measurements.items() if key == candidate]

    @property
    def spent_requests(self) -> int:
        return sum(m.requests for m in self.measurements.values())
