"""Where a served request's time to first token goes, stage by stage.

Runs `streamer serve` in this process with timestamps hooked onto the stages a request
passes (nothing in the package changes), and a streaming client in a second process;
both read the same monotonic clock (time.perf_counter is CLOCK_MONOTONIC on Linux), so
the client's send and receive times line up with the server's stages.

    python3 benchmarks/ttft_trace.py --model DIR --load-format dummy [--background 2] [-n 40]

Stages (per probe request, mean and p50 in ms):
  http_in    client sends            -> the completions handler starts
  parse      handler starts          -> the request is submitted to the engine
  tokenize   submitted               -> the tokenizer actor hands it on
  queue      tokenized               -> a batch containing it is built
  compute    in a batch              -> the scheduler has its first token (device time + waits)
  detok      first token             -> the handler has the first output
  sse        first output            -> its SSE event is produced
  http_out   SSE event produced      -> the client has parsed it
`--background N` keeps N long generations running, so probes meet decode steps in flight
(as in W5 at low request rates).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STAGES = ["t_send", "t_in", "t_submit", "t_tok", "t_sched", "t_token", "t_out", "t_sse", "t_recv"]
NAMES = ["http_in", "parse", "tokenize", "queue", "compute", "detok", "sse", "http_out"]


def hook_server(marks: dict[str, dict[str, float]]) -> None:
    """Wrap the stage functions; marks[request id prefix][stage] = perf_counter()."""
    from streamer.engine import scheduler, tokenizer
    from streamer.server import openai_api

    entered: contextvars.ContextVar[float] = contextvars.ContextVar("entered", default=0.0)

    def mark(rid: str, stage: str) -> None:
        marks.setdefault(rid.rsplit("-", 1)[0] if rid.count("-") > 1 else rid, {}).setdefault(
            stage, time.perf_counter())

    completions = openai_api.completions

    async def traced_completions(request):  # type: ignore[no-untyped-def]
        entered.set(time.perf_counter())
        return await completions(request)

    openai_api.completions = traced_completions
    start = openai_api.start

    async def traced_start(st, reqs):  # type: ignore[no-untyped-def]
        rid = reqs[0].request_id
        marks.setdefault(rid.rsplit("-", 1)[0], {})["t_in"] = entered.get()
        mark(rid, "t_submit")
        out = await start(st, reqs)
        mark(rid, "t_out")
        return out

    openai_api.start = traced_start
    call = tokenizer.Tokenizer.__call__

    def traced_call(self, req, arrival):  # type: ignore[no-untyped-def]
        out = call(self, req, arrival)
        mark(req.request_id, "t_tok")
        return out

    tokenizer.Tokenizer.__call__ = traced_call  # type: ignore[method-assign]
    build = scheduler.Scheduler._build

    def traced_build(self, chunks, ahead=False):  # type: ignore[no-untyped-def]
        for req, _ in chunks:
            mark(req.request_id, "t_sched")
        return build(self, chunks, ahead)

    scheduler.Scheduler._build = traced_build  # type: ignore[method-assign]
    delta = scheduler.Scheduler._delta

    def traced_delta(self, req, tokens, logprobs=None):  # type: ignore[no-untyped-def]
        if tokens:
            mark(req.request_id, "t_token")
        return delta(self, req, tokens, logprobs)

    scheduler.Scheduler._delta = traced_delta  # type: ignore[method-assign]
    content = openai_api.CompletionChunks.content

    def traced_content(self, i, out, c):  # type: ignore[no-untyped-def]
        mark(self.head[0], "t_sse")
        return content(self, i, out, c)

    openai_api.CompletionChunks.content = traced_content  # type: ignore[method-assign]


async def client(url: str, n: int, prompt_len: int, background: int) -> list[dict[str, float]]:
    """The probes, through the benchmark's own lean client (streamer.bench.http)."""
    import contextlib
    import random

    from streamer.bench.http import StreamingClient
    from streamer.sse import aiter_lines, parse_line

    rng = random.Random(0)
    c = StreamingClient(url)

    async def one(prompt: list[int], max_tokens: int) -> dict[str, float]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0}
        rec: dict[str, float] = {"t_send": time.perf_counter()}
        async with contextlib.aclosing(c.post_stream("/v1/completions", body)) as pieces:
            async for line in aiter_lines(pieces):
                chunk = parse_line(line)
                if isinstance(chunk, dict) and chunk.get("choices") and "t_recv" not in rec:
                    rec["t_recv"] = time.perf_counter()
                    rec["rid"] = chunk["id"]  # type: ignore[assignment]
        return rec

    # (within the server's 4096-token context: a longer request is refused, and then nothing
    # runs in the background; the first GPU traces of 2026-11-30 had that mistake)
    bg = [asyncio.create_task(one([rng.randrange(1000, 30000) for _ in range(64)], 3000))
          for _ in range(background)]
    await asyncio.sleep(1.0 if background else 0.0)
    out = []
    for _ in range(n):
        await asyncio.sleep(0.05 + rng.random() * 0.02)  # arrive at a random phase of the steps
        out.append(await one([rng.randrange(1000, 30000) for _ in range(prompt_len)], 2))
    for t in bg:
        t.cancel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--port", type=int, default=8199)
    ap.add_argument("-n", type=int, default=40, help="probe requests")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--background", type=int, default=2, help="long generations running meanwhile")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--set", nargs="*", default=[], help="engine settings key=value (numbers)")
    a = ap.parse_args()
    if a.client:
        print(json.dumps(asyncio.run(client(a.client, a.n, a.prompt_len, a.background))))
        return

    import uvicorn

    from streamer.config import EngineConfig, ServerConfig
    from streamer.engine.engine import AsyncEngine
    from streamer.server.app import create_app

    marks: dict[str, dict[str, float]] = {}
    hook_server(marks)
    settings = {k: float(v) if "." in v else int(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    engine = AsyncEngine(EngineConfig(model=a.model, load_format=a.load_format, max_model_len=4096,
                                      max_num_batched_tokens=8192, **settings))
    app = create_app(engine, ServerConfig(port=a.port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=a.port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.2)
    url = f"http://127.0.0.1:{a.port}"
    res = subprocess.run([sys.executable, __file__, "--client", url, "-n", str(a.n), "--prompt-len",
                          str(a.prompt_len), "--background", str(a.background)],
                         capture_output=True, text=True, check=True)
    st = engine.stats()
    server.should_exit = True
    th.join(timeout=30)
    rows = []
    for rec in json.loads(res.stdout.strip().splitlines()[-1]):
        m = {**marks.get(rec.pop("rid"), {}), **rec}
        if all(s in m for s in STAGES):
            rows.append([1e3 * (m[b] - m[s]) for s, b in zip(STAGES, STAGES[1:])])
    print(f"{len(rows)} probes of {a.prompt_len} tokens, {a.background} generations in the background; "
          f"steps {st.steps}, held {st.steps_held} (joined {st.held_steps_joined}, late {st.held_steps_late})")
    print(f"{'stage':10} {'mean ms':>8} {'p50 ms':>8}")
    for j, name in enumerate(NAMES + ["total"]):
        vals = sorted(sum(r) if name == "total" else r[j] for r in rows)
        if vals:
            print(f"{name:10} {sum(vals) / len(vals):8.2f} {vals[len(vals) // 2]:8.2f}")


if __name__ == "__main__":
    main()
