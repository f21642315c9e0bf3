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
   rank; `mini_batches` / `micro_batches`, the update's schedule over a step's samples.
5. `resume_policy.py`: which flags a resume may change, the config and content fingerprints that check it;
   `checkpoint.py`: atomic save (temp dir, sha256 manifest written last, rename), `find_latest`, exact
   `load_checkpoint` (weights_only) that refuses a partial or corrupt checkpoint, the layout; `resume.py`:
   `prepare_resume` (model-free: orphans, --resume never, integrity, an earlier verified checkpoint named).
6. `logs.py`: TensorBoard on rank 0, metric accumulation over micro-batches + one all_reduce over ranks, the
   `critic/*` reward/advantage stats, validation keys, image grids, a progress line with ETA, timers, run metadata.
7. `perf.py`: images/s per GPU, model FLOPs and MFU per phase, peak memory; `nft_perf_metrics` /
   `dppo_perf_metrics`, the one call each trainer makes.
8. `flags.py`: the flags both trainers take and their model-free checks (batch sizes, --rollout_policy_lag), and
   the one resolution of the run's CFG scale.
9. `scoring.py`: a rollout's rewards (never of a non-finite sample; `RewardStream` scores chunks while the rollout
   still samples), the judge's reply log, the group advantages over the global batch.
10. `rollouts.py`: one training rollout: the request (n samples per prompt, seeded per global row), its
   submission and collection with the checks of every step (non-finite samples, an empty judge).
11. `adapters.py`: the rollout policy's sync to the workers (PEFT folder or tensors, the bound-module check),
   adapter folders a flag names (`PATH` or `CHECKPOINT:default|old`), --init_adapter.
12. `validation.py`: ODE validation on the test split, one code path for training and scripts/evaluate.py.
13. `preflight.py`: every start-up check that needs no model (flags, image size, every dataset row against the
   rewards, output folder, one judge request), run by `setup_run` before anything loads.
14. `profiling.py`: `ProfileWindow` (a torch.profiler trace of a trainer step up to its first K update
   micro-steps, gzipped, with the settings and trace files of the leaf module `engines/profiler.py`, whose `step_profiler`
   the rollout workers use) and `profile_table`, the pure per-phase table of device busy / idle time, host reads,
   memory copies (and what issued them) and top kernels.
15. `run.py`: `setup_run` / `Run`, the setup both trainers do before their loop and the tail of every step (log,
   validate, checkpoint, the divergence stop), the SIGTERM/SIGINT/SIGHUP and --max_wall_time_s stops at a step boundary,
   the last finished step written at once on a signal, a fatal judge / rollout error or the agent's death, so each
   trainer file holds only its algorithm.
16. `cli.py`: the trainers' command line: a bad flag or a failure is one line on the console (rank 0; "did you
   mean" for a misspelt flag), the traceback goes to `<output_dir>/train.log`.
17. `lifecycle.py`: one live run per --output_dir (an advisory lock file), the parent watchdog of the ranks (no
   orphans when the torchrun agent dies), heartbeats that name a frozen rank.
