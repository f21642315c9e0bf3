"""Shared training plumbing for `train_nft.py` and `train_dppo.py`: one implementation of each piece, no framework.

Sections (each a handful of small functions; read top to bottom):

1. Distributed: `init_distributed` (torchrun env vars; NCCL on GPU, gloo on CPU; a 1-process group without
   torchrun), rank helpers, `seed_everything`, node-local rank 0 (the rollout group is started once per node).
2. Model preparation: LoRA through `models/lora.py` (peft) with named adapters ("default" trained, "old" for
   DiffusionNFT), adapter switching that never leaks `requires_grad`, composable activation checkpointing (module
   names stay unchanged), FSDP2 `fully_shard` per transformer block + the root with a `MixedPrecisionPolicy`, and
   the DTensor-aware gather / load of adapter tensors that checkpoints and rollout weight sync need.
3. Optimizer: AdamW over the "default" LoRA params (fused on CUDA), grad-norm clipping on FSDP2 DTensor grads, a
   non-finite grad norm skips the step (counted, logged); the DiffusionNFT `old` adapter copy / EMA refresh.
4. Data: `PromptSampler`, a resumable, deterministic, epoch-shuffled sampler of prompt indices, sharded per rank.
5. Checkpoints: atomic save (temp dir, marker written last, rename), `find_latest`, exact `load_checkpoint` that
   refuses a different config (naming the differing keys) and a partial or corrupt checkpoint.
6. Logging: TensorBoard on rank 0, metric accumulation over micro-batches + one all_reduce over ranks, the
   `critic/*` reward/advantage stats, validation keys, image grids, a progress line with ETA, timers, run metadata.
7. The parts of an online RL step both trainers share: flags, rollout requests, rewards, global advantages,
   validation, the adapter sync to the rollout workers (with its bound-module check).
8. `setup_run` / `Run`: the setup both trainers do before their loop and the tail of every step (log, validate,
   checkpoint), so each trainer file holds only its algorithm.

Checkpoint layout (``<root>/step_00000012/``)::

    adapters/default/{adapter_config.json, adapter_model.safetensors}   # diffusers `load_lora_weights` loads it
    adapters/old/...
    optimizer.pt        # full (unsharded) optimizer state, keyed by parameter name (`optimizer_full_state`)
    rng.pt              # python / numpy / torch CPU / CUDA RNG states, one entry per rank
    trainer_state.json  # step, sampler cursor, config fingerprint + fingerprinted values, versions, trainer extras
    COMPLETE            # written last (JSON: step, file sizes); a directory without it is never loaded

Rank 0 writes every file (state is gathered to it first); EVERY rank reads the checkpoint on load, so the checkpoint
directory must be visible to all ranks (a shared filesystem, as for any multi-node torchrun job). The optimizer state
is saved as one full state dict (not DCP shards): the trainable state is LoRA-sized, a full dict is resharding-free
and readable with plain `torch.load`. It is gathered/scattered by our own two functions rather than torch's
`get/set_optimizer_state_dict`, which fail on parameters without Adam state (a LoRA that never gets a gradient).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import losses
from models import lora

__all__ = [
    # distributed
    "DistInfo", "init_distributed", "cleanup_distributed", "get_rank", "get_world_size", "get_local_rank",
    "is_main_process", "is_local_main_process", "barrier", "seed_everything", "all_gather_cat",
    # model preparation
    "add_lora_adapters", "adapter_params", "use_adapter", "transformer_blocks",
    "apply_activation_checkpointing", "mixed_precision_policy", "shard_transformer", "prepare_transformer",
    "adapter_state_dict", "load_adapter_state_", "save_adapter_dir", "read_adapter_dir",
    # optimizer
    "build_optimizer", "GradStepper", "ema_adapter_", "old_policy_refresh",
    # data
    "PromptSampler", "SamplerBatch",
    # checkpoints
    "config_fingerprint", "save_checkpoint", "find_latest", "load_checkpoint", "CheckpointError",
    "optimizer_full_state", "load_optimizer_full_state_",
    # logging
    "TensorBoardLogger", "MetricAccumulator", "reward_metrics", "validation_metrics", "perf_metrics",
    "image_grid", "Progress", "timer", "library_versions", "git_commit", "write_run_metadata",
    # a run
    "Run", "setup_run",
]

ADAPTER_DEFAULT = "default"
ADAPTER_OLD = "old"


# =================================================================================================================
# 1. Distributed
# =================================================================================================================


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
    dist.all_gather_into_tensor(out, t.contiguous())
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


# =================================================================================================================
# 2. Model preparation: LoRA (peft), activation checkpointing, FSDP2
# =================================================================================================================


def _adapter_pattern(adapter: str) -> re.Pattern:
    # peft names: "<path>.lora_A.<adapter>.weight" (ModuleDict) or "<path>.lora_embedding_A.<adapter>" (ParameterDict)
    return re.compile(r"(^|\.)(lora_[A-Za-z_]+)\." + re.escape(adapter) + r"(\.|$)")


def _strip_adapter(name: str, adapter: str) -> str:
    """"a.lora_A.default.weight" -> "a.lora_A.weight"."""
    return _adapter_pattern(adapter).sub(lambda m: m.group(1) + m.group(2) + m.group(3), name, count=1)


def adapter_params(module: nn.Module, adapter: str = ADAPTER_DEFAULT) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every LoRA tensor of `adapter`, in `named_parameters` order (stable across ranks)."""
    pattern = _adapter_pattern(adapter)
    return [(n, p) for n, p in module.named_parameters() if pattern.search(n)]


def add_lora_adapters(
    transformer: nn.Module,
    *,
    target_modules: Sequence[str],
    rank: int,
    alpha: float,
    block_prefixes: Sequence[str],
    adapter_names: Sequence[str] = (ADAPTER_DEFAULT,),
    init_lora_weights: bool | str = "gaussian",
):
    """`models.lora.apply_lora` (target validation, one peft adapter per name, only the first trainable and
    active), then every LoRA tensor cast to float32 (trainable master weights; FSDP2's mixed-precision policy casts
    them for compute). Returns the adapters' `LoraConfig`. Module names stay the model's own (no PeftModel wrapper).

    init_lora_weights: peft's option; "gaussian" (verl-omni's `lora_init_weights` default) or True (kaiming A).
    Both start with B = 0, so "default" starts equal to the base model.
    """
    if rank <= 0:
        raise ValueError(f"LoRA rank must be > 0, got {rank} (full fine-tuning is not supported by these trainers)")
    lora.apply_lora(transformer, list(target_modules), rank=int(rank), alpha=alpha, block_prefixes=block_prefixes,
                    adapter_names=tuple(adapter_names), init_lora_weights=init_lora_weights)
    for name in adapter_names:
        for _, p in adapter_params(transformer, name):
            p.data = p.data.float()
    return transformer.peft_config[adapter_names[0]]


@contextlib.contextmanager
def use_adapter(transformer: nn.Module, adapter: str) -> Iterator[None]:
    """Run forwards with `adapter` active (e.g. "old" for DiffusionNFT's old-policy pass); the previous active
    adapter is restored on exit; `requires_grad` flags never change (`models.lora.set_active_adapter`).
    The reference (base) model forward is `models.lora.lora_disabled(transformer)`.

    With activation checkpointing, backward RECOMPUTES block forwards with whatever adapter is active at backward
    time: call `backward()` outside `use_adapter` / `lora_disabled` blocks (i.e. with "default" active) and
    run the old / reference forwards under `torch.no_grad()`."""
    layers = lora.lora_layers(transformer)
    if not layers:
        raise RuntimeError("use_adapter: the transformer has no LoRA layers (call add_lora_adapters first)")
    previous = next(iter(layers.values())).active_adapters
    if len(previous) != 1:
        raise RuntimeError(f"use_adapter expects one active adapter, found {previous}")
    lora.set_active_adapter(transformer, adapter)
    try:
        yield
    finally:
        lora.set_active_adapter(transformer, previous[0])


def transformer_blocks(transformer: nn.Module, block_prefixes: Sequence[str]) -> list[nn.Module]:
    """The transformer blocks: for each top-level child named in `block_prefixes`, its elements when it is a
    ModuleList/Sequential, else the child itself. (B blocks, in order.)"""
    if not block_prefixes:
        raise ValueError("block_prefixes is empty; pass the model wrapper's lora_block_prefixes")
    blocks: list[nn.Module] = []
    children = dict(transformer.named_children())
    for prefix in block_prefixes:
        if prefix not in children:
            raise ValueError(
                f"block prefix {prefix!r} is not a child of {type(transformer).__name__} (children: {sorted(children)})"
            )
        child = children[prefix]
        blocks.extend(child if isinstance(child, (nn.ModuleList, nn.Sequential)) else [child])
    return blocks


