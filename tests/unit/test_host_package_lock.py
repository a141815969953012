"""The host package lock against the real Debian archive: resolve, the content-addressed cache, `lock check`.

The truth here is what no code of ours made: Debian's own InRelease and Packages index for bookworm and two real
.debs (libze1, the Level Zero loader, and libigdgmm12), downloaded from the machine's own apt source and served
from a local mirror on 127.0.0.1, which a test then moves on (an entry disappears) or tampers with (a .deb's
bytes change). Each pin is checked against dpkg-deb's reading of the real file and python-debian's reading of
the real index; version order against dpkg --compare-versions.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import lzma
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from debian import deb822

from b70ctl.lock.debcache import DEFAULT_LOCK, http_get, load_debs_lock
from b70ctl.lock.debs import satisfies
from debianset import machine_indexes  # the appliance's own reading of the machine's sources

REPO = Path(__file__).resolve().parents[2]

SERIES = "bookworm"
PACKAGES = ("libze1", "libigdgmm12")
INDEX = "main/binary-amd64/Packages.xz"


class Mirror:
    """A local mirror of real files: path -> bytes, changed by the tests (None: 404)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files: dict[str, bytes | None] = dict(files)
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = mirror.files.get(self.path.lstrip("/"))
                if body is None:
                    self.send_error(404)
                    return
                start = 0
                if self.headers.get("Range", "").startswith("bytes="):
                    start = int(self.headers["Range"].removeprefix("bytes=").split("-")[0])
                    self.send_response(206)
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                self.wfile.write(body[start:])

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}/debian"

    def publish_index(self, stanzas: list[str]) -> None:
        """A mirror that moved on: a new Packages.xz and an InRelease listing its sha256."""
        data = lzma.compress("\n\n".join(stanzas).encode() + b"\n", preset=0)  # fast: it is 45 MB
        self.files[f"debian/dists/{SERIES}/{INDEX}"] = data
        self.files[f"debian/dists/{SERIES}/InRelease"] = (
            f"Suite: {SERIES}\nSHA256:\n {hashlib.sha256(data).hexdigest()} {len(data)} {INDEX}\n").encode()


def debian_entries(packages_xz: bytes) -> dict[str, deb822.Packages]:
    """python-debian's reading of the index entries of PACKAGES (its parser, not ours)."""
    paragraphs = lzma.decompress(packages_xz).decode().split("\n\n")
    return {name: deb822.Packages(paragraph) for paragraph in paragraphs for name in PACKAGES
            if paragraph.startswith(f"Package: {name}\n")}


@pytest.fixture(scope="module")
def real_archive() -> dict[str, bytes]:
    """bookworm's real InRelease, main Packages.xz and the two .debs, from the machine's own apt source."""
    uri = next(index["uri"] for index in machine_indexes("debian", SERIES) if index["suite"] == SERIES)
    base = str(uri).rstrip("/")
    files = {f"dists/{SERIES}/InRelease": http_get(f"{base}/dists/{SERIES}/InRelease"),
             f"dists/{SERIES}/{INDEX}": http_get(f"{base}/dists/{SERIES}/{INDEX}")}
    for entry in debian_entries(files[f"dists/{SERIES}/{INDEX}"]).values():
        files[entry["Filename"]] = http_get(f"{base}/{entry['Filename']}")
    assert len(files) == 2 + len(PACKAGES)
    return files


@pytest.fixture
def mirror(real_archive: dict[str, bytes]) -> Iterator[Mirror]:
    served = Mirror({f"debian/{path}": data for path, data in real_archive.items()})
    yield served
    served.server.shutdown()


def write_set(tmp_path: Path, uri: str) -> Path:
    spec = tmp_path / "set.yaml"
    spec.write_text(yaml.safe_dump({"series": {SERIES: {
        "codename": SERIES,
        "indexes": [{"source": "debian", "uri": uri, "suite": SERIES, "components": ["main"]}],
        "groups": {"gpu_runtime": [{"name": name, "source": "debian"} for name in PACKAGES]}}}}))
    return spec


