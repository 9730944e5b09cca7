"""EngineProcess: the engine in a process of its own, behind AsyncEngine's interface.

One engine process for the module, served by a real uvicorn (serve_in_thread) so the
server tests at the end run through it too; an in-process engine (LLM) is the reference.
The test that kills the engine process comes last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import torch

from streamer import LLM, SamplingParams
from streamer.config import EngineConfig, ServerConfig
from streamer.engine.health import DEADLINE_GRACE_S
from streamer.engine.remote import EngineProcess
from streamer.errors import ModelLoadError
from streamer.messages import ENGINE_STALLED, GenerateRequest, GrammarSpec, RequestOutput
from streamer.server.app import create_app
from tests.conftest import serve_in_thread

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@dataclass
class Served:
    engine: EngineProcess
    loop: asyncio.AbstractEventLoop
    url: str

    def run(self, coro: Any, timeout: float = 60) -> Any:
        """Run a coroutine on the server's event loop, where the engine's socket lives."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_idle(self, timeout: float = 10.0) -> Any:
        """The first snapshot received from now on that shows the engine idle: nothing running
        or waiting, and no step in flight (an aborted request's last step may still be on the
        device, and count its tokens, after the request left running). (The snapshot at hand
        may predate outputs already read, or even the admission of their request.)"""
        since = time.monotonic()
        deadline = since + timeout
        while True:
            s = self.engine.stats()
            fresh = self.engine.stats_received_at > since
            if fresh and s.running == 0 and s.waiting == 0 and s.step_age_s == 0 and s.pages_used == s.pages_cached:
                return s
            assert time.monotonic() < deadline, f"not idle after {timeout} s: {s}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def served(default_model) -> Iterator[Served]:
    engine = EngineProcess(EngineConfig(model="default", allow_runtime_lora_updating=True))
    app = create_app(engine, ServerConfig(served_model_name="smol"))
    with serve_in_thread(app, ws_ping_interval=None) as (port, loop):
        yield Served(engine, loop, f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def local(default_model) -> Iterator[LLM]:
    with LLM("default") as llm:
        yield llm


def request(rid: str, prompt: str, params: SamplingParams = GREEDY) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt=prompt, params=params)


async def stream(engine: EngineProcess, req: GenerateRequest) -> list[RequestOutput]:
    return [out async for out in engine.submit(req)]


def same_output(a: RequestOutput, b: RequestOutput) -> bool:
    """Equal but for the request id and the time spent queueing."""
    return msgspec.structs.replace(a, request_id="", queue_time=None) == \
        msgspec.structs.replace(b, request_id="", queue_time=None)


def test_ready_without_cuda_in_this_process(served: Served, local: LLM) -> None:
    e = served.engine
    assert e.info.name == "default" and e.info.max_model_len == 8192 and e.info.eos_token_ids
    assert e.info.hf_tokenizer is not None and e.info.vocab_size == 49152
    # the server process's tokenizer (/tokenize, logprobs' text) is the engine's
    assert local.engine.tokenizer.encode_prompt(request("t", "Hello")) == e.info.hf_tokenizer("Hello")["input_ids"]
    assert e.pid is not None and e.pid != os.getpid()
    assert not torch.cuda.is_initialized()


def test_greedy_streams_equal_in_process(served: Served, local: LLM) -> None:
    stop = msgspec.structs.replace(GREEDY, stop=[" magical abilities"], ignore_eos=False, max_tokens=40)
    cases = [(p, GREEDY) for p in PROMPTS] + [(PROMPTS[1], stop)]
    expected = local.generate([p for p, _ in cases], [sp for _, sp in cases])

    async def all_streams() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(stream(served.engine, request(f"greedy-{i}", p, sp))
                                      for i, (p, sp) in enumerate(cases)))

    streams = served.run(all_streams())
    for (prompt, _), outs, want in zip(cases, streams, expected):
        assert len(outs) > 1, "streamed in several increments"
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert [t for o in outs for t in o.token_ids] == want.token_ids, prompt
        assert "".join(o.text for o in outs) == want.text
        assert outs[-1].finish_reason == want.finish_reason
        assert outs[-1].completion_tokens == want.completion_tokens
    assert expected[-1].finish_reason == "stop" and expected[-1].text.endswith("known for his")
    # generate() collects a stream into one output, as in process
    whole = served.run(served.engine.generate(request("whole", PROMPTS[0])))
    assert same_output(whole, expected[0])


