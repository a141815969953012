"""HTTP client for a vLLM OpenAI-compatible server, measuring what a user would see.

Streaming requests record every SSE chunk with its arrival time (monotonic clock) and its token ids: with
speculative decoding one chunk carries several tokens, so anything that counts chunks instead of token ids
under-reports (docs/facts.md, Measuring). Requests always ask for `return_token_ids` and usage in the stream.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpcore
import httpx

from b70ctl.errors import CheckAborted

Api = Literal["completions", "chat"]
DEFAULT_MAX_ANSWER_BYTES = 64 * 2**20
# The slowest decode a request is given time for: its total deadline is --timeout plus max_tokens at this rate. A
# B70 decodes tens of tokens per second and vLLM on two CPU cores ~60 (docs/facts.md); a server below 1 tok/s,
# or one that trickles bytes or sends `: ping` comments and no token, is not serving the request.
FLOOR_DECODE_TOK_S = 1.0


def request_deadline_s(timeout_s: float, max_tokens: int | None) -> float:
    """Seconds one request may take in all: the stall limit, plus max_tokens at the floor rate."""
    return timeout_s + (max_tokens or 0) / FLOOR_DECODE_TOK_S


class RunDeadlineExceeded(CheckAborted):
    """The run's --deadline passed: the run ends with the report marked partial, naming the deadline."""

    def __init__(self, deadline_s: float):
        super().__init__(f"the run's deadline of {deadline_s:g} s passed")
        self.deadline_s = deadline_s


class RequestDeadlineExceeded(Exception):
    pass


class MalformedEvent(Exception):
    """A stream event that is not the OpenAI shape: the request is unusable, the run goes on."""


class EndpointError(Exception):
    """The server could not be reached or answered with an error. `reason` is one line for the report;
    `answered` tells a server that answered (wrongly) from one that could not be reached."""

    def __init__(self, reason: str, status_code: int | None = None, answered: bool | None = None):
        super().__init__(reason)
        self.reason = reason
        self.status_code = status_code
        self.answered = status_code is not None if answered is None else answered


@dataclass
class Chunk:
    t_s: float  # seconds since the request was sent
    token_ids: list[int]
    text: str


