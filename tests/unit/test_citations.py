"""What a tracked file cites as a file of this repository is in it, so a reader of a report, of `b70ctl diagnose`
or of the code can open what a citation points to.

Checked: Markdown documents cited by a repository path (docs/facts.md, tests/fixtures/README.md) or by an
upper-case name (README.md, beside the citing file or anywhere in the repository), every path under docs/, a
section cited as `docs/<file>.md, "Section"` (the start of one of its headings), and the local names of outside
documents that were never part of the repository ("seed" and a three-digit number, as a word or a directory).
Outside documents are cited by their public identity (intel/llm-scaler PR #620, the Doopeworld/Qwen3.8-27B-DSpark-vLLM
model card, a vLLM source file of a given version), which this test leaves alone, as it does output names such as
report.md.
A line containing "not a citation" is skipped: tests that feed deliberately broken references mark them so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from b70ctl.diagnose.model import markdown_headings

REPO = Path(__file__).resolve().parents[2]
SKIP_MARK = "not a citation"

# A relative path: no scheme, host or parent directory in front of it.
PATH = re.compile(r"(?<![\w./:@~-])((?:[\w.-]+/)+[\w.-]*)")
# An upper-case document name on its own, as documents are usually named (README.md).
DOCUMENT_NAME = re.compile(r"(?<![\w./:@~-])([A-Z][A-Z0-9_-]*\.md)\b")
# The local names the seed documents had outside the repository.
SEED = re.compile(r"\bseeds?[ _/]?0\d\d\b", re.IGNORECASE)
# docs/<file>.md, "Section" (or : or a space before the quote; the quote may start on the next line).
SECTION = re.compile(r"(?<![\w./-])(docs/[\w./-]+\.md)(?:[,:]\s*|\s+)(?:\"([^\"\n]+)\"|'([^'\n]+)')")
ALWAYS_CHECKED = ("docs", "seeds")
# Outside documents kept as their authors posted them (tests/fixtures/published/README.md): their own references
# point into their own repositories, and the text is not ours to change.
POSTED = ("tests/fixtures/published/",)


class Repository:
    """The tracked files, and the directories holding them, of a checkout."""

    def __init__(self, files: list[str]) -> None:
        self.files = set(files)
        self.directories = {str(parent) for name in files for parent in PurePosixPath(name).parents} - {"."}
        self.names = {PurePosixPath(name).name for name in files}
        self.top_level = {name.split("/")[0] for name in self.directories}

    def has(self, path: str) -> bool:
        return path in self.files or path in self.directories


def _resolve(repository: Repository, citing: str, path: str) -> str | None:
    """The repository path a cited path names, relative to the root or to the citing file's directory."""
    parent = PurePosixPath(citing).parent
    for candidate in (PurePosixPath(path), parent / path):
        normal = str(candidate).rstrip("/")
        if ".." not in candidate.parts and repository.has(normal):
            return normal
    return None


def broken_citations(text: str, citing: str, repository: Repository,
                     headings_of: dict[str, set[str]]) -> list[str]:
    """One line per citation in text (of the tracked file `citing`) that names no file of the repository."""
    broken = []
    for number, line in enumerate(text.splitlines(), 1):
        if SKIP_MARK in line:
            continue
        where = f"{citing}:{number}"
        for match in SEED.finditer(line):
            broken.append(f"{where}: {match.group(0)!r} is not in the repository: cite the document by its public "
                          "name (intel/llm-scaler PR #620, the Doopeworld/Qwen3.8-27B-DSpark-vLLM model card)")
        for match in PATH.finditer(line):
            path = match.group(1).rstrip(".-")
            first = path.split("/")[0]
            checked = first in ALWAYS_CHECKED or (path.endswith(".md") and first in repository.top_level)
            if checked and not SEED.search(path) and _resolve(repository, citing, path) is None:
                broken.append(f"{where}: {path} is not a file of the repository")
        for match in DOCUMENT_NAME.finditer(line):
            name = match.group(1)
            if _resolve(repository, citing, name) is None and name not in repository.names:
                broken.append(f"{where}: {name} is not a file of the repository (name it by its path)")
    for match in SECTION.finditer(text):
        path, section = match.group(1), (match.group(2) or match.group(3)).rstrip(")")
        line_text = text.splitlines()[text.count("\n", 0, match.start())]
        if SKIP_MARK in line_text or path not in headings_of:
            continue
        if not any(heading.startswith(section) for heading in headings_of[path]):
            number = text.count("\n", 0, match.start()) + 1
            broken.append(f"{citing}:{number}: {path} has no section {section!r}")
    return broken


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [name for name in listed.decode().split("\0") if name]


