"""The frames between processes, as tagged msgspec Structs: server <-> engine process
(engine/remote.py, remote_engine.py) and rank 0 -> the other tensor-parallel ranks
(distributed/step.py). They carry the actor messages of streamer/messages.py.
"""

from __future__ import annotations

import msgspec

from streamer.engine_stats import EngineStats
from streamer.messages import Abort, Batch, GenerateRequest, RequestOutput

# ---- between the server process and the engine process (engine/remote.py) ----------
# Length-prefixed msgpack frames over one socket pair. Tagged, so that each direction
# decodes as one union.


class Submit(msgspec.Struct, tag=True):
    """Server -> engine: a new request; its outputs come back in Outputs frames."""

    request: GenerateRequest


class Stop(msgspec.Struct, tag=True):
    """Server -> engine: abort what runs (each request's final output still comes), then exit."""


class Ready(msgspec.Struct, tag=True):
    """Engine -> server, once: the model is loaded and warmed up."""

    model_path: str
    """The resolved model folder: the server loads the same tokenizer from it."""
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    stats: EngineStats


class Outputs(msgspec.Struct, tag=True):
    """Engine -> server: every RequestOutput of one event-loop iteration, all requests mixed."""

    outputs: list[RequestOutput]


class Stats(msgspec.Struct, tag=True):
    """Engine -> server: the latest EngineStats (sent after outputs, or now and then when idle)."""

    stats: EngineStats


class Failed(msgspec.Struct, tag=True):
    """Engine -> server: the engine could not start (kind: the exception's class name, e.g.
    ModelLoadError) or died; the process exits after it."""

    error: str
    kind: str = "RuntimeError"


class Lora(msgspec.Struct, tag=True):
    """Server -> engine: load the adapter folder at `path` as `name` (replace: in place of the
    adapter of that name), or unload `name` (path None); its LoraDone has the same `id`."""

    id: int
    name: str
    path: str | None
    replace: bool = False


class LoraDone(msgspec.Struct, tag=True):
    """Engine -> server: the outcome of Lora `id`: the adapters served now, or the error (kind:
    its class name in streamer.errors) and nothing changed."""

    id: int
    loras: list[str]
    error: str | None = None
    kind: str = "RequestError"


ToEngine = Submit | Abort | Lora | Stop
FromEngine = Ready | Outputs | Stats | LoraDone | Failed


# ---- tensor parallelism: rank 0 -> the other ranks (streamer/distributed/step.py) ----------


class TierCopy(msgspec.Struct, array_like=True):
    """One copy of the host tier's (kv/host.py) between device pages and host pages:
    device -> host (a write-back) or host -> device (a load)."""

    write_back: bool
    gpu: list[int]
    host: list[int]


class RankStep(msgspec.Struct, tag=True):
    """One step, once for all its requests: the batch (its sampling fields emptied: rank 0
    samples alone), the runner's split threshold (the warm-up changes it), and the host
    tier's copies since the last step, in order, which each rank starts on its shard first."""

    batch: Batch
    split_decode_tokens: int
    tier_copies: list[TierCopy] = msgspec.field(default_factory=list)
    loads_ready: int = 0
    """How many of the host tier's loads (all sent so far, in their order) rank 0 had seen
    complete: the step may read their pages, so the other ranks wait for those alone (a load
    whose request still waits runs on beside their steps, as on rank 0)."""


class RankLora(msgspec.Struct, tag=True):
    """A LoRA adapter loaded (path) or unloaded (None) while serving, between two steps: each rank
    reads the folder itself, then all agree (TPGroup.min_int) or all leave the adapters as they were."""

    key: str
    name: str
    path: str | None


class RankPing(msgspec.Struct, tag=True):
    """Keep-alive while the engine is idle (the ranks wait on a collective with a timeout)."""


class RankStop(msgspec.Struct, tag=True):
    """The engine stops: the rank leaves the group and exits."""


ToRank = RankStep | RankLora | RankPing | RankStop
