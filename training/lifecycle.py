"""A run's life on a shared machine: one live run per --output_dir (`RunLock`, an advisory `fcntl.flock` on
<output_dir>/RUN_LOCK holding who holds it), no orphans (`watch_parent`: a trainer rank whose torchrun agent died
exits, and its rollout workers die with it through their parent-death signal, `engines.worker._die_with_parent`), and a
frozen rank named (`start_heartbeats`, `install_collective_explainer`: heartbeat files under
<output_dir>/.heartbeats), a stop signal during the start-up ended at once in one line (`stop_at_once_on_signals`,
`StoppedBySignal`), one during training at the next step boundary (`StopSignals`), and a full disk named as one,
whatever error it surfaced as (`disk_full_line`)."""

from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["RUN_LOCK", "RunLockError", "RunLock", "pid_alive", "describe_holder", "watch_parent", "silent_ranks",
           "describe_silent", "start_heartbeats", "install_collective_explainer", "collective_explanation",
           "HEARTBEAT_STALE_S", "run_lock_held", "STOP_SIGNALS", "StoppedBySignal", "stop_at_once_on_signals",
           "signal_stop_line", "StopSignals", "say_from_thread", "DISK_FULL_ERRNOS", "is_disk_full",
           "free_space_text", "disk_full_line"]

RUN_LOCK = "RUN_LOCK"


class RunLockError(RuntimeError):
    """--output_dir is held by a live run; the message names it (host, pids, start) and the fix."""


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def describe_holder(holder: dict[str, Any]) -> str:
    """'host H, pid P (torchrun agent A; ranks ...), started T' for a lock file's content."""
    ranks = holder.get("ranks") or []
    extra = [f"torchrun agent {holder['agent_pid']}"] if holder.get("agent_pid") else []
    others = [f"{r['host']}:{r['pid']}" for r in ranks[1:]]
    if others:
        extra.append("other ranks " + ", ".join(others))
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}"
            + (f" ({'; '.join(extra)})" if extra else "") + f", started {holder.get('started_at', '?')}")


