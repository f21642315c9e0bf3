"""The console log file, <output_dir>/train.log: rank 0's console and every rank's errors, each line with its UTC
time (`tee_console`). It is held in memory until the run holds its folder's run lock (a run refused by the lock
never writes into the live run's log), and a full disk under it never breaks the run or its error report."""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from typing import Any, Callable

import torch.distributed as dist

from .distributed import get_world_size, launch_rank
from .lifecycle import free_space_text, is_disk_full, run_lock_held

__all__ = ["LOG_FILE", "log_time", "tee_console", "console_log_path", "discard_console_log", "log_only"]


LOG_FILE = "train.log"


def log_time() -> str:
    """The UTC wall-clock time that starts every line of the console log file, e.g. `2026-12-02T15:53:09Z`."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class _LogFile:
    """<output_dir>/train.log as the console tees append to it (opened at the first line written). Held
    (`tee_console(hold=True)`): the lines wait in memory until `release`, so that a run which has not taken its run
    lock yet never writes into the log of another live run in the same folder (`discard` drops them; `settle`
    decides at the end). A write that fails (a full disk, a lost mount) ends the file logging with one warning on
    the console (`warn`), never the run or the error report that may follow."""

    def __init__(self, path: str, *, held: bool, warn: Callable[[str], None]) -> None:
        self.name, self.held, self.warn = path, held, warn
        self.pending: list[str] = []
        self.file: Any = None
        self.failed = False     # a write failed: nothing more is written
        self.discarded = False  # the folder is another live run's: nothing is written

    @property
    def usable(self) -> bool:
        """Whether lines written now reach the file (now or, held, once released)."""
        return not (self.failed or self.discarded)

    def write(self, text: str, *, quiet: bool = False) -> None:
        """Append `text` (held: keep it); a failure is reported once through `warn` unless `quiet`."""
        if not self.usable:
            return
        if self.held:
            self.pending.append(text)
            return
        try:
            if self.file is None:
                os.makedirs(os.path.dirname(self.name) or ".", exist_ok=True)
                self.file = open(self.name, "a", encoding="utf-8")
            self.file.write(text)
            self.file.flush()
        except (OSError, ValueError) as e:  # ValueError: written after close
            self.failed = True
            if not quiet and isinstance(e, OSError):
                self.warn(self._failure_line(e))

    def _failure_line(self, error: OSError) -> str:
        if is_disk_full(error):
            free = free_space_text(self.name)
            why = f"its disk is full{' (' + free + ')' if free else ''}"
        else:
            why = f"{type(error).__name__}: {error}"
        return (f"WARNING: the console log {self.name} cannot be written any more ({why}); the run goes on, its "
                f"console is no longer logged there")

    def release(self, *, quiet: bool = False) -> None:
        """Write the held lines, and every later one, to the file."""
        if self.held:
            self.held = False
            text, self.pending = "".join(self.pending), []
            if text:
                self.write(text, quiet=quiet)

    def discard(self) -> None:
        """Drop the held lines and every later one: the folder is another live run's."""
        self.discarded, self.pending = True, []

    def settle(self, *, quiet: bool = False) -> None:
        """A held log whose run never got to its run lock (a start-up error, a stop): write it, unless a live run
        holds <output_dir>/RUN_LOCK (that run's train.log is not this one's to write into); then drop it."""
        if self.held and self.usable:
            if run_lock_held(os.path.dirname(self.name)):
                self.discard()
            else:
                self.release(quiet=quiet)

    def close(self) -> None:
        """At exit: settle a held log (quietly: the run's own last line said what went wrong), close the file."""
        self.settle(quiet=True)
        if self.file is not None:
            file, self.file = self.file, None  # a later line (another exit hook) opens it again
            try:
                file.close()
            except OSError:
                pass


