#!/usr/bin/env python3
"""Wall seconds of a no-op re-run of the site.yml host stages: one host, and four hosts in parallel (forks).

Brings up four systemd test hosts (scripts/testhosts; prefix b70-bench), gives them their emulated hardware and
the local apt repository exactly as the appliance tests do, provisions them once, then times the re-runs, which
must change nothing. Prints one table; tears the hosts down unless --keep. Needs root.

    .venv/bin/python benchmarks/host_stages_noop.py [--repeats 2] [--keep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "appliance"))

from provision import run_playbook, start_hosts, testhosts, write_inventory  # noqa: E402

PREFIX = "b70-bench"
SUBNET = "172.30.73.0/24"
SCENARIOS = {1: "b70x2-switch", 2: "b70x2-root-ports", 3: "b70x2-switch", 4: "b70x2-root-ports"}


def timed_noop_run(inventory: Path, forks: int, limit: str | None) -> float:
    args = ["--forks", str(forks)] + (["--limit", limit] if limit else [])
    started = time.monotonic()
    run = run_playbook(inventory, *args, playbook="playbooks/host.yml")
    wall_s = time.monotonic() - started
    changed = {host: counts["changed"] for host, counts in run.recap.items()}
    if run.returncode != 0 or any(changed.values()):
        raise SystemExit(f"not a no-op run (exit {run.returncode}, changed {changed}):\n{run.output[-3000:]}")
    return wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="timed re-runs per configuration (median shown)")
    parser.add_argument("--keep", action="store_true", help="leave the hosts running afterwards")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="b70-bench-") as work:
        work_dir = Path(work)
        try:
            hosts, ssh_key = start_hosts(PREFIX, SUBNET, SCENARIOS, work_dir)
            inventory = write_inventory(work_dir / "bench.yml", hosts, ssh_key)
            started = time.monotonic()
            first = run_playbook(inventory, "--forks", "4", playbook="playbooks/host.yml")
            if first.returncode != 0:
                raise SystemExit(f"provisioning failed:\n{first.output[-3000:]}")
            provision_s = time.monotonic() - started
            one = [timed_noop_run(inventory, 1, hosts[0].name) for _ in range(args.repeats)]
            four = [timed_noop_run(inventory, 4, None) for _ in range(args.repeats)]
        finally:
            if not args.keep:
                testhosts("down", "--prefix", PREFIX)
    print(f"host stages, no-op re-run (changed=0), wall seconds, median of {args.repeats}")
    print(f"{'hosts':>6} {'forks':>6} {'wall_s':>8}   runs")
    print(f"{1:>6} {1:>6} {statistics.median(one):>8.1f}   {' '.join(f'{s:.1f}' for s in one)}")
    print(f"{4:>6} {4:>6} {statistics.median(four):>8.1f}   {' '.join(f'{s:.1f}' for s in four)}")
    print(f"(first provisioning of the 4 hosts, forks 4: {provision_s:.1f} s)")


if __name__ == "__main__":
    main()
