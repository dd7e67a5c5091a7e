"""Prefill/decode disaggregation on the engine service's side of the bus.

`DecodeSide` (role decode): admits a request (the engine matches, locks, reserves and starts
restoring its own prefix), answers `decode_prefix_len`, writes each KV frame into the
reserved pages and ACKs it in order, and gives up (releasing everything) when the prefill
engine goes quiet on the request for its transfer timeout: no frame, and no `Progress` (which
the prefill engine sends on the same subject while it queues or computes the request).

`PrefillSide` (role prefill): runs the prompt (the service tells the decode engine that it
still works on it: a long prefill on a CPU is not a lost one), gets the packed KV past `decode_prefix_len`, and sends it as checksummed frames sized in bytes
from the NATS server's `max_payload` (`pd_frames.py`), with a window of frames per transfer
and of bytes per engine in flight, resending a NACKed frame; the staging buffer is dropped
once the last frame is ACKed. A frame that cannot be published (any publish error) fails the
transfer at once, naming the cause.

Here: what both sides share (`PDConfig`, the callables the service hands them, the error of a
failed transfer); the sides are in `pd_decode.py` and `pd_prefill.py`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from bus_schemas.kv_frame import HEADER_SIZE
from services.engine.pd_frames import MIN_PAYLOAD

Publish = Callable[..., Awaitable[None]]  # (subject, data, reply="") -> None


class FailStream(Protocol):
    """End a request's stream with an error chunk (silently with an empty message);
    `crashed`: the engine's step loop died with it (the router retries it nowhere)."""

    def __call__(self, request_id: str, message: str, code: int, crashed: bool = False) -> None: ...


TRANSFER_FAILED = 502  # error code of a transfer that failed on the prefill side


@dataclass(frozen=True, slots=True)
class PDConfig:
    """How a prefill engine sends KV (the decode side's transfer timeout comes with each
    request from the router)."""

    frame_bytes: int = 0  # largest KV frame, header included; 0: the server's max_payload
    window: int = 8  # frames in flight per transfer before waiting for ACKs
    window_bytes: int = 32 * 1024 * 1024  # KV bytes in flight per prefill engine
    ack_timeout_s: float = 10.0  # prefill: an ACK must come within this
    max_attempts: int = 3  # sends of one frame before the transfer fails
    debug_corrupt_frames: int = 0  # test hook: corrupt the first N frames this engine sends
    debug_exit_after_frames: int = 0  # test hook: the process dies after sending N frames

    def __post_init__(self) -> None:
        smallest = HEADER_SIZE + MIN_PAYLOAD
        if self.frame_bytes and self.frame_bytes < smallest:
            raise ValueError(f"--disaggregation-frame-bytes must be 0 or >= {smallest}")
        if self.window < 1:
            raise ValueError("--disaggregation-window must be >= 1")
        if self.window_bytes < smallest:
            raise ValueError(f"--disaggregation-window-bytes must be >= {smallest}")
        if not self.ack_timeout_s > 0:
            raise ValueError("--disaggregation-ack-timeout must be positive")


class TransferError(RuntimeError):
    """A KV transfer failed on the prefill side; `code` is the error code its request gets:
    503 (decode did not take the frames) or `TRANSFER_FAILED` (a frame could not be sent)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
