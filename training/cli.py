"""The trainers' command line: one clear line per failure on the console, the traceback in the log.

Under torchrun every rank parses the flags and runs the same start-up checks, so every rank sees the same mistake.
`ArgumentParser` (a bad or misspelt flag) and `run_cli` (an error while running) print one line on the first rank
of each node (rank 0 on one machine: each node has its own console) and nothing on the other ranks' consoles;
`run_cli` writes the full traceback of every rank to `<output_dir>/train.log` (`training.logs.tee_console`).
torchrun's own ChildFailedError summary still follows the line: it is torchrun's. Errors that the ranks raise one
by one (not relayed to every rank, e.g. a crash in one rank's own work) are printed by every rank that has them,
prefixed "[rank N]".
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import traceback
from typing import Callable, Iterable, NoReturn, Sequence

from .checkpoint import CheckpointError
from .distributed import RankFailed, cleanup_distributed, get_local_rank, launch_rank
from .lifecycle import RunLockError, collective_explanation
from .logs import HelpFormatter, log_only
from .preflight import PreflightError

__all__ = ["ArgumentParser", "run_cli", "suggest_flags", "one_line_error"]

# Raised alike on every rank (computed by each, or relayed from rank 0 / the failing rank): one line per node says it
RELAYED_ERRORS: tuple[type[BaseException], ...] = (PreflightError, CheckpointError, RankFailed, RunLockError)
# Refusals of the inputs (they say what is wrong and the fix): no traceback on the console even before the log exists
REFUSALS: tuple[type[BaseException], ...] = (PreflightError, CheckpointError, RunLockError)


def suggest_flags(message: str, flags: Iterable[str]) -> str:
    """argparse's error `message` plus "did you mean --x?" for each unknown `--flag` in it that is close to one of
    `flags` (difflib); the message unchanged when there is none."""
    known = sorted(set(flags))
    hints = []
    for token in re.findall(r"(?<![\w-])(--[\w-]+)", message):
        if token in known:
            continue
        close = difflib.get_close_matches(token, known, n=1, cutoff=0.6)
        if close:
            hints.append(f"{token}: did you mean {close[0]}?")
    return message + ("; " + "; ".join(hints) if hints else "")


def one_line_error(error: BaseException) -> str:
    """`Type: message` of an exception, its lines joined into one line."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the trainers: `--help` shows every default (`HelpFormatter`), and a bad flag is one line on
    each node's first rank only (`prog: error: <what>; did you mean --x? (see prog --help)`), exit status 2."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        flags = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        if get_local_rank() == 0:
            sys.stderr.write(f"{self.prog}: error: {suggest_flags(message, flags)} (see {self.prog} --help)\n")
            sys.stderr.flush()
        raise SystemExit(2)


def run_cli(main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> None:
    """Run a trainer's `main(argv)`. An exception ends the process with status 1 after one line on the console
    (`error: Type: message`; for errors every rank raises alike, only each node's first rank) and its traceback in the run's log file
    (`<output_dir>/train.log`, every rank, "[rank N]"-prefixed); without a log file yet the traceback stays on the
    console. SystemExit and KeyboardInterrupt pass through unchanged."""
    try:
        main(argv)
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as error:  # noqa: BLE001 (every failure gets its one line)
        rank = launch_rank()
        log = log_only("".join(traceback.format_exception(error)))
        where = f" (traceback in {log})" if log else ""
        if log is None and not isinstance(error, REFUSALS):
            traceback.print_exception(error, file=sys.stderr)
        if get_local_rank() == 0 or not isinstance(error, RELAYED_ERRORS):
            prefix = "" if rank == 0 else f"[rank {rank}] "
            explanation = collective_explanation(error)  # a frozen rank named before a bare collective timeout
            if explanation:
                sys.stderr.write(f"{prefix}{explanation}\n")
            sys.stderr.write(f"{prefix}error: {one_line_error(error)}{where}\n")
            sys.stderr.flush()
        if isinstance(error, REFUSALS):  # every rank refused alike, no collective is in flight: leave the group
            _leave_process_group()  # (exiting with it alive has aborted a rank with "terminate called ...")
        raise SystemExit(1) from None


def _leave_process_group() -> None:
    """Destroy the process group before a refusal exits; a failure here never replaces the refusal's own line."""
    try:
        cleanup_distributed()
    except Exception:  # noqa: BLE001
        pass
