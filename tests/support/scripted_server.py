"""A real HTTP server on 127.0.0.1 that speaks the slice of vLLM's OpenAI API verify uses, with scripted timing.

Streams are SSE over chunked transfer encoding like vLLM's (uvicorn), each chunk written at an exact offset from
the request's arrival and flushed at once (Nagle off), so tests know what a client should measure. Each prompt
can carry its own behaviour: a script of (offset, tokens per chunk), HTTP 500, a stream cut mid-way, a stall.
The server logs when every chunk actually left (time.perf_counter, the same clock as the client in this process).
/metrics exports vLLM's counters, advanced by every completion as the script says, and vLLM's per-request
histograms (the names and shapes of the real captures in tests/fixtures/metrics/) observed with the script's
own timing: the engine's truth. `delivery="burst"` holds every chunk back and writes them all at the end, as a
loaded API server or a proxy can, while the histograms still tell when the engine produced each token.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import httpx

from b70ctl.checks.client import Endpoint, VllmClient
from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import Claim, CorrectnessSettings, Recipe, Workload
from b70ctl.report.model import Report
from b70ctl.verify.pipeline import VerifyRequest, verify

Mode = Literal["ok", "http500", "cut", "stall"]
Delivery = Literal["on_time", "burst"]


@dataclass
class Script:
    """One streamed answer: the first chunk `ttft_s` after the request arrives, then chunk i at
    ttft_s + offsets_s[i], carrying tokens_per_chunk[i] token ids."""

    ttft_s: float
    offsets_s: list[float]
    tokens_per_chunk: list[int]
    mode: Mode = "ok"
    fail_after_chunks: int = 0  # cut / stall after this many chunks
    usage_delta: int = 0  # report usage.completion_tokens off by this much
    delivery: Delivery = "on_time"
    cached_prompt_tokens: int = 0  # what the engine reports as served from the prefix cache

    @property
    def token_count(self) -> int:
        return sum(self.tokens_per_chunk)

    @property
    def engine_decode_time_s(self) -> float:
        """First to last token as the engine produced them: what vLLM's request_decode_time_seconds observes."""
        return self.offsets_s[-1] - self.offsets_s[0] if self.offsets_s else 0.0


@dataclass
class SentStream:
    """What the server actually did for one streamed request."""

    prompt: Any
    arrival_s: float
    chunk_sent_s: list[float] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class SpecPerRequest:
    """How much each completion advances vLLM's spec-decode counters."""

    drafts: int = 10
    draft_tokens: int = 40
    accepted: int = 25
    accepted_per_position: tuple[int, ...] = (10, 8, 5, 2)
    extra_generation_tokens: int = 0  # tokens "another client" generated at the same time


FAST = Script(ttft_s=0.01, offsets_s=[0.0, 0.01, 0.02], tokens_per_chunk=[1, 3, 3])


class ScriptedServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, model: str = "scripted"):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.model = model
        self.scripts: dict[str, Script] = {}
        self.default_script = FAST
        self.metrics_mode: Literal["ok", "missing", "garbage"] = "ok"
        self.spec = SpecPerRequest()
        self.stop_event = threading.Event()
        self.sent: list[SentStream] = []
        self.requests: list[tuple[str, dict[str, Any]]] = []  # (path, body) of every POST
        self.authorizations: list[str | None] = []  # the Authorization header of every request
        self.speculates = True
        self.request_histograms = True  # False: a server that exports no per-request timing
        self.first_token_id = 100  # another value makes this server's greedy output differ from a default one
        # (prompt, token ids) -> the token ids a non-streamed answer carries: a server corrupting some answers
        self.alter: Callable[[Any, list[int]], list[int]] | None = None
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "generation": 0}
        # Histogram name -> [sum, count], observed once per finished request like vLLM's.
        self.histograms: dict[str, list[float]] = {name: [0.0, 0.0] for name in HISTOGRAMS}
        self.prompt_tokens_cached = 0
        self.accepted_per_position = [0] * len(self.spec.accepted_per_position)
        self.lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up on a cut or stalled stream is the point of the test, not an error

    def script_for(self, prompt: Any) -> Script:
        key = "ids" if isinstance(prompt, list) else str(prompt)
        return self.scripts.get(key, self.default_script)

    def record_request(self, script: Script, prompt_tokens: int, completion_tokens: int) -> None:
        """The engine's per-request observations (vLLM v1/metrics/stats.py update_from_finished_request)."""
        prefill_s = script.ttft_s * 0.9
        observed = {
            "vllm:request_decode_time_seconds": script.engine_decode_time_s,
            "vllm:request_prefill_time_seconds": prefill_s,
            "vllm:request_queue_time_seconds": script.ttft_s * 0.05,
            "vllm:time_to_first_token_seconds": script.ttft_s,
            "vllm:request_generation_tokens": float(completion_tokens),
            "vllm:request_prompt_tokens": float(prompt_tokens),
        }
        with self.lock:
            for name, value in observed.items():
                self.histograms[name][0] += value
                self.histograms[name][1] += 1
            steps = max(len(script.offsets_s) - 1, 0)  # one inter-token-latency observation per engine step
            self.histograms["vllm:inter_token_latency_seconds"][0] += script.engine_decode_time_s
            self.histograms["vllm:inter_token_latency_seconds"][1] += steps
            self.prompt_tokens_cached += script.cached_prompt_tokens

    def count_completion(self, completion_tokens: int) -> None:
        with self.lock:
            self.counters["generation"] += completion_tokens + self.spec.extra_generation_tokens
            if not self.speculates:
                return
            self.counters["drafts"] += self.spec.drafts
            self.counters["draft_tokens"] += self.spec.draft_tokens
            self.counters["accepted"] += self.spec.accepted
            for position, value in enumerate(self.spec.accepted_per_position):
                self.accepted_per_position[position] += value

    def metrics_text(self) -> str:
        labels = f'engine="0",model_name="{self.model}"'
        with self.lock:
            lines = []
            counters = [("vllm:generation_tokens_total", "generation")]
            if self.speculates:  # vLLM creates no spec_decode_* series without a speculative config
                counters += [("vllm:spec_decode_num_drafts_total", "drafts"),
                             ("vllm:spec_decode_num_draft_tokens_total", "draft_tokens"),
                             ("vllm:spec_decode_num_accepted_tokens_total", "accepted")]
            for name, key in counters:
                lines += [f"# TYPE {name} counter", f"{name}{{{labels}}} {float(self.counters[key])}"]
            lines += ["# TYPE vllm:prompt_tokens_cached_total counter",
                      f"vllm:prompt_tokens_cached_total{{{labels}}} {float(self.prompt_tokens_cached)}"]
            for name, (total, count) in (self.histograms.items() if self.request_histograms else ()):
                lines += [f"# TYPE {name} histogram", f"{name}_sum{{{labels}}} {total}",
                          f'{name}_bucket{{{labels},le="+Inf"}} {count}', f"{name}_count{{{labels}}} {count}"]
            if self.speculates:
                lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter")
                for position, value in enumerate(self.accepted_per_position):
                    lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{position}"}}'
                                 f" {float(value)}")
        return "\n".join(lines) + "\n"


HISTOGRAMS = ("vllm:request_decode_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_queue_time_seconds", "vllm:time_to_first_token_seconds",
              "vllm:request_generation_tokens", "vllm:request_prompt_tokens", "vllm:inter_token_latency_seconds")


def _tokenize(text: str) -> list[int]:
    """One token per character: trivially exact, which is all a synthesized prompt needs."""
    return [1000 + ord(character) % 500 for character in text]


