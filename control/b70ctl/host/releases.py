"""The Ubuntu releases the appliance provisions and the ones it refuses, from one data file (releases.yaml beside
this module): codename, version, support state, end-of-life date, the kernel a B70 needs on it and where each
package family comes from, each fact with the source it was read from.

`release_verdict` is what preflight asks (`b70ctl host release`): a supported release passes; an end-of-life one is
refused naming its end-of-life date and the upgrade; an unknown one (or another distribution) naming the
supported ones. A release marked supported whose end-of-life date has passed is refused the same way, so the
matrix cannot silently outlive Ubuntu's support.
"""

from __future__ import annotations

import datetime as dt
from functools import cache
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from b70ctl.errors import BadInput, first_problem

DATA_FILE = "releases.yaml"
Source = Literal["ubuntu-archive", "kobuk-team-ppa"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PackageFrom(_Model):
    package: str | None = None
    packages: list[str] = Field(default_factory=list, description="Several packages of one family (gpu_runtime)")
    source: Source
    series: str | None = Field(None, description="Kernel series the package brings (kernel only), e.g. 6.17")

    @property
    def names(self) -> list[str]:
        return ([self.package] if self.package else []) + self.packages


class IndexTemplate(_Model):
    """An apt source of a release: suites written with {codename}."""

    uri: str
    suites: list[str] = Field(min_length=1)
    components: list[str] = Field(min_length=1)


class Release(_Model):
    codename: str
    version: str
    name: str
    lts: bool
    support: Literal["supported", "end-of-life"]
    released: dt.date
    end_of_life: dt.date
    kernel: PackageFrom | None = None
    firmware: PackageFrom | None = None
    gpu_runtime: PackageFrom | None = None
    container_engine: PackageFrom | None = None
    read_from: list[str]

    @model_validator(mode="after")
    def _supported_ones_say_what_to_install(self) -> Release:
        if self.support == "supported":
            missing = [part for part in ("kernel", "firmware", "gpu_runtime", "container_engine")
                       if getattr(self, part) is None]
            if missing or self.kernel is None or not self.kernel.package or not self.kernel.series:
                raise ValueError(f"{self.codename}: a supported release names its kernel (package and series), "
                                 f"firmware, gpu_runtime and container_engine; missing {missing or ['kernel']}")
        return self

    @property
    def title(self) -> str:
        return f"Ubuntu {self.version}{' LTS' if self.lts else ''} ({self.codename})"


class ReleaseMatrix(_Model):
    schema_version: Literal[1]
    read_on: str
    sources: dict[str, str]
    upgrade: str
    indexes: dict[Source, IndexTemplate]
    releases: list[Release]

    @model_validator(mode="after")
    def _every_fact_has_a_source(self) -> ReleaseMatrix:
        for release in self.releases:
            unknown = sorted(set(release.read_from) - set(self.sources))
            if unknown or not release.read_from:
                raise ValueError(f"{release.codename}: read_from names no source or unknown ones {unknown}")
        return self

    def package_set(self) -> dict[str, object]:
        """What `b70ctl lock resolve --host-packages` resolves by default: per supported release, the indexes of
        the sources it takes packages from and the packages of each group (a PackageSet document)."""
        series: dict[str, object] = {}
        for release in self.supported:
            groups: dict[str, list[dict[str, str]]] = {}
            for group, parts in (("kernel", (release.kernel, release.firmware)), ("gpu_runtime", (release.gpu_runtime,)),
                                 ("container_engine", (release.container_engine,))):
                groups[group] = [{"name": name, "source": part.source} for part in parts if part is not None
                                 for name in part.names]
            sources = sorted({request["source"] for requests in groups.values() for request in requests})
            indexes = [{"source": source, "uri": self.indexes[source].uri,  # type: ignore[index]
                        "suite": suite.format(codename=release.codename),
                        "components": self.indexes[source].components}  # type: ignore[index]
                       for source in sources for suite in self.indexes[source].suites]  # type: ignore[index]
            series[release.codename] = {"codename": release.codename, "indexes": indexes, "groups": groups}
        return {"series": series}

    def find(self, codename: str) -> Release | None:
        return next((release for release in self.releases if release.codename == codename.lower()), None)

    @property
    def supported(self) -> list[Release]:
        return [release for release in self.releases if release.support == "supported"]


@cache
def load_matrix() -> ReleaseMatrix:
    text = resources.files("b70ctl.host").joinpath(DATA_FILE).read_text(encoding="utf-8")
    try:
        return ReleaseMatrix.model_validate(yaml.safe_load(text))
    except ValidationError as error:
        raise BadInput(f"b70ctl/host/{DATA_FILE} is invalid ({first_problem(error)}): fix the release matrix") \
            from error


class ReleaseVerdict(_Model):
    supported: bool
    distribution: str
    codename: str
    message: str
    release: Release | None


def release_verdict(distribution: str, codename: str, today: dt.date | None = None,
                    matrix: ReleaseMatrix | None = None) -> ReleaseVerdict:
    """Is this distribution release one the appliance provisions? The message is one line naming the fix."""
    matrix = matrix or load_matrix()
    today = today or dt.date.today()
    supported = ", ".join(release.title for release in matrix.supported)
    release = matrix.find(codename) if distribution.lower() == "ubuntu" else None
    if release is None:
        return ReleaseVerdict(
            supported=False, distribution=distribution, codename=codename, release=None,
            message=f"{distribution} {codename or '(no codename)'} is not a release the appliance provisions: "
                    f"install one of {supported}")
    if release.support == "end-of-life" or release.end_of_life < today:
        return ReleaseVerdict(
            supported=False, distribution=distribution, codename=codename, release=release,
            message=f"{release.title} reached end of life on {release.end_of_life.isoformat()} and gets no more "
                    f"updates: {matrix.upgrade}; supported: {supported}")
    return ReleaseVerdict(supported=True, distribution=distribution, codename=codename, release=release,
                          message=f"{release.title}, supported until {release.end_of_life.isoformat()}")


def read_os_release(text: str | None) -> tuple[str, str]:
    """(NAME-ish distribution, VERSION_CODENAME) from /etc/os-release: ID=ubuntu -> Ubuntu, as Ansible names it."""
    values: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip().strip('"')
    identifier = values.get("ID", "")
    distribution = {"ubuntu": "Ubuntu", "debian": "Debian"}.get(identifier, identifier.capitalize())
    return distribution, values.get("VERSION_CODENAME", "")