def test_every_citation_of_a_repository_file_names_one_that_exists() -> None:
    files = tracked_files()
    repository = Repository(files)
    headings_of = {name: markdown_headings((REPO / name).read_text()) for name in files
                   if name.startswith("docs/") and name.endswith(".md") and (REPO / name).is_file()}
    assert "docs/facts.md" in headings_of  # the document most citations point to is tracked
    broken = []
    for name in files:
        path = REPO / name
        posted = name.startswith(POSTED) and PurePosixPath(name).name not in ("README.md", "sources.yaml")
        if posted or not path.is_file() or path.is_symlink():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            text = data.decode()
        except UnicodeDecodeError:
            continue
        broken.extend(broken_citations(text, name, repository, headings_of))
    assert not broken, "citations a reader cannot follow:\n" + "\n".join(broken)


# A repository of a few files for the tests of the search itself (its paths are not citations).
SAMPLE = Repository(["README.md", "docs/facts.md", "tests/fixtures/README.md",
                     "images/x/patches/README.md",  # not a citation
                     "images/x/patches/series", "control/b70ctl/checks/client.py"])
SAMPLE_HEADINGS = {"docs/facts.md": {"Hardware", "Known failures to detect or prevent",
                                     "Serving (route a: the PR #620 recipe)"}}


@pytest.mark.parametrize("citing, text, found", [
    ("control/b70ctl/checks/client.py", "(FACTS.md, Measuring)", ["FACTS.md is not a file"]),  # not a citation
    ("control/b70ctl/checks/client.py", "ref: seeds/000 (a comment)", ["'seeds/000' is not"]),  # not a citation
    ("control/b70ctl/checks/client.py", "the Doopeworld recipe (seed 001)", ["'seed 001' is not"]),  # not a citation
    ("control/b70ctl/checks/client.py", "see docs/nowhere.md", ["docs/nowhere.md is not a file"]),  # not a citation
    ("control/b70ctl/checks/client.py", "tests/fixtures/GONE.md", ["tests/fixtures/GONE.md is not"]),  # not a citation
    ("control/b70ctl/checks/client.py", 'docs/facts.md, "Nowhere"',  # not a citation
     ["docs/facts.md has no section 'Nowhere'"]),
    ("control/b70ctl/checks/client.py", 'docs/facts.md, "Serving (route a: the seed\'s recipe)"',  # not a citation
     ["docs/facts.md has no section \"Serving (route a: the seed's recipe\""]),
    ("control/b70ctl/checks/client.py", "(docs/facts.md, Measuring), README.md, tests/fixtures/README.md", []),
    ("control/b70ctl/checks/client.py", 'docs/facts.md, "Known failures"; docs/facts.md "Serving (route a)"', []),
    ("control/b70ctl/checks/client.py", "docs/facts.md,\n    'Hardware'", []),
    ("images/x/patches/series", "applies to the v0.21.0 tag (see README.md)", []),
    # Output names, outside documents and URLs are not files of the repository and are not cited as such.
    ("control/b70ctl/checks/client.py", "writes report.md and reports/site/reports/fleet/fleet.md", []),
    ("control/b70ctl/checks/client.py", "PR #620's vllm/patches/qwen38-dflash/README.md, https://x.org/docs/a.md",
     []),
    ("control/b70ctl/checks/client.py", "manual_seed(0); TinySpec (seed 1234)", []),
    ("control/b70ctl/checks/client.py", "ref: FACTS.md  # not a citation", []),
])
def test_a_citation_of_a_missing_file_is_found(citing: str, text: str, found: list[str]) -> None:
    broken = broken_citations(text, citing, SAMPLE, SAMPLE_HEADINGS)
    assert len(broken) == len(found), broken
    for line, expected in zip(broken, found, strict=True):
        assert expected in line
