"""Every string from outside crosses one boundary per output kind (b70ctl.escaping): each boundary against the
whole corpus (hostile_strings.py), the renderers with every string of a report poisoned, and real runs against
fake servers on loopback whose answers hold the corpus."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import types
import typing
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt
from pydantic import BaseModel

from b70ctl.errors import BadInput
from b70ctl.escaping import (
    TerminalStream,
    html_text,
    markdown_code,
    markdown_code_block,
    markdown_text,
    one_line,
    path_part,
    terminal_text,
)
from hostile import run_b70ctl
from hostile_strings import ALL, GOOD_PATH_PARTS, GROUPS, PATHS

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
PARSER = MarkdownIt("commonmark").enable("table").enable("strikethrough")


def test_the_corpus_counts_by_group():
    counts = {group: len(members) for group, members in GROUPS.items()}
    assert counts == {"terminal": 19, "markdown": 25, "html": 7, "line-breaks": 8, "paths": 15}
    assert len(ALL) == sum(counts.values())


def _skeleton(markdown: str) -> list[tuple[str, str]]:
    """Every token but text, flattened: the document's structure, whatever its words."""
    shape = []
    for token in PARSER.parse(markdown):
        shape.append((token.type, token.tag))
        shape += [(child.type, child.tag) for child in token.children or [] if child.type != "text"]
    return shape


def _words(markdown: str) -> list[str]:
    """The text of every inline run, as a reader sees it (escapes and entities resolved)."""
    return ["".join(child.content for child in token.children or [] if child.type in ("text", "code_inline"))
            for token in PARSER.parse(markdown) if token.type == "inline"]


def _strong_texts(markdown: str) -> list[str]:
    """What reads in bold."""
    found: list[str] = []
    for token in PARSER.parse(markdown):
        depth = 0
        for child in token.children or []:
            if child.type == "strong_open":
                depth += 1
                found.append("")
            elif child.type == "strong_close":
                depth -= 1
            elif depth and child.type == "text":
                found[-1] += child.content
    return found


def _document(value: str) -> str:
    return "\n".join(["# Report", "", f"**{markdown_text(value)}.** Claims met: 1 of 2.", "",
                      "| claim | verdict |", "|---|---|", f"| {markdown_text(value)} | met |", "",
                      f"- evidence {markdown_code(value)} and {markdown_text(value, 40)}", "",
                      *markdown_code_block(value), "", "Raw data is in `raw/`.", ""])


@pytest.mark.parametrize("name", sorted(ALL))
def test_markdown_boundary_keeps_the_structure_and_the_words(name):
    value = ALL[name]
    document = _document(value)
    assert _skeleton(document) == _skeleton(_document("plain"))
    words = _words(document)
    assert words[1] == one_line(value).strip() + ". Claims met: 1 of 2."  # reads as it was sent, on one line
    if "|" not in value:  # a pipe in a cell is the one character a table reader treats on its own
        assert words[4] == one_line(value).strip()
    assert words[-1] == "Raw data is in raw/."  # nothing was swallowed
    rendered = PARSER.render(document)
    assert "<script" not in rendered and "<img" not in rendered and 'href="javascript' not in rendered


@pytest.mark.parametrize("name", sorted(ALL))
def test_terminal_boundary_leaves_text_only(name):
    value = ALL[name]
    shown = terminal_text(value + "\nnext line")
    assert not CONTROL.search(shown), repr(shown)
    assert "\x1b" not in shown
    assert shown.endswith("\nnext line")  # an unterminated sequence takes nothing past its own line
    stream = io.StringIO()
    TerminalStream(stream).write(f"| {value} | met |\nnext row\n")
    assert not CONTROL.search(stream.getvalue()) and stream.getvalue().endswith("\nnext row\n")


def test_the_terminal_stream_keeps_rich_colours_on_a_terminal_and_nothing_else():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    TerminalStream(terminal).write(f"\x1b[1;31merror:\x1b[0m {GROUPS['terminal']['osc-52-clipboard']} "
                                   f"{GROUPS['terminal']['csi-clear-screen']}\r\x1b[2K")
    assert terminal.getvalue() == "\x1b[1;31merror:\x1b[0m ok after clean\r\x1b[2K"


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.data: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))

    def handle_data(self, data: str) -> None:
        self.data.append(data)


