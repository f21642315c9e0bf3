"""Layer 5 of the rollout code: the message protocol between the trainer and its rollout workers (length-prefixed
frames of plain data over pipes), the plain-data check and the start-up handshake.

Imports only torch and the standard library (no other project module).
"""

from __future__ import annotations

import io
import os
import select
import struct
import sys
import time
from typing import Any

import torch


# ---------------------------------------------------------------------------------------------------------
# Worker processes: length-prefixed messages over stdin/stdout, holding plain tensors and built-in types only
# ---------------------------------------------------------------------------------------------------------

# The trainer and its workers may run different Python environments (--rollout_python: e.g. vllm-omni's own torch
# 2.13 stack beside the trainer's torch 2.14), so every message is version-neutral: CPU tensors, None, bool, int,
# float, str, bytes, and lists / tuples / str-keyed dicts of those, written by torch.save and read back with
# torch.load(weights_only=True) (no pickled classes, so no import of the sender's code on the receiver), then
# checked again. Bump PROTOCOL_VERSION whenever a message's layout or meaning changes: the start-up handshake
# refuses a peer that speaks another version.
PROTOCOL_VERSION = 2
_MAGIC = b"FRLW"
_HEADER = struct.Struct("<4sQ")  # magic, payload length
_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)  # bytes: CUDA IPC handles


class ProtocolError(RuntimeError):
    """A message that is not plain data (refused whole; the channel stays in step)."""


class ChannelBroken(ProtocolError):
    """Bytes that are not a frame of this protocol (the channel is out of step and must be closed)."""


def check_plain(value: Any, path: str = "message") -> None:
    """Raise `ProtocolError` naming the first value (by its path) that is not plain data.

    Plain: None, bool, int, float, str, bytes (exact types: numpy scalars, enums and other subclasses are refused), dense
    CPU `torch.Tensor`s (exact type: no Parameters or subclasses), and list / tuple / dict (str keys) of plain values.
    """
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return
    if kind is torch.Tensor:
        if value.device.type != "cpu" or value.layout != torch.strided:
            raise ProtocolError(f"{path}: only dense CPU tensors cross the rollout channel, got a {value.layout} "
                                f"tensor on {value.device}")
        return
    if kind in (list, tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{path}[{i}]")
        return
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise ProtocolError(f"{path}: dict keys must be str, got {type(key).__name__} {key!r:.60}")
            check_plain(item, f"{path}[{key!r}]")
        return
    raise ProtocolError(f"{path}: {kind.__module__}.{kind.__qualname__} cannot cross the rollout channel (plain "
                        "tensors, None, bool, int, float, str, bytes, list, tuple and str-keyed dict only; convert it, "
                        "e.g. a PIL image to a uint8 (3, H, W) tensor, a numpy value to a tensor or a Python number)")


def encode_message(message: Any) -> tuple[bytes, bytes]:
    """One message's frame as (header, payload), written in that order (two writes: the payload, megabytes for a
    chunk of images, is not copied into one buffer); `ProtocolError` unless it is plain data."""
    check_plain(message)
    buffer = io.BytesIO()
    torch.save(message, buffer)
    payload = buffer.getvalue()
    return _HEADER.pack(_MAGIC, len(payload)), payload


def send_message(stream, message: Any) -> None:
    """Write one message (refused with `ProtocolError` before anything is written unless it is plain data)."""
    for part in encode_message(message):
        stream.write(part)
    stream.flush()


def send_message_within(fd: int, message: Any, timeout_s: float) -> None:
    """Write one message to the pipe `fd` within `timeout_s` seconds. A peer that is alive but no longer reads
    would block a plain write for ever once the pipe is full (64 KiB; a request with images is larger): this one
    raises `TimeoutError` at the deadline instead (the frame is then cut: close the channel). A peer that has gone
    raises `BrokenPipeError`; `ProtocolError` comes before anything is written."""
    parts = [memoryview(part) for part in encode_message(message)]
    deadline = time.monotonic() + timeout_s
    was_blocking = os.get_blocking(fd)
    os.set_blocking(fd, False)
    try:
        for data in parts:
            while data:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the peer did not take a whole message within {timeout_s:g} s")
                _, writable, _ = select.select([], [fd], [], min(remaining, 1.0))
                if writable:
                    try:
                        data = data[os.write(fd, data):]
                    except BlockingIOError:  # the pipe filled up again between the select and the write
                        pass
    finally:
        os.set_blocking(fd, was_blocking)


def _read_exact(stream, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            raise EOFError("the peer closed the channel")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv_message(stream) -> Any:
    """One message; works on buffered and raw (short-reading) streams.

    The payload is read with `torch.load(weights_only=True)` (no arbitrary classes are ever unpickled) and then
    checked by `check_plain` (weights_only also admits e.g. OrderedDict, torch.Size, dtypes, Parameters): anything
    else raises `ProtocolError` after the whole frame was consumed, so the channel stays usable."""
    magic, length = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    if magic != _MAGIC:
        raise ChannelBroken(f"the peer sent bytes that are not a rollout-channel frame (magic {magic!r}, expected "
                            f"{_MAGIC!r}): something else wrote to the channel, or the peer is not a flowrl rollout "
                            "worker")
    payload = _read_exact(stream, length)
    try:
        message = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as e:  # pickle.UnpicklingError for a forbidden global; anything else is a corrupt payload
        text = str(e)
        reason = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else text
        reason = reason.strip().split(" was not an allowed global")[0]  # "Unsupported global: GLOBAL numpy...."
        raise ProtocolError(f"refused a message that is not plain tensors / built-in types "
                            f"({type(e).__name__}: {reason[:300]})") from None
    check_plain(message, "received message")
    return message


def _distribution_version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def peer_info() -> dict[str, Any]:
    """This side's handshake: protocol version, interpreter, and the versions of the libraries a worker uses
    (read from the installed distributions, nothing is imported)."""
    import platform

    info: dict[str, Any] = {"protocol": PROTOCOL_VERSION, "executable": sys.executable,
                            "python": platform.python_version(), "torch": str(torch.__version__)}
    for name in ("diffusers", "transformers", "peft", "vllm", "vllm-omni"):
        info[name] = _distribution_version(name)
    return info


def _describe(info: dict[str, Any]) -> str:
    return (f"rollout protocol {info.get('protocol')!r} (python {info.get('python')}, torch {info.get('torch')}, "
            f"{info.get('executable')})")


def handshake_error(ours: dict[str, Any], theirs: Any, *, peer: str) -> str | None:
    """Why a peer's handshake is unacceptable, or None. `peer` names the other side ("the rollout worker")."""
    if type(theirs) is not dict or theirs.get("op") != "hello" or "protocol" not in theirs:
        return (f"{peer} did not open with a protocol handshake (it runs an older or foreign rollout.py); this side "
                f"speaks {_describe(ours)}: run the same flowrl checkout on both sides")
    if theirs["protocol"] != ours["protocol"]:
        return (f"{peer} speaks {_describe(theirs)}, this side speaks {_describe(ours)}: incompatible message "
                "formats; run the same flowrl checkout on both sides")
    return None
