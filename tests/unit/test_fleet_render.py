"""fleet.json, fleet.md and fleet.html of a planted fleet: what they say, that the HTML needs no network, and that
files are replaced atomically."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote
from xml.etree import ElementTree

import pytest

from b70ctl import svg
from b70ctl.fleet import render
from b70ctl.fleet.analysis import aggregate, build_fleet_report
from b70ctl.fleet.model import FleetReport
from fleet_factory import (
    NO_P2P_HOSTS,
    SLOW_HOST,
    build_planted_fleet,
    fleet_host_kind,
    make_report,
    synthetic_fleet,
    write_host,
)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[FleetReport, dict[str, Path]]:
    root = tmp_path_factory.mktemp("fleet-render")
    build_planted_fleet(root / "reports")
    report = aggregate(root / "reports")
    return report, render.write_fleet_report(report, root / "out")


class References(HTMLParser):
    """Every URL-bearing attribute, script and inline SVG root of a document."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.links: list[str] = []
        self.scripts: list[dict[str, str | None]] = []
        self.svg_count = 0
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        if tag == "svg":
            self.svg_count += 1
        if tag == "script":
            self.scripts.append(dict(attrs))
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "action", "data", "poster") and value is not None:
                self.urls.append(value)
                if tag == "a":
                    self.links.append(value)


