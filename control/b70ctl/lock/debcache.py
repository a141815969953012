"""The controller's content-addressed .deb cache, the lock file on disk, and `lock check` of a host's packages.

Each locked .deb is fetched once into CACHE/sha256/<hex> (resumable: a .partial file is continued with an HTTP
Range request), checked against the lock's sha256 and size before it is renamed into place, and fanned out to
the hosts from there. A file whose hash differs is refused with one line and never enters the cache; a cached
file is re-hashed before every fan-out, so a cache someone edited is caught too. Once cached, an index or a
.deb that disappears from its mirror changes nothing: the cache is the source of truth.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal, Protocol

from debian.debian_support import version_compare
from pydantic import Field, ValidationError

from b70ctl.documents import Pinned as Strict
from b70ctl.errors import BadInput, Refused, first_problem
from b70ctl.files import read_json_object, write_json_atomically
from b70ctl.lock.debs import ResolveError
from b70ctl.lock.debs_model import DebPin, Group, HostPackageLock, SeriesLock

# Where `lock resolve --host-packages` writes and the roles read, unless told otherwise: beside the release
# matrix the package set is read from.
DEFAULT_LOCK = Path(__file__).resolve().parents[1] / "host" / "packages.lock.json"
CHUNK = 1 << 20
TIMEOUT_S = 60.0


def http_get(url: str) -> bytes:
    """A whole (index) file; ResolveError in one line when the source cannot give it."""
    import httpx

    if url.startswith("file:"):
        try:
            return Path(url.removeprefix("file:").removeprefix("//")).read_bytes()
        except OSError as error:
            raise ResolveError(error.strerror or str(error)) from None
    try:
        response = httpx.get(url, timeout=TIMEOUT_S, follow_redirects=True)
    except httpx.HTTPError as error:
        raise ResolveError(f"unreachable ({type(error).__name__}: {error})") from None
    if response.status_code != 200:
        raise ResolveError(f"HTTP {response.status_code}")
    return response.content


def load_debs_lock(path: Path) -> HostPackageLock:
    fix = "re-run `b70ctl lock resolve --host-packages`, or restore the file from git"
    data = read_json_object(path, str(path), fix)
    try:
        return HostPackageLock.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"{path} is not a host package lock ({first_problem(error)}): {fix}") from None


def write_debs_lock(lock: HostPackageLock, path: Path) -> bool:
    """Write when the pins changed (the resolve time alone is not a change): False when nothing was written."""
    if path.is_file():
        try:
            previous = load_debs_lock(path)
        except BadInput:
            previous = None
        if previous is not None and previous.model_copy(update={"resolved_at": ""}) == \
                lock.model_copy(update={"resolved_at": ""}):
            return False
    write_json_atomically(path, lock.model_dump(mode="json"))
    return True


def series_lock(lock: HostPackageLock, codename: str, path: Path) -> SeriesLock:
    found = lock.series.get(codename)
    if found is None:
        raise BadInput(f"{path} locks no packages for {codename} (it has {', '.join(sorted(lock.series)) or 'none'}):"
                       f" run `b70ctl lock resolve --host-packages --series {codename}`")
    return found


def group_pins(one: SeriesLock, groups: list[Group], path: Path) -> list[DebPin]:
    """The pins of the groups (each once), refusing a group that is not resolved."""
    pins: dict[str, DebPin] = {}
    for group in groups:
        locked = one.groups.get(group)
        if locked is None:
            raise BadInput(f"{path}: {one.codename} has no {group} group: add it to the package set and run "
                           "`b70ctl lock resolve --host-packages`")
        if not locked.resolved:
            raise BadInput(f"{path}: {one.codename}/{group} is not resolved ({locked.reason}): run "
                           f"`b70ctl lock resolve --host-packages --series {one.codename}` where its indexes are "
                           "reachable")
        pins.update({pin.name: pin for pin in one.group_pins(group)})
    return sorted(pins.values(), key=lambda pin: pin.name)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stream(url: str, offset: int) -> Iterator[bytes]:
    import httpx

    if url.startswith("file:"):
        with Path(url.removeprefix("file:").removeprefix("//")).open("rb") as stream:
            stream.seek(offset)
            while chunk := stream.read(CHUNK):
                yield chunk
        return
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    with httpx.stream("GET", url, headers=headers, timeout=TIMEOUT_S, follow_redirects=True) as response:
        if offset and response.status_code == 200:  # the server ignored the range: start over
            raise _RangeIgnored
        if response.status_code not in (200, 206):
            raise ResolveError(f"HTTP {response.status_code}")
        yield from response.iter_bytes(CHUNK)


class _RangeIgnored(Exception):
    pass


class Fetchable(Protocol):
    """A file known by content: a lock's .deb pin, or a .deb a release matrix names (host/releases.py DebMember)."""

    @property
    def url(self) -> str: ...
    @property
    def sha256(self) -> str: ...
    @property
    def size_bytes(self) -> int: ...
    @property
    def filename(self) -> str: ...


