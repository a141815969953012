"""Drafter conversion cost against the size of the weights: hard links make the written bytes O(1); the source
hashes for the provenance are the only O(size) part, and they are skipped when `model fetch` verified the files.

    .venv/bin/python benchmarks/convert_scaling.py [--sizes-mib 16,256,1024] [--dir DIR]

For each size a drafter (DSpark config + one weights file of that size, random bytes) and a target config are
written under DIR (default: a temp dir on the same filesystem as /tmp), then, each timed:
  cold     convert with no fetch record (hashes every source file),
  fetched  convert after a fetch record exists (as `model fetch` writes it),
  rerun    convert again (no-op),
and the bytes the conversion added to the filesystem (st_blocks of DST's own files, links not counted twice).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_models(root: Path, size_mib: int) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from store_fixtures import TARGET_CONFIG, drafter_config

    drafter, target = root / "drafter", root / "target"
    drafter.mkdir(parents=True)
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(TARGET_CONFIG))
    (drafter / "config.json").write_text(json.dumps(drafter_config()))
    chunk = os.urandom(1 << 20)
    with open(drafter / "model.safetensors", "wb") as out:
        for _ in range(size_mib):
            out.write(chunk)
    return drafter, target


def fetch_record(drafter: Path) -> None:
    """The verified-state file `model fetch` leaves beside DEST/drafter (hashing is not timed)."""
    files = {}
    for path in sorted(drafter.iterdir()):
        stat = path.stat()
        files[path.name] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "size_bytes": stat.st_size,
                            "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    state = drafter.parent / ".b70ctl"
    state.mkdir(exist_ok=True)
    (state / "verified-drafter.json").write_text(json.dumps({"revision": None, "files": files}))


def added_bytes(dst: Path, src: Path) -> int:
    """Blocks DST's files hold that SRC does not already own (a hard link adds none)."""
    total = 0
    for path in dst.iterdir():
        if (src / path.name).exists() and os.path.samefile(path, src / path.name):
            continue
        total += path.stat().st_blocks * 512
    return total


def timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="16,256,1024")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    from b70ctl.models.convert import convert

    base = Path(tempfile.mkdtemp(prefix="b70-convert-bench-", dir=args.dir))
    print(f"{'weights MiB':>11} {'cold s':>8} {'fetched s':>9} {'rerun s':>8} {'bytes added':>11}")
    try:
        for size_mib in [int(s) for s in args.sizes_mib.split(",")]:
            root = base / f"{size_mib}"
            drafter, target = write_models(root, size_mib)
            cold = timed(convert, drafter, root / "cold", "0.32.0", target)
            fetch_record(drafter)
            fetched = timed(convert, drafter, root / "fetched", "0.32.0", target)
            rerun = timed(convert, drafter, root / "fetched", "0.32.0", target)
            added = added_bytes(root / "fetched", drafter)
            print(f"{size_mib:>11} {cold:>8.3f} {fetched:>9.3f} {rerun:>8.3f} {added:>11}")
            shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
