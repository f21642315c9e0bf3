"""Checkpoints: atomic save (temp dir, a sha256 manifest written last, rename), `find_latest`, `verify_checkpoint`,
and exact `load_checkpoint` (every file read with `torch.load(weights_only=True)`: a checkpoint never runs code),
which compares the run's config with the checkpoint's (`check_resume_config`, by the policy of `resume_policy.py`).
`resume.py` holds `prepare_resume`, the model-free first look at `<output_dir>/checkpoints` before any model loads.

Checkpoint layout (``<root>/step_00000012/``)::

    adapters/default/{adapter_config.json, adapter_model.safetensors}   # diffusers `load_lora_weights` loads it
    adapters/old/...
    optimizer.pt        # full (unsharded) optimizer state, keyed by parameter name (`optimizer_full_state`)
    rng.pt              # python / numpy / torch CPU / CUDA RNG states, one entry per rank (tensors, ints, lists)
    trainer_state.json  # step, sampler cursor, config fingerprint + fingerprinted and logged values, versions, extras
    COMPLETE            # written last (JSON: format, step, size and sha256 of every other file)

Rank 0 writes every file (state is gathered to it first); EVERY rank reads the checkpoint on load, so the checkpoint
directory must be visible to all ranks (a shared filesystem, as for any multi-node torchrun job). The optimizer state
is saved as one full state dict (not DCP shards): the trainable state is LoRA-sized, a full dict is resharding-free
and readable with plain `torch.load`. It is gathered/scattered by our own two functions rather than torch's
`get/set_optimizer_state_dict`, which fail on parameters without Adam state (a LoRA that never gets a gradient).
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import platform
import random
import re
import shutil
import uuid
import warnings
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from models import lora

from .distributed import get_rank, get_world_size, on_rank0, raise_if_any_rank_failed
from .model import ADAPTER_DEFAULT, full_tensor, adapter_state_dict, load_adapter_state_, save_adapter_dir
from .data import PromptSampler
from .resume_policy import RESUME_MUTABLE_KEYS, hash_files, logged_values, config_fingerprint

__all__ = [
    "CheckpointError", "read_adapter_dir", "read_verified_adapter", "adapter_checkpoint", "unverified_adapter_line",
    "earlier_verified_checkpoint", "earlier_adapter_advice", "MARKER",
    "CHECKPOINT_FORMAT", "library_versions", "optimizer_full_state", "load_optimizer_full_state_", "save_checkpoint",
    "GatheredState", "gather_checkpoint", "write_checkpoint", "save_gathered",
    "step_dir", "find_latest", "verify_checkpoint", "clean_orphans", "check_resume_config",
    "load_checkpoint", "complete_steps", "step_dirs", "load_tensors", "checkpoint_on_rank0", "read_trainer_state",
]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: partial, corrupt, or from a different config."""


def read_adapter_dir(path: str, *, manifest: bool = True) -> dict[str, torch.Tensor]:
    """Tensors of a PEFT adapter directory (`read_verified_adapter`: manifest when in a checkpoint and `manifest`,
    finiteness always), keyed like `adapter_state_dict`. Unreadable, malformed or non-finite -> CheckpointError
    naming the directory."""
    _, modules = read_verified_adapter(path, manifest=manifest)
    return {f"{module}.lora_{ab}.weight": t for module, pair in modules.items() for ab, t in pair.items()}


_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: str, step: int) -> str:
    """`<root>/step_XXXXXXXX`: the checkpoint directory of `step` (eight digits, so names sort by step)."""
    return os.path.join(root, f"step_{step:08d}")

