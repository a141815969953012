"""The serving image's two documents: what the controller provides for a recipe (`b70ctl image provide --json`),
and what a host serves once it is installed (/etc/b70/image.json, `b70ctl image record --json`). The dspark_image
role passes the first on and copies the second; the serving stage, the reports and the generation read the second.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from b70ctl.documents import Document

# A pull is by digest only: a tag can move under a fleet between two hosts' pulls.
DIGEST_REFERENCE = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")


class ProvidedImage(Document):
    """`b70ctl image provide --json`: the locked name@digest to pull, or the image built on the controller and the
    archive each host loads."""

    recipe: str
    source: Literal["pull", "build"]
    reference: str = Field(description="pull: name@sha256:digest; build: the tag it was built as")
    vllm_version: str
    digest: str | None = Field(None, description="pull: the sha256 digest")
    tag: str | None = Field(None, description="pull: the recipe's tag, informational only")
    id: str | None = Field(None, description="build: the image id")
    archive: str | None = Field(None, description="build: the archive on the controller, named by the id")
    labels: dict[str, str] = Field(default_factory=dict, description="build: the org.b70.* labels it carries")

    def installed(self, image_id: str) -> InstalledImage:
        return InstalledImage(recipe=self.recipe, source=self.source, reference=self.reference, id=image_id,
                              digest=self.digest, vllm_version=self.vllm_version, labels=self.labels)


class ProvidedImages(Document):
    """`b70ctl image provide --json RECIPE...`: each recipe's image, keyed by the recipe as the play's inventory
    names it (b70_recipe: a name or a file), so that a host reads its own by that key."""

    recipes: dict[str, ProvidedImage]


class InstalledImage(Document):
    """/etc/b70/image.json: the image a host serves, by the id its engine gives it."""

    recipe: str
    source: Literal["pull", "build"]
    reference: str
    id: str = Field(min_length=1, description="The engine's image id (sha256:...)")
    digest: str | None = None
    vllm_version: str
    labels: dict[str, str] = Field(default_factory=dict)
