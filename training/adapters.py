"""LoRA adapters between the trainer and the outside: the sync of the rollout policy to the rollout workers (a
versioned PEFT folder or tensors in shared memory, with the bound-module check), the adapter folders a flag can
name (`PATH` or `CHECKPOINT:default|old`), and --init_adapter."""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
from typing import Iterable, Sequence

import torch

from models import lora

from .checkpoint import (MARKER, CheckpointError, earlier_adapter_advice, find_latest, read_verified_adapter,
                         unverified_adapter_line)
from .distributed import barrier, is_main_process
from .logs import timer
from .model import (ADAPTER_DEFAULT, ADAPTER_OLD, full_tensor, strip_adapter, adapter_config_dict, adapter_params,
                    adapter_state_dict, load_adapter_state_, save_adapter_dir)

__all__ = ["sync_rollout_adapter", "prune_rollout_adapters", "clean_rollout_adapters", "publish_adapter_tensors",
           "publish_tensors", "resolve_adapter_dir", "verify_adapter_spec", "adapter_arg", "init_adapter_mismatch",
           "load_init_adapter"]


def sync_rollout_adapter(rollout_client, transformer, adapter: str, lora_config, root: str, version: int,
                         expected_modules: int, *, engine_names: bool, keep: int = 2,
                         label: str | None = None) -> dict[str, float]:
    """Publish `adapter` (the rollout policy: "old" for DiffusionNFT, "default" for DPPO/GRPO) to the rollout
    workers: every rank gathers the full tensors, rank 0 writes a versioned PEFT directory atomically, every node's
    workers load it, and the bound-module count must equal the actor's number of LoRA modules (a dropped sync would
    otherwise leave the rollout sampling an old policy while the run looks healthy). `label`: the workers' adapter
    version name (default "v<version>"). Collective."""
    timings: dict[str, float] = {}
    if rollout_client.has_pending:  # a lagged rollout still samples with the last version: this one comes after it
        with timer("gen_lag_wait", timings):
            rollout_client.finish_pending()
    with timer("update_weights", timings):
        if rollout_client.sync_mode == "tensors":  # no disk round trip: each node's workers get them in memory
            path = f"(tensors of {label or f'v{version}'})"
            counts = publish_adapter_tensors(rollout_client, transformer, adapter, lora_config,
                                             label or f"v{version}")
        else:
            state = adapter_state_dict(transformer, adapter, all_ranks=False)  # only rank 0 writes
            path = os.path.join(root, f"v{version:08d}")
            if is_main_process():  # an atomic write: workers never see a half-written version
                save_adapter_dir(state, lora_config, path, engine_names=engine_names)
                prune_rollout_adapters(root, version, keep)
            barrier()
            counts = rollout_client.load_adapter(path, label or f"v{version}")
    bad = [c for c in counts if c != expected_modules]
    if bad:
        raise RuntimeError(
            f"the rollout workers bound {counts} LoRA modules of adapter {path}, the actor has {expected_modules}: the "
            "weight sync is incomplete (name translation or target_modules mismatch); refusing to continue")
    return {**timings, "rollout/bound_modules": float(counts[0]) if counts else 0.0}


_VERSION_DIR = re.compile(r"^v(\d{8})$")


def prune_rollout_adapters(root: str, current: int, keep: int = 2) -> list[str]:
    """Rank 0, right after writing version `current`: delete the versions this run no longer needs; return them.

    Kept: `current` and the `keep - 1` newest versions below it (the workers still hold the previous one until they
    load `current`). Everything else goes, including versions ABOVE `current`: within one run versions only grow,
    so a higher one is a leftover of an earlier run (a resume from an earlier step), never in use.
    """
    versions = sorted(int(m.group(1)) for d in os.listdir(root) if (m := _VERSION_DIR.match(d)))
    below = [v for v in versions if v < current]
    kept = {current, *below[len(below) - max(keep - 1, 0):]} if keep > 1 else {current}
    removed = [f"v{v:08d}" for v in versions if v not in kept]
    for name in removed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed


