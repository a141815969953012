"""fleet.json, fleet.md and fleet.html of a planted fleet: what they say, that the HTML needs no network, and that
files are replaced atomically."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree

import pytest
from fleet_factory import environment_for, make_report, write_host
from test_fleet_aggregate import NO_P2P_HOSTS, SLOW_HOST, build_planted_fleet

from b70ctl.fleet import render, svg
from b70ctl.fleet.aggregate import aggregate
from b70ctl.fleet.model import FleetReport


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[FleetReport, dict[str, Path]]:
    root = tmp_path_factory.mktemp("fleet-render")
    build_planted_fleet(root / "reports")
    report = aggregate(root / "reports")
    return report, render.write_fleet_report(report, root / "out")


class References(HTMLParser):
    """Every URL-bearing attribute and every inline SVG root of a document."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.svg_count = 0
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        if tag == "svg":
            self.svg_count += 1
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "action", "data", "poster") and value is not None:
                self.urls.append(value)


def test_json_is_the_model(rendered):
    report, paths = rendered
    assert FleetReport.model_validate_json(paths["fleet.json"].read_text()).model_dump() == report.model_dump()
    assert json.loads(paths["fleet.json"].read_text())["schema_version"] == 1


def test_html_is_self_contained_and_has_the_plots(rendered):
    _, paths = rendered
    html = paths["fleet.html"].read_text()
    parser = References()
    parser.feed(html)
    # Inline SVG only references its own elements (#id) or embedded data; nothing is fetched.
    assert parser.urls, "the plots' internal references were expected"
    assert all(url.startswith(("#", "data:")) for url in parser.urls), [
        u for u in parser.urls if not u.startswith(("#", "data:"))]
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.IGNORECASE)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//|@import", html, re.IGNORECASE)
    assert {"script", "link", "iframe", "img"}.isdisjoint(parser.tags)
    # Two recipes: decode per host, acceptance curves for each; the drift chart for the recipe that drifts.
    assert parser.svg_count == 5
    for title in ("short: median decode tok/s per host", "long_prompt: per-position acceptance",
                  "pr620-fp8-tp2: what drift costs", "claim short-median &gt;= 72.2", "P2P = no-p2p (4 hosts)"):
        assert title in html, title
    assert "<details>" in html and "Drift from the fleet majority" in html


def test_markdown_summary_first_then_details(rendered):
    report, paths = rendered
    markdown = paths["fleet.md"].read_text()
    lines = markdown.splitlines()
    assert lines[0] == "# Fleet replication report"
    assert lines[2] == "**❌ Not replicated everywhere: 23 of 29 hosts met every claim.**"
    assert markdown.index("## Recipe `dspark-int4-tp1`") < markdown.index("## Recipe `pr620-fp8-tp2`")
    assert markdown.index("## Input problems") < markdown.index("<details><summary>Per-host results")
    assert (f"| `short-median` 72.2 tok/s median decode at concurrency 1, short prompt | >= 72.2 (±10%) | 20 | 1 | 0 "
            f"| {SLOW_HOST} |") in markdown
    assert "| P2P | `p2p` | `no-p2p` (4) | " + ", ".join(NO_P2P_HOSTS) + " |  |" in markdown
    no_p2p_row = next(line for line in lines if line.startswith("| P2P = `no-p2p` | 4 |"))
    assert re.findall(r"\(([-+]\d+\.\d)%\)", no_p2p_row) and all(
        -14 < float(v) < -10 for v in re.findall(r"\(([-+]\d+\.\d)%\)", no_p2p_row))
    assert f"| {SLOW_HOST} | short: " in markdown and "nothing: same fingerprint as the majority" in markdown
    assert markdown.count("<details>") == markdown.count("</details>") == 2 + len(report.recipes)
    # Every table row has as many cells as its header.
    for block in re.split(r"\n\s*\n", markdown):
        rows = [row for row in block.splitlines() if row.startswith("|")]
        if rows:
            widths = {len(re.split(r"(?<!\\)\|", row.strip())) for row in rows}
            assert len(widths) == 1, rows[:2]


def test_markdown_of_100_hosts_fits_a_github_issue(tmp_path):
    for index in range(100):
        host = f"node-{index:03d}"
        write_host(tmp_path / "reports", host, make_report("pr620-fp8-tp2", host, speed=0.6 if index == 42 else 1.0,
                                                           environment=environment_for(host)))
    markdown = render.render_markdown(aggregate(tmp_path / "reports"))
    assert len(markdown) < 65536  # GitHub's limit for an issue or comment body
    summary = markdown[: markdown.index("<details>")]
    assert "99 of 100 hosts met every claim" in summary and "| node-042 | short: " in summary
    assert summary.count("\n") < 80  # the summary stays a screenful or two; hosts are folded below


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
    assert render.render_html(report) == html  # the same report draws the same bytes


def test_ticks_are_round_numbers():
    assert svg.nice_ticks(0, 83.0, most=9) == [0, 10, 20, 30, 40, 50, 60, 70, 80]
    assert svg.nice_ticks(0, 1.02, most=6) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert svg.nice_ticks(-16.0, 6.25, most=9) == [-15, -12.5, -10, -7.5, -5, -2.5, 0, 2.5, 5]
    assert svg.tick_labels([-5, -2.5, 0, 2.5]) == ["\u22125.0", "\u22122.5", "0.0", "2.5"]
    assert svg.tick_labels([0, 200, 400]) == ["0", "200", "400"]
