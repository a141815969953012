"""What a host's container runs, by docker's own rules rather than this repo's reading of them.

`docker run [OPTIONS] IMAGE [COMMAND] [ARG...]` is parsed by the real docker CLI: it is pointed at a recording
daemon on a unix socket (DOCKER_HOST), which answers the CLI's ping, keeps the body of `POST /containers/create`
(the container config the CLI built from the arguments: Image, Cmd, Entrypoint, Env, HostConfig) and refuses
everything after it, so nothing is started and no engine is needed. The CLI reads --env-file itself, so the files
a unit names must exist where the test says they are.

The process the container then runs follows the Dockerfile reference (docs.docker.com/reference/dockerfile,
"Understand how CMD and ENTRYPOINT interact"): the image's ENTRYPOINT (unless --entrypoint overrides it) followed
by the words after the image, or by the image's CMD when there are none; and "if CMD is defined from the base
image, setting ENTRYPOINT will reset CMD to an empty value".
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socketserver
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dockerfile_parse import DockerfileParser

API_VERSION = "1.45"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _RecordingServer

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Api-Version", API_VERSION)
        self.send_header("OSType", "linux")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._answer(200, b"")

    def do_GET(self) -> None:
        self._answer(200, b"OK" if self.path.endswith("/_ping") else b"{}")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if "/containers/create" in self.path:
            self.server.created.append(json.loads(body))
            self._answer(201, json.dumps({"Id": "0" * 64, "Warnings": []}).encode())
        else:
            self._answer(500, b'{"message": "recording daemon: nothing is started"}')

    def address_string(self) -> str:
        return "unix"

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _RecordingServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str) -> None:
        self.created: list[dict[str, Any]] = []
        super().__init__(path, _Handler)

    def get_request(self) -> tuple[Any, Any]:
        request, _ = super().get_request()
        return request, ("unix", 0)


@contextmanager
def recording_daemon(directory: Path) -> Iterator[_RecordingServer]:
    server = _RecordingServer(str(directory / "docker.sock"))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def docker_cli() -> str:
    found = shutil.which("docker") or ("/usr/bin/docker" if Path("/usr/bin/docker").is_file() else None)
    assert found, "no docker CLI on this machine: install docker.io (scripts/testhosts engine does)"
    return found


def created_container(argv: list[str], directory: Path) -> dict[str, Any]:
    """The container config the real docker CLI sends for `argv` (a `docker run ...` command line)."""
    assert Path(argv[0]).name == "docker" and argv[1] == "run", argv[:2]
    with recording_daemon(directory) as daemon:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DOCKER_HOST": f"unix://{directory}/docker.sock",
               "DOCKER_CONFIG": str(directory / "docker-config"), "HOME": str(directory)}
        result = subprocess.run([docker_cli(), *argv[1:]], env=env, capture_output=True, text=True, timeout=60,
                                check=False)
        assert len(daemon.created) == 1, f"docker refused the command line: {result.stderr.strip()}"
        return daemon.created[0]


def image_start(dockerfile: Path) -> tuple[list[str] | None, list[str] | None]:
    """(ENTRYPOINT, CMD) of the image the Dockerfile's last stage builds, for what the Dockerfile itself sets (exec
    form only: a shell form would wrap the words in /bin/sh -c). A base's CMD is dropped once ENTRYPOINT is set."""
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    for instruction in DockerfileParser(path=str(dockerfile)).structure:
        name, value = instruction["instruction"], instruction["value"]
        if name == "FROM":
            entrypoint, cmd = None, None
        elif name in ("ENTRYPOINT", "CMD"):
            words = json.loads(value)
            assert isinstance(words, list), f"{dockerfile}: {name} {value} is not the exec form"
            if name == "ENTRYPOINT":
                entrypoint, cmd = words, None
            else:
                cmd = words
    return entrypoint, cmd


def container_process(dockerfile: Path, created: dict[str, Any]) -> list[str]:
    """The argv of the container's first process."""
    entrypoint, cmd = image_start(dockerfile)
    if created.get("Entrypoint"):
        entrypoint, cmd = created["Entrypoint"], None
    words = created.get("Cmd") or cmd or []
    process = [*(entrypoint or []), *words]
    assert process, f"{dockerfile}: the container has nothing to run"
    return process
