"""LoRA for both families: target validation, PEFT injection, trainer <-> vllm-omni names, adapter export/import.

Names:
- Trainer names are the diffusers / upstream module paths inside the transformer, e.g.
  `transformer_blocks.0.attn.to_out.0` (Qwen-Image) or
  `double_stream_layers.0.img_instruct_attn.processor.img_to_q` (Boogu-Image).
- vllm-omni names drop `.processor.` before the 8 Boogu joint projections and turn `to_out.0` into `to_out`
  (both families). The rule applies to tensor keys and to `target_modules` alike; `from_engine_name` inverts it.

Adapter directory (`export_adapter` / `import_adapter`): `adapter_config.json` (PEFT LoraConfig) and
`adapter_model.safetensors` with keys `<prefix><module path>.lora_A.weight` / `.lora_B.weight` (PEFT's saved form,
no adapter name). The default prefix `transformer.` is what diffusers' `load_lora_weights` reads for a pipeline's
transformer and what vllm-omni's LoRA manager looks up first (`transformer.<path>`); `base_model.model.` (PEFT's
`PeftModel.save_pretrained` form, stripped by vLLM's parser) is available too. The safetensors metadata also carries
diffusers' `lora_adapter_metadata` (r, alpha, targets) so diffusers applies the same scaling.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
import weakref
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIXES = ("transformer.", "base_model.model.")

# The Boogu joint-attention projections that live on the attention *processor* in the upstream tree.
JOINT_PROJECTIONS = (
    "img_to_q", "img_to_k", "img_to_v", "instruct_to_q", "instruct_to_k", "instruct_to_v", "img_out", "instruct_out",
)
_JOINT = "|".join(JOINT_PROJECTIONS)
_DROP_PROCESSOR = re.compile(rf"(^|(?<=\.))processor\.(?=(?:{_JOINT})(?:\.|$))")
_TO_OUT_0 = re.compile(r"(^|(?<=\.))to_out\.0(?=\.|$)")
_ADD_PROCESSOR = re.compile(rf"(?<=img_instruct_attn\.)(?=(?:{_JOINT})(?:\.|$))")
_TO_OUT = re.compile(r"(^|(?<=\.))to_out(?=\.lora_|\.weight|\.bias|$)")


# ---------------------------------------------------------------------------------------------------------------
# Name translation (trainer <-> vllm-omni)
# ---------------------------------------------------------------------------------------------------------------


def to_engine_name(name: str) -> str:
    """Trainer name -> vllm-omni name (a module path, a tensor key or a target_modules entry).

    `...img_instruct_attn.processor.img_to_q` -> `...img_instruct_attn.img_to_q` (8 joint projections);
    `...to_out.0` -> `...to_out`; everything else unchanged.
    """
    return _TO_OUT_0.sub("to_out", _DROP_PROCESSOR.sub("", name))


def from_engine_name(name: str) -> str:
    """vllm-omni name -> trainer name (inverse of `to_engine_name`; trainer names pass through unchanged)."""
    name = _TO_OUT.sub("to_out.0", name)
    return _ADD_PROCESSOR.sub("processor.", name)


def to_engine_targets(targets: Iterable[str]) -> list[str]:
    return [to_engine_name(t) for t in targets]


def from_engine_targets(targets: Iterable[str]) -> list[str]:
    return [from_engine_name(t) for t in targets]


# ---------------------------------------------------------------------------------------------------------------
# Target validation
# ---------------------------------------------------------------------------------------------------------------


def _matches(module_name: str, target: str) -> bool:
    """PEFT's list-of-names rule: the full name, or a suffix starting at a '.' boundary."""
    return module_name == target or module_name.endswith("." + target)


def _base_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear)


def bind_targets(transformer: torch.nn.Module, targets: Sequence[str]) -> dict[str, list[str]]:
    """{target: [module paths it binds]} over the transformer's modules (PEFT matching, LoRA wrappers skipped)."""
    names = [n for n, _ in transformer.named_modules() if n and ".base_layer" not in n and ".lora_" not in n]
    modules = dict(transformer.named_modules())
    out: dict[str, list[str]] = {}
    for t in targets:
        hits = [n for n in names if _matches(n, t)]
        # a LoRA-wrapped Linear is the wrapper module itself (its base lives in `.base_layer`)
        out[t] = [n for n in hits if _base_linear(modules[n]) or hasattr(modules[n], "base_layer")]
        bad = [n for n in hits if n not in out[t]]
        if bad:
            raise ValueError(
                f"LoRA target {t!r} matches non-Linear modules {bad[:4]} (e.g. to_out instead of to_out.0); "
                "LoRA targets must name nn.Linear layers"
            )
    return out