class HostTable(HTMLParser):
    """fleet.html's host table: header texts, and per row each cell's text and data-sort attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.headers: list[str] = []
        self.rows: list[list[dict[str, str | None]]] = []
        self.links: dict[str, str] = {}  # host name -> href
        self._inside = False
        self._cell: dict[str, str | None] | None = None
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "table" and attributes.get("id") == "hosts":
            self._inside = True
        elif self._inside and tag == "tr":
            self.rows.append([])
        elif self._inside and tag in ("th", "td"):
            self._cell = {"text": "", "sort": attributes.get("data-sort")}
        elif self._inside and tag == "a":
            self._href = attributes.get("href")

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell["text"] += data
            if self._href is not None:
                self.links[data] = self._href

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._inside = False
        elif self._inside and tag in ("th", "td") and self._cell is not None:
            if tag == "th":
                self.headers.append(self._cell["text"])
            else:
                self.rows[-1].append(self._cell)
            self._cell = None
        elif tag == "a":
            self._href = None


def host_table(html: str) -> HostTable:
    table = HostTable()
    table.feed(html)
    table.rows = [row for row in table.rows if row]
    return table


def test_json_is_the_model(rendered):
    report, paths = rendered
    assert FleetReport.model_validate_json(paths["fleet.json"].read_text()).model_dump() == report.model_dump()
    assert json.loads(paths["fleet.json"].read_text())["schema_version"] == 1


def test_html_is_self_contained_and_has_the_plots(rendered):
    _, paths = rendered
    html = paths["fleet.html"].read_text()
    parser = References()
    parser.feed(html)
    # Inline SVG only references its own elements (#id) or embedded data; the host links are relative paths to
    # the hosts' own reports on the same disk. Nothing is fetched.
    assert parser.urls, "the plots' internal references were expected"
    external = [url for url in parser.urls if not url.startswith(("#", "data:")) and url not in parser.links]
    assert not external, external
    for link in parser.links:
        assert not re.match(r"^([a-z][a-z0-9+.-]*:|/)", link, re.IGNORECASE), link
        assert (paths["fleet.html"].parent / unquote(link)).is_file(), link
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.IGNORECASE)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//|@import", html, re.IGNORECASE)
    assert {"link", "iframe", "img"}.isdisjoint(parser.tags)
    assert parser.scripts == [{}]  # one script, inline: no src
    # Two recipes: decode per host, acceptance curves for each; the drift chart for the recipe that drifts.
    assert parser.svg_count == 5
    for title in ("short: median decode tok/s per host", "long_prompt: per-position acceptance",
                  "pr620-fp8-tp2: what drift costs", "claim short-median &gt;= 72.2", "P2P = no-p2p (4 hosts)"):
        assert title in html, title
    assert "<details open>" in html and "Drift from the fleet majority" in html


def test_each_host_point_names_its_host_and_value(rendered):
    report, paths = rendered
    html = paths["fleet.html"].read_text()
    (fleet,) = [f for f in report.recipes if f.recipe == "pr620-fp8-tp2"]
    decode = next(d for d in re.findall(r"<svg\b.*?</svg>", html, re.DOTALL) if "pr620-fp8-tp2 · short: median" in d)
    titles = [element.text for element in ElementTree.fromstring(decode).iter("{http://www.w3.org/2000/svg}title")]
    outliers = {o.host for o in fleet.outliers if o.workload == "short"}
    expected = [f"{entry.host}: {figures.median_decode_tok_s:.1f} tok/s" + (" (outlier)" if entry.host in outliers
                                                                             else "")
                for entry in report.hosts if entry.recipe == fleet.recipe and entry.status in ("verified", "partial")
                for figures in entry.workloads if figures.name == "short"]
    assert len(expected) == 21 and set(expected) <= set(titles)
    assert f"{SLOW_HOST}: " in " ".join(t for t in expected if t.endswith("(outlier)"))
    # The per-host acceptance curves name their host too.
    acceptance = next(d for d in re.findall(r"<svg\b.*?</svg>", html, re.DOTALL)
                      if "long_prompt: per-position acceptance" in d and "<title>b70-" in d)
    assert "<title>b70-00: 0.82 0.61 0.44 0.30</title>" in acceptance


def test_y_axes_fit_the_data_and_legends_are_readable(rendered):
    _, paths = rendered
    html = paths["fleet.html"].read_text()
    decode = next(d for d in re.findall(r"<svg\b.*?</svg>", html, re.DOTALL) if "pr620-fp8-tp2 · short: median" in d)
    root = ElementTree.fromstring(decode)
    texts = list(root.iter("{http://www.w3.org/2000/svg}text"))
    y_ticks = [float(t.text) for t in texts if t.get("text-anchor") == "end" and t.get("transform") is None
               and re.fullmatch(r"\d+(\.\d+)?", t.text or "")]
    # The planted hosts measure 26.7 (the slow host's natural text) to 106 tok/s: no axis starts at 0.
    assert y_ticks and min(y_ticks) >= 25 and max(y_ticks) <= 110
    legend = [t for t in texts if (t.text or "").startswith(("fleet majority", "claim short-median", "outlier"))]
    assert legend and all(float(t.get("font-size")) >= 9 for t in legend)
    assert svg.data_limits([70.0, 80.0]) == pytest.approx((69.2, 80.8))
    assert svg.data_limits([0.988] * 4, floor=0.0, ceiling=1.02) == pytest.approx((0.988 - 0.08 * 0.988, 1.02))
    assert svg.data_limits([]) == (0.0, 1.0)


def test_hosts_link_to_their_own_report(tmp_path):
    """The collected layout: REPORTS_DIR/<host>/ and the fleet report in REPORTS_DIR/fleet/."""
    reports = tmp_path / "reports"
    for host in ("html-host", "md-host", "json-host"):
        write_host(reports, host, make_report("cpu-tiny", host))
    (reports / "html-host" / "report.html").write_text("<!DOCTYPE html>")
    (reports / "html-host" / "report.md").write_text("# report")
    (reports / "md-host" / "report.md").write_text("# report")
    write_host(reports, "gone-host", unreachable={"kind": "unreachable", "reason": "no route"})
    paths = render.write_fleet_report(aggregate(reports), reports / "fleet")
    table = host_table(paths["fleet.html"].read_text())
    assert table.links == {"html-host": "../html-host/report.html", "md-host": "../md-host/report.md",
                           "json-host": "../json-host/report.json"}
    assert "gone-host" in {row[0]["text"] for row in table.rows}


HOSTILE_NAMES = ["<script>alert(1)</script>", "b70-\"quoted'", "x\"><img src=x onerror=alert(2)>"]


def test_hostile_host_names_are_text_everywhere(tmp_path):
    collected = synthetic_fleet(20)
    for index, name in zip((3, 5, 17), HOSTILE_NAMES, strict=True):
        entry = collected.entries[index]
        entry.host = name
        if "/" not in name:  # a directory can hold the others: their link is percent-encoded
            (tmp_path / "reports" / name).mkdir(parents=True)
            (tmp_path / "reports" / name / "report.json").write_text("{}")
            entry.report_path = str(tmp_path / "reports" / name / "report.json")
    collected.entries[0].environment.kernel = "</td><script>alert(3)</script>"
    paths = render.write_fleet_report(build_fleet_report(collected, "synthetic"), tmp_path / "out")
    html = paths["fleet.html"].read_text()
    parser = References()
    parser.feed(html)
    assert parser.scripts == [{}] and "img" not in parser.tags
    assert html.count("<script") == 1 and "alert(3)</script>" not in html
    table = host_table(html)
    hosts = {row[0]["text"] for row in table.rows}
    assert set(HOSTILE_NAMES) <= hosts  # the parser reads back the very names: escaped, not markup
    for name in HOSTILE_NAMES[1:]:
        assert unquote(table.links[name]) == f"../reports/{name}/report.json"
        assert (paths["fleet.html"].parent / unquote(table.links[name])).is_file()
    for document in re.findall(r"<svg\b.*?</svg>", html, re.DOTALL):
        ElementTree.fromstring(document)
    markdown = paths["fleet.md"].read_text()
    # GitHub renders HTML in markdown, except inside code spans (where the kernel value is, shown as it is).
    outside_code = re.sub(r"`[^`\n]*`", "", markdown)
    assert "<script" not in outside_code and "<img" not in outside_code
    assert "`</td><script>alert(3)</script>`" in markdown
    assert "&lt;script>alert(1)&lt;/script>" in markdown


def test_host_table_sorts_on_a_header_click(rendered):
    """The page's own script, run by Node.js on a stand-in for the DOM it uses, sorts the real table."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed: the inline script cannot be run")
    report, paths = rendered
    html = paths["fleet.html"].read_text()
    script = re.search(r"<script>(.*?)</script>", html, re.DOTALL).group(1)
    table = host_table(html)
    host_column = table.headers.index("host")
    short_column = table.headers.index("short tok/s (peak tok/s, best request) · acceptance")
    completed = subprocess.run([node, "-e", SORT_HARNESS], input=json.dumps({
        "script": script, "headers": table.headers, "rows": table.rows,
        "clicks": [short_column, short_column, host_column]}), capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    ascending, descending, by_name = json.loads(completed.stdout)
    short = {entry.host: figures.median_decode_tok_s for entry in report.hosts for figures in entry.workloads
             if figures.name == "short" and figures.median_decode_tok_s is not None}
    measured = sorted(short, key=short.get)
    assert ascending[: len(measured)] == measured
    assert descending[: len(measured)] == measured[::-1]
    # Hosts without the figure stay last both ways.
    assert set(ascending[len(measured):]) == set(descending[len(measured):]) \
        == {e.host for e in report.hosts} - set(short)
    assert by_name == sorted(entry.host for entry in report.hosts)


SORT_HARNESS = """
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
function element(text, attributes) {
  return {textContent: text, attributes: Object.assign({}, attributes), listeners: {},
    hasAttribute(name) { return Object.prototype.hasOwnProperty.call(this.attributes, name); },
    getAttribute(name) { return this.hasAttribute(name) ? this.attributes[name] : null; },
    setAttribute(name, value) { this.attributes[name] = String(value); },
    removeAttribute(name) { delete this.attributes[name]; },
    addEventListener(type, listener) { this.listeners[type] = listener; }};
}
const headers = input.headers.map((text) => element(text, {}));
const rows = input.rows.map((cells) => ({cells: cells.map((c) => element(c.text, \
c.sort === null ? {} : {"data-sort": c.sort}))}));
const body = {rows: rows.slice(), appendChild(row) { this.rows.splice(this.rows.indexOf(row), 1); \
this.rows.push(row); }};
const table = {tHead: {rows: [{cells: headers}]}, tBodies: [body]};
globalThis.document = {querySelectorAll: (selector) => (selector === "table.sortable" ? [table] : [])};
new Function(input.script)();
const orders = input.clicks.map((column) => {
  headers[column].listeners.click();
  return body.rows.map((row) => row.cells[0].textContent);
});
process.stdout.write(JSON.stringify(orders));
"""


def test_markdown_summary_first_then_hosts_needing_attention(rendered):
    _report, paths = rendered
    markdown = paths["fleet.md"].read_text()
    lines = markdown.splitlines()
    assert lines[0] == "# Fleet replication report"
    assert lines[2] == "**❌ Not replicated everywhere: 23 of 29 hosts met every claim.**"
    assert ("**12 hosts need attention:** 1 outlier the environment does not explain, 5 failed, 6 drifting from "
            "the majority (listed below in that order).") in lines
    assert markdown.index("## Recipe `dspark-int4-tp1`") < markdown.index("## Recipe `pr620-fp8-tp2`")
    assert markdown.index("## Input problems") < markdown.index("## Hosts needing attention (12 of 29)")
    assert ("| `short-median` 72.2 tok/s median decode at concurrency 1, short prompt | >= 72.2 (tolerance 10%) "
            f"| 20 | 1 | 0 | {SLOW_HOST} |") in markdown
    assert "| P2P | `p2p` | `no-p2p` (4) | " + ", ".join(NO_P2P_HOSTS) + " |  |" in markdown
    no_p2p_row = next(line for line in lines if line.startswith("| P2P = `no-p2p` | 4 |"))
    assert re.findall(r"\(([-+]\d+\.\d)%\)", no_p2p_row) and all(
        -14 < float(v) < -10 for v in re.findall(r"\(([-+]\d+\.\d)%\)", no_p2p_row))
    # Two recipes: the attention rows name theirs. The slow host is the one outlier nothing explains; the no-P2P
    # hosts are outliers too, explained by their drift, and listed with it.
    assert f"| {SLOW_HOST} | `pr620-fp8-tp2` | short: " in markdown
    no_p2p_group = next(line for line in lines if line.startswith("| `pr620-fp8-tp2` | P2P=`no-p2p` | 4 |"))
    assert no_p2p_group.endswith(" | 4 | " + ", ".join(NO_P2P_HOSTS) + " |")
    assert "All 12 hosts needing attention are listed above" in markdown
    assert "<details>" not in markdown  # nothing grows with the fleet, so nothing needs folding
    # Every table row has as many cells as its header.
    for block in re.split(r"\n\s*\n", markdown):
        rows = [row for row in block.splitlines() if row.startswith("|")]
        if rows:
            widths = {len(re.split(r"(?<!\\)\|", row.strip())) for row in rows}
            assert len(widths) == 1, rows[:2]


# --------------------------------------------------------------------------- fleet.md at any fleet size

FLEET_SIZES = [1, 10, 200, 1000, 5000]
HOST_NAME = re.compile(r"\bb70-\d{5}\b")
ATTENTION_TITLES = {"outlier": "### Outliers the environment does not explain",
                    "failed": "### Failed", "drift": "### Drifting from the majority"}


def expected_attention(host: dict) -> str | None:
    """What fleet.md must say of a host, from fleet.json alone."""
    if host["status"] == "duplicate":
        return None
    if host["outlier_workloads"] and not host["drift_fields"]:
        return "outlier"
    if host["status"] not in ("verified", "partial") or not host["all_claims_met"]:
        return "failed"
    return "drift" if host["drift_fields"] else None


def attention_sections(markdown: str) -> dict[str, list[str]]:
    """The hosts each attention section names, in the order named."""
    section = markdown[markdown.index("## Hosts needing attention"):]
    found: dict[str, list[str]] = {}
    for kind, title in ATTENTION_TITLES.items():
        if title in section:
            body = section[section.index(title):].split("\n\n", 2)[1]
            found[kind] = HOST_NAME.findall(body)
    return found


def write_synthetic_fleet(out_dir: Path, hosts: int, **kinds) -> tuple[dict, str, str]:
    report = build_fleet_report(synthetic_fleet(hosts, **kinds), "synthetic fleet")
    paths = render.write_fleet_report(report, out_dir)
    return (json.loads(paths["fleet.json"].read_text()), paths["fleet.md"].read_text(),
            paths["fleet.html"].read_text())


@pytest.fixture(scope="module", params=FLEET_SIZES, ids=[f"{size}-hosts" for size in FLEET_SIZES])
def fleet_of_size(request, tmp_path_factory) -> tuple[dict, str, str]:
    return write_synthetic_fleet(tmp_path_factory.mktemp(f"fleet-{request.param}"), request.param)


def test_fleet_md_fits_a_github_issue_at_any_size(fleet_of_size):
    _fleet, markdown, _ = fleet_of_size
    assert len(markdown) < 65_536  # GitHub's limit for an issue or comment body, in characters
    assert len(markdown) <= render.MARKDOWN_BUDGET
    assert markdown.startswith("# Fleet replication report\n")
    closing = markdown.rstrip().splitlines()[-1]
    assert "fleet.json" in closing and "fleet.html" in closing


def test_fleet_md_lists_unexplained_outliers_then_failures_then_drift(fleet_of_size):
    fleet, markdown, _ = fleet_of_size
    expected = {host["host"]: expected_attention(host) for host in fleet["hosts"]}
    sections = attention_sections(markdown)
    titles = [markdown.index(ATTENTION_TITLES[kind]) for kind in ATTENTION_TITLES if kind in sections]
    assert titles == sorted(titles)
    for kind in ("outlier", "failed"):
        assert {expected[host] for host in sections.get(kind, [])} <= {kind}, kind
    # A drift group names all its members, failed hosts among them too, but never an unexplained outlier.
    assert "outlier" not in {expected[host] for host in sections.get("drift", [])}
    # Within the outliers, the most extreme first.
    outliers = {o["host"]: max(abs(x["robust_z"]) for x in fleet["recipes"][0]["outliers"] if x["host"] == o["host"])
                for o in fleet["recipes"][0]["outliers"] if expected[o["host"]] == "outlier"} \
        if fleet["recipes"] else {}
    shown = [outliers[host] for host in sections.get("outlier", [])]
    assert shown == sorted(shown, reverse=True)
    if fleet["summary"]["hosts"] >= 200:  # the planted kinds all occur from 200 hosts on
        assert list(sections) == ["outlier", "failed", "drift"]


def test_fleet_md_headline_counts_agree_with_fleet_json(fleet_of_size):
    fleet, markdown, _ = fleet_of_size
    summary = fleet["summary"]
    lines = markdown.splitlines()
    header = lines.index("| hosts | verified | partial | unreachable | bad report | duplicate | met every claim | "
                         "drifting | outliers | input problems |")
    counts = [int(cell) for cell in lines[header + 2].strip("| ").split(" | ")]
    assert counts == [summary[key] for key in ("hosts", "verified", "partial", "unreachable", "bad_report",
                                               "duplicate", "all_claims_met", "drifting_hosts", "outliers",
                                               "problems")]
    kinds = [expected_attention(host) for host in fleet["hosts"]]
    if summary["all_claims_met"] == summary["hosts"] and not fleet["problems"]:
        assert lines[2] == ("**✅ Replicated: "
                            + ("the one host" if summary["hosts"] == 1 else f"all {summary['hosts']} hosts")
                            + " met every claim.**")
    else:
        assert lines[2].startswith(f"**❌ Not replicated everywhere: {summary['all_claims_met']} of "
                                   f"{summary['hosts']} hosts met every claim.")
    needing = sum(1 for kind in kinds if kind)
    if needing:
        assert (f"**{needing} host{'s' if needing != 1 else ''} need{'' if needing != 1 else 's'} attention:** "
                f"{kinds.count('outlier')} outlier{'s' if kinds.count('outlier') != 1 else ''} the environment does "
                f"not explain, {kinds.count('failed')} failed, {kinds.count('drift')} drifting from the majority"
                ) in markdown
        assert f"## Hosts needing attention ({needing} of {summary['hosts']})" in markdown
    else:
        assert "**No host needs attention.**" in markdown


def test_hosts_left_out_of_fleet_md_are_in_fleet_json_and_html(fleet_of_size):
    fleet, markdown, html = fleet_of_size
    needing = {host["host"] for host in fleet["hosts"] if expected_attention(host)}
    named = {host for hosts in attention_sections(markdown).values() for host in hosts}
    left_out = needing - named
    if left_out:
        assert (f"**{len(left_out)} of {len(needing)} hosts needing attention are not listed here**"
                in markdown)
    elif needing:
        assert f"All {len(needing)} hosts needing attention are listed above" in markdown
    in_json = {host["host"] for host in fleet["hosts"]}
    assert needing <= in_json
    for host in sorted(needing)[:50] + sorted(left_out):
        assert f"<td>{host}</td>" in html or re.search(f">{host}</a></td>", html), host


def test_an_outage_of_thousands_of_hosts_is_counted_not_listed(tmp_path):
    """2,000 of 5,000 hosts unreachable: the failures fill the budget; the line after them counts the rest."""
    def outage(index: int) -> tuple[str, float, dict]:
        return ("unreachable", 0.0, {}) if index % 5 in (1, 2) else fleet_host_kind(index)

    fleet, markdown, html = write_synthetic_fleet(tmp_path, 5000, kind_of=outage)
    assert len(markdown) <= render.MARKDOWN_BUDGET
    needing = {host["host"] for host in fleet["hosts"] if expected_attention(host)}
    sections = attention_sections(markdown)
    named = {host for hosts in sections.values() for host in hosts}
    left_out = needing - named
    assert len(left_out) > 1000
    assert "drift" not in sections and len(sections["failed"]) > 100
    assert (f"**{len(left_out)} of {len(needing)} hosts needing attention are not listed here**, to keep this "
            "file under GitHub's 65,536-character limit: every host is in fleet.json (`hosts`) and in fleet.html"
            ) in markdown
    in_json = {host["host"]: host for host in fleet["hosts"]}
    for host in sorted(left_out):
        assert in_json[host]["status"] in ("unreachable", "verified"), host
        assert f">{host}</a>" in html or f"<td>{host}</td>" in html, host


def test_plots_are_well_formed_svg_with_ids_unique_in_the_page(rendered):
    report, paths = rendered
    html = paths["fleet.html"].read_text()
    documents = re.findall(r"<svg\b.*?</svg>", html, re.DOTALL)
    assert len(documents) == 5
    ids = []
    for document in documents:
        root = ElementTree.fromstring(document)  # raises on anything a browser's XML parser would reject
        ids += [element.get("id") for element in root.iter() if element.get("id")]
    assert ids and len(ids) == len(set(ids))
    assert render.render_html(report, paths["fleet.html"].parent) == html  # the same report, the same bytes


def test_ticks_are_round_numbers():
    assert svg.nice_ticks(0, 83.0, most=9) == [0, 10, 20, 30, 40, 50, 60, 70, 80]
    assert svg.nice_ticks(0, 1.02, most=6) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert svg.nice_ticks(-16.0, 6.25, most=9) == [-15, -12.5, -10, -7.5, -5, -2.5, 0, 2.5, 5]
    assert svg.tick_labels([-5, -2.5, 0, 2.5]) == ["\u22125.0", "\u22122.5", "0.0", "2.5"]
    assert svg.tick_labels([0, 200, 400]) == ["0", "200", "400"]


def test_fleet_md_stays_within_budget_when_reports_are_made_to_break_it(tmp_path):
    """Hundreds of recipes of 150-character names, host names of 200 characters with pipes: still under budget."""
    collected = synthetic_fleet(600)
    for index, entry in enumerate(collected.entries):
        entry.host = f"{'h|' * 100}{index:05d}"
        entry.recipe = f"{'r`' * 75}{index % 300:03d}"
    report = build_fleet_report(collected, "s" * 5000)
    markdown = render.render_markdown(report)
    assert len(report.recipes) == 300
    assert len(markdown) <= render.MARKDOWN_BUDGET
    assert "## Hosts needing attention" in markdown and "recipe sections left out to keep this file short" in markdown
    for block in re.split(r"\n\s*\n", markdown):
        rows = [row for row in block.splitlines() if row.startswith("|")]
        if rows:
            assert len({len(re.split(r"(?<!\\)\|", row.strip())) for row in rows}) == 1, rows[:2]


def _fleet_files(out_dir: Path) -> dict[str, tuple[bytes, int]]:
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in sorted(out_dir.iterdir())}


