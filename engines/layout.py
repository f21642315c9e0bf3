"""Layer 3 of the rollout code: node layouts (which GPU each rollout worker uses, which trainer rank feeds it) and
the adapter tensors a trainer rank hands its workers in shared memory (`AdapterBuffer` / `open_adapter_buffer`),
plus the worker's CUDA cache release after a request.

Imports only torch and the standard library (no other project module).
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Sequence

import torch


# ---------------------------------------------------------------------------------------------------------
# Node layouts (which GPU each rollout worker uses) and adapter tensors handed over without a disk round trip
# ---------------------------------------------------------------------------------------------------------

COLOCATED = "colocated"
SYNC_MODES = ("auto", "tensors", "disk")


def gpu_index(device: str) -> int | None:
    """k for "cuda:k" ("cuda" = 0), None for any other device."""
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def visible_gpu(index: int, visible: str | None = None) -> str:
    """The CUDA_VISIBLE_DEVICES entry (a number, GPU UUID or MIG id) for the GPU that this process calls
    `cuda:<index>`: the index-th entry of this process's CUDA_VISIBLE_DEVICES (`visible`, default the environment's),
    or the index itself when none is set. So `--rollout_devices cuda:3` means the trainer's cuda:3, as in torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not 0 <= index < len(entries):
        raise ValueError(f"cuda:{index} is not visible to this process: CUDA_VISIBLE_DEVICES={visible!r} lists "
                         f"{len(entries)} GPU(s); name a rollout device among cuda:0..cuda:{len(entries) - 1}")
    return entries[index]


def worker_cuda_devices(device: str, ipc_source: int | None = None,
                        visible: str | None = None) -> tuple[str, int | None]:
    """(CUDA_VISIBLE_DEVICES of a worker on `device`, the worker's cuda index of the trainer GPU `ipc_source`).

    device: "cuda:k" (or "cuda:k,l" for a worker using several GPUs), k = this process's cuda:k (`visible_gpu`);
    the worker sees its own GPU(s) first (it runs on its cuda:0). ipc_source: this process's cuda index of the
    trainer GPU that shares adapter tensors with the worker (None: no tensor sync); when it is not one of the
    worker's own GPUs it is made visible too, after them (the worker maps the buffer there and copies it over)."""
    ids = device.split(":", 1)[1] if ":" in device else "0"
    own = [visible_gpu(int(g), visible) if g.isdigit() else g for g in ids.split(",")]
    if ipc_source is None:
        return ",".join(own), None
    peer = visible_gpu(ipc_source, visible)
    if peer in own:
        return ",".join(own), own.index(peer)
    return ",".join(own + [peer]), len(own)


def node_worker_devices(devices: Sequence[str], *, local_world_size: int, trainer_device: str) -> list[str]:
    """One node's rollout worker devices from `--rollout_devices`: "colocated" = one worker per trainer rank of the
    node, on that rank's own device (local rank r trains on cuda:r, so its worker gets cuda:r; CPU trainers get CPU
    workers); anything else is taken as given (GPUs reserved for rollout, e.g. ["cuda:3"])."""
    devices = [d.strip() for d in devices]
    if COLOCATED not in devices:
        return devices
    if len(devices) != 1:
        raise ValueError(f"--rollout_devices {COLOCATED} stands alone (got {','.join(devices)})")
    if trainer_device not in ("cuda", "cpu"):
        raise ValueError(f"trainer device must be 'cuda' or 'cpu', got {trainer_device!r}")
    return [f"cuda:{r}" if trainer_device == "cuda" else "cpu" for r in range(local_world_size)]


def adapter_sources(devices: Sequence[str], *, local_world_size: int, trainer_device: str) -> list[int]:
    """For each worker, the node-local trainer rank whose copy of the adapter it receives in a tensor sync: the rank
    that trains on the worker's own GPU where there is one (colocated: worker r <- rank r, the same GPU), else local
    rank 0 (reserved rollout GPUs: the workers read rank 0's GPU buffer; CPU: rank 0's memory file)."""
    out = []
    for device in devices:
        k = gpu_index(device)
        out.append(k if trainer_device == "cuda" and k is not None and k < local_world_size else 0)
    return out


def resolve_sync(sync: str, *, engine: str, trainer_device: str, devices: Sequence[str]) -> str:
    """`--rollout_sync`: "tensors" (hand each worker the adapter tensors in memory; the native engine with trainers
    and workers both on CUDA or both on CPU) or "disk" (a versioned PEFT directory that every worker reads; what
    vllm-omni needs). "auto" picks tensors wherever they work."""
    if sync not in SYNC_MODES:
        raise ValueError(f"--rollout_sync must be one of {SYNC_MODES}, got {sync!r}")
    kinds = {"cuda" if gpu_index(d) is not None else d.split(":")[0] for d in devices}
    possible = engine == "native" and kinds == {trainer_device}
    if sync == "auto":
        return "tensors" if possible else "disk"
    if sync == "tensors" and not possible:
        raise ValueError(f"--rollout_sync tensors needs the native engine with trainers and rollout workers on the "
                         f"same kind of device (got engine {engine}, trainer {trainer_device}, workers "
                         f"{list(devices)}); use --rollout_sync disk")
    return sync


def adapter_layout(named_shapes: Sequence[tuple[str, Sequence[int]]]) -> list[list[Any]]:
    """The plain-data layout of a flat adapter buffer: [[key, [shape...]], ...] in buffer order, keys
    `<trainer module path>.lora_A.weight` / `.lora_B.weight`; each tensor starts where the previous one ends."""
    return [[str(key), [int(d) for d in shape]] for key, shape in named_shapes]


def layout_numel(layout: Sequence[Sequence[Any]]) -> int:
    return sum(math.prod(shape) for _, shape in layout)