@dataclass
class Run:
    exit_code: int
    stdout: str
    output: str  # stdout and stderr


def b70ctl(*args: str, stdin: str | None = None) -> Run:
    """The console script itself: its exit codes and one-line errors are what a role or a user sees."""
    done = subprocess.run([str(Path(sys.executable).parent / "b70ctl"), *args], input=stdin, capture_output=True,
                          text=True, timeout=300)
    return Run(done.returncode, done.stdout, done.stdout + done.stderr)


def resolve(tmp_path: Path, mirror: Mirror) -> Path:
    lock = tmp_path / "host-packages.lock.json"
    result = b70ctl("lock", "resolve", "--host-packages", "--package-set", str(write_set(tmp_path, mirror.uri)),
                    "--packages-lock", str(lock))
    assert result.exit_code == 0, result.output
    return lock


def fetch(lock: Path, cache: Path) -> dict:
    result = b70ctl("lock", "fetch", "--series", SERIES, "--group", "gpu_runtime", "--cache", str(cache),
                    "--packages-lock", str(lock), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_resolve_pins_what_debian_publishes(tmp_path: Path, mirror: Mirror, real_archive: dict[str, bytes]) -> None:
    locked = load_debs_lock(resolve(tmp_path, mirror)).series[SERIES]
    index = debian_entries(real_archive[f"dists/{SERIES}/{INDEX}"])
    assert [pin.name for pin in locked.packages] == sorted(PACKAGES)  # libc6, libstdc++6...: minbase, not locked
    assert locked.groups["gpu_runtime"].resolved and locked.base_packages > 50
    for pin in locked.packages:
        deb = real_archive[index[pin.name]["Filename"]]
        assert (pin.version, pin.sha256, pin.size_bytes) == (
            index[pin.name]["Version"], hashlib.sha256(deb).hexdigest(), len(deb))
        assert pin.url == f"{mirror.uri}/{index[pin.name]['Filename']}"
        assert pin.index == f"{mirror.uri}/dists/{SERIES}/{INDEX}"
        # dpkg's own reading of the file names the same package, version and file name.
        (tmp_path / pin.filename).write_bytes(deb)
        fields = subprocess.run(["dpkg-deb", "--field", str(tmp_path / pin.filename), "Package", "Version",
                                 "Architecture"], capture_output=True, text=True, check=True).stdout
        assert fields.split() == ["Package:", pin.name, "Version:", pin.version, "Architecture:", pin.architecture]
    (indexed,) = locked.indexes
    assert indexed.sha256 == hashlib.sha256(real_archive[f"dists/{SERIES}/{INDEX}"]).hexdigest()
    assert indexed.release_sha256 == hashlib.sha256(real_archive[f"dists/{SERIES}/InRelease"]).hexdigest()


def test_fetch_fills_the_cache_once_by_content_and_resumes(tmp_path: Path, mirror: Mirror) -> None:
    lock = resolve(tmp_path, mirror)
    cache = tmp_path / "cache"
    pin = next(pin for pin in load_debs_lock(lock).series[SERIES].packages if pin.name == "libze1")
    body = mirror.files[pin.url.split("/", 3)[3]]
    assert body is not None
    # A download cut half-way is continued where it stopped (an HTTP Range request), not started over.
    partial = cache / "sha256" / f"{pin.sha256}.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(body[: len(body) // 2])
    first = fetch(lock, cache)
    assert first["downloaded"] == 2
    for item in first["packages"]:
        assert Path(item["cache_path"]) == cache / "sha256" / item["sha256"]
        assert hashlib.sha256(Path(item["cache_path"]).read_bytes()).hexdigest() == item["sha256"]
    assert not partial.exists()
    assert first["sha256sums"].splitlines()[0] == f"{first['packages'][0]['sha256']}  /var/cache/b70/debs/" \
                                                  f"{first['packages'][0]['filename']}"
    assert fetch(lock, cache)["downloaded"] == 0


def test_an_index_entry_that_disappears_changes_nothing_on_a_locked_host(tmp_path: Path, mirror: Mirror,
                                                                          real_archive: dict[str, bytes]) -> None:
    lock = resolve(tmp_path, mirror)
    cache = tmp_path / "cache"
    fetched = fetch(lock, cache)
    before = lock.read_bytes()
    # The mirror moves on: libze1 leaves the index and its .deb is gone.
    stanzas = lzma.decompress(real_archive[f"dists/{SERIES}/{INDEX}"]).decode().split("\n\n")
    mirror.publish_index([stanza for stanza in stanzas if not stanza.startswith("Package: libze1\n")])
    for path in list(mirror.files):
        if path.endswith(".deb"):
            mirror.files[path] = None
    again = fetch(lock, cache)
    assert again["downloaded"] == 0
    assert [{**item, "downloaded": False} for item in fetched["packages"]] == again["packages"]
    installed = "".join(f"hi {item['name']} {item['version']} amd64\n" for item in fetched["packages"])
    check = b70ctl("lock", "check", "--host-packages", "--packages-lock", str(lock), "--series", SERIES,
                   "--installed", "-", "--group", "gpu_runtime", "--host", "b70-a", stdin=installed)
    assert check.exit_code == 0 and check.stdout.strip() == \
        f"b70-a: the gpu_runtime packages match the lock for {SERIES}"
    # Only an explicit resolve looks again, and it keeps the locked pins rather than trade them for a hole.
    result = b70ctl("lock", "resolve", "--host-packages", "--package-set", str(write_set(tmp_path, mirror.uri)),
                    "--packages-lock", str(lock))
    assert result.exit_code == 2
    assert f"libze1 is not in the debian indexes of {SERIES}" in result.output
    kept = load_debs_lock(lock).series[SERIES]
    assert kept.groups["gpu_runtime"].kept_previous
    assert [pin.model_dump() for pin in kept.packages] == \
        [pin.model_dump() for pin in load_debs_lock_text(before).series[SERIES].packages]


def load_debs_lock_text(text: bytes):
    from b70ctl.lock.debs_model import HostPackageLock

    return HostPackageLock.model_validate_json(text)


def test_a_deb_whose_hash_differs_is_refused_in_one_line(tmp_path: Path, mirror: Mirror) -> None:
    lock = resolve(tmp_path, mirror)
    pin = next(pin for pin in load_debs_lock(lock).series[SERIES].packages if pin.name == "libze1")
    path = pin.url.split("/", 3)[3]
    original = mirror.files[path]
    assert original is not None
    mirror.files[path] = original[:-1] + bytes([original[-1] ^ 1])  # same size, one bit flipped
    cache = tmp_path / "cache"
    result = b70ctl("lock", "fetch", "--series", SERIES, "--cache", str(cache), "--packages-lock", str(lock),
                    "--group", "gpu_runtime")
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"error: {pin.filename}: sha256 ") and f"differs from the lock's {pin.sha256}" in line
    assert "nothing was cached" in line
    assert not (cache / "sha256" / pin.sha256).exists()
    assert not list((cache / "sha256").glob("*.partial"))


