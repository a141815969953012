"""The host package lock: every .deb the roles install on a host, by content (Nix-style), one JSON document.

A package set (which packages each role asks for, on which release, from which apt indexes) moves: a PPA keeps
only its newest build per series, a mirror takes point releases. The lock records what they were when
`b70ctl lock resolve --host-packages` last read the indexes: for each package its name, version, architecture,
sha256, size, the index it was read from and the URL of its .deb. Hosts install exactly those files (the
controller's content-addressed cache is the source of truth), so nothing an index does later changes a locked
fleet; updating is an explicit resolve.

A group (kernel, gpu_runtime, container_engine: one per role that installs packages) is resolved or not, with the
reason; nothing is guessed, and the validators refuse a group that claims to be resolved without pins.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from b70ctl.documents import Pinned as Strict

SHA256_HEX = r"^[0-9a-f]{64}$"
# Debian policy 5.6.1 (Package) and 5.6.12 (Version): what dpkg accepts, so a name or version can go into argv,
# a file name or a URL path without quoting.
PACKAGE_NAME = r"^[a-z0-9][a-z0-9+.-]+$"
PACKAGE_VERSION = r"^([0-9]+:)?[0-9A-Za-z.+~-]+$"
GROUPS = ("kernel", "gpu_runtime", "container_engine")
Group = Literal["kernel", "gpu_runtime", "container_engine"]


class IndexSource(Strict):
    """One apt source as a sources.list line names it: URI, suite, components."""

    source: str = Field(description="Name of the source: ubuntu-archive, kobuk-team-ppa, debian, ...")
    uri: str
    suite: str
    components: list[str] = Field(min_length=1)


class Request(Strict):
    name: str = Field(pattern=PACKAGE_NAME)
    source: str = Field(description="The source the package must come from (its dependencies come from any)")


class SeriesSet(Strict):
    """What the roles ask for on one release: the indexes apt would read there and each group's packages."""

    codename: str
    architecture: str = "amd64"
    indexes: list[IndexSource] = Field(min_length=1)
    groups: dict[Group, list[Request]]


class PackageSet(Strict):
    """The input of `lock resolve --host-packages`: per release, what to resolve (from the release matrix by
    default; the appliance tests give one for their Debian hosts)."""

    series: dict[str, SeriesSet]

    @model_validator(mode="after")
    def _sources_exist(self) -> PackageSet:
        for codename, one in self.series.items():
            known = {index.source for index in one.indexes}
            for group, requests in one.groups.items():
                for request in requests:
                    if request.source not in known:
                        raise ValueError(f"{codename}/{group}: {request.name} comes from {request.source!r}, "
                                         f"which no index of the series names ({', '.join(sorted(known))})")
        return self


class LockedIndex(Strict):
    """A Packages index as read: its URL and sha256 (checked against the suite's InRelease, whose own sha256 is
    kept too), so a lock says exactly which state of the archive it was resolved from."""

    source: str
    url: str
    sha256: str = Field(pattern=SHA256_HEX)
    release_url: str
    release_sha256: str = Field(pattern=SHA256_HEX)


class DebPin(Strict):
    name: str = Field(pattern=PACKAGE_NAME)
    version: str = Field(pattern=PACKAGE_VERSION)
    architecture: str = Field(pattern=r"^[a-z0-9-]+$")
    sha256: str = Field(pattern=SHA256_HEX)
    size_bytes: int = Field(gt=0)
    source: str
    index: str = Field(description="URL of the Packages index the entry was read from")
    url: str = Field(description="URL of the .deb")
    groups: list[Group] = Field(min_length=1, description="The groups whose requests pulled this package in")

    @field_validator("url")
    @classmethod
    def _deb_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://", "file:/")) or not url.endswith(".deb"):
            raise ValueError(f"{url!r} is not the URL of a .deb: re-resolve the lock from a trusted index")
        return url

    @property
    def filename(self) -> str:
        """The name dpkg-deb gives it: name_version_arch.deb, the epoch dropped (':' is not for file names)."""
        return f"{self.name}_{self.version.split(':', 1)[-1]}_{self.architecture}.deb"


class GroupLock(Strict):
    requested: list[str]
    resolved: bool
    reason: str | None = Field(None, description="Why the group is not resolved (the index or package missing)")
    kept_previous: bool = Field(False, description="This resolve failed; the pins are the previous lock's")


class SeriesLock(Strict):
    codename: str
    architecture: str
    base: str = Field(description="What a host is assumed to carry already: these are not locked")
    base_packages: int = Field(ge=0, description="How many packages the base is in the indexes read")
    indexes: list[LockedIndex]
    groups: dict[Group, GroupLock]
    packages: list[DebPin]

    @model_validator(mode="after")
    def _resolved_groups_have_pins(self) -> SeriesLock:
        for name, group in self.groups.items():
            pinned = [pin for pin in self.packages if name in pin.groups]
            if group.resolved and {request for request in group.requested} - {pin.name for pin in pinned}:
                raise ValueError(f"{self.codename}/{name} claims to be resolved but does not pin every requested "
                                 "package: re-resolve the lock")
            if not group.resolved and not group.reason:
                raise ValueError(f"{self.codename}/{name} is not resolved and says no reason")
        names = [pin.name for pin in self.packages]
        if len(names) != len(set(names)):
            raise ValueError(f"{self.codename}: a package is pinned twice")
        return self

    def group_pins(self, group: Group) -> list[DebPin]:
        return [pin for pin in self.packages if group in pin.groups]


class HostPackageLock(Strict):
    schema_version: Literal[1] = 1
    kind: Literal["host-packages"] = "host-packages"
    resolved_at: str
    series: dict[str, SeriesLock]