def test_closing_a_stream_aborts_it_in_the_engine_process(served: Served) -> None:
    before = served.wait_idle()
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def two_then_close() -> None:
        outputs = served.engine.submit(request("leaves", "Tell me a long story.", long))
        await anext(outputs)
        await anext(outputs)
        await outputs.aclose()

    served.run(two_then_close())
    after = served.wait_idle(timeout=5)
    assert after.generated_tokens_total - before.generated_tokens_total < 200, "the request ran on"


def test_stats_follow_the_engine_process(served: Served) -> None:
    before = served.wait_idle()
    seen_running = False

    async def watch() -> None:
        nonlocal seen_running
        async for _ in served.engine.submit(request("watched", "Count to ten:", GREEDY)):
            seen_running |= served.engine.stats().running == 1

    served.run(watch())
    after = served.wait_idle()
    assert seen_running
    assert after.steps >= before.steps + GREEDY.max_tokens
    assert after.generated_tokens_total == before.generated_tokens_total + GREEDY.max_tokens


def test_bad_requests_fail_as_in_process_and_the_engine_goes_on(served: Served, local: LLM) -> None:
    too_long = SamplingParams(max_tokens=9000, temperature=0)
    bad_schema = SamplingParams(max_tokens=8, temperature=0,
                                grammar=GrammarSpec("json_schema", '{"type": "object", "properties": 7}'))
    for i, params in enumerate([too_long, bad_schema]):
        want = local.generate("Hello", params)[0]
        got = served.run(served.engine.generate(request(f"bad-{i}", "Hello", params)))
        assert want.finish_reason == "error" and want.error
        assert same_output(got, want), (got, want)
    # a value msgpack cannot carry (in process it would just never match) is refused the same way
    huge = msgspec.structs.replace(GREEDY, stop_token_ids=[2**70])
    got = served.run(served.engine.generate(request("huge", "Hello", huge)))
    assert got.finish_reason == "error" and "cannot be sent to the engine" in (got.error or "")
    ok = served.run(served.engine.generate(request("after-bad", PROMPTS[0])))
    assert ok.finish_reason == "length" and ok.completion_tokens == GREEDY.max_tokens


def test_a_missing_model_fails_start_with_a_clear_error(tmp_path) -> None:
    t0 = time.monotonic()
    engine = EngineProcess(EngineConfig(model=str(tmp_path / "nowhere")))
    with pytest.raises(ModelLoadError, match="no such model folder"):
        asyncio.run(engine.start())
    assert time.monotonic() - t0 < 30


