"""`streamer bench grammar`: the cost of JSON-schema constrained decoding, time per output
token vs unconstrained, the effect of jump-forward, and the grammar work per token (bitmask
fill, mask apply).

  streamer bench grammar                       # GPU: batch 64, default model
  streamer bench grammar --model /path/to/hf   # any local HF folder
  streamer bench grammar --smoke               # CPU smoke check (batch 4, 24 tokens)
  streamer bench grammar --model benchmarks/configs/smollm2-135m --load-format dummy \
      --tokenizer DIR                          # shapes only + a tokenizer folder (GPU box
                                               # without the cached model)

Runs, each one batch of --batch requests submitted at once (temperature 0.7, seed i):
  unconstrained      ignore_eos, exactly --max-tokens each
  json (jf on)       the schema below, jump-forward on (the default)
  json (jf off)      the same with jump-forward off:
                     batches are scheduled ahead, masks filled while the forward runs
Then, off the engine, the constrained outputs are replayed through fresh matchers
to time fill_bitmask for the whole batch per step (us per constrained row = per
output token), and apply_bitmask on a [batch, vocab] logits tensor on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from streamer.messages import GrammarSpec, SamplingParams

if TYPE_CHECKING:  # (torch and the engine are imported when a run starts, not with the CLI)
    import torch

    from streamer.engine.llm import LLM
    from streamer.sampling.grammar_compiler import GrammarCompiler

# Long enough that a batch stays full for a while (8 records), small enough to end.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "records": {
            "type": "array",
            "minItems": 8,
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "name": {"type": "string", "maxLength": 16},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "score": {"type": "number", "minimum": 0, "maximum": 1},
                    "active": {"type": "boolean"},
                },
                "required": ["id", "name", "kind", "score", "active"],
            },
        },
    },
    "required": ["title", "records"],
}
PROMPT = "Here is a JSON list of eight records describing team members:\n"


def run(llm: LLM, n: int, params: SamplingParams | list[SamplingParams]) -> dict:
    plist = params if isinstance(params, list) else [params] * n
    s0 = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate([PROMPT] * n, plist)
    wall = time.perf_counter() - t0
    s1 = llm.stats()
    toks = sum(len(o.token_ids) for o in outs)
    steps = s1.steps - s0.steps
    reasons: dict[str, int] = {}
    for o in outs:
        reasons[o.finish_reason or "?"] = reasons.get(o.finish_reason or "?", 0) + 1
    return {
        "wall_s": wall,
        "output_tokens": toks,
        "steps": steps,
        "ms_per_token": 1e3 * wall / max(toks, 1),
        "ms_per_step": 1e3 * wall / max(steps, 1),
        "tokens_per_s": toks / wall,
        "jump_forward_tokens": s1.jump_forward_tokens - s0.jump_forward_tokens,
        # per step: the device computing, and the device waiting for the host (between steps or
        # for grammar masks) while work was in flight
        "device_busy_ms_per_step": 1e3 * (s1.device_busy_s - s0.device_busy_s) / max(steps, 1),
        "device_idle_ms_per_step": 1e3 * (s1.device_idle_s - s0.device_idle_s) / max(steps, 1),
        "finish_reasons": reasons,
        "outputs": outs,
    }


def valid_json(outs, schema) -> int:
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    ok = 0
    for o in outs:
        try:
            v = json.loads(o.text)
            if jsonschema is not None:
                jsonschema.validate(v, schema)
            ok += 1
        except Exception:  # noqa: BLE001
            pass
    return ok


def mask_fill_replay(compiler: GrammarCompiler, spec: GrammarSpec, outs, vocab: int) -> dict:
    """Replay the outputs through fresh matchers: time fill_bitmask per step of the batch, and
    count the tokens the grammar rejects (0 when every step's mask was applied)."""
    from streamer.sampling.grammar import fill_bitmask

    seqs = [list(o.token_ids) for o in outs]
    states = [compiler.state_for(spec) for _ in seqs]
    per_step, rows_filled, rejected = [], 0, 0
    for t in range(max(len(s) for s in seqs)):
        active = [st if t < len(seq) else None for st, seq in zip(states, seqs)]
        n = sum(a is not None for a in active)
        if n == 0:
            break
        t0 = time.perf_counter()
        fill_bitmask(active, vocab)
        per_step.append(time.perf_counter() - t0)
        rows_filled += n
        for st, seq in zip(states, seqs):
            if t < len(seq) and not st.rejected:
                rejected += not st.accept(seq[t])
    total = sum(per_step)
    return {
        "fill_us_per_token": 1e6 * total / max(rows_filled, 1),
        "fill_ms_per_step_mean": 1e3 * statistics.mean(per_step) if per_step else 0.0,
        "fill_ms_per_step_max": 1e3 * max(per_step) if per_step else 0.0,
        "steps_replayed": len(per_step),
        "outputs_rejected": rejected,
    }


def apply_timing(batch: int, vocab: int, device: torch.device, iters: int = 50) -> dict:
    import torch

    from streamer.sampling.sampler import apply_bitmask

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g).to(device)
    mask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    rows = list(range(batch))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        apply_bitmask(logits.clone(), mask, rows=rows)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        apply_bitmask(logits, mask, rows=rows)  # includes the host-to-device copy of the mask
    sync()
    return {"apply_ms_per_step": 1e3 * (time.perf_counter() - t0) / iters}


