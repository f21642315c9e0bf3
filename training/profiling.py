"""The profile of one training step and the table read from traces (`tools/bench_step.py --profile`).

`ProfileWindow` records a bounded part of one trainer step: from its start to the end of its first K update
micro-steps (the window the update's behaviour repeats in; a whole Qwen-Image DiffusionNFT step is 20 micro-steps
and 14 M trace events), with the project's profiler settings (`engines.profiler.new_profiler`: CPU + CUDA activities, no
shapes, no stacks, no memory) into a gzipped Chrome-trace file (`engines.profiler.export_trace`). The rollout workers record
their generate call with `engines.profiler.step_profiler` (a leaf module: the worker and this module import it,
no arrow up from the rollout layers). `profile_table` is a pure function of the trace's events (`engines.profiler.load_trace`): per phase (the
`timing_s/<name>` ranges that `training.timer` annotates, the window's `update_window`, and the whole step,
`ProfilerStep#N` or the window's `profiled_step`) the wall time, the time the device was busy / idle, the longest idle
gap, the host reads (`aten::_local_scalar_dense`, what `.item()`, `bool(tensor)` and `float(tensor)` dispatch to),
the explicit synchronisations and the memory copies, the top kernels by their time on the device, and which host
ops issued the copies. `format_profile_table` prints it.

Because `training.timer` synchronises CUDA at the start and the end of every phase, every kernel launched in a phase
also runs inside the phase's wall-time window, so attributing device work to a phase by time is exact there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from engines.profiler import export_trace, new_profiler

__all__ = ["ProfileWindow", "PhaseRow", "KernelRow", "LauncherRow", "ProfileTable", "profile_table",
           "format_profile_table", "PHASE_PREFIX", "WINDOW_PHASE", "STEP_PHASE"]

PHASE_PREFIX = "timing_s/"          # the record_function names of `training.timer`
STEP_PREFIX = "ProfilerStep#"       # torch.profiler's own annotation of each scheduled step
STEP_PHASE = "profiled_step"        # `ProfileWindow`'s annotation of the recorded part of its step
WINDOW_PHASE = "update_window"      # `ProfileWindow`'s annotation of its K update micro-steps
MEMCPY_CATEGORY = "gpu_memcpy"
DEVICE_CATEGORIES = {"cuda": ("kernel", "gpu_memcpy", "gpu_memset"), "cpu": ("cpu_op",)}
HOST_READ_OPS = ("aten::_local_scalar_dense",)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class ProfileWindow:
    """Record one training step from its start to the end of its first `micro_steps` update micro-steps (CPU + CUDA
    activities, no shapes / stacks / memory), then stop and write the trace (gzipped Chrome JSON) to `path`.

    `start()` at the step's start; `tick()` at every backward of the update (`GradStepper.backward` calls it):
    the first tick opens the `update_window` annotation, the (micro_steps + 1)-th closes it and stops, so the
    window holds `micro_steps` whole micro-steps in their steady state (backward of one, forwards of the next), and
    the trace also holds what came before the first backward (rollout wait, advantages, old log-probs, first forwards).
    `stop()` at the step's end stops a window that saw fewer ticks (idempotent). micro_steps = 0: the whole step.
    Both ends synchronise CUDA, so every kernel launched inside the window also runs inside it."""

    def __init__(self, path: str, *, micro_steps: int, cuda: bool) -> None:
        if micro_steps < 0:
            raise ValueError(f"--profile_micro_steps must be >= 0, got {micro_steps}")
        self.path, self.micro_steps, self.cuda = path, micro_steps, cuda
        self.ticks = 0
        self._prof: torch.profiler.profile | None = None
        self._ranges: list[Any] = []

    @property
    def recording(self) -> bool:
        return self._prof is not None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _open(self, name: str) -> None:
        self._sync()
        rf = torch.profiler.record_function(PHASE_PREFIX + name)
        rf.__enter__()
        self._ranges.append(rf)

    def start(self) -> None:
        self._prof = new_profiler(self.cuda)
        self._prof.start()
        self._open(STEP_PHASE)

    def tick(self) -> None:
        if not self.recording or self.micro_steps == 0:
            return
        self.ticks += 1
        if self.ticks == 1:
            self._open(WINDOW_PHASE)
        elif self.ticks == self.micro_steps + 1:
            self.stop()

    def stop(self) -> None:
        if not self.recording:
            return
        self._sync()
        for rf in reversed(self._ranges):
            rf.__exit__(None, None, None)
        self._ranges.clear()
        prof, self._prof = self._prof, None
        prof.stop()
        export_trace(prof, self.path)


@dataclass(frozen=True)
class PhaseRow:
    """One phase: wall time of its windows, the device's busy (union of device intervals) and idle time inside
    them, the longest idle gap, device events started in it, host reads, explicit synchronisations and memory
    copies (device events of category gpu_memcpy: device-to-device, host-to-device, ...) started in it. ms."""

    phase: str
    wall_ms: float
    busy_ms: float
    idle_ms: float
    longest_idle_ms: float
    device_events: int
    host_reads: int
    syncs: int
    memcpys: int = 0


@dataclass(frozen=True)
class KernelRow:
    """One kernel name in one phase: its total self time on the device (ms), launches, share of the phase's
    busy time."""

    phase: str
    name: str
    total_ms: float
    count: int
    share: float


@dataclass(frozen=True)
class LauncherRow:
    """Which host code issued a phase's memory copies: the innermost annotation (e.g. `FSDP::pre_forward
    (transformer_blocks.N)`, block numbers folded to N) and the innermost CPU op (e.g. `aten::copy_`) enclosing
    the runtime call that launched them, with the count."""

    phase: str
    annotation: str
    op: str
    count: int


@dataclass(frozen=True)
class ProfileTable:
    device: str
    phases: list[PhaseRow] = field(default_factory=list)
    kernels: list[KernelRow] = field(default_factory=list)
    memcpy_launchers: list[LauncherRow] = field(default_factory=list)


def _windows(events: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Phase name -> [(start, end) us]: `timing_s/<name>` annotations as <name>, `ProfilerStep#N` and a
    `ProfileWindow`'s `timing_s/profiled_step` as "step"."""
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "user_annotation":
            continue
        name = str(e.get("name", ""))
        phase = "step" if name.startswith(STEP_PREFIX) or name == PHASE_PREFIX + STEP_PHASE \
            else name[len(PHASE_PREFIX):] if name.startswith(PHASE_PREFIX) else None
        if phase:
            out.setdefault(phase, []).append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    return out


