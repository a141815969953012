"""Level Zero (ZE_RESULT_*) and Unified Runtime (UR_RESULT_*) result codes, read from the runtimes' own headers
(the upstream/ folder beside this file, its README says where each was cut from), and found in log lines by name
or by number.

A log prints a code as its name (`code: ZE_RESULT_ERROR_INVALID_ARGUMENT`), as its number (`Native API returns: 39`)
or both (`level_zero backend failed with error: 39 (UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY)`): both read the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Literal

Api = Literal["ze", "ur"]

# One enumerator of a C enum: its name, `=`, its value (decimal or hex), then its comment (`///< ...` after it in
# ze_api.h; a `/// ...` line before it in ur_api.h).
_ENUMERATOR = re.compile(r"^\s*((?:ZE|UR)_RESULT_\w+)(?:\s*\[\[deprecated\]\])?\s*=\s*(0x[0-9a-fA-F]+|\d+)\s*,?"
                         r"\s*(?:///<\s*(.*))?$")
_DOC_LINE = re.compile(r"^\s*///\s?(?!<)(.*)$")
_END_MARKER = "_RESULT_FORCE_UINT32"

# Where a log names a code by number: UR's adapters print the number, then its name in () or []; SYCL's
# "Native API returns: N"; a bare "UR backend returns:N". Only these shapes: a number alone means nothing.
_NUMBER_PREFIX = r"(?:backend failed with error|Native API returns|UR backend returns|error code)[:=]?\s*"
_NUMBERED = re.compile(_NUMBER_PREFIX + r"(-?\d+)")
_NAMED = re.compile(r"\b(?:ZE|UR)_RESULT_[A-Z0-9_]+\b")


@dataclass(frozen=True)
class ResultCode:
    api: Api
    name: str
    number: int
    meaning: str

    @property
    def is_error(self) -> bool:
        return "_ERROR_" in self.name


def parse_result_enum(text: str) -> list[ResultCode]:
    """The enumerators of one result enum excerpt (ze_result_t or ur_result_t), in order, with each one's comment."""
    found: list[ResultCode] = []
    doc: list[str] = []
    trailing: ResultCode | None = None
    for line in text.splitlines():
        if (enumerator := _ENUMERATOR.match(line)) is not None:
            name, value, comment = enumerator.groups()
            if name.endswith(_END_MARKER):
                break
            api: Api = "ze" if name.startswith("ZE_") else "ur"
            meaning = comment.strip() if comment else " ".join(doc)
            trailing = ResultCode(api, name, int(value, 0), meaning)
            found.append(trailing)
            doc = []
        elif (comment_line := _DOC_LINE.match(line)) is not None:
            doc.append(comment_line.group(1).strip())
        elif (continued := re.match(r"^\s*///<\s*(.*)$", line)) is not None and trailing is not None:
            # ze_api.h wraps a long comment onto `///<` lines under the enumerator.
            found[-1] = trailing = ResultCode(trailing.api, trailing.name, trailing.number,
                                              f"{trailing.meaning} {continued.group(1).strip()}")
    return found


@lru_cache(maxsize=1)
def result_codes() -> dict[str, ResultCode]:
    """Every ZE_RESULT_* and UR_RESULT_* code by name, from the shipped header excerpts."""
    folder = resources.files("b70ctl.diagnose") / "upstream"
    codes: dict[str, ResultCode] = {}
    for name in ("ze_result_t.h", "ur_result_t.h"):
        for code in parse_result_enum((folder / name).read_text(encoding="utf-8")):
            codes[code.name] = code
    return codes


@lru_cache(maxsize=1)
def _ur_by_number() -> dict[int, ResultCode]:
    return {code.number: code for code in result_codes().values() if code.api == "ur"}


def codes_in(text: str) -> list[ResultCode]:
    """The result codes a log line names, by name or by number (a number is read as UR's: the shapes that print a
    bare number are UR's and SYCL's), each once, in the order they appear."""
    codes = result_codes()
    by_number = _ur_by_number()
    seen = [(match.start(), codes[match.group()]) for match in _NAMED.finditer(text) if match.group() in codes]
    seen += [(match.start(), by_number[int(match.group(1))]) for match in _NUMBERED.finditer(text)
             if int(match.group(1)) in by_number]
    found: dict[str, ResultCode] = {}
    for _, code in sorted(seen, key=lambda pair: pair[0]):
        found.setdefault(code.name, code)
    return list(found.values())


def code_regex(names: list[str]) -> str:
    """A regex finding these codes in a line by name, or (UR codes) by number in the shapes logs print numbers in."""
    codes = result_codes()
    unknown = [name for name in names if name not in codes]
    if unknown:
        raise ValueError(f"{unknown[0]} is not a ZE_RESULT_* or UR_RESULT_* code of the headers")
    by_name = r"\b(?:" + "|".join(re.escape(name) for name in names) + r")\b"
    numbers = sorted({codes[name].number for name in names if codes[name].api == "ur"})
    if not numbers:
        return by_name
    return by_name + "|" + _NUMBER_PREFIX + r"(?:" + "|".join(map(str, numbers)) + r")\b"
