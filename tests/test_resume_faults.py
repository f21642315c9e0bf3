"""Faults injected into real trainer runs (CPU, one trainer rank, tiny Qwen-Image, 64², rank-4 LoRA): a crash between
checkpoints then --resume auto (moved data, changed operational flags, Ctrl-C, different data refused), a second run
into the same output folder (stopped by --max_wall_time_s), a divergence with a huge learning rate, and a frozen
rollout worker under two trainer ranks. All of them are in the slow stage (`python3 -m pytest -m slow`).
The component-level checks (sha256 corruption, malicious pickles, killed saves, the flag policy, the skip logic)
are in tests/test_training_checkpoint.py, test_training_resume.py and test_training_optim.py."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from test_trainers import REPO, cli, demo_data, free_port, run_trainer, scalars, values  # noqa: F401 (fixture)

from training.checkpoint import find_latest, verify_checkpoint

# whole trainer runs with injected faults (minutes each on 2 cores): the slow stage (`python3 -m pytest -m slow`)
pytestmark = pytest.mark.slow


class Trainer:
    """A trainer started the way an operator starts one (torchrun in its own process group, like a terminal job),
    its merged output read line by line while it runs."""

    def __init__(self, script: str, args: list[str], torchrun: list[str] | None = None) -> None:
        """torchrun: its flags (default: one trainer rank on a free port)."""
        torchrun = torchrun or ["--nproc_per_node", "1", "--master_port", str(free_port())]
        command = [sys.executable, "-m", "torch.distributed.run", *torchrun, os.path.join(REPO, script), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
        self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, needle: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            line = self._queue.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"the trainer exited before printing {needle!r}:\n{self.output[-6000:]}")
            if needle in line:
                return

    def ctrl_c(self) -> None:
        """SIGINT to torchrun's process group, as a terminal does (torchrun starts each rank in its own session
        and forwards the signal to the rank's group, which holds the rank's rollout workers)."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def crash_rank(self) -> None:
        """SIGKILL the trainer rank's process group (the rank and its rollout worker): no cleanup runs."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            (rank_pid,) = [int(pid) for pid in f.read().split()]
        os.killpg(rank_pid, signal.SIGKILL)

    def rollout_worker_pid(self) -> int:
        """The pid of the (one) rollout worker among torchrun's descendants."""
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                with open(f"/proc/{pid}/task/{pid}/children") as f:
                    children = [int(c) for c in f.read().split()]
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().split(b"\0")
            except FileNotFoundError:
                continue
            if any(part.endswith(b"rollout.py") for part in cmdline) and b"--worker" in cmdline:
                found.append(pid)
            todo += children
        (pid,) = found
        return pid

    def finish(self, timeout: float = 600) -> int:
        code = self.proc.wait(timeout=timeout)
        self._pump.join(timeout=60)
        return code