@dataclass
class StreamResult:
    chunks: list[Chunk] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    done: bool = False  # the [DONE] sentinel arrived
    finish_reason: str | None = None
    error: str | None = None  # why the stream ended early (cut, stalled, HTTP error)
    prompt_token_ids: list[int] | None = None

    @property
    def token_ids(self) -> list[int]:
        return [token for chunk in self.chunks for token in chunk.token_ids]

    @property
    def text(self) -> str:
        return "".join(chunk.text for chunk in self.chunks)

    def raw(self) -> dict[str, Any]:
        """What goes to raw/: enough to recompute every figure."""
        return {
            "chunks": [{"t_s": c.t_s, "token_ids": c.token_ids, "text": c.text} for c in self.chunks],
            "usage": self.usage,
            "done": self.done,
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # e.g. http://127.0.0.1:8000 (no /v1)
    model: str | None = None  # served model name; discovered from /v1/models when None
    api_key: str | None = field(default=None, repr=False)  # never printed
    timeout_s: float = 60.0  # connect and between two chunks: a stream that stalls longer fails
    # user and password taken out of the URL (http://user:pw@host): sent as basic auth, never printed
    basic_auth: tuple[str, str] | None = field(default=None, repr=False)
    # Most bytes read from one answer: a server (or whatever answers at the URL) sending hundreds of MB must not
    # grow raw/ and memory without bound. Answers of vLLM to verify's requests are far below it.
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES


class AnswerTooLarge(Exception):
    pass


class UnreadableEncoding(AnswerTooLarge):
    """The answer comes in a content coding b70ctl does not decode: as unusable as one too large to read."""


# Content codings an answer may arrive in (httpx asks for them), each undone by zlib: "gzip" and "deflate" (RFC 9110
# 8.4.1; "deflate" is the zlib format, though some servers send it raw). Each coding costs a decoder's window in
# memory, and a server saves no bytes compressing twice: more codings than this on one body are refused.
_ZLIB_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
MAX_CONTENT_CODINGS = 2
# The most bytes one step of decompression may produce: memory holds at most this much beyond --max-answer-mb.
_INFLATE_PIECE_BYTES = 2**16


def _decoded(response: httpx.Response) -> Iterator[bytes]:
    """The answer's body as it arrives, its content coding undone a bounded piece at a time. httpx's own decoding
    turns each received piece into all it expands to at once (one gzip piece of a few kB can hold gigabytes), so
    the byte limit, counted after decoding, came too late."""
    if response.is_stream_consumed:  # a transport that hands the whole body (a test's): httpx has decoded it
        return response.iter_bytes()
    codings = [coding.strip().lower() for coding in response.headers.get("content-encoding", "").split(",")]
    codings = [coding for coding in codings if coding and coding != "identity"]
    listed = ", ".join(codings)
    if len(codings) > MAX_CONTENT_CODINGS:
        raise UnreadableEncoding(f"the answer is compressed {len(codings)} times (Content-Encoding: {listed[:80]}): "
                                 "no server saves bytes that way; read no further")
    parts: Iterator[bytes] = response.iter_raw()
    for coding in reversed(codings):
        wbits = _ZLIB_WBITS.get(coding)
        if wbits is None:
            raise UnreadableEncoding(f"the answer is compressed as {coding[:40]!r}, which b70ctl does not read: "
                                     "serve it uncompressed, gzip or deflate")
        parts = _inflated(parts, wbits, coding)
    return parts


def _inflated(parts: Iterator[bytes], wbits: int, coding: str) -> Iterator[bytes]:
    inflater, produced = zlib.decompressobj(wbits), False
    for part in parts:
        pending = part
        while pending and not inflater.eof:
            try:
                piece = inflater.decompress(pending, _INFLATE_PIECE_BYTES)
            except zlib.error as error:
                if coding == "deflate" and not produced and wbits > 0:  # raw deflate, as some servers send it
                    inflater, wbits = zlib.decompressobj(-zlib.MAX_WBITS), -zlib.MAX_WBITS
                    continue
                raise UnreadableEncoding(f"the answer is not valid {coding} ({error})") from error
            pending = inflater.unconsumed_tail
            if piece:
                produced = True
                yield piece


def _read(response: httpx.Response, content: bytes) -> httpx.Response:
    """The answer with its body read and decoded: it no longer names a content coding, which httpx would undo a
    second time."""
    headers = httpx.Headers(response.headers)
    headers.pop("content-encoding", None)
    return httpx.Response(response.status_code, headers=headers, content=content, request=response.request)


def _drop_overrun(http: httpx.Client) -> int:
    """Bytes a server sent past the end of an answer (its Content-Length, or a chunked body's last chunk), with
    every connection holding such bytes closed. h11 keeps them as the start of the connection's next answer and
    httpcore reuses the connection: the next request would be answered by them (by an answer the server forged in
    them, or by the rest of a body, the connection then one answer behind). They are in the parser's buffer, not in
    the socket, so httpcore's own check for a readable idle connection misses them. An idle connection of another
    shape than this httpcore's (no h11 parser found) is closed too: slower, never answered out of turn. Returns the
    bytes found."""
    overrun = 0
    for transport in (http._transport, *http._mounts.values()):
        pool = getattr(transport, "_pool", None)
        if not isinstance(pool, httpcore.ConnectionPool):  # a test's transport: no connections
            continue
        for connection in pool.connections:
            if not connection.is_idle():
                continue
            parser: Any = connection
            while not hasattr(parser, "_h11_state") and hasattr(parser, "_connection"):  # down to the HTTP/1.1 one
                parser = parser._connection
            leftover = getattr(getattr(parser, "_h11_state", None), "trailing_data", None)
            if isinstance(leftover, tuple) and leftover and isinstance(leftover[0], (bytes, bytearray)):
                if not leftover[0]:
                    continue
                overrun += len(leftover[0])
            connection.close()
    return overrun


def _overrun_text(overrun: int) -> str:
    return (f"the server sent {overrun} bytes past the end of its answer (beyond its Content-Length or last chunk): "
            "not a valid HTTP answer; its connection is closed so no other answer is read from them")


class VllmClient:
    def __init__(self, endpoint: Endpoint, transport: httpx.BaseTransport | None = None):
        self.endpoint = endpoint
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        self._http = httpx.Client(
            base_url=endpoint.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(endpoint.timeout_s),
            transport=transport,
            auth=httpx.BasicAuth(*endpoint.basic_auth) if endpoint.basic_auth and not endpoint.api_key else None,
        )
        self._model = endpoint.model
        # time.monotonic() past which the run is over (verify --deadline); None: no run deadline.
        self.run_deadline_at: float | None = None
        self.run_deadline_s: float = math.inf

    def _deadline_at(self, max_tokens: int | None) -> float:
        """When this request must have ended: its own deadline, or the run's when that comes first."""
        own = time.monotonic() + request_deadline_s(self.endpoint.timeout_s, max_tokens)
        return own if self.run_deadline_at is None else min(own, self.run_deadline_at)

    def _check_deadline(self, deadline_at: float, what: str) -> None:
        if time.monotonic() < deadline_at:
            return
        if self.run_deadline_at is not None and deadline_at >= self.run_deadline_at:
            raise RunDeadlineExceeded(self.run_deadline_s)
        raise RequestDeadlineExceeded(f"{what} took longer than its deadline (--timeout {self.endpoint.timeout_s:g} "
                                      f"s plus max_tokens at {FLOOR_DECODE_TOK_S:g} tok/s): the server trickles "
                                      "or never ends the answer")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VllmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plain requests -------------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One plain request, its answer read up to the endpoint's byte limit and within its deadline."""
        body = kwargs.get("json")
        max_tokens = body.get("max_tokens") if isinstance(body, dict) else None
        deadline_at = self._deadline_at(max_tokens if isinstance(max_tokens, int) else None)
        self._check_deadline(deadline_at, f"{method} {path}")
        _drop_overrun(self._http)  # whatever way the last answer ended, none is read from its leftovers
        try:
            with self._http.stream(method, path, **kwargs) as response:
                content = b"".join(self._capped(_decoded(response), deadline_at, f"{method} {path}"))
                answer = _read(response, content)
        except AnswerTooLarge as error:  # the server answered: with more than can be read, or in no known coding
            raise EndpointError(f"{method} {path}: {error}", answered=True) from error
        except RequestDeadlineExceeded as error:
            raise EndpointError(f"{method} {path}: {error}") from error
        except httpx.HTTPError as error:
            raise EndpointError(f"{method} {path}: {_describe(error)}") from error
        # More bytes than the answer declared: what was read is cut short of what the server sent, and the rest
        # would have been taken for the next answer.
        if overrun := _drop_overrun(self._http):
            raise EndpointError(f"{method} {path}: {_overrun_text(overrun)}", answered=True)
        return answer

    def _capped(self, parts: Iterator[bytes], deadline_at: float = math.inf, what: str = "the answer"
                ) -> Iterator[bytes]:
        limit, received = self.endpoint.max_answer_bytes, 0
        for part in parts:
            self._check_deadline(deadline_at, what)  # a byte every few seconds never trips --timeout
            received += len(part)
            if received > limit:
                raise AnswerTooLarge(f"the answer is larger than {limit / 2**20:g} MiB: read no further "
                                     "(--max-answer-mb raises the limit)")
            yield part

    def _lines(self, response: httpx.Response, deadline_at: float = math.inf) -> Iterator[str]:
        """The answer's lines as they arrive, within the byte limit (a line never grows past it either) and the
        deadline (comment lines such as `: ping` count toward it). Each byte is looked at once: the unfinished
        line's pieces are kept, not copied again with every new piece (a line of 64 MiB without a line end cost
        21 s of CPU when they were)."""
        pending: list[bytes] = []
        for part in self._capped(_decoded(response), deadline_at, "the stream"):
            start = 0
            while (end := part.find(b"\n", start)) >= 0:
                line = b"".join([*pending, part[start:end]])
                pending = []
                start = end + 1
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
            if start < len(part):
                pending.append(part[start:])
        if pending:
            yield b"".join(pending).decode("utf-8", errors="replace")

    def get(self, path: str) -> httpx.Response:
        return self._request("GET", path)

    def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self._request("POST", path, json=body)
        if response.status_code != 200:
            raise EndpointError(f"POST {path}: {_status_text(response)}", response.status_code)
        try:
            answer = response.json()
        except json.JSONDecodeError as error:
            raise EndpointError(f"POST {path}: answer is not JSON") from error
        except (RecursionError, ValueError) as error:  # nested too deep, a 5,000-digit integer
            raise EndpointError(f"POST {path}: the answer holds {_json_problem(error)}", 200) from error
        if not isinstance(answer, dict):
            raise EndpointError(f"POST {path}: the answer is a JSON {type(answer).__name__}, not an object", 200)
        return answer

    @property
    def model(self) -> str:
        """The served model name: the one asked for, else the first /v1/models lists."""
        if self._model is None:
            self._model = self.models()[0]
        return self._model

    def models(self) -> list[str]:
        response = self.get("/v1/models")
        if response.status_code in (401, 403):
            raise EndpointError(f"GET /v1/models: HTTP {response.status_code}: {self._refused()}",
                                response.status_code)
        if response.status_code == 404 and self.endpoint.base_url.rstrip("/").endswith("/v1"):
            raise EndpointError("GET /v1/models: HTTP 404: the URL ends in /v1 and b70ctl adds /v1 itself: drop the "
                                "/v1 from the URL", response.status_code)
        if response.status_code != 200:
            raise EndpointError(f"GET /v1/models: {_status_text(response)}", response.status_code)
        not_vllm = "not vLLM's model list: check that the URL and port are the vLLM server's"
        try:
            answer = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            kind = response.headers.get("content-type", "no content type").split(";")[0]
            raise EndpointError(f"GET /v1/models: the answer is not JSON ({kind}), {not_vllm}", 200) from error
        except (RecursionError, ValueError) as error:
            raise EndpointError(f"GET /v1/models: the answer holds {_json_problem(error)}, {not_vllm}", 200) \
                from error
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(answer, dict):
            raise EndpointError(f"GET /v1/models: the answer is a JSON {type(answer).__name__}, {not_vllm}", 200)
        if not isinstance(data, list):
            raise EndpointError(f"GET /v1/models: the answer has no data list, {not_vllm}", 200)
        names = [entry.get("id") if isinstance(entry, dict) else None for entry in data]
        if any(not isinstance(name, str) or not name for name in names):
            raise EndpointError(f"GET /v1/models: a model entry has no id string, {not_vllm}", 200)
        if not names:
            raise EndpointError("GET /v1/models: the server lists no model", 200)
        return [str(name) for name in names]

    def _refused(self) -> str:
        if self.endpoint.api_key:
            return "the server refused the API key: check --api-key-file or B70CTL_API_KEY"
        if self.endpoint.basic_auth:
            return "the server refused the user and password in the URL: give the key with --api-key-file"
        return "the server needs an API key: give it with --api-key-file or B70CTL_API_KEY"

    def metrics_text(self) -> str:
        response = self.get("/metrics")
        if response.status_code != 200:
            raise EndpointError(f"GET /metrics: {_status_text(response)}", response.status_code)
        return response.text

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` as the server's tokenizer sees it (vLLM's /tokenize), no special tokens."""
        answer = self.post_json("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        tokens = answer.get("tokens")
        if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise EndpointError("POST /tokenize: the answer has no tokens list of integers: not vLLM's /tokenize",
                                200)
        return tokens

    def detokenize(self, token_ids: list[int]) -> str:
        return str(self.post_json("/detokenize", {"model": self.model, "tokens": token_ids})["prompt"])

    def request_body(self, api: Api, prompt: str | list[int], max_tokens: int, temperature: float,
                     ignore_eos: bool = False, stream: bool = False) -> dict[str, Any]:
        """The one place a generation request is shaped: temperature always explicit, token ids asked for."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
        }
        if api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def complete(self, api: Api, prompt: str | list[int], max_tokens: int, temperature: float = 0.0,
                 ignore_eos: bool = False) -> dict[str, Any]:
        """A non-streamed completion or chat completion. Returns the server's JSON answer."""
        path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
        return self.post_json(path, self.request_body(api, prompt, max_tokens, temperature, ignore_eos))

    # -- streaming ----------------------------------------------------------------------------------
    def stream(self, api: Api, prompt: str | list[int], max_tokens: int, temperature: float = 0.0,
               ignore_eos: bool = False) -> StreamResult:
        """A streamed request, every chunk timed. Never raises for what happens mid-stream: a cut or stalled
        stream comes back with `error` set and the chunks received so far."""
        path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
        body = self.request_body(api, prompt, max_tokens, temperature, ignore_eos, stream=True)
        result = StreamResult()
        deadline_at = self._deadline_at(max_tokens)
        self._check_deadline(deadline_at, "the stream")
        _drop_overrun(self._http)  # whatever way the last answer ended, none is read from its leftovers
        start = time.perf_counter()
        try:
            with self._http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    try:
                        content = b"".join(self._capped(_decoded(response)))
                    except AnswerTooLarge:
                        content = b""
                    result.error = _status_text(_read(response, content))
                    return result  # the next request's check closes a connection this answer overran
                for line in self._lines(response, deadline_at):
                    now = time.perf_counter() - start
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        result.done = True
                        break
                    _ingest(result, json.loads(payload, parse_constant=_no_constant), now)
        except AnswerTooLarge as error:
            result.error = f"stream cut: {error}"
        except RequestDeadlineExceeded as error:
            result.error = f"stream cut: {error}"
        except MalformedEvent as error:
            result.error = f"malformed stream event: {error}: the request is unusable"
        except json.JSONDecodeError:
            result.error = "stream cut: a chunk was not valid JSON"
        except (RecursionError, ValueError) as error:  # nesting deeper than Python parses, a 5,000-digit number
            result.error = f"malformed stream event: {_json_problem(error)}: the request is unusable"
        except httpx.ReadTimeout:
            result.error = f"stream stalled: no data for {self.endpoint.timeout_s:g} s"
        except httpx.HTTPError as error:
            result.error = f"stream cut: {_describe(error)}"
        if (overrun := _drop_overrun(self._http)) and result.error is None:
            result.error = f"stream cut: {_overrun_text(overrun)}"
        if result.error is None and not result.done:
            result.error = "stream ended without [DONE]"
        return result


def _no_constant(name: str) -> float:
    raise MalformedEvent(f"a {name} where a number belongs")


def _json_problem(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "JSON nested deeper than can be read"
    return f"a value that cannot be read ({str(error).split(':')[0][:80]})"


def _ingest(result: StreamResult, event: Any, t_s: float) -> None:
    """One event into the result; MalformedEvent for an event that is not the OpenAI shape."""
    if not isinstance(event, dict):
        raise MalformedEvent(f"a JSON {type(event).__name__}, not an object")
    choices = event.get("choices")
    if choices is not None and not isinstance(choices, list):
        raise MalformedEvent(f"choices is a JSON {type(choices).__name__}, not a list")
    usage = event.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise MalformedEvent(f"usage is a JSON {type(usage).__name__}, not an object")
    if usage:
        for key in ("prompt_tokens", "completion_tokens"):
            count = usage.get(key)
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
                raise MalformedEvent(f"usage.{key} is {str(count)[:40]!r}, not a count of tokens")
        result.usage = usage
    if "error" in event and not choices:
        result.error = f"server error in stream: {str(event['error'])[:200]}"
        return
    for choice in choices or []:
        if not isinstance(choice, dict):
            raise MalformedEvent(f"a choice is a JSON {type(choice).__name__}, not an object")
        raw_ids = choice.get("token_ids") or []
        if not isinstance(raw_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in raw_ids):
            raise MalformedEvent("token_ids is not a list of integers")
        token_ids = list(raw_ids)
        delta = choice.get("delta")
        text = (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
        if not isinstance(text, str):
            raise MalformedEvent(f"the text is a JSON {type(text).__name__}, not a string")
        if token_ids or text:
            result.chunks.append(Chunk(t_s=t_s, token_ids=token_ids, text=text))
        if choice.get("finish_reason"):
            result.finish_reason = str(choice["finish_reason"])[:80]
    prompt_ids = event.get("prompt_token_ids")
    if prompt_ids and result.prompt_token_ids is None:
        if not isinstance(prompt_ids, list):
            raise MalformedEvent("prompt_token_ids is not a list")
        result.prompt_token_ids = list(prompt_ids)


def _describe(error: httpx.HTTPError) -> str:
    """Never the error's own text: a protocol error quotes the request's headers, the API key among them."""
    if isinstance(error, httpx.ConnectError):
        return "connection refused or host unreachable"
    if isinstance(error, httpx.TimeoutException):
        return "timed out"
    if isinstance(error, httpx.RemoteProtocolError):
        return "the server hung up or broke the HTTP protocol (RemoteProtocolError)"
    if isinstance(error, (httpx.ReadError, httpx.WriteError)):
        return f"the connection was reset or closed mid-answer ({error.__class__.__name__})"
    return f"the request failed ({error.__class__.__name__})"


def _status_text(response: httpx.Response) -> str:
    """`HTTP <status>: ` and what the answer says: its error message, or for a redirect where it leads (b70ctl
    follows none: the URL given is the server checked)."""
    status = response.status_code
    if 300 <= status < 400:
        location = response.headers.get("location")
        if not location:
            return f"HTTP {status}: a redirect without a Location header: not a vLLM server's answer"
        return f"HTTP {status}: redirects to {location[:200]}: give the server's own URL"
    return f"HTTP {status}: {_error_text(response)}"


def _error_text(response: httpx.Response) -> str:
    try:
        message = response.json().get("error", response.text)
        if isinstance(message, dict):
            message = message.get("message", message)
        return str(message)[:200]
    except (ValueError, RecursionError, AttributeError):  # not JSON, nested too deep, a 5,000-digit number
        return response.text[:200]
