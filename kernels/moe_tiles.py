"""Measured tile tables for the grouped MoE GEMM (kernels/moe.py), one JSON file per GPU model.

The best tiles depend on the card (its bandwidth, shared memory and SM count) and on the
experts' dtype (a float8 chunk of 128 columns moves half the bytes of a bf16 one; int4 tiles are
dequantized in registers), so a table
measured on one card is only used on that card. `benchmarks/moe_layer.py --sweep --write`
measures one and writes it here (or anywhere: STREAMER_MOE_TILES=path.json is read first).

A table maps the experts' dtype ("bf16": any 16-bit, "fp8", "int4": kernels/moe_int4.py's) to buckets of mean rows per
expert (pairs / experts), each with the tiles that were fastest for that bucket's token counts:

    {"device": "NVIDIA H100 80GB HBM3",
     "fp8": [{"max_rows": 16, "tiles": [16, 64, 256, 4, 3]}, ..., {"max_rows": null, ...}]}

tiles = [block_m, block_n, block_k, num_warps, num_stages]; max_rows null closes the list.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

TABLES = Path(__file__).with_name("moe_tiles")
ENV = "STREAMER_MOE_TILES"
BUCKETS: tuple[int | None, ...] = (16, 128, None)  # mean rows per expert: decode, mixed, prefill
KINDS = ("bf16", "fp8", "int4")


def slug(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3' (the table's file name)."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def bucket(mean_rows: float) -> int | None:
    """The first bucket bound >= mean_rows (None: the last, unbounded one)."""
    return next(b for b in BUCKETS if b is None or mean_rows <= b)


def _validated(table: object, source: str) -> dict[str, list[tuple[int | None, tuple[int, ...]]]]:
    """The table's dtype -> [(max_rows, tiles)] lists; a malformed file is refused by name."""
    if not isinstance(table, dict):
        raise ValueError(f"{source}: a MoE tile table is a JSON object")
    out = {}
    for kind in KINDS:
        rows = []
        for entry in table.get(kind, []):
            tiles = tuple(entry.get("tiles", ())) if isinstance(entry, dict) else ()
            if len(tiles) != 5 or not all(isinstance(v, int) and v > 0 for v in tiles):
                raise ValueError(f"{source}: {kind} entry {entry!r} needs tiles [block_m, block_n, block_k, "
                                 "num_warps, num_stages]")
            rows.append((entry.get("max_rows"), tiles))
        if rows and rows[-1][0] is not None:
            raise ValueError(f"{source}: the last {kind} entry must have max_rows null")
        out[kind] = rows
    return out


@functools.cache
def table_for(device_name: str) -> dict[str, list[tuple[int | None, tuple[int, ...]]]]:
    """STREAMER_MOE_TILES if set (whatever card it names), else moe_tiles/<slug>.json, else {}."""
    path = os.environ.get(ENV)
    if path:
        return _validated(json.loads(Path(path).read_text()), path)
    file = TABLES / f"{slug(device_name)}.json"
    return _validated(json.loads(file.read_text()), str(file)) if file.exists() else {}


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def tuned(device: torch.device, kind: str, mean_rows: float) -> tuple[int, ...] | None:
    """The measured tiles for this card, experts' dtype (KINDS) and mean rows per expert, or None (no table)."""
    assert kind in KINDS, kind
    if device.type != "cuda":
        return None
    rows = table_for(_device_name(device.index)).get(kind, [])
    return next((tiles for bound, tiles in rows if bound is None or mean_rows <= bound), None)


def write(path: Path, device_name: str, kind: str, best: dict[int | None, tuple[int, ...]]) -> None:
    """Merge one dtype's buckets into the table at path (the other dtype's entries kept)."""
    table = json.loads(path.read_text()) if path.exists() else {}
    table["device"] = device_name
    table[kind] = [{"max_rows": b, "tiles": list(best[b])} for b in BUCKETS if b in best]
    _validated(table, str(path))
    path.write_text(json.dumps(table, indent=1) + "\n")
