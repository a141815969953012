"""b70ctl's throughput check beside llama-benchy, against one real vLLM CPU server with speculation, in one run.

Every request of every tool goes through a recording proxy on loopback that asks vLLM for the token ids of each
chunk (it adds "return_token_ids": true to the request body) and timestamps each chunk as it passes. That
gives a token-exact reference for the very requests each tool measured: decode tok/s = (N-1)/(t_last-t_first)
with N the token ids streamed, and acceptance from vLLM's spec-decode counters around each tool's run. The
table prints each tool's figure, the reference and the relative error.

Also measured: the client's own ingest rate (tokens parsed per second of CPU on one core) on a fast local
stream, so the instrument is known not to be the bottleneck.

    .venv/bin/python benchmarks/verify_vs_peers.py [--runs 5] [--tg 128] [--pp 64]

llama-benchy is installed into .venv on first use (pinned, without its `asyncio` backport dependency). Its book
corpus is served from loopback: nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from b70ctl.checks.client import Endpoint, VllmClient
from b70ctl.checks.metrics import snapshot, spec_decode_stats
from b70ctl.checks.throughput import run_throughput
from b70ctl.embedded import default_cache_dir, ensure_models, start_servers
from b70ctl.models.tiny import corpus_lines
from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import Workload

LLAMA_BENCHY = "llama-benchy==0.4.0"
TABULATE = "tabulate==0.9.0"


# -- the recording proxy -------------------------------------------------------------------------------------
class RecordingProxy(ThreadingHTTPServer):
    """Runs in its own process (see `start_proxy`), so relaying chunks never competes with the measuring
    client for the GIL. Each finished stream is appended to a JSON-lines file the parent reads."""

    daemon_threads = True

    def __init__(self, upstream: str, book_text: str, record_path: str, port: int = 0):
        super().__init__(("127.0.0.1", port), _ProxyHandler)
        self.upstream = upstream.rstrip("/")
        self.book_text = book_text
        self.record_path = record_path
        self.lock = threading.Lock()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a benchmark client hanging up after [DONE] is not an error worth a traceback


class ProxyHandle:
    def __init__(self, upstream: str, book_text: str, work: Path):
        import multiprocessing
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.record_path = work / "proxy-streams.jsonl"
        self.record_path.write_text("")
        self.process = multiprocessing.get_context("spawn").Process(
            target=_serve_proxy, args=(upstream, book_text, str(self.record_path), port), daemon=True)
        self.process.start()
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(self.url + "/book.txt", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        self._read = 0

    def take(self) -> list[dict[str, Any]]:
        lines = self.record_path.read_text().splitlines()
        taken, self._read = lines[self._read:], len(lines)
        return [json.loads(line) for line in taken]

    def stop(self) -> None:
        self.process.terminate()
        self.process.join(5)


def _serve_proxy(upstream: str, book_text: str, record_path: str, port: int) -> None:
    RecordingProxy(upstream, book_text, record_path, port).serve_forever()


class _ProxyHandler(BaseHTTPRequestHandler):
    server: RecordingProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/book.txt":
            body = self.server.book_text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        upstream = httpx.get(self.server.upstream + self.path, timeout=60)
        self._relay(upstream.status_code, upstream.headers.get("content-type", "application/json"), upstream.content)

    def _relay(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not body.get("stream"):
            answer = httpx.post(self.server.upstream + self.path, json=body, timeout=300)
            self._relay(answer.status_code, answer.headers.get("content-type", "application/json"), answer.content)
            return
        body["return_token_ids"] = True
        record: dict[str, Any] = {"path": self.path, "temperature": body.get("temperature"), "chunks": [],
                                  "usage": None}
        start = time.perf_counter()
        with httpx.stream("POST", self.server.upstream + self.path, json=body, timeout=300) as upstream:
            self.send_response(upstream.status_code)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for line in upstream.iter_lines():
                now = time.perf_counter() - start
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    event = json.loads(line[5:])
                    if event.get("usage"):
                        record["usage"] = event["usage"]
                    ids = [t for choice in event.get("choices") or [] for t in choice.get("token_ids") or []]
                    if ids:
                        record["chunks"].append((now, len(ids)))
                payload = (line + "\n").encode()
                if not line:
                    payload = b"\n"
                self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        with self.server.lock, open(self.server.record_path, "a") as out:
            out.write(json.dumps(record) + "\n")


def reference_decode_rates(streams: list[dict[str, Any]]) -> list[float]:
    rates = []
    for stream in streams:
        chunks = stream["chunks"]
        tokens = sum(n for _, n in chunks)
        if tokens >= 2 and chunks[-1][0] > chunks[0][0]:
            rates.append((tokens - 1) / (chunks[-1][0] - chunks[0][0]))
    return rates


# -- the tools -----------------------------------------------------------------------------------------------
def ensure_llama_benchy() -> str:
    exe = Path(sys.executable).with_name("llama-benchy")
    if not exe.exists():
        uv = Path(sys.executable).with_name("uv")
        subprocess.run([str(uv), "pip", "install", "--quiet", "--python", sys.executable, "--no-deps",
                        LLAMA_BENCHY, TABULATE], check=True)
    return str(exe)


def run_llama_benchy(exe: str, proxy: ProxyHandle, model: str, tokenizer: str, args: argparse.Namespace,
                     extra_body: list[str], out: Path) -> dict[str, Any]:
    command = [exe, "--base-url", f"{proxy.url}/v1", "--model", model, "--tokenizer", tokenizer,
               "--pp", str(args.pp), "--tg", str(args.tg), "--runs", str(args.runs), "--exact-tg",
               "--latency-mode", "none", "--skip-coherence", "--no-adapt-prompt",
               "--book-url", f"{proxy.url}/book.txt", "--format", "json", "--save-result", str(out)]
    for item in extra_body:
        command += ["--extra-body", item]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=1800)
    report = json.loads(out.read_text())
    run = next(b for b in report["benchmarks"] if not b.get("is_context_prefill_phase"))
    return {"decode": run["tg_req_throughput"]["mean"], "peak": (run.get("peak_req_throughput") or {}).get("mean")}


def acceptance_around(client: VllmClient, action) -> tuple[Any, float | None]:
    before = snapshot(client, client.model)
    result = action()
    after = snapshot(client, client.model)
    stats = spec_decode_stats(before, after, after.generation_tokens - before.generation_tokens)
    return result, stats.acceptance_rate


def ingest_rate(tokens: int = 200_000, tokens_per_chunk: int = 1) -> float:
    """Tokens parsed per CPU-second by VllmClient.stream on a pre-rendered SSE stream served from loopback."""
    chunk = "data: " + json.dumps({"choices": [{"index": 0, "text": "x", "token_ids": [7] * tokens_per_chunk,
                                                "finish_reason": None}]}) + "\n\n"
    body = (chunk * (tokens // tokens_per_chunk) + "data: [DONE]\n\n").encode()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with VllmClient(Endpoint(f"http://127.0.0.1:{server.server_address[1]}", model="m")) as client:
            cpu_start = time.process_time()
            result = client.stream("completions", "x", tokens, 0.0)
            cpu_s = time.process_time() - cpu_start
        assert len(result.token_ids) == tokens and result.done
        return tokens / cpu_s
    finally:
        server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tg", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--pp", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--endpoint", help="a cpu-tiny draft-perturbed server already running (else one is started)")
    args = parser.parse_args()

    recipe = load_recipe("cpu-tiny")
    models_dir = default_cache_dir() / "tiny-models"
    ensure_models(recipe, models_dir)
    exe = ensure_llama_benchy()
    work = Path(tempfile.mkdtemp(prefix="b70-bench-"))
    servers = {} if args.endpoint else start_servers(["draft-perturbed"], models_dir, work / "logs")
    url = args.endpoint or servers["draft-perturbed"].url
    model = recipe.serve.served_model_name
    rows = []
    try:
        proxy = ProxyHandle(url, "\n".join(corpus_lines() * 20), work)
        direct = VllmClient(Endpoint(url, model=model, timeout_s=300))
        via_proxy = VllmClient(Endpoint(proxy.url, model=model, timeout_s=300))
        workload = Workload(name="bench", description="llama-benchy-shaped", prompts=["The server reads"],
                            prompt_tokens=args.pp, max_tokens=args.tg, temperature=0.0, warmup_requests=1,
                            min_requests=args.runs, max_requests=args.runs)
        bench_recipe = recipe.model_copy(update={"workloads": [workload]})

        proxy.take()
        result = run_throughput(via_proxy, bench_recipe, work / "raw")
        streams = proxy.take()[workload.warmup_requests:]  # the reference covers the measured requests only
        ours = result.workloads[0]
        rows.append(("b70ctl throughput (temperature 0)", ours.decode_tok_s.median,
                     statistics.median(reference_decode_rates(streams)), ours.spec_decode.acceptance_rate,
                     ours.spec_decode.acceptance_rate))

        for label, extra in (("llama-benchy (its defaults: no temperature)", []),
                             ("llama-benchy --extra-body temperature=0", ["temperature=0"])):
            proxy.take()
            figures, acceptance = acceptance_around(
                direct, lambda extra=extra: run_llama_benchy(exe, proxy, model, str(models_dir / "target"), args,
                                                             extra, work / "llama-benchy.json"))
            streams = [s for s in proxy.take() if len(s["chunks"]) > 1]
            measured = streams[-args.runs:] if len(streams) >= args.runs else streams
            rows.append((label, figures["decode"], statistics.median(reference_decode_rates(measured)),
                         None, acceptance))
    finally:
        if "proxy" in locals():
            proxy.stop()
        for server in servers.values():
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nvLLM CPU, cpu-tiny with draft_model k=4, concurrency 1, pp={args.pp} tg={args.tg}, {args.runs} runs")
    print(f"{'tool':46} {'decode tok/s':>12} {'reference':>10} {'rel.err':>8} {'acceptance':>11} {'ref.acc':>8}")
    for label, decode, reference, acceptance, reference_acceptance in rows:
        error = (decode - reference) / reference if decode and reference else float("nan")
        shown_acceptance = f"{acceptance:.3f}" if acceptance is not None else "n/a"
        shown_reference = f"{reference_acceptance:.3f}" if reference_acceptance is not None else "n/a"
        print(f"{label:46} {decode:12.1f} {reference:10.1f} {error:+8.1%} {shown_acceptance:>11} "
              f"{shown_reference:>8}")
    rate = ingest_rate()
    print(f"\nclient ingest: {rate:,.0f} tokens/s per CPU-second (1 token per chunk, loopback, one core)")


if __name__ == "__main__":
    main()
