"""Model preparation: LoRA (peft) with named adapters, adapter switching, (selective) activation checkpointing, the
frozen base weights in the compute dtype, FSDP2 `fully_shard` per block + root with a MixedPrecisionPolicy (or, on
one rank, `place_on_one_rank`: the same mixed precision without FSDP2), and DTensor-aware gather / load of adapter
tensors."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import warnings
from typing import Iterator, Mapping, Sequence
import torch
from torch import nn
from models import lora
from models.base import compile_blocks, transformer_blocks

from .distributed import get_world_size, is_main_process

__all__ = [
    "ADAPTER_DEFAULT", "ADAPTER_OLD", "adapter_params", "add_lora_adapters", "use_adapter",
    "apply_activation_checkpointing", "checkpointed_block_indices", "mixed_precision_policy", "base_weight_dtype",
    "cast_frozen_base_", "FSDP_MODES", "shard_transformer", "ComputeDtypeLinear", "place_on_one_rank",
    "prepare_transformer",
    "adapter_state_dict", "load_adapter_state_",
    "save_adapter_dir", "adapter_config_dict", "load_flow_model", "full_tensor", "strip_adapter", "adapter_pattern",
]


ADAPTER_DEFAULT = "default"
ADAPTER_OLD = "old"


def adapter_pattern(adapter: str) -> re.Pattern:
    """The regex of the adapter-name part of a LoRA parameter name of `adapter`."""
    # peft names: "<path>.lora_A.<adapter>.weight" (ModuleDict) or "<path>.lora_embedding_A.<adapter>" (ParameterDict)
    return re.compile(r"(^|\.)(lora_[A-Za-z_]+)\." + re.escape(adapter) + r"(\.|$)")


def strip_adapter(name: str, adapter: str) -> str:
    """"a.lora_A.default.weight" -> "a.lora_A.weight"."""
    return adapter_pattern(adapter).sub(lambda m: m.group(1) + m.group(2) + m.group(3), name, count=1)


def adapter_params(module: nn.Module, adapter: str = ADAPTER_DEFAULT) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every LoRA tensor of `adapter`, in `named_parameters` order (stable across ranks)."""
    pattern = adapter_pattern(adapter)
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

    The LoRA tensors are initialised in float32 whatever the base weights' dtype: peft moves a new adapter to its
    base layer's dtype, which for a bf16-stored base (`base_weight_dtype`) would round the initial A to bf16; while
    peft injects, every non-fp32 `weight` is replaced by an empty fp32 placeholder (peft reads only its dtype and
    device there) and put back afterwards, so the adapters are bit-identical to those of an fp32 base.

    init_lora_weights: peft's option; "gaussian" (verl-omni's `lora_init_weights` default) or True (kaiming A).
    Both start with B = 0, so "default" starts equal to the base model.
    """
    if rank <= 0:
        raise ValueError(f"LoRA rank must be > 0, got {rank} (full fine-tuning is not supported by these trainers)")
    with _float32_weight_placeholders(transformer):  # LoRA init never rounds through a bf16 base dtype
        lora.apply_lora(transformer, list(target_modules), rank=int(rank), alpha=alpha, block_prefixes=block_prefixes,
                        adapter_names=tuple(adapter_names), init_lora_weights=init_lora_weights)
    for name in adapter_names:
        for _, p in adapter_params(transformer, name):
            p.data = p.data.float()
    return transformer.peft_config[adapter_names[0]]


@contextlib.contextmanager
def _float32_weight_placeholders(transformer: nn.Module) -> Iterator[None]:
    """Temporarily swap every floating, non-fp32 `weight` parameter for an empty fp32 one (same device), restoring
    the originals on exit (see `add_lora_adapters`). The module objects stay the same, so peft's wrappers keep the
    real weights once restored."""
    swapped: list[tuple[nn.Module, nn.Parameter]] = []
    try:
        for module in transformer.modules():
            weight = module._parameters.get("weight")
            if weight is not None and weight.is_floating_point() and weight.dtype != torch.float32:
                swapped.append((module, weight))
                module._parameters["weight"] = nn.Parameter(
                    torch.empty(0, dtype=torch.float32, device=weight.device), requires_grad=False)
        yield
    finally:
        for module, weight in swapped:  # keep the requires_grad peft / apply_lora gave the placeholder (frozen)
            weight.requires_grad_(module._parameters["weight"].requires_grad)
            module._parameters["weight"] = weight


@contextlib.contextmanager
def use_adapter(transformer: nn.Module, adapter: str) -> Iterator[None]:
    """Run forwards with `adapter` active (e.g. "old" for DiffusionNFT's old-policy pass); the previous active
    adapter is restored on exit; `requires_grad` flags never change (`models.lora.set_active_adapter`).
    The reference (base) model forward is `models.lora.lora_disabled(transformer)`.

    With activation checkpointing, backward RECOMPUTES block forwards with whatever adapter is active at backward
    time: call `backward()` outside `use_adapter` / `lora_disabled` blocks (i.e. with "default" active) and
    run the old / reference forwards under `torch.no_grad()`."""
    layers = lora.cached_lora_layers(transformer)
    if not layers:
        raise RuntimeError("use_adapter: the transformer has no LoRA layers (call add_lora_adapters first)")
    previous = layers[0].active_adapters
    if len(previous) != 1:
        raise RuntimeError(f"use_adapter expects one active adapter, found {previous}")
    lora.set_active_adapter(transformer, adapter)
    try:
        yield
    finally:
        lora.set_active_adapter(transformer, previous[0])


def checkpointed_block_indices(num_blocks: int, num_checkpointed: int | None = None) -> list[int]:
    """Which of `num_blocks` blocks (in `transformer_blocks` order) to checkpoint: all of them for None, else
    `num_checkpointed` of them spread evenly (block i is chosen when floor((i+1)·n/B) > floor(i·n/B)), so every
    block type of a family (Boogu: refiners, double-, single-stream) keeps its share of stored activations."""
    if num_checkpointed is None:
        return list(range(num_blocks))
    if not 0 <= num_checkpointed <= num_blocks:
        raise ValueError(f"--activation_checkpointing_blocks must be in [0, {num_blocks}] (the transformer has "
                         f"{num_blocks} blocks), got {num_checkpointed}")
    return [i for i in range(num_blocks)
            if (i + 1) * num_checkpointed // num_blocks > i * num_checkpointed // num_blocks]


def apply_activation_checkpointing(transformer: nn.Module, block_prefixes: Sequence[str],
                                   num_blocks: int | None = None) -> int:
    """Checkpoint the activations of transformer blocks (recomputed in backward); return how many.

    num_blocks: None = every block; N = N blocks spread evenly (`checkpointed_block_indices`): selective
    checkpointing trades memory for less recomputation. Uses torch's composable `checkpoint` (hooks,
    non-reentrant), so module and parameter names do not change and LoRA export / optimizer FQNs stay the same.
    Apply before `shard_transformer`.
    """
    from torch.distributed._composable import checkpoint

    blocks = transformer_blocks(transformer, block_prefixes)
    chosen = checkpointed_block_indices(len(blocks), num_blocks)
    for i in chosen:
        checkpoint(blocks[i])
    return len(chosen)


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


# FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip the pre-backward hook). Our
# transformers end in an nn.Linear on (B, L, C) input, whose output is a view of the 2-D matmul; nothing ever
# modifies a transformer output in place (the wrappers and losses.py build new tensors), so the warning is noise.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor", category=UserWarning)


BASE_WEIGHT_DTYPES = ("compute", "fp32")


def base_weight_dtype(device: torch.device | str, precision: str = "bf16", mode: str = "compute") -> torch.dtype:
    """The dtype the FROZEN base weights are stored in on trainer ranks (LoRA tensors, their grads and AdamW state
    are always fp32).

    mode "compute" (default): the FSDP2 compute dtype of `mixed_precision_policy(device, precision)`, i.e. bf16
    for --precision bf16 on GPU, else fp32. Identical numbers to an fp32 base: the policy casts every parameter
    to bf16 for each forward anyway, and casting an fp32 weight to bf16 once at load rounds it exactly as that
    per-forward cast does (a bf16 parameter is not cast again); only the memory (Qwen-Image 82 -> 41 GB, Boogu 41
    -> 21 GB) and the per-forward cast go away. mode "fp32": today's fp32 master copy of the frozen weights
    (the benchmark's baseline).
    """
    if mode not in BASE_WEIGHT_DTYPES:
        raise ValueError(f"--base_weights_dtype must be one of {BASE_WEIGHT_DTYPES}, got {mode!r}")
    param_dtype = mixed_precision_policy(torch.device(device), precision).param_dtype
    return param_dtype if mode == "compute" and param_dtype is not None else torch.float32


@torch.no_grad()
def cast_frozen_base_(transformer: nn.Module, dtype: torch.dtype) -> int:
    """Cast every floating parameter outside the LoRA adapters to `dtype` in place (the frozen base weights; a
    no-op for those already in it). Returns how many were cast. Call before `shard_transformer`: FSDP2 keeps the
    dtype a parameter has when it is sharded (mixed original dtypes in one group are allowed for parameters that
    do not require grad, torch >= 2.8)."""
    lora_param = re.compile(r"(^|\.)lora_[A-Za-z_]+\.")
    count = 0
    for name, p in transformer.named_parameters():
        if p.is_floating_point() and p.dtype != dtype and not lora_param.search(name):
            if p.requires_grad:
                raise ValueError(f"cast_frozen_base_: {name} requires grad; only frozen base weights are cast")
            p.data = p.data.to(dtype)
            count += 1
    return count


FSDP_MODES = ("auto", "always")


def shard_transformer(
    transformer: nn.Module,
    block_prefixes: Sequence[str],
    *,
    mp_policy=None,
    device: torch.device | str | None = None,
    reshard_after_forward: bool = True,
    fsdp: str = "always",
) -> nn.Module:
    """FSDP2: `fully_shard` every transformer block, then the root (embedders, norms, output projection).

    Parameters become DTensors sharded on dim 0 over all ranks of the default process group, on `device`'s type
    (default: where the parameters are now; an explicit mesh, because fully_shard's default mesh is CUDA whenever
    CUDA exists). Build the optimizer AFTER this.

    fsdp: "always" = FSDP2 at any world size; "auto" = FSDP2 when there is more than one rank, `place_on_one_rank`
    (the same mixed precision, no FSDP2) when there is one.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if fsdp not in FSDP_MODES:
        raise ValueError(f"--fsdp must be one of {FSDP_MODES}, got {fsdp!r}")
    device = torch.device(device) if device is not None else next(transformer.parameters()).device
    mp_policy = mp_policy or MixedPrecisionPolicy()
    if fsdp == "auto" and get_world_size() == 1:
        return place_on_one_rank(transformer, block_prefixes, param_dtype=mp_policy.param_dtype, device=device)
    mesh = init_device_mesh(device.type, (get_world_size(),))
    for block in transformer_blocks(transformer, block_prefixes):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(transformer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return transformer


class ComputeDtypeLinear(nn.Linear):
    """An nn.Linear that keeps its (fp32) parameters and computes in `compute_dtype`: y = x Wᵀ + b with W, b and x
    cast to the compute dtype in forward. Autograd returns the compute-dtype gradient to W cast to W's dtype, i.e.
    grad_W (fp32) = fp32(grad of the bf16 GEMM), accumulated in fp32 over backward passes. The LoRA A / B layers
    of `place_on_one_rank` (their parameter names do not change)."""

    compute_dtype: torch.dtype = torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.compute_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)


def _cast_floating(value, dtype: torch.dtype, device: torch.device | None):
    """`value` with every floating-point tensor inside dataclasses, tuples, lists, sets and dicts cast to `dtype`
    (the containers FSDP2's cast_forward_inputs traverses; complex, integer and bool tensors keep their dtype, other
    objects are left alone) and, when `device` is given, every tensor moved there (FSDP2's root moves its inputs to
    the device)."""
    if torch.is_tensor(value):
        if device is not None and value.device != device:
            value = value.to(device)
        return value.to(dtype) if dtype is not None and value.is_floating_point() and value.dtype != dtype else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _cast_floating(getattr(value, f.name), dtype, device)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_cast_floating(v, dtype, device) for v in value))
    if isinstance(value, (tuple, list, set)):
        return type(value)(_cast_floating(v, dtype, device) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _cast_floating(v, dtype, device)) for k, v in value.items())
    return value


