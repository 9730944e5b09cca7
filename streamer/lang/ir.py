"""What a program appends to its state: plain text or one of these expressions.

  gen(name, ...)        generate text (optionally under a grammar) and store it as s[name]
  select(name, choices) pick the choice of highest log-likelihood (scored, not sampled)
  system/user/assistant(content)      one chat turn rendered with the model's chat template
  assistant_begin() ... assistant_end()  the same turn, opened and closed explicitly

Expressions are immutable values; `"Answer: " + gen("a")` builds a Seq. The
interpreter (state.py) gives them meaning against one state's text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from streamer.messages import GrammarSpec, SamplingParams

ROLES = ("system", "user", "assistant")


class Expr:
    """Base of every expression: supports `+` with text and other expressions."""

    def __add__(self, other: Any) -> Seq:
        return Seq((*parts_of(self), *parts_of(other)))

    def __radd__(self, other: Any) -> Seq:
        return Seq((*parts_of(other), *parts_of(self)))


def parts_of(x: Any) -> tuple[Any, ...]:
    if isinstance(x, Seq):
        return x.parts
    if isinstance(x, str | Expr):
        return (x,)
    raise TypeError(f"a program appends text or gen/select/role expressions, not {type(x).__name__}")


@dataclass(frozen=True)
class Seq(Expr):
    parts: tuple[Any, ...]


@dataclass(frozen=True)
class Gen(Expr):
    name: str | None
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    grammar: GrammarSpec | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, stop=list(self.stop), temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, grammar=self.grammar)


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    normalize: bool = False
    commit: bool = True


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class Commit(Expr):
    """Prefill the state's text now, so that later requests find it in the prefix cache."""


def gen(
    name: str | None = None,
    max_tokens: int = 128,
    stop: str | list[str] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    choices: list[str] | None = None,
    ebnf: str | None = None,
) -> Gen:
    """Generate text; stored as s[name]. Greedy by default (temperature 0).

    At most one of regex, json_schema (a dict or its JSON text; {} means any
    JSON object), choices (the output is exactly one of them, by constrained
    decoding) and ebnf constrains the output.
    """
    specs = []
    if regex is not None:
        specs.append(GrammarSpec("regex", regex))
    if json_schema is not None:
        if json_schema == {}:
            specs.append(GrammarSpec("json_object"))
        else:
            text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
            specs.append(GrammarSpec("json_schema", text))
    if choices is not None:
        if not choices:
            raise ValueError("gen(choices=...) needs at least one choice")
        specs.append(GrammarSpec("choice", json.dumps(list(choices))))
    if ebnf is not None:
        specs.append(GrammarSpec("ebnf", ebnf))
    if len(specs) > 1:
        raise ValueError("give at most one of regex, json_schema, choices, ebnf")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return Gen(name, max_tokens, stops, temperature, top_p, seed, specs[0] if specs else None)


def select(name: str | None = None, choices: list[str] | tuple[str, ...] = (), normalize: bool = False,
           commit: bool = True) -> Select:
    """Append the choice whose tokens are likeliest after the current text; stored as s[name].

    The score of a choice is the sum of its tokens' logprobs (its log-likelihood);
    normalize=True divides by the number of tokens scored (mean logprob per token),
    which stops short choices winning merely for being short. commit=True first
    prefills the shared text alone, so the choices' requests find it in the prefix
    cache rather than each computing it. See scoring.py.
    """
    if not choices:
        raise ValueError("select needs at least one choice")
    if not all(isinstance(c, str) for c in choices):
        raise TypeError("select's choices must be strings")
    return Select(name, tuple(choices), normalize, commit)


def _role(role: str, content: Any) -> Seq:
    return Seq((RoleBegin(role), *parts_of(content), RoleEnd(role)))


def system(content: Any = "") -> Seq:
    return _role("system", content)


def user(content: Any = "") -> Seq:
    return _role("user", content)


def assistant(content: Any = "") -> Seq:
    return _role("assistant", content)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
