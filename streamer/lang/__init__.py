"""The frontend language: programs that interleave text, generation and choice.

  from streamer import LLM
  from streamer.lang import EngineBackend, assistant, function, gen, select, set_default_backend, user

  @function
  def classify(s, review):
      s += user(f"Is this review positive or negative? {review}")
      s += assistant("It is " + select("label", ["positive", "negative"]))

  set_default_backend(EngineBackend(LLM("default")))
  classify.run(review="Loved it.")["label"]

Modules: ir (what can be appended), state (ProgramState and the interpreter),
program (@function, run, run_batch), scoring (select), chat (the chat template
turn by turn), backend (EngineBackend), runtime_endpoint (RuntimeEndpoint over
HTTP), errors (ProgramError).
"""

from streamer.lang.backend import Backend, EngineBackend
from streamer.lang.errors import ProgramError
from streamer.lang.ir import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from streamer.lang.program import Program, function, get_default_backend, set_default_backend
from streamer.lang.runtime_endpoint import RuntimeEndpoint
from streamer.lang.state import ForkGroup, ProgramState

__all__ = [
    "Backend",
    "EngineBackend",
    "ForkGroup",
    "Program",
    "ProgramError",
    "ProgramState",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "get_default_backend",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
]
