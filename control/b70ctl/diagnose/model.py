"""The signature catalogue (the catalogue/ folder) as typed models, and what a diagnosis returns.

A signature names one known failure (or one harmless warning that looks like a failure): the regexes that find
it in a serve log, the kernel log or a verify report, what it means, the fix, where the knowledge came from and
which vLLM / image versions it applies to. The catalogue is data; this module only says what a valid entry is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from b70ctl.documents import Pinned as _Model

CATALOGUE_SCHEMA_VERSION: Final = 1

# Where a line comes from. `verify` lines are the findings of a verify report, rendered by report_lines().
LogKind = Literal["serve", "kernel", "verify"]
Severity = Literal["failure", "harmless"]
# Where an entry's knowledge came from. Files of this repository: `docs`, a section of the documentation
# ("docs/facts.md: Hardware"), and `capture`, a log captured from a real server (a path under tests/fixtures/).
# Outside it: `issue`, the URL of a public issue or pull request, and `upstream`, a public document named so it can
# be found (a pull request's description, a model card, a source file of a given vLLM version).
SourceKind = Literal["docs", "capture", "issue", "upstream"]
REPOSITORY_SOURCE_KINDS = ("docs", "capture")
FixKind = Literal["env", "profile", "recipe", "command", "image", "host", "none"]
# The layer of the stack a failure belongs to, read from the shape of its lines: the xe kernel driver with its
# GuC/HuC firmware, PCIe and power; the Level Zero loader and driver with UR/SYCL above them; oneCCL;
# torch/triton/inductor and the vllm-xpu-kernels extension built against it; vLLM's configuration and scheduler; the
# model and quantization loader; the container's device access; the host's memory.
Layer = Literal["kernel-driver", "level-zero", "oneccl", "torch", "vllm", "model-loader", "container",
                "host-memory"]
LAYERS: Final[tuple[str, ...]] = ("kernel-driver", "level-zero", "oneccl", "torch", "vllm", "model-loader",
                                  "container", "host-memory")
# How an entry's issue source relates to its fix (tests/fixtures/field/index.yaml keeps each thread's settled fix):
# the thread settled on this entry's fix (or one of its causes'); the thread ended without one; or it is cited for
# a fact (a line, a version) and its own fix is about something else.
ThreadOutcome = Literal["settled", "unsettled", "context"]


class Pattern(_Model):
    regex: str = Field(description="Python regular expression searched in each line")
    kinds: list[LogKind] = Field(min_length=1, description="The logs this pattern is looked for in")

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as error:
            raise ValueError(f"not a regular expression: {error}") from error
        return value


# ${name} in a fix's text: what the named group `name` of the signature's pattern caught in the first line it matched
# (the option a vLLM refused, the library that did not load), so the fix names the log's own thing.
LINE_PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


class Fix(_Model):
    kind: FixKind
    text: str = Field(min_length=1, description="What to do, in one or two sentences; ${name}: the named group "
                                                "`name` of the pattern that matched the first line")
    command: str | None = Field(None, description="A command that applies or checks the fix")
    env: dict[str, str] = Field(default_factory=dict, description="Variables to set in the serve environment")
    profile: Literal["p2p", "no-p2p"] | None = Field(None, description="The oneCCL profile to force")


class Cause(_Model):
    """One of several settled causes of a signature: the same lines, a different way out."""

    cause: str = Field(min_length=1, description="What was behind the failure in the threads that settled it")
    how_to_tell: str = Field(min_length=1, description="What tells this cause from the others on a host")
    fix: Fix
    # Lines that show this cause in a log (a setting echoed, a version, a call): when one matches, the diagnosis
    # picks this cause and its fix. Without any, the cause is listed and never picked from a log alone.
    evidence: list[Pattern] = Field(default_factory=list)


class Source(_Model):
    kind: SourceKind
    ref: str = Field(min_length=1, description="docs/<file>.md: <section>, a fixture path, an issue URL or a named "
                                               "public document")
    quote: str | None = Field(None, description="The outside text the patterns were written from")
    thread: ThreadOutcome | None = Field(None, description="An issue source: whether the thread settled on this "
                                                           "entry's fix, settled on nothing, or is cited for a fact")

    @model_validator(mode="after")
    def _ref_fits_kind(self, info: ValidationInfo) -> Source:
        path, _, section = self.ref.partition(": ")
        if self.kind == "docs" and not re.fullmatch(r"docs/[\w./-]+\.md", path):
            raise ValueError(f"{self.ref!r}: a docs source is docs/<file>.md, then ': ' and its section")
        if self.kind == "capture" and not path.startswith("tests/fixtures/"):
            raise ValueError(f"{self.ref!r}: a capture source is a file under tests/fixtures/")
        if self.kind == "issue" and not path.startswith("https://"):
            raise ValueError(f"{self.ref!r}: an issue source is the https URL of the issue or pull request")
        # Given the repository (context {"repository": root}), a file of it must be there, and a section must be
        # one of the file's headings: a reader has to be able to follow the reference.
        root = (info.context or {}).get("repository")
        if root is not None and self.kind in REPOSITORY_SOURCE_KINDS:
            file = Path(root) / path
            if ".." in Path(path).parts or not file.is_file():
                raise ValueError(f"{self.ref!r}: {path} is not a file of the repository")
            if self.kind == "docs" and section and section not in markdown_headings(file.read_text()):
                raise ValueError(f"{self.ref!r}: {path} has no section {section!r}")
        return self


def markdown_headings(text: str) -> set[str]:
    """The headings of a Markdown document, without their #s."""
    return {line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)}


