"""training/lifeboat.py: `Lifeboat`, a run's checkpoints and ways out, without a model or a process group: a
checkpoint due on a skipped step is deferred to the next applied one, the last finished step is held and written at
once (not twice, never from an error in the state itself), a stop at a step boundary saves, closes and exits with
its code, and --max_consecutive_skips skips in a row end the run with `TrainingDiverged`. The whole-trainer stops
are in tests/test_lifecycle.py and tests/test_resume_faults.py (slow)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

import training.lifeboat as lifeboat_module
from training.checkpoint import CheckpointError, step_dir
from training.lifeboat import Lifeboat, TrainingDiverged


def make_boat(tmp_path, monkeypatch, **flags):
    """A rank-0 Lifeboat whose `gather` returns a stand-in state and whose writes are recorded, not done."""
    args = argparse.Namespace(keep_last=None, save_on_exit="last_step", max_consecutive_skips=2, lr=1e-3,
                              stop_save_budget_s=0.0, max_wall_time_s=0.0, **flags)
    stepper = SimpleNamespace(applied_steps=0, skipped_steps=0, consecutive_skips=0, last_skip_reason="")
    boat = Lifeboat(args, rank=0, world=1, device=torch.device("cpu"), ckpt_root=str(tmp_path / "checkpoints"),
                    start_step=0, stepper=stepper)
    written: list[tuple[str, int]] = []
    closed: list[bool] = []

    def save(root, gathered, keep_last=None):
        written.append(("save", gathered.step))
        return step_dir(root, gathered.step)

    def write(root, gathered, keep_last=None):
        written.append(("at_once", gathered.step))
        return step_dir(root, gathered.step)

    monkeypatch.setattr(lifeboat_module, "save_gathered", save)
    monkeypatch.setattr(lifeboat_module, "write_checkpoint", write)
    boat.gather, boat.close_run = (lambda step: SimpleNamespace(step=step)), (lambda: closed.append(True))
    return boat, stepper, written, closed


def test_a_checkpoint_due_on_a_skipped_step_waits_for_the_next_applied_one(tmp_path, monkeypatch):
    boat, _, written, _ = make_boat(tmp_path, monkeypatch)
    boat.checkpoint(1, due=True, skipped=True, last=False)
    assert written == [] and boat.save_pending and boat.snapshot is None
    boat.checkpoint(2, due=False, skipped=False, last=False)  # the pending one, at the next applied step
    assert written == [("save", 2)] and not boat.save_pending and boat.last_saved_step == 2
    assert boat.last_checkpoint.endswith("step_00000002") and boat.snapshot is None  # already on disk
    boat.checkpoint(3, due=True, skipped=True, last=True)  # the last step is saved, skipped or not
    assert written[-1] == ("save", 3)


def test_the_last_finished_step_is_held_and_written_at_once_only_once(tmp_path, monkeypatch):
    boat, _, written, _ = make_boat(tmp_path, monkeypatch)
    boat.checkpoint(1, due=False, skipped=False, last=False)
    assert boat.snapshot.step == 1 and written == []
    boat.checkpoint(2, due=False, skipped=True, last=False)  # NaN/inf weights: the held state stays step 1
    assert boat.snapshot.step == 1
    boat.on_signal(15)
    assert written == [("at_once", 1)] and boat.last_saved_step == 1 and boat.snapshot is None
    assert boat.write_snapshot("again") is None and written == [("at_once", 1)]


def test_a_fatal_error_writes_the_held_step_unless_the_state_itself_is_wrong(tmp_path, monkeypatch):
    boat, _, written, _ = make_boat(tmp_path, monkeypatch)
    boat.checkpoint(1, due=False, skipped=False, last=False)
    for error in (TrainingDiverged("diverged"), CheckpointError("cannot write")):
        boat.fail_with_checkpoint(error, "the rollout of step 2")
    assert written == []
    boat.fail_with_checkpoint(RuntimeError("the judge stays down"), "the rollout of step 2")
    assert written == [("at_once", 1)]


@pytest.mark.parametrize("signum, code", [(0, 0), (2, 130), (15, 143)])
def test_a_stop_at_a_step_boundary_saves_closes_and_exits_with_its_code(tmp_path, monkeypatch, capsys, signum, code):
    boat, _, written, closed = make_boat(tmp_path, monkeypatch)
    if signum:
        boat.stop_signals = SimpleNamespace(signum=signum, received_at=0.0)
    else:
        boat.args.max_wall_time_s = 1e-9
    with pytest.raises(SystemExit) as stop:
        boat.stop_if_asked(3, started_at=0.0)
    assert stop.value.code == code and closed == [True] and written == [("save", 3)]
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("stopped by SIG" if signum else "stopped at step 3 after")
    assert "--resume auto (checkpoint " in line


@pytest.mark.parametrize("signum", [0, 15])
def test_a_stop_after_a_skipped_update_does_not_save_that_step(tmp_path, monkeypatch, capsys, signum):
    """Like a due checkpoint, a stop's does not write weights that just gave NaN/inf: with --keep_last they could
    push out the last good checkpoint."""
    boat, stepper, written, closed = make_boat(tmp_path, monkeypatch)
    boat.checkpoint(2, due=False, skipped=False, last=False)  # step 2 applied: held (--save_on_exit last_step)
    stepper.consecutive_skips = 1
    if signum:
        boat.stop_signals = SimpleNamespace(signum=signum, received_at=0.0)
    else:
        boat.args.max_wall_time_s = 1e-9
    with pytest.raises(SystemExit):
        boat.stop_if_asked(3, started_at=0.0)
    assert written == [("at_once", 2)] and closed == [True]  # the held good step, not step 3
    out = capsys.readouterr().out
    assert "step 3 not saved: its update was skipped (non-finite)" in out and "step_00000002" in out


def test_no_stop_asked_runs_on(tmp_path, monkeypatch):
    boat, _, written, closed = make_boat(tmp_path, monkeypatch)
    boat.stop_if_asked(3, started_at=0.0)
    assert written == [] and closed == []


def test_consecutive_skips_end_the_run_with_training_diverged(tmp_path, monkeypatch, capsys):
    boat, stepper, _, closed = make_boat(tmp_path, monkeypatch)
    stepper.applied_steps = 1
    assert boat.note_updates(1, torch.nn.Linear(2, 2)) is False and boat.last_update_step == 1
    stepper.skipped_steps = stepper.consecutive_skips = 1
    stepper.last_skip_reason = "non-finite loss"
    assert boat.note_updates(2, torch.nn.Linear(2, 2)) is True and boat.last_update_step == 1
    assert "step 2: skipped 1 optimizer step(s): non-finite loss; 1 in a row" in capsys.readouterr().out
    stepper.skipped_steps = stepper.consecutive_skips = 2
    with pytest.raises(TrainingDiverged) as diverged:
        boat.note_updates(3, torch.nn.Linear(2, 2))
    assert closed == [True]
    assert "2 optimizer steps in a row were skipped" in str(diverged.value)
    assert "the result of the update of step 1" in str(diverged.value)
    assert "--resume never --lr 0.0001" in str(diverged.value)  # no checkpoint precedes step 1
