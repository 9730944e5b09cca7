"""The prompts of `streamer bench serve`'s workloads (see serve.py) and their request bodies."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

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