def validate_lora_targets(
    transformer: torch.nn.Module, targets: Sequence[str], block_prefixes: Sequence[str]
) -> list[str]:
    """Check that every target binds >= 1 nn.Linear and that every bound module lies inside the transformer blocks
    (its top-level child name is in `block_prefixes`). Returns the sorted bound module paths.

    Top-level modules (embedders, `norm_out`, `proj_out`, ...) never reach the rollout engine: the layered FSDP
    summon collects LoRA only under the block prefixes, and vllm-omni does not wrap the embedders.
    """
    if not targets:
        raise ValueError("no LoRA targets given; pass the model's default_lora_targets or a non-empty list")
    if isinstance(targets, str):
        raise TypeError("LoRA targets must be a list of module names, not a single string (PEFT would read a regex)")
    bound = bind_targets(transformer, targets)
    unbound = [t for t, mods in bound.items() if not mods]
    if unbound:
        raise ValueError(
            f"LoRA targets {unbound} bind no module of {type(transformer).__name__}; use names of nn.Linear layers "
            "inside the transformer blocks (see the model's default_lora_targets)"
        )
    outside = sorted({n for mods in bound.values() for n in mods if n.split(".")[0] not in block_prefixes})
    if outside:
        raise ValueError(
            f"LoRA targets bind modules outside the transformer blocks {tuple(block_prefixes)}: {outside[:6]}; "
            "top-level modules never reach the rollout engine. Use more specific target names"
        )
    return sorted({n for mods in bound.values() for n in mods})


# ---------------------------------------------------------------------------------------------------------------
# Injection and adapter switching
# ---------------------------------------------------------------------------------------------------------------


def lora_layers(transformer: torch.nn.Module, adapter_name: str | None = None) -> dict[str, torch.nn.Module]:
    """{module path: peft LoraLayer} (optionally only those holding `adapter_name`)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for n, m in transformer.named_modules():
        if isinstance(m, LoraLayer) and (adapter_name is None or adapter_name in m.lora_A):
            out[_strip_prefix(n)] = m
    return out


def apply_lora(
    transformer: torch.nn.Module,
    targets: Sequence[str],
    *,
    rank: int,
    alpha: float,
    block_prefixes: Sequence[str],
    adapter_names: Sequence[str] = ("default",),
    trainable: Sequence[str] | None = None,
    dropout: float = 0.0,
    init_lora_weights: bool = True,
    use_rslora: bool = False,
) -> int:
    """Validate `targets`, then inject one PEFT LoRA adapter per name (e.g. ("default", "old")) with the same config.

    The first adapter is left active; adapters in `trainable` (default: the first) require grad, the others and the
    base weights are frozen. Returns the number of LoRA-wrapped modules.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if not adapter_names or len(set(adapter_names)) != len(adapter_names):
        raise ValueError(f"adapter_names must be distinct and non-empty, got {adapter_names}")
    expected = len(validate_lora_targets(transformer, targets, block_prefixes))
    existing = {a for layer in lora_layers(transformer).values() for a in layer.lora_A}
    clash = sorted(existing & set(adapter_names))
    if clash:
        raise ValueError(f"adapters {clash} already exist on this transformer")
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=dropout,
        init_lora_weights=init_lora_weights, use_rslora=use_rslora,
    )
    peft_configs = getattr(transformer, "peft_config", None)
    peft_configs = dict(peft_configs) if isinstance(peft_configs, dict) else {}
    _LAYERS_CACHE.pop(transformer, None)  # new LoRA layers: the next switch walks the modules again
    for name in adapter_names:
        if hasattr(transformer, "peft_config"):
            del transformer.peft_config  # peft warns about a pre-existing attribute; restored below
        inject_adapter_in_model(config, transformer, adapter_name=name)
        peft_configs[name] = config
    transformer.peft_config = peft_configs  # where diffusers' PeftAdapterMixin keeps adapter configs
    if hasattr(transformer, "_hf_peft_config_loaded"):
        transformer._hf_peft_config_loaded = True
    trainable = list(adapter_names[:1] if trainable is None else trainable)
    for p in transformer.parameters():
        p.requires_grad_(False)
    set_active_adapter(transformer, adapter_names[0])
    for layer in lora_layers(transformer).values():
        for name in trainable:
            if name in layer.lora_A:
                layer.lora_A[name].requires_grad_(True)
                layer.lora_B[name].requires_grad_(True)
    n = len(lora_layers(transformer, adapter_names[0]))
    if n != expected:
        raise RuntimeError(f"PEFT wrapped {n} modules but the targets bind {expected}")
    return n


