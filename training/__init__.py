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

from .distributed import *  # noqa: F401,F403
from .model import *  # noqa: F401,F403
from .optim import *  # noqa: F401,F403
from .data import *  # noqa: F401,F403
from .checkpoint import *  # noqa: F401,F403
from .logs import *  # noqa: F401,F403
from .step import *  # noqa: F401,F403
from .preflight import *  # noqa: F401,F403
from .profiling import *  # noqa: F401,F403
from .run import *  # noqa: F401,F403
from .cli import *  # noqa: F401,F403
from .lifecycle import *  # noqa: F401,F403
from .model import _full  # noqa: F401  (tests use it on DTensors)

__all__ = [name for module in (distributed, model, optim, data, checkpoint, logs, step, preflight,  # noqa: F405
                               profiling, run, cli, lifecycle)
           for name in module.__all__]