def _self_times(spans: Sequence[tuple[float, float, Any]]) -> list[float]:
    """Self time of each (start, end, lane) span: its duration less the spans nested in it on the same lane
    (a CPU op's children; device kernels on one stream never nest, so theirs is their duration)."""
    order = sorted(range(len(spans)), key=lambda i: (str(spans[i][2]), spans[i][0], -spans[i][1]))
    own = [s[1] - s[0] for s in spans]
    stack: list[int] = []
    for i in order:
        start, end, lane = spans[i]
        while stack and (spans[stack[-1]][2] != lane or spans[stack[-1]][1] <= start):
            stack.pop()
        if stack:
            own[stack[-1]] -= min(end, spans[stack[-1]][1]) - start
        stack.append(i)
    return own


def _union_in(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> tuple[float, float]:
    """(covered length, longest uncovered gap) of [lo, hi] by `intervals` (sorted by start)."""
    covered, longest, cursor = 0.0, 0.0, lo
    for start, end in intervals:
        if start >= hi:
            break
        start, end = max(start, lo), min(end, hi)
        if end <= start or end <= cursor:
            continue
        if start > cursor:
            longest = max(longest, start - cursor)
            cursor = start
        covered += end - cursor
        cursor = end
    return covered, max(longest, hi - cursor)


def profile_table(events: Sequence[Mapping[str, Any]], *, device: str = "cuda", top: int = 10) -> ProfileTable:
    """The per-phase table of a Chrome trace's events (see the module docstring).

    device "cuda": the device work is the kernel / memcpy / memset events; "cpu" (a CPU-only trace): the CPU ops,
    so "idle" is time no op ran (Python and the loop's own overhead). Phases: every `timing_s/<name>` annotation
    and the profiled step ("step"), ordered by first start; a phase's windows are summed; a phase that outlasts the
    recorded step (still open when a `ProfileWindow` stopped, e.g. the update) is clipped to it and named
    "<phase> (cut)". `top` kernels per phase by self time. Raises ValueError when the trace holds no phase or no device event of the kind asked for."""
    if device not in DEVICE_CATEGORIES:
        raise ValueError(f"device must be one of {sorted(DEVICE_CATEGORIES)}, got {device!r}")
    windows = _windows(events)
    if not windows:
        raise ValueError("the trace has no phase annotations (timing_s/<name> or ProfilerStep#N)")
    if "step" in windows:  # a phase still open when a ProfileWindow stopped: clipped to the window, and named so
        step_end = max(hi for _, hi in windows["step"])
        for phase in [p for p in windows if p != "step"]:
            if any(hi > step_end for _, hi in windows[phase]):
                windows[f"{phase} (cut)"] = [(lo, min(hi, step_end)) for lo, hi in windows.pop(phase)]
    spans, names, copies = [], [], []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES[device]:
            start = float(e["ts"])
            spans.append((start, start + float(e.get("dur", 0.0)), (e.get("pid"), e.get("tid"))))
            names.append(str(e.get("name", "?")))
            copies.append(e.get("cat") == MEMCPY_CATEGORY)
    if not spans:
        raise ValueError(f"the trace has no {device} device events ({DEVICE_CATEGORIES[device]})")
    own = _self_times(spans)
    intervals = sorted((s, e) for s, e, _ in spans)
    marks = [(float(e["ts"]), str(e.get("name", ""))) for e in events
             if e.get("ph") == "X" and str(e.get("name", "")) in HOST_READ_OPS + SYNC_CALLS]
    launchers = _memcpy_launchers(events)
    table = ProfileTable(device=device)
    for phase in sorted(windows, key=lambda p: (min(w[0] for w in windows[p]), p != "step")):
        wall = busy = longest = 0.0
        started, totals, counts, by_launcher = 0, {}, {}, {}
        reads = syncs = memcpys = 0
        for lo, hi in windows[phase]:
            covered, gap = _union_in(intervals, lo, hi)
            wall, busy, longest = wall + hi - lo, busy + covered, max(longest, gap)
            for (start, _, _), name, t, copy in zip(spans, names, own, copies):
                if lo <= start < hi:
                    started += 1
                    memcpys += copy
                    totals[name] = totals.get(name, 0.0) + t
                    counts[name] = counts.get(name, 0) + 1
            for start, source in launchers:
                if lo <= start < hi:
                    by_launcher[source] = by_launcher.get(source, 0) + 1
            reads += sum(1 for ts, name in marks if lo <= ts < hi and name in HOST_READ_OPS)
            syncs += sum(1 for ts, name in marks if lo <= ts < hi and name in SYNC_CALLS)
        table.phases.append(PhaseRow(phase, wall / 1e3, busy / 1e3, (wall - busy) / 1e3, longest / 1e3, started,
                                     reads, syncs, memcpys))
        for name in sorted(totals, key=lambda n: -totals[n])[:top]:
            table.kernels.append(KernelRow(phase, name, totals[name] / 1e3, counts[name],
                                           totals[name] / busy if busy > 0 else 0.0))
        for (annotation, op), count in sorted(by_launcher.items(), key=lambda kv: -kv[1])[:LAUNCHERS_SHOWN]:
            table.memcpy_launchers.append(LauncherRow(phase, annotation, op, count))
    return table


LAUNCHERS_SHOWN = 4


def _memcpy_launchers(events: Sequence[Mapping[str, Any]]) -> list[tuple[float, tuple[str, str]]]:
    """(device start us, (innermost annotation, innermost CPU op)) of every memory copy whose launching runtime call
    (same `correlation` id) lies inside a CPU op or annotation of its thread; block numbers in the names are folded
    to N, so that the same code in every block counts as one source. Empty for traces without CPU ops."""
    starts: dict[Any, float] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == MEMCPY_CATEGORY:
            correlation = (e.get("args") or {}).get("correlation")
            if correlation is not None:
                starts[correlation] = float(e["ts"])
    if not starts:
        return []
    calls: dict[Any, list[tuple[float, Any]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime":
            correlation = (e.get("args") or {}).get("correlation")
            if correlation in starts:
                calls.setdefault((e.get("pid"), e.get("tid")), []).append((float(e["ts"]), correlation))
    hosts: dict[Any, list[tuple[float, float, str, bool]]] = {key: [] for key in calls}
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("ph") == "X" and key in hosts and e.get("cat") in ("cpu_op", "user_annotation"):
            start = float(e["ts"])
            hosts[key].append((start, start + float(e.get("dur", 0.0)), str(e.get("name", "")),
                               e.get("cat") == "user_annotation"))
    out = []
    for key, thread_calls in calls.items():
        spans = sorted(hosts[key], key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str, bool]] = []
        i = 0
        for ts, correlation in sorted(thread_calls):
            while i < len(spans) and spans[i][0] <= ts:
                while stack and stack[-1][1] <= spans[i][0]:
                    stack.pop()
                stack.append(spans[i])
                i += 1
            while stack and stack[-1][1] < ts:
                stack.pop()
            annotation = next((s[2] for s in reversed(stack) if s[3]), "-")  # the stack holds what encloses ts
            op = next((s[2] for s in reversed(stack) if not s[3]), "-")
            out.append((starts[correlation], (re.sub(r"\d+", "N", annotation), re.sub(r"\d+", "N", op))))
    return out


def format_profile_table(table: ProfileTable, *, name_width: int = 70) -> str:
    """The table as text: one line per phase, then the top kernels of each phase and what issued its copies."""
    lines = [f"{'phase':<14} {'wall ms':>10} {'busy ms':>10} {'idle ms':>10} {'idle %':>6} {'max gap ms':>10} "
             f"{'events':>8} {'memcpy':>7} {'.item()':>7} {'syncs':>6}"]
    for r in table.phases:
        idle = 100.0 * r.idle_ms / r.wall_ms if r.wall_ms > 0 else 0.0
        lines.append(f"{r.phase:<14} {r.wall_ms:>10.1f} {r.busy_ms:>10.1f} {r.idle_ms:>10.1f} {idle:>6.1f} "
                     f"{r.longest_idle_ms:>10.2f} {r.device_events:>8d} {r.memcpys:>7d} {r.host_reads:>7d} "
                     f"{r.syncs:>6d}")
    label = "kernel" if table.device == "cuda" else "CPU op (self time)"
    for phase in dict.fromkeys(k.phase for k in table.kernels):
        lines.append(f"\ntop {label}s in {phase}:")
        for k in (k for k in table.kernels if k.phase == phase):
            name = k.name if len(k.name) <= name_width else k.name[:name_width - 3] + "..."
            lines.append(f"  {k.total_ms:>10.2f} ms {100 * k.share:>5.1f}% {k.count:>7d}x  {name}")
        launched = [r for r in table.memcpy_launchers if r.phase == phase]
        if launched:
            lines.append(f"  memory copies in {phase} issued by (annotation > op):")
            lines += [f"  {r.count:>17d}x  {r.annotation} > {r.op}" for r in launched]
    return "\n".join(lines)