def test_crash_between_checkpoints_then_resume_with_moved_data_new_flags_and_ctrl_c(
        demo_data, tiny_models, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    data = demo_data["qwen_image"] / "train.parquet"
    # the disk adapter sync: the versioned rollout_adapters/ folders this test is about (tensors never touch disk)
    base = dict(model_path=os.path.join(tiny_models, "qwen_image"), lr=1e-2, save_freq=3, resume="auto",
                output_dir=out, rollout_sync="disk")

    # 1. a crash (SIGKILL of the trainer and its worker) in step 6: checkpoint at step 3, rollout adapters v4, v5
    crash = Trainer("train_dppo.py", cli(**base, train_files=data, total_training_steps=6))
    crash.wait_for("step 5/6")
    crash.crash_rank()
    assert crash.finish() != 0
    assert find_latest(str(out / "checkpoints")).endswith("step_00000003")
    assert {"v00000004", "v00000005"} <= set(os.listdir(out / "rollout_adapters"))
    crashed = dict(scalars(out)["critic/rewards/mean"])  # flushed every step: the crash lost no logged step
    assert sorted(crashed) == [1, 2, 3, 4, 5]

    # 2. --resume auto after moving the data, with changed operational flags, then Ctrl-C during step 4 (torchrun
    # forwards the SIGINT to the trainer's process group: the trainer and its rollout worker)
    moved = tmp_path / "moved" / "train.parquet"
    moved.parent.mkdir()
    shutil.copy(data, moved)
    run = Trainer("train_dppo.py", cli(**base, train_files=moved, total_training_steps=8,
                                       genrm_url="http://127.0.0.1:9999", rollout_max_batch_size=2))
    run.wait_for("step 4/8")
    run.ctrl_c()
    assert run.finish() != 0
    text = run.output
    assert f"resumed from {out}/checkpoints/step_00000003 at step 3" in text
    assert "changed since the checkpoint" in text
    for key in ("genrm_url", "rollout_max_batch_size", "train_files", "total_training_steps"):
        assert f"\n  {key}: checkpoint=" in text, key
    # the versions the crashed run left above step 3 were removed before the workers started (v3 was deleted before)
    assert re.search(r"rollout adapter versions v00000004\.\.v0000000[56]", text), text
    stop = re.search(r"stopped by SIGINT at step (\d+); resume with --resume auto \(checkpoint (\S+)\)", text)
    assert stop, text[-6000:]
    stopped, checkpoint = int(stop.group(1)), stop.group(2)
    assert stopped in (4, 5) and checkpoint == f"{out}/checkpoints/step_{stopped:08d}"  # the step it was in
    assert f"saved checkpoint {checkpoint}" in text
    verify_checkpoint(checkpoint)
    assert "rollout worker" not in text  # the worker ignored the Ctrl-C and was closed by the trainer
    # TensorBoard holds each step once (purge_step), and the resumed steps continue the crashed run
    after = scalars(out)["critic/rewards/mean"]
    assert [s for s, _ in after] == list(range(1, stopped + 1))
    for step, value in after[3:]:
        assert value == pytest.approx(crashed[step], abs=1e-4), step

    # 3. the same run on other data (one row fewer) is refused before any model or worker is loaded
    changed = tmp_path / "changed.parquet"
    pq.write_table(pq.read_table(data).slice(1), changed)
    worker_log = out / "rollout_logs" / "rollout-worker-0.log"
    log_size = worker_log.stat().st_size
    proc = run_trainer("train_dppo.py", cli(**base, train_files=changed, total_training_steps=8), nproc=1,
                       expect_ok=False)
    assert proc.returncode != 0 and "train_files@content: checkpoint='sha256:" in proc.stderr
    assert "--resume_force" in proc.stderr
    assert worker_log.stat().st_size == log_size  # no rollout worker was started


def test_second_run_into_the_same_output_dir(demo_data, tiny_models, tmp_path):  # noqa: F811
    """The demo run twice: the second (--resume never into the same folder) used to delete the rollout adapter it
    had just written (v00000000 sorts below the earlier run's v00000001, v00000002)."""
    out = tmp_path / "demo"
    flags = dict(model_path=os.path.join(tiny_models, "qwen_image"), train_files=demo_data["qwen_image"] /
                 "train.parquet", true_cfg_scale=1.0, lr=1e-2, save_freq=100, output_dir=out,
                 rollout_sync="disk")  # the disk sync writes the versions this test is about
    run_trainer("train_nft.py", cli(**flags, total_training_steps=2), nproc=1)
    # --max_wall_time_s stops it cleanly (checkpoint, exit 0) at the first step boundary after the limit
    proc = run_trainer("train_nft.py", cli(**flags, total_training_steps=4, resume="never", max_wall_time_s=0.001),
                       nproc=1)
    assert "rollout adapter versions v00000001..v00000002" in proc.stdout
    assert "--resume never:" in proc.stdout and "moved them and the earlier run's logs aside" in proc.stdout
    (previous,) = (out / "previous").iterdir()
    assert (previous / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    assert (previous / "tensorboard").is_dir() and (previous / "run_metadata.json").is_file()
    assert re.search(r"stopped at step 1 after \d+ s of training \(--max_wall_time_s 0\.001\); continue with "
                     r"--resume auto \(checkpoint \S+step_00000001\)", proc.stdout), proc.stdout
    assert "step 2/4" not in proc.stdout
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000001"]
    assert [s for s, _ in scalars(out)["critic/rewards/mean"]] == [1]  # the new logs hold only the new run


def test_divergence_with_a_huge_lr_skips_stops_and_names_the_checkpoint(demo_data, tiny_models,  # noqa: F811
                                                                        tmp_path):
    """--lr 1e8 after a healthy step (accepted with --resume_force, which names the key): step 2's update is
    applied (LoRA weights ~1e8, finite), steps 3 and 4 give NaN and are skipped, the run stops after 2 skips in a
    row naming the checkpoint before the diverging update. Slow: two trainer runs (~50 s on an idle 2-core machine)."""
    out = tmp_path / "run"
    flags = dict(model_path=os.path.join(tiny_models, "qwen_image"), train_files=demo_data["qwen_image"] /
                 "train.parquet", true_cfg_scale=1.0, save_freq=1, output_dir=out)
    run_trainer("train_nft.py", cli(**flags, total_training_steps=1, lr=1e-2), nproc=1)
    proc = run_trainer("train_nft.py", cli(**flags, total_training_steps=6, resume="auto", lr=1e8,
                                           max_consecutive_skips=2) + ["--resume_force"], nproc=1, expect_ok=False)
    assert proc.returncode != 0
    assert "WARNING --resume_force" in proc.stdout and "lr: checkpoint=0.01 now=100000000.0" in proc.stdout
    # the NaN shows first in step 3's rollout samples (never scored, the step skipped), or else in its loss
    assert re.search(r"step 3: skipped 1 optimizer step\(s\): (non-finite loss|\d+ non-finite rollout sample)",
                     proc.stdout), proc.stdout[-3000:]
    assert "step 3: checkpoint deferred" in proc.stdout
    assert "training diverged: 2 optimizer steps in a row were skipped" in proc.stderr
    assert "the result of the update of step 2" in proc.stderr
    assert f"--resume {out}/checkpoints/step_00000001 --lr 1e+07 --resume_force" in proc.stderr
    # no checkpoint from the skipped steps; step 2's holds finite (huge) weights
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000001", "step_00000002"]
    weights = load_file(str(out / "checkpoints" / "step_00000002" / "adapters" / "default" /
                            "adapter_model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert max(float(t.abs().max()) for t in weights.values()) > 1e6
    m = scalars(out)
    assert values(m, "actor/skipped_steps") == [0.0, 0.0, 1.0, 2.0]
    assert values(m, "actor/step_skipped") == [0.0, 0.0, 1.0, 1.0]


def test_a_frozen_rollout_worker_is_named_in_every_ranks_log(demo_data, tiny_models, tmp_path):  # noqa: F811
    """Two nodes of one trainer rank each (two torchruns on 127.0.0.1, gloo), each node with its own rollout worker;
    node 0's worker is frozen (SIGSTOP) after step 1. Its driver, rank 0, gives up on it after --rollout_timeout_s;
    rank 1, whose own rollout succeeded, hears that error at the end of the rollout phase and raises the same
    message, instead of dying in a collective (timeout, or a closed connection when rank 0 exits). Slow: two
    trainer processes (~1-2 min on this 2-core machine)."""
    out = tmp_path / "run"
    port = free_port()
    argv = cli(model_path=os.path.join(tiny_models, "qwen_image"), train_files=demo_data["qwen_image"] /
               "train.parquet", lr=1e-2, total_training_steps=3, rollout_timeout_s=8, output_dir=out)
    nodes = [Trainer("train_dppo.py", argv, torchrun=["--nnodes", "2", "--node_rank", str(k), "--nproc_per_node",
                                                      "1", "--master_addr", "127.0.0.1", "--master_port", str(port)])
             for k in (0, 1)]
    nodes[0].wait_for("step 1/3")
    worker = nodes[0].rollout_worker_pid()
    os.kill(worker, signal.SIGSTOP)
    start = time.monotonic()
    codes = [node.finish(timeout=300) for node in nodes]
    elapsed = time.monotonic() - start
    assert all(code != 0 for code in codes), codes
    named = r"rollout worker 0 \(cpu\) did not answer within 8 s during generate"
    assert re.search(named, nodes[0].output), nodes[0].output[-6000:]
    rank1 = nodes[1].output
    assert re.search(r"RankFailed: the rollout of step 2 failed on rank 0: RolloutError: " + named, rank1), \
        rank1[-6000:]
    log = (out / "train.log").read_text()  # both nodes write into the shared output folder
    assert re.search(r"\[rank 1\] .*RankFailed: the rollout of step 2 failed on rank 0: .*" + named, log), log[-6000:]
    assert "Timed out" not in rank1 + log and "Connection closed" not in rank1
    assert elapsed < 120, elapsed  # the worker's timeout ended it, not a collective's
