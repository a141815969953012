"""systemd's word splitting of an ExecStart= line, for the tests that read a unit file back as systemd would."""

from __future__ import annotations

import shutil
from pathlib import Path


def systemd_split(line: str) -> list[str]:
    """ExecStart's word splitting as systemd does it for double-quoted words (C escapes, %% and $$)."""
    words, index = [], 0
    escapes = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"'}
    while index < len(line):
        if line[index] == " ":
            index += 1
            continue
        assert line[index] == '"', line[index:]
        index += 1
        word = []
        while line[index] != '"':
            character = line[index]
            if character == "\\":
                following = line[index + 1]
                if following == "x":
                    word.append(chr(int(line[index + 2:index + 4], 16)))
                    index += 4
                    continue
                word.append(escapes[following])
                index += 2
                continue
            if character in "%$":
                assert line[index + 1] == character, line
                index += 1
            word.append(character)
            index += 1
        words.append("".join(word))
        index += 1
    return words


def systemd_verify_root(root: Path) -> Path:
    """A root for `systemd-analyze verify --root=`: verify wants every unit a unit requires and every command it
    runs to exist, so the root holds the machine's systemd units, a docker.service and /usr/bin/docker, whether
    or not this machine has docker installed yet."""
    shutil.copytree(Path("/lib/systemd/system"), root / "usr/lib/systemd/system", symlinks=True)
    (root / "usr/lib/systemd/system/docker.service").unlink(missing_ok=True)
    (root / "usr/lib/systemd/system/docker.service").write_text("[Service]\nExecStart=/usr/bin/docker\n")
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/docker").write_text("#!/bin/sh\n")
    (root / "usr/bin/docker").chmod(0o755)
    return root