def cache_path(cache: Path, pin: Fetchable) -> Path:
    return cache / "sha256" / pin.sha256


def fetch_pin(pin: Fetchable, cache: Path) -> tuple[Path, bool]:
    """(the cached file, whether it was downloaded now). BadInput in one line when the source's file differs from
    the lock or cannot be had; nothing but a resumable .partial is ever left behind. Several fetches at once (the
    play's forks, one per host) take turns per file: the first downloads, the others find it cached."""
    import fcntl

    final = cache_path(cache, pin)
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(final.name + ".lock"), "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        return _fetch_pin_locked(pin, cache, final)


def _fetch_pin_locked(pin: Fetchable, cache: Path, final: Path) -> tuple[Path, bool]:
    if final.is_file():
        if final.stat().st_size == pin.size_bytes and _sha256_of(final) == pin.sha256:
            return final, False
        final.unlink()  # edited or truncated in the cache: fetch it again
    partial = final.with_name(final.name + ".partial")
    for attempt in range(2):
        offset = partial.stat().st_size if partial.is_file() and attempt == 0 else 0
        if offset > pin.size_bytes:
            offset = 0
        try:
            with partial.open("ab" if offset else "wb") as out:
                for chunk in _stream(pin.url, offset):
                    out.write(chunk)
                    if out.tell() > pin.size_bytes:
                        break
            break
        except _RangeIgnored:
            continue
        except (ResolveError, OSError) as error:
            raise BadInput(f"{pin.filename}: cannot fetch {pin.url} ({error}); the lock still names it: fetch it "
                           "where the source is reachable, or copy it into the cache as "
                           f"{final.relative_to(cache)}") from None
        except Exception as error:  # noqa: BLE001 httpx's transport errors, whatever their class
            raise BadInput(f"{pin.filename}: cannot fetch {pin.url} ({type(error).__name__}: {error}): fetch it "
                           "where the source is reachable") from None
    actual = _sha256_of(partial)
    if actual != pin.sha256 or partial.stat().st_size != pin.size_bytes:
        partial.unlink()
        raise Refused(f"{pin.filename}: sha256 {actual} of {pin.url} differs from the lock's {pin.sha256}: the "
                       "source changed the file; nothing was cached (to accept a new build: `b70ctl lock resolve "
                       "--host-packages`)")
    os.replace(partial, final)
    return final, True


class FetchedDeb(Strict):
    name: str
    version: str
    filename: str
    sha256: str
    cache_path: str
    downloaded: bool


class FetchResult(Strict):
    series: str
    groups: list[Group]
    cache: str
    downloaded: int
    packages: list[FetchedDeb]
    host_dir: str
    sha256sums: str  # for `sha256sum --check --strict` on the host, paths in host_dir


def fetch_groups(one: SeriesLock, groups: list[Group], cache: Path, host_dir: str, path: Path) -> FetchResult:
    fetched = []
    for pin in group_pins(one, groups, path):
        file, downloaded = fetch_pin(pin, cache)
        fetched.append(FetchedDeb(name=pin.name, version=pin.version, filename=pin.filename, sha256=pin.sha256,
                                  cache_path=str(file), downloaded=downloaded))
    return FetchResult(series=one.codename, groups=groups, cache=str(cache),
                       downloaded=sum(item.downloaded for item in fetched), packages=fetched, host_dir=host_dir,
                       sha256sums="".join(f"{item.sha256}  {host_dir.rstrip('/')}/{item.filename}\n"
                                          for item in fetched))


# ------------------------------------------------------------------------------------------------ lock check
# What the role asks dpkg-query for: status, name, version, architecture of every installed package.
DPKG_FORMAT = "${db:Status-Abbrev} ${Package} ${Version} ${Architecture}\\n"


class PackageDrift(Strict):
    name: str
    expected: str
    actual: str | None = None
    kind: Literal["missing", "older", "newer", "different"] = Field(
        "different", description="missing; older or newer than the lock; another version or architecture")
    origin: str | None = Field(None, description="newer only: where the installed version comes from, when known")


