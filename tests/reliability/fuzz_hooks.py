"""Schemathesis hooks for the fuzz test (loaded through SCHEMATHESIS_HOOKS).

The fuzzer may generate any body, valid or not; these hooks only steer it:

- JSON Schema counts 1.0 as an integer, msgspec does not: integral floats in
  the integer fields become ints, so that more positive cases get past
  decoding and reach the engine (the float form is still covered by the
  negative cases, which must be answered 400);
- a random `model` name is dropped (it would be refused before anything else);
- generation is kept small on a 2-core CPU server: at most a few new tokens,
  few choices and few prompts per request. Values of the wrong type are left
  alone (they must still be answered 400, never 5xx);
- a numeric `timeout` is dropped: a request whose deadline passes is answered
  504 (request_timeout) by design, which the not-a-server-error check counts.
"""

from __future__ import annotations

from typing import Any

import schemathesis

MAX_NEW = 4
INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "seed", "top_k", "logprobs", "top_logprobs")


def _clamp(body: dict[str, Any], key: str, hi: int, default: int | None = None) -> None:
    v = body.get(key)
    if v is None and default is not None:
        body[key] = default
    elif isinstance(v, int) and not isinstance(v, bool) and v > hi:
        body[key] = hi


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    """map_case (not map_body): the coverage phase applies only case hooks."""
    body = getattr(case, "body", None)
    if isinstance(body, dict):
        case.body = steer(body)
    return case


def steer(body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    for key in INT_FIELDS:
        v = body.get(key)
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**62:
            body[key] = int(v)
    if isinstance(body.get("model"), str):
        del body["model"]
    if isinstance(body.get("timeout"), int | float) and not isinstance(body.get("timeout"), bool):
        del body["timeout"]
    _clamp(body, "max_tokens", MAX_NEW, default=MAX_NEW)
    _clamp(body, "max_completion_tokens", MAX_NEW)
    _clamp(body, "min_tokens", MAX_NEW)
    _clamp(body, "n", 2)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, list | str) for p in prompt):
        body["prompt"] = prompt[:4]
    return body