@pytest.mark.parametrize("name", sorted(ALL))
def test_html_boundary_is_text_and_attribute_only(name):
    value = ALL[name]
    parser = _Tags()
    parser.feed(f'<table><tr><td title="{html_text(value)}">{html_text(value)}</td></tr></table><p>end</p>')
    parser.close()
    shown = terminal_text(value)
    assert parser.tags == [("table", []), ("tr", []), ("td", [("title", shown)]), ("p", [])]
    assert "".join(parser.data) == shown + "end"


@pytest.mark.parametrize("name", sorted(PATHS))
def test_path_boundary_refuses_every_hostile_name(name):
    with pytest.raises(BadInput, match=r"workload name .*not usable as a file name.*: rename it"):
        path_part(PATHS[name], "workload name", "rename it")


def test_path_boundary_keeps_ordinary_names():
    assert [path_part(name, "workload name", "rename it") for name in GOOD_PATH_PARTS] == list(GOOD_PATH_PARTS)


# --- the renderers with every string of a report poisoned --------------------------------------------------------

EVERYTHING = " ".join(ALL.values())


def _takes_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(arg is str for arg in typing.get_args(annotation))
    return False


def _poisoned(value: Any, annotation: Any, hostile: str) -> Any:
    if isinstance(value, BaseModel):
        return value.model_copy(update={name: _poisoned(getattr(value, name), field.annotation, hostile)
                                        for name, field in type(value).model_fields.items()})
    if isinstance(value, list):
        lists = [arg for arg in (annotation, *typing.get_args(annotation)) if typing.get_origin(arg) is list]
        inner = typing.get_args(lists[0])[0] if lists else None
        return [_poisoned(item, inner, hostile) for item in value]
    if isinstance(value, str) and _takes_text(annotation):
        return hostile
    return value


def _full_report() -> tuple[Any, Any]:
    from b70ctl.recipes import load_recipe
    from b70ctl.report.model import DiagnosedFailure
    from fleet_factory import make_report

    report = make_report("cpu-tiny", "b70-a")
    report.passed = False
    report.partial, report.partial_reason = True, "failed"
    report.diagnosis = [DiagnosedFailure(id="garbage", title="t", fix="f", evidence=["line"])]
    report.environment.serve_command = "vllm serve x"
    report.environment.rehearsal = ["one change"]
    for workload in report.throughput.workloads:
        workload.error = "stopped"
    return report, load_recipe("cpu-tiny")


@pytest.mark.parametrize("hostile", [EVERYTHING, *GROUPS["markdown"].values(), *GROUPS["terminal"].values()][:30])
def test_report_md_keeps_its_structure_whatever_each_string_holds(hostile):
    from b70ctl.redact import without_controls
    from b70ctl.report.markdown import render_markdown

    report, recipe = _full_report()
    benign = without_controls(render_markdown(_poisoned(report, Report_annotation(), "plain"),
                                              _poisoned(recipe, None, "plain")))
    forged = without_controls(render_markdown(_poisoned(report, Report_annotation(), hostile),
                                              _poisoned(recipe, None, hostile)))
    assert _skeleton(forged) == _skeleton(benign)
    assert forged.rstrip().endswith("is in `raw/`.")  # nothing swallowed to the end
    assert "All checks passed." not in _strong_texts(forged)  # the hostile headline reads as text, not bold
    assert _strong_texts(forged)[0].startswith("PARTIAL — ")  # the real headline is the first bold
    assert "\x1b" not in forged


def Report_annotation() -> Any:  # noqa: N802 - reads as the type it stands for
    from b70ctl.report.model import Report

    return Report