class PackageUpdate(Strict):
    """A package newer than the lock from its release's own -security or -updates pocket: what Ubuntu publishes
    for that release and unattended-upgrades installs. Not drift: the appliance takes it, never downgrades it."""

    name: str
    locked: str
    installed: str
    origin: str


class HostPackageState(Strict):
    """What the role reads on a host for `lock check --host-state`: dpkg's view, and apt's view of where the
    installed versions of some packages come from (empty until the check asks for it)."""

    dpkg: str = Field(description=f"dpkg-query --show --showformat='{DPKG_FORMAT}'")
    apt_policy: str = Field("", description="apt-cache policy NAME... of the packages the check asked about")


class PackageCheck(Strict):
    host: str
    series: str
    groups: list[Group]
    ok: bool
    drift: list[PackageDrift]
    install_paths: list[str]  # the .debs (in the host directory) to install to match the lock
    hold: list[str]  # packages the role holds that are not held yet (the ones installed now included)
    unhold: list[str] = Field(default_factory=list, description="Locked packages held on the host that the role "
                              "no longer holds (an older release held them): apt-mark unhold")
    downgrades: list[str] = Field(default_factory=list, description="Held packages installed above the lock: only "
                                  "these are installed with --allow-downgrades")
    updates: list[PackageUpdate] = Field(default_factory=list)
    origin_unknown: list[str] = Field(default_factory=list, description="Newer than the lock, and where from is "
                                      "not known yet: give `apt-cache policy` of these (--host-state)")
    message: str


def read_dpkg(text: str) -> dict[str, tuple[str, str, bool]]:
    """dpkg-query lines (DPKG_FORMAT) -> {name: (version, architecture, held)} of the installed packages
    ('ii', 'hi': the second letter i; the first h for a hold)."""
    installed: dict[str, tuple[str, str, bool]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 4 or len(parts[0]) < 2:
            if line.strip():
                raise BadInput(f"cannot read the dpkg-query line {line.strip()[:80]!r}: give the output of "
                               f"dpkg-query --show --showformat='{DPKG_FORMAT}'")
            continue
        status, name, version, architecture = parts
        if status[1] == "i":
            installed[name.split(":", 1)[0]] = (version, architecture, status[0] == "h")
    return installed


# apt-cache policy (apt's cmdline/apt-cache.cc Policy): "name:" at the margin, then "  Installed: V", then the
# version table: " *** V PRIO" marks the installed version, and each of its origins follows indented as
# "        PRIO URI SUITE/COMPONENT ARCH Packages" (or "        100 /var/lib/dpkg/status").
_POLICY_PACKAGE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9+.-]+)(:[a-z0-9-]+)?:$")
_POLICY_VERSION = re.compile(r"^ (\*\*\*| {3}) (?P<version>\S+) -?\d+$")
_POLICY_ORIGIN = re.compile(r"^ {6,}-?\d+ (?P<uri>\S+) (?P<suite>[^/\s]+)(/\S+)? \S+ Packages$")


def read_apt_policy(text: str) -> dict[str, list[tuple[str, str]]]:
    """apt-cache policy output -> {name: [(suite, uri), ...]} for the installed version of each package named."""
    origins: dict[str, list[tuple[str, str]]] = {}
    name: str | None = None
    in_installed = False
    for line in text.splitlines():
        if match := _POLICY_PACKAGE.match(line):
            name, in_installed = match["name"], False
            origins.setdefault(name, [])
        elif name is not None and (match := _POLICY_VERSION.match(line)):
            in_installed = line.startswith(" ***")
        elif name is not None and in_installed and (match := _POLICY_ORIGIN.match(line)):
            origins[name].append((match["suite"], match["uri"]))
    return origins


def update_pocket(codename: str, origins: list[tuple[str, str]], archives: set[str]) -> str | None:
    """Where an installed version newer than the lock comes from, as "SUITE (URI)", when that is its release's own
    updates: the -security or -updates pocket from any mirror (what unattended-upgrades' default Allowed-Origins,
    ${distro_codename}-security, and Ubuntu's stable release updates publish), or the release suite itself from an
    archive the lock was resolved from (Debian's point releases). None for anything else: a PPA's "noble" suite is
    not Ubuntu's."""
    for suite, uri in origins:
        if suite in (f"{codename}-security", f"{codename}-updates") or \
                (suite == codename and uri.rstrip("/") in archives):
            return f"{suite} ({uri})"
    return None


