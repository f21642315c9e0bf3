"""A run's life on a shared machine (training/lifecycle.py, training/lifeboat.py): one live run per --output_dir (the
run lock), no orphans (the ranks' parent watchdog, the rollout workers' parent-death signal), a checkpoint on
every way out (SIGTERM within the launcher's shutdown window, a judge that stays down, a dead rollout worker, the
agent's death) and a frozen rank named. The component checks are fast; the whole-trainer ones are marked slow."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.checkpoint import verify_checkpoint
from training.lifecycle import RunLock, RunLockError, describe_silent, pid_alive, silent_ranks
from test_resume_faults import Trainer
from test_rewards import FakeJudge
from test_trainers import REPO, cli, demo_data, free_port, run_trainer  # noqa: F401 (fixture)


def holder_process(output_dir, *, hold: bool = True) -> subprocess.Popen:
    """A process that takes the run lock of `output_dir` and prints 'locked' (then sleeps until killed)."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        from training.lifecycle import RunLock
        RunLock.acquire({str(output_dir)!r})
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_the_run_lock_refuses_a_live_run_and_takes_over_a_dead_ones(tmp_path):
    out = tmp_path / "run"
    holder = holder_process(out)
    try:
        with pytest.raises(RunLockError) as info:
            RunLock.acquire(str(out), wait_s=0.2)
        message = str(info.value)
        assert "\n" not in message  # one line
        assert re.search(rf"--output_dir {re.escape(str(out))} is in use by a live run \(host "
                         rf"{re.escape(socket.gethostname())}, pid {holder.pid}, started 20\d\d-", message), message
        assert "pass another --output_dir" in message
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: the kernel dropped its flock, the file still names it
    assert json.loads((out / "RUN_LOCK").read_text())["pid"] == holder.pid
    lock = RunLock.acquire(str(out))
    assert f"took over the run lock {out}/RUN_LOCK of a run that ended without releasing it" in lock.message
    assert f"pid {holder.pid} is dead" in lock.message
    assert json.loads((out / "RUN_LOCK").read_text())["pid"] == os.getpid()
    lock.release()
    assert (out / "RUN_LOCK").read_text() == ""  # a clean end leaves nothing to take over
    again = RunLock.acquire(str(out))
    assert again.message == ""
    again.release()


def test_the_parent_watchdog_ends_an_orphan(tmp_path):
    """A child watching its parent (`watch_parent`) exits once the parent is SIGKILLed (re-parented to init)."""
    marker = tmp_path / "orphaned"
    child = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {REPO!r})
        from training.lifecycle import watch_parent
        def gone(old, new):
            open({str(marker)!r}, "w").write(f"{{old}} {{new}}")
            os._exit(3)
        watch_parent(gone, interval_s=0.1)
        print(os.getpid(), flush=True)
        time.sleep(600)
    """)
    parent = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE, text=True)
        print(child.stdout.readline().strip(), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child_pid = int(proc.stdout.readline())
    assert pid_alive(child_pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while pid_alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(child_pid)
    old, _ = marker.read_text().split()
    assert int(old) == proc.pid


def test_a_rollout_worker_whose_trainer_is_already_gone_exits_at_once():
    """The parent-death signal is armed after the worker's imports; a trainer that died before that is noticed by
    the --parent-pid check (the worker would otherwise wait on a pipe nobody writes)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, os.path.join(REPO, "rollout.py"), "--worker", "--model-path", "unused",
                           "--parent-pid", str(2 ** 22 + 1)], stdin=subprocess.PIPE, capture_output=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout == b""  # not even the handshake: nobody is listening
    assert time.monotonic() - start < 60


def test_silent_ranks_are_named_from_their_heartbeats(tmp_path):
    out = str(tmp_path)
    for rank in range(3):
        os.makedirs(os.path.join(out, ".heartbeats"), exist_ok=True)
        with open(os.path.join(out, ".heartbeats", f"rank_{rank:05d}.json"), "w") as f:
            json.dump({"host": "h", "pid": 100 + rank, "rank": rank}, f)
    old = time.time() - 95
    os.utime(os.path.join(out, ".heartbeats", "rank_00001.json"), (old, old))
    silent = silent_ranks(out, 4)
    assert [rank for rank, _, _ in silent] == [3, 1]  # rank 3 never beat; rank 1 stopped 95 s ago
    text = describe_silent(silent)
    assert text.startswith("rank 3 (host ?, pid ?): no heartbeat at all; rank 1 (host h, pid 101): no sign of "
                           "life for 9"), text


# ------------------------------------------------------------------------------------------------------------------
# Whole trainers (torchrun, CPU, tiny Qwen-Image 64², one rank unless said): slow
# ------------------------------------------------------------------------------------------------------------------


