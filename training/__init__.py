"""Shared training plumbing for `train_nft.py` and `train_dppo.py`: one implementation of each piece, no framework.

The package exports only what the two trainers and the user scripts (`scripts/sample.py`, `scripts/evaluate.py`,
`scripts/export_adapter.py`) call, as `import training as T` then `T.name` (at most 40 names, checked by
tests/test_architecture.py). Everything else is imported from the module that defines it, e.g.
`from training.optim import GradStepper`. One module per section, read in this order:

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
   rank; `mini_batches` / `micro_batches`, the update's schedule over a step's samples, and `micro_steps`, the
   update loop's one iterator over it (mini-batch, micro-batch, timestep / stored step, whether the optimizer steps).
5. `resume_policy.py`: which flags a resume may change, the config and content fingerprints that check it;
   `checkpoint.py`: atomic save (temp dir, sha256 manifest written last, rename), `find_latest`, exact
   `load_checkpoint` (weights_only) that refuses a partial or corrupt checkpoint, the layout; `resume.py`:
   `prepare_resume` (model-free: orphans, --resume never, integrity, an earlier verified checkpoint named).
   `run_settings.py`: a run's flags (from its verified checkpoint) as the after-training scripts' defaults.
6. `logs.py`: TensorBoard on rank 0, metric accumulation over micro-batches + one all_reduce over ranks, the
   `critic/*` reward/advantage stats, validation keys, image grids, a progress line with ETA, timers, run metadata.
   `console.py`: the console log file <output_dir>/train.log (held until the run lock is held; a full disk never
   breaks the run).
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
15. `run.py`: `setup_run` (one named phase per line) / `Run`, the setup both trainers do before their loop and the
   tail of every step (log, validate, checkpoint), so each trainer file holds only its algorithm. `lifeboat.py`:
   the `Lifeboat` a `Run` holds: its checkpoints, the stops at a step boundary on a signal or --max_wall_time_s,
   the last finished step written at once on a signal, a fatal judge / rollout error or the agent's death, the
   divergence stop (`TrainingDiverged`) and the release of the run lock.
16. `cli.py`: the trainers' command line: a bad flag or a failure is one line on the console (rank 0; "did you
   mean" for a misspelt flag), the traceback goes to `<output_dir>/train.log`.
17. `lifecycle.py`: one live run per --output_dir (an advisory lock file), the parent watchdog of the ranks (no
   orphans when the torchrun agent dies), heartbeats that name a frozen rank, the stop signals (`StopSignals`).
"""

from __future__ import annotations

# 1. process group
from .distributed import init_distributed, cleanup_distributed
# 2. the named LoRA adapters and the switch between them
from .model import ADAPTER_DEFAULT, ADAPTER_OLD, use_adapter
# 3. the `old` adapter refresh
from .optim import adapters_equal, old_policy_refresh
# 4. the update's micro-batches and micro-steps
from .data import micro_batches, micro_steps
# 5. checkpoint errors, adapter provenance, a run's flags as the scripts' defaults
from .checkpoint import CheckpointError, unverified_adapter_line
from .run_settings import set_defaults_from_checkpoint
# 6. metric accumulation, timers, image grids, gathers over ranks, the help formatter
from .logs import (MetricAccumulator, timer, image_grid, prompt_text, all_gather_objects, gather_first_images,
                   HelpFormatter)
# 7. one perf call per trainer step
from .perf import nft_perf_metrics, dppo_perf_metrics
# 8. the shared flags and their model-free checks, the run's CFG scale
from .flags import (add_common_args, resolve_device, run_dir_cfg_scale, check_rollout_lag,
                    set_defaults_from_model_folder)
# 9. global advantages
from .scoring import global_advantages
# 10. one training rollout: request, submission, collection with its checks, the lagged look-ahead
from .rollouts import rollout_request, submit_rollout, rollout_and_score, peek_batch, lag_next_rollout
# 11. adapter folders a flag names
from .adapters import verify_adapter_spec, adapter_arg
# 12. validation: in training and in scripts/evaluate.py
from .validation import run_validation
# 15. the setup and the tail of every step
from .run import setup_run
# 16. the trainers' command line
from .cli import ArgumentParser, run_cli

# what train_nft.py, train_dppo.py, scripts/sample.py, scripts/evaluate.py and scripts/export_adapter.py call
__all__ = [
    "init_distributed", "cleanup_distributed",
    "ADAPTER_DEFAULT", "ADAPTER_OLD", "use_adapter",
    "adapters_equal", "old_policy_refresh",
    "micro_batches", "micro_steps",
    "CheckpointError", "unverified_adapter_line", "set_defaults_from_checkpoint",
    "MetricAccumulator", "timer", "image_grid", "prompt_text", "all_gather_objects", "gather_first_images",
    "HelpFormatter",
    "nft_perf_metrics", "dppo_perf_metrics",
    "add_common_args", "resolve_device", "run_dir_cfg_scale", "check_rollout_lag", "set_defaults_from_model_folder",
    "global_advantages",
    "rollout_request", "submit_rollout", "rollout_and_score", "peek_batch", "lag_next_rollout",
    "verify_adapter_spec", "adapter_arg",
    "run_validation",
    "setup_run",
    "ArgumentParser", "run_cli",
]