def test_lock_check_names_the_host_and_each_package_that_drifted(tmp_path: Path, mirror: Mirror) -> None:
    lock = resolve(tmp_path, mirror)
    pins = {pin.name: pin for pin in load_debs_lock(lock).series[SERIES].packages}
    installed = "hi libze1 1.8.11-1 amd64\nii libc6 2.36-9 amd64\n"  # libigdgmm12 missing, libze1 moved
    result = b70ctl("lock", "check", "--host-packages", "--packages-lock", str(lock), "--series", SERIES,
                    "--installed", "-", "--host", "b70-a", "--hold", "libze1", "--hold", "libigdgmm12", "--json",
                    stdin=installed)
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["host"] == "b70-a" and not report["ok"]
    assert {(item["name"], item["actual"]) for item in report["drift"]} == {
        ("libze1", "1.8.11-1 amd64"), ("libigdgmm12", None)}
    assert report["install_paths"] == sorted(f"/var/cache/b70/debs/{pin.filename}" for pin in pins.values())
    assert report["message"].startswith(f"b70-a: 2 package(s) differ from the lock for {SERIES}: ")
    assert report["hold"] == ["libigdgmm12"]  # libze1 is held already
    # libze1 is held and 1.8.11-1 is below the lock: installed up to it, no downgrade.
    assert report["downgrades"] == [] and report["unhold"] == []


