"""`streamer serve`: its flags, the engine it starts, and uvicorn around the app (app.py).

Shutdown order (SIGTERM / SIGINT, handled by uvicorn):
  1. stop accepting; new requests would get 503 (draining);
  2. abort every in-flight engine request: each stream ends with a final
     chunk (finish_reason "abort") and [DONE], each WebSocket turn with done;
  3. uvicorn waits for the connections to finish, then the lifespan stops the engine
     (by default an EngineProcess: Stop, then the process is joined).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

import uvicorn

from streamer.config import (
    CACHE_ISOLATIONS,
    GENERATION_CONFIGS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    EngineConfig,
    ServerConfig,
)
from streamer.engine.protocol import Engine
from streamer.server import transport
from streamer.server.app import create_app
from streamer.server.state import ServerState


def add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help=f"address to bind (default {d.host}: this machine only)")
    g.add_argument("--port", type=int, default=d.port, help=f"TCP port (default {d.port})")
    g.add_argument("--api-key", dest="api_keys", action="append", type=_names, default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* and the native API (WebSocket: also "
                        "?api_key=KEY); several keys: repeat the flag or separate them with commas")
    g.add_argument("--cache-isolation", choices=CACHE_ISOLATIONS, default=d.cache_isolation,
                   help="per-key: requests of different API keys never share prefix-cache pages (nor learn "
                        "from cached_tokens or timing what the other keys' prompts were; needs --api-key); "
                        "none: shared, unless a request gives a cache_salt (default none)")
    g.add_argument("--request-timeout", type=_positive(float), default=d.request_timeout, metavar="SECONDS",
                   help="seconds a request may run, from its arrival to its end (queued, running): then it "
                        "ends with a timeout error; also caps a request's own 'timeout' (default: no limit)")
    g.add_argument("--generation-config", choices=GENERATION_CONFIGS, default=d.generation_config,
                   help="defaults of the sampling fields a request omits (temperature, top_p, top_k, "
                        "repetition_penalty, min_p): auto, the model folder's generation_config.json where "
                        "it gives them; none, streamer's (temperature 1, no top_p/top_k/min_p/repetition "
                        "penalty) (default auto)")
    g.add_argument("--served-model-name", default=d.served_model_name,
                   help="model name reported by /v1/models and accepted in requests (default: the folder's name)")
    g.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"requests allowed to wait for a first token; beyond it 503 + Retry-After (default {d.max_queue})")
    g.add_argument("--responses-store-mb", type=int, default=d.responses_store_mb, metavar="MB",
                   help="memory for stored /v1/responses (previous_response_id, GET /v1/responses/{id}), least "
                        f"recently used dropped first, lost on restart; 0: none stored (default {d.responses_store_mb})")
    g.add_argument("--session-idle-timeout", type=float, default=d.session_idle_timeout,
                   help=f"seconds before an idle WebSocket chat session is closed (default {d.session_idle_timeout:g})")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=d.engine_process,
                   help="run the engine in a process of its own (--no-engine-process: in the server's process "
                        "and event loop); default: its own process on CUDA, the server's on CPU")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=d.tool_call_parser,
                   help="the markup of tool calls in the model's output (default auto: from the chat template, "
                        "openai for gpt-oss's harmony, deepseek_v3 or deepseek_v31 for DeepSeek's markers; "
                        "hermes where another template does not read tools)")
    g.add_argument("--trust-request-chat-template", action="store_true", default=d.trust_request_chat_template,
                   help="let a chat request bring its own chat_template (Jinja, run sandboxed; default: refused)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=d.reasoning_parser,
                   help="answer the model's <think> text (openai_gptoss: gpt-oss's analysis messages) as "
                        "reasoning_content; grammars apply from its end (default: none, all text is content)")
    g.add_argument("--data-parallel-size", type=_positive(int), default=d.data_parallel_size, metavar="N",
                   help="N engine replicas, each an engine process with its own devices (CUDA: N devices, "
                        "or N x the tensor-parallel size), behind a router that sends each request to the "
                        "replica whose prefix cache likely holds its prompt (default 1)")
    g.add_argument("--balance-margin", type=int, default=d.balance_margin, metavar="REQUESTS",
                   help="with --data-parallel-size: open requests by which the replica holding a prompt's "
                        f"prefix may exceed the least loaded one and still get it (default {d.balance_margin})")
    add_limit_args(p, d)


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def add_limit_args(p: argparse.ArgumentParser, d: ServerConfig) -> None:
    """The limits on hostile input (README "Reliability limits"); each refusal names its flag."""
    g = p.add_argument_group("request limits (a request over one is refused with 400, the body with 413)")
    pi, pf = _positive(int), _positive(float)
    for flag, what in [
        ("--max-request-bytes", "bytes of an HTTP body (413 beyond it) or a WebSocket message"),
        ("--max-stop", "stop strings, and stop token ids, per request"),
        ("--max-stop-chars", "characters of one stop string"),
        ("--max-logit-bias", "logit_bias entries per request"),
        ("--max-choices", "guided_choice / choices entries per request"),
        ("--max-messages", "messages of a chat request, a WebSocket session or a conversation"),
        ("--max-conversations", "conversations per /apply_chat_template"),
        ("--max-batch", "engine requests one HTTP request may start: prompts x n, /generate and /tokenize lists"),
        ("--max-n", "choices (n) per request"),
    ]:
        default = getattr(d, flag[2:].replace("-", "_"))
        g.add_argument(flag, type=pi, default=default, help=f"{what} (default {default:,})")
    g.add_argument("--max-prompt-chars", type=pi, default=d.max_prompt_chars,
                   help="characters of text prompt per request (prompts, message contents, texts summed), "
                        "checked before tokenizing (default: 32 per token of the model's context)")
    g = p.add_argument_group("connections")
    g.add_argument("--max-connections", type=pi, default=d.max_connections,
                   help="open connections, HTTP and WebSocket; beyond it a new one gets 503 and is closed "
                        "(default 2048, fewer if the open-files limit is lower)")
    g.add_argument("--timeout-idle-connection", type=pf, default=d.timeout_idle_connection,
                   help="seconds a connection may take to send a complete request head, from its opening or "
                        f"from the previous response; then it is closed (default {d.timeout_idle_connection:g})")
    g.add_argument("--timeout-request-body", type=pf, default=d.timeout_request_body,
                   help=f"seconds a request body may take to arrive (408 beyond; default {d.timeout_request_body:g})")
    g.add_argument("--allowed-hosts", type=_names, default=d.allowed_hosts,
                   help="comma-separated Host names served ('*': any, '*.example.com': its subdomains); "
                        "default: localhost, 127.0.0.1, [::1] when bound to a loopback address, any otherwise")
    g.add_argument("--allowed-origins", type=_names, default=d.allowed_origins,
                   help="comma-separated Origins that may open the WebSocket ('*': any; e.g. "
                        "https://app.example.com); always allowed: the server's own origin, and pages on "
                        "loopback names when bound to a loopback address (unless this flag is given)")


LIMIT_FIELDS = ("max_request_bytes", "max_prompt_chars", "max_stop", "max_stop_chars", "max_logit_bias",
                "max_choices", "max_messages", "max_conversations", "max_batch", "max_n", "max_connections",
                "timeout_idle_connection", "timeout_request_body", "allowed_hosts", "allowed_origins")
"""ServerConfig fields that add_limit_args makes flags of, under the same names."""


def wants_engine_process(config: ServerConfig) -> bool:
    """config.engine_process, or when it is None, whether the engine will run on CUDA (see
    ServerConfig.engine_process). torch.cuda.is_available() creates no CUDA context."""
    if config.engine_process is not None:
        return config.engine_process
    device = config.engine.device
    if device == "auto":
        import torch  # noqa: PLC0415 - heavy

        return torch.cuda.is_available()
    return device.startswith("cuda")


class _Server(uvicorn.Server):
    """uvicorn.Server that aborts in-flight requests before waiting for connections to drain."""

    state: ServerState

    async def shutdown(self, sockets: Any = None) -> None:
        self.state.draining = True
        self.state.abort_all()
        # let aborted turns send their final message (WebSocket "done", SSE finish chunk)
        # before uvicorn closes the connections; bounded, so a stuck client cannot hold us
        for _ in range(40):
            if not self.state.inflight:
                break
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)


def server_config(args: argparse.Namespace, engine_config: EngineConfig) -> ServerConfig:
    """The ServerConfig of `streamer serve`'s flags (a flag absent from args: its default)."""
    d = ServerConfig()
    return ServerConfig(
        host=getattr(args, "host", d.host), port=getattr(args, "port", d.port),
        api_keys=tuple(k for ks in getattr(args, "api_keys", None) or [] for k in ks),
        served_model_name=getattr(args, "served_model_name", None),
        cache_isolation=getattr(args, "cache_isolation", d.cache_isolation),
        request_timeout=getattr(args, "request_timeout", d.request_timeout),
        generation_config=getattr(args, "generation_config", d.generation_config),
        max_queue=getattr(args, "max_queue", d.max_queue),
        session_idle_timeout=getattr(args, "session_idle_timeout", d.session_idle_timeout),
        responses_store_mb=getattr(args, "responses_store_mb", d.responses_store_mb),
        engine_process=getattr(args, "engine_process", d.engine_process), engine=engine_config,
        tool_call_parser=getattr(args, "tool_call_parser", d.tool_call_parser),
        reasoning_parser=getattr(args, "reasoning_parser", d.reasoning_parser),
        trust_request_chat_template=getattr(args, "trust_request_chat_template", d.trust_request_chat_template),
        data_parallel_size=getattr(args, "data_parallel_size", d.data_parallel_size),
        balance_margin=getattr(args, "balance_margin", d.balance_margin),
        **{f: getattr(args, f, getattr(d, f)) for f in LIMIT_FIELDS},
    )


