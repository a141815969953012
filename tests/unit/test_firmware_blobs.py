"""The GuC header reader on real Battlemage firmware, and the kernel plan a stock host gets from it.

The blobs are Debian's: firmware-intel-graphics from the non-free-firmware component of deb.debian.org (a registry
this machine reaches), each .deb fetched once into the user's cache and checked against the sha256 its Packages
index gives (trixie and sid, read 2026-12-05). Their xe/bmg_guc_70.bin carry GuC 70.40.2 (20250410) and 70.72.1
(20260916): one below the B70 floor, one the release that cleared the 70.58.0 resets (vllm-project/vllm #55425).
They are put in a host tree plain, .xz and .zst (Ubuntu's linux-firmware ships .zst), in /lib/firmware and in
/lib/firmware/updates, where the kernel's firmware loader looks first (drivers/base/firmware_loader/main.c fw_path[],
plain before .zst before .xz).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from b70ctl.host.fit import PlayHost, play_fit
from b70ctl.host.kernel import kernel_plan
from b70ctl.host.releases import load_matrix
from b70ctl.recipes import load_recipe
from b70ctl.verify.embedded import default_cache_dir
from b70host.facts import collect_facts, uc_release_version
from sysfs_trees import build_tree

POOL = "http://deb.debian.org/debian/pool/non-free-firmware/f/firmware-nonfree/"
# (file, sha256 from dists/<suite>/non-free-firmware/binary-all/Packages.xz, the GuC its bmg_guc_70.bin carries)
BLOBS = {
    "20250410": ("firmware-intel-graphics_20250410-2_all.deb",
                 "253d624068b361cfbc43c88b64ec0904fd14de1b704f89bdbe457a2e7edba2dc", "70.40.2"),
    "20260916": ("firmware-intel-graphics_20260916-1_all.deb",
                 "d3ae96acf5a73877806883b48356ddef272633c114e36099652d63a1fb01dfc7", "70.72.1"),
}
GUC = "xe/bmg_guc_70.bin"
RECIPE = "pr620-fp8-tp2"


@pytest.fixture(scope="module")
def guc_blobs() -> dict[str, bytes]:
    """{snapshot: the bmg_guc_70.bin its package installs}."""
    cache = default_cache_dir() / "debs"
    cache.mkdir(parents=True, exist_ok=True)
    blobs = {}
    for snapshot, (name, sha256, _) in BLOBS.items():
        deb = cache / name
        if not deb.exists() or hashlib.sha256(deb.read_bytes()).hexdigest() != sha256:
            partial = deb.with_suffix(".partial")
            with urllib.request.urlopen(POOL + name, timeout=120) as response, partial.open("wb") as out:
                shutil.copyfileobj(response, out)
            assert hashlib.sha256(partial.read_bytes()).hexdigest() == sha256, f"{name}: not the indexed package"
            partial.rename(deb)
        listing = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
        blob = subprocess.run(["tar", "-xO", f"./usr/lib/firmware/{GUC}"], input=listing, capture_output=True,
                              check=True).stdout
        blobs[snapshot] = blob
    return blobs


def compressed(blob: bytes, suffix: str) -> bytes:
    if suffix == "":
        return blob
    program = {".xz": ["xz", "-c", "--check=crc32"], ".zst": ["zstd", "-c", "-q"]}[suffix]
    assert shutil.which(program[0]), f"{program[0]} is needed to write the {suffix} form Ubuntu ships"
    return subprocess.run(program, input=blob, capture_output=True, check=True).stdout


def host_tree(tmp_path: Path, loaded: str) -> Path:
    """The dual-B70 tree with its GuC files removed and debugfs saying the driver loaded `loaded`."""
    root = Path(build_tree(tmp_path, "b70x2-switch"))
    for stale in (root / "lib" / "firmware" / "xe").glob("bmg_guc_70.bin*"):
        stale.unlink()
    for info in root.glob("sys/kernel/debug/dri/*/gt*/uc/guc_info"):
        lines = [f"\tfound release version {loaded}" if "found release version" in line else line
                 for line in info.read_text().splitlines()]
        info.write_text("\n".join(lines) + "\n")
    return root


def install(root: Path, directory: str, blob: bytes, suffix: str) -> None:
    target = root / directory.lstrip("/") / (GUC + suffix)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(compressed(blob, suffix))


@pytest.mark.parametrize("suffix", ["", ".xz", ".zst"])
@pytest.mark.parametrize("snapshot", sorted(BLOBS))
def test_the_header_reader_gives_each_real_blobs_guc_in_every_form_packages_ship(
        guc_blobs, tmp_path: Path, snapshot: str, suffix: str) -> None:
    root = host_tree(tmp_path, "70.54.0")
    install(root, "/lib/firmware", guc_blobs[snapshot], suffix)
    entry = collect_facts(str(root))["firmware_files"][GUC]
    assert (entry["present"], entry["file"], entry["path"]) == (True, GUC + suffix, f"/lib/firmware/{GUC}{suffix}")
    assert entry["release_version"] == BLOBS[snapshot][2]


def test_the_file_found_is_the_one_the_kernel_loads_first(guc_blobs, tmp_path: Path) -> None:
    """updates/ before the plain directory, and a plain file anywhere before a compressed one."""
    root = host_tree(tmp_path, "70.54.0")
    release = (root / "proc/sys/kernel/osrelease").read_text().strip()
    install(root, "/lib/firmware", guc_blobs["20250410"], ".zst")
    install(root, "/lib/firmware/updates", guc_blobs["20260916"], ".zst")
    entry = collect_facts(str(root))["firmware_files"][GUC]
    assert (entry["path"], entry["release_version"]) == (f"/lib/firmware/updates/{GUC}.zst", "70.72.1")
    install(root, f"/lib/firmware/{release}", guc_blobs["20250410"], "")
    entry = collect_facts(str(root))["firmware_files"][GUC]
    assert (entry["path"], entry["release_version"]) == (f"/lib/firmware/{release}/{GUC}", "70.40.2")


def play_host(root: Path) -> PlayHost:
    return PlayHost.model_validate({
        "host": "b70-a", "recipe": RECIPE, "facts": collect_facts(str(root)), "gpus": 2, "distribution": "Ubuntu",
        "codename": "resolute", "test_host": False, "test_host_distributions": [], "service_user": "b70",
        "model_store_dir": "/var/lib/b70/models", "extra_env": {}})


def test_the_matrix_override_is_the_real_blob_of_the_package_it_names(guc_blobs) -> None:
    """resolute's guc_override names Debian's firmware-intel-graphics 20260916-1 by sha256: the same package this
    module fetched and checked against Debian's index, and the blob inside it, whose header says the GuC the
    matrix records."""
    override = load_matrix().find("resolute", "Ubuntu").firmware.guc_override
    name, sha256, guc = BLOBS["20260916"]
    assert override.deb.url == POOL + name and override.deb.sha256 == sha256
    assert override.deb.member == f"./usr/lib/firmware/{GUC}" and override.file == GUC
    blob = guc_blobs["20260916"]
    assert (hashlib.sha256(blob).hexdigest(), len(blob), override.guc) == (override.sha256, override.size_bytes, guc)
    assert override.host_path == f"/lib/firmware/updates/{GUC}"
    # The test hosts' matrix installs the very same blob (tests/fixtures/releases-testhosts.yaml).
    testhosts = load_matrix(str(Path(__file__).resolve().parents[1] / "fixtures" / "releases-testhosts.yaml"))
    assert testhosts.find("bookworm", "Debian").firmware.guc_override == override


def test_guc_override_caches_the_blob_by_content_and_refuses_a_matrix_that_misnames_it(guc_blobs, tmp_path) -> None:
    """`b70ctl host guc-override`: the .deb through the content-addressed cache (here seeded with the real package
    this module fetched, as `lock fetch` would leave it), the blob out of it, checked, kept under its sha256."""
    import json
    import sys

    import yaml

    cache = tmp_path / "cache"
    (cache / "sha256").mkdir(parents=True)
    name, sha256, _ = BLOBS["20260916"]
    shutil.copy(default_cache_dir() / "debs" / name, cache / "sha256" / sha256)
    b70ctl = str(Path(sys.executable).with_name("b70ctl"))
    done = subprocess.run([b70ctl, "host", "guc-override", "--codename", "resolute", "--cache", str(cache), "--json"],
                          capture_output=True, text=True, check=True)
    cached = json.loads(done.stdout)
    assert (cached["guc"], cached["downloaded"]) == ("70.72.1", False)
    assert cached["host_path"] == f"/lib/firmware/updates/{GUC}"
    assert Path(cached["cache_path"]).read_bytes() == guc_blobs["20260916"]

    matrix = yaml.safe_load((Path(__file__).resolve().parents[2] / "control/b70ctl/host/releases.yaml").read_text())
    resolute = next(one for one in matrix["releases"] if one["codename"] == "resolute")
    resolute["firmware"]["guc_override"]["guc"] = "70.73.0"  # a matrix that says another release than the blob
    wrong = tmp_path / "releases.yaml"
    wrong.write_text(yaml.safe_dump(matrix))
    other = tmp_path / "other"
    (other / "sha256").mkdir(parents=True)
    shutil.copy(default_cache_dir() / "debs" / name, other / "sha256" / sha256)
    refused = subprocess.run([b70ctl, "host", "guc-override", "--codename", "resolute", "--releases", str(wrong),
                              "--cache", str(other), "--json"], capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout == ""
    (line,) = refused.stderr.strip().splitlines()
    assert "GuC 70.72.1; the release matrix says" in line and "nothing was cached" in line
    assert sorted(path.name for path in (other / "sha256").iterdir() if not path.name.endswith(".lock")) == \
        [sha256]  # the .deb only (and fetch's lock file)


def test_a_stock_26_04_host_gets_the_good_guc_before_its_one_reboot(guc_blobs, tmp_path: Path) -> None:
    """The reboot loop: GuC 70.58.0 loaded, the archive's 20260319 firmware carries 70.58.0 too (releases.yaml,
    from vllm-project/vllm #55425). Run by run: the plan installs the matrix's good blob in /lib/firmware/updates
    and reboots; before the reboot a re-run plans the reboot alone; after it, nothing."""
    root = host_tree(tmp_path, "70.58.0")
    install(root, "/lib/firmware", guc_blobs["20250410"], ".zst")  # a refused GuC on disk (below the floor)
    recipe = load_recipe(RECIPE)
    matrix = load_matrix()
    assert matrix.find("resolute", "Ubuntu").firmware.guc.release == "70.58.0"

    first = kernel_plan(recipe, collect_facts(str(root)), "Ubuntu", "resolute", matrix)
    assert first.needed and first.reboot_required and first.refused is None and first.packages == []
    assert first.guc_override is not None and first.guc_override.guc == "70.72.1"
    assert (f"installing GuC 70.72.1 (Debian firmware-intel-graphics 20260916-1 (deb.debian.org non-free-firmware), "
            f"the upstream linux-firmware 20260916 blob) as /lib/firmware/updates/{GUC}, where the kernel looks first; "
            "caution: GuC 70.72.1: a deterministic two-GPU TP=2 startup hang") in first.reason, first.reason
    # The open report against the installed GuC is named with its thread and the way out.
    assert "(intel/compute-runtime #999, GSD-13481" in first.reason
    assert "put a GuC 70.65 xe/bmg_guc_70.bin in /lib/firmware/updates/xe/" in first.reason
    # Preflight lets it through to host_kernel (this 128 GB tree's other verdicts are not about firmware).
    assert not any("GuC" in reason for reason in play_fit(play_host(root), recipe, matrix).reasons)

    install(root, "/lib/firmware/updates", guc_blobs["20260916"], "")  # what host_kernel copies there
    second = kernel_plan(recipe, collect_facts(str(root)), "Ubuntu", "resolute", matrix)
    assert second.needed and second.reboot_required and second.packages == [] and second.guc_override is None
    assert f"/lib/firmware/updates/{GUC} carries GuC 70.72.1: a reboot loads it" in second.reason

    for info in root.glob("sys/kernel/debug/dri/*/gt*/uc/guc_info"):  # the reboot: the driver loads that file
        info.write_text(info.read_text().replace("found release version 70.58.0", "found release version 70.72.1"))
    third = kernel_plan(recipe, collect_facts(str(root)), "Ubuntu", "resolute", matrix)
    assert not third.needed and third.refused is None


def test_without_a_good_blob_to_install_the_host_is_refused_not_rebooted(guc_blobs, tmp_path: Path) -> None:
    """A release whose firmware carries a refused GuC and that names no override: refused at preflight, nothing
    installed, the line names the manual fix."""
    root = host_tree(tmp_path, "70.58.0")
    install(root, "/lib/firmware", guc_blobs["20250410"], ".zst")
    recipe = load_recipe(RECIPE)
    matrix = load_matrix()
    resolute = matrix.find("resolute", "Ubuntu")
    bare = resolute.model_copy(update={"firmware": resolute.firmware.model_copy(update={"guc_override": None})})
    matrix = matrix.model_copy(update={"releases": [bare if one is resolute else one for one in matrix.releases]})
    first = kernel_plan(recipe, collect_facts(str(root)), "Ubuntu", "resolute", matrix)
    assert not first.needed and not first.reboot_required and first.packages == []
    assert first.refused is not None and "a reboot into it would load the same GuC again" in first.refused
    assert "/lib/firmware/updates/xe/" in first.refused and "\n" not in first.refused
    fit = play_fit(play_host(root), recipe, matrix)
    assert not fit.fits and first.refused in fit.reasons


def ubuntu_intel_graphics_guc(codename: str) -> tuple[str, str]:
    """(version, GuC) of the linux-firmware-intel-graphics the host package lock pins for `codename`: the .deb
    fetched from the Ubuntu archive by the lock's URL and checked against its sha256, its bmg_guc_70.bin.zst read
    with the facts module's own decompression and header reader."""
    from b70ctl.lock.debcache import DEFAULT_LOCK, load_debs_lock
    from b70host.facts import decompress_firmware, parse_css_release_version

    pin = next(pin for pin in load_debs_lock(DEFAULT_LOCK).series[codename].packages
               if pin.name == "linux-firmware-intel-graphics")
    cache = default_cache_dir() / "debs"
    cache.mkdir(parents=True, exist_ok=True)
    deb = cache / pin.filename
    if not deb.exists() or hashlib.sha256(deb.read_bytes()).hexdigest() != pin.sha256:
        partial = deb.with_suffix(".partial")
        with urllib.request.urlopen(pin.url, timeout=120) as response, partial.open("wb") as out:
            shutil.copyfileobj(response, out)
        assert hashlib.sha256(partial.read_bytes()).hexdigest() == pin.sha256, f"{pin.url}: not the locked package"
        partial.rename(deb)
    listing = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    members = subprocess.run(["tar", "-t"], input=listing, capture_output=True, check=True).stdout.decode().split()
    (member,) = [name for name in members if name.endswith(f"{GUC}.zst")]
    blob = subprocess.run(["tar", "-xO", member], input=listing, capture_output=True, check=True).stdout
    return pin.version, parse_css_release_version(decompress_firmware(blob, ".zst")) or "unreadable"