def clean_rollout_adapters(root: str) -> str | None:
    """Rank 0, at start-up before any rollout worker runs: remove every adapter version and temp folder left under
    `root` by earlier runs (this run publishes its own first version before the first rollout). Returns the line to
    log, or None when there was nothing to remove."""
    if not os.path.isdir(root):
        return None
    names = sorted(os.listdir(root))
    for name in names:
        full = os.path.join(root, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            os.remove(full)
    if not names:
        return None
    versions = [n for n in names if _VERSION_DIR.match(n)]
    return (f"removed {len(names)} entries left by an earlier run from {root} (rollout adapter versions "
            f"{versions[0] + '..' + versions[-1] if versions else 'none'}; they are re-published from the weights)")


def publish_adapter_tensors(rollout_client, transformer, adapter: str, lora_config, version: str) -> list[int]:
    """The tensor sync of `adapter`: every rank gathers each LoRA tensor (FSDP2 `full_tensor`, collective); the
    ranks that feed a worker (`rollout_client.feeds_workers`) copy it into their `AdapterBuffer`, and every node's
    workers bind the buffer of their source rank. Returns this node's per-worker bound-module counts. Collective."""
    params = adapter_params(transformer, adapter)
    layout = [(strip_adapter(name, adapter), tuple(p.shape)) for name, p in params]
    return publish_tensors(rollout_client, layout, (full_tensor(p.detach()) for _, p in params),
                           adapter_config_dict(lora_config), version)


def publish_tensors(rollout_client, layout: Sequence[tuple[str, Sequence[int]]], tensors: Iterable[torch.Tensor],
                    config: dict, version: str) -> list[int]:
    """Hand the adapter tensors `tensors` (one per `layout` entry, (key, shape), in order; consumed on every rank,
    as gathering them may be collective) to the rollout workers through one flat float32 buffer per source rank
    (`rollout.AdapterBuffer` on `rollout_client.device`), freed after every worker bound it. Collective."""
    import rollout

    plain = rollout.adapter_layout(layout)
    buffer = rollout.AdapterBuffer(rollout.layout_numel(plain), rollout_client.device) \
        if rollout_client.feeds_workers else None
    try:
        offset = 0
        for (key, shape), full in zip(plain, tensors, strict=True):
            n = math.prod(shape)
            if tuple(full.shape) != tuple(shape):
                raise ValueError(f"adapter tensor {key}: shape {tuple(full.shape)}, the layout says {tuple(shape)}")
            if buffer is not None:
                buffer.tensor[offset:offset + n].copy_(full.reshape(-1))
            offset += n
        return rollout_client.load_adapter_tensors(buffer, plain, config, version)
    finally:
        if buffer is not None:
            buffer.close()


def resolve_adapter_dir(spec: str) -> str:
    """The PEFT adapter folder named by `spec`: a PEFT folder (adapter_config.json + adapter_model.safetensors),
    or a checkpoint folder (`<output_dir>/checkpoints/step_XXXXXXXX`) with `:default` / `:old` choosing its adapter
    (optional when it holds only one). Model-free; raises ValueError naming the path and the fix."""
    path, name = spec, None
    for candidate in (ADAPTER_DEFAULT, ADAPTER_OLD):
        if spec.endswith(":" + candidate):
            path, name = spec[: -len(candidate) - 1], candidate
    is_peft = lambda d: all(  # noqa: E731
        os.path.isfile(os.path.join(d, f)) for f in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS))
    if is_peft(path):
        if name is not None:
            raise ValueError(f"{path} is a PEFT adapter folder, not a checkpoint: drop ':{name}'")
        return path
    adapters = os.path.join(path, "adapters")
    if os.path.isdir(adapters):
        if not os.path.isfile(os.path.join(path, MARKER)):
            raise ValueError(f"checkpoint {path} is partial (no {MARKER} marker: nothing in it can be verified); "
                             f"{earlier_adapter_advice(path, name or ADAPTER_DEFAULT)}")
        present = sorted(d for d in os.listdir(adapters) if is_peft(os.path.join(adapters, d)))
        if name is None and len(present) != 1:
            raise ValueError(f"checkpoint {path} holds the adapters {present}: name one, e.g. {path}:old (what "
                             f"verl-omni validates for DiffusionNFT) or {path}:default (the trained one)")
        name = name or present[0]
        if name not in present:
            raise ValueError(f"checkpoint {path} has no adapter {name!r} (it holds {present})")
        return os.path.join(adapters, name)
    hint = ""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        latest = find_latest(os.path.join(path, "checkpoints"))
        hint = f"; {path} looks like a run directory: pass one of its checkpoints"
        hint += f", e.g. {latest}" if latest else ""
    raise ValueError(f"{path} is neither a PEFT adapter folder ({lora.ADAPTER_CONFIG} + {lora.ADAPTER_WEIGHTS}) nor a "
                     f"checkpoint folder (adapters/<name>/){hint}")


