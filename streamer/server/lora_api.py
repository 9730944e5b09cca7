"""vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded
while the server runs (the engine's allow_runtime_lora_updating, `--allow-runtime-lora-updating`;
engine/adapters.py). Once loaded, an adapter's name is a model of /v1/models, and a request naming
it runs with it, as one of --lora-modules.

Answers as vLLM's: 200 with a line of text; 400 with OpenAI's error body where the engine does not
allow it, the name is taken (without load_inplace) or the folder is not an adapter it can take;
404 (code lora_not_found) for unloading a name no adapter has.
"""

from __future__ import annotations

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from streamer.errors import LoraNotFound, ModelLoadError, StreamerError
from streamer.server.api_error import ApiError
from streamer.server.openai_api import server
from streamer.server.protocol import decode_body


class LoadLoraAdapterRequest(Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    """Replace the adapter of that name (its requests still running end with an error)."""


class UnloadLoraAdapterRequest(Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None
    """vLLM's integer id of an adapter: adapters have names alone here, so one given is refused."""


async def load_lora_adapter(request: Request) -> Response:
    body = decode_body(await request.body(), LoadLoraAdapterRequest)
    st = server(request)
    if st.serves(body.lora_name):  # (the engine knows its own name, not the server's --served-model-name)
        raise ApiError(f"lora_name {body.lora_name!r} is the served model's name", param="lora_name")
    try:
        await st.engine.load_lora(body.lora_name, body.lora_path, body.load_inplace)
    except StreamerError as e:
        raise ApiError(str(e), param="lora_path" if isinstance(e, ModelLoadError) else None) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    body = decode_body(await request.body(), UnloadLoraAdapterRequest)
    if body.lora_int_id is not None:
        raise ApiError("lora_int_id: this server knows its adapters by lora_name alone (give that)",
                       param="lora_int_id")
    try:
        await server(request).engine.unload_lora(body.lora_name)
    except LoraNotFound as e:
        raise ApiError(str(e), 404, param="lora_name", code="lora_not_found", type="not_found_error") from None
    except StreamerError as e:
        raise ApiError(str(e)) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