MARKER = "COMPLETE"
CHECKPOINT_FORMAT = 2  # 2: sha256 per file in the manifest, weights_only-loadable rng.pt (1: sizes only, numpy pickles)


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
    """This rank's RNG states as tensors, ints, floats, strings and tuples only (what `weights_only=True` loads)."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {"python": random.getstate(),
             "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's generator
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
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


def optimizer_full_state(transformer: nn.Module, optimizer: torch.optim.Optimizer, *,
                         all_ranks: bool = True) -> dict[str, Any]:
    """The optimizer state with full (unsharded) CPU tensors, keyed by parameter name. Collective; with
    `all_ranks=False` only rank 0 keeps the CPU copies (the other ranks get empty entries).

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
    keep = all_ranks or get_rank() == 0
    for name, p in owned:
        entry = {}
        for k, v in optimizer.state[p].items():
            full = full_tensor(v).detach() if torch.is_tensor(v) else v  # the gather is collective: every rank runs it
            if keep:
                entry[k] = full.to("cpu").clone() if torch.is_tensor(full) else full
        state[name] = entry
    return {"state": state, "param_groups": groups}


def load_optimizer_full_state_(transformer: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """Inverse of `optimizer_full_state`: shard the saved tensors like their parameters and load them (no
    communication; every rank holds `saved`). The parameter names per group must match exactly; the groups'
    hyper-parameters stay those of `optimizer` (this run's flags)."""
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
        # hyper-parameters (lr, betas, weight decay) come from this run's flags: equal to the saved ones on a plain
        # resume, and a change accepted with --resume_force (e.g. a lower --lr after a divergence) takes effect
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    optimizer.state.clear()
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _nonfinite_report(adapters: Mapping[str, Mapping[str, torch.Tensor]], optim_state: Mapping[str, Any]) -> list[str]:
    """Names of the tensors about to be saved that hold NaN/inf (empty on the happy path)."""
    bad = [f"adapter {name}: {key}" for name, tensors in adapters.items() for key in lora.nonfinite_tensors(tensors)]
    for pname, entry in optim_state["state"].items():
        bad += [f"optimizer {pname}.{k}" for k in lora.nonfinite_tensors(entry)]
    return bad


def adapter_checkpoint(adapter_dir: str) -> tuple[str, str] | None:
    """(checkpoint folder, manifest prefix "adapters/<name>/") when `adapter_dir` (symbolic links resolved) is an
    adapter of a checkpoint, complete or not: `<ckpt>/adapters/<name>` where `<ckpt>` is named `step_XXXXXXXX` or
    holds a COMPLETE marker or a trainer_state.json. None for a standalone PEFT folder (it carries no manifest)."""
    parent, name = os.path.split(os.path.realpath(adapter_dir))
    ckpt, adapters = os.path.split(parent)
    if adapters == "adapters" and (_STEP_DIR.match(os.path.basename(ckpt)) or any(
            os.path.isfile(os.path.join(ckpt, f)) for f in (MARKER, "trainer_state.json"))):
        return ckpt, f"adapters/{name}/"
    return None


def unverified_adapter_line(adapter_dir: str) -> str | None:
    """The line a tool prints when it reads the standalone PEFT folder `adapter_dir`: its bytes could not be
    verified (no checksum available; only finiteness was checked). None for an adapter of a checkpoint, which
    `read_verified_adapter` verifies against the checkpoint's COMPLETE manifest or refuses."""
    if adapter_checkpoint(adapter_dir) is not None:
        return None
    return (f"LoRA adapter {adapter_dir}: not verified (a standalone PEFT folder has no checksum manifest: no "
            f"checksum available); only that its tensors are finite was checked")


def earlier_verified_checkpoint(path: str) -> str | None:
    """The newest complete checkpoint older than `path` in the same folder that verifies (`verify_checkpoint`:
    manifest, sha256, adapters readable and finite); None when there is none. What a refusal of `path` offers."""
    root, name = os.path.split(os.path.abspath(path))
    m = _STEP_DIR.match(name)
    below = int(m.group(1)) if m else None
    for step in reversed(complete_steps(root)):
        if below is not None and step >= below:
            continue
        candidate = step_dir(root, step)
        try:
            verify_checkpoint(candidate)
        except CheckpointError:
            continue
        return candidate
    return None


def earlier_adapter_advice(ckpt: str, name: str) -> str:
    """The fix a refusal of adapter `name` of checkpoint `ckpt` offers: the same adapter of the previous complete
    checkpoint that verifies (`earlier_verified_checkpoint`), or that there is none."""
    earlier = earlier_verified_checkpoint(ckpt)
    if earlier:
        return f"use {earlier}:{name}, the previous complete checkpoint, which verifies"
    return f"no earlier complete checkpoint in {os.path.dirname(os.path.abspath(ckpt))} verifies: use another adapter"


def _read_checked_adapter(adapter_dir: str, what: str, *, plain: bool) -> tuple[dict, dict[str, dict]]:
    """`models.lora.read_adapter` of `adapter_dir`, refused (CheckpointError naming the folder or file) when it is
    unreadable or any tensor holds NaN/inf. `plain`: a standalone folder (the message says it has no manifest)."""
    try:
        config, modules = lora.read_adapter(adapter_dir)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {what} {adapter_dir}: {type(e).__name__}: {e}; it is corrupt") from e
    bad = lora.nonfinite_tensors({f"{module}.lora_{ab}": t for module, pair in modules.items()
                                  for ab, t in pair.items()})
    if bad:
        raise CheckpointError(
            f"{what} {adapter_dir}: {len(bad)} tensors hold NaN/inf (e.g. {bad[:3]}); it is corrupt"
            + (" (a plain PEFT folder has no sha256 manifest to say which bytes changed)" if plain else "")
            + ": use another adapter or checkpoint")
    return config, modules


def read_verified_adapter(adapter_dir: str, *, what: str = "LoRA adapter",
                          manifest: bool = True) -> tuple[dict, dict[str, dict]]:
    """THE reader of an adapter folder from disk (evaluate, sample, export, --init_adapter, resume):
    `models.lora.read_adapter` of `adapter_dir` after verifying what can be verified. An adapter of a checkpoint
    (`adapter_checkpoint`, given as `CKPT:NAME` or as the folder itself) must match the checkpoint's COMPLETE
    manifest (sizes of every file, sha256 of its own): a checkpoint without the manifest is refused, as nothing
    can be verified. Every tensor must be finite, wherever the folder is (a standalone PEFT folder has no checksum:
    the caller prints `unverified_adapter_line`). `manifest=False`: the caller verified the checkpoint already.
    Raises CheckpointError naming the folder (`what` says whose), the files or tensors and the fix (for a
    checkpoint's adapter, the previous complete checkpoint that verifies)."""
    found = adapter_checkpoint(adapter_dir)
    if found is None:
        return _read_checked_adapter(adapter_dir, what, plain=True)
    ckpt, prefix = found
    try:
        if manifest:
            verify_checkpoint(ckpt, only=prefix, contents=False)
    except CheckpointError as e:
        raise CheckpointError(f"{what} {adapter_dir} is refused: {e}; "
                              f"{earlier_adapter_advice(ckpt, prefix.split('/')[1])}") from e
    try:
        return _read_checked_adapter(adapter_dir, what, plain=False)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {earlier_adapter_advice(ckpt, prefix.split('/')[1])}") from e


@dataclass
class GatheredState:
    """Everything a checkpoint of `step` holds, gathered to rank 0 (`gather_checkpoint`; other ranks hold None in
    every tensor field): written by `write_checkpoint` on rank 0 alone, with no collective, so a run can keep the
    last finished step's state in memory and write it at once on a signal or a fatal error."""

    step: int
    adapters: dict[str, dict[str, torch.Tensor]]
    optim_state: Any
    rng_states: list[Any]
    trainer_json: dict[str, Any]
    lora_config: Any


def gather_checkpoint(
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
) -> GatheredState:
    """The state of `step` (adapter tensors, optimizer state, every rank's RNG, the sampler cursor, the trainer
    state and config fingerprint) as full CPU copies on rank 0. Collective."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    adapters = {name: adapter_state_dict(transformer, name, all_ranks=False) for name in adapter_names}
    optim_state = optimizer_full_state(transformer, optimizer, all_ranks=False)
    rng_states: list[Any] = [None] * get_world_size()
    if dist.is_initialized():
        dist.all_gather_object(rng_states, _rng_state())
    else:
        rng_states = [_rng_state()]
    state: dict[str, Any] = {}
    if get_rank() == 0:
        digest, values = config_fingerprint(config, fingerprint_ignore)
        state = {
            "step": int(step),
            "world_size": get_world_size(),
            "adapters": list(adapter_names),
            "sampler": sampler.state_dict() if sampler is not None else None,
            "config_fingerprint": digest,
            "fingerprinted_config": values,
            "logged_config": logged_values(config, fingerprint_ignore),
            "versions": library_versions(),
            "trainer_state": json.loads(json.dumps(dict(trainer_state or {}))),  # a copy: later steps change it
        }
    return GatheredState(int(step), adapters, optim_state, rng_states, state, lora_config)


def write_checkpoint(root: str, gathered: GatheredState, *, keep_last: int | None = None) -> str:
    """Rank 0, no collective: refuse non-finite weights or optimizer state (CheckpointError: a checkpoint is never
    poisoned), write `gathered` into a temp directory, fsync, write the COMPLETE manifest (size + sha256 per file)
    last and rename the directory into place, so `root` never holds a half-written step directory; then delete
    older complete checkpoints beyond `keep_last`. Returns the step directory."""
    final = step_dir(root, gathered.step)
    bad = _nonfinite_report(gathered.adapters, gathered.optim_state)
    if bad:
        raise CheckpointError(
            f"refusing to write checkpoint {final}: {len(bad)} tensors hold NaN/inf (e.g. {bad[:3]}); the "
            f"earlier checkpoints under {root} are left as they are")
    state = {**gathered.trainer_json, "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    _write_checkpoint_dir(root, final, state, gathered.adapters, gathered.lora_config, gathered.optim_state,
                          gathered.rng_states)
    if keep_last is not None and keep_last > 0:
        for old_step in [s for s in complete_steps(root) if s != gathered.step][:-(keep_last - 1) or None]:
            shutil.rmtree(step_dir(root, old_step), ignore_errors=True)
    return final


def save_checkpoint(root: str, step: int, *, keep_last: int | None = None, **state: Any) -> str:
    """Save everything needed to resume at `step` to `<root>/step_XXXXXXXX`; return that path. Collective:
    `gather_checkpoint(step, **state)` on every rank (`state`: its keyword arguments: transformer, optimizer,
    lora_config, config, sampler, adapter_names, trainer_state (JSON-able extras, e.g. GradStepper.state_dict()),
    fingerprint_ignore), `write_checkpoint` on rank 0, its error raised on every rank. keep_last: delete older
    complete checkpoints beyond this many, only after the new one is in place."""
    return save_gathered(root, gather_checkpoint(step, **state), keep_last=keep_last)


def save_gathered(root: str, gathered: GatheredState, *, keep_last: int | None = None) -> str:
    """`write_checkpoint` on rank 0, its error raised on every rank. Collective; returns the step directory."""
    final = step_dir(root, gathered.step)
    error: BaseException | None = None
    if get_rank() == 0:
        try:
            write_checkpoint(root, gathered, keep_last=keep_last)
        except BaseException as e:  # noqa: BLE001 - re-raised below on every rank
            error = e
    _raise_if_any_rank_failed(error, f"save_checkpoint({final})")
    return final


def _raise_if_any_rank_failed(error: BaseException | None, what: str) -> None:
    """Collective: every rank raises when any rank failed (instead of the others hanging in a later collective)."""
    raise_if_any_rank_failed(error, what, exc_type=CheckpointError)


def _manifest(root: str, step: int) -> dict[str, Any]:
    sizes = _file_sizes(root)
    hashes = hash_files(root, list(sizes))
    return {"format": CHECKPOINT_FORMAT, "step": int(step),
            "files": {rel: {"size": size, "sha256": hashes[rel]} for rel, size in sizes.items()}}


def _write_checkpoint_dir(root: str, final: str, state: dict[str, Any], adapters: Mapping[str, Mapping[str, torch.Tensor]],
                          lora_config, optim_state: Any, rng_states: list[Any]) -> None:
    """Rank 0: write everything into a temp dir, fsync, manifest last, rename into place (temp removed on error)."""
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
        marker = _manifest(tmp, state["step"])  # sizes + sha256 of everything but the marker itself
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving a step: swap, then delete the previous copy (`clean_orphans` puts a
            # `.trash-` copy back if a kill lands between the two renames)
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


def step_dirs(root: str) -> dict[int, str]:
    """{step: name} of every `step_XXXXXXXX` directory under `root`, complete or not."""
    if not os.path.isdir(root):
        return {}
    return {int(m.group(1)): name for name in os.listdir(root) if (m := _STEP_DIR.match(name))}


def complete_steps(root: str) -> list[int]:
    """The steps of the `step_XXXXXXXX` directories under `root` that hold the completion marker, ascending."""
    return sorted(step for step, name in step_dirs(root).items() if os.path.isfile(os.path.join(root, name, MARKER)))


def find_latest(root: str) -> str | None:
    """Path of the newest COMPLETE checkpoint under `root` (None when `root` has no step directories at all).

    Step directories without the marker (copied by hand, damaged) are skipped with a warning; if step directories
    exist but none is complete, raises CheckpointError instead of letting a resume silently start fresh.
    """
    if not os.path.isdir(root):
        return None
    names = [n for n in os.listdir(root) if _STEP_DIR.match(n)]
    complete = complete_steps(root)
    incomplete = sorted(n for n in names if int(_STEP_DIR.match(n).group(1)) not in complete)
    if incomplete:
        warnings.warn(f"{root}: skipping checkpoint directories without a {MARKER} marker: {incomplete}")
    if names and not complete:
        raise CheckpointError(
            f"{root} holds checkpoint directories {incomplete} but none is complete (no {MARKER} marker); refusing to "
            f"start fresh. Remove them, or pass --resume never (they are moved aside) or another --output_dir."
        )
    return step_dir(root, complete[-1]) if complete else None


def verify_checkpoint(path: str, *, sha256: bool = True, only: str | None = None,
                      contents: bool = True) -> dict[str, Any]:
    """The COMPLETE manifest of `path` after checking it: the marker exists and is this format, the file set and
    sizes match, and (sha256=True) every file's sha256 matches (with `only`, e.g. "adapters/old/", the files under
    that prefix only) and (`contents`) every adapter there reads and holds finite tensors: a manifest re-forged
    over a damaged file (e.g. a zero-byte adapter) is refused here, before any model loads. Raises CheckpointError
    naming the files."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    marker_path = os.path.join(path, MARKER)
    if not os.path.isfile(marker_path):
        raise CheckpointError(f"checkpoint {path} is partial: the {MARKER} marker (written last) is missing, so "
                              f"nothing in it can be verified")
    try:
        with open(marker_path, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {MARKER} marker ({e}); the checkpoint is corrupt") from e
    if not isinstance(marker, dict) or marker.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {marker.get('format', 1) if isinstance(marker, dict) else '?'}, this code "
            f"reads format {CHECKPOINT_FORMAT} (sha256 manifest, weights_only-loadable files); a checkpoint from an "
            f"older flowrl cannot be verified or loaded safely: start a new run (--resume never)")
    expected = {rel: entry["size"] for rel, entry in marker["files"].items()}
    actual = {k: v for k, v in _file_sizes(path).items() if k != MARKER}
    if actual != expected:
        diff = sorted(k for k in set(actual) | set(expected) if actual.get(k) != expected.get(k))
        raise CheckpointError(
            f"checkpoint {path} is corrupt: files differ from the {MARKER} manifest (missing, truncated or extra): {diff}"
        )
    if sha256:
        hashes = hash_files(path, sorted(rel for rel in expected if only is None or rel.startswith(only)))
        wrong = sorted(rel for rel, h in hashes.items() if h != marker["files"][rel]["sha256"])
        if wrong:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {wrong} do not match the sha256 in its {MARKER} manifest (same size, "
                f"different bytes)")
        if contents:
            _check_adapter_contents(path, sorted(expected), only)
    return marker


