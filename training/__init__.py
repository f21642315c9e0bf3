"""Shared training plumbing for `train_nft.py` and `train_dppo.py`: one implementation of each piece, no framework.

One module per section, read in this order (`import training as T` gives every public name):

1. `distributed.py`: `init_distributed` (torchrun env vars; NCCL on GPU, gloo on CPU; a 1-process group without
   torchrun), rank helpers, `seed_everything`, node-local rank 0 (the rollout group is started once per node).
2. `model.py`: LoRA through `models/lora.py` (peft) with named adapters ("default" trained, "old" for
   DiffusionNFT), adapter switching that never leaks `requires_grad`, composable activation checkpointing (module
   names stay unchanged), FSDP2 `fully_shard` per transformer block + the root with a `MixedPrecisionPolicy`, and
   the DTensor-aware gather / load of adapter tensors that checkpoints and rollout weight sync need.
3. `optim.py`: AdamW over the "default" LoRA params (fused on CUDA), grad-norm clipping on FSDP2 DTensor grads, a
   non-finite loss, grad norm or updated parameter skips the step on every rank (undone, counted, logged); the
   DiffusionNFT `old` adapter copy / EMA refresh.
4. `data.py`: `PromptSampler`, a resumable, deterministic, epoch-shuffled sampler of prompt indices, sharded per
   rank.
5. `checkpoint.py`: atomic save (temp dir, sha256 manifest written last, rename), `find_latest`, exact
   `load_checkpoint` (weights_only) that refuses a partial or corrupt checkpoint; the resume policy (which flags may
   change, content fingerprints) and `prepare_resume` (model-free: orphans, --resume never, integrity); the layout.
6. `logs.py`: TensorBoard on rank 0, metric accumulation over micro-batches + one all_reduce over ranks, the
   `critic/*` reward/advantage stats, validation keys, image grids, a progress line with ETA, timers, run metadata.
7. `step.py`: the parts of an online RL step both trainers share: flags, rollout requests, rewards, global
   advantages, validation, the adapter sync to the rollout workers (with its bound-module check).
8. `preflight.py`: every start-up check that needs no model (flags, image size, every dataset row against the
   rewards, output folder, one judge request), run by `setup_run` before anything loads.
9. `profiling.py`: `step_profiler` (a torch.profiler trace of one step, gzipped) and `profile_table`, the pure
   per-phase table of device busy / idle time, host reads and top kernels read from such a trace.
10. `run.py`: `setup_run` / `Run`, the setup both trainers do before their loop and the tail of every step (log,
   validate, checkpoint, the divergence stop), the SIGTERM/SIGINT and --max_wall_time_s stops at a step boundary,
   the last finished step written at once on a signal, a fatal judge / rollout error or the agent's death, so each
   trainer file holds only its algorithm.
11. `cli.py`: the trainers' command line: a bad flag or a failure is one line on the console (rank 0; "did you
   mean" for a misspelt flag), the traceback goes to `<output_dir>/train.log`.
12. `lifecycle.py`: one live run per --output_dir (an advisory lock file), the parent watchdog of the ranks (no
   orphans when the torchrun agent dies), heartbeats that name a frozen rank.
"""

from __future__ import annotations

# 1. process group, ranks, seeding, collective failure relay
from .distributed import (DistInfo, init_distributed, cleanup_distributed, get_rank, launch_rank, get_world_size,
                          get_local_rank, is_main_process, is_local_main_process, barrier, all_gather_cat,
                          seed_everything, RankFailed, raise_if_any_rank_failed, on_rank0, collective_timeout_s,
                          COLLECTIVE_TIMEOUT_MARGIN_S)
# 2. LoRA adapters, activation checkpointing, FSDP2 sharding, adapter tensors (`_full`: not public, tests use it)
from .model import (ADAPTER_DEFAULT, ADAPTER_OLD, adapter_params, add_lora_adapters, use_adapter, transformer_blocks,
                    apply_activation_checkpointing, checkpointed_block_indices, mixed_precision_policy,
                    base_weight_dtype, cast_frozen_base_, shard_transformer, prepare_transformer, adapter_state_dict,
                    load_adapter_state_, save_adapter_dir, adapter_config_dict, _full)
