"""Local HTTP endpoints the model-store and lock tests talk to through the real clients.

- LocalHub: the few Hugging Face hub routes huggingface_hub uses (model info with siblings and LFS sha256 at a
  revision; HEAD/GET /REPO/resolve/REV/FILE with Range support), serving generated repositories whose branches
  can be moved, with one-shot faults: cut a body mid-way, serve corrupt bytes.
- LocalRegistry: the OCI distribution manifest route (HEAD/GET /v2/NAME/manifests/REF with Docker-Content-Digest),
  optionally behind an anonymous bearer-token challenge, optionally without the digest header on HEAD.

Both bind 127.0.0.1 on a free port of 8300-8319 (then any free port) and record every request.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PORT_RANGE = range(8300, 8320)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _free_port() -> int:
    for port in PORT_RANGE:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _Server:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        raise NotImplementedError

    def start(self) -> str:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_HEAD(self) -> None:
                server._record(self, "HEAD")
                server.handle(self, "HEAD")

            def do_GET(self) -> None:
                server._record(self, "GET")
                server.handle(self, "GET")

            def log_message(self, *args: Any) -> None:
                pass

        for _ in range(5):
            try:
                self._httpd = ThreadingHTTPServer(("127.0.0.1", _free_port()), Handler)
                break
            except OSError:
                continue
        assert self._httpd is not None
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self.url

    @property
    def url(self) -> str:
        assert self._httpd is not None
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def _record(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        with self.lock:
            self.requests.append({"method": method, "path": handler.path.split("?")[0],
                                  "range": handler.headers.get("Range"),
                                  "accept": handler.headers.get("Accept"),
                                  "authorization": handler.headers.get("Authorization")})

    @staticmethod
    def reply(handler: BaseHTTPRequestHandler, status: int, body: bytes = b"",
              headers: dict[str, str] | None = None, send_body: bool = True) -> None:
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if send_body and body:
            handler.wfile.write(body)


# --- the hub -----------------------------------------------------------------------------------------------------


@dataclass
class HubRepo:
    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> commit
    lfs_suffixes: tuple[str, ...] = (".safetensors",)

    def commit(self, files: dict[str, bytes], branch: str = "main") -> str:
        """Add a commit holding exactly `files` and move `branch` to it. Returns the 40-hex commit id."""
        digest = hashlib.sha1(json.dumps({p: hashlib.sha256(b).hexdigest() for p, b in sorted(files.items())},
                                         sort_keys=True).encode() + self.repo_id.encode()).hexdigest()
        self.commits[digest] = dict(files)
        self.refs[branch] = digest
        return digest

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


class LocalHub(_Server):
    def __init__(self) -> None:
        super().__init__()
        self.repos: dict[str, HubRepo] = {}
        self.cut_once: dict[str, int] = {}  # path -> bytes to send before closing the connection, once
        self.corrupt: dict[str, bytes] = {}  # "REPO/FILE" -> bytes served instead (metadata unchanged)

    def repo(self, repo_id: str) -> HubRepo:
        return self.repos.setdefault(repo_id, HubRepo(repo_id))

    def downloads(self, path_suffix: str = "") -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == "GET" and "/resolve/" in r["path"]
                and r["path"].endswith(path_suffix)]

    def _not_found(self, handler: BaseHTTPRequestHandler, code: str, send_body: bool) -> None:
        body = json.dumps({"error": f"{code}"}).encode()
        self.reply(handler, 404, body, {"X-Error-Code": code, "Content-Type": "application/json"}, send_body)

    def handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path = handler.path.split("?")[0]
        send_body = method == "GET"
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
        if info:
            repo = self.repos.get(info.group(1))
            if repo is None:
                return self._not_found(handler, "RepoNotFound", send_body)
            commit = repo.resolve(info.group(2))
            if commit is None:
                return self._not_found(handler, "RevisionNotFound", send_body)
            siblings = []
            for name, data in sorted(repo.commits[commit].items()):
                sibling: dict[str, Any] = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
                if name.endswith(repo.lfs_suffixes):
                    sibling["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                      "pointerSize": 134}
                siblings.append(sibling)
            body = json.dumps({"id": repo.repo_id, "modelId": repo.repo_id, "sha": commit,
                               "siblings": siblings, "private": False}).encode()
            return self.reply(handler, 200, body, {"Content-Type": "application/json"}, send_body)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if not resolve:
            return self.reply(handler, 404, b"not found", send_body=send_body)
        repo = self.repos.get(resolve.group(1))
        if repo is None:
            return self._not_found(handler, "RepoNotFound", send_body)
        commit = repo.resolve(resolve.group(2))
        if commit is None:
            return self._not_found(handler, "RevisionNotFound", send_body)
        name = resolve.group(3)
        files = repo.commits[commit]
        if name not in files:
            return self._not_found(handler, "EntryNotFound", send_body)
        data = files[name]
        etag = hashlib.sha256(data).hexdigest() if name.endswith(repo.lfs_suffixes) else git_blob_sha1(data)
        served = self.corrupt.get(f"{repo.repo_id}/{name}", data)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        start = 0
        range_header = handler.headers.get("Range")
        status = 200
        if range_header and method == "GET":
            match = re.fullmatch(r"bytes=(\d+)-", range_header.strip())
            assert match, f"unexpected Range {range_header}"
            start = int(match.group(1))
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(served) - 1}/{len(served)}"
        body = served[start:]
        if method == "GET" and name in self.cut_once:
            keep = self.cut_once.pop(name)
            handler.send_response(status)
            for key, value in headers.items():
                handler.send_header(key, value)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body[:keep])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return None
        return self.reply(handler, status, body, headers, send_body)


# --- the registry ------------------------------------------------------------------------------------------------

MANIFEST_TYPE = "application/vnd.oci.image.index.v1+json"


class LocalRegistry(_Server):
    def __init__(self, require_token: bool = False, digest_header_on_head: bool = True) -> None:
        super().__init__()
        self.manifests: dict[tuple[str, str], bytes] = {}  # (repository, tag or digest) -> manifest
        self.require_token = require_token
        self.digest_header_on_head = digest_header_on_head
        self.token = "anonymous-pull-token"

    def push(self, repository: str, tag: str, manifest: dict[str, Any]) -> str:
        body = json.dumps(manifest, sort_keys=True).encode()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        self.manifests[(repository, tag)] = body
        self.manifests[(repository, digest)] = body
        return digest

    def handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path = handler.path.split("?")[0]
        send_body = method == "GET"
        if path == "/token":
            body = json.dumps({"token": self.token}).encode()
            return self.reply(handler, 200, body, {"Content-Type": "application/json"}, send_body)
        match = re.fullmatch(r"/v2/(.+)/manifests/([^/]+)", path)
        if not match:
            return self.reply(handler, 404, b"{}", send_body=send_body)
        if self.require_token and handler.headers.get("Authorization") != f"Bearer {self.token}":
            challenge = f'Bearer realm="{self.url}/token",service="local-registry"'
            return self.reply(handler, 401, b"{}", {"WWW-Authenticate": challenge}, send_body)
        body = self.manifests.get((match.group(1), match.group(2)))
        if body is None:
            return self.reply(handler, 404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}', send_body=send_body)
        headers = {"Content-Type": MANIFEST_TYPE}
        if method == "GET" or self.digest_header_on_head:
            headers["Docker-Content-Digest"] = "sha256:" + hashlib.sha256(body).hexdigest()
        return self.reply(handler, 200, body, headers, send_body)