def test_an_unreachable_index_leaves_its_group_unresolved_and_fetch_refuses_it(tmp_path: Path) -> None:
    lock = tmp_path / "host-packages.lock.json"
    result = b70ctl("lock", "resolve", "--host-packages", "--package-set",
                    str(write_set(tmp_path, "http://127.0.0.1:9/debian")), "--packages-lock", str(lock))
    assert result.exit_code == 2 and "unreachable" in result.output
    group = load_debs_lock(lock).series[SERIES].groups["gpu_runtime"]
    assert not group.resolved and "127.0.0.1:9" in (group.reason or "")
    refused = b70ctl("lock", "fetch", "--series", SERIES, "--cache", str(tmp_path / "c"), "--packages-lock",
                     str(lock), "--group", "gpu_runtime")
    assert refused.exit_code == 2 and "is not resolved" in refused.output


@pytest.mark.parametrize(("left", "op", "right"), [
    ("1.28.2-1~24.04~ppa1", "<<", "1.28.2-1"), ("2:1.02.185-2", ">>", "1.03"), ("1.0", "=", "1.0-0"),
    ("26.05.37020.3-1", ">=", "26.05.37020.3-1"), ("7.0.0-44.44~24.04.1", "<<", "7.0.0-44.44"),
    ("1.0+dfsg1-1+b6", ">>", "1.0+dfsg1-1"), ("1.0a", "<=", "1.0~b"),
])
def test_version_order_is_dpkgs(left: str, op: str, right: str) -> None:
    truth = subprocess.run(["dpkg", "--compare-versions", left, {"<<": "lt", ">>": "gt", "=": "eq", ">=": "ge",
                                                                 "<=": "le"}[op], right]).returncode == 0
    assert satisfies(left, op, right) is truth


def test_the_committed_lock_pins_what_ubuntu_publishes_and_says_what_it_could_not() -> None:
    """The appliance's own lock (control/b70ctl/host/packages.lock.json), resolved against the Ubuntu archive.
    Its resolute GPU runtime is the one public 26.04.1 B70 host inventories list from the archive (libze1 1.28.2-2,
    libze-intel-gpu1 26.05.37020.3-1: tests/fixtures/apt-manifest.yaml); noble's comes from Intel's OMIX repository,
    which this machine cannot reach: that group says so instead of pinning anything."""
    from b70ctl.host.releases import load_matrix

    lock = load_debs_lock(DEFAULT_LOCK)
    manifest = yaml.safe_load((REPO / "tests" / "fixtures" / "apt-manifest.yaml").read_text())
    archive = {entry["name"]: entry["version"]
               for entry in manifest["sources"]["ubuntu-archive"]["packages"]["resolute"]}
    resolute = {pin.name: pin for pin in lock.series["resolute"].packages}
    assert {name: resolute[name].version for name in ("libze1", "libze-intel-gpu1")} == \
        {name: archive[name] for name in ("libze1", "libze-intel-gpu1")}
    assert all(pin.url.startswith("http://archive.ubuntu.com/ubuntu/pool/") for pin in resolute.values())
    noble = lock.series["noble"].groups["gpu_runtime"]
    assert not noble.resolved and "repositories.intel.com/gpu/ubuntu/dists/noble/intel-omix/0.4" in (noble.reason or "")
    for release in load_matrix().supported:
        groups = lock.series[release.codename].groups
        assert groups["kernel"].requested == [release.kernel.package, release.firmware.package]
        assert groups["gpu_runtime"].requested == ["libze1", "libze-intel-gpu1"]
        assert groups["container_engine"].requested == ["docker.io"]
        assert groups["kernel"].resolved and groups["container_engine"].resolved
        kernel = {pin.name: pin.version for pin in lock.series[release.codename].group_pins("kernel")}
        # The meta-package brings the release's kernel series or a newer one (24.04's HWE moved from 6.17 to 7.0).
        assert satisfies(kernel[release.kernel.package], ">=", release.kernel.series)


