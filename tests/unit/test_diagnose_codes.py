"""Result codes read from the Level Zero and Unified Runtime headers (control/b70ctl/diagnose/upstream/), checked
against what real logs print: a code's number and its name, side by side on one line, as reporters posted them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from b70ctl.diagnose.codes import codes_in, parse_result_enum, result_codes

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# Logs posted in public issues (each file's index or README names its thread); never the held-out set.
LOGS = sorted((FIXTURES / "field" / "logs").glob("*.log")) + sorted((FIXTURES / "diagnose").rglob("*.log"))
NUMBER_AND_NAME = re.compile(r"(?:error|returns):\s*(\d+)\s*[(\[]((?:UR|ZE)_RESULT_\w+)[)\]]")


def printed_pairs() -> list[tuple[str, int, str, str]]:
    pairs = []
    for log in LOGS:
        for line in log.read_text(errors="replace").splitlines():
            for match in NUMBER_AND_NAME.finditer(line):
                pairs.append((log.name, int(match.group(1)), match.group(2), line))
    return pairs


PAIRS = printed_pairs()


def test_the_corpus_prints_codes_by_number_and_name() -> None:
    # The check below needs real lines to read: 20, 39, 40 and 2147483646 are printed with their names today.
    assert {number for _, number, _, _ in PAIRS} >= {20, 39, 40, 2147483646}


@pytest.mark.parametrize("log, number, name, line", PAIRS, ids=[f"{p[0]}:{p[2]}" for p in PAIRS])
def test_a_number_a_log_prints_is_the_header_s_number_for_the_name_beside_it(log: str, number: int, name: str,
                                                                              line: str) -> None:
    assert result_codes()[name].number == number
    # Read by number alone (the name cut off), the line names the same code.
    assert [code.name for code in codes_in(line.replace(name, ""))] == [name]
    assert [code.name for code in codes_in(line)] == [name]


def test_names_alone_are_read_in_both_apis() -> None:
    line = ("RuntimeError: oneCCL: ze_call.cpp:28 do_call: EXCEPTION: ze error at zeMemOpenIpcHandle, code: "
            "ZE_RESULT_ERROR_INVALID_ARGUMENT")
    (code,) = codes_in(line)
    assert (code.api, code.number) == ("ze", 0x78000004)
    assert codes_in("no code here, error: 39 is only a number") == []


@pytest.mark.parametrize("older, api", [("ze_result_t-v1.28.2.h", "ze"), ("ur_result_t-e5ccb4b.h", "ur")])
def test_the_images_older_runtimes_define_the_same_numbers(older: str, api: str) -> None:
    old = parse_result_enum((FIXTURES / "upstream" / older).read_text())
    shipped = result_codes()
    assert len(old) > 40
    assert all(code.api == api for code in old)
    assert {code.name: code.number for code in old} == {code.name: shipped[code.name].number for code in old}


def test_every_enumerator_of_the_headers_is_read() -> None:
    # Counted in the excerpts' text, independent of the parser: each enumerator is a `NAME = value` line.
    folder = Path(__file__).resolve().parents[2] / "control" / "b70ctl" / "diagnose" / "upstream"
    written = set()
    for header in folder.glob("*.h"):
        written |= set(re.findall(r"^\s*((?:ZE|UR)_RESULT_\w+)\b(?:\s*\[\[deprecated\]\])?\s*=", header.read_text(),
                                  re.MULTILINE))
    written = {name for name in written if not name.endswith("FORCE_UINT32")}
    assert set(result_codes()) == written
    assert all(code.meaning for code in result_codes().values())