def test_a_rerun_over_unchanged_reports_leaves_the_fleet_files_untouched(tmp_path, capsys):
    from datetime import UTC, datetime, timedelta
    reports, out_dir = tmp_path / "reports", tmp_path / "fleet"
    for host in ("h1", "h2"):
        write_host(reports, host, make_report("cpu-tiny", host))
    first_time = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
    render.write_fleet_report(aggregate(reports, generated_at=first_time), out_dir)
    assert "unchanged" not in capsys.readouterr().err
    written = _fleet_files(out_dir)
    assert sorted(written) == ["fleet.html", "fleet.json", "fleet.md"]

    again = aggregate(reports, generated_at=first_time + timedelta(hours=5))
    paths = render.write_fleet_report(again, out_dir)
    assert _fleet_files(out_dir) == written  # same bytes, same modification times: not rewritten
    assert capsys.readouterr().err == (f"fleet report unchanged: {out_dir} left as generated at "
                                       "2026-11-30 08:00:00 UTC\n")
    assert again.generated_at == first_time  # what --json prints is what fleet.json holds
    assert json.loads(paths["fleet.json"].read_text())["generated_at"] == "2026-11-30T08:00:00Z"

    # A changed input: all three rewritten, with the new time.
    write_host(reports, "h3", make_report("cpu-tiny", "h3"))
    later = first_time + timedelta(hours=6)
    render.write_fleet_report(aggregate(reports, generated_at=later), out_dir)
    assert "unchanged" not in capsys.readouterr().err
    rewritten = _fleet_files(out_dir)
    assert all(rewritten[name][0] != written[name][0] for name in written)
    assert json.loads(rewritten["fleet.json"][0])["summary"]["hosts"] == 3
    assert all(b"2026-11-30 14:00 UTC" in rewritten[name][0] for name in ("fleet.md", "fleet.html"))