def _check_adapter_contents(path: str, files: Sequence[str], only: str | None) -> None:
    """Every adapter folder of checkpoint `path` among the manifest's `files` (under `only`) reads and is finite."""
    names = sorted({rel.split(os.sep)[1] for rel in files if rel.startswith("adapters" + os.sep)
                    and rel.count(os.sep) >= 2 and (only is None or rel.startswith(only))})
    for name in names:
        try:
            _read_checked_adapter(os.path.join(path, "adapters", name), "adapter", plain=False)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint {path} is corrupt: {e}") from None


def clean_orphans(root: str) -> list[str]:
    """Tidy `root` after a save that was killed; one message per action (rank 0, before anything reads `root`).

    `.tmp-step_X-*` (killed before its rename: step_X was never complete) is removed. `.trash-step_X-*` (a re-save
    of step_X killed after moving the old copy out) is renamed back to step_X when step_X is missing, else removed.
    """
    messages: list[str] = []
    if not os.path.isdir(root):
        return messages
    for name in sorted(os.listdir(root)):
        full = os.path.join(root, name)
        if name.startswith(".tmp-step_"):
            shutil.rmtree(full, ignore_errors=True)
            messages.append(f"removed {full}: the temp folder of a checkpoint save that was killed")
        elif m := re.match(r"^\.trash-(step_\d{8})-", name):
            target = os.path.join(root, m.group(1))
            if os.path.exists(target):
                shutil.rmtree(full, ignore_errors=True)
                messages.append(f"removed {full}: the old copy of {m.group(1)} left by a killed re-save")
            else:
                os.rename(full, target)
                messages.append(f"restored {target} from {full} (a re-save of it was killed between its renames)")
    return messages


