"""The trainers' command line: one clear line per failure on the console, the traceback in the log.

Under torchrun every rank parses the flags and runs the same start-up checks, so every rank sees the same mistake.
`ArgumentParser` (a bad or misspelt flag) and `run_cli` (an error while running) print one line on the first rank
of each node (rank 0 on one machine: each node has its own console) and nothing on the other ranks' consoles;
`run_cli` writes the full traceback of every rank to `<output_dir>/train.log` (`training.console.tee_console`).
torchrun's own ChildFailedError summary still follows the line: it is torchrun's. Errors that the ranks raise one
by one (not relayed to every rank, e.g. a crash in one rank's own work) are printed by every rank that has them,
prefixed "[rank N]". A full disk is one line naming the disk, its free space and how to continue, whatever error it
surfaced as; a stop signal during the start-up is one line and exit status 128 + the signal number.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import signal
import sys
import time
import traceback
from typing import Any, Callable, Iterable, Mapping, NoReturn, Sequence

from .checkpoint import CheckpointError
from .distributed import RankFailed, cleanup_distributed, get_local_rank, get_local_world_size, launch_rank
from .lifecycle import (STOP_SIGNALS, RunLockError, StoppedBySignal, collective_explanation, disk_full_line,
                        signal_stop_line)
from .console import console_log_path, log_only
from .logs import HelpFormatter
from .preflight import PreflightError

__all__ = ["ArgumentParser", "run_cli", "suggest_flags", "one_line_error"]

# Raised alike on every rank (computed by each, or relayed from rank 0 / the failing rank): one line per node says it
RELAYED_ERRORS: tuple[type[BaseException], ...] = (PreflightError, CheckpointError, RankFailed, RunLockError)
# Refusals of the inputs (they say what is wrong and the fix): no traceback on the console even before the log exists
REFUSALS: tuple[type[BaseException], ...] = (PreflightError, CheckpointError, RunLockError)


def suggest_flags(message: str, flags: Iterable[str], elsewhere: Mapping[str, Iterable[str]] | None = None) -> str:
    """argparse's error `message` plus, for each unknown `--flag` in it: "it is a flag of X" when the script X of
    `elsewhere` ({script: its flags}) takes it exactly (e.g. --mix_beta given to train_dppo.py: a train_nft.py
    flag), else "did you mean --x?" when it is close to one of `flags` (difflib); the message unchanged when there is
    neither."""
    known = sorted(set(flags))
    hints = []
    for token in re.findall(r"(?<![\w-])(--[\w-]+)", message):
        if token in known:
            continue
        owners = [script for script, theirs in (elsewhere or {}).items() if token in set(theirs)]
        close = difflib.get_close_matches(token, known, n=1, cutoff=0.6)
        if owners:
            hints.append(f"{token} is a flag of {' and '.join(owners)}, not of this script")
        elif close:
            hints.append(f"{token}: did you mean {close[0]}?")
    return message + ("; " + "; ".join(hints) if hints else "")


TRAINERS = ("train_nft.py", "train_dppo.py")


def trainer_flags(script: str) -> set[str]:
    """The `--flags` the trainer `script` (a file next to training/) defines, read from its source: its
    `add_argument("--...")` calls (the shared flags of training/flags.py are not in it). Empty when unreadable."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), script)
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return set()
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source))


