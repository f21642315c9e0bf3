"""Checkpoints: atomic save (temp dir, marker written last, rename), `find_latest`, exact `load_checkpoint` that
refuses a different config (naming the differing keys) and a partial or corrupt checkpoint.

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

import datetime
import hashlib
import json
import os
import platform
import random
import re
import shutil
import uuid
import warnings
from typing import Any, Iterable, Mapping, Sequence
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from models import lora

from .distributed import get_rank, get_world_size
from .model import ADAPTER_DEFAULT, _full, adapter_state_dict, load_adapter_state_, save_adapter_dir
from .data import PromptSampler

__all__ = [
    "CheckpointError", "read_adapter_dir", "MARKER", "RESUME_MUTABLE_KEYS", "config_fingerprint", "library_versions",
    "optimizer_full_state", "load_optimizer_full_state_", "save_checkpoint", "find_latest", "load_checkpoint"
]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: partial, corrupt, or from a different config."""


def read_adapter_dir(path: str) -> dict[str, torch.Tensor]:
    """Tensors of a PEFT adapter directory (`models.lora.read_adapter`: either key form, vllm-omni names mapped
    back), keyed like `adapter_state_dict`. Unreadable or malformed -> CheckpointError naming the directory."""
    try:
        _, modules = lora.read_adapter(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read LoRA adapter {path}: {type(e).__name__}: {e}; the checkpoint is corrupt") from e
    return {f"{module}.lora_{ab}.weight": t for module, pair in modules.items() for ab, t in pair.items()}


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
