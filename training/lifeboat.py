"""`Lifeboat`: what gets a run's state out when the run does not simply finish, held by `training.run.Run` (the
step). It keeps the run's checkpoints and the lock that guards them: the saves of the step's tail (`checkpoint`,
one due on a skipped step deferred to the next applied one), the last finished step held in rank 0's memory
(`keep_snapshot`) and written at once, with no collective, on a stop signal, a fatal error or the torchrun agent's
death (`write_snapshot`, `on_signal`, `fail_with_checkpoint`, `on_orphaned`); the stop at a step boundary on
SIGTERM / SIGINT / SIGHUP (`lifecycle.StopSignals`) or --max_wall_time_s (`stop_if_asked`); the divergence stop
after --max_consecutive_skips skipped optimizer steps in a row (`note_updates`, `TrainingDiverged`); and rank 0's
run lock of --output_dir (`lifecycle.RunLock`), released by `release_lock`."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from .checkpoint import (CheckpointError, GatheredState, complete_steps, step_dir, find_latest, save_gathered,
                         write_checkpoint)
from .lifecycle import RunLock, StopSignals, say_from_thread
from .model import ADAPTER_DEFAULT, adapter_params
from .optim import GradStepper, local_shard

__all__ = ["Lifeboat", "TrainingDiverged", "FATAL_SAVE_EXCLUDED"]


class TrainingDiverged(RuntimeError):
    """--max_consecutive_skips optimizer steps in a row were non-finite; the message says what to resume from."""


# errors in the state itself: no checkpoint is written from it on the way out (see `Lifeboat.fail_with_checkpoint`)
FATAL_SAVE_EXCLUDED: tuple[type, ...] = (TrainingDiverged, CheckpointError)


@dataclass
class Lifeboat:
    """A run's checkpoints, stops and run lock (see the module docstring). `setup_run` builds it, the `Run` holds it
    and `arm` gives it the run's `gather` and `close` (`close_run`) and installs the stop-signal and orphan
    handlers."""

    args: Any
    rank: int
    world: int
    device: torch.device
    ckpt_root: str                 # <output_dir>/checkpoints
    start_step: int                # the step this process started after (0, or the resumed checkpoint's)
    stepper: GradStepper           # its skip counts drive the divergence stop
    last_update_step: int = 0      # the last step whose update was applied (the divergence advice starts there)
    run_lock: RunLock | None = None        # rank 0: <output_dir>/RUN_LOCK, released by `release_lock`
    stop_signals: StopSignals | None = None  # installed by `arm`
    gather: Callable[[int], GatheredState] | None = None  # `Run.gather`, given by `arm`
    close_run: Callable[[], None] | None = None  # `Run.close`, given by `arm`: run before a stop exits
    last_saved_step: int = -1
    last_checkpoint: str | None = None  # the path `save` wrote last (the end-of-run summary names it)
    save_pending: bool = False     # a checkpoint that fell on a skipped (non-finite) step: written at the next good one
    snapshot: GatheredState | None = None  # rank 0: the last finished (applied) step's state, not yet on disk
    _save_lock: threading.Lock = field(default_factory=threading.Lock)
    _applied_seen: int = 0
    _skipped_seen: int = 0

    def __post_init__(self) -> None:
        self._applied_seen, self._skipped_seen = self.stepper.applied_steps, self.stepper.skipped_steps

    def arm(self, gather: Callable[[int], GatheredState], close_run: Callable[[], None],
            on_orphaned: list[Any]) -> None:
        """Once the run exists: save through `gather` (the state of a finished step, collective), end a stop with
        `close_run`, handle SIGTERM/SIGINT/SIGHUP (`StopSignals`, with the at-once write of the last finished step,
        `on_signal`) and put `self.on_orphaned` into `on_orphaned`, the one-element list of the orphan handler
        (`run.guard_start_up`)."""
        self.gather, self.close_run = gather, close_run
        self.stop_signals = StopSignals(self.rank == 0)
        self.stop_signals.install(on_signal=self.on_signal)
        on_orphaned[0] = self.on_orphaned

    # ----------------------------------------------------------------------------------------- stop at a boundary

    def stop_if_asked(self, done: int, started_at: float) -> None:
        """Collective (one all_reduce): stop after step `done` if any rank got a signal or the wall time is up
        (--max_wall_time_s counted from `started_at`, the training loop's start)."""
        args, now = self.args, time.monotonic()
        signals = self.stop_signals
        signum = signals.signum if signals else 0
        budget = args.stop_save_budget_s
        over_budget = bool(signum and budget > 0 and now - signals.received_at > budget)
        wall = bool(args.max_wall_time_s and args.max_wall_time_s > 0 and done > self.start_step
                    and now - started_at >= args.max_wall_time_s)
        # rank 0's last saved step: a signal may have had the last finished step written at once (`write_snapshot`)
        flags = torch.tensor([float(signum), float(wall), float(over_budget), float(self.last_saved_step)],
                             dtype=torch.float64)
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # CPU tensor: gloo, also in the NCCL+gloo group
        signum, wall, over_budget = int(flags[0]), bool(flags[1]), bool(flags[2])
        self.last_saved_step = int(flags[3])
        if signum or wall:
            self._stop(done, signum, wall, over_budget, started_at)

    def _stop(self, done: int, signum: int, wall: bool, over_budget: bool, started_at: float) -> None:
        """Checkpoint at step `done` (unless it is already saved or SIGTERM's --stop_save_budget_s ran out; when its
        update was skipped, like `checkpoint`'s deferral, the held last good step instead), print one line, close,
        exit: 0 for --max_wall_time_s, 128 + signal number for a signal."""
        args = self.args
        path = None
        saved_already = done <= max(self.start_step, self.last_saved_step)
        skipped = self.stepper.consecutive_skips > 0  # its weights just gave NaN/inf: never ahead of a good one
        if skipped and not over_budget:  # the held last good step instead, if it is not on disk yet (rank 0)
            path = self.write_snapshot(f"the stop at step {done}, whose update was skipped")
            if dist.is_initialized() and self.world > 1:
                dist.barrier()  # the other ranks wait for rank 0's write before they exit
        elif not saved_already and not over_budget:
            path = self.save(done)
        latest = path or (find_latest(self.ckpt_root) if self.rank == 0 else None)
        where = f"--resume auto (checkpoint {latest})" if latest else "--resume auto (no checkpoint yet: step 0)"
        reason = (f"; step {done} not saved: its update was skipped (non-finite)" if skipped and not saved_already
                  else "" if path or saved_already else
                  f"; no checkpoint written: the step ended more than --stop_save_budget_s "
                  f"{args.stop_save_budget_s:g} s after the signal")
        if signum:
            line = f"stopped by {signal.Signals(signum).name} at step {done}{reason}; resume with {where} and the " \
                   f"same flags"
            code = 128 + signum
        else:
            elapsed = time.monotonic() - started_at
            line = (f"stopped at step {done} after {elapsed:.0f} s of training (--max_wall_time_s "
                    f"{args.max_wall_time_s:g}){reason}; continue with {where} and the same flags")
            code = 0
        if self.rank == 0:
            print(line, flush=True)
        self.close_run()
        raise SystemExit(code)

    # ------------------------------------------------------------------------------------- checkpoints, snapshots

    def checkpoint(self, step: int, *, due: bool, skipped: bool, last: bool) -> None:
        """The checkpoint of the tail of step `step`: written when `due` (every --save_freq steps and at the end) or
        one is pending, except after a step whose update was `skipped` (not the `last`): it is deferred to the next
        applied one. Then, unless skipped, the step is held for an at-once write (`keep_snapshot`). Collective."""
        if due or self.save_pending:
            if skipped and not last:  # these weights just gave NaN/inf: do not let them push out a good one
                self.save_pending = True
                if self.rank == 0:
                    print(f"step {step}: checkpoint deferred to the next step whose update is applied", flush=True)
            else:
                self.save(step)
        if not skipped:  # a skipped step's weights just gave NaN/inf: the held state stays the last good one
            self.keep_snapshot(step)

    def save(self, step: int) -> str:
        """Checkpoint `step` (the run's `gather`, then `save_gathered`) and say so on rank 0. Collective."""
        start = time.perf_counter()
        gathered = self.gather(step)
        with self._save_lock:
            path = save_gathered(self.ckpt_root, gathered, keep_last=self.args.keep_last)
            self.last_saved_step, self.save_pending, self.snapshot = step, False, None
            self.last_checkpoint = path
        if self.rank == 0:
            print(f"saved checkpoint {path} ({time.perf_counter() - start:.1f} s)", flush=True)
        return path

    def keep_snapshot(self, step: int) -> None:
        """--save_on_exit last_step: hold finished step `step`'s state in rank 0's memory, so that a signal, a fatal
        judge / rollout error or the torchrun agent's death can write it at once (`write_snapshot`) instead of
        losing the steps since the last checkpoint. Collective (one gather of the LoRA-sized state)."""
        if getattr(self.args, "save_on_exit", "off") != "last_step" or step <= self.last_saved_step:
            return
        gathered = self.gather(step)
        with self._save_lock:
            self.snapshot = gathered if self.rank == 0 else None

    def write_snapshot(self, why: str, lock_timeout_s: float = 600.0) -> str | None:
        """Rank 0, no collective (safe from a helper thread while the main thread is anywhere): write the held
        state of the last finished step unless it is already on disk; print one line saying so and why. Returns
        the checkpoint path (None when there was nothing to write or the write failed, which is printed too)."""
        if self.rank != 0:
            return None
        if not self._save_lock.acquire(timeout=lock_timeout_s):  # the main thread is inside a save of its own
            say_from_thread(f"not saving the last finished step ({why}): a checkpoint save is still in progress",
                            sys.stderr)
            return None
        try:
            snap = self.snapshot
            if snap is None or snap.step <= self.last_saved_step:
                return None
            start = time.perf_counter()
            try:
                path = write_checkpoint(self.ckpt_root, snap, keep_last=self.args.keep_last)
            except Exception as e:  # noqa: BLE001 - reported; the caller goes on with its own way out
                say_from_thread(f"could not save the last finished step {snap.step} ({why}): "
                                f"{type(e).__name__}: {e}", sys.stderr)
                return None
            self.last_saved_step, self.snapshot = snap.step, None
        finally:
            self._save_lock.release()
        say_from_thread(f"saved checkpoint {path} ({time.perf_counter() - start:.1f} s): step {snap.step}, the last "
                        f"finished step, written at once ({why})", sys.stdout)
        return path

    # ------------------------------------------------------------------------------------- the ways out at once

    def on_signal(self, signum: int) -> None:
        """The first stop signal (from the stop-signal thread): write the last finished step now, within the
        launcher's shutdown window, whatever the main thread is doing; it still stops at the end of its step and
        saves that one too if it gets there in time."""
        self.write_snapshot(f"on {signal.Signals(signum).name}")

    def on_orphaned(self, old: int, new: int) -> None:
        """The parent watchdog: the torchrun agent (pid `old`) died, so no one supervises this rank any more. Write
        the last finished step (rank 0), say so, and exit at once; the rank's rollout workers die with it (their
        parent-death signal)."""
        say_from_thread(f"rank {self.rank}: the torchrun agent (pid {old}) died (parent is now {new}): exiting, "
                        "and its rollout workers with it", sys.stderr)
        self.write_snapshot(f"the torchrun agent pid {old} died", lock_timeout_s=30.0)
        os._exit(1)

    def fail_with_checkpoint(self, error: BaseException, what: str, *, agreed: bool = True) -> None:
        """A fatal error (a judge that stays down, a dead rollout worker, a failed collective): write the last
        finished step before the run ends, unless the error is in the state itself (a divergence, a checkpoint
        that cannot be written). `agreed`: every rank raises this error alike, so the others wait for rank 0's
        write (one barrier; torchrun would otherwise kill rank 0 mid-write once they exit); False for an error of
        the collective itself, where a barrier would only time out again. The caller raises `error`."""
        if isinstance(error, FATAL_SAVE_EXCLUDED) or getattr(self.args, "save_on_exit", "off") != "last_step":
            return
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        self.write_snapshot(f"before stopping on the error in {what}: {type(error).__name__}: {first}")
        if agreed and dist.is_initialized() and self.world > 1:
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - the error being raised says more
                pass

    # ----------------------------------------------------------------------------------------- the divergence stop

    def note_updates(self, step: int, transformer: torch.nn.Module) -> bool:
        """After step `step`: note whether its update was applied, report skips, and stop the run (TrainingDiverged,
        on every rank alike, after `close_run`) after --max_consecutive_skips skips in a row. `transformer`: the
        trained model (the divergence message reads its largest LoRA value). Returns whether the step ended
        skipped."""
        stepper, args = self.stepper, self.args
        if stepper.applied_steps > self._applied_seen:
            self.last_update_step = step
        skipped = stepper.skipped_steps - self._skipped_seen
        self._applied_seen, self._skipped_seen = stepper.applied_steps, stepper.skipped_steps
        if skipped and self.rank == 0:
            print(f"step {step}: skipped {skipped} optimizer step(s): {stepper.last_skip_reason}; "
                  f"{stepper.consecutive_skips} in a row (the run stops at --max_consecutive_skips "
                  f"{args.max_consecutive_skips})", flush=True)
        if args.max_consecutive_skips > 0 and stepper.consecutive_skips >= args.max_consecutive_skips:
            message = self.divergence_message(step, transformer)
            self.close_run()
            raise TrainingDiverged(message)
        return stepper.consecutive_skips > 0

    def divergence_message(self, step: int, transformer: torch.nn.Module) -> str:
        """What diverged, where the weights came from and which checkpoint + change to resume with. Collective."""
        args, stepper, update = self.args, self.stepper, self.last_update_step
        largest = torch.zeros((), dtype=torch.float64)
        for _, p in adapter_params(transformer, ADAPTER_DEFAULT):
            local = local_shard(p.detach())
            if local.numel():
                largest = torch.maximum(largest, local.abs().max().double().cpu())
        if dist.is_initialized() and self.world > 1:
            largest = largest.to(self.device)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        lines = [f"training diverged: {stepper.consecutive_skips} optimizer steps in a row were skipped "
                 f"(--max_consecutive_skips {args.max_consecutive_skips}), the last at step {step}: "
                 f"{stepper.last_skip_reason}. Nothing was updated since, and no checkpoint was written from NaN/inf."]
        if update <= 0:
            lines.append(f"No update was ever applied in this run: the starting weights (largest |LoRA value| "
                         f"{float(largest):.3g}) already give NaN/inf; check the model, --precision and the data.")
            return "\n".join(lines)
        lines.append(f"The LoRA weights are finite (largest |value| {float(largest):.3g}) but give NaN/inf; they are "
                     f"the result of the update of step {update}, so the checkpoints from step {update} on hold them.")
        earlier = None
        if self.rank == 0 and os.path.isdir(self.ckpt_root):
            older = [s for s in complete_steps(self.ckpt_root) if s < update]
            earlier = step_dir(self.ckpt_root, older[-1]) if older else None
        smaller = f"{args.lr / 10:g}"
        if earlier:
            lines.append(f"Resume from the last checkpoint before it with a smaller learning rate: --resume {earlier} "
                         f"--lr {smaller} --resume_force (--lr is fingerprinted; --resume_force accepts the change).")
        else:
            lines.append(f"No checkpoint precedes step {update}: start over with a smaller learning rate: --resume "
                         f"never --lr {smaller} (the current checkpoints are moved aside, not deleted).")
        return "\n".join(lines)

    # ------------------------------------------------------------------------------------------------- the run lock

    def release_lock(self) -> None:
        """Release rank 0's run lock of --output_dir (`Run.close`); idempotent."""
        if self.run_lock is not None:
            self.run_lock.release()
            self.run_lock = None