def ocr_data(demo_data, tmp_path) -> str:  # noqa: F811
    """The demo prompts scored by the OCR judge (their ground truths are the texts to render)."""
    rows = pq.read_table(demo_data["qwen_image"] / "train.parquet").to_pylist()
    for row in rows:
        row["data_source"] = "ocr"
    path = tmp_path / "ocr.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def base_flags(tiny_models, demo_data, out, **flags) -> list[str]:  # noqa: F811
    return cli(**{"model_path": os.path.join(tiny_models, "qwen_image"), "train_files": demo_data["qwen_image"] /
                  "train.parquet", "lr": 1e-2, "output_dir": out, "resume": "auto", **flags})


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def rank_pid(agent: int, rank: int) -> int:
    """The pid of trainer rank `rank` among the torchrun agent's children (from its environment)."""
    for pid in children(agent):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return pid
    raise AssertionError(f"no rank {rank} among the children of {agent}")


def wait_gone(pids, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids), [p for p in pids if pid_alive(p)]


def kill_group(trainer: Trainer) -> None:
    """Clean-up: whatever is left of a trainer (its torchrun's group, its ranks' own groups)."""
    for pid in [trainer.proc.pid]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_one_live_run_per_folder_and_no_orphans_when_the_agent_is_killed(demo_data, tiny_models,  # noqa: F811
                                                                          tmp_path):
    """A second run into a live run's folder is refused in one line naming it, before any model loads; kill -9 of
    the first run's torchrun agent ends its rank and rollout worker within seconds (the rank's parent watchdog,
    the worker's parent-death signal), the rank first writing its last finished step; a relaunch takes over the
    dead run's lock, saying so, and resumes from that step. Slow: three trainer launches (~1-2 min)."""
    out = tmp_path / "run"
    first = Trainer("train_dppo.py", base_flags(tiny_models, demo_data, out, total_training_steps=40, save_freq=100))
    try:
        first.wait_for("step 2/40")
        (rank,) = children(first.proc.pid)
        worker = first.rollout_worker_pid()
        second = run_trainer("train_dppo.py", base_flags(tiny_models, demo_data, out, total_training_steps=40,
                                                         save_freq=100), nproc=1, expect_ok=False)
        assert second.returncode != 0
        refusal = [line for line in second.stderr.splitlines() if line.startswith("error: RunLockError:")]
        assert len(refusal) == 1, second.stderr[-3000:]
        assert re.search(rf"--output_dir {re.escape(str(out))} is in use by a live run \(host "
                         rf"{re.escape(socket.gethostname())}, pid {rank} \(torchrun agent {first.proc.pid}\), "
                         r"started 20\d\d-", refusal[0]), refusal[0]
        assert "loading the transformer" not in second.stdout
        assert "setup_run" not in second.stderr  # a refusal, not a crash: no traceback of the trainer
        os.kill(first.proc.pid, signal.SIGKILL)  # the agent only: its rank and worker are in other groups
        wait_gone([rank, worker], timeout=30)
        first.finish(timeout=60)
    finally:
        kill_group(first)
    text = first.output
    assert re.search(rf"rank 0: the torchrun agent \(pid {first.proc.pid}\) died .*exiting", text), text[-3000:]
    saved = re.search(r"saved checkpoint (\S+step_(\d{8})) \([\d.]+ s\): step (\d+), the last finished step, written "
                      rf"at once \(the torchrun agent pid {first.proc.pid} died\)", text)
    assert saved, text[-3000:]
    step = int(saved.group(3))
    assert step >= 1 and int(saved.group(2)) == step
    verify_checkpoint(saved.group(1))
    third = run_trainer("train_dppo.py", base_flags(tiny_models, demo_data, out, total_training_steps=step + 1,
                                                    save_freq=100), nproc=1)
    assert f"took over the run lock {out}/RUN_LOCK of a run that ended without releasing it" in third.stdout
    assert f"pid {rank} is dead" in third.stdout
    assert f"resumed from {saved.group(1)} at step {step}" in third.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_during_a_long_step_saves_the_last_finished_step_within_the_shutdown_window(
        demo_data, tiny_models, tmp_path, sig):  # noqa: F811
    """Step 2 waits on a judge that takes 60 s per reply; torchrun's --shutdown-timeout is 8 s. SIGTERM (a
    scheduler) or SIGHUP (a closed terminal or SSH session) to the agent, which forwards it: the rank writes step 1
    at once (its held state), well inside the window, and torchrun's SIGKILL later finds nothing left to lose.
    Slow: one trainer launch (~40 s) per signal."""
    out = tmp_path / "run"
    with FakeJudge() as judge:
        argv = base_flags(tiny_models, demo_data, out, train_files=ocr_data(demo_data, tmp_path), save_freq=100,
                          total_training_steps=5, genrm_url=judge.url)
        run = Trainer("train_dppo.py", argv, torchrun=["--nproc_per_node", "1", "--master_port", str(free_port()),
                                                       "--shutdown-timeout", "8"])
        try:
            run.wait_for("step 1/5")
            judge.delay_s = 60.0  # step 2 is now stuck in scoring for a minute
            time.sleep(2)
            start = time.monotonic()
            os.kill(run.proc.pid, getattr(signal, sig))
            run.wait_for(f"written at once (on {sig})", timeout=30)
            elapsed = time.monotonic() - start
            assert run.finish(timeout=60) != 0
        finally:
            kill_group(run)
    assert elapsed < 8, elapsed
    text = run.output
    assert re.search(r"saved checkpoint \S+step_00000001 \([\d.]+ s\): step 1, the last finished step", text), text
    verify_checkpoint(str(out / "checkpoints" / "step_00000001"))
    assert "step 2/5" not in text


