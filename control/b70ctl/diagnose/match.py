"""Match collected log lines against the catalogue. Pure: lines in, a Diagnosis out.

A log is read once, whatever its size, and only the evidence stays in memory. Most lines of a serve log match
nothing, so a prefilter runs first: every pattern the catalogue and context.py hold has a literal part that any line
it matches must contain, a few short strings cover all of them, and a batch of lines is searched for those strings
at once (str.find, in C). Only the lines that hold one are read by the regular expressions.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from itertools import accumulate
from typing import Any

from b70ctl.diagnose import context
from b70ctl.diagnose.codes import codes_in
from b70ctl.diagnose.model import (
    LINE_PLACEHOLDER,
    Catalogue,
    Contradiction,
    Diagnosis,
    LogContext,
    LogKind,
    LogLine,
    Match,
    Pattern,
    Signature,
    UnknownFailure,
)

# The running Python's own regex parser and its opcodes (private modules without type stubs): read, never changed.
sre_parser: Any = import_module("re._parser")
sre_constants: Any = import_module("re._constants")

EVIDENCE_LINES = 5
# Lines longer than this are cut before matching: a log can hold a megabyte-long line (a tensor dump).
MAX_LINE_CHARS = 4000
# The shortest string the prefilter searches for a case-sensitive literal (a shorter one would let most lines of a
# log through), and for a case-insensitive one (those are few and short).
TRIGGER_MIN_CHARS = 10
TRIGGER_MIN_CHARS_IGNORECASE = 5
TRIGGER_MAX_CHARS = 24


@dataclass
class LineBatch:
    """Consecutive lines of one log, read in one go: `texts[i]` is line `first_number + i`. `kind_of` says a line's
    kind from its text (a file may hold both vLLM and kernel lines); it is only asked of the lines the prefilter
    lets through. `lines`, when given, are the same lines already made (a journal read, a report's findings)."""

    log: str
    first_number: int
    texts: list[str]
    kind_of: Callable[[str], LogKind]
    lines: list[LogLine] | None = field(default=None)


# ---------------------------------------------------------------- the prefilter

def _literals(items: Iterable[tuple[Any, Any]]) -> set[str] | None:
    """Strings of which a string matching this parsed sequence contains at least one: the longest run of literals,
    or a group or alternation whose every branch has one; None when the sequence has none."""
    candidates: list[set[str]] = []
    run: list[str] = []
    for op, value in items:
        if op is sre_constants.LITERAL:
            run.append(chr(value))
            continue
        if run:
            candidates.append({"".join(run)})
            run = []
        if op is sre_constants.SUBPATTERN:
            inner = _literals(value[-1])
            if inner:
                candidates.append(inner)
        elif op is sre_constants.BRANCH:
            branches = [_literals(branch) for branch in value[1]]
            if branches and all(branches):
                candidates.append({string for branch in branches if branch for string in branch})
        elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT) and value[0] >= 1:
            inner = _literals(value[2])
            if inner:
                candidates.append(inner)
    if run:
        candidates.append({"".join(run)})
    if not candidates:
        return None
    return max(candidates, key=lambda strings: min(len(string) for string in strings))


def required_literals(regex: str, flags: int = 0) -> tuple[set[str], bool] | None:
    """Strings one of which every match of `regex` contains, and whether they are compared ignoring case; None when
    the regex has no literal part (the prefilter then lets every line through)."""
    parsed = sre_parser.parse(regex, flags)
    ignore_case = bool((parsed.state.flags | flags) & re.IGNORECASE)
    found = _literals(list(parsed))
    return None if found is None else (found, ignore_case)


def _cover(strings: set[str], shortest: int) -> list[str]:
    """Few substrings (of `shortest` to TRIGGER_MAX_CHARS characters) such that every string holds one: greedily the
    one most strings share, the longer of equals."""
    left, chosen = set(strings), []
    while left:
        counts: dict[str, int] = {}
        for string in left:
            if len(string) <= shortest:
                parts = {string}
            else:
                parts = {string[start:start + size] for size in range(shortest, min(TRIGGER_MAX_CHARS, len(string)) + 1)
                         for start in range(len(string) - size + 1)}
            for part in parts:
                counts[part] = counts.get(part, 0) + 1
        best = max(counts, key=lambda part: (counts[part], len(part), part))
        chosen.append(best)
        left = {string for string in left if best not in string}
    return chosen


# Who reads a line a trigger let through: a watch (its index in the catalogue, from 0) or one of context.probes()
# (probe i is reader -1 - i).


