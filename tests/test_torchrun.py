"""scripts/torchrun.py: torchrun with a failed run summed up in one line. The pure parts here; the slow stage
counts the console lines of real failed runs through it (tests/test_cli_errors.py)."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

import torchrun


def failure(local_rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    f = ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file="<N/A>")
    f.timestamp = timestamp  # torchrun stamps it at construction, in whole seconds
    return f


def test_the_root_failure_is_the_rank_that_failed_on_its_own_not_one_torchrun_stopped():
    # rank 0 was SIGTERMed by the agent in the same second rank 1 exited with 2: torchrun's own pick (earliest
    # timestamp, then dict order) would name rank 0
    failures = {0: failure(0, -signal.SIGTERM, 100), 1: failure(1, 2, 100)}
    assert torchrun.root_failure(failures)[0] == 1
    # among real exits the earliest wins, then the lowest rank
    failures = {0: failure(0, 1, 101), 1: failure(1, 3, 100), 2: failure(2, 1, 100)}
    assert torchrun.root_failure(failures)[0] == 1
    # only signals (e.g. every rank OOM-killed): the earliest
    failures = {4: failure(0, -signal.SIGKILL, 101), 5: failure(1, -signal.SIGKILL, 100)}
    assert torchrun.root_failure(failures)[0] == 5


@pytest.mark.parametrize("exitcode, text", [(2, "exit code 2"), (-9, "signal SIGKILL"), (-15, "signal SIGTERM"),
                                            (-200, "signal 200")])
def test_exit_text_names_the_signal_of_a_negative_exit_code(exitcode, text):
    assert torchrun.exit_text(exitcode) == text


def test_failure_line_is_one_line_naming_the_rank_the_cause_and_the_log(monkeypatch):
    monkeypatch.setattr(torchrun.socket, "gethostname", lambda: "node3")
    line = torchrun.failure_line("/repo/train_dppo.py", {6: failure(2, -signal.SIGTERM, 5), 7: failure(3, 2, 5)})
    assert line == ("torchrun: train_dppo.py failed: rank 7 (local rank 3 on node3) ended first, with exit code 2 "
                    "(2 ranks of this node ended). The error is printed above; each rank's traceback, or how it "
                    "stopped, is in <output_dir>/train.log.")
    assert "\n" not in line
    single = torchrun.failure_line("train_nft.py", {0: failure(0, -signal.SIGKILL, 5)})
    assert "rank 0 (local rank 0 on node3) ended first, with signal SIGKILL. The error" in single
