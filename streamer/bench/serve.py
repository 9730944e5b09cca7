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
from streamer.sse import DONE, aiter_lines, parse_line

JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Lagos", "Lima", "Osaka", "Oslo", "Quito", "Hanoi", "Perth", "Cairo", "Toronto", "Porto", "Pune"]


# ---- workloads -----------------------------------------------------------------------------


@dataclass
class Request:
    prompt: list[int] | str
    max_tokens: int


def span(text: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' -> (min, max)."""
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise SystemExit(f"bad length range {text!r}: want N or MIN:MAX with 1 <= MIN <= MAX")
    return a, b


def make_requests(args: argparse.Namespace, seed: int) -> list[Request]:
    rng = random.Random(seed)
    vlo, vhi = span(args.vocab_range)
    olo, ohi = span(args.output_len)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vlo, vhi) for _ in range(n)]

    if args.workload == "random":
        ilo, ihi = span(args.input_len)
        out = []
        for _ in range(args.num_prompts or 200):
            p = ids(rng.randint(ilo, ihi))
            out.append(Request(p, rng.randint(olo, ohi)))
        return out
    if args.workload in ("shared-prefix", "W4"):
        out = []
        for _ in range(args.groups):
            prefix = ids(args.prefix_len)
            for _ in range(args.prompts_per_group):
                p = prefix + ids(args.question_len)
                out.append(Request(p, rng.randint(olo, ohi)))
        rng.shuffle(out)
        if args.num_prompts:
            out = [out[i % len(out)] for i in range(args.num_prompts)]
        return out
    if args.workload == "json-schema":
        out = []
        for i in range(args.num_prompts or 200):
            city = rng.choice(CITIES)
            text = (f"Invent a person #{i} who lives in {city}. Reply with a JSON object with the fields "
                    f"name, age, city and hobbies (at most three).\nJSON: ")
            out.append(Request(text, rng.randint(olo, ohi)))
        return out
    raise SystemExit(f"unknown workload {args.workload!r}")


def request_body(args: argparse.Namespace, req: Request, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if args.workload == "json-schema":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "person", "schema": JSON_SCHEMA, "strict": True}}
    elif args.ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    return body


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


SCRAPED = (
    "streamer_cached_prompt_tokens_total", "streamer_prompt_tokens_total", "streamer_engine_steps_total",
    "streamer_time_to_first_token_seconds_sum", "streamer_time_to_first_token_seconds_count",
    "streamer_request_queue_time_seconds_sum", "streamer_request_queue_time_seconds_count",
    "streamer_steps_held_total", "streamer_held_steps_joined_total", "streamer_held_steps_late_total",
    "streamer_device_busy_seconds_total", "streamer_device_idle_seconds_total",
)


async def scrape(client: Any) -> dict[str, float] | None:
    """The server's counters: cache hit rate, steps, and its own view of TTFT and queueing
    (None when /metrics cannot be read)."""
    try:
        r = await client.get("/metrics")
        r.raise_for_status()
    except Exception:  # noqa: BLE001 - the hit rate is then reported as unknown
        return None
    out = {}
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name in SCRAPED:
            out[name] = float(value)
    return out if "streamer_prompt_tokens_total" in out else None


def server_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Means over one rate point, from the differences of the server's counters: where the
    client's TTFT goes (server TTFT = submit to first token; queue = wait for a first batch)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    out: dict[str, float] = {}
    for key, name in (("server_ttft_mean_ms", "streamer_time_to_first_token_seconds"),
                      ("server_queue_mean_ms", "streamer_request_queue_time_seconds")):
        if d.get(name + "_count"):
            out[key] = 1e3 * d[name + "_sum"] / d[name + "_count"]
    for key, name in (("server_steps", "streamer_engine_steps_total"), ("steps_held", "streamer_steps_held_total"),
                      ("held_joined", "streamer_held_steps_joined_total"),
                      ("held_late", "streamer_held_steps_late_total")):
        if name in d:
            out[key] = d[name]
    busy, idle = d.get("streamer_device_busy_seconds_total"), d.get("streamer_device_idle_seconds_total")
    if busy is not None and idle is not None:
        out["device_busy_s"], out["device_idle_s"] = busy, idle
    return out


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": 1e3 * sum(values) / len(values), "p50": 1e3 * pct(values, 50), "p90": 1e3 * pct(values, 90),
            "p99": 1e3 * pct(values, 99)}


@dataclass
class Result:
    request_rate: float | str
    num_prompts: int
    completed: int
    errors: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    input_tokens: int
    output_tokens: int
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    cache_hit_rate: float | None
    cache_hit_rate_usage: float | None
    max_concurrency: int | None
    error_samples: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


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
    p.add_argument("--workload", default="random", choices=["random", "shared-prefix", "W4", "json-schema"])
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
    p.add_argument("--temperature", type=float, default=0.0)
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


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: list[Result]) -> None:
    head = (f"{'rate':>6} {'reqs':>5} {'ok':>5} {'err':>4} {'req/s':>6} {'out tok/s':>9} "
            f"{'TTFT p50/p90/p99 ms':>21} {'TPOT p50/p90/p99 ms':>21} {'ITL p50/p90/p99 ms':>21} {'hit%':>5}")
    print(head)
    print("-" * len(head))
    for r in results:
        def three(d: dict[str, float | None]) -> str:
            return "/".join(fmt(d[k]) for k in ("p50", "p90", "p99"))

        rate = r.request_rate if isinstance(r.request_rate, str) else f"{r.request_rate:g}"
        hit = None if r.cache_hit_rate is None else 100 * r.cache_hit_rate
        print(f"{rate:>6} {r.num_prompts:5d} {r.completed:5d} {r.errors:4d} {r.request_throughput:6.2f} "
              f"{r.output_throughput:9.1f} {three(r.ttft_ms):>21} {three(r.tpot_ms):>21} {three(r.itl_ms):>21} "
              f"{fmt(hit, '.1f'):>5}")
    for r in results:
        for e in r.error_samples:
            print(f"  error at rate {r.request_rate}: {e}")
        if r.extra:
            print(f"  rate {r.request_rate}: " + ", ".join(f"{k} {fmt(v, '.3g') if isinstance(v, float) else v}"
                                                          for k, v in r.extra.items()))


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
