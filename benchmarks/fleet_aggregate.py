"""Fleet report at scale: aggregate 100 / 1,000 / 5,000 generated host reports into fleet.json, fleet.md and
fleet.html; print a markdown table of fleet.md's size in characters (GitHub takes 65,536 in an issue), wall time,
CPU time and peak memory per size.

    .venv/bin/python benchmarks/fleet_aggregate.py [--sizes 100,1000,5000] [--keep DIR]

The reports are generated first (not timed): pr620-fp8-tp2 hosts with 8 requests per workload and 5 greedy
comparisons of 128 token ids each (the size of a real verify report), planted as the tests' synthetic fleets are
(fleet_factory.fleet_host_kind): 10% no-P2P hosts 12% slower, 3% on another kernel, 1% slow outliers, 0.5%
unreachable and 0.2% truncated reports. Each size is then measured in a fresh
process, twice: once for time and resident memory (ru_maxrss, and its growth over the process after imports),
once under tracemalloc for the peak Python heap (tracemalloc slows allocation, so that run is not timed). Both
leave the imports out; a third run times the whole command, `b70ctl fleet report REPORTS_DIR --out DIR`, from
interpreter start to exit. Its imports come from compiled bytecode, as in an installed b70ctl: the child processes
get their own PYTHONPYCACHEPREFIX (filled by a warm-up import first) even where PYTHONDONTWRITEBYTECODE is set.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def generate(reports_dir: Path, hosts: int) -> None:
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from fleet_factory import environment_for, fleet_host_kind, fleet_host_name, make_report, write_host

    for index in range(hosts):
        host = fleet_host_name(index)
        kind, speed, overrides = fleet_host_kind(index)
        if kind == "unreachable":
            write_host(reports_dir, host, unreachable={"kind": "unreachable", "stage": "verify",
                                                       "reason": "ssh: connect timed out", "recipe": "pr620-fp8-tp2"})
            continue
        report = make_report("pr620-fp8-tp2", host, speed=speed, environment=environment_for(host, **overrides),
                             requests_per_workload=8, tokens_per_comparison=128)
        if kind == "truncated":
            text = report.model_dump_json()
            write_host(reports_dir, host).joinpath("report.json").write_text(text[: len(text) // 2])
        else:
            write_host(reports_dir, host, report)


def measure(reports_dir: Path, out_dir: Path, trace: bool) -> dict[str, float]:
    """Runs in a fresh process: aggregate + render all three outputs once."""
    import tracemalloc

    from b70ctl.fleet.analysis import aggregate
    from b70ctl.fleet.render import write_fleet_report

    rss_after_imports_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if trace:
        tracemalloc.start()
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    report = aggregate(reports_dir)
    aggregated_s, aggregated_cpu_s = time.perf_counter() - wall_start, time.process_time() - cpu_start
    paths = write_fleet_report(report, out_dir)
    wall_s, cpu_s = time.perf_counter() - wall_start, time.process_time() - cpu_start
    result = {
        "hosts": report.summary.hosts,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "aggregate_wall_s": aggregated_s,
        "aggregate_cpu_s": aggregated_cpu_s,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_after_imports_kib) / 1024,
        "json_kib": paths["fleet.json"].stat().st_size / 1024,
        "md_kib": paths["fleet.md"].stat().st_size / 1024,
        "md_characters": len(paths["fleet.md"].read_text(encoding="utf-8")),
        "html_kib": paths["fleet.html"].stat().st_size / 1024,
    }
    if trace:
        result["traced_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
    return result


def _child_environment(root: Path) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    environment["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
    return environment


def _child(reports_dir: Path, out_dir: Path, trace: bool, environment: dict[str, str]) -> dict[str, float]:
    command = [sys.executable, __file__, "--measure", str(reports_dir), str(out_dir)] + (["--trace"] if trace else [])
    completed = subprocess.run(command, capture_output=True, text=True, check=True, env=environment)
    return json.loads(completed.stdout)


def _command(reports_dir: Path, out_dir: Path, environment: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of `b70ctl fleet report` in a fresh process, imports included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    completed = subprocess.run([sys.executable, "-c", "from b70ctl.cli import main; main()", "fleet", "report",
                                str(reports_dir), "--out", str(out_dir)], capture_output=True, text=True,
                               env=environment)
    wall_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode not in (0, 1):  # 1: some host did not meet every claim, as planted
        raise RuntimeError(f"b70ctl fleet report exited {completed.returncode}: {completed.stderr}")
    return wall_s, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,5000")
    parser.add_argument("--keep", type=Path, help="Generate into this directory and keep it")
    parser.add_argument("--measure", nargs=2, type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, trace=args.trace)))
        return
    sizes = [int(size) for size in args.sizes.split(",")]
    root = args.keep or Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    largest = root / f"reports-{max(sizes)}"
    started = time.perf_counter()
    if largest.is_dir():
        print(f"reusing the {max(sizes)} host reports under {root}")
    else:
        generate(largest, max(sizes))
        print(f"generated {max(sizes)} host reports in {time.perf_counter() - started:.1f} s under {root}")
    print(f"report.json about {(largest / 'b70-00000' / 'report.json').stat().st_size / 1024:.0f} KiB each; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (wall time suffers on a shared machine, "
          "CPU time much less)")
    environment = _child_environment(root)
    subprocess.run([sys.executable, "-c", "import b70ctl.cli, b70ctl.fleet.analysis, b70ctl.fleet.render"],
                   check=True, env=environment)  # compiles the bytecode the timed commands import
    rows = []
    for size in sizes:
        reports_dir = largest
        if size != max(sizes):
            # The first `size` hosts of the largest set, linked: the same reports, no second generation.
            reports_dir = root / f"reports-{size}"
            if not reports_dir.is_dir():
                reports_dir.mkdir()
                for host in sorted(os.listdir(largest))[:size]:
                    (reports_dir / host).symlink_to(largest / host)
        timed = _child(reports_dir, root / f"out-{size}", trace=False, environment=environment)
        traced = _child(reports_dir, root / f"out-{size}-traced", trace=True, environment=environment)
        command_wall_s, command_cpu_s = _command(reports_dir, root / f"out-{size}-command", environment)
        rows.append(f"| {timed['hosts']:,} | {timed['md_characters']:,} | {command_wall_s:.2f} / {command_cpu_s:.2f} | "
                    f"{timed['wall_s']:.2f} / {timed['cpu_s']:.2f} | {timed['aggregate_wall_s']:.2f} / "
                    f"{timed['aggregate_cpu_s']:.2f} | {traced['traced_peak_mib']:.0f} MiB | "
                    f"{timed['max_rss_mib']:.0f} MiB | {timed['json_kib']:,.0f} | {timed['html_kib']:,.0f} |")
        print(f"measured {size} hosts", file=sys.stderr, flush=True)
    print()
    print("| hosts | fleet.md characters | `b70ctl fleet report` wall / CPU s | in process wall / CPU s | "
          "aggregation wall / CPU s | peak heap (tracemalloc) | max RSS | fleet.json KiB | fleet.html KiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    if args.keep is None:
        print(f"(generated reports left in {root}; remove it when done)")


if __name__ == "__main__":
    main()
