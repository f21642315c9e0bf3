"""Launch a trainer under torchrun and read back what it logged (TensorBoard scalars and images, its console lines):
the helpers that the trainer tests and tools/bench_learning.py share."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Mapping, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_trainer(script: str, args: Sequence[str], *, nproc: int = 2, expect_ok: bool = True, timeout_s: float = 900,
                env: Mapping[str, str] | None = None, log_path: str | None = None) -> subprocess.CompletedProcess:
    """`scripts/torchrun.py --nproc_per_node nproc <REPO>/<script> args` (torchrun, one summary line on failure) from the repository root (OMP_NUM_THREADS=1 and REPO
    first on PYTHONPATH unless `env` overrides them). Returns the finished process with its stdout / stderr text; with
    `log_path`, both are also appended to that file. A run that fails (with `expect_ok`) raises AssertionError with
    the output's tail; one that outlives `timeout_s` is killed with its whole process group (torchrun, the trainer
    ranks and their rollout workers) and raises TimeoutError."""
    command = [sys.executable, os.path.join(REPO, "scripts", "torchrun.py"), "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), os.path.join(REPO, script), *map(str, args)]
    inherited = [p for p in [os.environ.get("PYTHONPATH")] if p]  # e.g. packages installed with --target
    run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, *inherited]))
    run_env.update(env or {})
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, cwd=REPO, env=run_env, stdout=out, stderr=err, text=True,
                                start_new_session=True)
        timed_out = False
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
        out.seek(0), err.seek(0)
        result = subprocess.CompletedProcess(command, returncode, out.read(), err.read())
    if log_path:
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"$ {' '.join(command)}\n{result.stdout}{result.stderr}[exit {returncode}]\n")
    if timed_out:
        raise TimeoutError(f"{script} ran past {timeout_s:.0f}s and was killed:\n{result.stdout[-3000:]}\n"
                           f"{result.stderr[-6000:]}")
    if expect_ok and returncode != 0:
        raise AssertionError(f"{script} failed ({returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def _events(run_dir: str, kind: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={kind: 0})
    events.Reload()
    return events


def scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag the run logged under <run_dir>/tensorboard -> [(step, value), ...] in logging order."""
    events = _events(run_dir, "scalars")
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def images(run_dir: str, tag: str) -> dict[int, bytes]:
    """The images logged under `tag` (e.g. the validation grid "val/samples") -> {step: PNG bytes}; {} if none."""
    events = _events(run_dir, "images")
    if tag not in events.Tags()["images"]:
        return {}
    return {e.step: e.encoded_image_string for e in events.Images(tag)}


# torchrun's own lines start with a glog-style header ("E1202 15:49:33.143000 ...") or, for a failed run through
# scripts/torchrun.py, are its one "torchrun: ... failed" line
TORCHRUN_LINE = re.compile(r"^([IWE]\d{4} \d\d:\d\d:\d\d|torchrun: )")


def trainer_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """The trainer's own non-empty console lines of a `run_trainer` result: stdout, then stderr up to torchrun's
    first line (its failure summary of a failed run)."""
    err = proc.stderr.splitlines()
    first_torchrun = next((i for i, line in enumerate(err) if TORCHRUN_LINE.match(line)), len(err))
    return [line for line in proc.stdout.splitlines() + err[:first_torchrun] if line.strip()]


def error_line(proc: subprocess.CompletedProcess, output_dir: str) -> str:
    """The one error line of a failed run of 2 ranks (AssertionError unless there is exactly one, the console shows
    no traceback, and <output_dir>/train.log holds rank 0's traceback and rank 1's, or rank 1's stop: torchrun
    SIGTERMs the other ranks once one fails, which on a loaded machine can be before rank 1 reaches the error)."""
    assert proc.returncode != 0
    lines = trainer_lines(proc)
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, lines
    assert not any("Traceback" in line for line in lines), lines
    with open(os.path.join(output_dir, "train.log"), encoding="utf-8") as f:
        log = f.read()
    # rank 0's lines carry no "[rank N] " prefix after the time: a bare "Traceback" would also match rank 1's
    assert re.search(r"^\S+ Traceback \(most recent call last\)", log, re.MULTILINE), log[-3000:]
    assert "[rank 1] Traceback" in log or "[rank 1] stopped by SIGTERM" in log, log[-3000:]
    return errors[0]
