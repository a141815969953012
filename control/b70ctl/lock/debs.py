"""Resolve the host package set against the real apt indexes: `b70ctl lock resolve --host-packages`.

For each release the indexes are read as apt reads them: the suite's InRelease, then each component's Packages
file, checked against the sha256 InRelease lists for it. Each group's requests are taken from the source they
name, at the newest version there; their Depends and Pre-Depends are followed through every index of the
release (newest satisfying version; a virtual package by its providers), as apt would with
--no-install-recommends. What every host carries already is not locked: the base, the closure of the packages
marked Essential or Priority required and of apt, which is exactly what `debootstrap --variant=minbase` installs (and so
what any Debian or Ubuntu system has; apt itself is Priority important on Ubuntu, and minbase adds it by name).
A host installs the locked files with apt given no source at all, so a dependency outside the lock and the base
fails the install instead of coming from the network.

InRelease signatures are not verified here (the sha256 chain from InRelease down to each .deb is); resolve from
a mirror you trust.
"""

from __future__ import annotations

import bz2
import datetime as dt
import gzip
import hashlib
import lzma
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cmp_to_key

from debian.deb822 import Packages, PkgRelation, Release
from debian.debian_support import version_compare

from b70ctl.lock.debs_model import (
    GROUPS,
    DebPin,
    Group,
    GroupLock,
    HostPackageLock,
    IndexSource,
    LockedIndex,
    PackageSet,
    SeriesLock,
    SeriesSet,
)

BASE_DESCRIPTION = ("Essential and Priority required packages, apt, and their dependencies (debootstrap "
                    "--variant=minbase): on every host already, not locked")
# debootstrap's minbase: "only includes essential packages and apt" (debootstrap(8)); its required list is the
# Priority required packages.
MINBASE_EXTRA = ("apt",)
Fetch = Callable[[str], bytes]
# Debian policy 5.6.1: a package name (lower case letters, digits, + - .; at least two characters).
_PACKAGE_NAME = re.compile(r"[a-z0-9][a-z0-9+.-]+")
_COMPRESSIONS: tuple[tuple[str, Callable[[bytes], bytes]], ...] = (
    (".xz", lzma.decompress), (".gz", gzip.decompress), (".bz2", bz2.decompress), ("", lambda data: data))


class ResolveError(Exception):
    """One line: why an index or a group could not be resolved."""


@dataclass(frozen=True)
class Candidate:
    name: str
    version: str
    architecture: str
    depends: str
    provides: tuple[str, ...]
    base: bool
    filename: str
    size: int
    sha256: str
    source: str
    index: str
    uri: str


@dataclass
class SeriesIndex:
    """Every entry of a release's indexes, by name and by what they provide."""

    by_name: dict[str, list[Candidate]] = field(default_factory=dict)
    providers: dict[str, list[Candidate]] = field(default_factory=dict)
    locked: list[LockedIndex] = field(default_factory=list)

    def add(self, candidate: Candidate) -> None:
        self.by_name.setdefault(candidate.name, []).append(candidate)
        for virtual in candidate.provides:
            self.providers.setdefault(virtual, []).append(candidate)


def _newer_first(a: Candidate, b: Candidate) -> int:
    return version_compare(b.version, a.version)


