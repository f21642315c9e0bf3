"""Distributed: torchrun process groups (NCCL on GPU + gloo for CPU tensors, gloo on CPU), rank helpers, seeds."""

from __future__ import annotations

import datetime
import os
import random
import socket
from dataclasses import dataclass
from typing import Any
import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "DistInfo", "init_distributed", "cleanup_distributed", "get_rank", "get_world_size", "get_local_rank",
    "is_main_process", "is_local_main_process", "barrier", "all_gather_cat", "seed_everything"
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank / world, node-local rank / world, its device and the backend."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Node-local rank 0: the process that starts this node's rollout worker group."""
        return self.local_rank == 0

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(device: str | None = None, *, timeout_s: float = 1800.0) -> DistInfo:
    """Initialise the default process group from torchrun's env vars and return this process's `DistInfo`.

    device: "cuda", "cpu" or None (= cuda when available). CUDA uses NCCL with `cuda:LOCAL_RANK` as the current
    device (plus gloo for CPU tensors: backend "cpu:gloo,cuda:nccl"); CPU uses gloo. Without torchrun (no
    WORLD_SIZE in the env) a 1-process group on a free local port is created (the environment is left untouched),
    so FSDP2, collectives and checkpoints run the same code path single-process. Calling it again when the group
    already exists just returns the info.
    """
    device_type = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' requested but torch.cuda.is_available() is False; pass --device cpu")
    under_torchrun = "WORLD_SIZE" in os.environ
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are visible; launch "
                f"torchrun with --nproc_per_node <= the number of trainer GPUs (check CUDA_VISIBLE_DEVICES)"
            )
        torch.cuda.set_device(local_rank)
        # NCCL for CUDA tensors plus gloo for CPU tensors (object collectives, CPU metric vectors) in one group
        dev, backend = torch.device("cuda", local_rank), "cpu:gloo,cuda:nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if dev.type == "cuda":
            kwargs["device_id"] = dev
        if not under_torchrun:
            kwargs.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        dist.init_process_group(**kwargs)
    rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank, world, local_rank, local_world, dev, backend)


def cleanup_distributed() -> None:
    """Destroy the default process group (a no-op when none exists)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    return get_rank() == 0


def is_local_main_process() -> bool:
    """Node-local rank 0 (from LOCAL_RANK): the process that launches this node's rollout worker group."""
    return get_local_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's (B, ...) tensor along dim 0 in rank order -> (W*B, ...), e.g. rewards for the
    global-batch advantages. All ranks must pass the same shape and dtype (checked; a mismatch raises)."""
    world = get_world_size()
    if world == 1 or not dist.is_initialized():
        return t
    shapes: list[Any] = [None] * world
    dist.all_gather_object(shapes, (tuple(t.shape), str(t.dtype)))
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"all_gather_cat: ranks hold different shapes/dtypes {shapes}; pad to equal per-rank batches")
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    # torch >= 2.14 deprecates all_gather_into_tensor (a FutureWarning per call) for all_gather_single, same op
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t.contiguous())
    return out


def seed_everything(seed: int, *, per_rank: bool = True) -> int:
    """Seed python `random`, numpy's global RNG, torch CPU and all CUDA generators; return the seed used.

    per_rank=True adds the global rank, so data-parallel ranks draw different noise (NFT's re-noising) while the
    run stays reproducible for a fixed world size.
    """
    used = int(seed) + (get_rank() if per_rank else 0)
    random.seed(used)
    np.random.seed(used % 2**32)
    torch.manual_seed(used)  # also seeds every CUDA device
    return used
