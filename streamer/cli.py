"""`streamer serve | generate | bench | models`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from streamer.config import QUANTIZATIONS, EngineConfig
from streamer.errors import StreamerError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default", help="local HF model folder, a .gguf file (converted once into the cache), "
                   "or 'default' (SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                   help="fp8: float8 weights and per-token float8 activations in the linear layers (W8A8); "
                   "awq, awq_marlin, gptq, gptq_marlin, compressed-tensors, mxfp4: the checkpoint's own format, "
                   "checked (quantized checkpoints run as stored without it too)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache dtype (auto: the model's; fp8: float8 e4m3, half the memory per token)")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the config's shapes (benchmarks)")
    g.add_argument("--cache-dir", default=None, help="where the default model and converted GGUF files are kept (env STREAMER_CACHE_DIR)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--num-pages", type=int, default=None, help="fixed KV pool size in pages")
    g.add_argument("--gpu-memory-fraction", type=float, default=0.85, help="share of GPU memory for weights + KV")
    g.add_argument("--cpu-kv-bytes", type=int, default=512 << 20, help="KV pool bytes on CPU")
    g.add_argument("--host-kv-cache-gb", type=float, default=0.0,
                   help="GiB of host memory under the prefix cache: evicted KV pages go there, not away (0: off)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="cap on running requests")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="priority: waiting requests by their priority (lower first), then arrival; preemption "
                        "takes the last of that order (default fcfs: first come, first served)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn the radix cache off")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly (no CUDA graphs)")
    g.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served beside the base model: a request whose model is "
                        "NAME runs with that adapter")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="LoRA adapters may be loaded and unloaded while serving (POST /v1/load_lora_adapter, "
                        "/v1/unload_lora_adapter): any folder the server can read")
    g.add_argument("--cuda-graph-max-bs", type=int, default=512,
                   help="largest decode batch replayed from a CUDA graph, capped at --max-num-seqs "
                   "(larger ones run eagerly)")
    g.add_argument("--cuda-graph-max-tokens", type=int, default=2048,
                   help="longest prefill / mixed step replayed from a CUDA graph (0: decode graphs only)")
    g.add_argument("--hold-ahead-ms", type=float, default=1.5,
                   help="while only decodes run, schedule the next batch this long before the running step's "
                        "predicted end, so that arrivals join it (0: schedule it at once)")
    g.add_argument("--no-decode-gemv", action="store_true",
                   help="linear layers of batch-1 decode steps use cuBLAS, not the Triton GEMV")
    g.add_argument("--seed", type=int, default=0, help="seed of the unseeded sampling and dummy weights")
    g.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="seconds one structured-output grammar may take to compile; past it the compilation "
                        "is killed and the request refused (default 10)")
    g.add_argument("--grammar-compile-memory-mb", type=int, default=2048,
                   help="memory one grammar compilation may take; past it likewise (default 2048)")
    g.add_argument("--grammar-compile-workers", type=int, default=2,
                   help="grammar compilations at once, each in a process of its own (default 2)")
    g.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template that replaces the model's (tools, reasoning and chat prompts)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N ranks (one GPU each; gloo processes on CPU)")
    g.add_argument("--default-chat-template-kwargs", type=_json_object, metavar="JSON",
                   help='variables of every chat prompt\'s template, e.g. \'{"enable_thinking": false}\'; '
                        "a request's chat_template_kwargs win over them")
    g.add_argument("--speculative-config", metavar="JSON", default=None,
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\', \'{"method": "draft_model", "model": PATH}\' or '
                        '\'{"method": "eagle3" (or "eagle"), "model": HEAD}\'; ngram '
                        'also takes "prompt_lookup_min" and "exact_verify" (README: speculative decoding)')


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw["enable_prefix_caching"] = not args.no_prefix_caching
    kw["cuda_graphs"] = not args.no_cuda_graphs
    kw["decode_gemv"] = not args.no_decode_gemv
    return EngineConfig(**kw)


def cmd_generate(args: argparse.Namespace) -> None:
    from streamer.engine.llm import LLM
    from streamer.messages import SamplingParams

    cfg = engine_config(args)
    with LLM(**{f.name: getattr(cfg, f.name) for f in fields(EngineConfig)}) as llm:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sample_seed)
        for prompt in args.prompt:
            if args.chat:
                out = llm.chat([{"role": "user", "content": prompt}], params)
            else:
                out = llm.generate(prompt, params)[0]
            if out.error:
                raise StreamerError(out.error)
            print(f"### {prompt}\n{out.text}\n[{out.completion_tokens} tokens, {out.finish_reason}]")


def cmd_models(args: argparse.Namespace) -> None:
    from streamer.model.default_model import default_model_dir, is_ready
    from streamer.model.gguf import converted_folders, is_current
    from streamer.model.source import DEFAULT, is_gguf, resolve_model

    if args.action == "pull":
        source = args.source or DEFAULT
        if source != DEFAULT and not is_gguf(source):
            raise StreamerError(f"models pull: {source}: a folder is used in place; pull takes 'default' or a .gguf file")
        # (the progress to stderr: stdout is the folder alone, for scripts)
        print(resolve_model(source, args.cache_dir, log=lambda line: print(line, file=sys.stderr)))
        return
    if args.source is not None:
        raise StreamerError(f"models list takes no model ({args.source!r})")
    d = default_model_dir(args.cache_dir)
    print(f"default  {d}  {'ready' if is_ready(d) else 'not fetched (streamer models pull)'}")
    for folder, stamp in converted_folders(args.cache_dir):
        source = Path(stamp["path"])
        state = ("current" if is_current(folder, source) else "source changed: converted again at next use"
                 ) if source.is_file() else "source missing"
        print(f"gguf     {folder}  from {source}  {state}")


def cmd_serve(args: argparse.Namespace) -> None:
    from streamer.server.serve import serve

    config = engine_config(args)
    if config.node_rank > 0:  # a tensor-parallel engine's other node: its ranks alone, no server
        from streamer.distributed.launch import run_node
        from streamer.engine.engine import resolve_model_path

        run_node(config, resolve_model_path(config))
        return
    config.grammar_prestart = True  # a server's first structured request should not wait for it
    serve(args, config)


def cmd_bench(args: argparse.Namespace) -> None:
    from streamer.bench import main as bench_main

    bench_main(args)


def cmd_router(args: argparse.Namespace) -> None:
    from streamer.router.http import run_router

    run_router(args)


def _unavailable(sub: argparse.ArgumentParser, error: ImportError) -> None:
    """A subcommand whose module cannot be imported (a broken or partial install) fails with the
    import error, not with argparse's 'unrecognized arguments' about its own flags (main lets
    unknown arguments through for it)."""

    def fail(_args: argparse.Namespace) -> None:
        raise StreamerError(f"this install cannot run `streamer {sub.prog.split()[-1]}`: {error}")

    sub.set_defaults(func=fail, unavailable=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamer", description="An async streaming LLM inference server.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate offline from prompts")
    add_engine_args(g)
    g.add_argument("prompt", nargs="+", help="prompt text(s)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="fetch or list models")
    m.add_argument("action", choices=["pull", "list"])
    m.add_argument("source", nargs="?", default=None,
                   help="pull: 'default' (the default) or a .gguf file, converted into the cache")
    m.add_argument("--cache-dir", default=None)
    m.set_defaults(func=cmd_models)

    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP + WebSocket server")
    add_engine_args(s)
    s.add_argument("--nnodes", type=int, default=1,
                   help="hosts a tensor-parallel engine spans (each runs serve with the same flags; "
                        "MASTER_ADDR/MASTER_PORT: node 0)")
    s.add_argument("--node-rank", type=int, default=0, help="this host's index among --nnodes (0 serves)")
    s.set_defaults(func=cmd_serve)
    try:
        from streamer.server.serve import add_server_args

        add_server_args(s)
    except ImportError as e:
        _unavailable(s, e)

    b = sub.add_parser("bench", help="benchmarks (offline / serve)")
    b.set_defaults(func=cmd_bench)
    try:
        from streamer.bench import add_bench_args

        add_bench_args(b)
    except ImportError as e:
        _unavailable(b, e)

    r = sub.add_parser("router", help="route OpenAI requests across `streamer serve` hosts (cache-aware)")
    from streamer.router.http import add_router_args

    add_router_args(r)
    r.set_defaults(func=cmd_router)
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        args.func(args)
    except StreamerError as e:
        print(f"streamer: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
