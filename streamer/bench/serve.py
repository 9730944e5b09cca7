"""`streamer bench serve`: open-loop load against a running server, over SSE.

Requests arrive as a Poisson process at --request-rate requests/s (inf: all
at once), whatever the server's pace (open loop); a comma-separated list of
rates runs one measurement per rate. Every request is a streamed
POST /v1/completions (stream_options.include_usage), timed on the client:

  TTFT  request sent -> first chunk with text
  TPOT  (last chunk - first chunk) / (completion tokens - 1), per request
  ITL   gap between two chunks with text (every gap of every request)
  E2E   request sent -> [DONE]

reported at p50 / p90 / p99 (and the mean), with throughput (requests/s,
output tokens/s), errors, and the prefix-cache hit rate: the delta of the
server's streamer_cached_prompt_tokens_total over streamer_prompt_tokens_total
in /metrics across the run (and, from the responses' usage, cached_tokens over
prompt_tokens).

Workloads (prompts are token ids drawn from --vocab-range unless said otherwise):
  random         input and output lengths uniform in --input-len / --output-len (N or MIN:MAX)
  shared-prefix  --groups groups of --prompts-per-group prompts; a group shares a --prefix-len prefix,
                 each prompt adds its own --question-len tokens; arrivals shuffled across groups
  W4             shared-prefix with the defaults: 32 groups x 16 prompts, 2,000 + 64 tokens, 128 out
  json-schema    text prompts asking for a record, constrained by response_format json_schema;
                 output ends when the JSON does (ignore_eos is not sent), capped by --output-len

Each rate point draws fresh prompts (seed + point index), so a sweep does not
hit the cache on the previous point's prefixes; the seed itself is fresh for
every invocation unless --seed is given (the server keeps a previous run's
prompts in its cache).

  streamer bench serve --base-url http://127.0.0.1:8000 --workload random --request-rate 1,2,4,inf \\
      --num-prompts 200 --input-len 128:512 --output-len 128 --json results.json

The workloads' prompts are built in serve_prompts.py; the summaries, the server's counters
and the printed table are in serve_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from streamer.bench.http import HTTPStatusError, StreamingClient
from streamer.bench.serve_prompts import Request, make_requests, request_body
from streamer.bench.serve_report import Result, print_table, scrape, server_view, summary_ms
from streamer.sse import DONE, aiter_lines, parse_line

# ---- one request ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""


async def send(client: StreamingClient, body: dict[str, Any], keep_text: bool) -> Outcome:
    o = Outcome()
    t0 = time.perf_counter()
    last: float | None = None
    text: list[str] = []
    done = False
    try:
        async with asyncio.timeout(client.timeout), \
                contextlib.aclosing(client.post_stream("/v1/completions", body)) as pieces:
            async for line in aiter_lines(pieces):
                chunk = parse_line(line)
                if chunk is None or done:
                    continue  # (read on to the end of the body: the connection is reused)
                if chunk == DONE:
                    done = True
                    continue
                assert isinstance(chunk, dict)
                if "error" in chunk:
                    o.error = f"error event: {chunk['error'].get('message', chunk['error'])}"[:300]
                    return o
                if chunk.get("usage"):
                    u = chunk["usage"]
                    o.prompt_tokens, o.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                    o.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for c in chunk.get("choices", []):
                    if c.get("text"):
                        now = time.perf_counter()
                        if last is None:
                            o.ttft = now - t0
                        else:
                            o.itl.append(now - last)
                        last = now
                        if keep_text:
                            text.append(c["text"])
                    o.finish_reason = c.get("finish_reason") or o.finish_reason
    except HTTPStatusError as e:
        o.error = str(e)
        return o
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
            KeyError) as e:
        o.error = f"{type(e).__name__}: {e}"[:300]
        return o
    finally:
        o.latency = time.perf_counter() - t0
    if not done:
        o.error = "the stream ended without [DONE]"
    elif o.finish_reason is None:
        o.error = "no finish_reason"
    else:
        o.ok = True
        o.text = "".join(text)
    return o


# ---- one rate point ------------------------------------------------------------------------------


class Progress:
    """One status line on stderr: live on a terminal, every 10 s in a log."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.sent = self.done = self.errors = 0
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()

    def line(self) -> str:
        return (f"{self.label}: sent {self.sent}/{self.total}, done {self.done}, errors {self.errors}, "
                f"in flight {self.sent - self.done}, {time.monotonic() - self.t0:6.1f}s")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0.5 if self.tty else 10.0)
            print(("\r" if self.tty else "") + self.line(), end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def finish(self) -> None:
        print(("\r" if self.tty else "") + self.line(), file=sys.stderr, flush=True)


async def run_point(client: Any, streams: StreamingClient, args: argparse.Namespace, rate: float, point: int,
                    model: str | None) -> Result:
    reqs = make_requests(args, args.seed + point)
    keep_text = args.workload == "json-schema"
    for i in range(args.warmup):  # a prompt of its own, so that it puts nothing the run could reuse in the cache
        await send(streams, request_body(args, Request(f"Warm-up {point}.{i}: say hello.", 8), model), False)
    label = f"rate {'inf' if math.isinf(rate) else f'{rate:g}'} req/s"
    prog = Progress(label, len(reqs))
    ticker = asyncio.create_task(prog.run())
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    arrivals = random.Random(args.seed + 1000 + point)
    before = await scrape(client)

    async def one(req: Request) -> Outcome:
        if sem is not None:
            async with sem:
                o = await send(streams, request_body(args, req, model), keep_text)
        else:
            o = await send(streams, request_body(args, req, model), keep_text)
        prog.done += 1
        prog.errors += not o.ok
        return o

    t0 = time.perf_counter()
    cpu0 = time.process_time()
    tasks = []
    next_at = t0
    for req in reqs:
        if not math.isinf(rate):
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            next_at += arrivals.expovariate(rate)
        tasks.append(asyncio.create_task(one(req)))
        prog.sent += 1
    outcomes: list[Outcome] = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    client_cpu = (time.process_time() - cpu0) / duration
    ticker.cancel()
    prog.finish()
    after = await scrape(client)

    ok = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    in_tokens = sum(o.prompt_tokens for o in ok)
    hit = None
    if before and after:
        prompt = after["streamer_prompt_tokens_total"] - before["streamer_prompt_tokens_total"]
        cached = after["streamer_cached_prompt_tokens_total"] - before["streamer_cached_prompt_tokens_total"]
        hit = cached / prompt if prompt > 0 else None
    res = Result(
        request_rate="inf" if math.isinf(rate) else rate, num_prompts=len(reqs), completed=len(ok),
        errors=len(outcomes) - len(ok), duration_s=duration, request_throughput=len(ok) / duration,
        output_throughput=out_tokens / duration, total_token_throughput=(in_tokens + out_tokens) / duration,
        input_tokens=in_tokens, output_tokens=out_tokens,
        ttft_ms=summary_ms([o.ttft for o in ok if o.ttft is not None]),
        tpot_ms=summary_ms([(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok
                            if o.ttft is not None and o.output_tokens > 1]),
        itl_ms=summary_ms([x for o in ok for x in o.itl]),
        e2e_ms=summary_ms([o.latency for o in ok]),
        cache_hit_rate=hit,
        cache_hit_rate_usage=sum(o.cached_tokens for o in ok) / in_tokens if in_tokens else None,
        max_concurrency=args.max_concurrency,
        error_samples=sorted({o.error for o in outcomes if o.error})[:5],
    )
    if before and after:
        res.extra.update(server_view(before, after))
    # this client is one Python process: near 1.0, its own parsing may hold the figures back
    res.extra["client_cpu_fraction"] = client_cpu
    if args.workload in ("shared-prefix", "W4"):
        # every prompt but the first of its group could take its whole prefix from the cache
        seen: set[tuple[int, ...]] = set()
        reused = 0
        for q in reqs:
            key = tuple(q.prompt[:args.prefix_len])
            reused += args.prefix_len if key in seen else 0
            seen.add(key)
        res.extra["optimal_hit_rate"] = reused / sum(len(q.prompt) for q in reqs)
    if keep_text:
        valid = 0
        for o in ok:
            try:
                json.loads(o.text)
                valid += 1
            except ValueError:
                pass
        res.extra["json_valid"] = valid
        res.extra["json_valid_fraction"] = valid / len(ok) if ok else None
    return res


# ---- CLI -------------------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the running server")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--model", default=None, help="model name to send (default: none, the server's model)")
    p.add_argument("--workload", default="random", choices=["random", "shared-prefix", "W4", "json-schema"],
                   help="the prompts (see above; default random)")
    p.add_argument("--request-rate", default="inf",
                   help="Poisson arrival rate in requests/s; a comma list sweeps (1,2,4,inf); inf: all at once")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per rate point (default 200; shared-prefix / W4: groups x prompts-per-group)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    p.add_argument("--input-len", default="128:512", help="random: prompt tokens, N or MIN:MAX (default 128:512)")
    p.add_argument("--output-len", default="128", help="max_tokens, N or MIN:MAX (default 128)")
    p.add_argument("--groups", type=int, default=32, help="shared-prefix: prefix groups (default 32)")
    p.add_argument("--prompts-per-group", type=int, default=16, help="shared-prefix: prompts per group (default 16)")
    p.add_argument("--prefix-len", type=int, default=2000, help="shared-prefix: shared tokens (default 2000)")
    p.add_argument("--question-len", type=int, default=64, help="shared-prefix: distinct tokens (default 64)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_tokens (default on; not sent for json-schema)")
    p.add_argument("--temperature", type=float, default=0.0, help="sent with every request (default 0)")
    p.add_argument("--vocab-range", default="1000:30000",
                   help="token ids of generated prompts, MIN:MAX (default 1000:30000: valid and not special "
                        "in every supported vocabulary)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of prompts, lengths and arrivals (default: a fresh one, printed and saved; the "
                        "server's prefix cache keeps a previous run's prompts, so the same seed twice hits it)")
    p.add_argument("--warmup", type=int, default=1, help="short unmeasured requests before each point (default 1)")
    p.add_argument("--timeout", type=float, default=1800, help="per-request timeout in seconds")
    p.add_argument("--json", default=None, help="write the config and results here")


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        rate = math.inf if part in ("inf", "infinity") else float(part)
        if not rate > 0:
            raise SystemExit(f"request rates must be > 0, got {part!r}")
        rates.append(rate)
    return rates


async def amain(args: argparse.Namespace) -> list[Result]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or None, max_keepalive_connections=64)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, timeout=timeout,
                                 limits=limits) as client:
        try:
            r = await client.get("/v1/models")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise SystemExit(f"cannot reach the server at {args.base_url}: {e}") from None
        card = r.json()["data"][0]
        longest = max(len(q.prompt) + q.max_tokens for q in make_requests(args, args.seed)
                      if isinstance(q.prompt, list)) if args.workload != "json-schema" else 0
        if longest > card.get("max_model_len", longest):
            raise SystemExit(f"prompt + output up to {longest} tokens; the server's context is {card['max_model_len']}")
        print(f"bench serve: {args.workload} against {card['id']!r} at {args.base_url} (seed {args.seed})",
              file=sys.stderr)
        results = []
        streams = StreamingClient(args.base_url, headers, timeout=args.timeout)
        try:
            for point, rate in enumerate(parse_rates(args.request_rate)):
                res = await run_point(client, streams, args, rate, point, args.model)
                results.append(res)
                if args.json:
                    write_json(args, results)
        finally:
            await streams.aclose()
        return results


def write_json(args: argparse.Namespace, results: list[Result]) -> None:
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key") and not callable(v)}
    Path(args.json).write_text(json.dumps({"config": config, "results": [asdict(r) for r in results]}, indent=2))


def main(args: argparse.Namespace) -> None:
    results = asyncio.run(amain(args))
    print_table(results)
    if args.json:
        print(f"results written to {args.json}")
