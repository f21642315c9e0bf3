"""The resume policy: which flags a run may change when it resumes and how that is checked. BLOCKING flags change
the objective, the sampled numbers or the data order (a resume with another value is refused; --resume_force
overrides with a warning naming them); LOGGED flags are operational (a change is allowed and printed); PATHS are
logged as strings, what they point to is fingerprinted (`content_fingerprints`). `config_fingerprint` is the digest
a checkpoint stores and `load_checkpoint` / `prepare_resume` compare."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping, Sequence

_HASH_CHUNK = 8 << 20
_SAMPLE = 1 << 20

__all__ = ["RESUME_BLOCKING", "RESUME_LOGGED", "RESUME_PATHS", "RESUME_MUTABLE_KEYS", "config_fingerprint",
           "content_fingerprints", "path_fingerprint", "sha256_file", "hash_files", "logged_values"]


# The resume policy: every flag of the trainers is in exactly one of these (tests/test_training_resume.py fails on a new
# flag that is not). BLOCKING flags change the objective, the sampled numbers or the data order: a resume with a
# different value is refused (--resume_force overrides, with a warning naming them). LOGGED flags are operational
# (where things run, how fast, how long, what is logged or validated): a change is allowed and printed. PATHS are
# logged as strings (a moved run folder still resumes); what they point to is fingerprinted instead
# (`content_fingerprints`, key "<flag>@content"), blocking where True (val_files only steer validation).
RESUME_BLOCKING: frozenset[str] = frozenset({
    # model, LoRA, optimizer
    "device", "precision", "max_sequence_length", "lora_rank", "lora_alpha", "lora_target_modules",
    "lora_init_weights", "lr", "weight_decay", "adam_betas", "max_grad_norm",
    # data order and batching
    "seed", "train_batch_size", "rollout_n", "ppo_mini_batch_size", "ppo_epochs",
    # rollout sampling
    "rollout_engine", "rollout_dtype", "height", "width", "num_inference_steps", "guidance_scale", "true_cfg_scale",
    "cfg_scale",
    # rewards
    "ocr_backend", "genrm_model", "genrm_temperature", "genrm_top_p", "genrm_max_tokens", "genrm_seed",
    "rapidocr_det_limit_side_len", "reward_weights",
    # DiffusionNFT
    "mix_beta", "adv_clip_max", "ref_kl_coef", "adaptive_weight_min", "adv_mode", "timestep_fraction",
    "timestep_shuffle_seed", "old_policy_decay_schedule", "old_policy_decay", "old_policy_update_interval",
    "global_std", "norm_adv_by_std",
    # Flow-DPPO / Flow-GRPO
    "loss", "noise_level", "sde_type", "sde_window_size", "sde_window_range", "kl_mask_threshold",
    "add_kl_coefficient", "clip_ratio",
    # lr schedule; what the training forwards and the old log-probs are (they change the update)
    "lr_scheduler", "lr_warmup_steps", "min_lr_ratio", "train_cfg", "old_log_probs",
    "rollout_policy_lag",
})


RESUME_LOGGED: frozenset[str] = frozenset({
    # run length, checkpoints, logging, stops
    "resume", "resume_force", "total_training_steps", "save_freq", "keep_last", "log_every", "output_dir",
    "max_consecutive_skips", "max_wall_time_s", "stop_save_budget_s", "save_on_exit", "judge_max_unusable_frac",
    "logger", "wandb_project", "wandb_name", "wandb_entity",
    # validation only (never touches the training batches or the trainer RNG)
    "test_freq", "val_before_train", "num_val_images", "val_max_samples", "val_num_inference_steps", "val_seed",
    # TensorBoard's training-sample grid (rank 0 only; reads the step's samples, changes nothing)
    "rollout_image_freq", "num_rollout_images",
    # where and how fast things run (same objective; float rounding and NFT's noise draws per micro-batch may differ)
    "micro_batch_size", "activation_checkpointing", "cfg_batch", "rollout_devices", "rollout_max_batch_size",
    "rollout_timeout_s", "rollout_startup_timeout_s", "collective_timeout_s", "rollout_threads", "judge_log_freq",
    "base_weights_dtype", "activation_checkpointing_blocks", "rollout_python", "rollout_sync", "reward_overlap",
    "attention_backend", "profile_step", "profile_micro_steps", "fsdp", "compile", "old_from_update",
    # only read at step 0 (a resume restores the adapters) / only steer validation
    "init_adapter", "val_adapter",
    # the reward servers and devices
    "genrm_url", "genrm_device", "genrm_batch_size", "genrm_concurrency", "genrm_timeout_s", "genrm_max_retries",
    "genrm_backoff_s", "genrm_retry_total_s", "allow_negative_reward_weights", "rapidocr_threads", "rapidocr_workers",
    "pickscore_device", "pickscore_cache_dir", "pickscore_batch_size",
})


RESUME_PATHS: dict[str, bool] = {
    "model_path": True, "train_files": True, "val_files": False, "genrm_model_path": True, "pickscore_path": True,
    "pickscore_processor_path": True,
}


CONTENT = "@content"


# Keys left out of the config fingerprint (the default `ignore` of save / load); everything else, including any key
# that is not classified above, is fingerprinted (fail closed).
RESUME_MUTABLE_KEYS: tuple[str, ...] = tuple(sorted(
    RESUME_LOGGED | set(RESUME_PATHS) | {flag + CONTENT for flag, blocks in RESUME_PATHS.items() if not blocks}))


def config_fingerprint(config: Mapping[str, Any], ignore: Iterable[str] = RESUME_MUTABLE_KEYS) -> tuple[str, dict[str, Any]]:
    """(sha256 hex, fingerprinted values): every config key except `ignore`, JSON-normalised (tuples -> lists)."""
    ignore = set(ignore)
    values = {k: config[k] for k in sorted(config) if k not in ignore}
    values = json.loads(json.dumps(values, sort_keys=True, default=str))
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode("utf-8")).hexdigest()
    return digest, values


def logged_values(config: Mapping[str, Any], ignore: Iterable[str]) -> dict[str, Any]:
    """The values of the keys in `ignore` that `config` holds, sorted and made JSON-plain (str for the rest)."""
    ignore = set(ignore)
    values = {k: config[k] for k in sorted(config) if k in ignore}
    return json.loads(json.dumps(values, sort_keys=True, default=str))


def sha256_file(path: str) -> str:
    """sha256 hex of a file, read in 8 MiB chunks (hashlib releases the GIL: `hash_files` runs files in parallel)."""
    digest = hashlib.sha256()
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def hash_files(root: str, rel_paths: Sequence[str]) -> dict[str, str]:
    """{relative path: sha256 hex} of the files `rel_paths` under `root`, up to 8 hashed at once."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(rel_paths)))) as pool:
        return dict(zip(rel_paths, pool.map(lambda rel: sha256_file(os.path.join(root, rel)), rel_paths)))


