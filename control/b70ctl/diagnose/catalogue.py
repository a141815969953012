"""Load the signature catalogue (catalogue.yaml beside this file, or another file) and validate it."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

import yaml
from pydantic import ValidationError

from b70ctl.diagnose.model import Catalogue
from b70ctl.errors import BadInput


def catalogue_path() -> Path:
    return Path(str(resources.files("b70ctl.diagnose") / "catalogue.yaml"))


def load_catalogue_file(path: Path, repository: Path | None = None) -> Catalogue:
    """The catalogue at path, validated; given the repository's root, its docs and capture sources must be files
    of that repository (the shipped package has no repository beside it, so only the tests pass one)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise BadInput(f"catalogue {path}: {error.strerror}") from error
    except yaml.YAMLError as error:
        raise BadInput(f"catalogue {path}: not valid YAML ({error.__class__.__name__}): fix the syntax") from error
    try:
        return Catalogue.model_validate(data, context={"repository": repository})
    except ValidationError as error:
        first = error.errors()[0]
        location = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise BadInput(f"catalogue {path}: {location}: {first['msg'].removeprefix('Value error, ')}") from error


@lru_cache(maxsize=1)
def load_catalogue() -> Catalogue:
    """The shipped catalogue, validated once per process."""
    return load_catalogue_file(catalogue_path())
