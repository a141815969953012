"""`b70ctl host ...`: what this host's hardware is, how its GPUs connect, and whether a recipe fits it.

Every command reads under --root (default /) so it runs the same on a host and on a fixture tree. --json prints
what Ansible consumes (`changed` where something is written); without it a table for people.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from b70ctl.choices import choice_option
from b70ctl.errors import BadInput, first_problem
from b70ctl.host.fit import HostFit, LockedGroups, PlayHost, host_fit, play_fit
from b70ctl.host.memory import KV_CACHE_GIB_MIN
from b70ctl.host_documents import load_facts
from b70ctl.options import JsonOption, json_option, print_json
from b70ctl.recipes import load_recipe
from b70host.facts import collect_facts
from b70host.topology import (
    FALLBACK_PATH,
    PROFILE_CHOICES,
    TOPOLOGY_PATH,
    apply_fallback,
    fallback_record,
    render_document,
    topology,
)

app = typer.Typer(no_args_is_help=True, help="Host hardware: GPU inventory, PCIe P2P topology, memory fit.")

Profile = Enum("Profile", {name: name for name in PROFILE_CHOICES}, type=str)  # type: ignore[misc]


class Probe(str, Enum):
    auto = "auto"  # ask the Level Zero loader when it is installed
    never = "never"

RootOption = Annotated[str, typer.Option("--root", help="Root prefix of the sysfs/procfs tree to read")]
FreeSpaceOption = Annotated[str | None, typer.Option(
    "--free-space-of", show_default=False, help="Also measure the free space for this directory on this machine "
    "(the model store, b70_model_store_dir; an absolute path, not under --root)")]


def _check_root(root: str) -> None:
    if not os.path.isdir(root):
        raise BadInput(f"--root {root} is not a directory: give the root of a sysfs tree (default /)")



def _gib(value: int | None) -> str:
    return f"{value / 1024 ** 3:.0f} GiB" if value else "-"


@app.command("facts")
def facts_command(root: RootOption = "/", free_space_of: FreeSpaceOption = None, as_json: JsonOption = False) -> None:
    """Intel GPUs by PCI id, driver binding, DRM nodes, links, BAR, firmware; kernel and RAM; the model store's free
    space with --free-space-of."""
    _check_root(root)
    facts = collect_facts(root, free_space_of)
    # On stderr in both modes: what could not be read is said by name, even when the JSON goes to a pipe.
    warn = Console(stderr=True, highlight=False, soft_wrap=True)
    for warning in facts["warnings"]:
        warn.print(Text.assemble(("warning:", "yellow"), " ", warning))
    if as_json:
        print_json(facts)
        return
    out = Console(soft_wrap=True)  # the summary lines whole, in a terminal or a pipe
    out.print(f"kernel {facts['kernel_release'] or '?'}, RAM {facts['ram_total_gib'] or '?'} GiB, "
              f"{facts['gpu_count']} Intel discrete GPU(s), {facts['gpu_count_xe_bound']} bound to xe")
    if "free_space" in facts:
        space = facts["free_space"]
        out.print(f"model store {space['path']}: " + (
            f"{space['free_bytes'] / 1024 ** 3:.1f} GiB free on the filesystem of {space['measured_at']}"
            if space["free_bytes"] is not None else "not measured (give an absolute path)"), highlight=False)
    table = Table("#", "PCI", "id", "model", "driver", "nodes", "slot link", "VRAM BAR", "VRAM", "NUMA", "GuC")
    for gpu in facts["gpus"]:
        slot = gpu["slot_link"]
        guc = ((gpu["firmware"] or {}).get("guc") or {}).get("found_release") or "-"
        table.add_row(str(gpu["index"]), gpu["pci_address"], gpu["pci_id"], gpu["model"], gpu["driver"] or "none",
                      " ".join(node for node in (gpu["card"], gpu["render"]) if node) or "-",
                      f"{slot['current_speed_gts'] or '?'} GT/s x{slot['current_width'] or '?'}",
                      f"{_gib(gpu['bar']['vram_bar_bytes'])} ({gpu['bar']['resizable_bar']})",
                      _gib(gpu["vram_bytes"]), str(gpu["numa_node"] if gpu["numa_node"] is not None else "-"), guc)
    out.print(table)
    for gpu in facts["integrated_gpus"]:
        out.print(f"not counted: integrated GPU {gpu['pci_address']} {gpu['pci_id']} ({gpu['integrated_reason']})")


@app.command("topology")
def topology_command(
    root: RootOption = "/",
    profile: Annotated[str, choice_option(Profile, "--profile", "auto, or force p2p / no-p2p for this host")] = "auto",
    tensor_parallel_size: Annotated[int | None, typer.Option(
        "--tensor-parallel-size", min=1, help="GPUs in the tensor-parallel group (default: all usable)")] = None,
    probe: Annotated[str, choice_option(Probe, "--probe", "auto: ask the Level Zero loader when installed; never")] =
        "auto",
    write: Annotated[bool, typer.Option("--write", help=f"Write <root>{TOPOLOGY_PATH}")] = False,
    recipe: Annotated[str | None, typer.Option(
        "--recipe", show_default=False, help="Build the group only from GPUs of this recipe's PCI ids (name or file); "
        "its tensor-parallel size unless --tensor-parallel-size is given")] = None,
    fallback_record_path: Annotated[str | None, typer.Option(
        "--fallback-record", show_default=False, help=f"The serve gate's record of a p2p start that died "
        f"({FALLBACK_PATH} on a host): no-p2p while it names the group's cards")] = None,
    as_json: JsonOption = False,
) -> None:
    """PCIe P2P per GPU pair and the oneCCL profile (p2p / no-p2p) for the tensor-parallel group."""
    _check_root(root)
    pci_ids: list[str] = []
    if recipe is not None:
        recipe_model = load_recipe(recipe)
        # The same GPUs host fit counts (memory.usable_gpus): bound to xe and of the recipe's ids.
        pci_ids = list(recipe_model.host.gpu_pci_ids)
        if tensor_parallel_size is None and recipe_model.host.accelerator == "xpu":
            tensor_parallel_size = recipe_model.serve.tensor_parallel_size
    result = topology(root, tensor_parallel_size, profile, probe, write, pci_ids=pci_ids,
                      fallback_path=fallback_record_path)
    if as_json:
        print_json(result)
        return
    out = Console()
    table = Table("pair", "relation", "common bridge", "ACS", "rule", "Level Zero", "P2P", "reason")
    for pair in result["pairs"]:
        probe_result = pair["probe"]["status"] if pair["probe"] else "-"
        table.add_row(f"{pair['a']}-{pair['b']}", pair["relation"], pair["common_bridge"] or "-", pair["acs"],
                      pair.get("rule") or "-", probe_result, str(pair["p2p"]), pair["reason"])
    out.print(table)
    out.print(f"profile [bold]{result['profile']}[/] ({escape(result['profile_reason'])}), group {result['group']}, "
              f"ZE_AFFINITY_MASK={result['affinity_mask']}, Level Zero {result['probe']['status']}")
    for reason in result["reasons"]:
        out.print(f"  {reason}", highlight=False)
    if write:
        out.print(f"{'wrote' if result['changed'] else 'unchanged'} {os.path.join(root, TOPOLOGY_PATH.lstrip('/'))}")


@app.command("fallback")
def fallback_command(
    topology_path: Annotated[str, typer.Option(
        "--topology", help="The host's topology.json whose p2p start died, or - for stdin")],
    signature: Annotated[str, typer.Option(
        help="The catalogue entry b70ctl diagnose named, one whose fix is the no-p2p profile")],
    evidence: Annotated[str, typer.Option(help="The log line that showed it")],
    as_json: Annotated[bool, json_option(
        "Print {\"record\", \"topology\", \"record_json\", \"topology_json\"}: the documents, and the files' text "
        "the role writes")] = False,
) -> None:
    """The serve gate's fallback from p2p to no-p2p: the record to keep at /etc/b70/ccl-fallback.json and the
    topology document to serve with ({"record", "topology"} with --json, and record_json and topology_json, the
    two files as the host package writes them). Exit 2 when the profile is not p2p."""
    from datetime import datetime

    from b70ctl.diagnose.catalogue import load_catalogue
    from b70ctl.files import read_json_object
    from b70ctl.host_documents import read_topology
    from b70ctl.redact import printable

    entries = {entry.id: entry for entry in load_catalogue().signatures}
    entry = entries.get(signature)
    if entry is None or getattr(entry.fix, "profile", None) != "no-p2p":
        raise BadInput(f"--signature {signature}: not a catalogue entry whose fix is the no-p2p profile: give the id "
                       "b70ctl diagnose --json named (e.g. ze-ipc-open-invalid-argument)")
    if topology_path == "-":
        document = read_json_object("-", "--topology -", "pipe in /etc/b70/topology.json")
    else:
        document, _ = read_topology(Path(topology_path))  # as written; refused in one line when not a topology
    if document.get("profile") != "p2p":
        raise BadInput(f"--topology {topology_path}: the profile is {document.get('profile', 'missing')}, not p2p: "
                       "there is nothing to fall back from")
    at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    record = fallback_record(document, signature, printable(evidence), at)
    fallen = apply_fallback(document, record)
    if as_json:
        print_json({"record": record, "topology": fallen, "record_json": render_document(record),
                     "topology_json": render_document(fallen)})
        return
    Console(highlight=False, markup=False, soft_wrap=True).print(
        f"profile: p2p -> {fallen['profile']} for {', '.join(record['group'])}\n"
        f"reason: {fallen['profile_reason']}")


DistributionOption = Annotated[str | None, typer.Option(
    "--distribution", show_default=False, help="Distribution as Ansible names it (Ubuntu, Debian); default from "
    "<root>/etc/os-release")]
CodenameOption = Annotated[str | None, typer.Option(
    "--codename", show_default=False, help="Release codename (noble, resolute); default from <root>/etc/os-release")]
ReleasesOption = Annotated[str | None, typer.Option(
    "--releases", show_default=False, help="Release matrix file to read instead of the appliance's own "
    "(control/b70ctl/host/releases.yaml), in its schema; empty: the appliance's own")]


@app.command("fit")
def fit_command(
    recipe_argument: Annotated[str | None, typer.Argument(
        metavar="[RECIPE]", show_default=False, help="Deprecated: give --recipe instead")] = None,
    recipe: Annotated[str | None, typer.Option(
        "--recipe", show_default=False, help="Recipe name or path to a recipe file")] = None,
    root: RootOption = "/",
    facts: Annotated[str | None, typer.Option(
        "--facts", help="Read the host's facts from this file (or - for stdin) instead of under --root")] = None,
    free_space_of: FreeSpaceOption = None,
    kv_cache_gib: Annotated[float, typer.Option("--kv-cache-gib", min=0, help="KV cache each card needs")] =
        KV_CACHE_GIB_MIN,
    hosts: Annotated[str | None, typer.Option(
        "--hosts", help=f"Every host of a play at once: a JSON list of {{{', '.join(PlayHost.model_fields)}}} "
                        "(- reads stdin); prints {host: fit}, each with its kernel plan (preflight's one call)")] =
        None,
    releases: ReleasesOption = None,
    packages_lock: Annotated[Path | None, typer.Option(
        "--packages-lock", help="With --hosts: the host package lock the play installs from (default: the "
                                "appliance's own); a group it cannot install stops the host here")] = None,
    as_json: JsonOption = False,
) -> None:
    """Does the recipe fit this host: GPU count and binding, per-card VRAM budget, host RAM, firmware, kernel, and
    the model store's free space (--free-space-of, or facts read with it, as preflight's are). Exit 1 when it does
    not (with --hosts: when one host does not)."""
    if hosts is not None:
        if recipe is not None or recipe_argument is not None or facts is not None or free_space_of is not None:
            raise BadInput("--hosts names each host's recipe and facts: give it without --recipe, --facts and "
                           "--free-space-of")
        fits = fit_play(hosts, releases, packages_lock)
        if as_json:
            print_json({name: fit.model_dump(mode="json") for name, fit in fits.items()})
        else:
            out = Console(soft_wrap=True)
            for name, fit in fits.items():
                out.print(f"{'[green]ok[/]' if fit.fits else '[red]FAIL[/]'} {escape(name)}: "
                          f"{escape('; '.join(fit.reasons) or 'recipe ' + fit.recipe + ' fits')}", highlight=False)
        if not all(fit.fits for fit in fits.values()):
            raise typer.Exit(1)
        return
    if recipe_argument is not None:
        if recipe is not None:
            raise BadInput(f"the recipe is given twice ({recipe_argument!r} and --recipe {recipe!r}): give --recipe "
                           "alone")
        Console(stderr=True).print(f"[yellow]warning:[/] `b70ctl host fit RECIPE` is deprecated and will be "
                                   f"removed: write `b70ctl host fit --recipe {escape(recipe_argument)}`",
                                   highlight=False, soft_wrap=True)
        recipe = recipe_argument
    if recipe is None:
        raise BadInput("no recipe: give --recipe NAME (b70ctl recipes list) or --recipe FILE")
    if facts is not None and free_space_of is not None:
        raise BadInput("--free-space-of measures this machine, --facts was read on another: give the facts read "
                       "with it there (b70host.facts --free-space-of), or drop --facts")
    if facts is None:
        _check_root(root)
    result = host_fit(load_recipe(recipe), load_facts(facts).model_dump() if facts else
                      collect_facts(root, free_space_of), kv_cache_gib)
    if as_json:
        print_json(result.model_dump(mode="json"))
    else:
        out = Console(soft_wrap=True)  # one line per verdict, as long as its reason, in a terminal or a pipe
        for name, part in (("GPUs", result.gpus), ("VRAM", result.card), ("RAM", result.ram),
                           ("Firmware", result.firmware), ("Kernel", result.kernel), ("Disk", result.disk)):
            if part is None:
                if name == "Disk":
                    out.print("- Disk: not measured (give --free-space-of the model store, or facts read with it)",
                              highlight=False)
                continue
            mark = "[green]ok[/]" if part.fits else "[red]FAIL[/]"
            out.print(f"{mark} {name}: {part.reason}", highlight=False)
    if not result.fits:
        raise typer.Exit(1)


def fit_play(source: str, releases: str | None, packages_lock: Path | None = None) -> dict[str, HostFit]:
    """{host: HostFit} for preflight's list of play hosts; each distinct recipe is loaded once, and the host package
    lock once."""
    from pydantic import TypeAdapter, ValidationError

    from b70ctl.files import read_bounded, read_bounded_stdin
    from b70ctl.host.releases import load_matrix
    where, fix = f"--hosts {source}", "pass preflight's list of {host, recipe, facts, ...} objects"
    limit = 2**30  # thousands of hosts' GPU inventories
    try:
        text = read_bounded_stdin(limit, where, fix) if source == "-" else read_bounded(source, limit, where, fix)
    except OSError as error:  # missing, a directory, unreadable: the file, not the document, is the problem
        raise BadInput(f"{where}: {error.strerror}: {fix}") from error
    try:
        play = TypeAdapter(list[PlayHost]).validate_json(text)
    except ValidationError as error:
        raise BadInput(f"{where}: {first_problem(error)}: {fix}") from error
    recipes = {name: load_recipe(name) for name in dict.fromkeys(host.recipe for host in play)}
    matrix = load_matrix(releases)
    from b70ctl.lock.debcache import DEFAULT_LOCK, load_debs_lock

    lock = load_debs_lock(packages_lock or DEFAULT_LOCK)
    locked: LockedGroups = {codename: {str(group): None if one.resolved else (one.reason or "not resolved")
                                       for group, one in series.groups.items()}
                            for codename, series in lock.series.items()}
    return {host.host: play_fit(host, recipes[host.recipe], matrix, locked) for host in play}


@app.command("environment")
def environment_command(
    recipe: Annotated[str, typer.Option(help="Recipe name or path to a recipe file")],
    as_json: Annotated[bool, json_option("Print host_facts.json (what the role writes)")] = False,
) -> None:
    """Read a host bundle (JSON on stdin: hostname, facts, topology, image, models, compute_runtime) and print the
    host_facts.json `b70ctl verify --host-facts` and the fleet report read."""
    from pydantic import ValidationError

    from b70ctl.files import MAX_DOCUMENT_BYTES, read_bounded_stdin
    from b70ctl.host.environment import HostBundle, host_environment
    from b70ctl.lock.model import load_recipe_and_lock

    text = read_bounded_stdin(MAX_DOCUMENT_BYTES, "host bundle on stdin",
                              "pipe in the JSON the replication_check role collects")
    try:
        bundle = HostBundle.model_validate_json(text)
    except ValidationError as error:
        raise BadInput(f"host bundle on stdin is invalid ({first_problem(error)}): "
                       "pipe in the JSON the replication_check role collects") from error
    recipe_model, lock_model, _ = load_recipe_and_lock(recipe, None)
    environment = host_environment(bundle, recipe_model, lock_model)
    document = environment.model_dump(mode="json", exclude={"extra", "served_model"}, exclude_none=True)
    if as_json:  # the file's bytes (keys sorted): the role writes stdout as it is
        sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
        return
    out = Console(highlight=False, markup=False, soft_wrap=True)
    for key, value in document.items():
        out.print(f"{key}: {value if isinstance(value, (str, int, float)) else json.dumps(value)}")


def _distribution_and_codename(root: str, distribution: str | None, codename: str | None) -> tuple[str, str]:
    """The options when given, else <root>/etc/os-release (a fixture tree has none: then both must be given)."""
    if distribution is not None and codename is not None:
        return distribution, codename
    from b70ctl.host.releases import read_os_release

    path = Path(root) / "etc" / "os-release"
    try:
        found = read_os_release(path.read_text(encoding="utf-8", errors="replace"))
    except OSError as error:
        raise BadInput(f"{path}: {error.strerror}: give --distribution and --codename") from error
    return distribution or found[0], codename or found[1]


@app.command("release")
def release_command(
    root: RootOption = "/",
    distribution: DistributionOption = None,
    codename: CodenameOption = None,
    releases: ReleasesOption = None,
    as_json: JsonOption = False,
) -> None:
    """Is this a release the appliance provisions (control/b70ctl/host/releases.yaml)? Exit 1 when it is not,
    naming its end-of-life date and the upgrade, or the supported releases."""
    from b70ctl.host.releases import load_matrix, release_verdict

    verdict = release_verdict(*_distribution_and_codename(root, distribution, codename), matrix=load_matrix(releases))
    if as_json:
        print_json(verdict.model_dump(mode="json"))
    else:
        Console(highlight=False, soft_wrap=True).print(
            f"{'[green]ok[/]' if verdict.supported else '[red]refused[/]'} {escape(verdict.message)}")
    if not verdict.supported:
        raise typer.Exit(1)


@app.command("guc-override")
def guc_override_command(
    cache: Annotated[Path, typer.Option("--cache", help="Controller's content-addressed cache directory")],
    distribution: Annotated[str, typer.Option("--distribution", help="The host's distribution")] = "Ubuntu",
    codename: Annotated[str, typer.Option("--codename", help="The host's release codename")] = "",
    releases: ReleasesOption = None,
    as_json: JsonOption = False,
) -> None:
    """Put the release's good GuC blob (releases.yaml guc_override) in the cache, by content, and say where it
    goes on the host (/lib/firmware/updates). Exit 2 when the release names none or the blob is not the one named."""
    from b70ctl.host.guc_override import cached_guc_override
    from b70ctl.host.releases import load_matrix

    release = load_matrix(releases).find(codename, distribution)
    override = release.firmware.guc_override if release is not None and release.firmware is not None else None
    if override is None:
        raise BadInput(f"{distribution} {codename or '(no --codename)'} names no GuC override in the release matrix: "
                       "give the host's --codename (b70ctl host kernel-plan says when one is needed)")
    cached = cached_guc_override(override, cache)
    if as_json:
        print_json(cached.model_dump(mode="json"))
    else:
        Console(highlight=False, soft_wrap=True).print(
            f"GuC {cached.guc}: {cached.cache_path} ({'fetched now' if cached.downloaded else 'cached'}), goes to "
            f"{cached.host_path}")


@app.command("kernel-plan")
def kernel_plan_command(
    recipe: Annotated[str, typer.Option(help="Recipe name or path to a recipe file")],
    root: RootOption = "/",
    facts: Annotated[str | None, typer.Option(
        "--facts", help="Read the host's facts from this file (or - for stdin) instead of under --root")] = None,
    distribution: DistributionOption = None,
    codename: CodenameOption = None,
    releases: ReleasesOption = None,
    as_json: JsonOption = False,
) -> None:
    """Does the running kernel drive the recipe's GPUs? {needed, reason, packages, reboot_required}: the
    distribution's kernel and firmware the host_kernel role installs before a reboot."""
    from b70ctl.host.kernel import kernel_plan
    from b70ctl.host.releases import load_matrix

    if facts is None:
        _check_root(root)
    matrix = load_matrix(releases)
    host_facts = load_facts(facts).model_dump() if facts else collect_facts(root)
    plan = kernel_plan(load_recipe(recipe), host_facts, *_distribution_and_codename(root, distribution, codename),
                       matrix=matrix)
    if as_json:
        print_json(plan.model_dump(mode="json"))
        return
    out = Console(highlight=False, soft_wrap=True)
    if plan.needed:
        out.print(f"[yellow]needed[/]: {escape(plan.reason)}")
        out.print(f"install {' '.join(plan.packages)}, then reboot")
    else:
        out.print(f"[green]not needed[/]: {escape(plan.reason)}")