def place_on_one_rank(transformer: nn.Module, block_prefixes: Sequence[str], *, param_dtype: torch.dtype | None,
                      device: torch.device | str) -> nn.Module:
    """One trainer rank: the whole transformer on `device`, with the numbers of FSDP2's MixedPrecisionPolicy
    (`param_dtype`, fp32 gradient reduction) and none of its per-forward copies.

    FSDP2 shards nothing when the world size is 1, yet every unshard of a block copies each of its parameters into a
    new buffer, one copy per tensor, and casts the fp32 LoRA tensors again (80 copies and 48 casts per Qwen-Image
    block; DiffusionNFT unshards every block 4 times per micro-batch and timestep), all issued by a Python loop per
    parameter. Here instead:
      - the frozen base weights are used in place; they must already be in `param_dtype` (`cast_frozen_base_`);
      - every other floating parameter (the fp32 LoRA A / B tensors) lives in a `ComputeDtypeLinear`, which casts
        it to `param_dtype` in forward; its gradient comes back in fp32, as FSDP2's reduce_dtype=fp32 gives it;
        peft's cast of a LoRA input to the LoRA weight's dtype is turned off (the input already has `param_dtype`,
        as it has under FSDP2, where the unsharded LoRA weight is bf16);
      - the root and every block cast the floating tensors of their arguments to `param_dtype` before forward
        (FSDP2's cast_forward_inputs), and the root moves its tensor arguments to the device (FSDP2's root does).
    param_dtype None (fp32 training, CPU): the transformer is only moved. Equal to FSDP2 at world size 1 bit for bit
    (tests/test_performance.py), but for the gradient of a LoRA layer applied twice in one forward (Boogu's shared
    `to_out.0`): FSDP2 sums the two bf16 weight gradients in bf16, here each is cast and the sum is fp32. Apply
    after activation checkpointing; build the optimizer after this."""
    from peft.tuners.lora import LoraLayer

    device = torch.device(device)
    transformer.to(device)
    if param_dtype is None:
        return transformer
    for module in transformer.modules():
        if isinstance(module, LoraLayer):
            module.cast_input_dtype_enabled = False
            for linear in list(module.lora_A.values()) + list(module.lora_B.values()):
                if type(linear) is not nn.Linear:
                    raise TypeError(f"LoRA layer {type(linear).__name__} is not an nn.Linear; one-rank placement "
                                    "supports linear LoRA only (use --fsdp always)")
                linear.__class__ = ComputeDtypeLinear
                linear.compute_dtype = param_dtype
    lora_modules = {id(m) for m in transformer.modules() if isinstance(m, ComputeDtypeLinear)}
    stray = [n for n, m in transformer.named_modules() if id(m) not in lora_modules
             for _, p in m.named_parameters(recurse=False) if p.is_floating_point() and p.dtype != param_dtype]
    if stray:
        raise ValueError(f"one-rank placement needs the frozen base weights in {param_dtype} (--base_weights_dtype "
                         f"compute), found {stray[:3]} in another dtype; or use --fsdp always")

    def cast_inputs(to_device: torch.device | None):
        def hook(module, args, kwargs):
            return _cast_floating(args, param_dtype, to_device), _cast_floating(kwargs, param_dtype, to_device)
        return hook

    transformer.register_forward_pre_hook(cast_inputs(device if device.type != "cpu" else None), with_kwargs=True)
    for block in transformer_blocks(transformer, block_prefixes):
        block.register_forward_pre_hook(cast_inputs(None), with_kwargs=True)
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
    checkpoint_blocks: int | None = None,
    base_weights: str = "compute",
    fsdp: str = "always",
    compile: str = "off",
    compile_prefixes: Sequence[str] | None = None,
):
    """LoRA -> frozen base weights to `base_weight_dtype(device, precision, base_weights)` -> (activation
    checkpointing of all blocks, or of `checkpoint_blocks` of them) -> FSDP2 (or, with fsdp="auto" on one rank,
    `place_on_one_rank`) -> with compile="blocks", `models.base.compile_blocks` of `compile_prefixes` (None:
    every block), in that order; returns the `LoraConfig`.

    For a FlowModel `m`: `prepare_transformer(m.transformer, block_prefixes=m.lora_block_prefixes,
    target_modules=m.default_lora_targets, compile_prefixes=m.blocks_to_compile, ...)`. The base weights are frozen;
    with two adapter names (DiffusionNFT) "old" starts as an independent random init: hard-copy it (`models.lora.copy_adapter_(t, "default", "old")`)
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
    cast_frozen_base_(transformer, base_weight_dtype(device, precision, base_weights))
    if activation_checkpointing or checkpoint_blocks is not None:
        apply_activation_checkpointing(transformer, block_prefixes, checkpoint_blocks)
    shard_transformer(transformer, block_prefixes, mp_policy=mixed_precision_policy(torch.device(device), precision),
                      device=device, fsdp=fsdp)
    if compile == "blocks":
        compile_blocks(transformer, compile_prefixes or block_prefixes)
    elif compile != "off":
        raise ValueError(f"compile must be 'off' or 'blocks', got {compile!r}")
    return config


def full_tensor(t: torch.Tensor) -> torch.Tensor:
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
        full = full_tensor(p.detach())  # the gather is collective: every rank runs it
        if keep:
            out[strip_adapter(name, adapter)] = full.to("cpu", torch.float32).clone()
    if keep and not out:
        raise ValueError(f"the transformer has no LoRA tensors for adapter {adapter!r}")
    return out


@torch.no_grad()
def load_adapter_state_(transformer: nn.Module, adapter: str, state: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors (keys as `adapter_state_dict` returns them) into `adapter`'s (possibly sharded) params.

    Strict: a missing key, an extra key or a shape mismatch raises, naming the keys.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = {strip_adapter(n, adapter): p for n, p in adapter_params(transformer, adapter)}
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


def load_flow_model(path: str, args, device: torch.device):
    """The trainer's model wrapper: the transformer only. Prompt embeddings, reference latents and images come from
    the rollout workers, so trainer ranks skip the text encoder and the VAE (`models.base.NotLoaded`).

    The transformer is read from disk directly in `base_weight_dtype(device, --precision, --base_weights_dtype)`
    (bf16 for --precision bf16 on GPU: half the host RAM and read time of an fp32 load, and no fp32 master copy of
    the frozen weights on the GPU; fp32 on CPU or with --base_weights_dtype fp32). The wrapper still hands the
    transformer fp32 inputs (`model.dtype = float32`), so timesteps, latents and embeddings are rounded exactly as
    before: FSDP2's policy casts them to the compute dtype at the root, as it did with fp32 weights."""
    from models import family_class, load_model, model_family

    kwargs = family_class(model_family(path)).load_kwargs(args)  # e.g. Qwen-Image's --max_sequence_length
    storage = base_weight_dtype(device, args.precision, args.base_weights_dtype)
    # Loaded on the CPU: `prepare_transformer`'s fully_shard moves one block at a time to `device` and shards it,
    # so no GPU ever holds the whole transformer. The wrapper's inputs go to `device`.
    model = load_model(path, device="cpu", dtype=storage, cfg_batch=args.cfg_batch, transformer_only=True, **kwargs)
    model.device, model.dtype = torch.device(device), torch.float32
    return model