def unpack_adapter(flat: torch.Tensor, layout: Sequence[Sequence[Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """{module path: {"A": view, "B": view}} of a flat buffer laid out by `adapter_layout` (views, no copies). A
    malformed layout (bad key, duplicate, sizes that do not add up to the buffer) raises."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for key, shape in layout:
        path, sep, suffix = str(key).rpartition(".lora_")
        if not sep or suffix not in ("A.weight", "B.weight") or not path:
            raise ValueError(f"adapter tensor key {key!r} is not '<module>.lora_A.weight' / '<module>.lora_B.weight'")
        which = suffix[0]
        if which in modules.get(path, {}):
            raise ValueError(f"adapter tensor {key!r} appears twice in the layout")
        n = math.prod(shape)
        if offset + n > flat.numel():
            raise ValueError(f"the adapter layout needs more than the buffer's {flat.numel()} elements (at {key!r})")
        modules.setdefault(path, {})[which] = flat[offset:offset + n].view(*shape)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"the adapter layout covers {offset} of the buffer's {flat.numel()} elements")
    return modules


def _memory_file(nbytes: int) -> tuple[int, str, bool]:
    """(fd, path other processes of this machine can open, unlink on close?) of a file of `nbytes` in memory: an
    anonymous memfd (Linux; freed with its last mapping, even if this process dies), else a file in /dev/shm or the
    temp directory."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("flowrl-adapter")
        path, unlink = f"/proc/{os.getpid()}/fd/{fd}", False
    else:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="flowrl-adapter-", dir=folder)
        unlink = True
    os.ftruncate(fd, nbytes)
    return fd, path, unlink


class AdapterBuffer:
    """One flat float32 buffer that holds a LoRA adapter's tensors back to back (`adapter_layout` order) on a trainer
    rank, for this node's rollout workers to read without a disk round trip: on a GPU through CUDA IPC (a worker on
    the same GPU maps this very memory; one on another GPU of the node maps it on that GPU and copies it over, one
    device-to-device copy), on the CPU as a memory file that the workers map read-only. `share()` is plain data for
    the worker message; `close()` frees the buffer (only after every worker answered)."""

    def __init__(self, numel: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._fd: int | None = None
        if self.device.type == "cuda":
            self.tensor = torch.empty(numel, dtype=torch.float32, device=self.device)
        elif self.device.type == "cpu":
            self._fd, self._path, self._unlink = _memory_file(numel * 4)
            self.tensor = torch.from_file(self._path, shared=True, size=numel, dtype=torch.float32)
        else:
            raise ValueError(f"an adapter buffer lives on a CUDA GPU or the CPU, not {self.device}")

    def share(self) -> dict[str, Any]:
        """Plain data (ints, bytes, str, bool) from which `open_adapter_buffer` maps this buffer in a worker."""
        if self.device.type == "cpu":
            return {"kind": "file", "path": self._path, "numel": self.tensor.numel()}
        torch.cuda.synchronize(self.device)  # the buffer is filled before any worker reads it
        try:
            (_, handle, storage_size, storage_offset, ref_counter_handle, ref_counter_offset, event_handle,
             event_sync_required) = self.tensor.untyped_storage()._share_cuda_()
        except RuntimeError as e:
            raise RuntimeError(f"could not export the adapter buffer through CUDA IPC ({e}); use --rollout_sync disk"
                               ) from e
        return {"kind": "cuda_ipc", "handle": handle, "storage_size": int(storage_size),
                "storage_offset": int(storage_offset), "ref_counter_handle": ref_counter_handle,
                "ref_counter_offset": int(ref_counter_offset), "event_handle": event_handle,
                "event_sync_required": bool(event_sync_required), "offset": int(self.tensor.storage_offset()),
                "numel": self.tensor.numel()}

    def close(self) -> None:
        self.tensor = None
        if self._fd is not None:
            os.close(self._fd)
            if self._unlink:
                os.unlink(self._path)
            self._fd = None
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # free what the workers released


def open_adapter_buffer(source: dict[str, Any], device: torch.device) -> torch.Tensor:
    """In a worker: the flat float32 buffer that a trainer rank shares (`AdapterBuffer.share()`, with "device" set
    by the group to this worker's index of the trainer's GPU), on `device`: mapped in place when it already lives
    there, else copied over once."""
    numel = int(source["numel"])
    if source["kind"] == "file":
        flat = torch.from_file(source["path"], shared=False, size=numel, dtype=torch.float32)
    elif source["kind"] == "cuda_ipc":
        index = int(source["device"])
        storage = torch.UntypedStorage._new_shared_cuda(
            index, source["handle"], source["storage_size"], source["storage_offset"], source["ref_counter_handle"],
            source["ref_counter_offset"], source["event_handle"], source["event_sync_required"])
        flat = torch.empty(0, dtype=torch.float32, device=f"cuda:{index}").set_(
            storage, source["offset"], (numel,), (1,))
        torch.cuda.synchronize(index)  # the producer's event (if any) is waited for on that device's stream
    else:
        raise ValueError(f"unknown adapter buffer kind {source['kind']!r}")
    return flat.to(device)


def release_memory(device: str) -> dict[str, float]:
    """In a worker after a request: return the CUDA cache to the GPU (a colocated trainer rank trains next on it)
    and report, in GiB, the peak allocated during the request and what the worker still holds (allocated /
    reserved). {} on CPU."""
    if not (str(device).startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    gib = 1024.0 ** 3
    peak = torch.cuda.max_memory_allocated() / gib
    torch.cuda.empty_cache()
    out = {"peak_gib": peak, "allocated_gib": torch.cuda.memory_allocated() / gib,
           "reserved_gib": torch.cuda.memory_reserved() / gib}
    torch.cuda.reset_peak_memory_stats()
    return out