# transformer -> its LoRA layers in module order, for the per-forward adapter switches (a module walk of a 60-block
# transformer per switch cost the host ~10 ms, three switches per DiffusionNFT micro-step). Cleared by `apply_lora`.
_LAYERS_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def cached_lora_layers(transformer: torch.nn.Module) -> tuple:
    """`lora_layers(transformer).values()` as a tuple, walked once per transformer that has LoRA layers (adapters
    injected later by `apply_lora` clear the entry; a transformer without any is walked again each time)."""
    layers = _LAYERS_CACHE.get(transformer)
    if layers is None:
        layers = tuple(lora_layers(transformer).values())
        if layers:
            _LAYERS_CACHE[transformer] = layers
    return layers


def set_active_adapter(transformer: torch.nn.Module, adapter_name: str) -> None:
    """Make `adapter_name` the active LoRA on every layer, keeping every requires_grad flag as it was.

    The state peft's `LoraLayer.set_adapter` leaves (its `_active_adapter` list) without its side effect on
    requires_grad (it would make the newly active adapter trainable), set directly on the cached layers: no module
    walk, no parameter loop (tests/test_lora.py checks it against peft's own switch)."""
    layers = cached_lora_layers(transformer)
    if not layers:
        raise ValueError("the transformer has no LoRA layers")
    missing = [layer for layer in layers if adapter_name not in layer.lora_A]
    if missing:
        raise ValueError(f"adapter {adapter_name!r} is missing on {len(missing)} LoRA layers "
                         f"(e.g. one with {sorted(missing[0].lora_A)})")
    for layer in layers:
        layer._active_adapter = [adapter_name]


@contextlib.contextmanager
def lora_disabled(transformer: torch.nn.Module) -> Iterator[None]:
    """Run the base model (all LoRA bypassed) inside the block, e.g. for a reference-model forward (a no-op on a
    transformer without LoRA layers)."""
    layers = cached_lora_layers(transformer)
    before = [layer._disable_adapters for layer in layers]
    try:
        for layer in layers:
            layer._disable_adapters = True
        yield
    finally:
        for layer, b in zip(layers, before):
            layer._disable_adapters = b


def copy_adapter_(transformer: torch.nn.Module, src: str, dst: str) -> int:
    """Hard-copy adapter `src` into `dst` (e.g. default -> old at start); returns the number of modules copied."""
    n = 0
    with torch.no_grad():
        for path, layer in lora_layers(transformer, src).items():
            if dst not in layer.lora_A:
                raise ValueError(f"adapter {dst!r} is missing on {path}")
            layer.lora_A[dst].weight.copy_(layer.lora_A[src].weight)
            layer.lora_B[dst].weight.copy_(layer.lora_B[src].weight)
            n += 1
    return n


# ---------------------------------------------------------------------------------------------------------------
# Export / import of a PEFT adapter directory
# ---------------------------------------------------------------------------------------------------------------


