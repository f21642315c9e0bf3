"""The project's torch.profiler settings and its trace files: a leaf (imports torch only, no project module), so
both the rollout workers (`engines/worker.py`) and the trainer's profiling (`training/profiling.py`) import it
without an arrow up from the rollout layers into `training/`.

`step_profiler` records one step of a loop (wait / warmup / active schedule) and writes it as gzipped Chrome-trace
JSON; the rollout workers record their generate call with it. `new_profiler` holds the settings every profile of
the project uses (CPU + CUDA activities, no shapes, no stacks, no memory: a small trace); `export_trace` /
`load_trace` write and read the gzipped trace files.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from typing import Any

import torch

__all__ = ["step_profiler", "new_profiler", "export_trace", "load_trace"]


def step_profiler(path: str, *, step: int, first_step: int, cuda: bool) -> torch.profiler.profile:
    """A (not yet started) profiler that records iteration `step` of a loop whose first iteration is `first_step`,
    with one warm-up iteration before it when there is one; call `.step()` after every iteration. The trace is
    written to `path` (gzipped Chrome JSON) when the step ends. Activities: CPU, plus CUDA when `cuda`."""
    if step < first_step:
        raise ValueError(f"profile step {step} comes before the loop's first step {first_step}")
    warmup = 1 if step > first_step else 0
    return new_profiler(cuda, schedule=torch.profiler.schedule(wait=step - first_step - warmup, warmup=warmup,
                                                               active=1, repeat=1),
                        on_trace_ready=lambda prof: export_trace(prof, path))


def new_profiler(cuda: bool, **kwargs: Any) -> torch.profiler.profile:
    """The project's profiler settings: CPU (+ CUDA when `cuda`) activities, no shapes, memory or stacks."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    return torch.profiler.profile(activities=activities, record_shapes=False, profile_memory=False, with_stack=False,
                                  **kwargs)


def export_trace(prof: torch.profiler.profile, path: str) -> None:
    """Write `prof`'s Chrome trace to `path` gzipped (exported to a plain file first, then compressed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    plain = path[:-3] if path.endswith(".gz") else path + ".plain"
    prof.export_chrome_trace(plain)
    with open(plain, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(plain)


def load_trace(path: str) -> list[dict[str, Any]]:
    """The `traceEvents` of a Chrome trace file (gzipped or not)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return list(data["traceEvents"] if isinstance(data, dict) else data)
