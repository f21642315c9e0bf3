"""`prepare_resume`: the model-free first look at `<output_dir>/checkpoints` that a trainer runs before it loads
anything: orphans of a killed save removed, `--resume never` (earlier checkpoints moved aside), the checkpoint to
resume verified (an unverifiable latest one falls back to the newest verified earlier one, named) and its config
compared with this run's (`checkpoint.check_resume_config`)."""

from __future__ import annotations

import datetime
import os
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .checkpoint import (CheckpointError, complete_steps, step_dir, load_tensors, checkpoint_on_rank0, read_trainer_state,
                         step_dirs, check_resume_config, clean_orphans, earlier_verified_checkpoint, find_latest,
                         verify_checkpoint)
from .model import ADAPTER_DEFAULT

__all__ = ["ResumePlan", "prepare_resume"]


@dataclass(frozen=True)
class ResumePlan:
    """What `prepare_resume` decided: the checkpoint to load (None: start at step 0), its step, and what it did or
    found (orphans removed, checkpoints moved aside, changed flags) as lines for rank 0 to print."""

    path: str | None
    step: int
    messages: tuple[str, ...] = ()

    @property
    def purge_step(self) -> int:
        """TensorBoard `purge_step`: earlier events at steps >= this are dropped from view (a replayed step is not
        shown twice; a fresh start hides a crashed attempt that never saved)."""
        return self.step + 1 if self.path else 0


def _set_aside(paths: Sequence[str], previous_root: str, label: str) -> str:
    """Move `paths` (those that exist) into a new `<previous_root>/<UTC time>-<label>/`; return that folder."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest = os.path.join(previous_root, f"{stamp}-{label}-{uuid.uuid4().hex[:4]}")
    os.makedirs(dest)
    for path in paths:
        if os.path.lexists(path):
            os.rename(path, os.path.join(dest, os.path.basename(path)))
    return dest


def _prepare_resume_rank0(resume: str, ckpt_root: str, config: Mapping[str, Any], adapter_names: Sequence[str],
                          force: bool, set_aside_with_checkpoints: Sequence[str], previous_root: str) -> ResumePlan:
    messages = clean_orphans(ckpt_root)
    existing = step_dirs(ckpt_root)
    if resume == "never":
        if existing:
            dest = _set_aside([ckpt_root, *set_aside_with_checkpoints], previous_root, "resume-never")
            messages.append(
                f"--resume never: {ckpt_root} held checkpoints (steps {sorted(existing)}); moved them and the earlier "
                f"run's logs aside to {dest} (nothing deleted; remove that folder when it is no longer needed)")
        return ResumePlan(None, 0, tuple(messages))
    if resume == "auto":
        path = find_latest(ckpt_root)
        if path is None:
            return ResumePlan(None, 0, tuple(messages))
    else:
        path = os.path.abspath(resume)
        if not os.path.isdir(path):
            raise CheckpointError(f"--resume {resume}: no such checkpoint directory (complete checkpoints under "
                                  f"{ckpt_root}: {[step_dir(ckpt_root, s) for s in complete_steps(ckpt_root)]})")
    try:
        verify_checkpoint(path)
    except CheckpointError as e:
        earlier = earlier_verified_checkpoint(path)
        advice = (f"\nThe previous complete checkpoint {earlier} verifies: resume from it with --resume {earlier} "
                  f"(the later ones are then moved aside, not deleted)." if earlier else
                  "\nNo earlier complete checkpoint verifies; start a new run with --resume never (the checkpoints are "
                  "moved aside, not deleted).")
        raise CheckpointError(str(e) + advice) from None
    for name in ("optimizer.pt", "rng.pt"):  # a pickle that would run code is refused now, before any model loads
        load_tensors(path, name, mmap=True)
    state = read_trainer_state(path)
    step = int(state["step"])
    messages += check_resume_config(path, state, config, adapter_names=adapter_names, force=force)
    # <ckpt_root> keeps only the history being continued: later step folders (a run that went on past `step`, e.g.
    # a corrupt newest one) would otherwise be picked by the next --resume auto or pushed out by keep_last
    inside = os.path.realpath(os.path.dirname(path)) == os.path.realpath(ckpt_root)
    later = sorted(name for s, name in existing.items() if not inside or s > step)
    if later:
        dest = _set_aside([os.path.join(ckpt_root, name) for name in later], previous_root, f"after-step-{step}")
        messages.append(f"resuming from step {step}: moved the later checkpoint folders {later} (another history) "
                        f"aside to {dest}")
    return ResumePlan(path, step, tuple(messages))


def prepare_resume(resume: str, ckpt_root: str, config: Mapping[str, Any], *,
                   adapter_names: Sequence[str] = (ADAPTER_DEFAULT,), force: bool = False,
                   set_aside_with_checkpoints: Sequence[str] = (), previous_root: str | None = None) -> ResumePlan:
    """Decide `--resume` before any model is loaded. Collective: rank 0 inspects and tidies, every rank gets the
    same plan or raises the same CheckpointError.

    1. orphans of a killed save are removed or restored (`clean_orphans`);
    2. 'never' with checkpoints present: `ckpt_root` and `set_aside_with_checkpoints` (TensorBoard, metadata) are
       moved to `<previous_root>/<time>-resume-never/` (refusing would make re-running a recipe fail, deleting would
       lose a run; moved aside, both stay and the new run's logs start clean);
    3. 'auto' (newest complete) or a directory: every file's sha256 is checked; a corrupt checkpoint is an error that
       names the previous one that verifies and the `--resume DIR` that uses it;
    4. the config is checked (`check_resume_config`, `force` = --resume_force);
    5. step folders after the resumed step (or all, when resuming from another folder) are moved aside.
    """
    previous_root = previous_root or os.path.join(os.path.dirname(os.path.abspath(ckpt_root)), "previous")
    return checkpoint_on_rank0(lambda: _prepare_resume_rank0(resume, ckpt_root, config, adapter_names, force,
                                                   set_aside_with_checkpoints, previous_root))
