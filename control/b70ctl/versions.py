"""Version comparison for vLLM releases and dev builds ("0.21.1.dev0", "0.26.1rc1.dev799")."""

from __future__ import annotations

from packaging.version import InvalidVersion, Version


def parse(version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion as error:
        raise ValueError(f"not a version: {version!r}") from error


def version_at_least(version: str, minimum: str) -> bool:
    """True when `version` is `minimum` or newer. Dev and rc builds of a release count as that release: a
    0.25.0rc1 already carries what 0.25.0 does for the features recipes gate on."""
    return parse(version).release >= parse(minimum).release