def with_tokenizer(model: str, tokenizer: str) -> str:
    """A temporary folder: the model folder's files, plus the tokenizer folder's tokenizer files."""
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="grammar-bench-"))
    for src in (Path(model), Path(tokenizer)):
        for f in src.iterdir():
            if src == Path(tokenizer) and not (f.name.startswith("tokenizer") or f.name.endswith(".jinja")):
                continue
            dst = out / f.name
            if dst.exists():
                dst.unlink()
            dst.symlink_to(f.resolve())
    return str(out)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="default",
                    help="a local HF folder, a .gguf file, or default (SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, default=64, help="requests submitted at once (default 64)")
    ap.add_argument("--max-tokens", type=int, default=320, help="per request (default 320)")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights of the config's shapes")
    ap.add_argument("--dtype", default="auto", help="weights and KV dtype (auto: bfloat16 on CUDA)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="eager steps only (compare)")
    ap.add_argument("--tokenizer", default=None, help="folder with tokenizer files to pair with --model")
    ap.add_argument("--repeats", type=int, default=3,
                    help="unconstrained and JSON (jf off) runs, alternated; the median of each is reported "
                         "(one run of ~0.6 s is at the mercy of host noise: +2%% to +22%% seen on the H200)")
    ap.add_argument("--smoke", action="store_true", help="tiny run for a CPU check")
    ap.add_argument("--profile-host", action="store_true",
                    help="then one more JSON (jf off) run under a stack sampler: where each thread's time goes")
    ap.add_argument("--json", default=None, help="write the results here")


def main(args: argparse.Namespace) -> None:
    from streamer.engine.llm import LLM
    from streamer.sampling.grammar_compiler import GrammarCompiler

    if args.smoke:
        args.batch, args.max_tokens = 4, 24
    model = args.model
    if args.tokenizer:
        from streamer.model.source import resolve_model

        model = with_tokenizer(str(resolve_model(model)), args.tokenizer)
    llm = LLM(
        model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        cuda_graphs=not args.no_cuda_graphs,
    )
    try:
        device = llm.engine.runner.device
        vocab = llm.engine.runner.hf_config.vocab_size
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
        compiler: GrammarCompiler = llm.engine.tokenizer.grammars
        fresh = GrammarCompiler(llm.tokenizer, vocab)
        t0 = time.perf_counter()
        fresh.compile(spec)
        compile_ms = 1e3 * (time.perf_counter() - t0)

        n, mt = args.batch, args.max_tokens
        # warm up (graphs, kernels) at the timed batch size: with a warm-up of 2 rows the
        # first timed run was slow on two machines (its pair read -33% and -39%); Triton
        # specializes integer arguments on divisibility by 16, so batch 2 does not compile
        # every variant that batch 64 runs
        warm = [SamplingParams(temperature=0.7, seed=i, max_tokens=4, ignore_eos=True) for i in range(n)]
        llm.generate([PROMPT] * n, warm)
        llm.generate([PROMPT] * 2, SamplingParams(max_tokens=4, grammar=spec))
        base_params = [SamplingParams(temperature=0.7, seed=i, max_tokens=mt, ignore_eos=True) for i in range(n)]
        grammar_params = [
            SamplingParams(temperature=0.7, seed=i, max_tokens=mt, grammar=spec) for i in range(n)
        ]
        # the engine switches jump-forward off under CUDA graphs (on its scheduler instance):
        # set it on the instance both ways, so "jf on" really jumps (and is not scheduled
        # ahead), and run a JSON warm-up first (xgrammar's first use is not timed)
        sched = llm.engine.scheduler
        engine_default = sched.jump_forward
        run(llm, min(n, 4), grammar_params[:4])
        try:
            sched.jump_forward = True
            jf_on = run(llm, n, grammar_params)
            sched.jump_forward = False
            bases, offs = [], []
            for _ in range(max(1, args.repeats)):
                bases.append(run(llm, n, base_params))
                offs.append(run(llm, n, grammar_params))
        finally:
            sched.jump_forward = engine_default

        def median(runs: list[dict]) -> dict:
            return sorted(runs, key=lambda r: r["ms_per_token"])[len(runs) // 2]

        base, jf_off = median(bases), median(offs)
        overhead = jf_off["ms_per_token"] / base["ms_per_token"] - 1
        fill = mask_fill_replay(compiler, spec, jf_off["outputs"], vocab)
        apply = apply_timing(n, vocab, device)

        rows = [("unconstrained", base), ("json (jf on)", jf_on), ("json (jf off)", jf_off)]
        print(f"model={args.model} device={device} batch={n} max_tokens={mt} vocab={vocab}")
        print(
            f"{'run':15s} {'tokens':>7s} {'steps':>6s} {'ms/tok':>8s} {'ms/step':>8s} {'busy':>6s} {'idle':>6s} "
            f"{'tok/s':>8s} {'jumped':>7s}  finish"
        )
        for name, r in rows:
            print(
                f"{name:15s} {r['output_tokens']:7d} {r['steps']:6d} {r['ms_per_token']:8.3f} "
                f"{r['ms_per_step']:8.2f} {r['device_busy_ms_per_step']:6.2f} {r['device_idle_ms_per_step']:6.2f} "
                f"{r['tokens_per_s']:8.1f} {r['jump_forward_tokens']:7d}  {r['finish_reasons']}"
            )
        each = ", ".join(f"{100 * (o['ms_per_token'] / b['ms_per_token'] - 1):+.1f}%" for b, o in zip(bases, offs))
        print(f"JSON (jf off) against unconstrained, medians of {len(bases)} alternated runs: "
              f"{100 * overhead:+.1f}% (each pair: {each})")
        print(
            f"valid JSON: jf on {valid_json(jf_on['outputs'], SCHEMA)}/{n}, "
            f"jf off {valid_json(jf_off['outputs'], SCHEMA)}/{n}; "
            f"jf off outputs the grammar rejects on replay: {fill['outputs_rejected']}/{n}"
        )
        print(
            f"schema compile {compile_ms:.1f} ms; mask fill {fill['fill_us_per_token']:.1f} us/token "
            f"({fill['fill_ms_per_step_mean']:.3f} ms/step mean, {fill['fill_ms_per_step_max']:.3f} max, "
            f"batch {n}); apply_bitmask {apply['apply_ms_per_step']:.3f} ms/step [{n}x{vocab}] on {device.type}"
        )
        if args.profile_host:
            from streamer.bench.stacks import StackSampler

            sched.jump_forward = False
            with StackSampler() as sampler:
                r = run(llm, n, grammar_params)
            sched.jump_forward = engine_default
            print(f"\nprofiled JSON (jf off) run: {r['ms_per_step']:.2f} ms/step")
            sampler.report(top=18)
        if args.json:
            result = {
                "model": args.model,
                "device": str(device),
                "batch": n,
                "max_tokens": mt,
                "schema_compile_ms": compile_ms,
                "repeats": len(bases),
                "overhead_jf_off": overhead,
                "ms_per_token_runs": {"unconstrained": [r["ms_per_token"] for r in bases],
                                      "json (jf off)": [r["ms_per_token"] for r in offs]},
                **{k: {kk: vv for kk, vv in r.items() if kk != "outputs"} for k, r in rows},
                **fill,
                **apply,
            }
            Path(args.json).write_text(json.dumps(result, indent=2))
    finally:
        llm.close()