class DoorSlam:
    """A TCP port that accepts and closes at once (a judge restarting: the client sees its connection dropped),
    counting the connections."""

    def __init__(self, port: int) -> None:
        import threading

        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.connections = 0
        self.open = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.open:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()  # RST

    def close(self) -> None:
        """Stop listening (shutdown wakes the blocked accept, so the port is free for the judge again)."""
        self.open = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.mark.slow
def test_a_judge_restart_is_ridden_out_and_a_judge_that_stays_down_saves_the_last_step(
        demo_data, tiny_models, tmp_path):  # noqa: F811
    """The judge drops every connection for a while after step 1 (a restart) and comes back: the run goes on. After
    step 3 it goes away for good: the requests are retried for --genrm_retry_total_s (not --genrm_max_retries 0),
    then the run ends naming those numbers, having written step 3 first. Slow: one trainer launch (~1 min)."""
    out = tmp_path / "run"
    port = free_port()
    judge = FakeJudge(port=port).__enter__()
    argv = base_flags(tiny_models, demo_data, out, train_files=ocr_data(demo_data, tmp_path), save_freq=100,
                      total_training_steps=8, genrm_url=f"http://127.0.0.1:{port}", genrm_max_retries=0,
                      genrm_backoff_s=0.5, genrm_retry_total_s=12)
    run = Trainer("train_dppo.py", argv)
    try:
        run.wait_for("step 1/8")
        judge.__exit__(None, None, None)
        door = DoorSlam(port)
        deadline = time.monotonic() + 60
        while door.connections < 3 and time.monotonic() < deadline:  # step 2's requests are being retried
            time.sleep(0.1)
        assert door.connections >= 3
        door.close()
        judge = FakeJudge(port=port).__enter__()  # back up
        run.wait_for("step 3/8")
        judge.__exit__(None, None, None)  # gone for good: nothing listens any more
        assert run.finish(timeout=120) != 0
    finally:
        kill_group(run)
    text = run.output
    assert "step 2/8" in text
    assert re.search(r"saved checkpoint \S+step_00000003 \([\d.]+ s\): step 3, the last finished step, written at "
                     r"once \(before stopping on the error in the rollout of step 4: GenRMServerError", text), text
    verify_checkpoint(str(out / "checkpoints" / "step_00000003"))
    found = re.search(r"failed (\d+) attempt\(s\) in ([\d.]+) s \(timeout \S+ each, .*; (\d+) could not connect, "
                      r"retried for up to --genrm_retry_total_s 12 s", text)
    assert found, text[-4000:]
    assert 11 <= float(found.group(2)) <= 30 and int(found.group(1)) == int(found.group(3)) > 1