class _Tee:
    """A text stream that also appends every complete line to a log file (`_LogFile`), after the time (`log_time`)
    and a prefix (e.g. "[rank 1] ")."""

    def __init__(self, stream: Any, log: _LogFile, prefix: str) -> None:
        self.stream, self.log, self.prefix, self.pending = stream, log, prefix, ""
        self.console_lost = False

    def write(self, text: str) -> int:
        n = len(text)
        if not self.console_lost:
            try:
                n = self.stream.write(text)
            except (OSError, ValueError):  # a closed terminal (EIO) or launcher pipe: the log file carries on
                self.console_lost = True
        self.pending += text
        if "\n" in self.pending:  # whole lines only, so the ranks' lines never interleave mid-line
            lines, self.pending = self.pending.rsplit("\n", 1)
            now = log_time()
            self.log.write("".join(f"{now} {self.prefix}{line}\n" for line in lines.split("\n")))
        return n

    def flush(self) -> None:
        if not self.console_lost:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.console_lost = True

    def close_log(self) -> None:
        """At exit: write a last unfinished line (the log file itself is closed once, by `tee_console`'s hook)."""
        if self.pending:
            self.log.write(f"{log_time()} {self.prefix}{self.pending}\n", quiet=True)
            self.pending = ""

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ... of the real stream
        return getattr(self.stream, name)


def _console_warning(stream: Any) -> Callable[[str], None]:
    """A `_LogFile` warning printer on the real console `stream` (a lost console is ignored)."""
    def warn(line: str) -> None:
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass
    return warn


def tee_console(output_dir: str, *, hold: bool = False) -> str:
    """Mirror the console into `<output_dir>/train.log` (appended, so a resumed run continues the same file), every
    line after its UTC time: rank 0's stdout and stderr, and every other rank's stderr with a "[rank N] " prefix
    (tracebacks and warnings of every rank land there). Python-level writes only (C/C++ libraries writing to the fds directly are not
    captured). Works before the process group exists (the rank from torchrun's environment). `hold`: keep the lines
    in memory, not in the file, until a later `tee_console(output_dir)` (`setup_run`: once this run holds the run
    lock of the folder) or, at exit, unless another live run holds it (`_LogFile.settle`); `discard_console_log`
    drops them. Idempotent; returns the log path. A log that cannot be written (a full disk) warns once on the
    console and the run goes on."""
    path = os.path.join(output_dir, LOG_FILE)
    if isinstance(sys.stderr, _Tee):
        if not hold:
            sys.stderr.log.release()
        return path
    rank = launch_rank()
    log = _LogFile(path, held=hold, warn=_console_warning(sys.stderr))
    prefix = "" if rank == 0 else f"[rank {rank}] "
    tees = [_Tee(sys.stderr, log, prefix)]
    sys.stderr = tees[0]
    if rank == 0:
        tees.append(_Tee(sys.stdout, log, ""))
        sys.stdout = tees[1]
        world = get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        log.write(f"{log_time()} ==== {' '.join(sys.argv)} ({world} ranks)\n")
    atexit.register(lambda: ([t.close_log() for t in tees], log.close()))
    return path


def console_log_path() -> str | None:
    """The console log file `tee_console` mirrors into (held or not), or None without one."""
    return sys.stderr.log.name if isinstance(sys.stderr, _Tee) else None


def discard_console_log() -> None:
    """Drop what the console log holds and every later line (`tee_console(hold=True)`): this run was refused the
    run lock of its --output_dir, whose train.log belongs to the live run that holds it."""
    if isinstance(sys.stderr, _Tee):
        sys.stderr.log.discard()


def log_only(text: str) -> str | None:
    """Append `text` to the console log file (`tee_console`), with this rank's line prefix, without showing it on
    the console (a held log is settled first: written, or dropped when another live run holds the folder).
    Returns the log path, or None when no log file is open or it cannot be written (a full disk)."""
    tee = sys.stderr
    if not isinstance(tee, _Tee):
        return None
    tee.log.settle(quiet=True)
    now = log_time()
    tee.log.write("".join(f"{now} {tee.prefix}{line}\n" for line in text.rstrip("\n").split("\n")), quiet=True)
    return tee.log.name if tee.log.usable else None
