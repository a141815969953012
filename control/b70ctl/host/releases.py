"""The Ubuntu releases the appliance provisions and the ones it refuses, from one data file (releases.yaml beside
this module): codename, version, support state, end-of-life date, the kernel a B70 needs on it and where each
package family comes from, each fact with the source it was read from.

Another matrix file of the same schema may stand in for it (`--releases FILE`, the b70_release_matrix variable):
the Debian test hosts are given one naming Debian's own kernel, so host_kernel's install path runs on them.

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

from pydantic import Field, ValidationError, model_validator

from b70ctl.documents import Pinned as _Model
from b70ctl.errors import BadInput, first_problem
from b70ctl.files import load_yaml_unique, read_yaml_mapping

DATA_FILE = "releases.yaml"


class GucRecord(_Model):
    """The GuC release a firmware package carries, and where that was read: from the blob's header when the package
    could be fetched and read, else the field report that names it."""

    release: str = Field(pattern=r"^\d+\.\d+\.\d+$")
    read_from: str = Field(min_length=1)


class DebMember(_Model):
    """One file inside a .deb, by content: the package's URL and sha256, and the member's path in its data."""

    url: str = Field(pattern=r"^(https?://|file:/).+\.deb$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(gt=0)
    member: str = Field(pattern=r"^\./[A-Za-z0-9_./+-]+$", description="As dpkg-deb -c lists it")

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]


class GucOverride(_Model):
    """A good GuC blob for a release whose own firmware package carries a refused one: installed by content in
    /lib/firmware/updates, where the kernel's firmware loader looks first, so the archive's file stays as it is
    (and takes its updates) and the kernel loads this one."""

    file: str = Field(pattern=r"^xe/[a-z0-9_]+\.bin$", description="Relative to /lib/firmware, as the driver asks")
    guc: str = Field(pattern=r"^\d+\.\d+\.\d+$", description="The GuC release its header carries")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(gt=0)
    deb: DebMember
    read_from: str = Field(min_length=1)

    @property
    def host_path(self) -> str:
        return f"/lib/firmware/updates/{self.file}"


class PackageFrom(_Model):
    package: str | None = None
    packages: list[str] = Field(default_factory=list, description="Several packages of one family (gpu_runtime)")
    source: str = Field(description="The key of the matrix's indexes this package family is read from")
    series: str | None = Field(None, description="Kernel series the package brings (kernel only), e.g. 6.17")
    guc: GucRecord | None = Field(None, description="Firmware only: the GuC its xe/bmg_guc_70.bin carries, when known")
    guc_override: GucOverride | None = Field(None, description="Firmware only: the GuC installed in its place when "
                                                               "`guc` is one the appliance refuses")

    @property
    def names(self) -> list[str]:
        return ([self.package] if self.package else []) + self.packages


class IndexTemplate(_Model):
    """An apt source of a release: suites written with {codename}."""

    uri: str
    suites: list[str] = Field(min_length=1)
    components: list[str] = Field(min_length=1)


class Release(_Model):
    distribution: str = Field("Ubuntu", description="As Ansible names it (ansible_facts.distribution)")
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
        return f"{self.distribution} {self.version}{' LTS' if self.lts else ''} ({self.codename})"

    @property
    def parts(self) -> dict[str, PackageFrom]:
        return {name: part for name in ("kernel", "firmware", "gpu_runtime", "container_engine")
                if (part := getattr(self, name)) is not None}


class ReleaseMatrix(_Model):
    schema_version: Literal[1]
    read_on: str
    sources: dict[str, str]
    upgrade: str
    indexes: dict[str, IndexTemplate]
    releases: list[Release]

    @model_validator(mode="after")
    def _every_fact_has_a_source(self) -> ReleaseMatrix:
        for release in self.releases:
            unknown = sorted(set(release.read_from) - set(self.sources))
            if unknown or not release.read_from:
                raise ValueError(f"{release.codename}: read_from names no source or unknown ones {unknown}")
            no_index = sorted({part.source for part in release.parts.values()} - set(self.indexes))
            if no_index:
                raise ValueError(f"{release.codename}: packages come from {no_index}, which indexes does not list")
        return self

    def package_set(self) -> dict[str, object]:
        """What `b70ctl lock resolve --host-packages` resolves by default: per supported release, the indexes of
        the sources it takes packages from and the packages of each group (a PackageSet document)."""
        series: dict[str, object] = {}
        for release in self.supported:
            groups: dict[str, list[dict[str, str]]] = {}
            for group, parts in (("kernel", (release.kernel, release.firmware)),
                                 ("gpu_runtime", (release.gpu_runtime,)),
                                 ("container_engine", (release.container_engine,))):
                groups[group] = [{"name": name, "source": part.source} for part in parts if part is not None
                                 for name in part.names]
            sources = sorted({request["source"] for requests in groups.values() for request in requests})
            indexes = [{"source": source, "uri": self.indexes[source].uri,
                        "suite": suite.format(codename=release.codename),
                        "components": self.indexes[source].components}
                       for source in sources for suite in self.indexes[source].suites]
            series[release.codename] = {"codename": release.codename, "indexes": indexes, "groups": groups}
        return {"series": series}

    def find(self, codename: str, distribution: str | None = None) -> Release | None:
        """The release of that codename (and distribution, when given: Debian's bookworm is no Ubuntu release)."""
        return next((release for release in self.releases if release.codename == codename.lower()
                     and (distribution is None or release.distribution.lower() == distribution.lower())), None)

    @property
    def supported(self) -> list[Release]:
        return [release for release in self.releases if release.support == "supported"]


@cache
def load_matrix(path: str | None = None) -> ReleaseMatrix:
    """The appliance's own matrix, or the file at `path` (the same schema)."""
    if path:
        name = path
        data = read_yaml_mapping(path, name, "give a release matrix of the schema of control/b70ctl/host/releases.yaml")
    else:
        name = f"b70ctl/host/{DATA_FILE}"
        data = load_yaml_unique(resources.files("b70ctl.host").joinpath(DATA_FILE).read_text(encoding="utf-8"), name)
    try:
        return ReleaseMatrix.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"{name} is invalid ({first_problem(error)}): fix the release matrix") from None


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
    release = matrix.find(codename, distribution)
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
