"""The messages between a frontend and an engine-core process: msgspec Structs, msgpack on the
wire (never pickle). Tensors cross as dtype, shape and raw bytes.

frontend -> core: Add, Abort, Rpc, Shutdown     core -> frontend: Ready, Outputs, Reject, StepFailed,
                                                                  RpcReply, Dead
An add the core takes is not answered (its outputs are the answer); one it refuses gets a Reject.
Image pixels cross once per content hash: the frontend keeps the list of hashes whose pixels the
core holds for it (core/pixels.py) and sends only the hash for those, and it alone decides when
the core may drop them (`Add.forget`), so the two never disagree. With several API servers
(`--api-server-count`) each has its own socket pair with the core, and the core keeps each one's
pixels apart.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from mm_engine.core.types import CoreOutput
from mm_engine.sampling_params import SamplingParams


class TensorMsg(msgspec.Struct, array_like=True):
    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMsg:
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # any dtype, bf16 too
        return cls(str(t.dtype).removeprefix("torch."), list(t.shape), raw.numpy().tobytes())

    def tensor(self) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8) if self.data else torch.empty(0)
        return raw.to(torch.uint8).view(getattr(torch, self.dtype)).reshape(self.shape)


class ImageMsg(msgspec.Struct, array_like=True):
    offset: int
    length: int
    content_hash: str
    num_embeds: int
    embed_mask: list[bool] | None = None
    grid: list[int] | None = None
    pixels: TensorMsg | None = None  # None: the core holds this hash's pixels already
    temporal_step: float = 1.0
    video: bool = False
    time_offset: int = 0


class Add(msgspec.Struct, tag=True):
    request_id: str
    token_ids: list[int]
    images: list[ImageMsg]
    params: SamplingParams
    eos_token_ids: list[int]
    priority: int
    arrival_time: float
    forget: list[str] = []  # hashes whose pixels the core may drop (once no request needs them)
    frontend: int = 0  # which API server sent it (--api-server-count): its outputs go back there


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Rpc(msgspec.Struct, tag=True):
    call_id: int
    method: str  # "kv_report" or "stats"
    frontend: int = 0


class Shutdown(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    max_model_len: int
    max_num_seqs: int
    max_waiting_requests: int
    platform: dict[str, Any]
    stats: dict[str, Any]
    pid: int


class Outputs(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]
    stats: dict[str, Any]
    step_seconds: float  # 0 for a heartbeat (no step ran)


class Reject(msgspec.Struct, tag=True):
    request_id: str
    kind: str  # "invalid" (the client's: a 400), "full" (queue full: 429), "error" (ours: 500)
    message: str


class StepFailed(msgspec.Struct, tag=True):
    request_ids: list[str]
    device_lost: bool
    error_kind: str  # the exception's type name, never its message


class RpcReply(msgspec.Struct, tag=True):
    call_id: int
    result: Any


class Dead(msgspec.Struct, tag=True):
    reason: str


ToCore = Add | Abort | Rpc | Shutdown
FromCore = Ready | Outputs | Reject | StepFailed | RpcReply | Dead

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)
