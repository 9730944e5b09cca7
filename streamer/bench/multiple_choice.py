"""`streamer bench select` (W6): multiple-choice questions over a shared 5-shot prefix,
answered with the frontend language's select.

  streamer bench select                  # 200 questions, default model, 4 choices each
  streamer bench select -n 50            # fewer (a slow CPU)
  streamer bench select --json out.json

Two runs over the same questions, each on a fresh engine:
  language   the frontend language: one select per question, all programs through
             run_batch (--parallel at once), prefix caching on. Each select scores its
             choices in one batched prefill; the 5-shot prefix comes from the radix cache.
  baseline   the same scoring requests (prompt = prefix + question + choice,
             max_tokens=1, prompt_logprobs_from = the shared position) sent one at a time
             and awaited one by one, prefix caching off.
Reported: wall time of each, speed-up, the language run's prefix-cache hit rate
(cached / prompt tokens), its mean and largest batch, and how often both runs
chose the same answer (they score the same tokens, so they should agree).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from streamer.lang import EngineBackend, function, select
from streamer.lang.scoring import common_prefix
from streamer.messages import SamplingParams

INSTRUCTION = "Answer each arithmetic question by choosing the correct option.\n\n"


def question(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    op = rng.choice("+-")
    right = a + b if op == "+" else a - b
    wrong = {right + d for d in (rng.choice((-10, 10)), rng.choice((-1, 1)), rng.choice((-11, 11, 2)))}
    options = sorted({right, *wrong} - {right})[:3] + [right]
    rng.shuffle(options)
    return f"Q: {a} {op} {b} = ?\nOptions: {', '.join(map(str, options))}\nA:", [f" {o}" for o in options], \
        options.index(right)


def workload(n: int, seed: int = 0) -> tuple[str, list[tuple[str, list[str], int]]]:
    rng = random.Random(seed)
    shots = [question(rng) for _ in range(5)]
    prefix = INSTRUCTION + "".join(f"{q}{c[i]}\n\n" for q, c, i in shots)
    return prefix, [question(rng) for _ in range(n)]


@function
def answer(s, prefix, q, choices, commit=True):
    s += prefix + q
    s += select("answer", choices, commit=commit)


def run_language(args, prefix, qs) -> dict:
    from streamer.engine.llm import LLM

    with LLM(args.model, enable_prefix_caching=True, load_format=args.load_format, gpu_memory_fraction=0.4) as llm:
        llm.generate(["Warm-up: an unrelated prompt."], SamplingParams(max_tokens=2))
        before = llm.stats()
        t0 = time.perf_counter()
        states = answer.run_batch([{"prefix": prefix, "q": q, "choices": c, "commit": not args.no_commit}
                                   for q, c, _ in qs],
                                  backend=EngineBackend(llm), parallel=args.parallel)
        wall = time.perf_counter() - t0
        after = llm.stats()
    errors = [st.error for st in states if st.error is not None]
    if errors:
        raise errors[0]
    prompt = after.prompt_tokens_total - before.prompt_tokens_total
    cached = after.cached_tokens_total - before.cached_tokens_total
    steps = after.steps - before.steps
    return {
        "wall_s": wall, "picks": [c.index(st["answer"]) for st, (_, c, _) in zip(states, qs)],
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
        "steps": steps, "requests": after.requests_finished - before.requests_finished,
        "max_batch_size": after.max_batch_size,
    }


def run_baseline(args, prefix, qs) -> dict:
    from streamer.engine.llm import LLM

    with LLM(args.model, enable_prefix_caching=False, load_format=args.load_format, gpu_memory_fraction=0.4) as llm:
        llm.generate(["Warm-up: an unrelated prompt."], SamplingParams(max_tokens=2))
        tok = llm.tokenizer
        picks = []
        t0 = time.perf_counter()
        for q, choices, _ in qs:
            base = tok(prefix + q)["input_ids"]
            full = [tok(prefix + q + c)["input_ids"] for c in choices]
            k = max(1, min(common_prefix(base, f) for f in full))
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs_from=k)
            scores = [sum(llm.generate([f], params)[0].prompt_logprobs or []) for f in full]
            picks.append(max(range(len(scores)), key=scores.__getitem__))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "picks": picks}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-n", "--num-questions", type=int, default=200, help="questions (default 200)")
    ap.add_argument("--model", default="default",
                    help="a local HF folder, a .gguf file, or default (SmolLM2-135M-Instruct)")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights (GPU machine, no checkpoint)")
    ap.add_argument("--parallel", type=int, default=64, help="programs run at once by run_batch")
    ap.add_argument("--no-commit", action="store_true",
                    help="select without first prefilling the shared text (choices then compute it each)")
    ap.add_argument("--no-baseline", action="store_true", help="only the language run")
    ap.add_argument("--json", help="write the results here")


def main(args: argparse.Namespace) -> None:
    prefix, qs = workload(args.num_questions)
    lang = run_language(args, prefix, qs)
    base = run_baseline(args, prefix, qs) if not args.no_baseline else {"wall_s": float("nan"), "picks": []}
    n = len(qs)
    agree = sum(a == b for a, b in zip(lang["picks"], base["picks"])) / n
    correct = sum(p == right for p, (_, _, right) in zip(lang["picks"], qs)) / n
    result = {
        "questions": n, "choices_per_question": len(qs[0][1]), "parallel": args.parallel,
        "language_s": round(lang["wall_s"], 3), "baseline_s": round(base["wall_s"], 3),
        "speedup": round(base["wall_s"] / lang["wall_s"], 2),
        "questions_per_s": round(n / lang["wall_s"], 2),
        "hit_rate": round(lang["hit_rate"], 4), "cached_tokens": lang["cached_tokens"],
        "prompt_tokens": lang["prompt_tokens"], "mean_batch": round(lang["requests"] / max(lang["steps"], 1), 2),
        "max_batch_size": lang["max_batch_size"], "agreement": agree, "accuracy": correct,
    }
    print(f"W6 select: {n} questions x {result['choices_per_question']} choices, 5-shot prefix "
          f"({len(prefix)} chars)\n"
          f"  language (cache on, batched)  {lang['wall_s']:8.2f} s  ({result['questions_per_s']} q/s)\n"
          f"  baseline (cache off, serial)  {base['wall_s']:8.2f} s\n"
          f"  speed-up {result['speedup']}x; prefix-cache hit rate {lang['hit_rate']:.1%} "
          f"({lang['cached_tokens']}/{lang['prompt_tokens']} prompt tokens); "
          f"requests per step {result['mean_batch']} (max batch {lang['max_batch_size']})\n"
          f"  answers agree {agree:.1%}; accuracy {correct:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
