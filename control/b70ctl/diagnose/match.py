"""Match collected log lines against the catalogue. Pure: lines in, a Diagnosis out."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from b70ctl.diagnose.model import Catalogue, Contradiction, Diagnosis, LogLine, Match, Pattern, Signature

EVIDENCE_LINES = 5
# Lines longer than this are cut before matching: a log can hold a megabyte-long line (a tensor dump).
MAX_LINE_CHARS = 4000


def _compiled(patterns: Sequence[Pattern]) -> list[tuple[re.Pattern[str], frozenset[str]]]:
    return [(re.compile(pattern.regex), frozenset(pattern.kinds)) for pattern in patterns]


def _matches(kind: str, text: str, compiled: list[tuple[re.Pattern[str], frozenset[str]]]) -> bool:
    return any(kind in kinds and regex.search(text) for regex, kinds in compiled)


class _Watch:
    """One signature, fed the lines one at a time: its first EVIDENCE_LINES matching lines, how many matched, and
    which of its `requires` patterns some line met. A log is read once, whatever its size, and only the evidence
    stays in memory."""

    def __init__(self, signature: Signature) -> None:
        self.signature = signature
        self.patterns = _compiled(signature.patterns)
        self.requires = [_compiled([required]) for required in signature.requires]
        self.met = [False] * len(self.requires)
        self.evidence: list[LogLine] = []
        self.count = 0

    def see(self, line: LogLine, text: str) -> None:
        if _matches(line.kind, text, self.patterns):
            self.count += 1
            if len(self.evidence) < EVIDENCE_LINES:
                self.evidence.append(line)
        for index, required in enumerate(self.requires):
            if not self.met[index] and _matches(line.kind, text, required):
                self.met[index] = True

    def match(self) -> Match | None:
        if not self.count or not all(self.met):
            return None
        signature = self.signature
        return Match(id=signature.id, title=signature.title, severity=signature.severity, meaning=signature.meaning,
                     fix=signature.fix, causes=signature.causes, sources=signature.sources,
                     applies_to=signature.applies_to, evidence=self.evidence, evidence_count=self.count)


def _watch(watches: Sequence[_Watch], lines: Iterable[LogLine]) -> int:
    """Feed every line to every watch; the number of lines read."""
    read = 0
    for line in lines:
        read += 1
        text = line.text[:MAX_LINE_CHARS]
        for watch in watches:
            watch.see(line, text)
    return read


def match_signature(signature: Signature, lines: Iterable[LogLine]) -> Match | None:
    watch = _Watch(signature)
    _watch([watch], lines)
    return watch.match()


def contradictions(catalogue: Catalogue, matches: Iterable[Match], profile: str | None,
                   profile_source: str | None, auto_profile: str | None = None) -> list[Contradiction]:
    """Where the running oneCCL profile contradicts the catalogue: a matched failure whose entry says the profile
    is wrong (the no-P2P IPC failure under `p2p`), or a profile forced against what the topology itself gives
    (`p2p` on a host whose pairs have no P2P), even before it failed."""
    if profile is None:
        return []
    matched = {match.id for match in matches}
    found = []
    for signature in catalogue.signatures:
        if signature.contradicts_profile != profile:
            continue
        if signature.id in matched:
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


def diagnose_lines(catalogue: Catalogue, lines: Iterable[LogLine], logs: Sequence[str],
                   profile: str | None = None, profile_source: str | None = None,
                   auto_profile: str | None = None) -> Diagnosis:
    """`lines` may be a stream (collect.stream_log): it is read once."""
    watches = [_Watch(signature) for signature in catalogue.signatures]
    read = _watch(watches, lines)
    matches = [found for watch in watches if (found := watch.match())]
    matched = {match.id for match in matches}
    unless = {signature.id: set(signature.unless) for signature in catalogue.signatures}
    matches = [match for match in matches if not unless[match.id] & matched]
    failures = [m for m in matches if m.severity == "failure"]
    return Diagnosis(logs=list(logs), lines_read=read, failures=failures,
                     harmless=[m for m in matches if m.severity == "harmless"],
                     contradictions=contradictions(catalogue, failures, profile, profile_source, auto_profile))
