"""What rank 0 tells the workers, and how: small msgspec messages over each worker's stdin pipe
(its start-up settings, the KV block count, then one header per step: which tensors follow, their
dtypes and shapes, the host-side numbers the attention backends read; and the swaps rank 0 makes,
which a worker repeats on its own KV heads), and a step's tensors broadcast over the model's group
right after its header, packed into one buffer per dtype. No pickle.

A pipe, not a collective, carries what a worker waits for: a collective times out, and an engine
may sit idle for hours; a pipe waits as long as rank 0 lives and ends (EOF) when it dies.
"""

from __future__ import annotations

import math
import struct
from typing import BinaryIO

import msgspec
import torch

from mm_engine.core.step_inputs import StepInputs
from mm_engine.kernels.metadata import AttentionMetadata
from mm_engine.parallel.group import TPGroup
from mm_engine.parallel.ranks import WorkerStart

# The tensors of StepInputs (and of its metadata) a worker's forward reads, by name.
_TENSORS = ("ids", "positions", "embed_rows", "embed_feats", "logit_rows")
_META = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")


class TensorSpec(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    shape: list[int]


class Start(msgspec.Struct, tag=True):
    settings: WorkerStart


class Blocks(msgspec.Struct, tag=True):
    num_blocks: int
    state_slots: int = 0  # a hybrid model's state pool: slots, then snapshot rows
    state_snapshots: int = 0


class Step(msgspec.Struct, tag=True):
    tensors: list[TensorSpec]
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    state_slots_cpu: list[int] | None = None  # hybrid models (AttentionMetadata's)
    state_snapshots_cpu: list[list[tuple[int, int]]] | None = None


class ImageSpec(msgspec.Struct, array_like=True):
    """What a family's `encode` reads of an image (its tensors follow the header, in order)."""

    pixel_values: TensorSpec
    grid: list[int] | None
    num_embeds: int


class Encode(msgspec.Struct, tag=True):
    """A worker's share of a step's images (data-parallel vision tower, parallel/vision_dp.py):
    encode them and hand the features to rank 0 as `[rows, *feature]` in `dtype`."""

    images: list[ImageSpec]
    rows: int  # every rank's share padded to this many feature rows
    feature: list[int]  # [1 + deepstack, hidden]
    dtype: str


class SwapOut(msgspec.Struct, tag=True):  # rank 0 swapped these blocks of a request to host memory
    request_id: str
    blocks: list[int]
    state_slot: int | None = None  # and its recurrent state (hybrid models)


class SwapIn(msgspec.Struct, tag=True):  # ... and back into these blocks (and state slot)
    request_id: str
    blocks: list[int]
    state_slot: int | None = None


class SwapDrop(msgspec.Struct, tag=True):  # ... or dropped its host copy
    request_id: str


class Stop(msgspec.Struct, tag=True):
    pass


Message = Start | Blocks | Step | Encode | SwapOut | SwapIn | SwapDrop | Stop
DTYPES = {
    str(d): d
    for d in (torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16)
}
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Message).decode
_LEN = struct.Struct("<I")


def write(pipe: BinaryIO, msg: Message) -> None:
    raw = _encode(msg)
    pipe.write(_LEN.pack(len(raw)) + raw)
    pipe.flush()


def read(pipe: BinaryIO) -> Message | None:
    """The next message; None at EOF (rank 0 is gone)."""
    head = pipe.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    raw = pipe.read(n)
    return _decode(raw) if len(raw) == n else None


def send_step(
    pipes: list[BinaryIO], inputs: StepInputs, group: TPGroup, prev_tokens: torch.Tensor | None = None
) -> None:
    """Rank 0: the header to every worker, then the tensors over the group. With async
    scheduling an input may be the previous step's sampled token, still on the device: those
    tokens (`prev_tokens`) go too, in the device's order, so nobody waits for them on the host."""
    named = _named(inputs, prev_tokens)
    meta = inputs.meta
    header = Step(
        [TensorSpec(n, str(t.dtype), list(t.shape)) for n, t in named],
        meta.max_query_len, meta.max_seq_len, list(meta.query_lens_cpu), list(meta.seq_lens_cpu),
        meta.state_slots_cpu, meta.state_snapshots_cpu,
    )  # fmt: skip
    for pipe in pipes:
        write(pipe, header)
    for dtype in dict.fromkeys(t.dtype for _, t in named):  # one broadcast per dtype, not per tensor
        group.broadcast(torch.cat([t.reshape(-1) for _, t in named if t.dtype == dtype]))


def receive_step(header: Step, group: TPGroup) -> tuple[StepInputs, torch.Tensor | None]:
    """A worker: the tensors that follow `header`, as the step's inputs on its device, and the
    previous step's sampled tokens where an input takes one."""
    got: dict[str, torch.Tensor] = {}
    for dtype in dict.fromkeys(spec.dtype for spec in header.tensors):
        specs = [spec for spec in header.tensors if spec.dtype == dtype]
        sizes = [math.prod(spec.shape) for spec in specs]
        packed = torch.empty(sum(sizes), dtype=DTYPES[dtype], device=group.device)
        group.broadcast(packed)
        for spec, part in zip(specs, packed.split(sizes), strict=True):
            got[spec.name] = part.view(spec.shape)

    def pair(name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (got[f"{name}.0"], got[f"{name}.1"]) if f"{name}.0" in got else None

    meta = AttentionMetadata(
        *(got[n] for n in _META), header.max_query_len, header.max_seq_len,
        header.query_lens_cpu, header.seq_lens_cpu, pair("bidirectional"),
        header.state_slots_cpu, header.state_snapshots_cpu,
    )  # fmt: skip
    inputs = StepInputs(
        got["ids"], got["positions"], meta, got.get("embed_rows"), got.get("embed_feats"),
        [], [], pair("from_prev"), [], [], got.get("logit_rows"), pair("block_copies"),
        pair("state_copies"),
    )  # fmt: skip
    return inputs, got.get("prev_tokens")


def _named(inputs: StepInputs, prev_tokens: torch.Tensor | None) -> list[tuple[str, torch.Tensor]]:
    out = [(n, getattr(inputs, n)) for n in _TENSORS if getattr(inputs, n) is not None]
    out += [(n, getattr(inputs.meta, n)) for n in _META]
    pairs = (("bidirectional", inputs.meta.bidirectional), ("block_copies", inputs.block_copies),
             ("from_prev", inputs.from_prev), ("state_copies", inputs.state_copies))  # fmt: skip
    for name, value in pairs:
        if value is not None:
            out += [(f"{name}.0", value[0]), (f"{name}.1", value[1])]
    if inputs.from_prev is not None:
        if prev_tokens is None:
            raise ValueError("these inputs take the previous step's tokens; pass prev_tokens")
        out.append(("prev_tokens", prev_tokens))
    return out