def apply_activation_checkpointing(transformer: nn.Module, block_prefixes: Sequence[str]) -> int:
    """Checkpoint the activations of every transformer block (recomputed in backward); return the block count.

    Uses torch's composable `checkpoint` (hooks, non-reentrant), so module and parameter names do not change and
    LoRA export / optimizer FQNs stay the same. Apply before `shard_transformer`.
    """
    from torch.distributed._composable import checkpoint

    blocks = transformer_blocks(transformer, block_prefixes)
    for block in blocks:
        checkpoint(block)
    return len(blocks)


def mixed_precision_policy(device: torch.device, precision: str = "bf16"):
    """FSDP2 MixedPrecisionPolicy: bf16 compute with fp32 gradient reduction on GPU; on CPU always fp32.

    precision: "bf16" | "fp32". fp32 = no casting (the parameters' own dtype is used).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    if precision == "fp32" or torch.device(device).type == "cpu":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_transformer(
    transformer: nn.Module,
    block_prefixes: Sequence[str],
    *,
    mp_policy=None,
    device: torch.device | str | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2: `fully_shard` every transformer block, then the root (embedders, norms, output projection).

    Parameters become DTensors sharded on dim 0 over all ranks of the default process group, on `device`'s type
    (default: where the parameters are now; an explicit mesh, because fully_shard's default mesh is CUDA whenever
    CUDA exists). Build the optimizer AFTER this.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = torch.device(device) if device is not None else next(transformer.parameters()).device
    mesh = init_device_mesh(device.type, (get_world_size(),))
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for block in transformer_blocks(transformer, block_prefixes):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(transformer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return transformer


def prepare_transformer(
    transformer: nn.Module,
    *,
    block_prefixes: Sequence[str],
    target_modules: Sequence[str],
    lora_rank: int,
    lora_alpha: float,
    adapter_names: Sequence[str] = (ADAPTER_DEFAULT,),
    device: torch.device | str = "cpu",
    precision: str = "bf16",
    activation_checkpointing: bool = False,
    init_lora_weights: bool | str = "gaussian",
):
    """LoRA -> (activation checkpointing) -> FSDP2, in that order; returns the `LoraConfig`.

    For a FlowModel `m`: `prepare_transformer(m.transformer, block_prefixes=m.lora_block_prefixes,
    target_modules=m.default_lora_targets, ...)`. The base weights are frozen; with two adapter names (DiffusionNFT)
    "old" starts as an independent random init: hard-copy it (`models.lora.copy_adapter_(t, "default", "old")`)
    at the start of training, after any checkpoint load.
    """
    transformer.requires_grad_(False)
    # No whole-model move here: fully_shard moves each block to `device` as it shards it (lower peak memory).
    config = add_lora_adapters(
        transformer,
        target_modules=target_modules,
        rank=lora_rank,
        alpha=lora_alpha,
        adapter_names=adapter_names,
        init_lora_weights=init_lora_weights,
        block_prefixes=block_prefixes,
    )
    if activation_checkpointing:
        apply_activation_checkpointing(transformer, block_prefixes)
    shard_transformer(transformer, block_prefixes, mp_policy=mixed_precision_policy(torch.device(device), precision),
                      device=device)
    return config


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded DTensor) parameter; a collective for DTensors."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def adapter_state_dict(transformer: nn.Module, adapter: str, *, all_ranks: bool = True) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU float32 tensors of `adapter`, keyed `<module path>.lora_A.weight` (adapter name dropped,
    the model's own module names). A collective: every rank must call it; with `all_ranks=False` only rank 0 (the
    writer) copies the gathered tensors to the host, the others get an empty dict."""
    out: dict[str, torch.Tensor] = {}
    keep = all_ranks or is_main_process()
    for name, p in adapter_params(transformer, adapter):
        full = _full(p.detach())  # the gather is collective: every rank runs it
        if keep:
            out[_strip_adapter(name, adapter)] = full.to("cpu", torch.float32).clone()
    if keep and not out:
        raise ValueError(f"the transformer has no LoRA tensors for adapter {adapter!r}")
    return out