def serve(args: argparse.Namespace, engine_config: EngineConfig) -> None:
    config = server_config(args, engine_config)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine: Engine
    if config.data_parallel_size > 1:
        from streamer.router.data_parallel import DataParallelEngine  # noqa: PLC0415 - heavy (torch)

        replicas = DataParallelEngine(engine_config, config.data_parallel_size, config.balance_margin)
        replicas.launch()  # every replica loads its model; a failure raises here, before uvicorn starts
        engine = replicas
    elif wants_engine_process(config):
        from streamer.engine.remote import EngineProcess  # noqa: PLC0415 - heavy (torch)

        process = EngineProcess(engine_config)
        process.launch()  # the model loads there; a failure raises here, before uvicorn starts
        engine = process
    else:
        from streamer.engine.engine import AsyncEngine  # noqa: PLC0415 - heavy (torch)

        engine = AsyncEngine(engine_config)
    app = create_app(engine, config)
    max_connections = config.max_connections or transport.default_max_connections()
    server = _Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=30,
        ws_ping_interval=20, ws_max_size=config.max_request_bytes,
        http=transport.guarded_http(config.timeout_idle_connection, max_connections),
        # (annotated int, used as seconds in loop.call_later: a float works)
        timeout_keep_alive=config.timeout_idle_connection))  # type: ignore[arg-type]
    transport.redact_logs()  # after uvicorn.Config, which configures its loggers
    server.state = app.state.server
    host = f"[{config.host}]" if ":" in config.host else config.host
    base = f"http://{'127.0.0.1' if config.host in ('0.0.0.0', '::') else host}:{config.port}"
    defaults = app.state.server.sampling_defaults
    if defaults:
        print("streamer: sampling defaults from the model's generation_config.json: "
              + ", ".join(f"{k}={v:g}" for k, v in defaults.items()) + " (--generation-config none: off)")
    print(f"streamer: serving {app.state.server.model_name!r}\n"
          f"  chat page:     {base}/  (open in a browser)\n"
          f"  OpenAI client: OpenAI(base_url=\"{base}/v1\", api_key=\"{'<your --api-key>' if config.api_keys else 'none'}\")\n"
          f"  WebSocket:     {base.replace('http', 'ws', 1)}/v1/chat/ws", flush=True)
    server.run()
