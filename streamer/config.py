"""Every knob of the engine and the server, in one place. (The environment variables that
some read, and their accessors, are streamer/env.py's.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from streamer.chat_template import check_kwargs
from streamer.env import env_flag, env_ints, env_str
from streamer.errors import ConfigError, RequestError
from streamer.speculative_config import parse_speculative_config

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
CHECKPOINT_FORMATS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq",
                      "compressed-tensors": "compressed-tensors", "mxfp4": "mxfp4"}
"""quantization values that name a checkpoint's own format (vLLM's names, its Marlin kernels' included) -> the
config.json quant_method they stand for: accepted where the checkpoint is stored that way (it runs as stored),
refused otherwise (model/fp8_config.py confirm_format). streamer quantizes at load to fp8 only."""
QUANTIZATIONS = ("fp8", *CHECKPOINT_FORMATS)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "openai", "deepseek_v3", "deepseek_v31",
                     "qwen3_coder", "glm45")
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")
CACHE_ISOLATIONS = ("none", "per-key")
GENERATION_CONFIGS = ("auto", "none")
BALANCE_MARGIN = 8
"""ServerConfig.balance_margin's default (router/policy.py says why 8)."""


@dataclass(frozen=True, slots=True)
class DiagnosticsConfig:
    """The engine's diagnostic switches (streamer/diagnostics.py), all off by default: read
    from the environment once, when an engine is built (from_env)."""

    step_trace: str | None = None
    """STREAMER_STEP_TRACE=path: one JSON line per step (StepTrace)."""
    profile_steps: frozenset[int] = frozenset()
    """STREAMER_PROFILE_STEPS=40,41,900: these steps run alone under torch.profiler..."""
    profile_out: str = "kernel_profile.jsonl"
    """...and STREAMER_PROFILE_OUT names the file their kernel tables go to."""
    log_compiles: bool = False
    """STREAMER_LOG_COMPILES=1: log every kernel variant Triton builds after start (CUDA)."""

    @classmethod
    def from_env(cls) -> DiagnosticsConfig:
        return cls(
            step_trace=env_str("STEP_TRACE") or None,
            profile_steps=env_ints("PROFILE_STEPS"),
            profile_out=env_str("PROFILE_OUT", "kernel_profile.jsonl"),
            log_compiles=env_flag("LOG_COMPILES", False),
        )


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    """A local HF folder, a GGUF file (converted once into cache_dir, model/gguf.py), or
    "default" for SmolLM2-135M-Instruct (fetched once): model/source.py tells them apart."""
    dtype: str = "auto"
    """auto: bfloat16 on CUDA, float32 on CPU."""
    kv_cache_dtype: str = "auto"
    """auto: the model's dtype. fp8 (or fp8_e4m3): K/V stored as float8 e4m3 with scale 1,
    saturated at +-448; half the bytes per token (twice the tokens in the pool, half the
    attention reads of long contexts) for a small loss of precision."""
    quantization: str | None = None
    """fp8: the decoder's linear layers hold float8 e4m3 weights (a scale per output row,
    computed at load time) and quantize their inputs per token at each call (W8A8, see
    streamer/model/quant.py): half the weight bytes and twice the tensor-core FLOPs, for a
    small loss of precision. None: the weights stay in `dtype`. A checkpoint that is already
    float8 (a quantization_config in config.json) runs as stored with either value
    (streamer/model/fp8_checkpoint.py). awq, awq_marlin, gptq, gptq_marlin, compressed-tensors,
    mxfp4 (CHECKPOINT_FORMATS): the checkpoint is stored that way and runs as stored (a check,
    as a quantized checkpoint loads as stored with no value)."""
    device: str = "auto"
    load_format: str = "auto"
    """auto: safetensors from the folder; dummy: random weights of the real shapes."""
    cache_dir: str | None = None
    page_size: int = 16
    num_pages: int | None = None
    """Fixed pool size; None sizes it from gpu_memory_fraction / cpu_kv_bytes."""
    gpu_memory_fraction: float = 0.85
    cpu_kv_bytes: int = 512 << 20
    max_num_seqs: int = 256
    """Cap on requests running at once."""
    scheduling_policy: str = "fcfs"
    """fcfs: first come, first served. priority (vLLM's): waiting requests by SamplingParams.priority
    (lower first), then arrival; preemption takes the running request last in that order."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    max_model_len: int | None = None
    """Defaults to the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    overlap_schedule: bool | None = None
    """Schedule batch N+1 while N runs. None: on for CUDA, off on CPU (nothing to overlap)."""
    hold_ahead_ms: float = 1.5
    """With overlap, while only decodes run and nobody waits, the batch after the running
    one is scheduled this long before the running one is expected to end (not at once), so
    that a request arriving meanwhile joins it instead of queueing behind it. 0: off."""
    decode_gemv: bool = True
    """On CUDA, linear layers of one-token steps use the Triton GEMV of kernels/gemv.py
    (cuBLAS leaves bandwidth unused on mid-size weights at batch 1)."""
    cuda_graph_max_bs: int = 512
    """Largest decode batch replayed from a CUDA graph (capped at max_num_seqs; larger decode
    batches run eagerly, their host launches then bound the step: W3 at batch ~490 ran 7%
    faster with graphs up to 512 than up to 256)."""
    cuda_graph_max_tokens: int = 2048
    """Largest prefill or mixed step replayed from a CUDA graph (padded up a ladder of
    token counts); longer steps run eagerly, where the GPU outlasts the launches. 0: off."""
    warmup: bool = True
    """On CUDA, start() runs a few short requests first (Triton compiles its kernel variants)."""
    seed: int = 0
    fcfs_queue_threshold: int = 128
    """Past this many waiting requests, admission is plain FCFS (no prefix sort)."""
    grammar_compile_timeout: float = 10.0
    """Seconds one grammar (JSON schema, regex, EBNF, choice) may take to compile; past it the
    compilation is killed and the request refused (sampling/grammar_worker.py)."""
    grammar_compile_memory_mb: int = 2048
    """Memory one grammar compilation may take, in MB; past it, likewise killed and refused."""
    grammar_compile_workers: int = 2
    """Grammar compilations at once (each in a process of its own); more wait their turn."""
    chat_template: str | None = None
    """A Jinja file that replaces the model's chat template (--chat-template)."""
    default_chat_template_kwargs: dict[str, Any] | None = None
    """Variables of every chat prompt's template (e.g. {"enable_thinking": false}); a
    request's chat_template_kwargs win over them."""
    grammar_prestart: bool = False
    """Start the grammar compilation process with the engine (`streamer serve` does: it takes
    a few seconds, which the first structured-output request would otherwise wait), not on
    the first grammar that needs it."""
    host_kv_cache_gb: float = 0.0
    """GiB of host memory (pinned on CUDA) under the radix cache (kv/host.py): pages evicted
    from the device pool are written back there instead of dropped, and a prefix match that
    reaches them loads them back before the prefill. 0: off."""
    tensor_parallel_size: int = 1
    """Ranks the model is sharded over (streamer/distributed/): the engine starts the other
    ranks' processes; on CUDA one GPU each, from `device` on."""
    nnodes: int = 1
    """Hosts the tensor_parallel_size ranks span (MASTER_ADDR/MASTER_PORT: node 0)."""
    node_rank: int = 0
    """This host's index among nnodes; 0 runs the engine, the others only their ranks."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters, each "NAME=PATH" (a PEFT folder, model/lora.py), loaded at start: a request
    naming NAME as its model (SamplingParams.lora) runs with it."""
    allow_runtime_lora_updating: bool = False
    """Whether LoRA adapters may be loaded and unloaded while the engine serves (AsyncEngine.load_lora,
    unload_lora; the server's /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING). Off by default: a load reads any folder the engine can read."""
    speculative_config: Any = None
    """Speculative decoding (streamer/engine/spec/): a dict or JSON text, parsed here into a
    SpeculativeConfig, e.g. {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_min": 1, "prompt_lookup_max": 4} or {"method": "draft_model", "model":
    "path/to/small-model", "num_speculative_tokens": 4} or {"method": "eagle3" (or "eagle"),
    "model": "path/to/eagle-head", "num_speculative_tokens": 4}. None: off. With overlap scheduling,
    a request with a verify chunk in flight is not scheduled ahead (its next proposals need
    its kept tokens); one whose proposals keep failing decodes ahead for a while."""

    def __post_init__(self) -> None:
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)} (or none), not {self.quantization!r}"
            )
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format must be auto or dummy, not {self.load_format!r}")
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, not {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages must be >= 2, not {self.num_pages}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"gpu_memory_fraction must be in (0, 1], not {self.gpu_memory_fraction}")
        if self.hold_ahead_ms < 0:
            raise ConfigError(f"hold_ahead_ms must be >= 0, not {self.hold_ahead_ms}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be fcfs or priority, not {self.scheduling_policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.default_chat_template_kwargs is not None:
            try:
                check_kwargs(self.default_chat_template_kwargs, "default_chat_template_kwargs")
            except RequestError as e:
                raise ConfigError(str(e)) from None
        if not 0 <= self.host_kv_cache_gb < float("inf"):
            raise ConfigError(f"host_kv_cache_gb must be >= 0 (0: no host tier), not {self.host_kv_cache_gb}")
        if self.host_kv_cache_gb and not self.enable_prefix_caching:
            raise ConfigError("host_kv_cache_gb keeps the prefix cache's evicted pages: it needs prefix caching on")
        if self.grammar_compile_timeout <= 0 or self.grammar_compile_memory_mb < 1 or self.grammar_compile_workers < 1:
            raise ConfigError("grammar_compile_timeout must be > 0, grammar_compile_memory_mb and "
                              "grammar_compile_workers >= 1")

        if self.tensor_parallel_size < 1 or self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError("tensor_parallel_size and nnodes must be >= 1, and 0 <= node_rank < nnodes")
        if self.tensor_parallel_size % self.nnodes:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of "
                              f"nnodes={self.nnodes} (each node runs as many ranks)")
        self.lora_modules = tuple(self.lora_modules)
        names = [name for name, _ in self.lora_adapters]
        if len(set(names)) != len(names):
            raise ConfigError(f"lora_modules: each adapter needs a name of its own, not {', '.join(names)}")

    @property
    def lora_adapters(self) -> list[tuple[str, str]]:  # (in the order given: adapter k is the k-th)
        out = []
        for entry in self.lora_modules:
            name, sep, path = entry.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ConfigError(f"lora_modules: {entry!r} is not NAME=PATH")
            out.append((name.strip(), path.strip()))
        return out

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    """Keys accepted as `Authorization: Bearer KEY` (empty: no key needed)."""
    served_model_name: str | None = None
    max_queue: int = 1024
    """Waiting requests beyond this are answered 503 with Retry-After."""
    session_idle_timeout: float = 600.0
    responses_store_mb: int = 256
    """Memory for stored /v1/responses (server/response_store.py); 0: none (store: true refused)."""
    cache_isolation: str = "none"
    """none: one prefix cache for everyone; a request's cache_salt alone namespaces it.
    per-key: every request is also salted by (a hash of) the API key it authenticated with,
    so tenants of different keys never share cached KV (nor learn, from cached_tokens or
    timing, what another tenant's prompts were). Needs api_keys."""
    request_timeout: float | None = None
    """Seconds a request may take from its arrival at the engine to its end (None: no limit);
    also the cap of a request's own `timeout` field. See SamplingParams.timeout."""
    generation_config: str = "auto"
    """Where the sampling fields a request omits (temperature, top_p, top_k, repetition_penalty,
    min_p) take their values: auto, the model folder's generation_config.json where it gives
    them (engine/generation_config.py), else streamer's defaults; none: streamer's defaults."""
    # ---- hostile input (server/limits.py, server/guard.py, server/transport.py) ----
    max_request_bytes: int = 8 << 20
    """An HTTP body (413 beyond it) or a WebSocket message (closed with 1009)."""
    max_prompt_chars: int | None = None
    """Characters of text prompt per request (prompts, message contents, texts summed),
    checked before tokenizing. None: 32 per token of the model's context."""
    max_stop: int = 16
    """Stop strings, and stop token ids, per request (each list)."""
    max_stop_chars: int = 128
    """Characters of one stop string (they are searched at every token)."""
    max_logit_bias: int = 300
    max_choices: int = 256
    """guided_choice / choices entries."""
    max_messages: int = 1024
    """Messages of one chat (request, WebSocket session, /apply_chat_template conversation)."""
    max_conversations: int = 256
    """Conversations of one /apply_chat_template."""
    max_batch: int = 256
    """Engine requests one HTTP request may start (prompts x n; /generate and /tokenize lists)."""
    max_n: int = 64
    max_connections: int | None = None
    """Open connections (HTTP and WebSocket); beyond it a new one gets 503 and is closed.
    None: 2048, or fewer where the process may open fewer files (RLIMIT_NOFILE)."""
    timeout_idle_connection: float = 10.0
    """Seconds a connection may take to send a complete request head, from its opening or
    from the end of the previous response (uvicorn's keep-alive); then it is closed."""
    timeout_request_body: float = 60.0
    """Seconds a request's body may take to arrive after its head (408 beyond it)."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header names ("*": any). None: the loopback names when bound to a loopback
    address, any host otherwise."""
    allowed_origins: tuple[str, ...] | None = None
    """WebSocket Origins ("*": any). None: same origin as the Host, and loopback pages
    when bound to a loopback address."""
    engine_process: bool | None = None
    """`streamer serve` runs the engine in a process of its own (engine/remote.py): the
    server's HTTP/SSE work and the engine's actors do not share one event loop and GIL.
    None: a process of its own when the engine runs on CUDA (where the GPU waits whenever
    the host falls behind), in the server's process on CPU (where the model's compute
    takes the cores, and a second process would only add its ~350 MB)."""
    tool_call_parser: str = "auto"
    """The markup of tool calls in the model's output: hermes, llama3_json, mistral, openai
    (gpt-oss's harmony messages to functions.NAME), deepseek_v3 (DeepSeek-V3, V3-0324,
    R1-0528) or deepseek_v31 (V3.1 and later), or auto (from the chat template: openai for a
    harmony one, a deepseek format for one that writes DeepSeek's markers; another template
    that does not read tools gets hermes)."""
    trust_request_chat_template: bool = False
    """Whether a chat request may bring its own chat_template (vLLM's extension; a Jinja template is
    code the server runs, sandboxed: off by default, and a request's template is then refused)."""
    reasoning_parser: str | None = None
    """qwen3 | deepseek_r1: the model's <think> text is answered as reasoning_content, and
    grammars (response_format, tools) apply from its end. openai_gptoss: gpt-oss's analysis
    messages are the reasoning, its final message the content (no grammars: refused). None:
    all text is content (there is no auto: a gpt-oss server names openai_gptoss)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    data_parallel_size: int = 1
    """Engine replicas, each an engine process with the same EngineConfig (and its own
    devices), behind the cache-aware router of streamer/router/ (DataParallelEngine)."""
    balance_margin: int = BALANCE_MARGIN
    """With data_parallel_size > 1: open requests by which the replica that holds a prompt's
    prefix may exceed the least loaded replica and still get it (router/policy.py)."""

    def __post_init__(self) -> None:
        if self.responses_store_mb < 0:
            raise ConfigError(f"responses_store_mb (--responses-store-mb) must be >= 0, not {self.responses_store_mb}")
        if self.data_parallel_size < 1 or self.balance_margin < 0:
            raise ConfigError(f"data_parallel_size must be >= 1 and balance_margin >= 0, not "
                              f"{self.data_parallel_size} and {self.balance_margin}")
        if self.data_parallel_size > 1 and self.engine_process is False:
            raise ConfigError("--data-parallel-size runs each replica in an engine process of its own: "
                              "it cannot be combined with --no-engine-process")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"not {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} (or none), "
                              f"not {self.reasoning_parser!r}")
        if self.cache_isolation not in CACHE_ISOLATIONS:
            raise ConfigError(f"cache_isolation must be one of {', '.join(CACHE_ISOLATIONS)}, "
                              f"not {self.cache_isolation!r}")
        if self.cache_isolation == "per-key" and not self.api_keys:
            raise ConfigError("--cache-isolation per-key salts the prefix cache by API key: give the keys "
                              "with --api-key (repeated, or comma-separated)")
        if any(not k for k in self.api_keys):
            raise ConfigError("an API key must not be empty")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ConfigError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, "
                              f"not {self.generation_config!r}")
        if self.request_timeout is not None and not 0 < self.request_timeout < float("inf"):
            raise ConfigError(f"request_timeout must be a positive number of seconds, not {self.request_timeout}")