class _Handler(BaseHTTPRequestHandler):
    server: ScriptedServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # -- plumbing --------------------------------------------------------------------------------------
    def _send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, status: int, text: str, content_type: str = "text/plain") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _model_error(self, model: Any) -> None:
        self._send_json(404, {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                                        "code": 404}})

    def _chunk(self, payload: str) -> None:
        data = payload.encode()
        self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    # -- routes ------------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self.server.authorizations.append(self.headers.get("Authorization"))
        if self.path == "/health":
            self._send_text(200, "")
        elif self.path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [{"id": self.server.model, "object": "model"}]})
        elif self.path == "/metrics":
            if self.server.metrics_mode == "missing":
                self._send_json(404, {"detail": "Not Found"})
            elif self.server.metrics_mode == "garbage":
                self._send_text(200, "<html><body>metrics moved</body></html>", "text/html")
            else:
                self._send_text(200, self.server.metrics_text())
        else:
            self._send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        arrival_s = time.perf_counter()
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.server.requests.append((self.path, body))
        self.server.authorizations.append(self.headers.get("Authorization"))
        if body.get("model") != self.server.model:
            self._model_error(body.get("model"))
            return
        if self.path == "/tokenize":
            self._send_json(200, {"tokens": _tokenize(body["prompt"]), "count": len(body["prompt"])})
            return
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._send_json(404, {"detail": "Not Found"})
            return
        chat = self.path == "/v1/chat/completions"
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        script = self.server.script_for(prompt)
        if script.mode == "http500":
            self._send_json(500, {"error": {"message": "EngineCore died", "type": "InternalServerError",
                                            "code": 500}})
            return
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(_tokenize(prompt))
        if body.get("stream"):
            self._stream(body, script, prompt, prompt_tokens, arrival_s, chat)
        else:
            self._complete(script, prompt_tokens, chat, prompt)

    def _token_ids(self, script: Script) -> list[list[int]]:
        next_id = self.server.first_token_id
        per_chunk = []
        for count in script.tokens_per_chunk:
            per_chunk.append(list(range(next_id, next_id + count)))
            next_id += count
        return per_chunk

    def _complete(self, script: Script, prompt_tokens: int, chat: bool, prompt: Any = None) -> None:
        token_ids = [token for chunk in self._token_ids(script) for token in chunk]
        if self.server.alter is not None:
            token_ids = self.server.alter(prompt, token_ids)
        text = "".join(f"t{token} " for token in token_ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "token_ids": token_ids}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        self.server.count_completion(len(token_ids))
        self.server.record_request(script, prompt_tokens, len(token_ids))
        self._send_json(200, {"choices": [choice], "usage": {"prompt_tokens": prompt_tokens,
                                                             "completion_tokens": len(token_ids),
                                                             "total_tokens": prompt_tokens + len(token_ids)}})

    def _stream(self, body: dict[str, Any], script: Script, prompt: Any, prompt_tokens: int, arrival_s: float,
                chat: bool) -> None:
        sent = SentStream(prompt=prompt, arrival_s=arrival_s)
        self.server.sent.append(sent)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        try:
            if chat:  # vLLM's first chat chunk: the role, no tokens
                self._chunk("data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                            + "\n\n")
            chunks = self._token_ids(script)
            held: list[str] = []  # burst delivery: every chunk written at once after the last is produced
            for index, (offset_s, token_ids) in enumerate(zip(script.offsets_s, chunks)):
                if script.mode in ("cut", "stall") and index == script.fail_after_chunks:
                    if script.mode == "stall":
                        self.server.stop_event.wait(30)
                    self.close_connection = True
                    return  # no terminating chunk: the client sees the body end mid-way
                delay_s = arrival_s + script.ttft_s + offset_s - time.perf_counter()
                if delay_s > 0:
                    time.sleep(delay_s)
                finish = "length" if index == len(chunks) - 1 else None
                text = "".join(f"t{token} " for token in token_ids)
                choice: dict[str, Any] = {"index": 0, "token_ids": token_ids, "finish_reason": finish}
                if chat:
                    choice["delta"] = {"content": text}
                else:
                    choice["text"] = text
                event = "data: " + json.dumps({"choices": [choice]}) + "\n\n"
                if script.delivery == "burst":
                    held.append(event)
                else:
                    self._chunk(event)
                    sent.chunk_sent_s.append(time.perf_counter())
                sent.token_ids.append(token_ids)
            # vLLM records a finished request in the step that ends its stream, before the client sees the end.
            self.server.count_completion(script.token_count)
            self.server.record_request(script, prompt_tokens, script.token_count)
            if held:
                self._chunk("".join(held))
                sent.chunk_sent_s += [time.perf_counter()] * len(held)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": script.token_count + script.usage_delta,
                     "total_tokens": prompt_tokens + script.token_count + script.usage_delta}
            if (body.get("stream_options") or {}).get("include_usage"):
                self._chunk("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n")
            self._chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


