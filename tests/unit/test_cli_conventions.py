"""What users of a typer CLI and of the reports expect: --version, -h, shell completion, --json on every command
(people's form by default, on stdout), choices that help and completion list, --recipe everywhere, vllm-style
--base-url and API key variables; English counts, one count per GPU line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from b70ctl import __version__
from b70ctl.fleet.analysis import aggregate
from b70ctl.fleet.render import render_markdown as render_fleet
from b70ctl.recipes import load_recipe
from b70ctl.report.markdown import render_markdown
from b70ctl.report.model import Environment
from fleet_factory import make_report, write_host
from scripted_server import ScriptedServer


def b70ctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from b70ctl.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def commands() -> dict[str, object]:
    """Every leaf command of b70ctl, by its words ("lock status")."""
    from b70ctl.cli import app

    found: dict[str, object] = {}

    def walk(command: object, words: list[str]) -> None:
        if not hasattr(command, "list_commands"):  # a leaf; groups are asked as click asks them (some load lazily)
            found[" ".join(words)] = command
            return
        context = typer.Context(command)
        for name in command.list_commands(context):
            walk(command.get_command(context, name), [*words, name])
    walk(typer.main.get_command(app), [])
    return found


def completions(*words: str) -> list[str]:
    """What bash completion offers after WORDS (the last one being completed), as the installed script asks."""
    env = {**os.environ, "_B70CTL_COMPLETE": "complete_bash", "COMP_WORDS": " ".join(["b70ctl", *words]),
           "COMP_CWORD": str(len(words))}
    done = subprocess.run([str(Path(sys.executable).with_name("b70ctl"))], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_version_and_short_help():
    version = b70ctl("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"b70ctl {__version__}"
    short = b70ctl("-h")
    assert short.returncode == 0 and "Usage:" in short.stdout and "verify" in short.stdout
    assert b70ctl("verify", "-h").returncode == 0


def test_shell_completion_is_offered_and_completes_commands_and_choices():
    assert "--install-completion" in b70ctl("-h").stdout
    # The shell is named, not detected: typer otherwise looks for a shell among the process's ancestors, and a
    # run detached from its shell (nohup, a service) has none ("Shell  not supported").
    script = subprocess.run([str(Path(sys.executable).with_name("b70ctl")), "--show-completion", "bash"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert script.returncode == 0 and "_B70CTL_COMPLETE=complete_bash" in script.stdout
    assert completions("ver") == ["verify"]
    assert completions("verify", "--check", "") == ["smoke", "correctness", "throughput"]
    assert completions("host", "topology", "--profile", "") == ["auto", "p2p", "no-p2p"]
    assert completions("model", "fetch", "--source", "") == ["hub", "cache", "local"]


def test_every_command_has_json():
    without = [words for words, command in commands().items()
               if "--json" not in [name for param in command.params for name in param.opts]]
    assert len(commands()) >= 22 and without == []


@pytest.mark.parametrize(("words", "option", "shown"), [
    ("verify", "--check", "[smoke|correctness|throughput]"),
    ("host topology", "--profile", "[auto|p2p|no-p2p]"),
    ("host topology", "--probe", "[auto|never]"),
    ("model fetch", "--source", "[hub|cache|local]"),
])
def test_choices_are_listed_in_help_and_refused_in_one_line(words, option, shown):
    help_text = b70ctl(*words.split(), "-h", env={**os.environ, "COLUMNS": "200"}).stdout
    assert shown in help_text
    refused = b70ctl(*words.split(), option, "bogus")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [f"error: {option} 'bogus': " + (
        "unknown check; " if option == "--check" else "") + f"choose one of {', '.join(shown[1:-1].split('|'))}"]


def test_host_fit_takes_recipe_like_every_command_and_the_old_positional_still_works():
    with_option = b70ctl("host", "fit", "--recipe", "cpu-tiny", "--json")
    positional = b70ctl("host", "fit", "cpu-tiny", "--json")
    assert with_option.returncode == positional.returncode == 0, with_option.stderr
    assert json.loads(with_option.stdout) == json.loads(positional.stdout)
    assert with_option.stderr == ""
    assert positional.stderr.strip() == ("warning: `b70ctl host fit RECIPE` is deprecated and will be removed: "
                                         "write `b70ctl host fit --recipe cpu-tiny`")
    twice = b70ctl("host", "fit", "cpu-tiny", "--recipe", "cpu-tiny")
    assert twice.returncode == 2 and "given twice" in twice.stderr


def test_verify_prints_its_verdicts_on_stdout_and_takes_base_url_and_vllm_api_key(tmp_path):
    """`b70ctl verify ... | tee` keeps the verdicts; --base-url and VLLM_API_KEY work as for `vllm bench serve`."""
    with ScriptedServer() as served:
        env = {**os.environ, "VLLM_API_KEY": "sk-vllm-key-123"}
        for name in ("B70CTL_API_KEY", "OPENAI_API_KEY"):
            env.pop(name, None)
        done = b70ctl("verify", "--base-url", served.url, "--recipe", "cpu-tiny", "--model", "scripted",
                      "--check", "smoke", "--out", str(tmp_path / "out"), "--timeout", "5", env=env)
        authorizations = list(served.authorizations)
    assert done.returncode in (0, 1), done.stderr
    assert "checks: smoke " in done.stdout and f"report: {tmp_path / 'out' / 'report.md'}" in done.stdout
    assert "checks:" not in done.stderr
    assert "using the API key in $VLLM_API_KEY" in done.stderr and "sk-vllm-key-123" not in done.stderr
    assert authorizations and all(a == "Bearer sk-vllm-key-123" for a in authorizations)
    assert json.loads((tmp_path / "out" / "report.json").read_text())["endpoint"] == served.url


def test_one_host_fleet_reads_as_english(tmp_path):
    write_host(tmp_path, "b70-a", make_report("cpu-tiny", "b70-a"))
    headline = render_fleet(aggregate(tmp_path)).splitlines()[2]
    assert "the one host met every claim" in headline and "all 1 hosts" not in headline


def test_gpu_line_prints_the_count_once():
    report = make_report("pr620-fp8-tp2", "b70-a", environment=Environment(gpu_count=2, gpu_model="2x B70"))
    text = render_markdown(report, load_recipe("pr620-fp8-tp2"))
    assert "- GPUs: 2x B70" in text and "2 × 2x B70" not in text
