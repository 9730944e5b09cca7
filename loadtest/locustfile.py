"""Load scenarios for a running streamer server (locust).

    .venv/bin/locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 60s --host http://127.0.0.1:8000

Users (pick some by naming them after the file: `... loadtest/locustfile.py ChatStreamUser`):

  ChatStreamUser     POST /v1/chat/completions, stream=true. Besides the request itself
                     ("POST chat [stream]", first byte to [DONE]) it records, as entries of
                     type SSE:
                       ttft          request sent -> first content delta (ms)
                       itl           gap between two content deltas (ms), one entry per gap
                       tpot          (last delta - first delta) / (completion tokens - 1), per request (ms)
                       tokens_per_s  completion tokens / request time; the "ms" columns hold tok/s
  CompletionUser     POST /v1/completions, non-streaming.
  WebSocketChatUser  a multi-turn session on /v1/chat/ws (websockets' sync client): type WS,
                     "turn" (user message -> done, per turn) and "ttft" (-> first delta);
                     "session" is the whole conversation.

Scenarios: each user has one task per scenario, tagged with its name, so
`--tags short` (or `--exclude-tags long`) narrows a run; LOADTEST_SCENARIO
sets the task weights:
  short   a short chat question (default weight 6 in the mix)
  long    a long prompt of LOADTEST_LONG_WORDS random words, unique per request (1)
  shared  one long system prompt shared by every request + a short question (3):
          the radix cache serves the system prompt after the first request
  mix     all three with the weights above (the default)

Environment:
  LOADTEST_SCENARIO     mix | short | long | shared (default mix)
  LOADTEST_MAX_TOKENS   max_tokens of every request / turn (default 64)
  LOADTEST_LONG_WORDS   words in a long prompt (default 1200)
  LOADTEST_SHARED_WORDS words in the shared system prompt (default 600)
  LOADTEST_WS_TURNS     turns per WebSocket session (default 3)
  LOADTEST_WAIT         think time between tasks, "MIN,MAX" seconds (default "0.5,2")
  LOADTEST_TEMPERATURE  sampling temperature (default 0.7)
  LOADTEST_IGNORE_EOS   1: always generate max_tokens (default 0)
  LOADTEST_TIMEOUT      per-request timeout in seconds (default 120)
  LOADTEST_MODEL        model name to send (default: none, the server's model)
  LOADTEST_API_KEY      sent as Authorization: Bearer KEY (and ?api_key= on the WebSocket)
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any
from urllib.parse import quote

from locust import HttpUser, User, between, events, tag, task

from streamer.sse import DONE, iter_lines, parse_line

# ---- configuration ---------------------------------------------------------------------


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


SCENARIO = os.environ.get("LOADTEST_SCENARIO", "mix").strip().lower()
MIX = {"short": 6, "long": 1, "shared": 3}
if SCENARIO == "mix":
    WEIGHTS = MIX
elif SCENARIO in MIX:
    WEIGHTS = {k: int(k == SCENARIO) for k in MIX}
else:
    raise SystemExit(f"LOADTEST_SCENARIO must be mix, short, long or shared, not {SCENARIO!r}")

MAX_TOKENS = _env_int("LOADTEST_MAX_TOKENS", 64)
LONG_WORDS = _env_int("LOADTEST_LONG_WORDS", 1200)
SHARED_WORDS = _env_int("LOADTEST_SHARED_WORDS", 600)
WS_TURNS = _env_int("LOADTEST_WS_TURNS", 3)
TEMPERATURE = float(os.environ.get("LOADTEST_TEMPERATURE", 0.7))
IGNORE_EOS = os.environ.get("LOADTEST_IGNORE_EOS", "0") not in ("", "0", "false", "no")
TIMEOUT = float(os.environ.get("LOADTEST_TIMEOUT", 120))
MODEL = os.environ.get("LOADTEST_MODEL") or None
API_KEY = os.environ.get("LOADTEST_API_KEY") or None
_wait = [float(x) for x in os.environ.get("LOADTEST_WAIT", "0.5,2").split(",")]
WAIT = between(_wait[0], _wait[-1])

# ---- prompts ---------------------------------------------------------------------------------

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain cloud engine garden window letter music "
         "question answer system market city story water light paper money night table color forest").split()
QUESTIONS = [
    "What is the capital of France?", "Give me three tips for better sleep.", "Write a haiku about the sea.",
    "Explain what a hash table is.", "How do plants make food?", "Name a few prime numbers.",
    "What is the difference between weather and climate?", "Suggest a name for a grey cat.",
    "Why is the sky blue?", "Summarize the plot of Romeo and Juliet in two sentences.",
    "How many legs does a spider have?", "Translate 'good morning' into Spanish.",
]
FOLLOW_UPS = ["Can you say more?", "Why is that?", "Give me an example.", "Make it shorter.", "Thanks! One more?"]
CITIES = ["Paris", "Rome", "Lisbon", "Oslo", "Cairo", "Lima", "Kyoto", "Quebec", "Vienna", "Dakar"]


def _notes(words: int) -> str:
    """Travel-agency notes of about `words` words (fixed seed: every user gets the very same text)."""
    rng, out, n = random.Random(7), [], 0
    while n < words:
        s = (f"The {rng.choice(WORDS)} tour in {rng.choice(CITIES)} costs {rng.randrange(20, 900)} euros "
             f"and leaves on day {rng.randrange(1, 29)}.")
        out.append(s)
        n += len(s.split())
    return " ".join(out)


SHARED_SYSTEM = ("You are a friendly assistant for a travel agency. Answer the customer's question in a few "
                 "sentences. Agency notes: " + _notes(SHARED_WORDS))


def _long_text() -> str:
    rng = random.Random()
    return "Read this text and tell me what it is about. " + " ".join(rng.choice(WORDS) for _ in range(LONG_WORDS))


def messages_for(scenario: str) -> list[dict[str, str]]:
    question = random.choice(QUESTIONS)
    if scenario == "long":
        return [{"role": "user", "content": _long_text()}]
    if scenario == "shared":
        return [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": question}]
    return [{"role": "user", "content": f"{question} (#{random.randrange(10**6)})"}]


def prompt_for(scenario: str) -> str:
    if scenario == "long":
        return _long_text() + "\nSummary:"
    if scenario == "shared":
        return f"{SHARED_SYSTEM}\nQuestion: {random.choice(QUESTIONS)}\nAnswer:"
    return f"Question: {random.choice(QUESTIONS)}\nAnswer:"


def sampling() -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": TEMPERATURE}
    if IGNORE_EOS:
        body["ignore_eos"] = True
    if MODEL:
        body["model"] = MODEL
    return body


def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}


def record(request_type: str, name: str, value: float, length: int = 0, exception: Exception | None = None) -> None:
    events.request.fire(request_type=request_type, name=name, response_time=value, response_length=length,
                        exception=exception, context={})


class StreamError(Exception):
    pass


# ---- users ---------------------------------------------------------------------------------


class ChatStreamUser(HttpUser):
    """Streaming chat completions over SSE."""

    weight = 3
    wait_time = WAIT

    def chat(self, scenario: str) -> None:
        body = {"messages": messages_for(scenario), "stream": True, "stream_options": {"include_usage": True},
                **sampling()}
        t0 = time.perf_counter()
        deltas: list[float] = []
        usage: dict[str, Any] | None = None
        finish = None
        done = False
        with self.client.post("/v1/chat/completions", json=body, headers=headers(), stream=True,
                              catch_response=True, name="POST chat [stream]", timeout=TIMEOUT) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                for line in iter_lines(resp.iter_content(chunk_size=None)):
                    chunk = parse_line(line)
                    if chunk is None:
                        continue
                    if chunk == DONE:
                        done = True
                        break
                    if "error" in chunk:
                        raise StreamError(f"error event: {chunk['error']}")
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        if choice["delta"].get("content"):
                            deltas.append(time.perf_counter())
                        finish = choice.get("finish_reason") or finish
                if not done or finish is None:
                    raise StreamError(f"stream ended without {'a finish_reason' if done else '[DONE]'}")
            except Exception as e:  # noqa: BLE001 - any broken stream is a failed request
                resp.failure(e)
                return
            total = time.perf_counter() - t0
            resp.request_meta["response_time"] = 1e3 * total
            tokens = usage["completion_tokens"] if usage else len(deltas)
            resp.request_meta["response_length"] = tokens
            resp.success()
        if deltas:
            record("SSE", "ttft", 1e3 * (deltas[0] - t0))
            for a, b in zip(deltas, deltas[1:]):
                record("SSE", "itl", 1e3 * (b - a))
            if tokens > 1:
                record("SSE", "tpot", 1e3 * (deltas[-1] - deltas[0]) / (tokens - 1))
            record("SSE", "tokens_per_s", tokens / total, tokens)

    @tag("short")
    @task(WEIGHTS["short"])
    def short_chat(self) -> None:
        self.chat("short")

    @tag("long")
    @task(WEIGHTS["long"])
    def long_prompt(self) -> None:
        self.chat("long")

    @tag("shared")
    @task(WEIGHTS["shared"])
    def shared_system_prompt(self) -> None:
        self.chat("shared")


class CompletionUser(HttpUser):
    """Non-streaming text completions."""

    weight = 1
    wait_time = WAIT

    def complete(self, scenario: str) -> None:
        body = {"prompt": prompt_for(scenario), **sampling()}
        with self.client.post("/v1/completions", json=body, headers=headers(), catch_response=True,
                              name="POST completions", timeout=TIMEOUT) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                out = resp.json()
                choice = out["choices"][0]
                if choice.get("finish_reason") not in ("stop", "length"):
                    raise StreamError(f"finish_reason {choice.get('finish_reason')!r}")
                resp.request_meta["response_length"] = out["usage"]["completion_tokens"]
            except Exception as e:  # noqa: BLE001
                resp.failure(e)
                return
            resp.success()

    @tag("short")
    @task(WEIGHTS["short"])
    def short_completion(self) -> None:
        self.complete("short")

    @tag("long")
    @task(WEIGHTS["long"])
    def long_completion(self) -> None:
        self.complete("long")

    @tag("shared")
    @task(WEIGHTS["shared"])
    def shared_prefix_completion(self) -> None:
        self.complete("shared")


class WebSocketChatUser(User):
    """Multi-turn chat sessions over the WebSocket; every turn is recorded."""

    weight = 1
    wait_time = WAIT

    def ws_url(self) -> str:
        base = (self.host or "http://127.0.0.1:8000").rstrip("/")
        url = "ws" + base[4:] if base.startswith("http") else base
        return url + "/v1/chat/ws" + (f"?api_key={quote(API_KEY)}" if API_KEY else "")

    def session(self, scenario: str) -> None:
        from websockets.sync.client import connect

        t_session = time.perf_counter()
        try:
            with connect(self.ws_url(), open_timeout=TIMEOUT, close_timeout=5, max_size=None) as ws:
                hello = json.loads(ws.recv(timeout=TIMEOUT))
                if hello.get("type") != "session":
                    raise StreamError(f"expected a session message, got {hello}")
                first = messages_for(scenario)[-1]["content"]
                if scenario == "shared":
                    first = f"{SHARED_SYSTEM}\n\n{first}"
                for turn in range(WS_TURNS):
                    content = first if turn == 0 else random.choice(FOLLOW_UPS)
                    self.turn(ws, content)
        except Exception as e:  # noqa: BLE001 - a session that breaks is a failure
            record("WS", "session", 1e3 * (time.perf_counter() - t_session), exception=e)
            return
        record("WS", "session", 1e3 * (time.perf_counter() - t_session))

    def turn(self, ws: Any, content: str) -> None:
        t0 = time.perf_counter()
        first: float | None = None
        chars = 0
        ws.send(json.dumps({"type": "user", "content": content, **sampling()}))
        try:
            while True:
                msg = json.loads(ws.recv(timeout=TIMEOUT))
                kind = msg.get("type")
                if kind == "delta":
                    if first is None:
                        first = time.perf_counter()
                    chars += len(msg["text"])
                elif kind == "done":
                    if msg.get("finish_reason") not in ("stop", "length"):
                        raise StreamError(f"turn ended with finish_reason {msg.get('finish_reason')!r}")
                    break
                else:
                    raise StreamError(f"unexpected message {msg}")
        except Exception as e:
            record("WS", "turn", 1e3 * (time.perf_counter() - t0), chars, exception=e)
            raise
        record("WS", "turn", 1e3 * (time.perf_counter() - t0), chars)
        if first is not None:
            record("WS", "ttft", 1e3 * (first - t0))

    @tag("short")
    @task(WEIGHTS["short"])
    def short_session(self) -> None:
        self.session("short")

    @tag("long")
    @task(WEIGHTS["long"])
    def long_session(self) -> None:
        self.session("long")

    @tag("shared")
    @task(WEIGHTS["shared"])
    def shared_session(self) -> None:
        self.session("shared")
