"""torchrun, with a failed run summed up in one line instead of torchrun's ~40-line ChildFailedError report.

    python3 scripts/torchrun.py --nproc_per_node 2 train_dppo.py --model_path ...   # any torchrun flags

Takes exactly torchrun's arguments (`torch.distributed.run`) and runs its agent. When ranks fail, the trainer has
already printed its own one-line error (rank 0) and written to `<output_dir>/train.log` each rank's traceback, or how
it was stopped (torchrun SIGTERMs the other ranks once one has failed, which may be before they reach the error); this
adds one line naming the rank that failed first, its exit code or signal, and how many of the node's ranks ended, and
exits with that rank's exit code (1 for a signal). The agent's own per-rank log lines ("Sending process ... closing
signal", "failed (exitcode ...)") and the OMP_NUM_THREADS banner are left out; set TORCHRUN_VERBOSE=1 to keep
everything torchrun prints. `scripts/launch.sh` (every recipe) and the test runs launch through this.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from typing import Mapping, Sequence

AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # its per-rank lines repeat the summary below


def root_failure(failures: Mapping[int, object]) -> tuple[int, object]:
    """(global rank, failure) of the rank that failed on its own: the earliest one that exited with a code > 0, else
    the earliest of all. torchrun's own pick (earliest timestamp, 1 s resolution) often names a rank it had SIGTERMed
    itself because another rank failed in the same second."""
    def key(rank: int) -> tuple[bool, int, int]:
        failure = failures[rank]
        return (not failure.exitcode > 0, failure.timestamp, rank)
    rank = min(failures, key=key)
    return rank, failures[rank]


def exit_text(exitcode: int) -> str:
    """'exit code 2', or 'signal SIGKILL' for a rank ended by a signal (a negative exit code)."""
    if exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        return f"signal {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"signal {-exitcode}"


def failure_line(script: str, failures: Mapping[int, object]) -> str:
    """One line for a ChildFailedError's `failures` ({global rank: ProcessFailure} of this node), e.g.
    'torchrun: train_dppo.py failed: rank 0 (local rank 0 on node0) ended first, with exit code 2 (2 ranks of this
    node ended). The error is printed above; each rank's traceback, or how it stopped, is in <output_dir>/train.log.'"""
    rank, failure = root_failure(failures)
    host = socket.gethostname()  # an agent reports the ranks of its own node only
    count = f" ({len(failures)} ranks of this node ended)" if len(failures) > 1 else ""
    return (f"torchrun: {os.path.basename(script)} failed: rank {rank} (local rank {failure.local_rank} on {host}) "
            f"ended first, with {exit_text(failure.exitcode)}{count}. The error is printed above; each rank's "
            f"traceback, or how it stopped, is in <output_dir>/train.log.")


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import determine_local_world_size, parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    verbose = os.environ.get("TORCHRUN_VERBOSE", "") not in ("", "0")
    if not verbose:
        logging.getLogger(AGENT_LOGGER).setLevel(logging.CRITICAL)
        # "Received 2 death signal, shutting down workers": the ranks print their own stop line
        logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
        if "OMP_NUM_THREADS" not in os.environ and determine_local_world_size(args.nproc_per_node) > 1:
            # what torchrun sets for more than one process, without its banner
            os.environ["OMP_NUM_THREADS"] = "1"
    try:
        run(args)
    except SignalException as stop:  # forwarded to the ranks, which saved, printed their line and exited
        if verbose:
            raise
        return 128 + int(stop.sigval)
    except ChildFailedError as error:
        if verbose:
            raise
        print(failure_line(args.training_script, error.failures), file=sys.stderr, flush=True)
        _, failure = root_failure(error.failures)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
