"""streamer: an async, event-driven LLM inference server."""

from streamer.config import EngineConfig
from streamer.messages import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing streamer must not pull torch in
    if name == "LLM":
        from streamer.engine.llm import LLM

        return LLM
    raise AttributeError(name)