# 3. AdamW, lr schedules, the checked optimizer step, the `old` adapter refresh
from .optim import (build_optimizer, LR_SCHEDULES, lr_multiplier, build_lr_scheduler, lr_scheduler_state,
                    load_lr_scheduler_state_, GradStepper, ema_adapter_, old_policy_refresh)
# 4. the resumable prompt sampler
from .data import SamplerBatch, PromptSampler
# 5. atomic checkpoints, resume policy and integrity
from .checkpoint import (CheckpointError, read_adapter_dir, read_verified_adapter, adapter_checkpoint, MARKER,
                         CHECKPOINT_FORMAT, RESUME_BLOCKING, RESUME_LOGGED, RESUME_PATHS, RESUME_MUTABLE_KEYS,
                         config_fingerprint, content_fingerprints, path_fingerprint, sha256_file, library_versions,
                         optimizer_full_state, load_optimizer_full_state_, save_checkpoint, GatheredState,
                         gather_checkpoint, write_checkpoint, save_gathered, find_latest, verify_checkpoint,
                         clean_orphans, check_resume_config, ResumePlan, prepare_resume, load_checkpoint)
# 6. TensorBoard, metric reduction, image grids, timers, run metadata, the console log
from .logs import (TensorBoardLogger, MetricAccumulator, reward_metrics, validation_metrics, perf_metrics, timer,
                   image_grid, sample_caption, rollout_grid, prompt_text, all_gather_objects, gather_first_images,
                   Progress, git_commit, write_run_metadata, read_run_config, set_defaults_from_run, tee_console,
                   log_only, log_time, run_summary, LOG_FILE, HelpFormatter, PEAK_TFLOPS_ENV, device_peak_flops,
                   rollout_device_count, transformer_flops, phase_perf_metrics)
# 7. flags, rollout requests, rewards, advantages, validation, adapter sync
from .step import (add_common_args, resolve_device, guidance_of, guidance_for, rollout_request, score_samples,
                   global_advantages, sync_rollout_adapter, parse_lora_init, load_flow_model, check_batch_sizes,
                   resolve_adapter_dir, adapter_arg, verify_adapter_spec, init_adapter_mismatch, load_init_adapter,
                   ValidationOutcome, run_validation, validate, prune_rollout_adapters, clean_rollout_adapters,
                   score_inputs, RewardStream, rollout_and_score, submit_rollout, peek_batch, lag_next_rollout,
                   check_rollout_lag, publish_adapter_tensors, publish_tensors, JUDGE_LOG, judge_records,
                   log_judge_replies, nonfinite_rows, score_finite, JudgeRepliesEmpty, empty_reply_counts)
# 8. model-free start-up checks
from .preflight import (PreflightError, run_preflight, check_flags, check_datasets, check_rewards, check_output_dir,
                        probe_judge, rewards_used, check_reward_signs, check_rollout_devices, check_init_adapter,
                        truncated_prompts)
# 9. torch.profiler trace of one step and its per-phase table
from .profiling import (step_profiler, export_trace, load_trace, PhaseRow, KernelRow, ProfileTable, profile_table,
                        format_profile_table, PHASE_PREFIX)
# 10. setup_run / Run: the setup and the tail of every step
from .run import Run, setup_run, StopSignals, TrainingDiverged, prepare_output_dir, FATAL_SAVE_EXCLUDED
# 11. the trainers' command line
from .cli import ArgumentParser, run_cli, suggest_flags, one_line_error
# 12. run lock, parent watchdog, heartbeats
from .lifecycle import (RUN_LOCK, RunLockError, RunLock, pid_alive, describe_holder, watch_parent, silent_ranks,
                        describe_silent, start_heartbeats, install_collective_explainer, collective_explanation,
                        HEARTBEAT_STALE_S)

# every public name above, module by module (each module's own __all__)
__all__ = [name for module in (distributed, model, optim, data, checkpoint, logs, step, preflight,  # noqa: F821
                               profiling, run, cli, lifecycle)
           for name in module.__all__]