def _strip_prefix(name: str) -> str:
    for p in ("base_model.model.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(p, "")
    return name


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy (gathers an FSDP2 DTensor shard first: call on every rank)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous().clone()


def _adapter_config_dict(transformer: torch.nn.Module, adapter_name: str, layers: dict) -> dict:
    first = next(iter(layers.values()))
    r, alpha = first.r[adapter_name], first.lora_alpha[adapter_name]
    for path, layer in layers.items():
        if layer.r[adapter_name] != r or layer.lora_alpha[adapter_name] != alpha:
            raise ValueError(f"{path}: rank/alpha differ across modules; per-module patterns are not exported")
    config = (getattr(transformer, "peft_config", None) or {}).get(adapter_name)
    if config is not None:
        d = config.to_dict()
        targets = sorted(config.target_modules) if not isinstance(config.target_modules, str) else None
        if targets is None:
            raise ValueError("regex target_modules are not supported for export; use a list of names")
    else:  # adapter injected elsewhere: use the exact module paths
        from peft import LoraConfig

        d = LoraConfig(r=r, lora_alpha=alpha).to_dict()
        targets = sorted(layers)
    d["peft_type"] = "LORA"
    d["r"], d["lora_alpha"] = int(r), alpha
    d["target_modules"] = targets
    d["inference_mode"] = True
    d["use_dora"] = False
    d["lora_bias"] = False
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()}


