"""How a run ends when something outside it stops it, through the real trainer command line (CPU, the tiny Qwen-Image,
one rank): a stop signal during the start-up (one line, exit status 128 + the signal number, no traceback, also as a
rank under scripts/torchrun.py), a full disk (one line naming the disk, its free space and how to continue; no
traceback storm, no "Error in sys.excepthook", no advice about permissions), and a step whose samples all came back
non-finite (its reward mean is NaN in TensorBoard and `n/a` on the console, never a 0.0 that charts as a jump).
The component checks are fast; the whole-trainer ones are marked slow."""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from training.distributed import RankFailed
from training.console import log_only, tee_console
from training.logs import Progress, reward_metrics
from test_trainers import REPO, cli, demo_data, free_port  # noqa: F401 (fixture)
from trainer_runs import scalars


def flags(tiny_models, demo_data, out, **extra) -> list[str]:  # noqa: F811
    return cli(**{"model_path": os.path.join(tiny_models, "qwen_image"), "train_files": demo_data["qwen_image"] /
                  "train.parquet", "lr": 1e-2, "output_dir": out, "resume": "auto", **extra})


def trainer_command(script: str, argv: list[str]) -> list[str]:
    """The trainer started the plainest way: `python train_*.py FLAGS` (one process, no torchrun)."""
    return [sys.executable, os.path.join(REPO, script), *map(str, argv)]


def trainer_env() -> dict[str, str]:
    inherited = [p for p in [os.environ.get("PYTHONPATH")] if p]
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, *inherited]))


