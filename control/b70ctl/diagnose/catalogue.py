"""Load the signature catalogue (the catalogue/ folder beside this file, or another file or folder) and validate it.

The catalogue is split by topic into files (catalogue/platform.yaml: kernel, firmware, compute runtime, host;
catalogue/serving.yaml: vLLM, oneCCL, the image): read in name order, they are validated as one document, so ids
are unique across files and `unless` may name an entry of another file.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from b70ctl.diagnose.model import Catalogue
from b70ctl.errors import BadInput
from b70ctl.files import read_yaml_mapping


def catalogue_path() -> Path:
    return Path(str(resources.files("b70ctl.diagnose") / "catalogue"))


def catalogue_files(path: Path) -> list[Path]:
    """The files of a catalogue: path itself, or the *.yaml files of a folder in name order."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.yaml"))
        if not files:
            raise BadInput(f"catalogue {path}: a folder with no .yaml file: put the catalogue's files there")
        return files
    return [path]


def load_catalogue_file(path: Path, repository: Path | None = None) -> Catalogue:
    """The catalogue at path (a file, or a folder of files), validated; given the repository's root, its docs and
    capture sources must be files of that repository (the shipped package has no repository beside it, so only
    the tests pass one)."""
    files = catalogue_files(path)
    fix = "give a catalogue file (schema_version, signatures)"
    documents = [(file, read_yaml_mapping(file, f"catalogue {file}", fix)) for file in files]
    versions = {data.get("schema_version") for _, data in documents}
    merged = {"schema_version": documents[0][1].get("schema_version"),
              "signatures": [entry for _, data in documents for entry in (data.get("signatures") or [])]}
    if len(versions) > 1:
        raise BadInput(f"catalogue {path}: its files declare schema versions {sorted(map(str, versions))}: "
                       "make them one")
    try:
        return Catalogue.model_validate(merged, context={"repository": repository})
    except ValidationError as error:
        first = error.errors()[0]
        location = list(first["loc"])
        where = path
        # Name the file an entry came from: signatures.N counts across the files in order.
        if len(location) >= 2 and location[0] == "signatures" and isinstance(location[1], int):
            index = location[1]
            for file, data in documents:
                count = len(data.get("signatures") or [])
                if index < count:
                    where, location[1] = file, index
                    break
                index -= count
        text = ".".join(str(part) for part in location) or "(top level)"
        raise BadInput(f"catalogue {where}: {text}: {first['msg'].removeprefix('Value error, ')}") from error


@lru_cache(maxsize=1)
def load_catalogue() -> Catalogue:
    """The shipped catalogue, validated once per process."""
    return load_catalogue_file(catalogue_path())