def test_report_html_and_fleet_md_keep_their_structure_whatever_each_string_holds(tmp_path):
    from b70ctl.redact import without_controls
    from b70ctl.report.html import render_html
    from fleet_factory import write_host

    report, recipe = _full_report()
    page = without_controls(render_html(_poisoned(report, Report_annotation(), EVERYTHING),
                                        _poisoned(recipe, None, EVERYTHING)))
    benign = without_controls(render_html(_poisoned(report, Report_annotation(), "plain"),
                                          _poisoned(recipe, None, "plain")))
    for tag in ("<script", "<img", "<div", "<table", "<tr", "<td", "</html>"):
        assert page.count(tag) == benign.count(tag), tag
    assert 'class="verdict' in page

    hostile_host = "b70-[x](javascript:alert(1))![i](http://e.example/p.png)"
    write_host(tmp_path / "reports", hostile_host, report.model_copy(deep=True))
    write_host(tmp_path / "reports", "b70-b", unreachable={"status": "unreachable",
                                                            "reason": GROUPS["terminal"]["osc-unterminated"]})
    outcome = run_b70ctl(["fleet", "report", str(tmp_path / "reports"), "--out", str(tmp_path / "fleet")])
    assert outcome.code in (0, 1), outcome.stderr
    fleet = (tmp_path / "fleet" / "fleet.md").read_text()
    rendered = PARSER.render(fleet)
    assert "<img" not in rendered and 'href="javascript' not in rendered
    assert "b70-b" in fleet  # the host after the unterminated sequence is still listed
    assert "\x1b" not in fleet + (tmp_path / "fleet" / "fleet.html").read_text() + outcome.stdout


# --- real runs: a server whose every answer holds the corpus -------------------------------------------------------


def _hostile_routes(version: str, body: str) -> dict[str, tuple[int, str, bytes]]:
    from hostile import GOOD_MODELS, JSON

    error = (500, JSON, json.dumps({"error": {"message": body}}).encode())
    return {**GOOD_MODELS, "/version": (200, JSON, json.dumps({"version": version}).encode()),
            "/v1/completions": error, "/v1/chat/completions": error,
            "/metrics": (200, "text/plain", b"# no vLLM metrics\n")}


@pytest.mark.parametrize("hostile", [GROUPS["markdown"]["forged-headline"], GROUPS["terminal"]["osc-unterminated"],
                                     GROUPS["terminal"]["osc-52-clipboard"], EVERYTHING],
                         ids=["forged-headline", "osc-unterminated", "osc-52", "everything"])
def test_verify_reports_and_stdout_hold_a_hostile_server_as_text(hostile, tmp_path):
    from hostile import SECRET, Misbehaving

    work = tmp_path / "case"
    work.mkdir()
    (work / "key").write_text(SECRET + "\n")
    (work / "key").chmod(0o600)
    out = work / "out"
    with Misbehaving(_hostile_routes(hostile, hostile + " key {TOKEN} " + hostile)) as server:
        outcome = run_b70ctl(["verify", "--endpoint", server.url, "--recipe", "cpu-tiny", "--check", "smoke",
                              "--out", str(out), "--timeout", "5", "--api-key-file", str(work / "key")])
    assert outcome.code == 1, outcome.stderr
    markdown = (out / "report.md").read_text()
    lines = markdown.splitlines()
    assert lines[0] == "# Replication report: cpu-tiny"
    assert lines[2].startswith("**failed: smoke (")  # the real headline, and no other
    assert "**All checks passed.**" not in markdown
    assert markdown.rstrip().endswith("is in `raw/`.")  # the end of the document survived the escape byte
    assert sum(1 for token in PARSER.parse(markdown) if token.type == "heading_open" and token.tag == "h1") == 1
    page = (out / "report.html").read_text()
    assert 'class="verdict' in page and page.rstrip().endswith("</html>")
    shown = outcome.stdout + outcome.stderr
    assert "\x1b" not in shown and not CONTROL.search(shown.replace("\n", ""))
    everything = shown + "".join(p.read_text(errors="replace") for p in work.rglob("*") if p.is_file()
                                 and p.name != "key")
    assert SECRET not in everything and SECRET[: len(SECRET) // 2 + 1] not in everything
    assert "\x1b" not in everything


def test_reports_are_private_when_an_api_key_is_in_use(tmp_path):
    from hostile import SECRET, Misbehaving

    (tmp_path / "key").write_text(SECRET)
    (tmp_path / "key").chmod(0o600)
    with Misbehaving(_hostile_routes("0.32.0", "echo {TOKEN}")) as server:
        keyed = run_b70ctl(["verify", "--endpoint", server.url, "--recipe", "cpu-tiny", "--check", "smoke",
                            "--out", str(tmp_path / "keyed"), "--timeout", "5", "--api-key-file",
                            str(tmp_path / "key")])
    assert keyed.code == 1, keyed.stderr
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777
             for p in (tmp_path / "keyed").rglob("*") if p.is_file() and p.name != ".verify.lock"}
    assert modes and all(mode == 0o600 for name, mode in modes.items()
                         if not name.endswith("b70ctl-verify.marker")), modes


