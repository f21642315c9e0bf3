"""Model preparation: LoRA (peft) with named adapters, adapter switching, activation checkpointing, FSDP2
`fully_shard` per block + root with a MixedPrecisionPolicy, and DTensor-aware gather / load of adapter tensors."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Iterator, Mapping, Sequence
import torch
from torch import nn
from models import lora

from .distributed import get_world_size, is_main_process

__all__ = [
    "ADAPTER_DEFAULT", "ADAPTER_OLD", "adapter_params", "add_lora_adapters", "use_adapter", "transformer_blocks",
    "apply_activation_checkpointing", "mixed_precision_policy", "shard_transformer", "prepare_transformer",
    "adapter_state_dict", "load_adapter_state_", "save_adapter_dir", "adapter_config_dict"
]


ADAPTER_DEFAULT = "default"
ADAPTER_OLD = "old"


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
    lora.write_adapter_dir(dict(state), adapter_config_dict(lora_config), out_dir, engine_names=engine_names)


def adapter_config_dict(lora_config) -> dict:
    """The PEFT adapter_config dict of `lora_config` in plain JSON types (trainer module names), as an exported
    adapter directory holds it and the rollout workers' tensor sync sends it."""
    config = json.loads(json.dumps(lora_config.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    config.update(peft_type="LORA", inference_mode=True, use_dora=False, lora_bias=False,
                  target_modules=sorted(lora_config.target_modules))
    return config