@dataclass(frozen=True)
class Prefilter:
    """Strings one of which every line some pattern matches contains (`exact` as written, `folded` lower-cased),
    and for each string the readers whose patterns it stands for; `everything` when some pattern has no literal
    part (every line then goes to every reader)."""

    exact: tuple[str, ...]
    folded: tuple[str, ...]
    owners: dict[str, frozenset[int]]
    everyone: frozenset[int]
    everything: bool

    def readers(self, text: str) -> frozenset[int]:
        """The readers one line goes to."""
        if self.everything:
            return self.everyone
        found = [self.owners[trigger] for trigger in self.exact if trigger in text]
        if self.folded:
            lowered = text.lower()
            found += [self.owners[trigger] for trigger in self.folded if trigger in lowered]
        return frozenset().union(*found)

    def candidates(self, texts: list[str]) -> list[tuple[int, frozenset[int]]]:
        """The lines of `texts` that hold a trigger, in order, each with the readers it goes to."""
        if self.everything:
            return [(index, self.everyone) for index in range(len(texts))]
        block = "\n".join(texts)
        starts = [0, *accumulate(len(text) + 1 for text in texts)]
        hits: dict[int, set[int]] = {}

        def find(where: str, triggers: tuple[str, ...]) -> None:
            for trigger in triggers:
                owners = self.owners[trigger]
                position = where.find(trigger)
                while position != -1:
                    line = bisect_right(starts, position) - 1
                    hits.setdefault(line, set()).update(owners)
                    # Go on from the next line: one hit is enough for a line.
                    position = where.find(trigger, starts[line + 1])

        find(block, self.exact)
        if self.folded:
            lowered = block.lower()
            if len(lowered) == len(block):
                find(lowered, self.folded)
            else:  # lower() changed a length (a rare letter): the offsets would not map, so read each line
                for index, text in enumerate(texts):
                    if readers := self.readers(text):
                        hits.setdefault(index, set()).update(readers)
        return [(index, frozenset(hits[index])) for index in sorted(hits)]


def build_prefilter(regexes: Iterable[tuple[int, str, int]]) -> Prefilter:
    """The prefilter of (reader, regex, flags) triples."""
    wanted: list[tuple[int, set[str], bool]] = []
    everyone: set[int] = set()
    everything = False
    for reader, regex, flags in regexes:
        everyone.add(reader)
        found = required_literals(regex, flags)
        if found is None:
            everything = True
            continue
        strings, ignore_case = found
        wanted.append((reader, {string.lower() for string in strings} if ignore_case else strings, ignore_case))
    if everything:
        return Prefilter((), (), {}, frozenset(everyone), everything=True)
    exact = tuple(_cover({string for _, strings, folded in wanted if not folded for string in strings},
                         TRIGGER_MIN_CHARS))
    folded = tuple(_cover({string for _, strings, ignore in wanted if ignore for string in strings},
                          TRIGGER_MIN_CHARS_IGNORECASE))
    owners: dict[str, set[int]] = {trigger: set() for trigger in exact + folded}
    for reader, strings, ignore_case in wanted:
        for string in strings:
            for trigger in folded if ignore_case else exact:
                if trigger in string:
                    owners[trigger].add(reader)
    return Prefilter(exact, folded, {trigger: frozenset(readers) for trigger, readers in owners.items()},
                     frozenset(everyone), everything=False)


def catalogue_regexes(catalogue: Catalogue) -> list[tuple[int, str, int]]:
    """Every regex the matcher reads a line with, with its reader: each signature's patterns, requirements and
    cause evidence (the signature's index), and each of the context's probes (-1 - its index)."""
    found: list[tuple[int, str, int]] = []
    for index, signature in enumerate(catalogue.signatures):
        for pattern in [*signature.all_patterns(), *signature.requires,
                        *(evidence for cause in signature.causes for evidence in cause.evidence)]:
            found.append((index, pattern.regex, 0))
    found += [(-1 - index, pattern.pattern, pattern.flags & ~re.UNICODE)
              for index, (_, _, pattern) in enumerate(context.probes())]
    return found


# Built once per catalogue (by identity: a catalogue is immutable, its lists are not hashable).
_PREFILTERS: dict[int, tuple[Catalogue, Prefilter]] = {}


def _prefilter_for(catalogue: Catalogue) -> Prefilter:
    cached = _PREFILTERS.get(id(catalogue))
    if cached is None or cached[0] is not catalogue:
        if len(_PREFILTERS) >= 8:
            _PREFILTERS.clear()
        cached = _PREFILTERS[id(catalogue)] = (catalogue, build_prefilter(catalogue_regexes(catalogue)))
    return cached[1]


# ---------------------------------------------------------------- the watches

def _compiled(patterns: Sequence[Pattern]) -> list[tuple[re.Pattern[str], frozenset[str]]]:
    return [(re.compile(pattern.regex), frozenset(pattern.kinds)) for pattern in patterns]


