"""Writes the KV-cache event fixtures of crates/kvc-events/tests/fixtures/ with msgspec.

Each fixture is one msgpack payload as an engine publishes it, encoded by msgspec from
structs declared the way vLLM and SGLang declare theirs (field order, tags, omitted
defaults), so the bytes are the engines' bytes. tests/fixtures.rs decodes each one and
asserts the values written here.

Usage: python fixtures.py OUT_DIR
"""

import pathlib
import sys
from typing import Any, Optional, Union

import msgspec

Hash = Union[int, bytes]


# vLLM 0.33: the batch and every event are maps; events tagged by "type"; defaults omitted.
class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None
    lookahead_token_ids: Optional[list[int]] = None


class MapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


# The outer batch as an array (vLLM before 0.33; with the rank since data parallelism).
class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


# Positional events: vLLM before map events.
class PosEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class PosStored(PosEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Optional[Hash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class PosRemoved(PosEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: Optional[str]


class PosCleared(PosEvent, tag="AllBlocksCleared"):
    pass


# SGLang: positional batch (third field the attention-DP rank) and positional events.
class SglBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


def fixtures() -> dict[str, bytes]:
    enc = msgspec.msgpack.Encoder()
    out = {}
    out["vllm033_map.msgpack"] = enc.encode(
        MapBatch(
            ts=1767225600.25,
            events=[
                MapStored(
                    block_hashes=[2**64 - 6, 17],
                    parent_block_hash=None,
                    token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                    block_size=4,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None, ["mm-hash", 3]],
                    group_idx=0,
                    locality="local",
                    ownership="owned",
                    session_id="sess-A",
                    lookahead_token_ids=[9],
                ),
                MapRemoved(block_hashes=[17], medium="GPU"),
                MapCleared(),
            ],
            data_parallel_rank=2,
        )
    )
    out["vllm033_array_batch.msgpack"] = enc.encode(
        ArrayBatch(
            ts=12.5,
            events=[
                MapStored(
                    block_hashes=[-1, -(2**63)],
                    parent_block_hash=-42,
                    token_ids=[100, 200],
                    block_size=1,
                    lora_id=None,
                    medium=None,
                    lora_name=None,
                ),
            ],
            data_parallel_rank=0,
        )
    )
    out["vllm_positional.msgpack"] = enc.encode(
        ArrayBatch(
            ts=3.0,
            events=[
                PosStored(
                    block_hashes=[b"\x01" * 32, b"\xab" * 32],
                    parent_block_hash=b"\x00" * 32,
                    token_ids=[7, 8, 9, 10],
                    block_size=2,
                    lora_id=None,
                    medium=None,
                ),
                PosRemoved(block_hashes=[b"\x01" * 32], medium="CPU"),
                PosCleared(),
            ],
        )
    )
    out["sglang_positional.msgpack"] = enc.encode(
        SglBatch(
            ts=99.75,
            events=[
                PosStored(
                    block_hashes=[101],
                    parent_block_hash=100,
                    token_ids=[42],
                    block_size=1,
                    lora_id=None,
                    medium="GPU",
                ),
                PosRemoved(block_hashes=[100], medium="GPU"),
            ],
            attn_dp_rank=1,
        )
    )
    # A producer newer than the decoder: unknown keys everywhere, defaults left out, an
    # integer timestamp, a nil rank.
    out["vllm_map_unknown_fields.msgpack"] = enc.encode(
        {
            "ts": 5,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [5],
                    "token_ids": [1, 2],
                    "block_size": 2,
                    "future_field": {"x": [1, 2]},
                },
                {"type": "AllBlocksCleared", "reason": "reset"},
            ],
            "data_parallel_rank": None,
            "producer": "next-version",
        }
    )
    return out


def main() -> None:
    out_dir = pathlib.Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in sorted(fixtures().items()):
        (out_dir / name).write_bytes(data)


if __name__ == "__main__":
    main()