@pytest.mark.parametrize("codename", ["noble", "resolute"])
def test_the_matrix_records_the_guc_of_every_firmware_the_lock_pins(codename: str) -> None:
    """Read from the blob, not from a report: 24.04's archive firmware carries GuC 70.44.1 (below the floor) and
    26.04's 70.58.0 (the one vllm-project/vllm #55425 reports)."""
    version, guc = ubuntu_intel_graphics_guc(codename)
    recorded = load_matrix().find(codename, "Ubuntu").firmware.guc
    assert recorded is not None and recorded.release == guc, (version, guc)
    assert version in recorded.read_from


def test_a_stock_24_04_host_gets_the_good_guc_too(guc_blobs, tmp_path) -> None:
    """noble's archive firmware carries 70.44.1 (below the floor): installing it and rebooting would load a refused
    GuC, so the plan installs the good blob instead, as on 26.04."""
    root = host_tree(tmp_path, "70.40.2")
    install(root, "/lib/firmware", guc_blobs["20250410"], ".zst")
    plan = kernel_plan(load_recipe(RECIPE), collect_facts(str(root)), "Ubuntu", "noble")
    assert plan.needed and plan.reboot_required and plan.refused is None
    assert plan.guc_override is not None and plan.guc_override.guc == "70.72.1"
    assert "GuC 70.40.2 is below the B70 floor 70.54.0" in plan.reason
    assert ("linux-firmware's own GuC is refused too (GuC 70.44.1 is below the B70 floor 70.54.0): installing GuC "
            "70.72.1") in plan.reason