def read_trainer_state(path: str) -> dict[str, Any]:
    """The checkpoint's `trainer_state.json`; unreadable or not JSON: a CheckpointError naming it."""
    try:
        with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read trainer_state.json ({e})") from e


def _diff_lines(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [f"{k}: checkpoint={old.get(k, '<absent>')!r} now={new.get(k, '<absent>')!r}"
            for k in sorted(set(old) | set(new)) if old.get(k, "<absent>") != new.get(k, "<absent>")]


def check_resume_config(path: str, state: Mapping[str, Any], config: Mapping[str, Any], *,
                        adapter_names: Sequence[str] | None = None, force: bool = False,
                        fingerprint_ignore: Iterable[str] = RESUME_MUTABLE_KEYS) -> list[str]:
    """Compare this run's config with the checkpoint's trainer state; return the lines to print.

    Raises CheckpointError for another world size or adapter set, and for different fingerprinted values (naming
    each key with both values) unless `force`, which turns that into a warning line. Changed logged (operational)
    values are reported, never refused.
    """
    if state.get("world_size") != get_world_size():
        raise CheckpointError(
            f"checkpoint {path} was written by {state.get('world_size')} ranks, this run has {get_world_size()}; exact "
            f"resume (per-rank RNG, data shards) needs the same number of trainer processes")
    if adapter_names is not None and list(state["adapters"]) != list(adapter_names):
        raise CheckpointError(f"checkpoint {path} holds adapters {state['adapters']}, this run expects {list(adapter_names)}")
    lines: list[str] = []
    digest, values = config_fingerprint(config, fingerprint_ignore)
    if digest != state["config_fingerprint"]:
        diffs = _diff_lines(state["fingerprinted_config"], values)
        if not force:
            raise CheckpointError(
                f"refusing to resume {path}: it was written with other values of flags that change the objective, "
                f"the sampled numbers or the data order ({'; '.join(diffs)}); resume with the original values, or "
                f"pass --resume_force to continue anyway (the run is then no longer one experiment), or start a new "
                f"run with --resume never (the checkpoints are moved aside) or in a fresh --output_dir")
        lines.append(f"WARNING --resume_force: resuming {path} although these flags changed (the objective, the "
                     f"sampled numbers or the data order differ from the run so far):\n  " + "\n  ".join(diffs))
    logged = _diff_lines(state.get("logged_config", {}), logged_values(config, fingerprint_ignore))
    logged = [line for line in logged if not line.startswith(("resume:", "resume_force:"))]
    if logged:
        lines.append("changed since the checkpoint (operational flags and paths, allowed):\n  " + "\n  ".join(logged))
    return lines


def checkpoint_on_rank0(fn: Callable[[], Any], what: str = "") -> Any:
    """`fn()` on rank 0 only, its result given to every rank (`on_rank0`). A CheckpointError or OSError there is
    raised as a CheckpointError on every rank (prefixed by `what`), so no rank waits in a later collective."""
    return on_rank0(fn, catch=(CheckpointError, OSError), exc_type=CheckpointError, what=what)


def load_tensors(path: str, name: str, *, mmap: bool = False) -> Any:
    """`torch.load(weights_only=True)`: tensors, numbers, strings and containers only; a pickle that would build
    any other object (run code) is refused with a CheckpointError naming the file. `mmap`: map the tensor data
    instead of reading it (a cheap check of the pickle alone)."""
    file = os.path.join(path, name)
    try:
        mmap = mmap and zipfile.is_zipfile(file)  # torch.save's zip format maps; a legacy pickle is read whole
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {path}: {name} holds pickled objects other than tensors and plain containers; refusing to "
            f"unpickle it (weights_only=True: loading it could run arbitrary code). flowrl never writes such files: "
            f"do not use this checkpoint unless you know where it came from ({first})") from None
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {name} ({type(e).__name__}: {e}); it is corrupt") from e