"""

from __future__ import annotations

# 1. process group, ranks, seeding, collective failure relay
from .distributed import (DistInfo, init_distributed, cleanup_distributed, get_rank, launch_rank, get_world_size,
                          get_local_rank, is_main_process, is_local_main_process, barrier, all_gather_cat,
                          seed_everything, RankFailed, raise_if_any_rank_failed, on_rank0, collective_timeout_s,
                          COLLECTIVE_TIMEOUT_MARGIN_S, scores_http_judge)
# 2. LoRA adapters, activation checkpointing, FSDP2 sharding, adapter tensors
from .model import (ADAPTER_DEFAULT, ADAPTER_OLD, adapter_params, add_lora_adapters, use_adapter,
                    apply_activation_checkpointing, checkpointed_block_indices, mixed_precision_policy,
                    base_weight_dtype, cast_frozen_base_, FSDP_MODES, shard_transformer, ComputeDtypeLinear,
                    place_on_one_rank,
                    prepare_transformer, adapter_state_dict, load_adapter_state_, save_adapter_dir,
                    adapter_config_dict, load_flow_model)
# 3. AdamW, lr schedules, the checked optimizer step, the `old` adapter refresh
from .optim import (build_optimizer, LR_SCHEDULES, lr_multiplier, build_lr_scheduler, lr_scheduler_state,
                    load_lr_scheduler_state_, GradStepper, ema_adapter_, adapters_equal, old_policy_refresh)
# 4. the resumable prompt sampler, the update's mini- and micro-batches
from .data import SamplerBatch, PromptSampler, micro_batches, mini_batches
# 5. the resume policy and its fingerprints; atomic checkpoints and integrity; the model-free resume decision
from .resume_policy import (RESUME_BLOCKING, RESUME_LOGGED, RESUME_PATHS, RESUME_MUTABLE_KEYS, config_fingerprint,
                            content_fingerprints, path_fingerprint, sha256_file)
from .checkpoint import (CheckpointError, read_adapter_dir, read_verified_adapter, adapter_checkpoint, MARKER,
                         CHECKPOINT_FORMAT, library_versions, optimizer_full_state, load_optimizer_full_state_,
                         save_checkpoint, GatheredState, gather_checkpoint, write_checkpoint, save_gathered,
                         find_latest, verify_checkpoint, clean_orphans, check_resume_config, load_checkpoint,
                         unverified_adapter_line, earlier_verified_checkpoint, earlier_adapter_advice,
                         verified_run_config, run_settings, explicit_flags, set_defaults_from_checkpoint,
                         read_run_config)
from .resume import ResumePlan, prepare_resume
# 6. TensorBoard, metric reduction, image grids, timers, run metadata, the console log
from .logs import (TensorBoardLogger, WandbLogger, WandbSetupError, WANDB_RUN_ID_FILE, MetricAccumulator,
                   reward_metrics, validation_metrics, timer, image_grid, sample_caption, rollout_grid, prompt_text,
                   all_gather_objects, gather_first_images, Progress, git_commit, write_run_metadata, tee_console,
                   log_only,
                   log_time, run_summary, LOG_FILE, HelpFormatter, console_log_path, discard_console_log)
# 7. throughput, MFU per phase, peak memory: one call per trainer step
from .perf import (perf_metrics, PEAK_TFLOPS_ENV, device_peak_flops, rollout_device_count, transformer_flops,
                   phase_perf_metrics, nft_perf_metrics, dppo_perf_metrics)
# 8. the shared flags and their model-free checks, the run's CFG scale
from .flags import (add_common_args, resolve_device, resolve_cfg_scale, run_dir_cfg_scale, check_batch_sizes,
                    parse_lora_init, check_rollout_lag, set_defaults_from_model_folder)
# 9. rewards of a rollout (scored while it samples), the judge's reply log, global advantages
from .scoring import (score_inputs, score_samples, nonfinite_rows, score_finite, RewardStream, JUDGE_LOG,
                      JudgeNotReading, JudgeReplyCounts, judge_reply_counts, judge_records, log_judge_replies,
                      append_judge_log,
                      global_advantages)
# 10. one training rollout: request, submission, collection with its checks, the lagged look-ahead
from .rollouts import (rollout_request, submit_rollout, rollout_and_score, log_rollout_images, peek_batch,
                       lag_next_rollout)
# 11. the rollout policy's sync to the workers, adapter folders, --init_adapter
from .adapters import (sync_rollout_adapter, prune_rollout_adapters, clean_rollout_adapters, publish_adapter_tensors,
                       publish_tensors, resolve_adapter_dir, verify_adapter_spec, adapter_arg, init_adapter_mismatch,
                       load_init_adapter)
# 12. validation: in training and in scripts/evaluate.py
from .validation import ValidationOutcome, run_validation, validate
# 13. model-free start-up checks
from .preflight import (PreflightError, run_preflight, check_flags, check_datasets, check_rewards, check_output_dir,
                        probe_judge, rewards_used, check_reward_signs, check_rollout_devices, check_init_adapter,
                        truncated_prompts)
# 14. torch.profiler trace of one trainer step and its per-phase table
from .profiling import (ProfileWindow, PhaseRow, KernelRow, LauncherRow, ProfileTable, profile_table,
                        format_profile_table, PHASE_PREFIX, WINDOW_PHASE, STEP_PHASE)
# 15. setup_run / Run: the setup and the tail of every step
from .run import Run, setup_run, StopSignals, TrainingDiverged, prepare_output_dir, FATAL_SAVE_EXCLUDED
# 16. the trainers' command line
from .cli import ArgumentParser, run_cli, suggest_flags, one_line_error
# 17. run lock, parent watchdog, heartbeats
from .lifecycle import (RUN_LOCK, RunLockError, RunLock, pid_alive, describe_holder, watch_parent, silent_ranks,
                        describe_silent, start_heartbeats, install_collective_explainer, collective_explanation,
                        HEARTBEAT_STALE_S, run_lock_held, STOP_SIGNALS, StoppedBySignal, stop_at_once_on_signals,
                        signal_stop_line, DISK_FULL_ERRNOS, is_disk_full, free_space_text, disk_full_line)

# every public name above, module by module (each module's own __all__)
__all__ = [name for module in (distributed, model, optim, data, resume_policy, checkpoint, resume,  # noqa: F821
                               logs, perf, flags, scoring, rollouts, adapters, validation, preflight, profiling, run,
                               cli, lifecycle)
           for name in module.__all__]