def test_gzip_indexes_are_read_too(tmp_path: Path, real_archive: dict[str, bytes]) -> None:
    """Some mirrors (and PPAs) list only Packages.gz: the same entries come out."""
    stanzas = lzma.decompress(real_archive[f"dists/{SERIES}/{INDEX}"])
    data = gzip.compress(stanzas)
    path = "main/binary-amd64/Packages.gz"
    served = Mirror({f"debian/dists/{SERIES}/{path}": data,
                     f"debian/dists/{SERIES}/InRelease":
                         f"SHA256:\n {hashlib.sha256(data).hexdigest()} {len(data)} {path}\n".encode()})
    try:
        lock = resolve(tmp_path, served)
        assert [pin.name for pin in load_debs_lock(lock).series[SERIES].packages] == sorted(PACKAGES)
    finally:
        served.server.shutdown()


def test_fetches_at_once_take_turns_and_each_file_is_downloaded_once(tmp_path: Path, mirror: Mirror) -> None:
    """The play fetches for each host in its own fork: they must not write one .partial together."""
    lock = resolve(tmp_path, mirror)
    cache = tmp_path / "cache"
    command = [str(Path(sys.executable).parent / "b70ctl"), "lock", "fetch", "--series", SERIES, "--group",
               "gpu_runtime", "--cache", str(cache), "--packages-lock", str(lock), "--json"]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0], results
    assert sum(json.loads(out)["downloaded"] for out, _ in results) == len(PACKAGES)


@pytest.mark.parametrize(("content", "problem"), [
    ('{"schema_version": 1, "series": {', "not valid JSON (line 1)"),
    ("[1]", "expected a JSON object, found list"),
])
def test_a_broken_host_package_lock_is_one_line_naming_the_fix(tmp_path, content, problem):
    """A lock cut short (a full disk, an interrupted checkout) failed `lock check` and `lock fetch` with "failed
    unexpectedly (JSONDecodeError)" and a traceback file."""
    lock = tmp_path / "host-packages.lock.json"
    lock.write_text(content)
    for args in (["lock", "check", "--host-packages", "--series", SERIES, "--installed", "-"],
                 ["lock", "fetch", "--series", SERIES, "--cache", str(tmp_path / "cache")]):
        result = b70ctl(*args, "--packages-lock", str(lock), stdin="")
        assert result.exit_code == 2, result.output
        assert result.output.strip() == (f"error: {lock}: {problem}: re-run `b70ctl lock resolve --host-packages`, "
                                         "or restore the file from git")


# Relations as Debian bookworm's Packages index gives them (libze1 1.8.12-1's Depends, read with apt-cache show), and
# the forms policy 7.1 allows: alternatives, an architecture qualifier, and no relation at all.
@pytest.mark.parametrize(("text", "parsed"), [
    ("libc6 (>= 2.34), libgcc-s1 (>= 3.0), libstdc++6 (>= 11)",
     [[("libc6", ">=", "2.34")], [("libgcc-s1", ">=", "3.0")], [("libstdc++6", ">=", "11")]]),
    ("default-mta | mail-transport-agent, python3:any (<< 3.12)",
     [[("default-mta", None, None), ("mail-transport-agent", None, None)], [("python3", "<<", "3.12")]]),
    ("", []),
])
def test_relations_are_read_as_policy_writes_them(text: str, parsed: list) -> None:
    from b70ctl.lock.debs import parse_relations

    assert parse_relations(text) == parsed


def test_a_relation_that_cannot_be_read_is_refused_not_taken_raw() -> None:
    from b70ctl.lock.debs import ResolveError, parse_relations

    with pytest.raises(ResolveError) as refused:
        parse_relations("libc6 (>= 2.34), libfoo ((>= 1)")
    assert str(refused.value) == "cannot read the relation 'libfoo ((>= 1)'"
