"""torch.profiler traces of one training step and the table read from them (`scripts/bench_step.py --profile`).

`step_profiler` records one step of a loop (wait / warmup / active schedule, CPU + CUDA activities, no shapes, no
stacks, no memory: a small trace) and writes it as gzipped Chrome-trace JSON. `profile_table` is a pure function of
the trace's events: per phase (the `timing_s/<name>` ranges that `training.timer` annotates, and the whole step,
`ProfilerStep#N`) the wall time, the time the device was busy / idle, the longest idle gap, the host reads
(`aten::_local_scalar_dense`, what `.item()`, `bool(tensor)` and `float(tensor)` dispatch to) and the explicit
synchronisations, and the top kernels by their time on the device. `format_profile_table` prints it.

Because `training.timer` synchronises CUDA at the start and the end of every phase, every kernel launched in a phase
also runs inside the phase's wall-time window, so attributing device work to a phase by time is exact there.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

__all__ = ["step_profiler", "export_trace", "load_trace", "PhaseRow", "KernelRow", "ProfileTable", "profile_table",
           "format_profile_table", "PHASE_PREFIX"]

PHASE_PREFIX = "timing_s/"          # the record_function names of `training.timer`
STEP_PREFIX = "ProfilerStep#"       # torch.profiler's own annotation of each scheduled step
DEVICE_CATEGORIES = {"cuda": ("kernel", "gpu_memcpy", "gpu_memset"), "cpu": ("cpu_op",)}
HOST_READ_OPS = ("aten::_local_scalar_dense",)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def step_profiler(path: str, *, step: int, first_step: int, cuda: bool) -> torch.profiler.profile:
    """A (not yet started) profiler that records iteration `step` of a loop whose first iteration is `first_step`,
    with one warm-up iteration before it when there is one; call `.step()` after every iteration. The trace is
    written to `path` (gzipped Chrome JSON) when the step ends. Activities: CPU, plus CUDA when `cuda`."""
    if step < first_step:
        raise ValueError(f"profile step {step} comes before the loop's first step {first_step}")
    warmup = 1 if step > first_step else 0
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    return torch.profiler.profile(
        activities=activities, record_shapes=False, profile_memory=False, with_stack=False,
        schedule=torch.profiler.schedule(wait=step - first_step - warmup, warmup=warmup, active=1, repeat=1),
        on_trace_ready=lambda prof: export_trace(prof, path))


def export_trace(prof: torch.profiler.profile, path: str) -> None:
    """Write `prof`'s Chrome trace to `path` gzipped (exported to a plain file first, then compressed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    plain = path[:-3] if path.endswith(".gz") else path + ".plain"
    prof.export_chrome_trace(plain)
    with open(plain, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(plain)


def load_trace(path: str) -> list[dict[str, Any]]:
    """The `traceEvents` of a Chrome trace file (gzipped or not)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return list(data["traceEvents"] if isinstance(data, dict) else data)


@dataclass(frozen=True)
class PhaseRow:
    """One phase: wall time of its windows, the device's busy (union of device intervals) and idle time inside
    them, the longest idle gap, device events started in it, host reads and explicit synchronisations. ms."""

    phase: str
    wall_ms: float
    busy_ms: float
    idle_ms: float
    longest_idle_ms: float
    device_events: int
    host_reads: int
    syncs: int


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
class ProfileTable:
    device: str
    phases: list[PhaseRow] = field(default_factory=list)
    kernels: list[KernelRow] = field(default_factory=list)


def _windows(events: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Phase name -> [(start, end) us]: `timing_s/<name>` annotations as <name>, `ProfilerStep#N` as "step"."""
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "user_annotation":
            continue
        name = str(e.get("name", ""))
        phase = "step" if name.startswith(STEP_PREFIX) else name[len(PHASE_PREFIX):] \
            if name.startswith(PHASE_PREFIX) else None
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
    and the profiled step ("step"), ordered by first start; a phase's windows are summed. `top` kernels per phase
    by self time. Raises ValueError when the trace holds no phase or no device event of the kind asked for."""
    if device not in DEVICE_CATEGORIES:
        raise ValueError(f"device must be one of {sorted(DEVICE_CATEGORIES)}, got {device!r}")
    windows = _windows(events)
    if not windows:
        raise ValueError("the trace has no phase annotations (timing_s/<name> or ProfilerStep#N)")
    spans, names = [], []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES[device]:
            start = float(e["ts"])
            spans.append((start, start + float(e.get("dur", 0.0)), (e.get("pid"), e.get("tid"))))
            names.append(str(e.get("name", "?")))
    if not spans:
        raise ValueError(f"the trace has no {device} device events ({DEVICE_CATEGORIES[device]})")
    own = _self_times(spans)
    intervals = sorted((s, e) for s, e, _ in spans)
    marks = [(float(e["ts"]), str(e.get("name", ""))) for e in events
             if e.get("ph") == "X" and str(e.get("name", "")) in HOST_READ_OPS + SYNC_CALLS]
    table = ProfileTable(device=device)
    for phase in sorted(windows, key=lambda p: (min(w[0] for w in windows[p]), p != "step")):
        wall = busy = longest = 0.0
        started, totals, counts = 0, {}, {}
        reads = syncs = 0
        for lo, hi in windows[phase]:
            covered, gap = _union_in(intervals, lo, hi)
            wall, busy, longest = wall + hi - lo, busy + covered, max(longest, gap)
            for (start, _, _), name, t in zip(spans, names, own):
                if lo <= start < hi:
                    started += 1
                    totals[name] = totals.get(name, 0.0) + t
                    counts[name] = counts.get(name, 0) + 1
            reads += sum(1 for ts, name in marks if lo <= ts < hi and name in HOST_READ_OPS)
            syncs += sum(1 for ts, name in marks if lo <= ts < hi and name in SYNC_CALLS)
        table.phases.append(PhaseRow(phase, wall / 1e3, busy / 1e3, (wall - busy) / 1e3, longest / 1e3, started,
                                     reads, syncs))
        for name in sorted(totals, key=lambda n: -totals[n])[:top]:
            table.kernels.append(KernelRow(phase, name, totals[name] / 1e3, counts[name],
                                           totals[name] / busy if busy > 0 else 0.0))
    return table


def format_profile_table(table: ProfileTable, *, name_width: int = 70) -> str:
    """The table as text: one line per phase, then the top kernels of each phase."""
    lines = [f"{'phase':<14} {'wall ms':>10} {'busy ms':>10} {'idle ms':>10} {'idle %':>6} {'max gap ms':>10} "
             f"{'events':>8} {'.item()':>7} {'syncs':>6}"]
    for r in table.phases:
        idle = 100.0 * r.idle_ms / r.wall_ms if r.wall_ms > 0 else 0.0
        lines.append(f"{r.phase:<14} {r.wall_ms:>10.1f} {r.busy_ms:>10.1f} {r.idle_ms:>10.1f} {idle:>6.1f} "
                     f"{r.longest_idle_ms:>10.2f} {r.device_events:>8d} {r.host_reads:>7d} {r.syncs:>6d}")
    label = "kernel" if table.device == "cuda" else "CPU op (self time)"
    for phase in dict.fromkeys(k.phase for k in table.kernels):
        lines.append(f"\ntop {label}s in {phase}:")
        for k in (k for k in table.kernels if k.phase == phase):
            name = k.name if len(k.name) <= name_width else k.name[:name_width - 3] + "..."
            lines.append(f"  {k.total_ms:>10.2f} ms {100 * k.share:>5.1f}% {k.count:>7d}x  {name}")
    return "\n".join(lines)