def load_checkpoint(
    path: str,
    *,
    transformer: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Mapping[str, Any],
    sampler: PromptSampler | None = None,
    adapter_names: Sequence[str] = (ADAPTER_DEFAULT,),
    fingerprint_ignore: Iterable[str] = RESUME_MUTABLE_KEYS,
    force: bool = False,
    verify_sha256: bool = True,
) -> dict[str, Any]:
    """Restore adapters, optimizer, this rank's RNG states and the sampler cursor from `path`; return the saved
    trainer state dict ({"step", "trainer_state", ...}). Collective (every rank reads `path`).

    Refuses (CheckpointError) a partial or corrupt checkpoint (sizes on every rank; sha256 on rank 0 when
    `verify_sha256`, e.g. False after `prepare_resume` checked it), another world size, a config whose fingerprint
    differs unless `force` (the message names each differing key with both values), and any file that
    `torch.load(weights_only=True)` refuses. RNG states are restored last, so the next random draw equals the
    uninterrupted run's.
    """
    error: BaseException | None = None
    try:
        verify_checkpoint(path, sha256=verify_sha256 and get_rank() == 0)
    except CheckpointError as e:
        error = e
    _raise_if_any_rank_failed(error, f"load_checkpoint({path})")
    state = read_trainer_state(path)
    check_resume_config(path, state, config, adapter_names=adapter_names, force=force,
                        fingerprint_ignore=fingerprint_ignore)
    for name in adapter_names:
        # the manifest was checked above (sizes on every rank, sha256 on rank 0 unless the caller did)
        load_adapter_state_(transformer, name, read_adapter_dir(os.path.join(path, "adapters", name), manifest=False))
    optim_state, rng_states = {}, []
    try:
        optim_state = load_tensors(path, "optimizer.pt")
        rng_states = load_tensors(path, "rng.pt")
        load_optimizer_full_state_(transformer, optimizer, optim_state)
    except CheckpointError as e:
        error = e
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
