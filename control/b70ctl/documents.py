"""The three base classes of the pydantic models b70ctl's JSON and YAML documents are made of.

- Document: a document, or part of one, that b70ctl reads and writes. A field it does not know is refused, not
  dropped: a typo in a hand-edited file, or a file of another schema, fails naming the field.
- Pinned: the same, immutable once read: locks, manifests, patch series, release matrices, rendered commands, what
  is compared, hashed or handed on, never edited in place.
- Read: a document another program made, read for the keys b70ctl needs: Ansible's registered results passed on
  whole, files the fleet's hosts and plays wrote. The producer's other keys are its own, ignored, not refused.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Pinned(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Read(BaseModel):
    model_config = ConfigDict(extra="ignore")