def _dir_fingerprint(path: str) -> str:
    """One sha256 over a model folder: every file's relative path and size, the full bytes of files up to 1 MiB
    (configs, tokenizers) and the first and last MiB of larger ones (weights: a different checkpoint differs in its
    header and tensors there; hashing 40 GB at every start would cost minutes). Hidden entries are skipped."""
    digest = hashlib.sha256()
    for dirpath, dirnames, files in os.walk(path, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            full = os.path.join(dirpath, name)
            size = os.path.getsize(full)
            digest.update(f"{os.path.relpath(full, path)}\0{size}\0".encode())
            with open(full, "rb") as f:
                if size <= 2 * _SAMPLE:
                    digest.update(f.read())
                else:
                    digest.update(f.read(_SAMPLE))
                    f.seek(size - _SAMPLE)
                    digest.update(f.read(_SAMPLE))
    return digest.hexdigest()


def path_fingerprint(path: str | None) -> str | None:
    """What a path flag points to: "sha256:<hex>" of a file's bytes, "dir:<hex>" of a folder (`_dir_fingerprint`),
    or the string itself when it is not a local path (a Hub id); None stays None."""
    if path is None:
        return None
    local = os.path.expanduser(str(path))
    if os.path.isfile(local):
        return "sha256:" + sha256_file(local)
    if os.path.isdir(local):
        return "dir:" + _dir_fingerprint(local)
    return f"not a local path: {path}"


def content_fingerprints(config: Mapping[str, Any]) -> dict[str, str | None]:
    """{"<flag>@content": path_fingerprint(value)} for every path flag in `config` (`RESUME_PATHS`), so a resume
    checks the data and the models themselves rather than where they live. Model-free; the train parquet is hashed
    in full, model folders as `_dir_fingerprint` says."""
    return {flag + CONTENT: path_fingerprint(config[flag]) for flag in RESUME_PATHS if flag in config}
