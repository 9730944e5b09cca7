"""LoRA adapters by name, and their loading and unloading while the engine serves
(EngineConfig.allow_runtime_lora_updating; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter).

A request names an adapter (SamplingParams.lora); the tokenizer rewrites that name to the adapter's
key, NAME@N (`lora_key`), and keys are what the scheduler, the batches and the layers know
(model/lora.py Adapters). N counts every adapter the engine has loaded, those of
EngineConfig.lora_modules first, and is never used again: a name unloaded and loaded anew is
another key, so that no request, batch or cached prefix of the old adapter meets the new one
(the prefix cache's namespace of an adapter is its key).

Loading reads and checks the folder in a worker thread, then sends a LoraUpdate through the
scheduler to the executor, which changes the layers between two steps; the name is served once
that is done. Unloading takes the name away first (the tokenizer refuses it from then on), then
the scheduler ends the adapter's requests (finish_reason "error", naming it) and refuses any
tokenized before, and the executor drops its layers' columns. One update runs at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from streamer.config import EngineConfig
from streamer.errors import LoraNotFound, RequestError
from streamer.messages import LoraUpdate
from streamer.model.lora import lora_key, lora_name, read_adapter

NOT_ALLOWED = ("this engine does not load or unload LoRA adapters while serving (start it with "
               "--allow-runtime-lora-updating; adapters given at start: --lora-modules)")


def unloaded(key: str) -> str:
    """The error of a request whose adapter was unloaded before it ended."""
    return f"the LoRA adapter {lora_name(key)!r} was unloaded"


class LoraRegistry:
    """The engine's adapters: name -> key (`keys`, which the tokenizer reads), and the updates."""

    def __init__(self, config: EngineConfig, model_name: str) -> None:
        self.allowed = config.allow_runtime_lora_updating
        self.model_name = model_name
        self.keys: dict[str, str] = {name: lora_key(name, k) for k, (name, _) in enumerate(config.lora_adapters)}
        self._loaded = len(self.keys)
        self._one_at_a_time = asyncio.Lock()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.keys)

    async def load(self, name: str, path: str, replace: bool, send: Callable[[LoraUpdate], None]) -> None:
        """Serve the PEFT folder at `path` as `name` (replace: in place of the adapter of that name,
        whose requests then end as an unloaded one's). RequestError, or ModelLoadError for a folder
        it cannot take; nothing changes then."""
        if not self.allowed:
            raise RequestError(NOT_ALLOWED)
        if not name or not name.strip() or name != name.strip():
            raise RequestError(f"lora_name must be a name without surrounding spaces, not {name!r}")
        if name == self.model_name:
            raise RequestError(f"lora_name {name!r} is the served model's name")
        async with self._one_at_a_time:
            old = self.keys.get(name)
            if old is not None and not replace:
                raise RequestError(f"a LoRA adapter named {name!r} is loaded already (load_inplace replaces it)")
            adapter = await asyncio.get_running_loop().run_in_executor(None, read_adapter, name, path)
            key = lora_key(name, self._loaded)
            self._loaded += 1
            await _update(send, key, name, adapter, path)
            self.keys[name] = key
            if old is not None:
                await _update(send, old, name)

    async def unload(self, name: str, send: Callable[[LoraUpdate], None]) -> None:
        """Stop serving `name`: its requests still running end with an error. LoraNotFound."""
        if not self.allowed:
            raise RequestError(NOT_ALLOWED)
        async with self._one_at_a_time:
            key = self.keys.pop(name, None)
            if key is None:
                have = f" (loaded: {', '.join(self.keys)})" if self.keys else " (none is loaded)"
                raise LoraNotFound(f"no LoRA adapter is named {name!r}{have}")
            await _update(send, key, name)


async def _update(send: Callable[[LoraUpdate], None], key: str, name: str, adapter: Any = None,
                  path: str | None = None) -> None:
    """Send the LoraUpdate (adapter None: unload key) and wait for the executor's outcome."""
    done = asyncio.get_running_loop().create_future()
    send(LoraUpdate(key, name, adapter, done, path))
    await done
