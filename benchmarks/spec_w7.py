"""W7: batch-1 latency on an input-grounded workload, with and without speculative decoding.

    python3 benchmarks/spec_w7.py [--model default|DIR|FILE.gguf] [--speculative-config JSON]
                                  [--num-prompts N] [--max-tokens N] [--json OUT] [--tiny] [--prediction]

Each prompt asks the chat model to rewrite a piece of code with one change ("rename x to y"),
its answer opened with a code fence, so the answer copies long spans of the prompt: what prompt-lookup (ngram) proposals predict.
The same prompts run one at a time (batch 1) through two engines in one run, one plain (its
defaults: overlap scheduling, CUDA graphs) and one with speculation; each reports ms per
output token (first token to last, over all prompts), the mean time to first token, the
engine steps, and for speculation its acceptance rate and mean accepted length. Greedy
outputs must be identical token for token: the mismatches are counted and printed.

--prediction adds a third run: speculation with each request's code as its prediction
(SamplingParams.prediction, OpenAI's Predicted Outputs: the file being edited), whose
outputs must be the plain ones too.

Real weights make acceptance real (the default model, or a GGUF of it carried in ignored
folders); --load-format dummy measures the verify step's cost only (random weights copy no
prompt). --tiny: 2 prompts of 48 tokens, for a CPU check that the script works.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'

SNIPPETS = [
    ("total", "amount", '''def total(items):
    """The sum of the prices of the items, with tax."""
    result = 0.0
    for item in items:
        price = item["price"] * item.get("quantity", 1)
        if item.get("taxable", True):
            price = price * 1.2
        result += price
    return round(result, 2)


def cheapest(items):
    """The item with the lowest price, or None."""
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
'''),
    ("width", "w", '''class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def area(self):
        return self.width * self.height

    def perimeter(self):
        return 2 * (self.width + self.height)

    def scale(self, factor):
        return Rectangle(self.width * factor, self.height * factor)

    def __repr__(self):
        return f"Rectangle(width={self.width}, height={self.height})"
'''),
    ("lines", "rows", '''def read_table(path):
    """Rows of a comma-separated file, as lists of stripped fields."""
    lines = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            lines.append([field.strip() for field in line.split(",")])
    return lines


def column(lines, index):
    return [row[index] for row in lines if len(row) > index]
'''),
    ("count", "tally", '''def word_counts(text):
    count = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            count[word] = count.get(word, 0) + 1
    return count


def most_common(text, n=3):
    count = word_counts(text)
    ranked = sorted(count.items(), key=lambda pair: -pair[1])
    return ranked[:n]
'''),
]


def codes(n: int) -> list[str]:
    """Each prompt's code before the edit (its prediction with --prediction)."""
    return [SNIPPETS[i % len(SNIPPETS)][2] for i in range(n)]


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        old, new, code = SNIPPETS[i % len(SNIPPETS)]
        msg = f"Rename `{old}` to `{new}` in this code:\n```python\n{code}```"
        # the answer opens with the code block (as an assistant's would): the model then copies
        text = tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                             tokenize=False) + "```python\n"
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


async def _one_at_a_time(llm: Any, ps: list[list[int]], max_tokens: int, label: str,
                         top: int | None = None, predictions: list[str] | None = None) -> list[dict[str, Any]]:
    from streamer.messages import GenerateRequest, SamplingParams

    rows = []
    for i, p in enumerate(ps):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=top,
                                prediction=predictions[i] if predictions is not None else None)
        req = GenerateRequest(request_id=f"{label}-{i}", prompt_token_ids=p, params=params)
        t0 = time.perf_counter()
        t_first = None
        ids: list[int] = []
        tops: list[Any] = []
        async for out in llm.engine.submit(req):
            if out.error:
                raise RuntimeError(out.error)
            if out.token_ids and t_first is None:
                t_first = time.perf_counter()
            ids.extend(out.token_ids)
            tops.extend(t.top_logprobs for t in out.logprobs or [])
        rows.append(dict(ids=ids, ttft=(t_first or t0) - t0, decode_s=time.perf_counter() - (t_first or t0),
                         tops=tops))
    return rows