class AppliesTo(_Model):
    vllm: str = Field("*", description="PEP 440 specifier of the vLLM versions, or * for any")
    images: list[str] = Field(default_factory=list, description="Images or builds it was reported on")


class Signature(_Model):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    title: str
    severity: Severity
    layer: Layer | None = Field(None, description="The layer of the stack the failure is in")
    # A layer's generic entry: its fix is the first step whatever the specific cause, and it is reported only when
    # no specific failure matched.
    generic: bool = False
    # An entry whose lines have several causes and whose first fix is only a first step (a lost device: read the
    # kernel log): it is reported as its layer's generic entry unless the log shows one cause's own evidence, so
    # a line that cannot tell the causes apart gives the layer and that step, never a cause's remedy.
    generic_unless_picked: bool = False
    patterns: list[Pattern] = Field(min_length=1)
    # Result codes (ZE_RESULT_* / UR_RESULT_*) that are evidence too, in serve lines, by name or by number.
    codes: list[str] = Field(default_factory=list)
    # Each of these must also match some line read, anywhere, for the signature to be reported.
    requires: list[Pattern] = Field(default_factory=list)
    # Not reported when one of these (more specific) signatures matched: it would only repeat them.
    unless: list[str] = Field(default_factory=list)
    meaning: str
    fix: Fix
    # Several settled causes of the same lines, most likely first; `fix` is the first cause's.
    causes: list[Cause] = Field(default_factory=list)
    sources: list[Source] = Field(min_length=1)
    applies_to: AppliesTo = Field(default_factory=AppliesTo)
    # A profile this failure contradicts: a topology forcing it is named in the diagnosis.
    contradicts_profile: Literal["p2p", "no-p2p"] | None = None

    @field_validator("codes")
    @classmethod
    def _known_codes(cls, value: list[str]) -> list[str]:
        from b70ctl.diagnose.codes import code_regex

        if value:
            code_regex(value)  # refuses a name the headers do not define
        return value

    def all_patterns(self) -> list[Pattern]:
        """The patterns, and the codes as one more (serve lines)."""
        if not self.codes:
            return list(self.patterns)
        from b70ctl.diagnose.codes import code_regex

        return [*self.patterns, Pattern(regex=code_regex(self.codes), kinds=["serve"])]

    @model_validator(mode="after")
    def _harmless_has_no_fix(self) -> Signature:
        if self.severity == "harmless" and self.fix.kind != "none":
            raise ValueError(f"{self.id}: a harmless entry's fix kind must be none")
        if self.severity == "failure" and self.fix.kind == "none":
            raise ValueError(f"{self.id}: a failure needs a fix")
        if self.causes and self.severity == "harmless":
            raise ValueError(f"{self.id}: a harmless entry has no causes")
        if self.causes and self.causes[0].fix != self.fix:
            raise ValueError(f"{self.id}: fix must be the first (most likely) cause's fix")
        if (self.generic or self.generic_unless_picked) and self.layer is None:
            raise ValueError(f"{self.id}: a generic entry names its layer")
        if self.generic_unless_picked and not any(cause.evidence for cause in self.causes):
            raise ValueError(f"{self.id}: generic_unless_picked needs a cause with its own evidence")
        named = set(LINE_PLACEHOLDER.findall(self.fix.text))
        if named:  # every pattern must catch them: any of them may be the one that matched first
            for pattern in self.patterns:
                missing = named - set(re.compile(pattern.regex).groupindex)
                if missing:
                    raise ValueError(f"{self.id}: the fix names ${{{sorted(missing)[0]}}}, which pattern "
                                     f"{pattern.regex!r} does not catch (give it a named group)")
            if self.codes:
                raise ValueError(f"{self.id}: a fix naming what a line caught cannot be matched by result codes")
        return self


