"""A run's life on a shared machine (training/lifecycle.py, training/run.py): one live run per --output_dir (the
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

import training as T
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
        with pytest.raises(T.RunLockError) as info:
            T.RunLock.acquire(str(out), wait_s=0.2)
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
    lock = T.RunLock.acquire(str(out))
    assert f"took over the run lock {out}/RUN_LOCK of a run that ended without releasing it" in lock.message
    assert f"pid {holder.pid} is dead" in lock.message
    assert json.loads((out / "RUN_LOCK").read_text())["pid"] == os.getpid()
    lock.release()
    assert (out / "RUN_LOCK").read_text() == ""  # a clean end leaves nothing to take over
    again = T.RunLock.acquire(str(out))
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
    assert T.pid_alive(child_pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while T.pid_alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not T.pid_alive(child_pid)
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
    silent = T.silent_ranks(out, 4)
    assert [rank for rank, _, _ in silent] == [3, 1]  # rank 3 never beat; rank 1 stopped 95 s ago
    text = T.describe_silent(silent)
    assert text.startswith("rank 3 (host ?, pid ?): no heartbeat at all; rank 1 (host h, pid 101): no sign of "
                           "life for 9"), text