def run(model: str, ps: list[list[int]], args: argparse.Namespace, spec: str | None,
        predictions: list[str] | None = None) -> dict[str, Any]:
    from streamer import LLM, SamplingParams
    from streamer.engine.spec.report import spec_delta

    # (two engines live in this process one after the other: each a fixed pool: 2,048 pages hold 32k tokens, for one request at a time)
    kw: dict[str, Any] = dict(dtype=args.dtype, load_format=args.load_format, device=args.device, num_pages=2048,
                              max_model_len=max(len(p) for p in ps) + args.max_tokens + 16)
    if args.no_cuda_graphs:
        kw["cuda_graphs"] = False
    if args.no_overlap:
        kw["overlap_schedule"] = False
    label = "pred" if predictions is not None else "spec" if spec else "plain"
    with LLM(model, speculative_config=spec, **kw) as llm:
        llm.generate(ps[:1], SamplingParams(max_tokens=8, temperature=0))  # warm-up (compiles, graphs)
        llm.wait_idle()
        s0 = llm.stats()
        rows = llm.call(_one_at_a_time(llm, ps, args.max_tokens, label, 3 if args.diagnose else None, predictions))
        s1 = llm.stats()
    tokens = sum(max(len(r["ids"]) - 1, 0) for r in rows)
    res = dict(
        mode=label, speculative_config=spec, prompts=len(ps), output_tokens=sum(len(r["ids"]) for r in rows),
        ms_per_token=1e3 * sum(r["decode_s"] for r in rows) / max(tokens, 1),
        ttft_ms=1e3 * sum(r["ttft"] for r in rows) / len(rows), steps=s1.steps - s0.steps,
        outputs=[r["ids"] for r in rows], tops=[r["tops"] for r in rows],
    )
    res.update(spec_delta(s0, s1))
    return res


def _print_partings(plain: dict[str, Any], spec: dict[str, Any]) -> None:
    """Where a prompt's two outputs part: the top-3 (token, logprob) each run saw there. A gap
    between the top two below bf16's resolution (~1e-2 in logprob) is a near tie, which two
    kernels (decode against extend) may break either way."""
    for i, (a, b) in enumerate(zip(plain["outputs"], spec["outputs"])):
        if a == b:
            continue
        d = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ta = plain["tops"][i][d] if d < len(plain["tops"][i]) else None
        tb = spec["tops"][i][d] if d < len(spec["tops"][i]) else None
        print(f"W7 prompt {i} parts at token {d}: plain {a[d:d + 1]} top {ta}; spec {b[d:d + 1]} top {tb}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC, metavar="JSON")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-overlap", action="store_true", help="overlap scheduling off (both runs)")
    ap.add_argument("--tiny", action="store_true", help="2 prompts of 48 tokens (a CPU check)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--prediction", action="store_true",
                    help="a third run: speculation with each request's code as its prediction")
    ap.add_argument("--diagnose", action="store_true",
                    help="ask for the top-3 logprobs of every token (both runs) and print them where the outputs part")
    args = ap.parse_args()
    if args.tiny:
        args.num_prompts, args.max_tokens = 2, 48

    from streamer.config import EngineConfig
    from streamer.engine.engine import resolve_model_path
    from streamer.engine.tokenizer import load_tokenizer

    path = resolve_model_path(EngineConfig(model=args.model))
    ps = prompts(load_tokenizer(path, None), args.num_prompts)
    plain = run(str(path), ps, args, None)
    spec = run(str(path), ps, args, args.speculative_config)
    runs = [plain, spec]
    if args.prediction:
        runs.append(run(str(path), ps, args, args.speculative_config, codes(len(ps))))
    same = min(sum(a == b for a, b in zip(plain["outputs"], r["outputs"])) for r in runs[1:])
    if args.diagnose:
        _print_partings(plain, spec)
    summary = dict(
        workload="W7", model=args.model, identical_outputs=f"{same}/{len(ps)}",
        speedup=plain["ms_per_token"] / spec["ms_per_token"], plain=plain, spec=spec,
    )
    if args.prediction:
        summary.update(predicted=runs[2], prediction_speedup=plain["ms_per_token"] / runs[2]["ms_per_token"])
    for r in runs:
        extra = ""
        if "spec_acceptance_rate" in r:
            extra = (f"  acceptance {r['spec_acceptance_rate']:.2f}, "
                     f"{r['spec_mean_accepted_length']:.2f} tokens/verify")
        print(f"W7 {r['mode']:5} {r['output_tokens']:6d} tokens  {r['ms_per_token']:8.2f} ms/token  "
              f"TTFT {r['ttft_ms']:7.1f} ms  {r['steps']:5d} steps{extra}")
    print(f"W7 speedup {summary['speedup']:.2f}x, identical greedy outputs {summary['identical_outputs']}")
    if args.prediction:
        print(f"W7 with predictions: speedup {summary['prediction_speedup']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if same != len(ps):
        sys.exit(1)


if __name__ == "__main__":
    main()