def check_host(one: SeriesLock, groups: list[Group], dpkg_text: str, host: str, path: Path,
               host_dir: str = "/var/cache/b70/debs", hold: Iterable[str] = (),
               apt_policy: str | None = None) -> PackageCheck:
    """Each locked package of the groups against what the host has installed.

    The locked version is a floor, except for the packages the role holds (`hold`: the ones the appliance needs
    at exactly that version). Missing or older: installed from the lock. Newer: a held package is put back
    (the only downgrade); any other is left as it is, and is no drift when apt says it came from the release's
    own -security or -updates pocket (an update, as unattended-upgrades would install). Where it came from is
    read from `apt_policy`; without it, the newer packages are listed in origin_unknown."""
    installed = read_dpkg(dpkg_text)
    pins = group_pins(one, groups, path)
    held_names = set(hold)
    unknown = sorted(held_names - {pin.name for pin in pins})
    if unknown:
        raise BadInput(f"--hold {unknown[0]}: not a locked package of {'/'.join(groups)} on {one.codename}: hold "
                       "only packages the lock pins")
    origins = read_apt_policy(apt_policy) if apt_policy else {}
    archives = {index.url.split("/dists/", 1)[0].rstrip("/") for index in one.indexes}
    drift: list[PackageDrift] = []
    install: list[str] = []
    holds: list[str] = []
    unhold: list[str] = []
    downgrades: list[str] = []
    updates: list[PackageUpdate] = []
    origin_unknown: list[str] = []
    for pin in pins:
        have = installed.get(pin.name)
        exact = pin.name in held_names
        expected = f"{pin.version} {pin.architecture}"
        if have is not None and have[0] == pin.version and have[1] == pin.architecture:
            pass
        elif have is None or have[1] != pin.architecture or version_compare(have[0], pin.version) < 0:
            kind: Literal["missing", "older", "newer", "different"] = (
                "missing" if have is None else "different" if have[1] != pin.architecture else "older")
            drift.append(PackageDrift(name=pin.name, expected=expected,
                                      actual=f"{have[0]} {have[1]}" if have else None, kind=kind))
            install.append(f"{host_dir.rstrip('/')}/{pin.filename}")
        elif exact:
            drift.append(PackageDrift(name=pin.name, expected=expected, actual=f"{have[0]} {have[1]}", kind="newer"))
            install.append(f"{host_dir.rstrip('/')}/{pin.filename}")
            downgrades.append(pin.name)
        elif apt_policy is None or pin.name not in origins:
            origin_unknown.append(pin.name)
        elif (pocket := update_pocket(one.codename, origins[pin.name], archives)) is not None:
            updates.append(PackageUpdate(name=pin.name, locked=pin.version, installed=have[0], origin=pocket))
        else:
            elsewhere = ", ".join(f"{suite} ({uri})" for suite, uri in origins[pin.name]) or "no index (a local file)"
            drift.append(PackageDrift(name=pin.name, expected=expected, actual=f"{have[0]} {have[1]}", kind="newer",
                                      origin=elsewhere))
        if exact and (have is None or not have[2]):
            holds.append(pin.name)
        if not exact and have is not None and have[2]:
            unhold.append(pin.name)
    parts = []
    if drift:
        shown = ", ".join(f"{item.name} {item.actual.split()[0] if item.actual else 'not installed'} "
                          f"(lock: {item.expected.split()[0]}{', from ' + item.origin if item.origin else ''})"
                          for item in drift[:5])
        more = f" and {len(drift) - 5} more" if len(drift) > 5 else ""
        parts.append(f"{len(drift)} package(s) differ from the lock for {one.codename}: {shown}{more}")
    if origin_unknown:
        parts.append(f"{len(origin_unknown)} newer than the lock, origin not read: {', '.join(origin_unknown)} "
                     "(give apt-cache policy of them with --host-state)")
    if not parts:
        parts.append(f"the {'/'.join(groups)} packages match the lock for {one.codename}")
    if updates:
        parts.append(f"{len(updates)} security or stable update(s) kept: "
                     + ", ".join(f"{item.name} {item.installed} from {item.origin.split()[0]}" for item in updates))
    return PackageCheck(host=host, series=one.codename, groups=groups, ok=not drift and not origin_unknown,
                        drift=drift, install_paths=install, hold=holds, unhold=unhold, downgrades=downgrades,
                        updates=updates, origin_unknown=origin_unknown, message=f"{host}: " + "; ".join(parts))