UPSTREAM = Path(__file__).resolve().parents[1] / "fixtures" / "upstream"
# {snapshot: linux-firmware's WHENCE, the xe stanza, cut unedited} (tests/fixtures/upstream/README.md names each
# source). 20260916: WHENCE at a GitHub mirror's commit 0ab00e4, which carries the changes Debian's 20260916-1
# changelog lists; which commit the tag names is not known here. 20250410 has none: no WHENCE of that time (bmg GuC
# 70.40.2) was found in what this machine reaches, so that blob is not checked against WHENCE.
WHENCE = {"20260916": "linux-firmware-WHENCE-0ab00e4-xe-guc.txt"}
RELEASE_LINE = re.compile(r"(?:GuC|HuC) API/APB ver (\d+\.\d+\.\d+) for .+")


def whence_versions(text: str) -> dict[str, str]:
    """{file: its Version: line}: in WHENCE a Version: line belongs to the File: line above it."""
    versions: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("File: "):
            current = line.removeprefix("File: ").strip()
        elif line.startswith("Version: ") and current is not None:
            versions[current] = line.removeprefix("Version: ").strip()
        elif line.startswith("Driver: "):
            current = None
    return versions


def package_xe_files(snapshot: str) -> dict[str, bytes]:
    """{xe/<name>: bytes} of every file the snapshot's .deb (fetched and checked by guc_blobs) installs in xe/."""
    deb = default_cache_dir() / "debs" / BLOBS[snapshot][0]
    listing = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    members = subprocess.run(["tar", "-t"], input=listing, capture_output=True, check=True).stdout.decode().split()
    prefix = "./usr/lib/firmware/"
    return {member.removeprefix(prefix): subprocess.run(["tar", "-xO", member], input=listing, capture_output=True,
                                                        check=True).stdout
            for member in members if member.startswith(prefix + "xe/") and not member.endswith("/")}