def _matches(kind: str, text: str, compiled: list[tuple[re.Pattern[str], frozenset[str]]]) -> bool:
    return any(kind in kinds and regex.search(text) for regex, kinds in compiled)


class _Watch:
    """One signature, fed the lines one at a time: its first EVIDENCE_LINES matching lines, how many matched, which
    of its `requires` patterns some line met, and the first line showing each cause's own evidence."""

    def __init__(self, signature: Signature) -> None:
        self.signature = signature
        self.patterns = _compiled(signature.all_patterns())
        self.requires = [_compiled([required]) for required in signature.requires]
        self.met = [False] * len(self.requires)
        self.causes = [_compiled(cause.evidence) for cause in signature.causes]
        self.cause_lines: list[LogLine | None] = [None] * len(self.causes)
        self.evidence: list[LogLine] = []
        self.count = 0

    def see(self, line: LogLine, text: str) -> bool:
        """Whether the line is evidence of this signature."""
        matched = _matches(line.kind, text, self.patterns)
        if matched:
            self.count += 1
            if len(self.evidence) < EVIDENCE_LINES:
                self.evidence.append(line)
        for index, required in enumerate(self.requires):
            if not self.met[index] and _matches(line.kind, text, required):
                self.met[index] = True
        for index, evidence in enumerate(self.causes):
            if self.cause_lines[index] is None and evidence and _matches(line.kind, text, evidence):
                self.cause_lines[index] = line
        return matched

    def match(self) -> Match | None:
        if not self.count or not all(self.met):
            return None
        signature = self.signature
        # The first cause (most likely first) whose own evidence is in the log; none when no cause's is.
        picked = next((index for index, line in enumerate(self.cause_lines) if line is not None), None)
        fix = signature.causes[picked].fix if picked is not None else signature.fix
        if picked is None and LINE_PLACEHOLDER.search(fix.text):
            fix = fix.model_copy(update={"text": self._filled(fix.text)})
        return Match(id=signature.id, title=signature.title, severity=signature.severity, meaning=signature.meaning,
                     fix=fix, causes=signature.causes, picked_cause=picked,
                     cause_evidence=[line for line in self.cause_lines[picked:picked + 1] if line is not None]
                     if picked is not None else [],
                     layer=signature.layer,
                     generic=signature.generic or (signature.generic_unless_picked and picked is None),
                     sources=signature.sources,
                     applies_to=signature.applies_to, evidence=self.evidence, evidence_count=self.count)


    def _filled(self, text: str) -> str:
        """TEXT with each ${name} replaced by what the pattern that matched the first evidence line caught."""
        line = self.evidence[0]
        caught: dict[str, str] = {}
        for pattern in self.signature.patterns:
            found = re.search(pattern.regex, line.text[:MAX_LINE_CHARS])
            if found is not None and line.kind in pattern.kinds:
                caught = {name: value.strip() for name, value in found.groupdict().items() if value}
                break
        return LINE_PLACEHOLDER.sub(lambda named: caught.get(named.group(1), "(see the line)"), text)


class _Reader:
    """Every watch, and what the log says beside them (context.py), fed the lines the prefilter lets through."""

    def __init__(self, catalogue: Catalogue) -> None:
        self.watches = [_Watch(signature) for signature in catalogue.signatures]
        self.prefilter = _prefilter_for(catalogue)
        self.probes = context.probes()
        self.read = 0
        self.versions: dict[str, str] = {}
        self.settings: dict[str, str] = {}
        self.last_call: str | None = None
        self.failing_call: str | None = None
        self.decisive: list[LogLine] = []

    def line(self, line: LogLine, readers: frozenset[int]) -> None:
        text = line.text[:MAX_LINE_CHARS]
        probes: list[int] = []
        for index in readers:
            if index >= 0:
                self.watches[index].see(line, text)
            else:
                probes.append(-1 - index)
        if line.kind == "verify":
            return
        decisive = False
        for index in sorted(probes):
            what, name, pattern = self.probes[index]
            if what == "version":
                if name not in self.versions and (version := context.version_in(name, text)) is not None:
                    self.versions[name] = version
            elif what == "settings":
                for setting, value in context.settings_in(text).items():
                    self.settings.setdefault(setting, value)
            elif what == "call":
                if pattern.search(text):
                    self.last_call = name
            else:
                decisive = decisive or context.is_decisive(line.kind, text)
        if decisive:
            if self.failing_call is None:
                self.failing_call = self.last_call
            if len(self.decisive) < 4 * EVIDENCE_LINES:
                self.decisive.append(line)

    def batch(self, batch: LineBatch) -> None:
        self.read += len(batch.texts)
        for index, readers in self.prefilter.candidates(batch.texts):
            if batch.lines is not None:
                self.line(batch.lines[index], readers)
                continue
            text = batch.texts[index]
            self.line(LogLine.model_construct(log=batch.log, kind=batch.kind_of(text),
                                              number=batch.first_number + index, text=text), readers)