def signal_at(command: list[str], needle: str, sig: int, *, target=None, timeout: float = 300) -> tuple[int, str]:
    """Start `command` (its own session, stdout and stderr merged), send `sig` once a line contains `needle` (to the
    process, or to `target(pid)`), return (exit status, output)."""
    proc = subprocess.Popen(command, cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if needle in line:
                os.kill(target(proc.pid) if target else proc.pid, sig)
                break
        lines += proc.stdout.readlines()
        return proc.wait(timeout=timeout), "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rank_of(agent: int) -> int:
    """The one trainer rank among the torchrun agent's children."""
    with open(f"/proc/{agent}/task/{agent}/children") as f:
        (pid,) = [int(c) for c in f.read().split()]
    return pid


# ------------------------------------------------------------------------------------------------------------------
# Components (fast)
# ------------------------------------------------------------------------------------------------------------------


def test_a_full_disk_is_recognised_in_every_form_it_reaches_the_report(tmp_path):
    """ENOSPC / EDQUOT raised, chained, relayed from another rank as text, and torch's short write all read as a
    full disk, named with its free space and how to continue; any other error does not."""
    from training.lifecycle import disk_full_line, is_disk_full

    enospc = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt" / "optimizer.pt"))
    try:
        try:
            raise enospc
        except OSError as e:
            raise RuntimeError("save failed") from e
    except RuntimeError as e:
        chained = e
    for error in (enospc, chained, OSError(errno.EDQUOT, "Disk quota exceeded"),
                  RankFailed("save_checkpoint(x) failed on rank 0: OSError: [Errno 28] No space left on device"),
                  RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 53312 vs 53204")):
        assert is_disk_full(error), error
    line = disk_full_line(chained, "/nonexistent")
    assert line.startswith(f"the disk of {tmp_path} is full (no space left on device; ")  # the file's existing folder
    assert re.search(r"; [\d.]+ [KMGT]?B free\)", line) and line.endswith("--resume auto and the same flags")
    assert disk_full_line(OSError(errno.EACCES, "Permission denied"), str(tmp_path)) is None
    assert disk_full_line(ValueError("bad value"), str(tmp_path)) is None


def test_the_console_log_survives_a_full_disk(tmp_path, monkeypatch, capsys):
    """train.log on a full disk: one warning on the console, every later line still on the console, and the error
    report (`log_only`) says there is no log instead of raising (before: `Error in sys.excepthook`)."""
    import training.console as console

    class FullDisk:
        name = str(tmp_path / "train.log")

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        flush = close = lambda self: None

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after the test, whatever tee_console installs
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    monkeypatch.setattr(console, "launch_rank", lambda: 0)
    monkeypatch.setattr(console, "open", lambda *a, **kw: FullDisk(), raising=False)
    tee_console(str(tmp_path))
    print("step 1/2 | after the disk filled up")
    print("step 2/2 | still on the console")
    assert log_only("Traceback (most recent call last): ...") is None
    captured = capsys.readouterr()
    assert "step 1/2 | after the disk filled up\nstep 2/2 | still on the console\n" in captured.out
    warnings = [line for line in captured.err.splitlines() if "WARNING: the console log" in line]
    assert len(warnings) == 1 and "cannot be written any more (its disk is full (" in warnings[0], captured.err


def test_the_start_up_stop_is_one_line_naming_the_signal():
    from training.lifecycle import StoppedBySignal, signal_stop_line

    assert signal_stop_line(signal.SIGHUP) == ("stopped by SIGHUP during the start-up, before any step ran (nothing "
                                               "to save); start it again with --resume auto and the same flags")
    assert not issubclass(StoppedBySignal, Exception)  # no `except Exception` on the way swallows it


def test_reward_stats_are_over_the_scored_samples_and_nan_without_any():
    """A non-finite sample's reward is NaN (`score_finite`): the stats leave it out, and with none scored they are
    NaN, printed `n/a` on the console."""
    uids = [0, 0, 1, 1]
    nan = float("nan")
    out = reward_metrics(torch.tensor([1.0, 3.0, nan, nan]), uids)
    assert out["critic/rewards/mean"] == 2.0 and out["critic/rewards/min"] == 1.0  # the unscored samples left out
    none = reward_metrics(torch.tensor([nan] * 4), uids)
    assert all(math.isnan(none[f"critic/rewards/{k}"]) for k in ("mean", "max", "min", "std_mean", "zero_std_ratio"))
    assert Progress(3).line(2, 1.0, none).endswith("| rewards/mean n/a")
    assert Progress(3).line(2, 1.0, out).endswith("| rewards/mean 2")


# ------------------------------------------------------------------------------------------------------------------
# Whole trainers (CPU, tiny Qwen-Image 64², one rank): slow
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_signal_during_the_start_up_is_one_line_and_exit_128_plus_the_signal(
        demo_data, tiny_models, tmp_path, sig):  # noqa: F811
    """A Ctrl-C (or a scheduler's SIGTERM, a closed terminal's SIGHUP) while the model loads: before, 117 lines of
    KeyboardInterrupt traceback and death by the signal (SIGTERM, SIGHUP: not a word). Now one line naming the
    signal and how to continue, exit status 128 + its number, the line in train.log and the run lock left empty.
    Slow: one trainer start-up (~15 s) per signal."""
    out = tmp_path / "run"
    signum = getattr(signal, sig)
    code, output = signal_at(trainer_command("train_dppo.py", flags(tiny_models, demo_data, out)),
                             "loading the transformer", signum)
    line = (f"stopped by {sig} during the start-up, before any step ran (nothing to save); start it again with "
            f"--resume auto and the same flags")
    assert code == 128 + signum, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert output.splitlines()[-1] == line, output[-3000:]
    assert output.count("stopped by") == 1
    assert line in (out / "train.log").read_text()
    assert (out / "RUN_LOCK").read_text() == ""  # released: the next run has nothing to take over


@pytest.mark.slow
def test_a_rank_stopped_during_the_start_up_exits_143_under_torchrun(demo_data, tiny_models, tmp_path):  # noqa: F811
    """SIGTERM to the trainer rank under scripts/torchrun.py (a scheduler that signals the ranks): the rank's one
    line, then torchrun's, and the launch exits 143 (128 + SIGTERM), not 1; no traceback. Slow (~20 s)."""
    out = tmp_path / "run"
    command = [sys.executable, os.path.join(REPO, "scripts", "torchrun.py"), "--nproc_per_node", "1",
               "--master_port", str(free_port()), os.path.join(REPO, "train_dppo.py"),
               *map(str, flags(tiny_models, demo_data, out))]
    code, output = signal_at(command, "loading the transformer", signal.SIGTERM, target=rank_of)
    assert code == 143, output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-3000:]
    assert "stopped by SIGTERM during the start-up, before any step ran" in output
    assert "with exit code 143" in output  # scripts/torchrun.py's line names the rank's own status


def can_mount_tmpfs() -> bool:
    """Whether `unshare -rm` can give a process its own small tmpfs (a user + mount namespace)."""
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def on_small_disk(out, size_kb: int, argv: list[str], *, fill: bool = False) -> subprocess.CompletedProcess:
    """Run `argv` with `out` on a tmpfs of `size_kb` KB of its own (filled up first with `fill`)."""
    out.mkdir(parents=True, exist_ok=True)
    fill_cmd = f'dd if=/dev/zero of="{out}/filler" bs=4k >/dev/null 2>&1; ' if fill else ""
    script = f'mount -t tmpfs -o size={size_kb}k tmpfs "{out}" && {fill_cmd}exec "$@"'
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *map(str, argv)], cwd=REPO, env=trainer_env(),
                          capture_output=True, text=True, timeout=600)