def one_line_error(error: BaseException) -> str:
    """`Type: message` of an exception, its lines joined into one line."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


QUIET_RANK_WAIT_S = 60.0  # how long a quiet rank waits for its node's first rank to print the shared error and exit


def wait_for_first_rank() -> None:
    """On a node's non-first rank under torchrun (LOCAL_WORLD_SIZE > 1), before it exits on an error that its
    node's first rank prints: wait up to QUIET_RANK_WAIT_S. torchrun stops every rank once one exits, so exiting
    first could stop the first rank (still importing on a loaded machine, or still writing its traceback to the
    log) before its line is out; the first rank's exit ends this wait: torchrun stops us with SIGTERM, which the
    default action it gets back here ends at once (the trainers' handlers would turn it into a stop request, or
    a second error, and keep torchrun waiting). Nothing elsewhere."""
    if get_local_rank() == 0 or get_local_world_size() <= 1:
        return
    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, signal.SIG_DFL)
        except ValueError:  # not the main thread: its handlers are the main thread's to set
            pass
    time.sleep(QUIET_RANK_WAIT_S)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the trainers: `--help` shows every default (`HelpFormatter`), no abbreviated flags, and a bad
    flag is one line on each node's first rank only (`prog: error: <what>; did you mean --x? (see prog --help)`, or
    which trainer takes it), exit status 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # a flag's prefix never quietly means the flag
        super().__init__(*args, **kwargs)

    def check_ranges(self, args: argparse.Namespace, rules: Sequence[tuple[str, Callable[[Any], bool], str]]) -> None:
        """`error` naming the first flag whose value breaks its rule: (dest, predicate, what the value must be);
        an unset (None) flag passes. Model-free, so a bad value ends the run before anything loads."""
        for dest, ok, must in rules:
            value = getattr(args, dest)
            if value is not None and not ok(value):
                self.error(f"--{dest} {value}: must be {must}")

    def error(self, message: str) -> NoReturn:
        flags = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        others = {script: trainer_flags(script) for script in TRAINERS if script != self.prog}
        if get_local_rank() == 0:
            sys.stderr.write(f"{self.prog}: error: {suggest_flags(message, flags, others)} (see {self.prog} --help)\n")
            sys.stderr.flush()
        wait_for_first_rank()
        raise SystemExit(2)


# the torchrun agent that started this rank (None outside torchrun): when it dies, a rank's next collective or store
# call fails with gloo's "Connection reset by peer", whose cause is the agent's death (`agent_death_line`)
AGENT_PID = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


def agent_death_line(agent_pid: int | None) -> str | None:
    """The cause to report when this rank's torchrun agent `agent_pid` has died (the rank was re-parented), else
    None."""
    if agent_pid is None or os.getppid() == agent_pid:
        return None
    return (f"the torchrun agent (pid {agent_pid}) died, so this rank lost its launcher and the rendezvous store; "
            f"the last finished step is written when rank 0 got to it: start the run again with --resume auto")


def run_cli(main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> None:
    """Run a trainer's `main(argv)`. An exception ends the process with status 1 after one line on the console
    (`error: Type: message`; for errors every rank raises alike, only each node's first rank) and its traceback in the run's log file
    (`<output_dir>/train.log`, every rank, "[rank N]"-prefixed); without a log file yet the traceback stays on the
    console. An error a full disk caused is one line naming that disk, its free space and how to continue
    (`lifecycle.disk_full_line`), never a traceback on the console. A stop signal during the start-up
    (`lifecycle.StoppedBySignal`; a Ctrl-C before its handler, KeyboardInterrupt) is one line and exit status
    128 + the signal number. SystemExit passes through unchanged."""
    try:
        main(argv)
    except SystemExit:
        raise
    except StoppedBySignal as stop:
        _stopped_by_signal(stop.signum)
    except KeyboardInterrupt:
        _stopped_by_signal(signal.SIGINT)
    except Exception as error:  # noqa: BLE001 (every failure gets its one line)
        _report_error(error)
        if isinstance(error, REFUSALS):  # every rank refused alike, no collective is in flight: leave the group
            _leave_process_group()  # (exiting with it alive has aborted a rank with "terminate called ...")
        if isinstance(error, RELAYED_ERRORS):  # its line is the node's first rank's to print
            wait_for_first_rank()
        raise SystemExit(1) from None


def _console_line(line: str) -> None:
    """Write one line to stderr; a console or log that cannot be written never turns into a second error."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _report_error(error: BaseException) -> None:
    """`run_cli`'s report of `error`: the traceback to the log (or, without one, to the console unless the error is
    a refusal or a full disk), then its one line on the ranks that print it."""
    rank = launch_rank()
    log = log_only("".join(traceback.format_exception(error)))
    where = f" (traceback in {log})" if log else ""
    log_path = console_log_path()
    full = disk_full_line(error, os.path.dirname(log_path) if log_path else os.getcwd())
    if log is None and not isinstance(error, REFUSALS) and full is None:
        try:
            traceback.print_exception(error, file=sys.stderr)
        except (OSError, ValueError):
            pass
    if get_local_rank() == 0 or not isinstance(error, RELAYED_ERRORS):
        prefix = "" if rank == 0 else f"[rank {rank}] "
        # the cause first: a dead agent, or a frozen rank named before a bare collective timeout
        explanation = agent_death_line(AGENT_PID) or collective_explanation(error)
        if explanation:
            _console_line(f"{prefix}{explanation}")
        _console_line(f"{prefix}error: {full or one_line_error(error)}{where}")


def _stopped_by_signal(signum: int) -> NoReturn:
    """A stop signal before the training loop: one line (each node's first rank; every rank's in the log), leave
    the process group, exit with 128 + `signum`."""
    line = signal_stop_line(signum)
    if get_local_rank() == 0:
        _console_line(line)
    else:
        log_only(line)
    _leave_process_group()
    raise SystemExit(128 + signum) from None


def _leave_process_group() -> None:
    """Destroy the process group before a refusal exits; a failure here never replaces the refusal's own line."""
    try:
        cleanup_distributed()
    except Exception:  # noqa: BLE001
        pass