def _batches(lines: Iterable[LogLine | LineBatch], size: int = 4096) -> Iterable[LineBatch]:
    """LogLines grouped into batches (of one log at a time), batches passed through."""
    pending: list[LogLine] = []

    def flush() -> LineBatch:
        batch = LineBatch(log=pending[0].log, first_number=pending[0].number, texts=[line.text for line in pending],
                          kind_of=lambda _text: "serve", lines=list(pending))
        pending.clear()
        return batch

    for item in lines:
        if isinstance(item, LineBatch):
            if pending:
                yield flush()
            yield item
            continue
        pending.append(item)
        if len(pending) >= size:
            yield flush()
    if pending:
        yield flush()


def match_signature(signature: Signature, lines: Iterable[LogLine]) -> Match | None:
    watch = _Watch(signature)
    for line in lines:
        watch.see(line, line.text[:MAX_LINE_CHARS])
    return watch.match()


def contradictions(catalogue: Catalogue, matches: Iterable[Match], profile: str | None,
                   profile_source: str | None, auto_profile: str | None = None) -> list[Contradiction]:
    """Where the running oneCCL profile contradicts the catalogue: a matched failure whose entry says the profile
    is wrong (the no-P2P IPC failure under `p2p`), or a profile forced against what the topology itself gives
    (`p2p` on a host whose pairs have no P2P), even before it failed."""
    if profile is None:
        return []
    matched = {match.id: match for match in matches}
    found = []
    for signature in catalogue.signatures:
        if signature.contradicts_profile != profile:
            continue
        if signature.id in matched:
            if matched[signature.id].fix.profile != signature.fix.profile:
                continue  # the log shows another cause of the same lines: the profile is not what failed
            why = f"the logs show {signature.id}"
        elif auto_profile is not None and auto_profile != profile and signature.fix.profile == auto_profile:
            why = f"the topology gives {auto_profile} and {signature.id} is what {profile} leads to there"
        else:
            continue
        found.append(Contradiction(
            signature=signature.id, profile=profile, profile_source=profile_source or "unknown",
            text=(f"the host serves with the {profile} oneCCL profile ({profile_source or 'unknown source'}), but "
                  f"{why}: use profile {signature.fix.profile} (b70ctl host topology --write"
                  f"{' --profile ' + signature.fix.profile if signature.fix.profile else ''}, and drop any profile "
                  f"override)")))
    return found


def _unknown(reader: _Reader, harmless: list[Match]) -> UnknownFailure | None:
    """The decisive lines no harmless entry explains, with their layers and codes; None when there are none."""
    explained = {(line.log, line.number) for match in harmless for line in match.evidence}
    lines = [line for line in reader.decisive if (line.log, line.number) not in explained][:EVIDENCE_LINES]
    if not lines:
        return None
    layers: list[str] = []
    codes: list[str] = []
    for line in lines:
        layer = context.layer_of(line.kind, line.text[:MAX_LINE_CHARS])
        if layer is not None and layer not in layers:
            layers.append(layer)
        codes += [code.name for code in codes_in(line.text[:MAX_LINE_CHARS]) if code.name not in codes]
    return UnknownFailure(lines=lines, layers=layers, codes=codes)


def diagnose_lines(catalogue: Catalogue, lines: Iterable[LogLine | LineBatch], logs: Sequence[str],
                   profile: str | None = None, profile_source: str | None = None,
                   auto_profile: str | None = None) -> Diagnosis:
    """`lines` may be a stream (collect.stream_log, collect.stream_log_batches): it is read once."""
    reader = _Reader(catalogue)
    for batch in _batches(lines):
        reader.batch(batch)
    matches = [found for watch in reader.watches if (found := watch.match())]
    matched = {match.id for match in matches}
    unless = {signature.id: set(signature.unless) for signature in catalogue.signatures}
    matches = [match for match in matches if not unless[match.id] & matched]
    # A layer's generic entry only speaks when no specific failure did: a named cause says more than any layer.
    if any(match.severity == "failure" and not match.generic for match in matches):
        matches = [match for match in matches if not match.generic]
    failures = [m for m in matches if m.severity == "failure"]
    harmless = [m for m in matches if m.severity == "harmless"]
    return Diagnosis(logs=list(logs), lines_read=reader.read, failures=failures, harmless=harmless,
                     contradictions=contradictions(catalogue, failures, profile, profile_source, auto_profile),
                     unknown=None if failures else _unknown(reader, harmless),
                     context=LogContext(versions=reader.versions, settings=reader.settings,
                                        failing_call=reader.failing_call))
