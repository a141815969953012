"""report.html: each request's decode rate and the per-position acceptance against the recipe's claims, written
by verify beside report.md through the atomic writer, with every string from the report kept as text."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from xml.etree import ElementTree

import pytest

from b70ctl.report.html import render_html
from b70ctl.verify import run_dir as run_dir_module
from b70ctl.verify.pipeline import verify
from fleet_factory import make_report, shipped_recipe
from scripted_server import SHORT_RATE, request_for, scripted_recipe

SVG = "{http://www.w3.org/2000/svg}"


class Document(HTMLParser):
    """Tags, URLs and the text of a page, as a browser's parser reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.urls: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.urls += [value for name, value in attrs if name in ("src", "href", "xlink:href") and value is not None]

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def plots(html: str) -> list[ElementTree.Element]:
    return [ElementTree.fromstring(document) for document in re.findall(r"<svg\b.*?</svg>", html, re.DOTALL)]


def titles(plot: ElementTree.Element) -> list[str]:
    return [element.text or "" for element in plot.iter(f"{SVG}title")]


def test_each_request_is_a_point_on_its_clock_against_the_decode_claims():
    report = make_report("pr620-fp8-tp2", "b70-a", speed=0.9)
    for workload in report.throughput.workloads:
        for request in workload.requests[:3]:
            request.timing_source = "engine"
    html = render_html(report, shipped_recipe("pr620-fp8-tp2"))
    decode = next(plot for plot in plots(html) if "decode tok/s per request" in "".join(plot.itertext()))
    shown = titles(decode)
    for workload in report.throughput.workloads:
        for number, request in enumerate(workload.requests, start=1):
            clock = "engine clock" if number <= 3 else "client clock"
            assert f"{workload.name} request {number}: {request.decode_tok_s:.1f} tok/s ({clock})" in shown
        assert (f"{workload.name}: median {workload.decode_tok_s.median:.1f} tok/s of "
                f"{workload.decode_tok_s.n} requests") in shown
    # pr620's decode claims: short >= 72.2 (65.0 with its 10%), natural text 38..53 (34.2..58.3).
    assert "claim short-median with tolerance: >= 65.0" in shown
    assert any(t.startswith("claim natural-text-rate: ") and t.endswith("(34.2..58.3 with tolerance)") for t in shown)
    # The y axis spans the requests and the claims: 0 tok/s is not on it.
    ticks = [float(t.text) for t in decode.iter(f"{SVG}text")
             if t.get("text-anchor") == "end" and re.fullmatch(r"\d+(\.\d+)?", t.text or "")]
    assert ticks and min(ticks) > 20


def test_per_position_acceptance_against_the_claim_values():
    report = make_report("dspark-int4-tp1", "dsp-a", per_position=[0.70, 0.40, 0.30, 0.12, 0.08, 0.02, 0.0])
    html = render_html(report, shipped_recipe("dspark-int4-tp1"))
    acceptance = next(plot for plot in plots(html) if "per-position acceptance" in "".join(plot.itertext()))
    shown = titles(acceptance)
    assert "claim per-position-acceptance: 0.76 0.45 0.31 0.14 0.10 0.02 0.00 (±0.08)" in shown
    assert "long_prompt: 0.70 0.40 0.30 0.12 0.08 0.02 0.00" in shown
    assert "long_prompt, position 1: 0.700" in shown
    # Nothing to draw: no acceptance plot for a recipe without speculation counters.
    target_only = make_report("dspark-int4-tp1", "dsp-b")
    for workload in target_only.throughput.workloads:
        workload.spec_decode = None
    assert len(plots(render_html(target_only, shipped_recipe("dspark-int4-tp1")))) == 1  # decode only


