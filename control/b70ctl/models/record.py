"""/etc/b70/models.json: what a host's model store holds, as the serving stage and the reports read it.

`b70ctl model record --store-dir DIR < fetch.json` makes it from `b70ctl model fetch --json` (the revisions the lock
pinned, or a generated model's generator record) and the host's store directory, where the model_store role
installs target/ and drafter/. The role copies the output to the host; `b70ctl serve render --models-record` reads
it back (the store directory the container mounts, and the label that restarts a unit when it changes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import PurePosixPath

from pydantic import Field, ValidationError, field_validator, model_validator

from b70ctl.documents import Document, Pinned
from b70ctl.errors import BadInput, first_problem
from b70ctl.models.fetch import FetchResult

# The directories a host's store holds, whatever the recipe: the role installs the servable drafter as drafter/.
STORED_ROLES = ("target", "drafter")


class StoredModel(Pinned):
    path: str = Field(description="Absolute directory on the host")
    revision: str | None = Field(description="The lock's commit, or generated-<sha256 of generator.json, 12 digits>")

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("not an absolute path")
        return value


class ModelsRecord(Document):
    target: StoredModel
    drafter: StoredModel | None = None

    @model_validator(mode="after")
    def _one_store(self) -> ModelsRecord:
        # The container mounts one directory: the drafter sits beside the target (models_record puts both there).
        store = PurePosixPath(self.target.path).parent
        if self.drafter is not None and PurePosixPath(self.drafter.path).parent != store:
            raise ValueError(f"the drafter is not in the target's store directory {store}")
        return self

    def store_dir(self) -> str:
        """The host directory holding target/ (and drafter/): what the serving container mounts at /models."""
        return str(PurePosixPath(self.target.path).parent)

    def in_container(self, mount: str) -> tuple[str, str | None]:
        """The target's and the drafter's directories as a container that mounts store_dir() at `mount` sees them."""
        def seen(model: StoredModel) -> str:
            return f"{mount.rstrip('/')}/{PurePosixPath(model.path).name}"
        return seen(self.target), None if self.drafter is None else seen(self.drafter)

    def label(self) -> str:
        """16 hex digits of the record (paths and revisions): a different record, a different unit."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def models_record(fetched: FetchResult, store_dir: str) -> ModelsRecord:
    revisions = {model.role: model.revision for model in fetched.models}
    missing = [role for role in ("target",) if role not in revisions]
    if missing:
        raise BadInput(f"the fetch of {fetched.recipe} has no {missing[0]}: fetch the recipe's models again")
    try:
        return ModelsRecord.model_validate({
            role: {"path": f"{store_dir.rstrip('/')}/{role}", "revision": revisions[role]}
            for role in STORED_ROLES if role in revisions})
    except ValidationError as error:
        raise BadInput(f"--store-dir {store_dir}: {first_problem(error)}: give the host's absolute directory") \
            from error


def parse_models_record(text: str, what: str) -> ModelsRecord:
    try:
        return ModelsRecord.model_validate_json(text)
    except ValidationError as error:
        raise BadInput(f"{what}: {first_problem(error)}: pass the host's /etc/b70/models.json (the model_store role "
                       "writes it)") from error