@pytest.mark.slow
def test_a_dead_rollout_worker_ends_the_run_after_saving_the_last_step(demo_data, tiny_models, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    run = Trainer("train_dppo.py", base_flags(tiny_models, demo_data, out, total_training_steps=8, save_freq=100))
    try:
        run.wait_for("step 2/8")
        os.kill(run.rollout_worker_pid(), signal.SIGKILL)
        assert run.finish(timeout=120) != 0
    finally:
        kill_group(run)
    text = run.output
    saved = re.search(r"saved checkpoint \S+step_(\d{8}) \([\d.]+ s\): step (\d+), the last finished step, written at "
                      r"once \(before stopping on the error in (the rollout of step \d+|the adapter sync of step \d+): "
                      r"RolloutError: rollout worker 0 \(cpu\)", text)
    assert saved, text[-4000:]
    assert int(saved.group(2)) >= 2
    verify_checkpoint(str(out / "checkpoints" / f"step_{saved.group(1)}"))
    assert "RolloutError: rollout worker 0 (cpu) died" in text


@pytest.mark.slow
@pytest.mark.parametrize("reply, finish, counts", [
    ("", None, "4 empty, 0 over-long, 0 refusals"),
    ("I'm sorry, but I can't help with that.", None, "0 empty, 0 over-long, 4 refusals"),
], ids=["empty", "refusal"])  # an over-long reply takes the same path (counted: tests/test_rewards.py)
def test_a_judge_that_does_not_read_stops_the_run_naming_its_replies(demo_data, tiny_models, tmp_path,  # noqa: F811
                                                                    reply, finish, counts):
    """A judge that answers every request after step 1 with nothing or a refusal: the step's replies are logged,
    the last finished step is saved and the run stops with one line naming the counts. Before, a refusing judge
    trained on zero rewards at rc 0."""
    out = tmp_path / "run"
    # the start-up probe (read by FakeJudge) and step 1 (2 prompts x 2 samples) read text, then no more
    with FakeJudge(reply=["Exit 42"] * 5 + [reply] * 100, finish_reason=[None] * 5 + [finish] * 100) as judge:
        proc = run_trainer("train_dppo.py", base_flags(
            tiny_models, demo_data, out, train_files=ocr_data(demo_data, tmp_path), save_freq=100,
            total_training_steps=4, genrm_url=judge.url, judge_max_unusable_frac=0.5, judge_log_freq=0,
            genrm_max_tokens=64), nproc=1, expect_ok=False)
    assert proc.returncode != 0
    log = out / "judge_replies.jsonl"
    assert re.search(rf"JudgeNotReading: the OCR judge \(--genrm_url {re.escape(judge.url)}\): 4 of the 4 samples it "
                     rf"read in step 2 were not readings \({counts}\), 100% > --judge_max_unusable_frac 0.5.*Its "
                     rf"replies are in {re.escape(str(log))}", proc.stderr), proc.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["phase"], r["step"], r["ocr/response"]) for r in records] == [("train", 2, reply)] * 4
    assert "saved checkpoint" in proc.stdout and "step 1, the last finished step" in proc.stdout
    if reply:  # the odd replies are printed with an example at the step they happen
        assert "step 2: the OCR judge's replies to 4 of the 4 samples" in proc.stdout
        assert repr(reply[:80]) in proc.stdout


@pytest.mark.slow
def test_a_frozen_rank_is_named(demo_data, tiny_models, tmp_path):  # noqa: F811
    """Two trainer ranks; rank 1 is frozen (SIGSTOP) after step 1. Rank 0 names it once it has been silent for
    HEARTBEAT_STALE_S, and again when its collective times out, instead of a bare gloo timeout. Slow (~2 min)."""
    out = tmp_path / "run"
    argv = base_flags(tiny_models, demo_data, out, total_training_steps=20, save_freq=100, rollout_timeout_s=20,
                      rollout_startup_timeout_s=60, collective_timeout_s=75,
                      ocr_backend="rapidocr")  # no judge phase to outlast (the demo rows score jpeg_compressibility)
    run = Trainer("train_dppo.py", argv, torchrun=["--nproc_per_node", "2", "--master_port", str(free_port())])
    try:
        run.wait_for("step 1/20")
        frozen = rank_pid(run.proc.pid, 1)
        os.kill(frozen, signal.SIGSTOP)
        run.wait_for(f"WARNING: rank 1 (host {socket.gethostname()}, pid {frozen}): no sign of life for", timeout=120)
        assert run.finish(timeout=300) != 0
    finally:
        try:
            os.kill(frozen, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
        kill_group(run)
    assert re.search(rf"a collective failed while these ranks were silent: rank 1 \(host \S+, pid {frozen}\): no sign "
                     rf"of life for \d+ s", run.output), run.output[-4000:]


@pytest.mark.slow
def test_a_run_refused_by_the_run_lock_writes_nothing_into_the_live_runs_log(demo_data, tiny_models,  # noqa: F811
                                                                             tmp_path):
    """A second run (two ranks) into the folder of a live run: refused in one line, and the live run's train.log
    stays byte for byte what it was (before, the refused run appended its command line and both ranks'
    tracebacks to it: the console log is held in memory until the run lock is held, and dropped when it is
    refused). Slow: one two-rank start-up (~20 s)."""
    from trainer_runs import trainer_lines

    out = tmp_path / "run"
    holder = holder_process(out)
    log = out / "train.log"
    log.write_text("2026-01-01T00:00:00Z step 7/40 | the live run's own line\n")
    before = log.read_bytes()
    try:
        proc = run_trainer("train_dppo.py", base_flags(tiny_models, demo_data, out), nproc=2, expect_ok=False)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0
    lines = trainer_lines(proc)
    assert [line for line in lines if "error:" in line] == lines and len(lines) == 1, lines
    assert lines[0].startswith(f"error: RunLockError: --output_dir {out} is in use by a live run (host "), lines
    assert "Traceback" not in proc.stdout + proc.stderr
    assert log.read_bytes() == before