def test_sse_chat_through_the_engine_process(served: Served) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=served.url + "/v1", api_key="none")
    chunks = list(client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Name three colors."}], max_tokens=16,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and finish in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 16
    metrics = httpx.get(served.url + "/metrics").text
    assert "streamer_engine_steps" in metrics and "streamer_kv_pages_total 727.0" in metrics


def test_lora_adapters_load_and_unload_in_the_engine_process(served: Served, default_model, tmp_path) -> None:
    """Lora and LoraDone frames: the engine process loads the adapter and the server's info follows;
    its errors come back as their own classes."""
    from streamer.errors import LoraNotFound, ModelLoadError
    from tests.model.lora_files import make_adapter

    folder = make_adapter(tmp_path / "terse", default_model, ["q_proj", "v_proj"], rank=2, alpha=4, seed=1)
    params = msgspec.structs.replace(GREEDY, lora="terse")
    with pytest.raises(ModelLoadError, match="adapter_config.json"):
        served.run(served.engine.load_lora("terse", str(tmp_path)))
    served.run(served.engine.load_lora("terse", str(folder)))
    assert served.engine.info.loras == ("terse",)
    got = served.run(served.engine.generate(request("with-adapter", PROMPTS[0], params)))
    assert got.error is None and got.completion_tokens == GREEDY.max_tokens
    served.run(served.engine.unload_lora("terse"))
    assert served.engine.info.loras == ()
    with pytest.raises(LoraNotFound, match="terse"):
        served.run(served.engine.unload_lora("terse"))
    gone = served.run(served.engine.generate(request("adapter-gone", PROMPTS[0], params)))
    assert gone.finish_reason == "error" and "terse" in gone.error


def _stopped(served: Served, req: GenerateRequest) -> tuple[RequestOutput, float]:
    """Run req; once it streams, SIGSTOP the engine process until req has ended (then SIGCONT).
    Its last output, and how long after the SIGSTOP it came."""
    engine = served.engine
    assert engine.pid is not None

    async def scenario() -> tuple[RequestOutput, float]:
        outputs = engine.submit(req)
        await anext(outputs)
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            rest = [out async for out in outputs]
            return rest[-1], time.monotonic() - t0
        finally:
            os.kill(engine.pid, signal.SIGCONT)

    last, took = served.run(scenario(), timeout=60)
    deadline = time.monotonic() + 10
    while engine.stalled is not None:  # (its heartbeat again)
        assert time.monotonic() < deadline, engine.stalled
        time.sleep(0.05)
    served.wait_idle()  # the Aborts sent meanwhile freed its pages
    ok = served.run(engine.generate(request(f"after-{req.request_id}", PROMPTS[0])))
    assert ok.finish_reason == "length" and not engine.dead
    return last, took


def test_a_stopped_engine_process_fails_open_requests_as_stalled(served: Served, monkeypatch) -> None:
    from streamer.engine import remote

    monkeypatch.setattr(remote, "FAIL_STALLED_S", 1.5)
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    last, took = _stopped(served, request("stopped", "Tell me a long story.", long))
    assert last.finished and last.finish_reason == "error" and last.error_code == ENGINE_STALLED, last
    assert took < 1.5 + 1.0, took


def test_a_deadline_ends_a_request_even_while_the_engine_process_is_stopped(served: Served) -> None:
    timed = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True, timeout=1.0)
    last, took = _stopped(served, request("timed", "Tell me a long story.", timed))
    assert last.finish_reason == "timeout" and "did not end it" in (last.error or ""), last
    assert took < 1.0 + DEADLINE_GRACE_S + 0.5, took  # (stopped after its first output)


def test_killing_the_engine_process_fails_streams_and_health(served: Served) -> None:
    engine = served.engine
    assert httpx.get(served.url + "/health").status_code == 200
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def stream_then_kill() -> list[RequestOutput]:
        outputs = engine.submit(request("killed", "Tell me a long story.", long))
        got = [await anext(outputs)]
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        got += [out async for out in outputs]
        return got

    outs = served.run(stream_then_kill(), timeout=30)
    last = outs[-1]
    assert last.finished and last.finish_reason == "error" and "engine" in (last.error or "")
    assert engine.dead and "-9" in engine.dead
    r = httpx.get(served.url + "/health")
    assert r.status_code == 503 and r.json()["status"] == "error"
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 503


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _opening_a_fifo(pid: int) -> bool:
    """Whether a thread of the process waits in open() of a FIFO for its writer."""
    try:
        return any((task / "wchan").read_text() == "wait_for_partner" for task in Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False


def test_a_server_killed_while_the_model_loads_takes_its_engine_process_along(tmp_path, tiny_models) -> None:
    """The engine process loads the model before it reads the socket. A tiny model whose
    weights file is a FIFO nobody writes keeps that load waiting forever (in native code,
    holding the GIL): the server process is SIGKILLed meanwhile, and its engine process
    (and multiprocessing's resource tracker) must still exit at once."""
    import shutil
    import subprocess
    import sys

    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama3"], model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
        os.mkfifo(weights)
    code = (
        "from streamer.engine.remote import EngineProcess\n"
        f"EngineProcess(model={str(model)!r}, device='cpu').launch()\n"
    )
    server = subprocess.Popen([sys.executable, "-c", code])
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (children := _children(server.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert children, "the engine process did not start"
        # past the imports, the child blocks opening the FIFO: seen in its wait channel where the
        # kernel shows it, else given 8 s
        deadline = time.monotonic() + 8.0
        while not any(map(_opening_a_fifo, _children(server.pid))) and time.monotonic() < deadline:
            time.sleep(0.05)
        children = _children(server.pid)
        assert children and server.poll() is None, "the load did not block"
        server.kill()
        server.wait(10)
        deadline = time.monotonic() + 30
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, children)), "the engine process outlived its server"
    finally:
        server.kill()
        for pid in children:  # (a failed run leaves no orphan behind)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