def verify_adapter_spec(spec: str) -> tuple[str, dict, dict]:
    """(folder, adapter_config, modules) of the adapter `spec` names (`resolve_adapter_dir`), read by
    `read_verified_adapter` (an adapter of a checkpoint, as `CKPT:NAME` or as its folder, against the checkpoint's
    COMPLETE manifest, refused without one; finiteness always). What every tool reads an adapter with; a
    standalone folder's `unverified_adapter_line` is for the tool to print. Model-free; raises ValueError /
    CheckpointError naming the adapter and the fix."""
    path = resolve_adapter_dir(spec)
    config, modules = read_verified_adapter(path)
    return path, config, modules


def adapter_arg(spec: str) -> str:
    """argparse `type=` for adapter flags: checks `spec` with `verify_adapter_spec` at parse time (before any
    model loads: where it is, its manifest, its finiteness) and keeps it as written."""
    try:
        verify_adapter_spec(spec)
    except (ValueError, CheckpointError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def init_adapter_mismatch(spec: str, config: dict, *, lora_rank: int, lora_alpha: float) -> str | None:
    """Why the --init_adapter whose adapter_config is `config` cannot start this run's LoRA (None when it can):
    its rank and alpha must be the run's, and it must not be rsLoRA."""
    if int(config.get("r", -1)) != lora_rank or float(config.get("lora_alpha", -1)) != float(lora_alpha) \
            or config.get("use_rslora"):
        return (f"--init_adapter {spec}: r={config.get('r')}, lora_alpha={config.get('lora_alpha')}, "
                f"use_rslora={config.get('use_rslora', False)}; this run has --lora_rank {lora_rank} "
                f"--lora_alpha {lora_alpha} (no rsLoRA): pass the adapter's values")
    return None


def load_init_adapter(transformer, spec: str | None, *, lora_rank: int, lora_alpha: float, expected_modules: int,
                      adapter: str = ADAPTER_DEFAULT) -> int:
    """--init_adapter: copy the LoRA of `spec` (see `resolve_adapter_dir`) into `adapter` of the (sharded)
    transformer. Its rank and alpha must be the run's and its tensors must bind exactly the run's LoRA modules
    (`load_adapter_state_` is strict), else ValueError. Logs one line on rank 0; returns the module count (0 when
    `spec` is None). Every rank calls it (each reads the full tensors and keeps its shard; no communication)."""
    if not spec:
        return 0
    path, config, modules = verify_adapter_spec(spec)
    problem = init_adapter_mismatch(spec, config, lora_rank=lora_rank, lora_alpha=lora_alpha)
    if problem:
        raise ValueError(problem)
    load_adapter_state_(transformer, adapter, {f"{module}.lora_{ab}.weight": t for module, pair in modules.items()
                                               for ab, t in pair.items()})
    if len(modules) != expected_modules:  # load_adapter_state_ is strict, so this only guards its contract
        raise RuntimeError(f"--init_adapter {spec} bound {len(modules)} LoRA modules, the actor has {expected_modules}")
    if is_main_process():
        print(f"init adapter: '{adapter}' starts from {path} ({len(modules)} modules, r={lora_rank}, "
              f"alpha={lora_alpha})", flush=True)
        unverified = unverified_adapter_line(path)
        if unverified:
            print(f"--init_adapter: {unverified}", flush=True)
    return len(modules)