def write_adapter_dir(
    tensors: dict[str, torch.Tensor],
    config: dict,
    out_dir: str,
    *,
    engine_names: bool = False,
    key_prefix: str = "transformer.",
) -> None:
    """Write a PEFT adapter directory atomically (temp dir + rename): `adapter_model.safetensors` with keys
    `<key_prefix><module path>.lora_{A,B}.weight` and `adapter_config.json`, plus the diffusers
    `lora_adapter_metadata` header (so `load_lora_weights` applies alpha/r).

    tensors: full CPU tensors keyed `<trainer module path>.lora_{A,B}.weight`; config: the PEFT LoraConfig dict
    (trainer names). engine_names=True writes vllm-omni names, in the keys and in `target_modules` alike.
    """
    from safetensors.torch import save_file

    if key_prefix not in KEY_PREFIXES:
        raise ValueError(f"key_prefix must be one of {KEY_PREFIXES}, got {key_prefix!r}")
    rename = to_engine_name if engine_names else (lambda s: s)
    out_tensors: dict[str, torch.Tensor] = {}
    for key, value in sorted(tensors.items()):
        module, sep, suffix = key.rpartition(".lora_")
        if not sep or suffix not in ("A.weight", "B.weight"):
            raise ValueError(f"adapter tensor key {key!r} is not '<module>.lora_A.weight' / '<module>.lora_B.weight'")
        out_tensors[f"{key_prefix}{rename(module)}.lora_{suffix}"] = value.detach().to("cpu").contiguous()
    config = dict(config)
    config["target_modules"] = sorted(rename(t) for t in config["target_modules"])
    # diffusers reads the LoRA config from this metadata entry (keys prefixed by the component name)
    meta_keys = ("r", "lora_alpha", "target_modules", "lora_dropout", "bias", "use_rslora", "use_dora", "lora_bias")
    diffusers_meta = {f"transformer.{k}": config[k] for k in meta_keys if k in config}
    metadata = {"format": "pt", "lora_adapter_metadata": json.dumps(diffusers_meta, sort_keys=True)}

    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp.", dir=parent)
    try:
        save_file(out_tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata=metadata)
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True, default=str)
        old = None
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old.", dir=parent)
            os.rename(out_dir, os.path.join(old, "x"))
        os.rename(tmp, out_dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def adapter_tensors(transformer: torch.nn.Module, adapter_name: str = "default") -> tuple[dict[str, torch.Tensor], dict]:
    """(full CPU tensors keyed `<module path>.lora_{A,B}.weight`, PEFT config dict) of one adapter. Gathers FSDP2
    DTensor shards, so every rank must call it."""
    layers = lora_layers(transformer, adapter_name)
    if not layers:
        raise ValueError(f"the transformer has no LoRA adapter named {adapter_name!r}")
    tensors: dict[str, torch.Tensor] = {}
    for path, layer in sorted(layers.items()):
        if layer.use_dora.get(adapter_name, False):
            raise ValueError("DoRA adapters cannot be exported (vllm-omni rejects them)")
        tensors[f"{path}.lora_A.weight"] = _full(layer.lora_A[adapter_name].weight)
        tensors[f"{path}.lora_B.weight"] = _full(layer.lora_B[adapter_name].weight)
    return tensors, _adapter_config_dict(transformer, adapter_name, layers)


def export_adapter(
    transformer: torch.nn.Module,
    out_dir: str,
    *,
    adapter_name: str = "default",
    engine_names: bool = False,
    key_prefix: str = "transformer.",
) -> int:
    """Write adapter `adapter_name` as a PEFT adapter directory (`adapter_tensors` + `write_adapter_dir`).

    engine_names=True writes vllm-omni names (keys and target_modules). key_prefix: "transformer." (diffusers /
    vllm-omni) or "base_model.model." (PEFT). Returns the number of exported LoRA modules. Under FSDP2 every rank
    gathers; call `write_adapter_dir` on one rank to write once.
    """
    tensors, config = adapter_tensors(transformer, adapter_name)
    write_adapter_dir(tensors, config, out_dir, engine_names=engine_names, key_prefix=key_prefix)
    return len(tensors) // 2


def nonfinite_tensors(tensors: Mapping[str, Any]) -> list[str]:
    """The keys of the floating-point tensors in `tensors` that hold NaN or inf (other values are skipped): THE
    finiteness check of adapters and optimizer state, wherever they are read, bound or saved."""
    return [key for key, t in tensors.items()
            if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def read_adapter(adapter_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, {trainer module path: {"A": tensor, "B": tensor}}) from a PEFT adapter directory in either
    name form (prefix `transformer.` / `base_model.model.` / none). A module may lack A or B here;
    `import_adapter` checks bindability first, then completeness."""
    from safetensors.torch import load_file

    from models.base import read_json

    config = read_json(os.path.join(adapter_dir, ADAPTER_CONFIG), "LoRA adapter config")
    wpath = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(wpath):
        raise FileNotFoundError(f"{wpath} does not exist; a PEFT adapter directory needs {ADAPTER_WEIGHTS}")
    try:
        raw = load_file(wpath)
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"{wpath} is not a readable safetensors file ({e}); re-export the adapter") from e
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight", key)
        if m is None:
            raise ValueError(f"{wpath}: unexpected tensor {key!r} (only <module>.lora_A/B.weight are supported)")
        path = m.group(1)
        for p in KEY_PREFIXES:
            if path.startswith(p):
                path = path[len(p):]
                break
        modules.setdefault(from_engine_name(path), {})[m.group(2)] = t
    return config, modules


def import_adapter(
    transformer: torch.nn.Module,
    adapter_dir: str,
    *,
    adapter_name: str = "default",
    block_prefixes: Sequence[str] | None = None,
) -> int:
    """Load a PEFT adapter directory (trainer or vllm-omni names) into `transformer` as `adapter_name`
    (`read_adapter` + `bind_adapter`). Returns the number of bound modules."""
    config, modules = read_adapter(adapter_dir)
    return bind_adapter(transformer, config, modules, adapter_name=adapter_name, block_prefixes=block_prefixes,
                        source=adapter_dir)


def bind_adapter(
    transformer: torch.nn.Module,
    config: dict,
    modules: dict[str, dict[str, torch.Tensor]],
    *,
    adapter_name: str = "default",
    block_prefixes: Sequence[str] | None = None,
    source: str = "the adapter",
) -> int:
    """Copy LoRA tensors into `transformer`'s adapter `adapter_name`, however they arrived (a PEFT directory read by
    `read_adapter`, or tensors handed over by the trainer: the rollout tensor sync, `engines/native.py`).

    config: the PEFT adapter_config dict; modules: {trainer module path: {"A": (r, in), "B": (out, r)}}. If the
    adapter does not exist yet it is injected from `config` (rank, alpha, target_modules translated to trainer names;
    validated against `block_prefixes` when given). Raises, before copying anything, if any tensor binds to no LoRA
    module, if a LoRA module of the adapter receives no tensor, or on a shape/rank/alpha mismatch; `source` names
    where the tensors came from in the message. Returns the number of bound modules.
    """
    layers = lora_layers(transformer, adapter_name)
    if not layers:
        targets = from_engine_targets(config.get("target_modules") or [])
        if block_prefixes is not None:
            validate_lora_targets(transformer, targets, block_prefixes)
        else:
            block_prefixes = sorted({n.split(".")[0] for n, _ in transformer.named_modules() if n})
        apply_lora(transformer, targets, rank=int(config["r"]), alpha=config["lora_alpha"],
                   block_prefixes=block_prefixes, adapter_names=(adapter_name,), trainable=(),
                   use_rslora=bool(config.get("use_rslora", False)))
        layers = lora_layers(transformer, adapter_name)
    unbound = sorted(set(modules) - set(layers))
    if unbound:
        raise ValueError(
            f"{len(unbound)} adapter tensors in {source} bind to no LoRA module of adapter {adapter_name!r}: "
            f"{unbound[:6]}; the adapter was made for another model or with other target_modules"
        )
    half = sorted(p for p, ab in modules.items() if set(ab) != {"A", "B"})
    if half:
        raise ValueError(f"{source}: modules {half[:6]} lack lora_A or lora_B (both are required)")
    missing = sorted(set(layers) - set(modules))
    if missing:
        raise ValueError(
            f"{len(missing)} LoRA modules of adapter {adapter_name!r} get no tensor from {source}: {missing[:6]}"
        )
    bad = nonfinite_tensors({f"{p}.lora_{ab}": t for p, pair in modules.items() for ab, t in pair.items()})
    if bad:
        raise ValueError(f"{source}: {len(bad)} LoRA tensors hold NaN/inf (e.g. {bad[:3]}); refusing to bind a "
                         f"corrupt adapter (its images would be scored as if they were a policy's)")
    for path, layer in layers.items():  # every check before the first copy: a refused set leaves the adapter as it was
        a, b = modules[path]["A"], modules[path]["B"]
        wa, wb = layer.lora_A[adapter_name].weight, layer.lora_B[adapter_name].weight
        if a.shape != wa.shape or b.shape != wb.shape:
            raise ValueError(f"{path}: adapter shapes A{tuple(a.shape)} B{tuple(b.shape)} do not match the model's "
                             f"A{tuple(wa.shape)} B{tuple(wb.shape)} (different rank or model size)")
        r, alpha = wa.shape[0], config["lora_alpha"]
        scaling = alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r
        if not math.isclose(layer.scaling[adapter_name], scaling, rel_tol=1e-6):
            raise ValueError(f"{path}: the model's LoRA scaling {layer.scaling[adapter_name]} differs from the "
                             f"file's {scaling} (lora_alpha={alpha}, r={r}, use_rslora="
                             f"{config.get('use_rslora', False)})")
    with torch.no_grad():
        for path, layer in layers.items():
            a, b = modules[path]["A"], modules[path]["B"]
            wa, wb = layer.lora_A[adapter_name].weight, layer.lora_B[adapter_name].weight
            wa.copy_(a.to(wa.dtype))
            wb.copy_(b.to(wb.dtype))
    return len(layers)


# ---------------------------------------------------------------------------------------------------------------
# FlowModel conveniences (the wrapper supplies the family's targets and block prefixes)
# ---------------------------------------------------------------------------------------------------------------


def add_lora(
    model,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str] | None = None,
    adapter_names: Sequence[str] = ("default",),
    trainable: Sequence[str] | None = None,
    dropout: float = 0.0,
) -> int:
    """`apply_lora` on a FlowModel's transformer with its validated default targets (unless `targets` is given)
    and its block prefixes. Returns the number of LoRA modules per adapter."""
    return apply_lora(
        model.transformer,
        list(model.default_lora_targets if targets is None else targets),
        rank=rank, alpha=alpha, block_prefixes=model.lora_block_prefixes,
        adapter_names=adapter_names, trainable=trainable, dropout=dropout,
    )


def load_adapter(model, adapter_dir: str, *, adapter_name: str = "default") -> int:
    """`import_adapter` into a FlowModel's transformer (e.g. a rollout engine receiving a new adapter version);
    the adapter is injected on first use and overwritten in place afterwards. Returns the bound-module count."""
    n = import_adapter(model.transformer, adapter_dir, adapter_name=adapter_name,
                       block_prefixes=model.lora_block_prefixes)
    set_active_adapter(model.transformer, adapter_name)
    return n


def load_adapter_tensors(model, config: dict, modules: dict[str, dict[str, torch.Tensor]], *,
                         adapter_name: str = "default", source: str = "the adapter tensors") -> int:
    """`bind_adapter` into a FlowModel's transformer from tensors already in memory (the rollout workers' tensor
    sync: the same checks and the same copies as `load_adapter` from a directory). Returns the bound-module count."""
    n = bind_adapter(model.transformer, config, modules, adapter_name=adapter_name,
                     block_prefixes=model.lora_block_prefixes, source=source)
    set_active_adapter(model.transformer, adapter_name)
    return n
