"""What users of a typer CLI and of the reports expect: --version, -h, English counts, one count per GPU line."""

from __future__ import annotations

import subprocess
import sys

from fleet_factory import make_report, write_host

from b70ctl import __version__
from b70ctl.fleet.aggregate import aggregate
from b70ctl.fleet.render import render_markdown as render_fleet
from b70ctl.recipes import load_recipe
from b70ctl.report.markdown import render_markdown
from b70ctl.report.model import Environment


def b70ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from b70ctl.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=120)


def test_version_and_short_help():
    version = b70ctl("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"b70ctl {__version__}"
    short = b70ctl("-h")
    assert short.returncode == 0 and "Usage:" in short.stdout and "verify" in short.stdout
    assert b70ctl("verify", "-h").returncode == 0


def test_one_host_fleet_reads_as_english(tmp_path):
    write_host(tmp_path, "b70-a", make_report("cpu-tiny", "b70-a"))
    headline = render_fleet(aggregate(tmp_path)).splitlines()[2]
    assert "the one host met every claim" in headline and "all 1 hosts" not in headline


def test_gpu_line_prints_the_count_once():
    report = make_report("pr620-fp8-tp2", "b70-a", environment=Environment(gpu_count=2, gpu_model="2x B70"))
    text = render_markdown(report, load_recipe("pr620-fp8-tp2"))
    assert "- GPUs: 2x B70" in text and "2 × 2x B70" not in text