def _newest_first(candidates: Iterable[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=cmp_to_key(_newer_first))


def satisfies(version: str, op: str | None, wanted: str | None) -> bool:
    """Debian policy 7.1: << <= = >= >> (and the obsolete < > as <= >=)."""
    if op is None or wanted is None:
        return True
    order = version_compare(version, wanted)
    return {"<<": order < 0, "<=": order <= 0, "<": order <= 0, "=": order == 0, ">=": order >= 0,
            ">>": order > 0, ">": order >= 0}[op]


def parse_relations(text: str) -> list[list[tuple[str, str | None, str | None]]]:
    """'a (>= 1) | b, c' -> [[(a, '>=', '1'), (b, None, None)], [(c, None, None)]], read by python-debian's
    PkgRelation (Debian policy 7.1). It hands back a relation it cannot read as a raw name: that is refused."""
    relations: list[list[tuple[str, str | None, str | None]]] = []
    if not text.strip():
        return relations
    for clause in PkgRelation.parse_relations(text):
        alternatives = []
        for alternative in clause:
            if not _PACKAGE_NAME.fullmatch(alternative["name"]):
                raise ResolveError(f"cannot read the relation {alternative['name'].strip()!r}")
            op, version = alternative["version"] or (None, None)
            alternatives.append((alternative["name"], op, version))
        relations.append(alternatives)
    return relations


def release_hashes(inrelease: str) -> dict[str, tuple[str, int]]:
    """The SHA256 section of a (clear-signed) InRelease: path -> (sha256, size)."""
    return {entry["name"]: (entry["sha256"], int(entry["size"])) for entry in Release(inrelease).get("SHA256", [])}


def read_index(fetch: Fetch, index: IndexSource, architecture: str, into: SeriesIndex) -> None:
    base = index.uri.rstrip("/")
    release_url = f"{base}/dists/{index.suite}/InRelease"
    try:
        release = fetch(release_url)
    except ResolveError as error:
        raise ResolveError(f"{index.source}: {release_url}: {error}") from None
    hashes = release_hashes(release.decode("utf-8", "replace"))
    release_sha = hashlib.sha256(release).hexdigest()
    for component in index.components:
        stem = f"{component}/binary-{architecture}/Packages"
        suffix, decompress = next(((suffix, decompress) for suffix, decompress in _COMPRESSIONS
                                   if stem + suffix in hashes), (None, None))
        if suffix is None or decompress is None:
            raise ResolveError(f"{index.source}: {release_url} lists no {stem} index: check the suite and "
                               "components of the source")
        url = f"{base}/dists/{index.suite}/{stem}{suffix}"
        data = fetch(url)
        expected = hashes[stem + suffix][0]
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise ResolveError(f"{index.source}: {url} has sha256 {actual[:16]}..., InRelease says "
                               f"{expected[:16]}...: the mirror is mid-sync or tampered with; resolve again later")
        into.locked.append(LockedIndex(source=index.source, url=url, sha256=actual, release_url=release_url,
                                       release_sha256=release_sha))
        for entry in Packages.iter_paragraphs(decompress(data).decode("utf-8", "replace").splitlines(),
                                              use_apt_pkg=False):
            if entry.get("Architecture") not in (architecture, "all") or "Filename" not in entry:
                continue
            into.add(Candidate(
                name=entry["Package"], version=entry["Version"], architecture=entry["Architecture"],
                depends=", ".join(filter(None, (entry.get("Pre-Depends", ""), entry.get("Depends", "")))),
                provides=tuple(alternative[0][0] for alternative in parse_relations(entry.get("Provides", ""))),
                base=(entry.get("Essential") == "yes" or entry.get("Priority") == "required"
                      or entry["Package"] in MINBASE_EXTRA),
                filename=entry["Filename"], size=int(entry.get("Size", "0")), sha256=entry.get("SHA256", ""),
                source=index.source, index=url, uri=base))


def base_names(index: SeriesIndex) -> set[str]:
    """Names in the minbase closure (every alternative a base package could take counts as base: a host has one
    of them, and apt on the host checks which)."""
    names: set[str] = set()
    pending = [candidate for candidates in index.by_name.values() for candidate in candidates if candidate.base]
    while pending:
        candidate = pending.pop()
        if candidate.name in names:
            continue
        names.add(candidate.name)
        for alternatives in parse_relations(candidate.depends):
            for name, _, _ in alternatives:
                pending.extend(index.by_name.get(name, []) or index.providers.get(name, []))
    return names


def _pick(index: SeriesIndex, name: str, op: str | None, wanted: str | None) -> Candidate | None:
    real = [candidate for candidate in _newest_first(index.by_name.get(name, []))
            if satisfies(candidate.version, op, wanted)]
    if real:
        return real[0]
    if op is None:  # a virtual package: unversioned relations only (policy 7.5), its first provider by name
        providers = sorted(index.providers.get(name, []), key=lambda candidate: candidate.name)
        return _newest_first(providers)[0] if providers else None
    return None


def resolve_group(index: SeriesIndex, base: set[str], one: SeriesSet, group: Group,
                  chosen: dict[str, Candidate]) -> list[str]:
    """Add the group's closure to `chosen`; the names the group pulled in, or ResolveError naming the gap."""
    pulled: list[str] = []
    pending: list[tuple[Candidate, str]] = []
    for request in one.groups.get(group, []):
        candidates = _newest_first(candidate for candidate in index.by_name.get(request.name, [])
                                   if candidate.source == request.source)
        if not candidates:
            raise ResolveError(f"{request.name} is not in the {request.source} indexes of {one.codename}")
        pending.append((chosen.get(request.name, candidates[0]), f"{group} asks for it"))
    while pending:
        candidate, why = pending.pop(0)
        if candidate.name in pulled:
            continue
        previous = chosen.get(candidate.name)
        if previous is not None and previous.version != candidate.version:
            raise ResolveError(f"{candidate.name} is needed at {candidate.version} ({why}) and at "
                               f"{previous.version}: no single locked set satisfies both")
        chosen[candidate.name] = candidate
        pulled.append(candidate.name)
        for alternatives in parse_relations(candidate.depends):
            if any(name in base for name, _, _ in alternatives):
                continue
            held = next((chosen[name] for name, op, wanted in alternatives
                         if name in chosen and satisfies(chosen[name].version, op, wanted)), None)
            if held is not None:
                pending.append((held, f"{candidate.name} depends on it"))
                continue
            picked = next(filter(None, (_pick(index, *alternative) for alternative in alternatives)), None)
            if picked is None:
                wanted = " | ".join(name + (f" ({op} {version})" if op else "") for name, op, version in alternatives)
                raise ResolveError(f"{candidate.name} depends on {wanted}, which no index of {one.codename} "
                                   "carries")
            pending.append((picked, f"{candidate.name} depends on it"))
    return pulled


def resolve_series(fetch: Fetch, one: SeriesSet, previous: SeriesLock | None) -> SeriesLock:
    index = SeriesIndex()
    failure: str | None = None
    for source in one.indexes:
        try:
            read_index(fetch, source, one.architecture, index)
        except ResolveError as error:
            failure = failure or str(error)
    unreadable = {source.source for source in one.indexes} - {locked.source for locked in index.locked}
    base = base_names(index)
    chosen: dict[str, Candidate] = {}
    groups: dict[Group, GroupLock] = {}
    members: dict[str, list[Group]] = {}
    kept: list[DebPin] = []
    for group in GROUPS:
        if group not in one.groups:
            continue
        requested = [request.name for request in one.groups[group]]
        reason: str | None = None
        needs = {request.source for request in one.groups[group]}
        if needs & unreadable:
            reason = failure
        else:
            try:
                for name in resolve_group(index, base, one, group, chosen):
                    members.setdefault(name, []).append(group)
            except ResolveError as error:
                reason = str(error)
        if reason is None:
            groups[group] = GroupLock(requested=requested, resolved=True)
            continue
        earlier = previous.groups.get(group) if previous is not None else None
        if earlier is not None and earlier.resolved and previous is not None and earlier.requested == requested:
            groups[group] = GroupLock(requested=requested, resolved=True, reason=reason, kept_previous=True)
            kept.extend(previous.group_pins(group))
        else:
            groups[group] = GroupLock(requested=requested, resolved=False, reason=reason)
    pins = {name: DebPin(name=name, version=candidate.version, architecture=candidate.architecture,
                         sha256=candidate.sha256, size_bytes=candidate.size, source=candidate.source,
                         index=candidate.index, url=f"{candidate.uri}/{candidate.filename}",
                         groups=members[name])
            for name, candidate in chosen.items() if name in members}
    for pin in kept:
        if pin.name in pins and pins[pin.name].version != pin.version:
            raise ResolveError(f"{one.codename}: {pin.name} is locked at {pin.version} by a kept group and "
                               f"resolves to {pins[pin.name].version} now: resolve when every index is readable")
        existing = pins.get(pin.name)
        pins[pin.name] = pin if existing is None else existing.model_copy(
            update={"groups": sorted({*existing.groups, *pin.groups}, key=GROUPS.index)})
    return SeriesLock(codename=one.codename, architecture=one.architecture, base=BASE_DESCRIPTION,
                      base_packages=len(base), indexes=index.locked, groups=groups,
                      packages=sorted(pins.values(), key=lambda pin: pin.name))


def resolve_package_set(fetch: Fetch, package_set: PackageSet, previous: HostPackageLock | None,
                        only: list[str] | None = None,
                        now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC)
                        ) -> HostPackageLock:
    """A new lock; releases not in `only` keep their previous pins unchanged."""
    series: dict[str, SeriesLock] = {}
    for codename, one in package_set.series.items():
        earlier = previous.series.get(codename) if previous is not None else None
        if only and codename not in only and earlier is not None:
            series[codename] = earlier
            continue
        series[codename] = resolve_series(fetch, one, earlier)
    return HostPackageLock(resolved_at=now().replace(microsecond=0).isoformat(), series=series)