@pytest.mark.parametrize("hostile", ["<script>alert(1)</script>", "b70-\"quoted' host", "x\"><img src=x>"])
def test_strings_from_the_report_stay_text(hostile):
    report = make_report("pr620-fp8-tp2", "b70-a")
    report.environment.hostname = hostile
    report.endpoint = f"http://{hostile}:8000"
    report.environment.vllm_version = hostile
    report.throughput.workloads[0].name = hostile
    report.verdicts[0].reason = hostile
    report.verdicts[0].url = "javascript:alert(1)"
    html = render_html(report, shipped_recipe("pr620-fp8-tp2"))
    page = Document()
    page.feed(html)
    assert {"script", "img", "iframe", "link"}.isdisjoint(page.tags)
    # The plots' own markers, and the claims' sources as links to read (not fetched); "javascript:" is text.
    assert all(url.startswith(("#", "https://github.com/")) for url in page.urls), page.urls
    text = "".join(page.text)
    assert f"host {hostile}" in text and f"http://{hostile}:8000" in text
    for plot in plots(html):  # well-formed XML, the name a tooltip
        assert all("<" not in (element.text or "") or hostile in (element.text or "") for element in plot.iter())
    assert any(title.startswith(f"{hostile} request 1: ") for plot in plots(html) for title in titles(plot))


def test_verify_writes_report_html_beside_report_md_atomically(servers, tmp_path, monkeypatch):
    written: list[str] = []
    atomic = run_dir_module.write_text_atomically

    def recording(path, text, *args, **kwargs):
        written.append(path.name)
        return atomic(path, text, *args, **kwargs)

    monkeypatch.setattr(run_dir_module, "write_text_atomically", recording)
    served, baseline = servers
    report = verify(request_for(scripted_recipe(SHORT_RATE), served, baseline, tmp_path))
    # Rewritten after every check, like report.json and report.md: the last one is the finished report.
    assert written.count("report.html") == written.count("report.md") >= 2
    html = (tmp_path / "report.html").read_text()
    assert render_html(report, scripted_recipe(SHORT_RATE)) == html
    short = {w.name: w for w in report.throughput.workloads}["short"]
    assert all(f"short request {number}: {request.decode_tok_s:.1f} tok/s" in html
               for number, request in enumerate(short.requests, start=1))
    assert not [path.name for path in tmp_path.iterdir() if path.name.endswith(".tmp")]


def test_a_report_made_on_emulated_hardware_says_so_under_its_status_line():
    from b70ctl.report.markdown import render_markdown
    recipe = shipped_recipe("pr620-fp8-tp2")
    report = make_report("pr620-fp8-tp2", "b70-a")
    report.environment.xe_guc_firmware, report.environment.xe_huc_firmware = "70.54.0 (loaded)", "8.2.10 (file)"
    real_markdown, real_html = render_markdown(report, recipe), render_html(report, recipe)
    assert "emulated" not in real_markdown.lower() and "Hardware: emulated" not in real_html
    assert "- Firmware: GuC 70.54.0 (loaded), HuC 8.2.10 (file)" in real_markdown.splitlines()
    assert f"kernel {report.environment.kernel} · GuC 70.54.0 (loaded), HuC 8.2.10 (file)" in real_html

    report.environment.hardware_root = "/opt/b70-fixture"
    said = ("Hardware: emulated (GPU facts read from the sysfs tree under /opt/b70-fixture; kernel and firmware "
            "values are the fixture's)")
    lines = render_markdown(report, recipe).splitlines()
    status = next(index for index, line in enumerate(lines) if line.startswith("**all checks passed.**"))
    assert lines[status + 1:status + 3] == ["", f"**{said}.**"]
    assert f"- Kernel: {report.environment.kernel} (emulated: the fixture's)" in lines
    assert "- Firmware: GuC 70.54.0 (loaded), HuC 8.2.10 (file) (emulated: the fixture's)" in lines
    html = render_html(report, recipe).splitlines()
    status = next(index for index, line in enumerate(html) if line.startswith('<div class="verdict ok">'))
    assert html[status + 1] == f'<p class="emulated"><strong>{said.replace(chr(39), "&#x27;")}.</strong></p>'