@pytest.mark.parametrize("disturb", ["fleet.md removed", "fleet.html edited", "fleet.json not JSON",
                                     "fleet.json of a list", "a host report.html appeared"])
def test_fleet_files_that_do_not_hold_the_same_report_are_all_rewritten(tmp_path, capsys, disturb):
    from datetime import UTC, datetime, timedelta
    reports, out_dir = tmp_path / "reports", tmp_path / "fleet"
    write_host(reports, "h1", make_report("cpu-tiny", "h1"))
    first_time = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
    render.write_fleet_report(aggregate(reports, generated_at=first_time), out_dir)
    if disturb == "fleet.md removed":
        (out_dir / "fleet.md").unlink()
    elif disturb == "fleet.html edited":
        (out_dir / "fleet.html").write_text((out_dir / "fleet.html").read_text() + "<!-- edited -->")
    elif disturb == "fleet.json not JSON":
        (out_dir / "fleet.json").write_text("{")
    elif disturb == "fleet.json of a list":
        (out_dir / "fleet.json").write_text("[]")
    else:  # the same fleet.json, but fleet.html now links the host to its report.html
        (reports / "h1" / "report.html").write_text("<!DOCTYPE html>")
    capsys.readouterr()
    render.write_fleet_report(aggregate(reports, generated_at=first_time + timedelta(hours=1)), out_dir)
    assert "unchanged" not in capsys.readouterr().err
    for name in ("fleet.json", "fleet.md", "fleet.html"):
        assert "09:00" in (out_dir / name).read_text(), name
    if disturb == "a host report.html appeared":
        assert 'href="../reports/h1/report.html"' in (out_dir / "fleet.html").read_text()


def test_the_fleet_command_run_twice_says_the_report_is_unchanged(tmp_path):
    from fleet_factory import b70ctl
    write_host(tmp_path / "reports", "h1", make_report("cpu-tiny", "h1"))
    command = ("fleet", "report", str(tmp_path / "reports"), "--out", str(tmp_path / "out"))
    first = b70ctl(*command)
    assert first.returncode == 0 and "fleet report unchanged" not in first.stderr, first.stderr
    written = _fleet_files(tmp_path / "out")
    assert f"wrote {tmp_path / 'out' / 'fleet.md'}" in first.stdout
    second = b70ctl(*command)
    assert second.returncode == 0 and "fleet report unchanged: " in second.stderr, second.stderr
    assert _fleet_files(tmp_path / "out") == written
    assert "wrote" not in second.stdout and f"unchanged {tmp_path / 'out' / 'fleet.md'}" in second.stdout