class Catalogue(_Model):
    schema_version: Literal[1] = CATALOGUE_SCHEMA_VERSION
    signatures: list[Signature] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> Catalogue:
        seen: set[str] = set()
        for signature in self.signatures:
            if signature.id in seen:
                raise ValueError(f"duplicate signature id {signature.id}")
            seen.add(signature.id)
        for signature in self.signatures:
            unknown = set(signature.unless) - seen
            if unknown:
                raise ValueError(f"{signature.id}: unless names unknown signature {sorted(unknown)[0]}")
        return self


class LogLine(_Model):
    """One line of collected text: which log it came from and where."""

    log: str = Field(description="File name, unit or host:unit the line was read from")
    kind: LogKind
    number: int = Field(description="1-based line number in that log")
    text: str


class Match(_Model):
    id: str
    title: str
    severity: Severity
    meaning: str
    fix: Fix = Field(description="The fix of the cause the log shows (picked_cause), else the most likely cause's")
    causes: list[Cause] = Field(default_factory=list, description="Settled causes, most likely first")
    picked_cause: int | None = Field(None, description="Index in causes of the cause whose own evidence is in the "
                                                       "log; null when the log does not tell them apart")
    cause_evidence: list[LogLine] = Field(default_factory=list, description="The lines that picked that cause")
    layer: str | None = Field(None, description="The layer of the stack the failure is in")
    generic: bool = Field(False, description="A layer's generic entry: the first step whatever the cause")
    sources: list[Source]
    applies_to: AppliesTo
    evidence: list[LogLine] = Field(description="The first lines that matched (at most a few per signature)")
    evidence_count: int = Field(description="How many lines matched in all")


class Contradiction(_Model):
    signature: str
    profile: str
    profile_source: str
    text: str


class LogContext(_Model):
    """What a log says about the run it came from, for a person searching the right tracker."""

    versions: dict[str, str] = Field(default_factory=dict, description="Versions the log shows (vllm, torch, "
                                                                       "kernel, GuC, compute-runtime, ...)")
    settings: dict[str, str] = Field(default_factory=dict, description="Serve settings the log echoes "
                                                                       "(gpu_memory_utilization, max_model_len, ...)")
    failing_call: str | None = Field(None, description="The call that failed, read from the trace: load, profile "
                                                       "run, warm-up, graph capture, first collective")


class UnknownFailure(_Model):
    """A failure seen, whose cause the catalogue does not know: the decisive lines and the layer they belong to."""

    lines: list[LogLine] = Field(description="The first lines that show the failure (errors, exceptions, codes)")
    layers: list[str] = Field(description="The layers those lines belong to, first seen first; empty when the "
                                          "lines do not say")
    codes: list[str] = Field(default_factory=list, description="ZE_RESULT_* / UR_RESULT_* codes the lines name")


class Diagnosis(_Model):
    logs: list[str] = Field(description="What was read")
    lines_read: int
    failures: list[Match]
    harmless: list[Match]
    contradictions: list[Contradiction] = Field(default_factory=list)
    unknown: UnknownFailure | None = Field(None, description="A failure no entry names (only when none did)")
    context: LogContext = Field(default_factory=LogContext)

    @property
    def found_failure(self) -> bool:
        return bool(self.failures or self.contradictions)

    @property
    def cause_unknown(self) -> bool:
        """A failure is in the logs and no entry, specific or generic, names it."""
        return not self.found_failure and self.unknown is not None
