#!/usr/bin/env python3
"""Wall seconds of no-op re-runs: the host stages (playbooks/host.yml) on 1, 4 and 16 hosts in parallel, and the
whole site.yml (CPU vLLM image, tiny models, serving, verify) on one host. Each configuration twice over: as users
run it (a converged host skips each stage on its recorded generation), and with every stage run in full
(-e generation_enabled=false, which is what a re-run cost before generations and what a run costs when
something changed).

Brings up systemd test hosts (scripts/testhosts; prefix b70-bench), gives them their emulated hardware and the
local apt repository exactly as the appliance tests do, provisions them once, then times the re-runs, which must
change nothing. The load average (1 min) is printed beside each run: the machine's other work moves the figures.
Prints one table; tears the hosts down unless --keep (--reuse keeps hosts already up from an earlier --keep).
With --profile DIR every timed run also goes through benchmarks/callbacks/task_times.py: DIR gets one JSON per run
(wall seconds per task) and the table is followed by where each configuration's fastest run spent its time.
Needs root.

    .venv/bin/python benchmarks/host_stages_noop.py [--sizes 1,4,16] [--site] [--repeats 2] [--keep] [--reuse]
        [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "appliance"))

from provision import run_playbook, run_testhosts, start_hosts, write_inventory

PREFIX = "b70-bench"
SUBNET = "172.30.78.0/24"
SCENARIOS = ("b70x2-switch", "b70x2-root-ports")
CALLBACKS = Path(__file__).resolve().parent / "callbacks"
PROFILE: dict[str, Path] = {}  # "dir": where --profile writes each run's task times


def timed_noop_run(inventory: Path, forks: int, playbook: str, *extra: str) -> tuple[float, float]:
    """(wall seconds, 1-minute load average when it started) of a run that must change nothing."""
    if "dir" in PROFILE:
        name = f"{Path(playbook).stem}-{inventory.stem}-{'full' if extra else 'gen'}"
        runs = len(list(PROFILE["dir"].glob(f"{name}-*.json")))
        os.environ.update(ANSIBLE_CALLBACK_PLUGINS=str(CALLBACKS), ANSIBLE_CALLBACKS_ENABLED="task_times",
                          B70_TASK_TIMES=str(PROFILE["dir"] / f"{name}-{runs + 1}.json"))
    load_1min = os.getloadavg()[0]
    started = time.monotonic()
    run = run_playbook(inventory, "--forks", str(forks), *extra, playbook=playbook)
    wall_s = time.monotonic() - started
    changed = {host: counts["changed"] for host, counts in run.recap.items()}
    if run.returncode != 0 or any(changed.values()):
        raise SystemExit(f"{playbook}: not a no-op run (exit {run.returncode}, changed {changed}):\n"
                         f"{run.output[-3000:]}")
    return wall_s, load_1min


def print_profiles(directory: Path, top: int = 8) -> None:
    """For each configuration, its fastest run: the time outside tasks and the slowest tasks."""
    fastest: dict[str, dict] = {}
    for path in sorted(directory.glob("*.json")):
        run = json.loads(path.read_text())
        name = path.stem.rsplit("-", 1)[0]
        if name not in fastest or run["wall_s"] < fastest[name]["wall_s"]:
            fastest[name] = run
    for name, run in fastest.items():
        print(f"\n{name}: {run['wall_s']:.1f} s, {len(run['tasks'])} tasks; {run['outside_tasks_s']:.1f} s outside "
              "tasks (start-up, inventory and playbook parsing, recap)")
        for task in sorted(run["tasks"], key=lambda task: -task["wall_s"])[:top]:
            print(f"  {task['wall_s']:6.2f} s  {task['hosts']:3d} host(s)  {task['play'][:40]} | {task['task'][:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,4,16", help="host counts for the host stages (comma-separated)")
    parser.add_argument("--site", action="store_true", help="also time the whole site.yml on one host")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed re-runs per configuration, taken in rounds (median shown)")
    parser.add_argument("--keep", action="store_true", help="leave the hosts running afterwards")
    parser.add_argument("--reuse", action="store_true", help="keep hosts already running under the prefix")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="write each timed run's task times to DIR")
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        PROFILE["dir"] = args.profile.resolve()
    sizes = sorted({int(size) for size in args.sizes.split(",")})
    rows: list[tuple[str, int, list[tuple[float, float]], list[tuple[float, float]]]] = []
    full = ("-e", "generation_enabled=false")
    with tempfile.TemporaryDirectory(prefix="b70-bench-") as work:
        work_dir = Path(work)
        try:
            scenarios = {index: SCENARIOS[(index - 1) % 2] for index in range(1, max(sizes) + 1)}
            hosts, ssh_key = start_hosts(PREFIX, SUBNET, scenarios, work_dir, fresh=not args.reuse)
            largest = write_inventory(work_dir / "all.yml", hosts, ssh_key)
            started = time.monotonic()
            first = run_playbook(largest, "--forks", str(len(hosts)), playbook="playbooks/host.yml")
            if first.returncode != 0:
                raise SystemExit(f"provisioning failed:\n{first.output[-3000:]}")
            print(f"host stages, first run on {len(hosts)} host(s): {time.monotonic() - started:.1f} s", flush=True)
            configurations: list[tuple[str, int, Path]] = []
            if args.site:
                one = write_inventory(work_dir / "site-1.yml", hosts[:1], ssh_key)
                first = run_playbook(one, playbook="site.yml")
                if first.returncode != 0:
                    raise SystemExit(f"site.yml failed:\n{first.output[-3000:]}")
                configurations.append(("site.yml", 1, one))
            for size in sizes:
                configurations.append(("playbooks/host.yml", size,
                                       write_inventory(work_dir / f"hosts-{size}.yml", hosts[:size], ssh_key)))
            # In rounds, every configuration once per round, so that one host and sixteen are compared under the
            # same load; then each once in full.
            runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
            for _ in range(args.repeats):
                for playbook, size, inventory in configurations:
                    runs.setdefault((playbook, size), []).append(timed_noop_run(inventory, size, playbook))
            for playbook, size, inventory in configurations:
                rows.append((playbook, size, runs[playbook, size],
                             [timed_noop_run(inventory, size, playbook, *full)]))
        finally:
            if not args.keep:
                run_testhosts("down", "--prefix", PREFIX)
    print(f"no-op re-run (changed=0), wall seconds: median of {args.repeats} as users run it (generations), one "
          "with every stage in full; load average (1 min) at each start")
    print(f"{'playbook':<20} {'hosts':>5} {'forks':>5} {'wall_s':>7}   runs (wall_s @ load)   in full (wall_s @ load)")
    for playbook, size, runs, in_full in rows:
        median = statistics.median(wall for wall, _ in runs)
        detail = " ".join(f"{wall:.1f}@{load:.1f}" for wall, load in runs)
        full_detail = " ".join(f"{wall:.1f}@{load:.1f}" for wall, load in in_full)
        print(f"{playbook:<20} {size:>5} {size:>5} {median:>7.1f}   {detail}   {full_detail}")
    host_rows = [(size, runs) for playbook, size, runs, _ in rows if playbook == "playbooks/host.yml"]
    if len(host_rows) > 1:
        (small, small_runs), (large, large_runs) = host_rows[0], host_rows[-1]
        print(f"\nper round, host stages on {large} hosts against {small}: "
              + ", ".join(f"{big:.1f}/{little:.1f} = {big / little:.2f}x"
                          for (big, _), (little, _) in zip(large_runs, small_runs)))
    if "dir" in PROFILE:
        print_profiles(PROFILE["dir"])


if __name__ == "__main__":
    main()