@pytest.mark.parametrize("snapshot", sorted(WHENCE))
def test_whence_names_the_guc_the_header_reader_reads_from_the_blob(guc_blobs, snapshot: str) -> None:
    """linux-firmware's own record of bmg_guc_70.bin's release, against what the facts module reads from the
    blob's header: the two sources are independent, so a reader that read the wrong field would fail here."""
    stated = RELEASE_LINE.fullmatch(whence_versions((UPSTREAM / WHENCE[snapshot]).read_text())[GUC])
    assert stated is not None and stated.group(0).endswith(" for Battlemage")
    assert uc_release_version(GUC, guc_blobs[snapshot]) == stated.group(1) == BLOBS[snapshot][2]


@pytest.mark.parametrize("snapshot", sorted(WHENCE))
def test_the_whence_stanza_is_the_packages_xe_directory_release_by_release(guc_blobs, snapshot: str) -> None:
    """The excerpt lists exactly the files the package installs in xe/, and every GuC and HuC release it states is
    the one the header reader reads from that file (HuC through its CPD directory). GSC and fan_control lines give
    versions the reader does not read."""
    versions = whence_versions((UPSTREAM / WHENCE[snapshot]).read_text())
    files = package_xe_files(snapshot)
    assert sorted(versions) == sorted(files)
    stated = {name: found.group(1) for name, line in versions.items() if (found := RELEASE_LINE.fullmatch(line))}
    assert len(stated) == 7 and GUC in stated and "xe/bmg_huc.bin" in stated
    assert {name: uc_release_version(name, files[name]) for name in stated} == stated
