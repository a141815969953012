"""The host package lock's commands: `lock resolve --host-packages`, `lock fetch`, `lock check --host-packages`.
Imported only when one of them runs (b70ctl's startup stays small for the roles' many calls)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import typer
from pydantic import ValidationError
from rich.console import Console

from b70ctl.errors import BadInput, first_problem
from b70ctl.files import MAX_DOCUMENT_BYTES, read_bounded, read_bounded_stdin, read_yaml_mapping
from b70ctl.lock.debcache import (
    DEFAULT_LOCK,
    HostPackageState,
    check_host,
    fetch_groups,
    http_get,
    load_debs_lock,
    series_lock,
    write_debs_lock,
)
from b70ctl.lock.debs import resolve_package_set
from b70ctl.lock.debs_model import GROUPS, Group, PackageSet, SeriesLock
from b70ctl.options import print_json

out = Console(highlight=False, markup=False, soft_wrap=True)



def _groups(names: list[str], one: SeriesLock) -> list[Group]:
    """The groups asked for (default: every group the release's lock has)."""
    unknown = sorted(set(names) - set(GROUPS))
    if unknown:
        raise BadInput(f"--group {unknown[0]} is not a package group: use {', '.join(GROUPS)}")
    return cast(list[Group], names) if names else list(one.groups)


def load_package_set(path: Path | None) -> PackageSet:
    if path is None:
        from b70ctl.host.releases import load_matrix

        data: object = load_matrix().package_set()
        where = "the release matrix (control/b70ctl/host/releases.yaml)"
    else:
        fix = "give a package set: {series: {CODENAME: {codename, indexes: [...], groups: {...}}}}"
        data = read_yaml_mapping(path, str(path), fix)
        where = str(path)
    try:
        return PackageSet.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"{where} is not a package set ({first_problem(error)}): fix it") from None


def resolve_host_packages(package_set_path: Path | None, lock_path: Path | None, series: list[str],
                          as_json: bool) -> None:
    package_set = load_package_set(package_set_path)
    unknown = sorted(set(series) - set(package_set.series))
    if unknown:
        raise BadInput(f"--series {unknown[0]} is not in the package set (it has "
                       f"{', '.join(sorted(package_set.series))})")
    path = lock_path or DEFAULT_LOCK
    previous = load_debs_lock(path) if path.is_file() else None
    lock = resolve_package_set(http_get, package_set, previous, only=series)
    written = write_debs_lock(lock, path)
    summary = {"lock": str(path), "written": written, "series": {
        codename: {"packages": len(one.packages), "bytes": sum(pin.size_bytes for pin in one.packages),
                   "groups": {name: group.model_dump(mode="json") for name, group in one.groups.items()}}
        for codename, one in lock.series.items()}}
    if as_json:
        print_json(summary)
    else:
        out.print(f"{path}: {'written' if written else 'unchanged'}")
        for codename, one in lock.series.items():
            for name, group in one.groups.items():
                pins = one.group_pins(name)
                state = ("kept the previous pins: " + (group.reason or "") if group.kept_previous
                         else "resolved" if group.resolved else f"NOT resolved: {group.reason}")
                out.print(f"  {codename}/{name}: {len(pins)} package(s), {state}")
    failed = [(codename, name, group) for codename, one in lock.series.items()
              for name, group in one.groups.items() if not group.resolved or group.kept_previous]
    if failed:
        codename, name, group = failed[0]
        if group.kept_previous:
            raise BadInput(f"{codename}/{name}: {group.reason} (its previous pins were kept)")
        raise BadInput(f"{codename}/{name} is not resolved: {group.reason}")


def fetch_host_packages(codename: str, cache: Path, groups: list[str], lock_path: Path | None, host_dir: str,
                        as_json: bool) -> None:
    path = lock_path or DEFAULT_LOCK
    one = series_lock(load_debs_lock(path), codename, path)
    result = fetch_groups(one, _groups(groups, one), cache, host_dir, path)
    if as_json:
        print_json(result.model_dump(mode="json"))
    else:
        out.print(f"{codename}: {len(result.packages)} .deb(s) in {cache}, {result.downloaded} fetched now")


def check_host_packages(codename: str, groups: list[str], installed: str | None, host_state: str | None,
                        hold: list[str], host: str, lock_path: Path | None, host_dir: str, as_json: bool) -> None:
    path = lock_path or DEFAULT_LOCK
    one = series_lock(load_debs_lock(path), codename, path)
    source = installed if installed is not None else host_state
    assert source is not None
    fix = ("give the output of dpkg-query --show on the host" if installed is not None else
           'give {"dpkg": "<dpkg-query --show output>", "apt_policy": "<apt-cache policy output>"}')
    text = (read_bounded_stdin(MAX_DOCUMENT_BYTES, "stdin", fix) if source == "-"
            else read_bounded(source, MAX_DOCUMENT_BYTES, source, fix).decode("utf-8", "replace"))
    apt_policy: str | None = None
    if host_state is not None:
        try:
            state = HostPackageState.model_validate_json(text)
        except ValidationError as error:
            raise BadInput(f"--host-state {host_state}: not a host package state ({first_problem(error)}): {fix}") \
                from None
        text, apt_policy = state.dpkg, state.apt_policy
    report = check_host(one, _groups(groups, one), text, host, path, host_dir, hold, apt_policy)
    if as_json:
        print_json(report.model_dump(mode="json"))
    else:
        out.print(report.message)
    if not report.ok:
        raise typer.Exit(1)