def test_path_parts_of_the_report_are_untouched_by_markdown(tmp_path):
    """The escaping is for values: a report's own paths and names still read as they are."""
    assert markdown_text("cpu-tiny") == "cpu-tiny" and markdown_text("draft_model, k=4") == "draft_model, k=4"
    assert markdown_text(Path("reports/b70-a")) == "reports/b70-a"


# --- output paths: --record-reference replaces a regular file or nothing; names from recipes are file names ------


def _record(tmp_path: Path, target: Path) -> Any:
    from scripted_server import ScriptedServer

    with ScriptedServer() as served:
        return run_b70ctl(["verify", "--endpoint", served.url, "--recipe", "cpu-tiny", "--model", "scripted",
                           "--record-reference", str(target), "--timeout", "5"]), served


def _fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "fifo")
    return tmp_path / "fifo"


def _link(tmp_path: Path) -> Path:
    (tmp_path / "victim.json").write_text("the user's own\n")
    (tmp_path / "link.json").symlink_to(tmp_path / "victim.json")
    return tmp_path / "link.json"


def _dangling_link(tmp_path: Path) -> Path:
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere" / "x.json")
    return tmp_path / "dangling.json"


def _directory(tmp_path: Path) -> Path:
    (tmp_path / "dir").mkdir()
    return tmp_path / "dir"


def _null_device(tmp_path: Path) -> Path:
    """A character device like /dev/null (same numbers), made here: the test never points at the real one."""
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    return tmp_path / "null"


@pytest.mark.parametrize("make, kind", [(_fifo, "a FIFO"), (_link, "a symbolic link"),
                                        (_dangling_link, "a symbolic link"), (_directory, "a directory"),
                                        (_null_device, "a character device")],
                         ids=["fifo", "link", "dangling-link", "directory", "device"])
def test_record_reference_replaces_nothing_but_a_regular_file(make, kind, tmp_path):
    from hostile import assert_one_line_error, snapshot

    target = make(tmp_path)
    before = snapshot(tmp_path)
    outcome, served = _record(tmp_path, target)
    assert_one_line_error(outcome, 2, rf"--record-reference \S+: {kind}, not a regular file: nothing was changed")
    assert snapshot(tmp_path) == before
    assert served.requests == []  # refused before a single prompt
    if make is _link:
        assert (tmp_path / "victim.json").read_text() == "the user's own\n"


def test_record_reference_writes_a_new_file_and_replaces_a_regular_one(tmp_path):
    for target in (tmp_path / "new.json", tmp_path / "old.json"):
        if target.name == "old.json":
            target.write_text("{}")
        outcome, _ = _record(tmp_path, target)
        assert outcome.code == 0, outcome.stderr
        assert json.loads(target.read_text())["recipe"] == "cpu-tiny" and not target.is_symlink()


def _recipe_with_workload_name(work: Path, name: str) -> Path:
    import yaml

    from b70ctl.recipes import recipe_path

    data = yaml.safe_load(recipe_path("cpu-tiny").read_text())
    data["workloads"][0]["name"] = name
    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return recipe