@dataclass
class RunLock:
    """The advisory lock of one run on `output_dir` (see `acquire`); `release` (or the process's death, which the
    kernel turns into an unlock) frees it."""

    path: str
    fd: int
    message: str  # what acquiring did, for the log ("" on a clean start)

    @classmethod
    def acquire(cls, output_dir: str, *, ranks: Sequence[dict[str, Any]] = (), command: str | None = None,
                wait_s: float = 2.0) -> "RunLock":
        """Take <output_dir>/RUN_LOCK (created if missing) with a non-blocking exclusive `flock` and write this run
        into it: host, pid, the torchrun agent's pid (the parent, under torchrun), every rank's host and pid
        (`ranks`), start time and command line. Held by a live run: RunLockError naming it (after up to `wait_s`
        for a holder that has not written itself in yet). A file left by a run that died without releasing it (the
        kernel dropped its lock) is taken over, and `message` says so, naming that run and why it is stale."""
        os.makedirs(output_dir, exist_ok=True)
        path = os.path.join(output_dir, RUN_LOCK)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _read_holder(fd)
                if holder or time.monotonic() >= deadline:
                    os.close(fd)
                    who = describe_holder(holder) if holder else "a process that has not written itself in yet"
                    raise RunLockError(
                        f"--output_dir {output_dir} is in use by a live run ({who}; lock {path}): two runs would "
                        f"interleave their checkpoints and logs. Stop that run first, or pass another --output_dir")
                time.sleep(0.1)
        previous = _read_holder(fd)
        message = ""
        if previous:
            message = f"took over the run lock {path} of a run that ended without releasing it " \
                      f"({describe_holder(previous)}: {_why_stale(previous)})"
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "agent_pid": os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None,
                  "ranks": list(ranks) or [{"host": socket.gethostname(), "pid": os.getpid()}],
                  "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": command if command is not None else " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder, indent=1) + "\n").encode(), 0)
        os.fsync(fd)
        return cls(path, fd, message)

    def release(self) -> None:
        """Empty the lock file (a clean end leaves nothing to take over) and unlock it; idempotent."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1


def run_lock_held(output_dir: str) -> bool:
    """Whether a live process holds <output_dir>/RUN_LOCK (an exclusive `flock` that a shared, non-blocking one
    cannot join); False when there is no lock file or it cannot be read."""
    try:
        fd = os.open(os.path.join(output_dir, RUN_LOCK), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also drops the shared lock


def _read_holder(fd: int) -> dict[str, Any]:
    """The JSON a holder wrote into the lock file ({} when empty or unreadable)."""
    try:
        raw = os.pread(fd, 1 << 16, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}


def _why_stale(holder: dict[str, Any]) -> str:
    """Why a lock file whose flock was free is stale, in words."""
    if holder.get("host") != socket.gethostname():
        return f"its lock was released on host {holder.get('host')}"
    pid = int(holder.get("pid") or 0)
    return f"pid {pid} is dead" if not pid_alive(pid) else f"pid {pid} now belongs to another process"


# The helper threads below stop and are joined at exit, before the interpreter finalizes: a daemon thread still
# running then is ended with pthread_exit, which aborts a process holding C++ frames ("terminate called without an
# active exception"; gloo's own threads did the same while the process group outlived destroy_process_group, see
# training/distributed.py).
_STOPPING = threading.Event()
_THREADS: list[threading.Thread] = []


def stop_helper_threads(timeout_s: float = 5.0) -> None:
    """Ask the watchdog and heartbeat threads to stop and join them (registered with atexit)."""
    _STOPPING.set()
    for thread in _THREADS:
        if thread is not threading.current_thread():
            thread.join(timeout_s)


atexit.register(stop_helper_threads)


def _start(target: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    _THREADS.append(thread)
    thread.start()
    return thread


def watch_parent(on_orphaned: Callable[[int, int], None], *, interval_s: float = 1.0,
                 parent: int | None = None) -> threading.Thread:
    """Start a daemon thread that calls `on_orphaned(old_parent, new_parent)` once this process's parent changes
    (it died: the process was re-parented to init or a subreaper), checking every `interval_s`. `parent`: the pid
    to watch (default: the current parent). A parent already gone at the call is reported at the first check."""
    expected = os.getppid() if parent is None else parent

    def loop() -> None:
        while not _STOPPING.is_set():
            now = os.getppid()
            if now != expected:
                on_orphaned(expected, now)
                return
            _STOPPING.wait(interval_s)

    return _start(loop, "parent-watchdog")


HEARTBEATS = ".heartbeats"
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_STALE_S = 30.0  # a rank silent this long is named (frozen by SIGSTOP, swapped out, hung holding the GIL)


def heartbeat_path(output_dir: str, rank: int) -> str:
    return os.path.join(output_dir, HEARTBEATS, f"rank_{rank:05d}.json")


def silent_ranks(output_dir: str, world: int, *, stale_s: float = HEARTBEAT_STALE_S,
                 now: float | None = None) -> list[tuple[int, float, dict[str, Any]]]:
    """(rank, seconds since its last heartbeat, its host/pid) of every rank whose heartbeat file under
    <output_dir>/.heartbeats is older than `stale_s` (or missing), oldest first."""
    now = time.time() if now is None else now
    out = []
    for rank in range(world):
        path = heartbeat_path(output_dir, rank)
        try:
            age = now - os.path.getmtime(path)
            with open(path, encoding="utf-8") as f:
                who = json.load(f)
        except (OSError, ValueError):
            age, who = float("inf"), {}
        if age > stale_s:
            out.append((rank, age, who))
    return sorted(out, key=lambda item: -item[1])


def describe_silent(silent: Sequence[tuple[int, float, dict[str, Any]]]) -> str:
    """'rank 1 (host h, pid 123): no sign of life for 64 s' for each silent rank, joined by '; '."""
    return "; ".join(f"rank {rank} (host {who.get('host', '?')}, pid {who.get('pid', '?')}): "
                     + (f"no sign of life for {age:.0f} s" if age != float("inf") else "no heartbeat at all")
                     for rank, age, who in silent)


def start_heartbeats(output_dir: str, rank: int, world: int, *, interval_s: float = HEARTBEAT_INTERVAL_S,
                     stale_s: float = HEARTBEAT_STALE_S, say: Callable[[str], None] | None = None) -> None:
    """Every rank touches <output_dir>/.heartbeats/rank_R.json every `interval_s` from a daemon thread (a rank
    stopped by SIGSTOP or frozen stops touching it); rank 0 also watches the others and, through `say`, names a
    rank once it has been silent for `stale_s` (and again when it is back). `install_collective_explainer` uses
    the same files to name the silent ranks when a collective times out."""
    os.makedirs(os.path.join(output_dir, HEARTBEATS), exist_ok=True)
    me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "rank": rank})
    path = heartbeat_path(output_dir, rank)

    started = time.monotonic()

    def beat() -> None:
        named: set[int] = set()
        while not _STOPPING.is_set():
            try:
                with open(path + ".tmp", "w", encoding="utf-8") as f:
                    f.write(me)
                os.replace(path + ".tmp", path)
            except OSError:
                pass
            # a rank that has not written its first heartbeat yet is only named once it had stale_s to do so
            if rank == 0 and say is not None and world > 1 and time.monotonic() - started >= stale_s:
                silent = [s for s in silent_ranks(output_dir, world, stale_s=stale_s) if s[0] != 0]
                for entry in silent:
                    if entry[0] not in named:
                        say(f"WARNING: {describe_silent([entry])} (frozen by SIGSTOP, swapped out or hung); the "
                            f"other ranks wait for it in their collectives")
                named = {s[0] for s in silent}
            _STOPPING.wait(interval_s)

    _start(beat, "heartbeat")


_COLLECTIVE_KEYS = ("Timed out", "timed out", "Timeout", "Connection closed", "DistBackendError", "Connection reset")
_EXPLAINER: dict[str, Any] = {}  # set by install_collective_explainer: output_dir, world, stale_s


def collective_explanation(error: BaseException) -> str | None:
    """One line naming the ranks that stopped sending heartbeats, when `error` looks like a failed collective (a
    gloo/NCCL timeout, a peer that closed its connection) and `install_collective_explainer` ran; else None."""
    text = f"{type(error).__name__}: {error}"
    if not _EXPLAINER or not any(key in text for key in _COLLECTIVE_KEYS):
        return None
    silent = silent_ranks(_EXPLAINER["output_dir"], _EXPLAINER["world"], stale_s=_EXPLAINER["stale_s"])
    if not silent:
        return None
    return (f"a collective failed while these ranks were silent: {describe_silent(silent)} (frozen by SIGSTOP, "
            f"swapped out or hung?)")


def install_collective_explainer(output_dir: str, world: int, *, stale_s: float = HEARTBEAT_STALE_S) -> None:
    """Name the silent ranks before a failed collective's error (`collective_explanation`): `training.cli.run_cli`
    prints the line before its one error line, and `sys.excepthook` is wrapped for errors that escape it, so a
    frozen rank is named instead of a bare timeout."""
    _EXPLAINER.update(output_dir=output_dir, world=world, stale_s=stale_s)
    previous = sys.excepthook

    def hook(kind, value, tb) -> None:
        line = collective_explanation(value)
        if line:
            try:
                print(line, file=sys.stderr, flush=True)
            except (OSError, ValueError):  # a lost console or a full disk under the log: the error still shows
                pass
        previous(kind, value, tb)

    sys.excepthook = hook


# the signals that stop a run: a scheduler's SIGTERM, a terminal's Ctrl-C (SIGINT) and a closed terminal or SSH
# session (SIGHUP, which torchrun forwards to the ranks like the other two)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# STOP_SIGNALS (lifecycle.py) stop a run at a step boundary with a checkpoint: a scheduler's SIGTERM, a terminal's
# Ctrl-C (SIGINT) and a closed terminal or SSH session (SIGHUP, which torchrun forwards to the ranks like the other
# two); during the start-up, before any step, they end it at once (`stop_at_once_on_signals`)


class StopSignals:
    """SIGTERM / SIGINT / SIGHUP on a trainer rank: the first asks for a stop at the next step boundary
    (`lifeboat.Lifeboat.stop_if_asked`, called by `Run.steps`: every rank stops at the same step, with a
    checkpoint); a repeat more than 3 s later (an operator's second Ctrl-C) stops at once without one. Repeats
    within 3 s are the same request: torchrun forwards a terminal Ctrl-C that the ranks also received directly."""

    def __init__(self, announce: bool = True) -> None:
        self.signum = 0
        self.received_at: float | None = None
        self.announce = announce
        self.on_signal: Any = None  # called once, from a helper thread, the moment the first stop signal lands

    def install(self, on_signal: Any = None) -> "StopSignals":
        """Handle the `STOP_SIGNALS` (main thread only). `on_signal(signum)`, when given, runs in a daemon thread as
        soon as the first one arrives, even while the main thread is blocked in C code (a collective, a long
        forward): Python runs signal handlers only between bytecodes of the main thread, but the C-level handler
        writes the signal number to `signal.set_wakeup_fd`'s socket at once, which that thread reads."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        if on_signal is not None:
            self.on_signal = on_signal
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (reader, writer)  # kept alive with the handler
            watcher = threading.Thread(target=self._watch, args=(reader,), name="stop-signal", daemon=True)
            watcher.start()
            atexit.register(self._close_wakeup, watcher)  # joined before the interpreter finalizes (lifecycle.py)
        return self

    def _close_wakeup(self, watcher: threading.Thread) -> None:
        """At exit: stop the wake-up socket (its reader then sees EOF and the watcher thread returns), join it."""
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # not the main thread
            pass
        self._wakeup[1].close()
        watcher.join(5.0)

    def _watch(self, reader: socket.socket) -> None:
        while True:
            data = reader.recv(64)
            if not data:
                return
            for signum in data:
                if signum in STOP_SIGNALS:
                    self.on_signal(signum)
                    return

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.signum and now - self.received_at > 3.0:
            if self.announce:
                os.write(2, f"second {name}: stopping now, without a checkpoint; resume with --resume auto\n".encode())
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not self.signum:
            self.signum, self.received_at = signum, now
            if self.announce:  # os.write: print() is not safe inside a signal handler
                os.write(2, f"received {name}: stopping at the end of this step, with a checkpoint (send it again "
                            f"after 3 s to stop at once)\n".encode())


def say_from_thread(line: str, stream) -> None:
    """Print `line` from a helper thread (not a signal handler); a closed console (a dead launcher) is ignored."""
    try:
        print(line, file=stream, flush=True)
    except (OSError, ValueError):
        pass


class StoppedBySignal(BaseException):
    """A stop signal during the start-up (flags, checks, model load, rollout workers), before any step ran: there is
    nothing to save, so the start-up ends at once; `training.cli.run_cli` prints one line and exits with 128 + the
    signal number. A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = int(signum)


def signal_stop_line(signum: int) -> str:
    """The one line of a run stopped by signal `signum` during its start-up."""
    name = signal.Signals(signum).name
    return (f"stopped by {name} during the start-up, before any step ran (nothing to save); start it again with "
            f"--resume auto and the same flags")


def stop_at_once_on_signals(repeat_after_s: float = 3.0) -> None:
    """The start-up's handling of the `STOP_SIGNALS` (main thread only): the first raises `StoppedBySignal` in the
    main thread, wherever it is (a model load, a wait for the rollout workers); repeats within `repeat_after_s`
    are the same request (torchrun forwards a terminal's Ctrl-C that the ranks also received), a later one (an
    operator's second Ctrl-C while the stop is still unwinding) ends the process at once by that signal.
    `StopSignals` replaces these handlers once the training loop can stop at a step boundary."""
    first: list[float] = []

    def handle(signum: int, frame) -> None:
        if not first:
            first.append(time.monotonic())
            raise StoppedBySignal(signum)
        if time.monotonic() - first[0] > repeat_after_s:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# the same failures, as text: an error relayed from another rank (`RankFailed`, `on_rank0`) keeps only its message;
# torch's PyTorchStreamWriter reports a short write ("unexpected pos N vs M") without the errno of the full disk
_DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "StorageFull", "unexpected pos ")


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from or during (__cause__, __context__), each once."""
    seen: list[BaseException] = []
    while error is not None and not any(error is e for e in seen):
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` (or one it was raised from) is a full disk or an exhausted quota: an OSError with ENOSPC or
    EDQUOT, or a message that says so (an error relayed from another rank, torch's short write, safetensors')."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if any(text in str(e) for text in _DISK_FULL_TEXTS):
            return True
    return False


def _existing_folder(path: str) -> str:
    """The nearest folder at or above `path` that exists (the disk a file that could not be written is on)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def free_space_text(path: str) -> str:
    """'1.2 GB free' on the disk of `path` (for the user running the run), or '' when it cannot be read."""
    try:
        return f"{_size_text(shutil.disk_usage(_existing_folder(path)).free)} free"
    except OSError:
        return ""


def disk_full_line(error: BaseException, where: str) -> str | None:
    """One line for an error that a full disk caused (`is_disk_full`), naming the disk (the folder of the file that
    could not be written, else `where`, e.g. the run's --output_dir), its free space and how to continue; None for
    any other error."""
    if not is_disk_full(error):
        return None
    names = [e.filename for e in _chain(error) if isinstance(e, OSError) and isinstance(e.filename, str)]
    folder = _existing_folder(os.path.dirname(os.path.abspath(names[0])) if names else where)
    free = free_space_text(folder)
    return (f"the disk of {folder} is full (no space left on device{'; ' + free if free else ''}): nothing already "
            f"saved was damaged; free space there (or give the run a larger disk), then continue with --resume auto "
            f"and the same flags")