@torch.no_grad()
def load_adapter_state_(transformer: nn.Module, adapter: str, state: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors (keys as `adapter_state_dict` returns them) into `adapter`'s (possibly sharded) params.

    Strict: a missing key, an extra key or a shape mismatch raises, naming the keys.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = {_strip_adapter(n, adapter): p for n, p in adapter_params(transformer, adapter)}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"adapter {adapter!r}: tensors do not match the model's LoRA layout (missing {len(missing)}: "
            f"{missing[:3]}, unexpected {len(unexpected)}: {unexpected[:3]}); was it saved with other LoRA targets?"
        )
    for key, p in params.items():
        full = state[key]
        if tuple(full.shape) != tuple(p.shape):
            raise ValueError(f"adapter {adapter!r}: {key} has shape {tuple(full.shape)}, the model {tuple(p.shape)}")
        if isinstance(p, DTensor):
            local = distribute_tensor(full.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(local.to_local())
        else:
            p.copy_(full.to(p.device, p.dtype))


def save_adapter_dir(state: Mapping[str, torch.Tensor], lora_config, out_dir: str, *,
                     engine_names: bool = False) -> None:
    """Rank-0 half of an adapter export: write full tensors (from `adapter_state_dict`, gathered on every rank) as a
    PEFT adapter directory with `models.lora.write_adapter_dir` (diffusers' `load_lora_weights` reads it;
    engine_names=True writes vllm-omni names)."""
    config = json.loads(json.dumps(lora_config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    config.update(peft_type="LORA", inference_mode=True, use_dora=False, lora_bias=False,
                  target_modules=sorted(lora_config.target_modules))
    lora.write_adapter_dir(dict(state), config, out_dir, engine_names=engine_names)


def read_adapter_dir(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a PEFT adapter directory (`models.lora.read_adapter`: either key form, vllm-omni names mapped
    back), keyed like `adapter_state_dict`. Unreadable or malformed -> CheckpointError naming the directory."""
    try:
        _, modules = lora.read_adapter(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read LoRA adapter {path}: {type(e).__name__}: {e}; the checkpoint is corrupt") from e
    return {f"{module}.lora_{ab}.weight": t for module, pair in modules.items() for ab, t in pair.items()}


# =================================================================================================================
# 3. Optimizer, grad clipping with skip on non-finite norms, the DiffusionNFT old adapter
# =================================================================================================================


def build_optimizer(
    transformer: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    adapter: str = ADAPTER_DEFAULT,
) -> torch.optim.AdamW:
    """AdamW over `adapter`'s LoRA tensors that require grad (fused kernel on CUDA). Build after sharding."""
    params = [p for _, p in adapter_params(transformer, adapter) if p.requires_grad]
    if not params:
        raise ValueError(f"no trainable LoRA parameters for adapter {adapter!r}; call add_lora_adapters first")
    frozen_trainable = [n for n, p in transformer.named_parameters() if p.requires_grad and not _adapter_pattern(adapter).search(n)]
    if frozen_trainable:
        raise ValueError(f"parameters outside adapter {adapter!r} require grad: {frozen_trainable[:3]}; freeze them")
    fused = params[0].device.type == "cuda"
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)


@dataclass
class GradStepper:
    """Clip, check and apply one optimizer step; a non-finite total grad norm skips the step (grads zeroed).

    `skipped_steps` counts skips over the whole run (restore it from the checkpoint's trainer state). The total norm
    is computed by `torch.nn.utils.clip_grad_norm_`, which reduces FSDP2 DTensor grads across ranks (verified on
    gloo/CPU against an unsharded model), so every rank takes the same skip decision.
    """

    max_grad_norm: float = 1.0
    skipped_steps: int = 0

    def step(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """Returns {"actor/grad_norm", "actor/lr", "actor/step_skipped", "actor/skipped_steps"}."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if params:
            max_norm = self.max_grad_norm if self.max_grad_norm and self.max_grad_norm > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
            grad_norm = float(_full(norm).item())
        else:
            grad_norm = 0.0
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.skipped_steps += 1
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {
            "actor/grad_norm": grad_norm,
            "actor/lr": float(optimizer.param_groups[0]["lr"]),
            "actor/step_skipped": float(skipped),
            "actor/skipped_steps": float(self.skipped_steps),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"max_grad_norm": self.max_grad_norm, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped_steps = int(state["skipped_steps"])


def ema_adapter_(transformer: nn.Module, decay: float, src: str = ADAPTER_DEFAULT, dst: str = ADAPTER_OLD) -> None:
    """dst <- decay * dst + (1 - decay) * src on the LoRA A/B tensors (`losses.ema_update_`; decay 0 = hard copy,
    which `models.lora.copy_adapter_` also does). Works on FSDP2 shards: both adapters of a layer share a placement."""
    old, new = [], []
    for path, layer in lora.lora_layers(transformer, src).items():
        if dst not in layer.lora_A:
            raise ValueError(f"adapter {dst!r} is missing on {path}")
        for mod in (layer.lora_A, layer.lora_B):
            old.append(mod[dst].weight.data)
            new.append(mod[src].weight.data)
    if not old:
        raise ValueError(f"the transformer has no LoRA adapter {src!r}")
    losses.ema_update_(old, new, decay)


def old_policy_refresh(
    transformer: nn.Module,
    step: int,
    *,
    interval: int = 1,
    schedule: str = "copy",
    decay: float | None = None,
) -> dict[str, float]:
    """DiffusionNFT's old-adapter refresh after the actor update of rollout step `step` (1-based, verl-omni).

    Applied when `step % interval == 0`: d = `decay` if given else `losses.old_policy_decay(step, schedule)`;
    d == 0 -> hard copy, else EMA. Returns the `old_policy/*` metrics exactly as verl-omni logs them (all 0.0 when
    the refresh is not due).
    """
    if interval < 1:
        raise ValueError(f"old_policy_update_interval must be >= 1, got {interval}")
    metrics = {"old_policy/update_applied": 0.0, "old_policy/copy_update": 0.0, "old_policy/ema_update": 0.0,
               "old_policy/decay": 0.0}
    if step % interval != 0:
        return metrics
    d = float(decay) if decay is not None else losses.old_policy_decay(step, schedule)
    metrics["old_policy/update_applied"] = 1.0
    metrics["old_policy/decay"] = d
    if d == 0.0:
        lora.copy_adapter_(transformer, ADAPTER_DEFAULT, ADAPTER_OLD)
        metrics["old_policy/copy_update"] = 1.0
    else:
        ema_adapter_(transformer, d)
        metrics["old_policy/ema_update"] = 1.0
    return metrics


# =================================================================================================================
# 4. Data: resumable, deterministic, epoch-shuffled prompt sampler
# =================================================================================================================


@dataclass(frozen=True)
class SamplerBatch:
    """One rollout step's prompts. indices: the global batch (train_batch_size dataset indices); local: this
    rank's contiguous share (train_batch_size / world). The trainer repeats each prompt n times for the group."""

    indices: list[int]
    local: list[int]
    epoch: int
    step_in_epoch: int


class PromptSampler:
    """Epoch-shuffled prompt indices over `dataset_len` prompts, `batch_size` (= data.train_batch_size) per step.

    Epoch e uses the permutation `np.random.default_rng([seed, e]).permutation(dataset_len)`, cut into
    `dataset_len // batch_size` steps (the incomplete tail is dropped, as verl's dataloader does). The cursor
    (epoch, step_in_epoch) is the whole state: `state_dict()` / `load_state_dict()` resume exactly. Every rank holds
    the same global sequence; `SamplerBatch.local` is rank r's slice [r*B/W, (r+1)*B/W).
    """

    def __init__(self, dataset_len: int, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if dataset_len < batch_size:
            raise ValueError(
                f"the dataset has {dataset_len} prompts, fewer than train_batch_size={batch_size}; lower the batch size"
            )
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(f"bad rank/world_size {rank}/{world_size}")
        if batch_size % world_size != 0:
            raise ValueError(
                f"train_batch_size={batch_size} prompts must be divisible by the {world_size} data-parallel ranks"
            )
        self.dataset_len, self.batch_size, self.seed = int(dataset_len), int(batch_size), int(seed)
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.steps_per_epoch = self.dataset_len // self.batch_size
        self.epoch, self.step_in_epoch = 0, 0
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = (np.random.default_rng([self.seed, epoch]).permutation(self.dataset_len) if self.shuffle
                          else np.arange(self.dataset_len))
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> SamplerBatch:
        """The next step's prompts; advances the cursor (rolling into the next epoch when this one is used up)."""
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        start = self.step_in_epoch * self.batch_size
        indices = [int(i) for i in self._permutation(self.epoch)[start:start + self.batch_size]]
        per_rank = self.batch_size // self.world_size
        batch = SamplerBatch(indices, indices[self.rank * per_rank:(self.rank + 1) * per_rank], self.epoch,
                             self.step_in_epoch)
        self.step_in_epoch += 1
        return batch

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "dataset_len": self.dataset_len,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the cursor; refuses a state from another dataset length, batch size, seed or shuffle setting."""
        for key in ("dataset_len", "batch_size", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r}, this run has {getattr(self, key)!r}; "
                    f"resume with the same data and flags"
                )
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])


# =================================================================================================================
# 5. Checkpoints
# =================================================================================================================


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: partial, corrupt, or from a different config."""


_STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE"
# Flags that may change between a run and its resume (everything else is fingerprinted; new flags are protected).
# Only bookkeeping / I/O flags: anything that can change a sampled number stays fingerprinted.
RESUME_MUTABLE_KEYS: tuple[str, ...] = (
    "resume", "total_training_steps", "save_freq", "keep_last", "test_freq", "val_before_train", "num_val_images",
    "log_every", "output_dir", "val_max_samples", "rollout_timeout_s", "rollout_threads",
)


def config_fingerprint(config: Mapping[str, Any], ignore: Iterable[str] = RESUME_MUTABLE_KEYS) -> tuple[str, dict[str, Any]]:
    """(sha256 hex, fingerprinted values): every config key except `ignore`, JSON-normalised (tuples -> lists)."""
    ignore = set(ignore)
    values = {k: config[k] for k in sorted(config) if k not in ignore}
    values = json.loads(json.dumps(values, sort_keys=True, default=str))
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode("utf-8")).hexdigest()
    return digest, values


def library_versions() -> dict[str, str]:
    """Versions of python, torch (and CUDA), diffusers, transformers, peft, numpy."""
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
           "numpy": np.__version__}
    for name in ("diffusers", "transformers", "peft"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's generator
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if not torch.cuda.is_available():
            raise CheckpointError("the checkpoint holds CUDA RNG states but CUDA is unavailable; resume on GPU")
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _file_sizes(root: str) -> dict[str, int]:
    sizes = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            full = os.path.join(dirpath, f)
            sizes[os.path.relpath(full, root)] = os.path.getsize(full)
    return dict(sorted(sizes.items()))


def optimizer_full_state(transformer: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state with full (unsharded) CPU tensors, keyed by parameter name. Collective.

    {"state": {param name: {"step": 0-dim tensor, "exp_avg": full tensor, ...}}, "param_groups": [{hyper-params,
    "params": [param names]}]}. Parameters that never received a gradient have no entry (AdamW creates none), e.g.
    the text-stream LoRA of Qwen-Image's last block, whose output never reaches the image; torch's
    `get/set_optimizer_state_dict` refuse or hang on such parameters, so this is done here, explicitly.
    """
    names = {id(p): n for n, p in transformer.named_parameters()}
    groups, owned = [], []
    for group in optimizer.param_groups:
        if any(id(p) not in names for p in group["params"]):
            raise ValueError("the optimizer holds parameters that are not parameters of the transformer")
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]})
        owned += [(names[id(p)], p) for p in group["params"] if optimizer.state.get(p)]
    with_state = [n for n, _ in owned]
    everyone: list[Any] = [None] * get_world_size()
    if dist.is_initialized() and get_world_size() > 1:
        dist.all_gather_object(everyone, with_state)
    else:
        everyone = [with_state]
    if any(e != with_state for e in everyone):  # the gathers below are collectives: every rank needs the same list
        raise RuntimeError("ranks hold optimizer state for different parameters; cannot save a consistent checkpoint")
    state = {}
    for name, p in owned:
        state[name] = {k: (_full(v).detach().to("cpu").clone() if torch.is_tensor(v) else v)
                       for k, v in optimizer.state[p].items()}
    return {"state": state, "param_groups": groups}


def load_optimizer_full_state_(transformer: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """Inverse of `optimizer_full_state`: shard the saved tensors like their parameters and load them (no
    communication; every rank holds `saved`). The parameter names per group must match exactly."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    names = {id(p): n for n, p in transformer.named_parameters()}
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"{len(saved['param_groups'])} saved param groups vs {len(optimizer.param_groups)} now")
    state, groups, index = {}, [], 0
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        current = [names[id(p)] for p in group["params"]]
        if current != saved_group["params"]:
            diff = sorted(set(current) ^ set(saved_group["params"]))
            raise ValueError(f"optimizer parameters differ from the checkpoint's (e.g. {diff[:3]}); other LoRA targets?")
        ids = []
        for name, p in zip(current, group["params"]):
            if name in saved["state"]:
                entry = {}
                for k, v in saved["state"][name].items():
                    if torch.is_tensor(v) and v.dim() > 0 and isinstance(p, DTensor):
                        v = distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                    entry[k] = v
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    optimizer.state.clear()
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(
    root: str,
    step: int,
    *,
    transformer: nn.Module,
    optimizer: torch.optim.Optimizer,
    lora_config,
    config: Mapping[str, Any],
    sampler: PromptSampler | None = None,
    adapter_names: Sequence[str] = (ADAPTER_DEFAULT,),
    trainer_state: Mapping[str, Any] | None = None,
    fingerprint_ignore: Iterable[str] = RESUME_MUTABLE_KEYS,
    keep_last: int | None = None,
) -> str:
    """Save everything needed to resume at `step` to `<root>/step_XXXXXXXX`; return that path. Collective.

    All ranks gather (adapter tensors, optimizer state, per-rank RNG); rank 0 writes into a temp directory, fsyncs,
    writes the COMPLETE marker last and renames the directory into place, so `<root>` never holds a half-written
    step directory. trainer_state: JSON-able extras (e.g. GradStepper.state_dict(), counters). keep_last: delete
    older complete checkpoints beyond this many.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    adapters = {name: adapter_state_dict(transformer, name, all_ranks=False) for name in adapter_names}
    optim_state = optimizer_full_state(transformer, optimizer)
    rng_states: list[Any] = [None] * get_world_size()
    if dist.is_initialized():
        dist.all_gather_object(rng_states, _rng_state())
    else:
        rng_states = [_rng_state()]
    rank = get_rank()
    final = os.path.join(root, f"step_{step:08d}")
    error: BaseException | None = None
    if rank == 0:
        digest, values = config_fingerprint(config, fingerprint_ignore)
        state = {
            "step": int(step),
            "world_size": get_world_size(),
            "adapters": list(adapter_names),
            "sampler": sampler.state_dict() if sampler is not None else None,
            "config_fingerprint": digest,
            "fingerprinted_config": values,
            "versions": library_versions(),
            "trainer_state": dict(trainer_state or {}),
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        }
        try:
            _write_checkpoint_dir(root, final, state, adapters, lora_config, optim_state, rng_states)
            if keep_last is not None and keep_last > 0:
                for old_step in _complete_steps(root)[:-keep_last]:
                    shutil.rmtree(os.path.join(root, f"step_{old_step:08d}"), ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 - re-raised below on every rank
            error = e
    _raise_if_any_rank_failed(error, f"save_checkpoint({final})")
    return final


def _raise_if_any_rank_failed(error: BaseException | None, what: str) -> None:
    """Collective: every rank raises when any rank failed (instead of the others hanging in a later collective)."""
    messages: list[Any] = [None] * get_world_size()
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if dist.is_initialized() and get_world_size() > 1:
        dist.all_gather_object(messages, mine)
    else:
        messages = [mine]
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        raise CheckpointError(f"{what} failed on rank {failed[0][0]}: {failed[0][1]}")


def _write_checkpoint_dir(root: str, final: str, state: dict[str, Any], adapters: Mapping[str, Mapping[str, torch.Tensor]],
                          lora_config, optim_state: Any, rng_states: list[Any]) -> None:
    """Rank 0: write everything into a temp dir, fsync, marker last, rename into place (temp removed on error)."""
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp-{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        for name, tensors in adapters.items():
            save_adapter_dir(tensors, lora_config, os.path.join(tmp, "adapters", name))
        torch.save(optim_state, os.path.join(tmp, "optimizer.pt"))
        torch.save(rng_states, os.path.join(tmp, "rng.pt"))
        with open(os.path.join(tmp, "trainer_state.json"), "w", encoding="utf-8") as f:
            json.dump(state, f, indent=2, sort_keys=True)
        for dirpath, _, files in os.walk(tmp):
            for fname in files:
                with open(os.path.join(dirpath, fname), "rb") as fh:
                    os.fsync(fh.fileno())
        marker = {"step": state["step"], "files": _file_sizes(tmp)}  # sizes of everything but the marker itself
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving a step: swap, then delete the previous copy
            trash = os.path.join(root, f".trash-{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _complete_steps(root: str) -> list[int]:
    steps = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, MARKER)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def find_latest(root: str) -> str | None:
    """Path of the newest COMPLETE checkpoint under `root` (None when `root` has no step directories at all).

    Step directories without the marker (copied by hand, damaged) are skipped with a warning; if step directories
    exist but none is complete, raises CheckpointError instead of letting a resume silently start fresh.
    """
    if not os.path.isdir(root):
        return None
    names = [n for n in os.listdir(root) if _STEP_DIR.match(n)]
    complete = _complete_steps(root)
    incomplete = sorted(n for n in names if int(_STEP_DIR.match(n).group(1)) not in complete)
    if incomplete:
        warnings.warn(f"{root}: skipping checkpoint directories without a {MARKER} marker: {incomplete}")
    if names and not complete:
        raise CheckpointError(
            f"{root} holds checkpoint directories {incomplete} but none is complete (no {MARKER} marker); refusing to "
            f"start fresh. Remove them or pass another --output_dir to start a new run."
        )
    return os.path.join(root, f"step_{complete[-1]:08d}") if complete else None


def _verify_complete(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    marker_path = os.path.join(path, MARKER)
    if not os.path.isfile(marker_path):
        raise CheckpointError(f"checkpoint {path} is partial: the {MARKER} marker (written last) is missing")
    try:
        with open(marker_path, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {MARKER} marker ({e}); the checkpoint is corrupt") from e
    actual = {k: v for k, v in _file_sizes(path).items() if k != MARKER}
    expected = marker.get("files", {})
    if actual != expected:
        diff = sorted(k for k in set(actual) | set(expected) if actual.get(k) != expected.get(k))
        raise CheckpointError(
            f"checkpoint {path} is corrupt: files differ from the {MARKER} manifest (missing, truncated or extra): {diff}"
        )
    return marker


def load_checkpoint(
    path: str,
    *,
    transformer: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Mapping[str, Any],
    sampler: PromptSampler | None = None,
    adapter_names: Sequence[str] = (ADAPTER_DEFAULT,),
    fingerprint_ignore: Iterable[str] = RESUME_MUTABLE_KEYS,
) -> dict[str, Any]:
    """Restore adapters, optimizer, this rank's RNG states and the sampler cursor from `path`; return the saved
    trainer state dict ({"step", "trainer_state", ...}). Collective (every rank reads `path`).

    Refuses (CheckpointError) a partial or corrupt checkpoint, another world size, or a config whose fingerprint
    differs; the message names each differing key with both values. RNG states are restored last, so the next
    random draw equals the uninterrupted run's.
    """
    _verify_complete(path)
    try:
        with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read trainer_state.json ({e})") from e
    digest, values = config_fingerprint(config, fingerprint_ignore)
    if digest != state["config_fingerprint"]:
        saved = state["fingerprinted_config"]
        diffs = [f"{k}: checkpoint={saved.get(k, '<absent>')!r} now={values.get(k, '<absent>')!r}"
                 for k in sorted(set(saved) | set(values)) if saved.get(k, "<absent>") != values.get(k, "<absent>")]
        raise CheckpointError(
            f"checkpoint {path} was written with a different config; refusing to resume. Differing keys:\n  "
            + "\n  ".join(diffs) + "\nResume with the original flags, or start a new run in a fresh --output_dir."
        )
    if state["world_size"] != get_world_size():
        raise CheckpointError(
            f"checkpoint {path} was written by {state['world_size']} ranks, this run has {get_world_size()}; exact "
            f"resume (per-rank RNG, data shards) needs the same number of trainer processes"
        )
    if list(state["adapters"]) != list(adapter_names):
        raise CheckpointError(f"checkpoint {path} holds adapters {state['adapters']}, this run expects {list(adapter_names)}")
    for name in adapter_names:
        load_adapter_state_(transformer, name, read_adapter_dir(os.path.join(path, "adapters", name)))
    error, optim_state, rng_states = None, {}, []
    try:
        optim_state = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=False)
        rng_states = torch.load(os.path.join(path, "rng.pt"), map_location="cpu", weights_only=False)
        load_optimizer_full_state_(transformer, optimizer, optim_state)
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        error = CheckpointError(f"checkpoint {path}: cannot restore optimizer.pt / rng.pt ({type(e).__name__}: {e})")
    _raise_if_any_rank_failed(error, f"load_checkpoint({path})")
    if sampler is not None:
        if state["sampler"] is None:
            raise CheckpointError(f"checkpoint {path} holds no sampler state")
        sampler.load_state_dict(state["sampler"])
    if len(rng_states) != get_world_size():
        raise CheckpointError(f"checkpoint {path}: rng.pt holds {len(rng_states)} rank states, expected {get_world_size()}")
    _set_rng_state(rng_states[get_rank()])
    return state


# =================================================================================================================
# 6. Logging
# =================================================================================================================


class TensorBoardLogger:
    """TensorBoard writer that only writes on rank 0 (other ranks get a no-op object with the same methods)."""

    def __init__(self, log_dir: str, *, enabled: bool | None = None) -> None:
        self.enabled = is_main_process() if enabled is None else enabled
        self.writer = None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir)

    def log_scalars(self, metrics: Mapping[str, float], step: int) -> None:
        if self.writer is None:
            return
        for key, value in metrics.items():
            value = float(value)
            self.writer.add_scalar(key, value, global_step=step)

    def log_image(self, tag: str, image, step: int) -> None:
        """image: a PIL image (e.g. from `image_grid`)."""
        if self.writer is not None:
            self.writer.add_image(tag, np.asarray(image.convert("RGB")), global_step=step, dataformats="HWC")

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class MetricAccumulator:
    """Collect scalar metrics over micro-batches; `reduce()` = mean over micro-batches, then mean over ranks.

    Tensor values stay on their device until `reduce()` (no host sync per micro-batch for callers that pass
    tensors; the losses return Python floats already). The rank mean is ONE
    all_reduce of a float64 vector [means..., key count, key hash]; every rank must have added the same keys (a
    different key set is detected and raised, never silently averaged).
    """

    def __init__(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, metrics: Mapping[str, float | torch.Tensor]) -> None:
        for key, value in metrics.items():
            value = value.detach().double().mean() if isinstance(value, torch.Tensor) else float(value)
            self.sums[key] = self.sums.get(key, 0.0) + value
            self.counts[key] = self.counts.get(key, 0) + 1

    def reduce(self) -> dict[str, float]:
        """Mean over this rank's adds, then the mean over ranks (one collective); clears the accumulator."""
        keys = sorted(self.sums)
        device = next((v.device for v in self.sums.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        world = get_world_size()
        key_hash = float(int(hashlib.sha1("\n".join(keys).encode()).hexdigest(), 16) % (2**40))
        parts = [torch.as_tensor(self.sums[k], dtype=torch.float64, device=device).reshape(1) / self.counts[k]
                 for k in keys]
        tail = torch.tensor([float(len(keys)), key_hash], dtype=torch.float64, device=device)
        vec = torch.cat(parts + [tail])
        self.sums, self.counts = {}, {}
        if world > 1 and dist.is_initialized():
            dist.all_reduce(vec)  # vectors of different lengths make this collective itself fail
        values = vec.tolist()
        if values[-1] != key_hash * world or values[-2] != len(keys) * world:
            raise RuntimeError(
                f"MetricAccumulator.reduce: ranks logged different metric keys (rank {get_rank()} has {keys}); "
                f"log the same keys on every rank"
            )
        return {k: values[i] / world for i, k in enumerate(keys)}


def reward_metrics(
    rewards: torch.Tensor,
    uids: Sequence[Any],
    advantages: torch.Tensor | None = None,
    extras: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, float]:
    """`critic/rewards/*`, `critic/advantages/*` and `critic/<extra>/mean` over the global batch (verl-omni names
    and definitions).

    rewards: (B,) or (B, T) (averaged over T first); uids: (B,) prompt ids, equal within a group; advantages:
    any shape, stats over all elements. zero_std_ratio / std_mean use the population std per uid. extras: numeric
    per-sample reward extras (e.g. {"pickscore_raw": [...], "reward/ocr": [...]}) -> `critic/<key>/mean`.
    """
    r = rewards.detach().float().cpu()
    if r.ndim == 2:
        r = r.mean(dim=1)
    if r.ndim != 1 or len(uids) != r.shape[0]:
        raise ValueError(f"rewards must be (B,) or (B, T) with B = len(uids) = {len(uids)}, got {tuple(rewards.shape)}")
    out = {"critic/rewards/mean": float(r.mean()), "critic/rewards/max": float(r.max()),
           "critic/rewards/min": float(r.min())}
    uid_arr = np.asarray([str(u) for u in uids])
    r_np = r.numpy().astype(np.float64)
    groups = np.unique(uid_arr)
    stds = np.array([np.std(r_np[uid_arr == u]) for u in groups])
    out["critic/rewards/zero_std_ratio"] = float(np.mean(stds == 0))
    out["critic/rewards/std_mean"] = float(np.mean(stds))
    out["critic/rewards/group_size"] = float(len(r_np) / len(groups))
    if advantages is not None:
        a = advantages.detach().float()
        out.update({"critic/advantages/mean": float(a.mean()), "critic/advantages/max": float(a.max()),
                    "critic/advantages/min": float(a.min())})
    for key, values in (extras or {}).items():
        if len(values) != len(uids):
            raise ValueError(f"reward extra {key!r} has {len(values)} values for {len(uids)} samples")
        values = np.asarray(values, dtype=np.float64)
        if np.isfinite(values).any():  # NaN marks samples another reward scored (mixed data sources)
            out[f"critic/{key}/mean"] = float(np.nanmean(values))
    return out


def validation_metrics(
    data_sources: Sequence[str],
    scores: Mapping[str, Sequence[float]],
    uids: Sequence[Any] | None = None,
) -> dict[str, float]:
    """`val-core/<data_source>/<var>/mean@N` and `val-aux/...` (verl-omni `process_validation_metrics` naming).

    scores: {"reward": per-sample scores, plus numeric extras such as "pickscore_raw" or "acc"}; every list has one
    value per sample, aligned with data_sources (and uids; default = one sample per prompt, N = 1). Per data source
    and variable, mean@N (and std@N for N > 1) is computed per uid, then averaged over uids. The core variable is
    "acc" when present, else "reward"; only its mean@N goes to val-core, everything else to val-aux. verl's
    bootstrap best@k / worst@k / maj@k (only defined for N > 1; validation runs N = 1) are not computed.
    """
    n = len(data_sources)
    if "reward" not in scores:
        raise ValueError("validation scores need a 'reward' entry")
    for var, vals in scores.items():
        if len(vals) != n:
            raise ValueError(f"validation scores[{var!r}] has {len(vals)} values for {n} samples")
    uids = list(range(n)) if uids is None else list(uids)
    core_var = "acc" if "acc" in scores else "reward"
    out: dict[str, float] = {}
    sources = np.asarray(list(data_sources))
    uid_arr = np.asarray([str(u) for u in uids])
    for ds in sorted(set(data_sources)):
        in_ds = sources == ds
        groups = sorted(set(uid_arr[in_ds]))
        sizes = {int((uid_arr[in_ds] == g).sum()) for g in groups}
        n_per = max(sizes)
        for var in sorted(scores):
            vals = np.asarray(scores[var], dtype=np.float64)
            per_uid = [vals[in_ds & (uid_arr == g)] for g in groups]
            prefix = "val-core" if var == core_var else "val-aux"
            out[f"{prefix}/{ds}/{var}/mean@{n_per}"] = float(np.mean([v.mean() for v in per_uid]))
            if n_per > 1:
                out[f"val-aux/{ds}/{var}/std@{n_per}"] = float(np.mean([v.std() for v in per_uid]))
    return out


def perf_metrics(num_images: int, step_time_s: float, num_gpus: int) -> dict[str, float]:
    """`perf/total_num_images`, `perf/time_per_step`, `perf/throughput` (images / (t_step * n_gpus))."""
    return {"perf/total_num_images": float(num_images), "perf/time_per_step": float(step_time_s),
            "perf/throughput": float(num_images) / (max(step_time_s, 1e-9) * max(num_gpus, 1))}


@contextlib.contextmanager
def timer(name: str, timings: dict[str, float], *, cuda_sync: bool = True) -> Iterator[None]:
    """Add the wall time of the block to `timings["timing_s/<name>"]` (synchronising CUDA first when in use)."""
    sync = cuda_sync and torch.cuda.is_available() and torch.cuda.is_initialized()
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            torch.cuda.synchronize()
        key = f"timing_s/{name}"
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def _wrap(text: str, width_px: int, char_px: int = 6) -> list[str]:
    return textwrap.wrap(text, width=max(8, width_px // char_px)) or [""]


def image_grid(images: torch.Tensor | Sequence[Any], captions: Sequence[str], *, ncols: int = 4,
               caption_lines: int = 4):
    """A PIL grid of images with a caption (prompt, reward) under each; images: uint8 (B, 3, H, W) or PIL list."""
    from PIL import Image, ImageDraw, ImageFont

    if isinstance(images, torch.Tensor):
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be uint8 (B, 3, H, W), got {images.dtype} {tuple(images.shape)}")
        pil = [Image.fromarray(im.permute(1, 2, 0).cpu().numpy()) for im in images]
    else:
        pil = [im.convert("RGB") for im in images]
    if len(pil) != len(captions):
        raise ValueError(f"{len(pil)} images but {len(captions)} captions")
    if not pil:
        raise ValueError("image_grid needs at least one image")
    w, h = max(im.width for im in pil), max(im.height for im in pil)
    font = ImageFont.load_default()
    line_h = 12
    cap_h = caption_lines * line_h + 4
    ncols = min(ncols, len(pil))
    nrows = (len(pil) + ncols - 1) // ncols
    grid = Image.new("RGB", (ncols * w, nrows * (h + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (im, cap) in enumerate(zip(pil, captions)):
        x, y = (i % ncols) * w, (i // ncols) * (h + cap_h)
        grid.paste(im, (x, y))
        lines = _wrap(cap, w)[:caption_lines]
        for j, line in enumerate(lines):
            draw.text((x + 2, y + h + 2 + j * line_h), line, fill="black", font=font)
    return grid


class Progress:
    """A one-line progress report per step with the ETA from the mean step time (the first step, which carries
    compilation / warm-up, is excluded once later steps exist)."""

    def __init__(self, total_steps: int, start_step: int = 0) -> None:
        self.total_steps, self.start_step = int(total_steps), int(start_step)
        self.step_times: list[float] = []

    def line(self, step: int, step_time_s: float, metrics: Mapping[str, float] | None = None,
             keys: Sequence[str] = ("critic/rewards/mean", "actor/grad_norm")) -> str:
        self.step_times.append(float(step_time_s))
        times = self.step_times[1:] if len(self.step_times) > 1 else self.step_times
        remaining = max(self.total_steps - step, 0)
        eta = datetime.timedelta(seconds=int(round(remaining * sum(times) / len(times))))
        parts = [f"step {step}/{self.total_steps}", f"{step_time_s:.2f}s/step", f"ETA {eta}"]
        for k in keys:
            if metrics and k in metrics:
                parts.append(f"{k.split('/', 1)[-1]} {metrics[k]:.4g}")
        return " | ".join(parts)


def git_commit(repo_dir: str | None = None) -> str:
    """`git rev-parse HEAD` of the code (suffix "-dirty" with uncommitted changes); "unknown" outside git."""
    repo_dir = repo_dir or os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_dir,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_run_metadata(out_dir: str, config: Mapping[str, Any], *, seeds: Mapping[str, int] | None = None,
                       logger: TensorBoardLogger | None = None) -> dict[str, Any]:
    """Rank 0: write `<out_dir>/run_metadata.json` (full config, versions, git commit, seeds, world size, argv,
    host, time) and, with a logger, the same JSON as TensorBoard text. Returns the metadata on every rank."""
    meta = {
        "config": json.loads(json.dumps(dict(config), default=str)),
        "versions": library_versions(),
        "git_commit": git_commit(),
        "seeds": dict(seeds or {}),
        "world_size": get_world_size(),
        "argv": list(sys.argv),
        "host": socket.gethostname(),
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    if is_main_process():
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, f".run_metadata.json.{uuid.uuid4().hex[:8]}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(out_dir, "run_metadata.json"))
        if logger is not None:
            logger.log_text("run_metadata", "```\n" + json.dumps(meta, indent=2, sort_keys=True) + "\n```")
    return meta


# =================================================================================================================
# 7. The parts of an online RL step that both trainers share: flags, rollout requests, rewards, advantages,
#    validation, adapter sync to the rollout workers
# =================================================================================================================


def add_common_args(parser) -> None:
    """Flags shared by train_nft.py and train_dppo.py (defaults: verl-omni's where it has one)."""
    import rewards

    g = parser.add_argument_group("model")
    g.add_argument("--model_path", default=os.environ.get("MODEL_PATH"),
                   help="pipeline folder (Boogu-Image or Qwen-Image; model_index.json decides) or a Hub id; "
                        "default $MODEL_PATH")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="trainer device")
    g.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="FSDP2 compute dtype on GPU (master LoRA weights stay fp32); CPU always computes in fp32")
    g.add_argument("--max_sequence_length", type=int, default=512, help="Qwen-Image prompt token budget")
    g = parser.add_argument_group("data")
    g.add_argument("--train_files", default=os.environ.get("TRAIN_FILES"), help="train.parquet (data_prep/)")
    g.add_argument("--val_files", default=os.environ.get("VAL_FILES"), help="test.parquet for validation")
    g.add_argument("--train_batch_size", type=int, default=32, help="prompts per rollout step (global)")
    g.add_argument("--rollout_n", type=int, default=16, help="samples per prompt (one group per prompt)")
    g.add_argument("--ppo_mini_batch_size", type=int, default=None,
                   help="prompts per optimizer step (global); default = train_batch_size (one step per rollout)")
    g.add_argument("--micro_batch_size", type=int, default=4, help="samples per GPU per forward/backward")
    g.add_argument("--ppo_epochs", type=int, default=1, help="passes over each rollout batch")
    g.add_argument("--val_max_samples", type=int, default=256, help="validation prompts (0 = all)")
    g = parser.add_argument_group("LoRA and optimizer")
    g.add_argument("--lora_rank", type=int, default=64)
    g.add_argument("--lora_alpha", type=float, default=64.0)
    g.add_argument("--lora_target_modules", default=None,
                   help="comma-separated; default = the model's validated list (Boogu: 18 names, Qwen: 12)")
    g.add_argument("--lora_init_weights", default="gaussian", help="peft init for A ('gaussian' or 'true'); B = 0")
    g.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (constant)")
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--adam_betas", default="0.9,0.999")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="grad-norm clip; a non-finite norm skips the step")
    g.add_argument("--activation_checkpointing", action="store_true", help="recompute block activations in backward")
    g = parser.add_argument_group("rollout")
    g.add_argument("--rollout_engine", default="native", choices=["native", "vllm_omni"])
    g.add_argument("--rollout_devices", default="cuda:3",
                   help="rollout workers of EACH node, comma-separated: e.g. 'cuda:3' (4-GPU node: 3 trainer GPUs), "
                        "'cuda:2,cuda:3', or 'cpu,cpu' for CPU runs")
    g.add_argument("--rollout_dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    g.add_argument("--rollout_max_batch_size", type=int, default=16, help="samples per rollout forward")
    g.add_argument("--rollout_timeout_s", type=float, default=3600.0, help="a rollout worker silent longer fails")
    g.add_argument("--rollout_threads", type=int, default=0, help="CPU threads per rollout worker (0 = default)")
    g.add_argument("--cfg_batch", action="store_true",
                   help="run the conditional and unconditional CFG branches as ONE batched forward, in rollout and in "
                        "training alike (same result within float tolerance; faster when the GPU is not saturated)")
    g.add_argument("--height", type=int, default=512)
    g.add_argument("--width", type=int, default=512)
    g.add_argument("--num_inference_steps", type=int, default=10, help="rollout steps (training)")
    g.add_argument("--guidance_scale", type=float, default=None,
                   help="Boogu-Image text CFG (None = 4.0, the released default; 1.0 disables CFG)")
    g.add_argument("--true_cfg_scale", type=float, default=None,
                   help="Qwen-Image true CFG (None = 4.0; needs negative prompts when > 1)")
    g.add_argument("--seed", type=int, default=42, help="seeds rollouts (per-row streams), sampling and re-noising")
    g = parser.add_argument_group("validation, logging, checkpoints")
    g.add_argument("--val_num_inference_steps", type=int, default=50)
    g.add_argument("--val_seed", type=int, default=42)
    g.add_argument("--test_freq", type=int, default=0, help="validate every N steps (0 = only at the end)")
    g.add_argument("--val_before_train", action="store_true")
    g.add_argument("--num_val_images", type=int, default=8, help="validation samples shown in the image grid")
    g.add_argument("--total_training_steps", type=int, default=300)
    g.add_argument("--save_freq", type=int, default=30, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep_last", type=int, default=3, help="complete checkpoints to keep")
    g.add_argument("--resume", default="auto",
                   help="'auto' = latest complete checkpoint under <output_dir>/checkpoints if any, 'never', or a "
                        "checkpoint directory")
    g.add_argument("--output_dir", default="outputs/run", help="TensorBoard logs, checkpoints, adapters")
    g.add_argument("--log_every", type=int, default=1)
    rewards.add_reward_args(parser)


def resolve_device(flag: str) -> str:
    if flag == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return flag


def guidance_of(model, args) -> float:
    """The CFG scale of the run from --guidance_scale (Boogu-Image) / --true_cfg_scale (Qwen-Image)."""
    return model.resolve_guidance(args.guidance_scale, args.true_cfg_scale)


def rollout_request(rows: Sequence[Any], *, n: int, first_row: int, seed: int, step: int, num_inference_steps: int,
                    height: int, width: int, family: str, scale: float, **algo: Any):
    """The rollout request for this rank's prompts: each prompt repeated n times (interleaved, a group per prompt),
    per-sample seeds `rollout.row_seed(seed, step, global row)` with global rows numbered from `first_row`."""
    import rollout

    prompts, negatives, images = [], [], []
    edit = any(row.images for row in rows)
    for row in rows:
        for _ in range(n):
            prompts.append(row.prompt)
            negatives.append(row.negative_prompt)
            images.append(row.images[0] if row.images else None)
    guided = scale > 1.0
    if guided and any(neg is None for neg in negatives):
        raise ValueError("guidance is on but a prompt has no negative prompt (the dataset loader should have refused it)")
    knob = {"guidance_scale": scale} if family == "boogu_image" else {"true_cfg_scale": scale}
    return rollout.RolloutRequest(
        prompts=prompts, negative_prompts=negatives if guided else None, images=images if edit else None,
        seeds=[rollout.row_seed(seed, step, first_row + i) for i in range(len(prompts))],
        num_inference_steps=num_inference_steps, height=height, width=width, **knob, **algo)


def score_samples(scorer, images: torch.Tensor, rows: Sequence[Any], n: int):
    """Rewards (B,) for this rank's samples (prompt-major, n per prompt), chosen by each row's data_source."""
    gts = [row.ground_truth for row in rows for _ in range(n)]
    sources = [row.data_source for row in rows for _ in range(n)]
    infos = [row.extra_info for row in rows for _ in range(n)]
    return scorer.score_batch(images, gts, sources, infos)


def global_advantages(scored, n: int, *, global_std: bool, norm_by_std: bool,
                      num_steps: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """Group advantages over the GLOBAL batch (every rank's rewards; a group never spans ranks) plus the
    `critic/*` metrics (reward extras included, NaN where a reward did not score a sample); returns this rank's
    slice of the advantages. Collective."""
    all_rewards = all_gather_cat(scored.rewards.float())
    group_ids = [i // n for i in range(all_rewards.shape[0])]
    advantages = losses.group_advantages(all_rewards, group_ids, global_std=global_std, norm_by_std=norm_by_std,
                                         num_steps=num_steps)
    extras = {key: all_gather_cat(values.float()).tolist() for key, values in sorted(scored.extras.items())}
    metrics = reward_metrics(all_rewards, group_ids, advantages, extras=extras)
    start = get_rank() * scored.rewards.shape[0]
    return advantages[start:start + scored.rewards.shape[0]], metrics


def sync_rollout_adapter(rollout_client, transformer, adapter: str, lora_config, root: str, version: int,
                         expected_modules: int, *, engine_names: bool, keep: int = 2) -> dict[str, float]:
    """Publish `adapter` (the rollout policy: "old" for DiffusionNFT, "default" for DPPO/GRPO) to the rollout
    workers: every rank gathers the full tensors, rank 0 writes a versioned PEFT directory atomically, every node's
    workers load it, and the bound-module count must equal the actor's number of LoRA modules (a dropped sync would
    otherwise leave the rollout sampling an old policy while the run looks healthy). Collective."""
    timings: dict[str, float] = {}
    with timer("update_weights", timings):
        state = adapter_state_dict(transformer, adapter, all_ranks=False)  # only rank 0 writes
        path = os.path.join(root, f"v{version:08d}")
        if is_main_process():  # an atomic write: workers never see a half-written version
            save_adapter_dir(state, lora_config, path, engine_names=engine_names)
            for old in sorted(d for d in os.listdir(root) if d.startswith("v"))[:-keep]:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        barrier()
        counts = rollout_client.load_adapter(path, f"v{version}")
    bad = [c for c in counts if c != expected_modules]
    if bad:
        raise RuntimeError(
            f"the rollout workers bound {counts} LoRA modules of adapter {path}, the actor has {expected_modules}: the "
            "weight sync is incomplete (name translation or target_modules mismatch); refusing to continue")
    return {**timings, "rollout/bound_modules": float(counts[0]) if counts else 0.0}


def parse_lora_init(value: str) -> bool | str:
    """--lora_init_weights: 'gaussian' (verl-omni's default) or 'true'/'false' (peft's kaiming / zero A)."""
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return value


def load_flow_model(path: str, args, device: torch.device):
    """The trainer's model wrapper: the transformer only (fp32 master weights; FSDP2 casts to --precision for
    compute). Prompt embeddings, reference latents and images come from the rollout workers, so trainer ranks skip
    the text encoder and the VAE (`models.base.NotLoaded`)."""
    from models import load_model, model_family

    kwargs = {"max_sequence_length": args.max_sequence_length} if model_family(path) == "qwen_image" else {}
    # Loaded on the CPU: `prepare_transformer`'s fully_shard moves one block at a time to `device` and shards it,
    # so no GPU ever holds the whole fp32 transformer (Qwen-Image: ~80 GB). The wrapper's inputs go to `device`.
    model = load_model(path, device="cpu", dtype=torch.float32, cfg_batch=args.cfg_batch, transformer_only=True,
                       **kwargs)
    model.device = torch.device(device)
    return model


def check_batch_sizes(train_batch_size: int, mini_batch_prompts: int, n: int, micro_batch_size: int,
                      world: int) -> None:
    """verl-omni batching: prompts x n per step, mini-batches in prompts, micro-batches in samples per GPU."""
    if train_batch_size % world or mini_batch_prompts % world:
        raise ValueError(f"train_batch_size ({train_batch_size}) and ppo_mini_batch_size ({mini_batch_prompts}) "
                         f"must be divisible by the {world} trainer ranks")
    if train_batch_size % mini_batch_prompts:
        raise ValueError(f"ppo_mini_batch_size ({mini_batch_prompts}) must divide train_batch_size ({train_batch_size})")
    if (mini_batch_prompts // world) * n % micro_batch_size:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must divide the per-rank mini-batch of "
                         f"{(mini_batch_prompts // world) * n} samples (ppo_mini_batch_size / world x rollout_n)")


def resume_path(resume: str, ckpt_root: str) -> str | None:
    """--resume: 'auto' -> the latest complete checkpoint (None if there is none), 'never' -> None, else a path."""
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(ckpt_root)
    if not os.path.isdir(resume):
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
    return resume


def validate(model, rollout_client, scorer, dataset, args, step: int, scale: float, logger) -> dict[str, float]:
    """Validation on the test split: ODE (noise 0), --val_num_inference_steps, seeds from --val_seed, one sample
    per prompt; logs `val-core/<data_source>/reward/mean@1` (+ val-aux extras) and an image grid. Collective."""
    world, rank = get_world_size(), get_rank()
    total = len(dataset) if not args.val_max_samples else min(len(dataset), args.val_max_samples)
    per_rank = total // world
    if per_rank == 0:
        raise ValueError(f"validation needs at least {world} prompts (one per rank), the test split has {total}")
    rows = [dataset[i] for i in range(rank * per_rank, (rank + 1) * per_rank)]
    timings: dict[str, float] = {}
    with timer("testing", timings):
        request = rollout_request(rows, n=1, first_row=rank * per_rank, seed=args.val_seed, step=1,
                                  num_inference_steps=args.val_num_inference_steps, height=args.height,
                                  width=args.width, family=model.family, scale=scale, noise_level=0.0)
        result = rollout_client.generate(request)
        scored = score_samples(scorer, result.images, rows, 1)
    local = {"reward": scored.rewards.tolist()}
    for key, values in scored.extras.items():
        local[key] = values.tolist()
    gathered: list[Any] = [None] * world
    payload = (local, [row.data_source for row in rows])
    if dist.is_initialized() and world > 1:
        dist.all_gather_object(gathered, payload)
    else:
        gathered = [payload]
    sources = [s for _, ds in gathered for s in ds]
    keys = sorted({k for scores, _ in gathered for k in scores})
    scores = {k: [v for sc, ds in gathered for v in sc.get(k, [float("nan")] * len(ds))] for k in keys}
    metrics = validation_metrics(sources, {k: v for k, v in scores.items()})
    metrics = {k: v for k, v in metrics.items() if v == v}  # extras absent for a data source give NaN: drop them
    metrics.update(timings)
    if rank == 0:
        logger.log_scalars(metrics, step)
        k = min(args.num_val_images, len(rows))
        user_text = lambda row: next((m["content"] for m in row.prompt if m.get("role") == "user"), "")  # noqa: E731
        captions = [f"r={float(r):.3f} | {user_text(row)[:100]}" for row, r in zip(rows[:k], scored.rewards[:k])]
        logger.log_image("val/samples", image_grid(result.images[:k], captions), step)
        core = {key: v for key, v in metrics.items() if key.startswith("val-core/")}
        print(f"validation @ step {step}: " + ", ".join(f"{key} {v:.4f}" for key, v in core.items()), flush=True)
    return metrics


# =================================================================================================================
# 8. A run: the setup both trainers do before their loop, and the tail of every step (log, validate, save)
# =================================================================================================================


@dataclass
class Run:
    """Everything a trainer builds before its loop (see `setup_run`) plus the per-step tail both trainers share.

    The trainer files keep what differs between the algorithms: the rollout request, the advantages, the update,
    and which adapter the rollout workers sample with (`sync_rollout`)."""

    args: Any
    config: dict[str, Any]
    device: torch.device
    rank: int
    world: int
    logger: TensorBoardLogger
    model: Any                     # the FlowModel wrapper (transformer only: trainer ranks never encode or decode)
    scale: float                   # the CFG scale of rollout and replay (1.0 = unguided)
    adapter_names: tuple[str, ...]
    lora_config: Any
    num_lora_modules: int          # the rollout workers must bind exactly this many modules at every sync
    optimizer: torch.optim.Optimizer
    stepper: GradStepper
    train_data: Any
    val_data: Any
    sampler: PromptSampler
    mini_prompts: int              # prompts per optimizer step (global)
    scorer: Any
    rollout: Any                   # rollout.DistributedRollout
    ckpt_root: str
    adapters_root: str
    start_step: int
    progress: Progress

    def steps(self) -> range:
        """The steps still to run: start_step + 1 .. total_training_steps."""
        return range(self.start_step + 1, self.args.total_training_steps + 1)

    def sync_rollout(self, adapter: str, step: int) -> dict[str, float]:
        """Publish `adapter` to the rollout workers as version `step` (see `sync_rollout_adapter`). Collective."""
        return sync_rollout_adapter(self.rollout, self.model.transformer, adapter, self.lora_config,
                                    self.adapters_root, step, self.num_lora_modules,
                                    engine_names=self.args.rollout_engine == "vllm_omni")

    def validate(self, step: int) -> dict[str, float]:
        """ODE validation on the test split (see `validate`). Collective."""
        return validate(self.model, self.rollout, self.scorer, self.val_data, self.args, step, self.scale,
                        self.logger)

    def end_step(self, step: int, metrics: dict[str, float], timings: Mapping[str, float], step_start: float,
                 epoch: int) -> None:
        """The tail of a step: timing and throughput metrics, TensorBoard, the progress line, validation every
        --test_freq steps and at the end, a checkpoint every --save_freq steps and at the end. Collective."""
        args = self.args
        step_time = time.perf_counter() - step_start
        metrics.update(timings)
        metrics.update(perf_metrics(args.train_batch_size * args.rollout_n, step_time, self.world))
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(epoch)
        if step % args.log_every == 0:
            self.logger.log_scalars(metrics, step)
        if self.rank == 0:
            print(self.progress.line(step, step_time, metrics), flush=True)
        last = step == args.total_training_steps
        if self.val_data is not None and ((args.test_freq and step % args.test_freq == 0) or last):
            self.validate(step)
        if step % args.save_freq == 0 or last:
            save_checkpoint(self.ckpt_root, step, transformer=self.model.transformer, optimizer=self.optimizer,
                            lora_config=self.lora_config, config=self.config, sampler=self.sampler,
                            adapter_names=self.adapter_names,
                            trainer_state={"grad_stepper": self.stepper.state_dict()}, keep_last=args.keep_last)

    def close(self) -> None:
        self.rollout.close()
        self.logger.close()
        cleanup_distributed()


def setup_run(args, *, adapter_names: tuple[str, ...]) -> Run:
    """Both trainers' setup, in order: distributed init and seeds; TensorBoard and run metadata (config, versions,
    git commit); the model (transformer only), LoRA adapters `adapter_names` + FSDP2; AdamW; train/val data, the
    sampler and the batch-size checks; the reward scorer; `--resume` (adapters, optimizer, RNG, sampler cursor,
    grad-skip count); the rollout workers of this node. Adapters are NOT yet synced to the workers: the trainer does
    that with the adapter its algorithm samples from."""
    from data_prep.dataset import PromptDataset
    from models import resolve_model_path
    import rewards
    from rollout import DistributedRollout

    config = vars(args)
    dist_info = init_distributed(resolve_device(args.device))
    device, rank, world = dist_info.device, dist_info.rank, dist_info.world_size
    seed_everything(args.seed)
    logger = TensorBoardLogger(os.path.join(args.output_dir, "tensorboard"))
    write_run_metadata(args.output_dir, config, seeds={"seed": args.seed, "val_seed": args.val_seed}, logger=logger)

    model_path = resolve_model_path(args.model_path)
    model = load_flow_model(model_path, args, device)
    scale = guidance_of(model, args)
    targets = args.lora_target_modules.split(",") if args.lora_target_modules else list(model.default_lora_targets)
    lora_config = prepare_transformer(
        model.transformer, block_prefixes=model.lora_block_prefixes, target_modules=targets,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, adapter_names=adapter_names, device=device,
        precision=args.precision, activation_checkpointing=args.activation_checkpointing,
        init_lora_weights=parse_lora_init(args.lora_init_weights))
    num_lora_modules = len(lora.lora_layers(model.transformer, ADAPTER_DEFAULT))
    optimizer = build_optimizer(model.transformer, lr=args.lr, weight_decay=args.weight_decay,
                                betas=tuple(float(b) for b in args.adam_betas.split(",")))
    stepper = GradStepper(args.max_grad_norm)

    train_data = PromptDataset(args.train_files, guidance=scale > 1.0)
    val_data = PromptDataset(args.val_files, guidance=scale > 1.0) if args.val_files else None
    sampler = PromptSampler(len(train_data), args.train_batch_size, seed=args.seed, rank=rank, world_size=world)
    mini_prompts = args.ppo_mini_batch_size or args.train_batch_size
    check_batch_sizes(args.train_batch_size, mini_prompts, args.rollout_n, args.micro_batch_size, world)
    scorer = rewards.RewardScorer(rewards.RewardConfig.from_args(args))

    start_step = 0
    ckpt_root = os.path.join(args.output_dir, "checkpoints")
    resume_from = resume_path(args.resume, ckpt_root)
    if resume_from:
        state = load_checkpoint(resume_from, transformer=model.transformer, optimizer=optimizer, config=config,
                                sampler=sampler, adapter_names=adapter_names)
        start_step = state["step"]
        stepper.load_state_dict(state["trainer_state"]["grad_stepper"])

    rollout = DistributedRollout(model_path, args.rollout_devices.split(","), engine=args.rollout_engine,
                                 dtype=args.rollout_dtype if device.type == "cuda" else "float32",
                                 max_batch_size=args.rollout_max_batch_size, timeout_s=args.rollout_timeout_s,
                                 log_dir=os.path.join(args.output_dir, "rollout_logs"),
                                 threads_per_worker=args.rollout_threads, cfg_batch=args.cfg_batch)
    return Run(args=args, config=config, device=device, rank=rank, world=world, logger=logger, model=model,
               scale=scale, adapter_names=tuple(adapter_names), lora_config=lora_config,
               num_lora_modules=num_lora_modules, optimizer=optimizer, stepper=stepper, train_data=train_data,
               val_data=val_data, sampler=sampler, mini_prompts=mini_prompts, scorer=scorer, rollout=rollout,
               ckpt_root=ckpt_root, adapters_root=os.path.join(args.output_dir, "rollout_adapters"),
               start_step=start_step, progress=Progress(args.total_training_steps, start_step))
