#!/usr/bin/env python3
"""Compare finished (or running) runs from their TensorBoard logs: one row per run and metric with the last value,
the best value and the step it was reached at, plus the run's last step and wall time.

    python3 scripts/compare_runs.py outputs/*                                # every val-core/* metric
    python3 scripts/compare_runs.py outputs/nft outputs/dppo --prefix val-core/ --prefix critic/rewards/mean

A run is a trainer's --output_dir (it holds tensorboard/); other folders are skipped with a note on stderr.
"Best" is the maximum (rewards: higher is better). Steps are the trainers' global steps; the time is the span
between the run's first and last logged event (a resumed run's gap included).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float, float]]]:
    """{tag: [(step, value, wall_time), ...]} of `<run_dir>/tensorboard` (all event files, resumes included)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def summarize(scalars: dict[str, list[tuple[int, float, float]]], prefixes: list[str]) -> dict:
    """{"last_step", "time" (h:mm:ss), "metrics": {tag: (last, best, best_step)}} for the tags starting with a
    prefix."""
    everything = [e for values in scalars.values() for e in values]
    metrics = {}
    for tag in sorted(scalars):
        if any(tag.startswith(p) for p in prefixes):
            values = sorted(scalars[tag])  # by step
            best = max(values, key=lambda e: e[1])
            metrics[tag] = (values[-1][1], best[1], best[0])
    seconds = max(e[2] for e in everything) - min(e[2] for e in everything) if everything else 0.0
    return {"last_step": max((e[0] for e in everything), default=0),
            "time": str(datetime.timedelta(seconds=round(seconds))), "metrics": metrics}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories (trainers' --output_dir)")
    parser.add_argument("--prefix", action="append", default=None,
                        help="metric tags to show: any tag starting with this; repeat it for several (default: "
                             "val-core/)")
    args = parser.parse_args(argv)
    args.prefix = args.prefix or ["val-core/"]
    rows = []
    for run in args.runs:
        if not os.path.isdir(os.path.join(run, "tensorboard")):
            if os.path.isdir(run):
                print(f"skipping {run}: no tensorboard/ folder (not a trainer's --output_dir)", file=sys.stderr)
            continue
        summary = summarize(read_scalars(run), args.prefix)
        if not summary["metrics"]:
            rows.append((run, summary, "(no metric matches " + " ".join(args.prefix) + ")", None))
        for tag, values in summary["metrics"].items():
            rows.append((run, summary, tag, values))
    if not rows:
        sys.exit("no runs found: pass trainers' --output_dir folders (they hold tensorboard/)")
    run_w = max(len("run"), *(len(r[0]) for r in rows))
    tag_w = max(len("metric"), *(len(r[2]) for r in rows))
    print(f"{'run':<{run_w}}  {'steps':>6} {'time':>9}  {'metric':<{tag_w}}  {'last':>10} {'best':>10} {'@step':>6}")
    for run, summary, tag, values in rows:
        last, best, best_step = values if values else ("", "", "")
        fmt = lambda v: f"{v:>10.4f}" if isinstance(v, float) else f"{v:>10}"  # noqa: E731
        print(f"{run:<{run_w}}  {summary['last_step']:>6} {summary['time']:>9}  {tag:<{tag_w}}  {fmt(last)} "
              f"{fmt(best)} {best_step:>6}")


if __name__ == "__main__":
    main()