def assert_one_disk_full_line(proc: subprocess.CompletedProcess, where: str) -> str:
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console[-3000:]
    assert "Traceback" not in console and "Error in sys.excepthook" not in console, console[-3000:]
    assert "permissions" not in console, console[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert re.search(rf"the disk of {re.escape(where)} is full \(no space left on device; [\d.]+ [KMGT]?B free\): "
                     r".*free space there .*then continue with --resume auto and the same flags", errors[0]), errors[0]
    return errors[0]


@pytest.mark.slow
def test_a_full_disk_is_one_line_naming_it(demo_data, tiny_models, tmp_path):  # noqa: F811
    """--output_dir on a disk that is full from the start, then on one where the first checkpoint does not fit:
    before, 47-98 lines, `Error in sys.excepthook`, and advice to fix permissions (or torch's `unexpected pos`);
    now one line naming the disk, its free space and how to continue, exit status 1. Slow: a preflight and a
    one-step run (~40 s)."""
    if not can_mount_tmpfs():
        pytest.skip("needs `unshare -rm` (user + mount namespaces) for a small tmpfs of the run's own")
    full = tmp_path / "full"
    proc = on_small_disk(full, 64, trainer_command("train_dppo.py", flags(tiny_models, demo_data, full)), fill=True)
    line = assert_one_disk_full_line(proc, str(full))
    assert line.startswith(f"error: PreflightError: --output_dir {full}: the disk of {full} is full")
    small = tmp_path / "small"  # the start-up's files fit, the first checkpoint (~180 KB) does not
    proc = on_small_disk(small, 128, trainer_command("train_dppo.py", flags(tiny_models, demo_data, small,
                                                                            save_freq=1)))
    assert "step 1/1" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_one_disk_full_line(proc, str(small))


@pytest.mark.slow
def test_a_step_whose_samples_were_all_non_finite_logs_no_reward_mean(demo_data, tiny_models, tmp_path):  # noqa: F811
    """--lr 1e8: step 1's update makes every sample of step 2 non-finite (never scored, the update skipped). Its
    reward mean was logged 0.0 (and printed `rewards/mean 0`), a jump up where the policy broke; now NaN, a gap in
    TensorBoard, and `n/a` on the console. Slow: a two-step run (~30 s)."""
    out = tmp_path / "run"
    proc = subprocess.run(trainer_command("train_dppo.py", flags(tiny_models, demo_data, out, lr=1e8,
                                                                 total_training_steps=2, max_consecutive_skips=0)),
                          cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 2: 4 rollout sample(s) came back non-finite" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"^step 2/2 \| .* \| rewards/mean n/a \|", proc.stdout, re.M), proc.stdout[-3000:]
    logged = dict(scalars(str(out))["critic/rewards/mean"])
    assert math.isfinite(logged[1]) and math.isnan(logged[2]), logged


def test_a_rank_whose_torchrun_agent_died_names_that_cause_before_the_gloo_error(monkeypatch, capsys):
    """After the agent's death the rank's next store or collective call fails with gloo's "Connection reset by
    peer"; the report names the dead agent first (before: only the gloo line). Outside torchrun nothing is added."""
    import os

    from training import cli

    assert cli.agent_death_line(None) is None and cli.agent_death_line(os.getppid()) is None

    def main(argv):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer")

    monkeypatch.setattr(cli, "AGENT_PID", 2 ** 22 + 12345)  # not this process's parent: the agent is gone
    with pytest.raises(SystemExit):
        cli.run_cli(main, [])
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-2].startswith(f"the torchrun agent (pid {2 ** 22 + 12345}) died") and "--resume auto" in lines[-2]
    assert lines[-1].startswith("error: RuntimeError: ") and "Connection reset by peer" in lines[-1]