@pytest.mark.parametrize("name", ["../../x", "/abs/dir", "..", "a/b", ".hidden", ""])
def test_a_workload_name_that_is_a_path_is_refused_naming_the_field(name, tmp_path):
    from hostile import assert_left_clean, assert_one_line_error, snapshot

    recipe = _recipe_with_workload_name(tmp_path, name)
    before = snapshot(tmp_path)
    for args in (["recipes", "show", str(recipe)],
                 ["verify", "--endpoint", "http://127.0.0.1:9", "--recipe", str(recipe), "--check", "throughput",
                  "--out", str(tmp_path / "out"), "--timeout", "5"]):
        outcome = run_b70ctl(args)
        assert_one_line_error(outcome, 2, r"recipe file \S*recipe\.yaml: workloads\.0\.name: workload name .* not "
                                          r"usable as a file name .*: rename the workload")
    assert_left_clean(tmp_path, before, [])
    assert not (tmp_path / "x").exists() and not Path("/abs").exists()


@pytest.mark.parametrize(("text", "redacted"), [
    # The key cut short where something cut it: at the end, before a truncation mark, inside one of its words.
    ("key rehearsal-key-3e…", "key [redacted]…"),
    ("echo rehearsal-ke", "echo [redacted]"),
    ('"auth": "rehearsal-key-"', '"auth": "[redacted]"'),
    ("x rehearsal-key-3e9a y", "x [redacted] y"),
    # A whole word of the product's own that only begins like the key is left as it is: the rehearsal's report.json
    # key "rehearsal" and its overlay's file name were once both "[redacted]" (the key is "rehearsal-key-3e9a").
    ('{"rehearsal": ["models: tiny"]}', '{"rehearsal": ["models: tiny"]}'),
    ("control/b70ctl/serve/rehearsal.yaml", "control/b70ctl/serve/rehearsal.yaml"),
])
def test_a_cut_secret_is_redacted_and_a_word_that_begins_like_it_is_not(text, redacted):
    from b70ctl.redact import forget_secrets, keep_secret, redact

    keep_secret("rehearsal-key-3e9a")  # tests/appliance/rehearsal.py's API key
    try:
        assert redact(text) == redacted
    finally:
        forget_secrets()


# --- host directory names: a fleet's collected reports are named by whoever made the directories -----------------

# Every string of the corpus that can be one directory name the fleet report reads (no "/" or NUL, not hidden), plus
# links and images written without a "/" of their own.
HOST_DIRECTORY_NAMES = sorted({value for value in ALL.values()
                               if value and "/" not in value and "\x00" not in value and not value.startswith(".")
                               and len(value.encode()) < 200}
                              | {"![x](http:evil.example)", "[click](javascript:alert(1))", "[x][1]",
                                 "<img src=x onerror=alert(1)>", "**forged** host"})


def test_fleet_md_holds_host_directory_names_as_text(tmp_path):
    from fleet_factory import make_report, write_host

    reports = tmp_path / "reports"
    write_host(reports, "host-a", make_report("cpu-tiny", "host-a"))
    for name in HOST_DIRECTORY_NAMES:
        write_host(reports, name, make_report("cpu-tiny", None))
    outcome = run_b70ctl(["fleet", "report", str(reports), "--out", str(tmp_path / "fleet")])
    assert outcome.code in (0, 1) and "Traceback" not in outcome.stderr, outcome.stderr
    markdown = (tmp_path / "fleet" / "fleet.md").read_text()
    inline = [child.type for token in PARSER.parse(markdown) for child in token.children or []]
    assert not {"link_open", "image", "html_inline"} & set(inline), sorted(set(inline))
    assert not [token.type for token in PARSER.parse(markdown) if token.type == "html_block"]
    assert sum(1 for token in PARSER.parse(markdown) if token.type == "heading_open" and token.tag == "h1") == 1
    assert "\x1b" not in markdown + outcome.stdout + outcome.stderr
    hosts = {entry["host"] for entry in json.loads((tmp_path / "fleet" / "fleet.json").read_text())["hosts"]}
    assert len(hosts) == len(HOST_DIRECTORY_NAMES) + 1  # every directory is a host of the report, none dropped
