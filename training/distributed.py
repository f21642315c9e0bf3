"""Distributed: torchrun process groups (NCCL on GPU + gloo for CPU tensors, gloo on CPU), rank helpers, seeds."""

from __future__ import annotations

import datetime
import os
import random
import socket
from dataclasses import dataclass
from typing import Any, Callable
import numpy as np
import torch
import torch.distributed as dist
# Imported before any process group exists: torch.distributed.nn.functional binds `group.WORLD` as default arguments
# when first imported (loading a model imports it through torch.distributed.fsdp). Imported after init_distributed it
# would hold the group for good, destroy_process_group could neither free it nor join its gloo threads, and one of
# them dropping a finished collective during interpreter shutdown aborts the rank ("terminate called without an
# active exception", SIGABRT, at the end of 2-rank runs of scripts/sample.py under load).
import torch.distributed.nn  # noqa: F401,E402

__all__ = [
    "DistInfo", "init_distributed", "cleanup_distributed", "get_rank", "launch_rank", "get_world_size", "get_local_rank",
    "get_local_world_size", "is_main_process", "barrier", "all_gather_cat", "seed_everything", "RankFailed",
    "raise_if_any_rank_failed", "run_phase", "on_rank0", "collective_timeout_s", "COLLECTIVE_TIMEOUT_MARGIN_S", "scores_http_judge"
]

# What a collective waits beyond the longest per-phase timeout of the run before giving up (see collective_timeout_s)
COLLECTIVE_TIMEOUT_MARGIN_S = 600.0


class RankFailed(RuntimeError):
    """Another rank failed in a phase all ranks run together; the message is that rank's error, so every rank's log
    says what went wrong (not a bare collective timeout)."""


def raise_if_any_rank_failed(error: BaseException | None, what: str, *, exc_type: type = RankFailed,
                             group: Any = None) -> None:
    """Collective (one all_gather_object over `group`, default: every rank): every rank says whether its part of
    phase `what` failed; a rank that failed re-raises its own error, every other rank raises `exc_type` with the
    first failed rank's message ("<what> failed on rank R: <error>"). So an error seen by one rank (a frozen rollout
    worker on a node's driver, a failed save on rank 0) ends every rank with the same explanation, instead of the
    others dying later in a collective timeout. A no-op without a process group."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    messages: list[Any] = [mine]
    if dist.is_initialized() and world > 1:
        messages = [None] * world
        dist.all_gather_object(messages, mine, group=group)
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        rank, message = failed[0]
        if group is not None:
            rank = dist.get_global_rank(group, rank)
        raise exc_type(f"{what} failed on rank {rank}: {message}")


def run_phase(fn: Callable[[], Any], what: str,
              fail: Callable[[BaseException | None, str], None] = raise_if_any_rank_failed) -> Any:
    """`fn()`, this rank's part of phase `what`, then `fail(its exception or None, what)` on every rank alike
    (collective: `raise_if_any_rank_failed`, or a trainer's `Run.raise_fatal`, which also writes the last finished
    step), so one rank's error ends every rank with it instead of leaving the others in a later collective.
    Returns `fn()`'s result."""
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - re-raised on this rank, and its message on every other one
        error = e
    fail(error, what)
    return result


def on_rank0(fn: Callable[[], Any], *, catch: tuple[type, ...], exc_type: type, what: str = "",
             share: bool = True) -> Any:
    """`fn()` on rank 0 only, its result given to every rank (one broadcast; with share=False the result stays on
    rank 0, e.g. an object that holds a file, and the other ranks get None). An exception of a `catch` type there
    is raised as `exc_type` on every rank (message prefixed by `what`), so no rank waits in a later collective."""
    payload: tuple[str, Any] | None = None
    result = None
    if get_rank() == 0:
        try:
            result = fn()
            payload = ("ok", result if share else None)
        except catch as e:
            payload = ("error", what + (str(e) if isinstance(e, exc_type) else f"{type(e).__name__}: {e}"))
    if dist.is_initialized() and get_world_size() > 1:
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
    if payload[0] == "error":
        raise exc_type(payload[1])
    return payload[1] if share else result


def collective_timeout_s(args: Any) -> float:
    """The timeout of every process group of a training run (the main group and the nodes' rollout subgroups):
    `--collective_timeout_s` when set, else the longest per-phase timeout of the run plus
    `COLLECTIVE_TIMEOUT_MARGIN_S`. While one rank works through a phase (a node's driver waiting up to
    --rollout_timeout_s for a silent rollout worker or --rollout_startup_timeout_s for one that starts, a judge
    request of up to (--genrm_max_retries + 1) x --genrm_timeout_s + backoff), the other ranks wait in a collective;
    it must outlast the phase so that they hear the phase's own error (which the failing rank sends them) rather than
    dying first in a bare timeout; the judge counts only for a run that scores it (`scores_http_judge`). An explicit
    value not above every phase timeout raises ValueError naming them."""
    import rewards

    phases = {
        "--rollout_timeout_s": float(args.rollout_timeout_s),
        "--rollout_startup_timeout_s": float(getattr(args, "rollout_startup_timeout_s", 0.0) or 0.0),
        "a judge request ((--genrm_max_retries + 1) x --genrm_timeout_s + backoff + --genrm_retry_total_s)":
            rewards.genrm_request_budget_s(args.genrm_timeout_s, args.genrm_max_retries, args.genrm_backoff_s,
                                           getattr(args, "genrm_retry_total_s", 0.0))
            if scores_http_judge(args) else 0.0,
    }
    longest_flag, longest = max(phases.items(), key=lambda item: item[1])
    chosen = getattr(args, "collective_timeout_s", None)
    if chosen is None or chosen <= 0:
        return longest + COLLECTIVE_TIMEOUT_MARGIN_S
    if chosen <= longest:
        raise ValueError(f"--collective_timeout_s {chosen:g} is not above {longest_flag} ({longest:g} s): ranks "
                         f"waiting for that phase would time out before its error reaches them; pass a larger "
                         f"value or 0 (= the longest phase timeout + {COLLECTIVE_TIMEOUT_MARGIN_S:g} s)")
    return float(chosen)


def scores_http_judge(args: Any) -> bool:
    """Whether the run scores the OCR reward through the HTTP judge (--ocr_backend http): "ocr" among
    --reward_weights, else among the data_source values of --train_files / --val_files (that column only). A file
    that cannot be read counts as scoring it: the dataset checks report the file, the judge's budget stays counted
    until then."""
    if getattr(args, "ocr_backend", "http") != "http":
        return False
    if getattr(args, "reward_weights", None):
        import rewards

        try:
            return "ocr" in rewards.parse_reward_weights(args.reward_weights)
        except ValueError:
            return True
    import pyarrow.parquet as pq

    for flag in ("train_files", "val_files"):
        path = getattr(args, flag, None)
        if not path:
            continue
        try:
            sources = pq.read_table(os.path.expanduser(str(path)), columns=["data_source"]).column(0).to_pylist()
        except Exception:  # noqa: BLE001 - missing, unreadable, no data_source column: check_datasets names it
            return True
        if "ocr" in sources:
            return True
    return False


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
    local_world = get_local_world_size()
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


def launch_rank() -> int:
    """This process's global rank, also before the process group exists: the group's rank once initialised, else
    torchrun's $RANK, else 0 (a plain `python train_*.py`)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_local_world_size() -> int:
    """The ranks on this node: torchrun's $LOCAL_WORLD_SIZE, else $WORLD_SIZE (one node), else 1 (no launcher)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1")


def is_main_process() -> bool:
    return get_rank() == 0


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