# --- what the tests that drive verify's checks against a ScriptedServer share ----------------------------------


def recipe_with(*workloads: Workload) -> Recipe:
    """cpu-tiny with these workloads only, served as "scripted" (the name ScriptedServer lists)."""
    base = load_recipe("cpu-tiny")
    serve = base.serve.model_copy(update={"served_model_name": "scripted"})
    return base.model_copy(update={"workloads": list(workloads), "serve": serve})


def workload(name: str, prompt: str, **overrides) -> Workload:
    settings = {"description": f"scripted {name}", "prompts": [prompt], "max_tokens": 64, "warmup_requests": 0,
                "min_requests": 1, "max_requests": 1, **overrides}
    return Workload(name=name, **settings)


def client_for(server: ScriptedServer, model: str | None = "scripted", timeout_s: float = 10.0,
               transport: httpx.BaseTransport | None = None) -> VllmClient:
    return VllmClient(Endpoint(server.url, model=model, timeout_s=timeout_s), transport=transport)


def scripted_recipe(*claims: Claim) -> Recipe:
    """Two workloads (3 short requests, 2 natural) and three correctness prompts: a verify run in seconds."""
    recipe = recipe_with(workload("short", "go", max_requests=3, min_requests=3),
                         workload("natural", "tell", max_requests=2, min_requests=2))
    return recipe.model_copy(update={
        "correctness": CorrectnessSettings(prompts=["a", "b", "c"], max_tokens=7),
        "claims": list(claims),
    })


SHORT_RATE = Claim(id="short-rate", description="short decode", metric="throughput.short.decode_tok_s.median",
                   op=">=", value=1.0, source="test")


def request_for(recipe: Recipe, served: ScriptedServer, baseline: ScriptedServer, out_dir: Path,
                **overrides: Any) -> VerifyRequest:
    """verify's request against a scripted server and its target-only baseline (the `servers` fixture's pair)."""
    return VerifyRequest(recipe=recipe, out_dir=out_dir, endpoint=Endpoint(served.url, model="scripted", timeout_s=5),
                         baseline_endpoint=Endpoint(baseline.url, model="scripted", timeout_s=5), **overrides)


def steady_script(tok_s: float) -> Script:
    """Nine tokens, one per chunk, the engine producing one every 1/tok_s seconds: (9 - 1) * tok_s / 8 = tok_s."""
    return Script(ttft_s=0.002, offsets_s=[index / tok_s for index in range(9)], tokens_per_chunk=[1] * 9)


def short_recipe(*claims: Claim, requests: int = 3) -> Recipe:
    """One workload of `requests` 33-token answers to "go", two correctness prompts: the engine-clock tests'."""
    base = recipe_with(workload("short", "go", max_tokens=33, max_requests=requests, min_requests=requests))
    return base.model_copy(update={"correctness": CorrectnessSettings(prompts=["ab", "cd"], max_tokens=7),
                                   "claims": list(claims)})


def verify_scripted(recipe: Recipe, served: ScriptedServer, baseline: ScriptedServer, out_dir: Path,
                    **overrides: Any) -> Report:
    """verify run to the end against a scripted server and its baseline (10 s per request)."""
    return verify(VerifyRequest(recipe=recipe, out_dir=out_dir,
                                endpoint=Endpoint(served.url, model="scripted", timeout_s=10),
                                baseline_endpoint=Endpoint(baseline.url, model="scripted", timeout_s=10),
                                **overrides))
