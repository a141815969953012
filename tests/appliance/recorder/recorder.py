"""Stand-in for `vllm serve`: records its argv and environment and answers like vLLM's OpenAI server.

GET /health              200, empty (as vLLM)
GET /v1/models           the --served-model-name, behind the API key of VLLM_API_KEY when it is set (as vLLM)
GET /metrics             Prometheus text with vLLM's spec-decode and generation counters at zero
GET /b70/recorded        {"argv": [...], "env": {...}} as this process started, behind the same API key
Only --host, --port and --served-model-name are read from argv; every argument is recorded as given.

B70_RECORDER_DIES_ON_P2P=<file> makes it die as a dual-B70 host without working peer memory does: started with the
p2p oneCCL set (CCL_TOPO_P2P_ACCESS=1) it prints that file (a log a B70 owner posted) and exits 1 before serving.
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def initial_environment() -> dict[str, str]:
    """The environment exactly as the process was started with: Python itself adds LC_CTYPE to os.environ when
    it coerces a C locale (PEP 538), so the kernel's copy is read instead."""
    with open("/proc/self/environ", "rb") as stream:
        pairs = [item.decode().split("=", 1) for item in stream.read().split(b"\0") if item]
    return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


ARGV = sys.argv[1:]
ENV = initial_environment()
STARTED = int(time.time())


def option(name: str, default: str) -> str:
    for index, arg in enumerate(ARGV):
        if arg == name and index + 1 < len(ARGV):
            return ARGV[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


MODEL = option("--served-model-name", option("--model", "stand-in"))
API_KEY = ENV.get("VLLM_API_KEY", "")
METRICS = "".join(
    f"# TYPE vllm:{name} counter\nvllm:{name}{{engine=\"0\",model_name=\"{MODEL}\"}} 0.0\n"
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "generation_tokens_total", "prompt_tokens_total"))


class Handler(BaseHTTPRequestHandler):
    server_version = "b70-recorder"

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        if not API_KEY or self.headers.get("Authorization") == f"Bearer {API_KEY}":
            return True
        self._send(401, json.dumps({"error": "Unauthorized"}).encode())
        return False

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send(200, b"")
        elif path == "/metrics":
            self._send(200, METRICS.encode(), "text/plain; version=0.0.4")
        elif path == "/v1/models":
            if self._authorized():
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": MODEL, "object": "model", "created": STARTED, "owned_by": "vllm", "root": option(
                        "--model", MODEL), "max_model_len": int(option("--max-model-len", "0"))}]}).encode())
        elif path == "/b70/recorded":
            if self._authorized():
                self._send(200, json.dumps({"argv": ARGV, "env": ENV}).encode())
        else:
            self._send(404, json.dumps({"detail": "Not Found"}).encode())

    def log_message(self, format: str, *args: object) -> None:
        sys.stderr.write("recorder: " + (format % args) + "\n")


def main() -> None:
    posted_log = ENV.get("B70_RECORDER_DIES_ON_P2P")
    if posted_log and ENV.get("CCL_TOPO_P2P_ACCESS") == "1":
        with open(posted_log, encoding="utf-8") as stream:
            sys.stderr.write(stream.read())
        sys.exit(1)
    server = ThreadingHTTPServer((option("--host", "0.0.0.0"), int(option("--port", "8000"))), Handler)
    sys.stderr.write(f"recorder: serving {MODEL} on {server.server_address}, argv {len(ARGV)} items\n")
    server.serve_forever()


if __name__ == "__main__":
    main()
