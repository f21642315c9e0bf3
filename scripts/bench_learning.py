"""Learning benchmark: DiffusionNFT, Flow-DPPO, Flow-GRPO and an lr = 0 control, run one after another from one
model folder with the same GPU-time budget each, scored by the `rapidocr` OCR reward; held-out reward and
exact-match accuracy against GPU-seconds.

    python3 scripts/bench_learning.py --model_path MODEL --train_files train.parquet --val_files test.parquet \
        --budget_s 90 --out_dir OUT --work_dir /tmp/bench_learning           # one GPU
    python3 scripts/bench_learning.py --smoke --out_dir /tmp/bench_smoke     # CPU: tiny Qwen-Image, 64², 2 steps

Runs (each `torchrun --nproc_per_node 1`, the trainer rank and its rollout worker sharing one device, e.g. cuda:0):
  nft      train_nft.py                        verl-omni's Qwen-Image DiffusionNFT OCR recipe, scaled (see --help)
  dppo     train_dppo.py                       scripts/run_qwen_image_ocr_lora.sh (Flow-DPPO), scaled
  grpo     train_dppo.py --loss flow_grpo      the same recipe with the Flow-GRPO loss (--clip_ratio 1e-5)
  control  train_dppo.py --lr 0                the Flow-DPPO run without updates (see CONTROL_WHY)

Budget: `--budget_s S` passes the trainers' `--max_wall_time_s S` (stop at the first step boundary after S s,
checkpoint, exit 0); `--steps N` runs N steps instead (the smoke path, and the fallback before that flag exists).

Held-out evaluation is the trainers' own validation (`--val_files`, `--val_before_train`, `--test_freq`,
`--val_num_inference_steps`, `--val_seed`: ODE, one sample per prompt, fixed seeds): `val-core/ocr/reward/mean@1`
and the exact-match extra `val-aux/ocr/ocr/exact_match/mean@1`, read back from TensorBoard. GPU-seconds: see
GPU_SECONDS. Outputs in --out_dir: bench_learning.json, bench_learning.png (both curves against GPU-seconds),
bench_learning_grids.png (each run's validation grid at step 0 and at its last step) and bench_learning.log (every
trainer's output), and a final table on stdout naming the algorithm that learned fastest per GPU-second.

From Python (e.g. a CPU learning test): `main(argv)` returns the JSON document (`doc["runs"][name]["gain_vs_control"]`
...); `read_run(run_dir)` and `summarize_runs(records)` work on any trainer output dir with validation.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import io
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "scripts")):
    if path not in sys.path:
        sys.path.insert(0, path)

from trainer_runs import images, run_trainer, scalars  # noqa: E402

REWARD_KEY = "val-core/ocr/reward/mean@1"
EXACT_KEY = "val-aux/ocr/ocr/exact_match/mean@1"   # rewards.py's `ocr/exact_match` extra, as validation logs it
TRAIN_REWARD_KEY = "critic/rewards/mean"
STEP_TIME_KEY = "perf/time_per_step"
GRID_TAG = "val/samples"
FILES = {"json": "bench_learning.json", "plot": "bench_learning.png", "grids": "bench_learning_grids.png",
         "log": "bench_learning.log"}

GPU_SECONDS = (
    "the sum over training steps of the trainer's perf/time_per_step: per RL step, from drawing the batch to the "
    "end of the adapter sync, i.e. rollout on the shared GPU, reward scoring (RapidOCR on the CPU pool, while the "
    "GPU waits), advantages, the update and the sync (timing_s/* gives the split). Not counted: setup (model load, "
    "rollout worker start), validation (val_before_train included), TensorBoard logging and checkpoints. Curve "
    "points sit at the GPU-seconds accumulated up to the validated step.")
CONTROL_WHY = (
    "train_dppo.py with the Flow-DPPO flags and --lr 0: with lr = 0 AdamW changes nothing (decoupled weight decay "
    "is lr * wd = 0), so the policy stays the starting model while the run still does every part of a step (SDE "
    "rollouts, rewards, advantages, replay, backward, sync). Its held-out curve is the noise floor of the "
    "evaluation itself (same prompts and seeds at every validation; drift = non-determinism), and its training "
    "reward the per-step noise of the SDE rollouts that DPPO and GRPO start from. The DiffusionNFT trainer at lr 0 "
    "would validate the same unchanged model.")

# Shared by all four runs: the recipes scaled to one GPU and a small model (SCALING says how and why).
COMMON: dict[str, Any] = dict(
    height=128, width=128, num_inference_steps=10, val_num_inference_steps=20, true_cfg_scale=1.0,
    max_sequence_length=256, train_batch_size=4, rollout_n=16, ppo_mini_batch_size=2, micro_batch_size=32,
    lora_rank=16, lora_alpha=32, lr=1e-3, weight_decay=1e-4, rollout_max_batch_size=64, seed=42, val_seed=42,
    val_before_train=True, test_freq=5, val_max_samples=64, num_val_images=8, log_every=1, keep_last=1,
    save_freq=10**9, resume="never", ocr_backend="rapidocr", rapidocr_det_limit_side_len=256)
SCALING = (
    "One GPU holds the trainer rank and the rollout worker. Batch: 4 prompts x 16 samples per step (the recipes' "
    "rollout_n 16 kept, 32 resp. 24 prompts cut to 4) with 2-prompt mini-batches, so 2 optimizer steps per rollout "
    "step as in all three recipes; micro-batch 32 and rollout batch 64 (the small model fits whole). LoRA rank 16 / "
    "alpha 32 (the recipes' alpha/rank = 2 of 64/128) for a model a few hundred channels wide. lr 1e-3 for every "
    "trained run (recipes: 3e-4 at rank 64 on the 3072-wide Qwen-Image; raised because the budget allows tens of "
    "steps, one value for all so that the algorithms and not their tuning differ), wd 1e-4 (recipes). 128^2 "
    "images, 10 rollout steps (recipes), validation 20 ODE steps (recipes 40/50) on 64 held-out prompts (recipes "
    "256/1018), every 5 steps and before training. true CFG 1.0 for all four (the DiffusionNFT recipe's; the "
    "DPPO/GRPO recipes use 4.0): one sampler, so one start point for every run. Reward: rapidocr (CPU, "
    "Det.limit_side_len 256, a process pool) instead of the Qwen3-VL GenRM. --set KEY=VALUE / ALGO.KEY=VALUE "
    "changes any of these (e.g. --set lr=3e-4 for the recipes' lr).")
DPPO_FLAGS: dict[str, Any] = dict(loss="flow_dppo", kl_mask_threshold=1e-5, noise_level=1.2, sde_type="sde",
                                  sde_window_size=2, sde_window_range="0,5")


@dataclass
class Algorithm:
    name: str
    label: str
    script: str
    flags: dict[str, Any]
    recipe: str


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("nft", "DiffusionNFT", "train_nft.py",
              dict(mix_beta=0.1, ref_kl_coef=1e-4, adv_clip_max=5.0, timestep_fraction=1.0, adv_mode="continuous",
                   old_policy_decay_schedule="delayed_linear_to_0_999", old_policy_update_interval=2),
              "verl-omni Qwen-Image DiffusionNFT OCR LoRA recipe (specs/algorithms.md 8.2): ODE rollouts with the "
              "`old` adapter, mix_beta 0.1, ref_kl_coef 1e-4, adv_clip_max 5, timestep_fraction 1.0, continuous, "
              "old policy delayed_linear_to_0_999 every 2 steps (decay 0 before step 75, so `old` is a copy of the "
              "policy refreshed every 2 steps here; validation samples with `old`, as in verl-omni), true CFG 1.0; "
              "24 prompts x 16, mini 12, LoRA 64/128, lr 3e-4, wd 1e-4"),
    Algorithm("dppo", "Flow-DPPO", "train_dppo.py", dict(DPPO_FLAGS),
              "scripts/run_qwen_image_ocr_lora.sh (verl-omni Flow-DPPO Qwen-Image OCR, specs/algorithms.md 8.2): "
              "kl_mask_threshold 1e-5, add_kl_coefficient, sde, noise 1.2, SDE window 2 in [0,5], 32 prompts x 16, "
              "mini 16, LoRA 64/128, lr 3e-4, wd 1e-4, true CFG 4.0"),
    Algorithm("grpo", "Flow-GRPO", "train_dppo.py",
              dict(DPPO_FLAGS, loss="flow_grpo", clip_ratio=1e-5, adv_clip_max=5.0),
              "the Flow-DPPO recipe with --loss flow_grpo --clip_ratio 1e-5 (verl-omni's Flow-GRPO Qwen-Image OCR "
              "recipe: the same batch, LoRA, lr, SDE window; advantages clamped to +-5)"),
    Algorithm("control", "lr = 0 control", "train_dppo.py", dict(DPPO_FLAGS, lr=0.0), CONTROL_WHY),
)}

# --smoke: the same four runs on CPU with the tiny random-weight Qwen-Image (no learning is expected, only the path).
SMOKE: dict[str, Any] = dict(
    device="cpu", rollout_devices="cpu", rollout_threads=1, height=64, width=64, num_inference_steps=4,
    val_num_inference_steps=2, train_batch_size=2, rollout_n=2, ppo_mini_batch_size=1, micro_batch_size=2,
    lora_rank=4, lora_alpha=8, lr=1e-2, rollout_max_batch_size=16, val_max_samples=2, num_val_images=2,
    test_freq=2, rapidocr_workers=1)
SMOKE_ALGO: dict[str, dict[str, Any]] = {"train_nft.py": dict(timestep_fraction=0.5),   # K = 2 of 4 steps
                                          "train_dppo.py": dict(sde_window_range="0,3")}  # the window fits 4 steps
SMOKE_WORDS = ["open", "stop", "cafe", "exit", "hello", "sale"]
SMOKE_TEMPLATES = {"train": ['A sign that says "{}"', 'A poster with the word "{}"'],
                   "test": ['A label reading "{}"']}


# ----------------------------------------------------------------------------------------------------------------
# Settings and commands
# ----------------------------------------------------------------------------------------------------------------

def parse_overrides(items: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, str]]:
    """--set KEY=VALUE (every run) / ALGO.KEY=VALUE -> {"*" or algo: {key: value}}. Raises on a malformed item,
    an unknown algorithm, or any change to the control's lr (it is 0 by definition)."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE or ALGO.KEY=VALUE (ALGO in {list(names)})")
        scope, dot, key = key.rpartition(".") if "." in key else ("*", "", key)
        if scope != "*" and scope not in names:
            raise ValueError(f"--set {item!r}: unknown algorithm {scope!r}; known: {list(names)}")
        if scope == "control" and key == "lr":
            raise ValueError("--set control.lr: the control runs at lr 0 by definition")
        out.setdefault(scope, {})[key.replace("-", "_")] = value
    return out


def run_flags(algo: Algorithm, common: Mapping[str, Any], overrides: Mapping[str, Mapping[str, str]], *,
              budget_s: float | None, steps: int | None) -> dict[str, Any]:
    """The trainer flags of one run: common settings, the algorithm's recipe flags, the budget, then --set overrides
    (every run's, then this algorithm's: e.g. control.max_wall_time_s=20 shortens only the control). The control's
    lr stays 0 whatever '*' overrides say."""
    if (budget_s is None) == (steps is None):
        raise ValueError("give exactly one of budget_s (the --max_wall_time_s path) and steps")
    budget: dict[str, Any] = ({"total_training_steps": int(steps)} if steps is not None else
                              {"total_training_steps": 10**6, "max_wall_time_s": float(budget_s)})  # time ends it
    flags = {**common, **algo.flags, **budget, **overrides.get("*", {}), **overrides.get(algo.name, {})}
    if algo.name == "control":
        flags["lr"] = 0.0
    return flags


def to_argv(flags: Mapping[str, Any]) -> list[str]:
    """{flag: value} -> argparse argv; True -> a bare switch, False / None / "false" / "none" -> dropped."""
    argv: list[str] = []
    for key, value in flags.items():
        if value is None or value is False or str(value).lower() in ("false", "none"):
            continue
        argv += [f"--{key}"] if value is True or str(value).lower() == "true" else [f"--{key}", str(value)]
    return argv


def trainer_accepts(script: str, flag: str, value: str = "1") -> bool:
    """Whether `script`'s own parser accepts `flag value` (imports the trainer module; parses, runs nothing)."""
    module = importlib.import_module(os.path.splitext(script)[0])
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            module.parse_args(["--model_path", "m", "--train_files", "t", flag, value])
    except SystemExit:
        return False
    return True


def require_flag(scripts: Sequence[str], flag: str) -> None:
    """SystemExit naming the trainers whose parser lacks `flag` (the budget path needs --max_wall_time_s)."""
    missing = [script for script in scripts if not trainer_accepts(script, flag)]
    if missing:
        raise SystemExit(f"{', '.join(missing)} has no {flag} (the trainers' time-budget stop); pass --steps N for "
                         f"a fixed number of steps per run instead")


def check_inputs(model_path: str, train_files: str, val_files: str) -> None:
    """Fail before any run starts: the model folder, both parquet files, and OCR rows in the held-out set."""
    import pyarrow.parquet as pq

    if not os.path.isfile(os.path.join(model_path, "model_index.json")):
        raise FileNotFoundError(f"--model_path {model_path}: no model_index.json (a pipeline folder is needed)")
    for flag, path in (("--train_files", train_files), ("--val_files", val_files)):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{flag} {path}: no such file (make it with data_prep/, e.g. qwen_image_ocr.py)")
    for flag, path in (("--train_files", train_files), ("--val_files", val_files)):
        sources = set(pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist())
        if sources != {"ocr"}:
            raise ValueError(f"{flag} {path}: data_source {sorted(sources)}; this benchmark trains and evaluates on "
                             f"the OCR reward ({REWARD_KEY}), so every row must have data_source 'ocr'")


def make_smoke_data(out_dir: str) -> tuple[str, str]:
    """A few OCR prompts (train and held-out templates) through the project's converter -> (train, test) parquet."""
    from data_prep import qwen_image_ocr

    text_dir = os.path.join(out_dir, "prompts")
    os.makedirs(text_dir, exist_ok=True)
    for split, templates in SMOKE_TEMPLATES.items():
        with open(os.path.join(text_dir, f"{split}.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(t.format(w) for t in templates for w in SMOKE_WORDS) + "\n")
    qwen_image_ocr.main(["--input_dir", text_dir, "--output_dir", out_dir])
    return os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "test.parquet")


def tiny_qwen_image() -> str:
    """$TINY_MODELS_DIR/qwen_image (or <repo>/.cache/tiny_models), built once by build_tiny_models (never forced)."""
    import build_tiny_models

    root = os.environ.get("TINY_MODELS_DIR") or os.path.join(REPO, ".cache", "tiny_models")
    os.makedirs(root, exist_ok=True)
    build_tiny_models.build_one("qwen_image", root, force=False)
    return os.path.join(root, "qwen_image")


# ----------------------------------------------------------------------------------------------------------------
# Reading a finished run
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class RunRecord:
    """What one finished run logged, in benchmark terms (see read_run)."""
    steps: int
    gpu_seconds: float
    curve: list[dict[str, float | None]]          # held-out: step, gpu_seconds, reward, exact_match
    train_curve: list[dict[str, float]]           # step, gpu_seconds, reward (critic/rewards/mean)
    timing_s: dict[str, float]                    # sums of timing_s/* over the run (testing = validation)
    final_step_validated: bool
    grids: dict[str, tuple[int, bytes]] = field(default_factory=dict)   # "before"/"after" -> (step, PNG)


def read_run(run_dir: str) -> RunRecord:
    """The run's held-out and training curves against GPU-seconds (GPU_SECONDS), step count, timing sums and the
    validation grids of its first and last validated steps. Raises when the run has no training step or no
    validation at step 0 (the start point) and after it."""
    m = scalars(run_dir)
    if STEP_TIME_KEY not in m:
        raise RuntimeError(f"{run_dir}: no {STEP_TIME_KEY} logged (did the trainer run a step?)")
    step_times = dict(m[STEP_TIME_KEY])
    steps = max(step_times)
    if sorted(step_times) != list(range(1, steps + 1)):
        raise RuntimeError(f"{run_dir}: {STEP_TIME_KEY} logged for steps {sorted(step_times)}, not 1..{steps}")
    cumulative = [0.0]
    for s in range(1, steps + 1):
        cumulative.append(cumulative[-1] + step_times[s])
    reward = dict(m.get(REWARD_KEY, []))
    exact = dict(m.get(EXACT_KEY, []))
    if 0 not in reward or not any(s > 0 for s in reward):
        raise RuntimeError(f"{run_dir}: {REWARD_KEY} needs a step-0 validation (--val_before_train) and one after "
                           f"training; logged at steps {sorted(reward)}")
    curve = [{"step": s, "gpu_seconds": cumulative[s], "reward": reward[s], "exact_match": exact.get(s)}
             for s in sorted(reward) if s <= steps]
    train_curve = [{"step": s, "gpu_seconds": cumulative[s], "reward": v} for s, v in m.get(TRAIN_REWARD_KEY, [])]
    timing = {k.split("/", 1)[1]: sum(v for _, v in vals) for k, vals in m.items() if k.startswith("timing_s/")}
    grids = images(run_dir, GRID_TAG)
    record = RunRecord(steps=steps, gpu_seconds=cumulative[-1], curve=curve, train_curve=train_curve,
                       timing_s=timing, final_step_validated=steps in reward)
    if grids:
        first, last = min(grids), max(grids)
        record.grids = {"before": (first, grids[first]), "after": (last, grids[last])}
    return record


# ----------------------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------------------

def _rate(gain: float | None, seconds: float) -> float | None:
    return None if gain is None or seconds <= 0 else gain / seconds


def summarize_runs(records: Mapping[str, RunRecord], control: str = "control",
                   threshold: float = 0.1) -> dict[str, dict[str, Any]]:
    """Per run: start / end (first and last held-out point), gain, gain over the control's gain, rates per
    GPU-second (gain over the control / GPU-seconds at the end point) and the GPU-seconds at which the held-out
    reward first reached start + `threshold`. Without a control run the gains over it are None."""
    def gains(rec: RunRecord) -> dict[str, float | None]:
        first, last = rec.curve[0], rec.curve[-1]
        ex = None if first["exact_match"] is None or last["exact_match"] is None else \
            last["exact_match"] - first["exact_match"]
        return {"reward": last["reward"] - first["reward"], "exact_match": ex}

    base = gains(records[control]) if control in records else None
    out: dict[str, dict[str, Any]] = {}
    for name, rec in records.items():
        first, last = rec.curve[0], rec.curve[-1]
        gain = gains(rec)
        vs = {k: (None if base is None or gain[k] is None or base[k] is None else gain[k] - base[k]) for k in gain}
        reached = next((p["gpu_seconds"] for p in rec.curve if p["reward"] >= first["reward"] + threshold), None)
        out[name] = {
            "start": {"reward": first["reward"], "exact_match": first["exact_match"]},
            "end": {"reward": last["reward"], "exact_match": last["exact_match"], "step": last["step"],
                    "gpu_seconds": last["gpu_seconds"]},
            "gain": gain,
            "gain_vs_control": vs,
            "reward_gain_vs_control_per_gpu_second": _rate(vs["reward"], last["gpu_seconds"]),
            "exact_match_gain_vs_control_per_gpu_second": _rate(vs["exact_match"], last["gpu_seconds"]),
            "reward_gain_per_gpu_second": _rate(gain["reward"], last["gpu_seconds"]),
            f"gpu_seconds_to_start_plus_{threshold:g}": reached,
        }
    return out


def verdict(summary: Mapping[str, Mapping[str, Any]], labels: Mapping[str, str],
            control: str = "control") -> dict[str, Any]:
    """Which trained run raised the held-out reward beyond the control fastest per GPU-second, by how much (ratio
    to the runner-up when both rates are positive, else the difference), and DiffusionNFT vs Flow-GRPO (the
    DiffusionNFT paper claims up to 25x the efficiency of Flow-GRPO)."""
    key = "reward_gain_vs_control_per_gpu_second"
    rates = {n: s[key] for n, s in summary.items() if n != control and s[key] is not None}
    if not rates:
        return {"fastest": None, "statement": "no trained run with a control to compare against"}
    ranked = sorted(rates, key=rates.get, reverse=True)
    best = ranked[0]
    out: dict[str, Any] = {"fastest": best, "rates": rates, "ranking": ranked}
    if rates[best] <= 0:
        out["statement"] = (f"no algorithm raised the held-out reward beyond the lr = 0 control (best: "
                            f"{labels[best]}, {rates[best]:+.2e} reward / GPU-s)")
    elif len(ranked) > 1 and rates[ranked[1]] > 0:
        out["ratio_to_runner_up"] = rates[best] / rates[ranked[1]]
        out["statement"] = (f"{labels[best]} learned fastest per GPU-second: {rates[best]:.2e} reward / GPU-s over "
                            f"the control, {out['ratio_to_runner_up']:.2f}x {labels[ranked[1]]} "
                            f"({rates[ranked[1]]:.2e})")
    else:
        runner = f", {labels[ranked[1]]} {rates[ranked[1]]:+.2e}" if len(ranked) > 1 else ""
        out["statement"] = (f"{labels[best]} learned fastest per GPU-second: {rates[best]:.2e} reward / GPU-s over "
                            f"the control (the only positive rate{runner})")
    if "nft" in rates and "grpo" in rates:
        nft, grpo = rates["nft"], rates["grpo"]
        claim = "DiffusionNFT claims up to 25x the efficiency of Flow-GRPO"
        if nft > 0 and grpo > 0:
            out["nft_vs_grpo"] = nft / grpo
            out["papers_agree"] = nft > grpo
            out["papers"] = (f"{claim}; here DiffusionNFT gains {nft / grpo:.2f}x Flow-GRPO's reward per GPU-second"
                             + (" (the same ordering)" if nft > grpo else " (the ordering DIFFERS from the claim)"))
        elif nft > 0 or grpo > 0:
            out["nft_vs_grpo"] = None
            out["papers_agree"] = nft > 0
            winner = "DiffusionNFT" if nft > 0 else "Flow-GRPO"
            out["papers"] = (f"{claim}; here only {winner} beat the control ({nft:+.2e} vs {grpo:+.2e} reward / "
                             "GPU-s)" + ("" if nft > 0 else ": the ordering DIFFERS from the claim"))
        else:
            out["nft_vs_grpo"], out["papers_agree"] = None, None
            out["papers"] = f"{claim}; here neither beat the control ({nft:+.2e} vs {grpo:+.2e}): no ordering"
    return out


def table(summary: Mapping[str, Mapping[str, Any]], records: Mapping[str, RunRecord],
          labels: Mapping[str, str]) -> str:
    """The final plain-text table, one row per run: steps, GPU-seconds in all and at the last held-out point
    (end@s), held-out reward start / end / gain / gain over the control / that gain per GPU-second (at end@s), and
    exact-match start / end / gain over the control."""
    def f(v, spec="+.3f"):
        return "-" if v is None else format(v, spec)

    head = (f"{'run':<16}{'steps':>6}{'GPU-s':>8}{'end@s':>8}{'start':>8}{'end':>8}{'gain':>8}{'vs ctrl':>9}"
            f"{'/GPU-s':>10}"
            f"{'exact start':>12}{'exact end':>10}{'exact vs ctrl':>14}")
    rows = [head, "-" * len(head)]
    for name, s in summary.items():
        r = records[name]
        rows.append(f"{labels[name]:<16}{r.steps:>6}{r.gpu_seconds:>8.1f}{s['end']['gpu_seconds']:>8.1f}"
                    f"{s['start']['reward']:>8.3f}"
                    f"{s['end']['reward']:>8.3f}{f(s['gain']['reward']):>8}{f(s['gain_vs_control']['reward']):>9}"
                    f"{f(s['reward_gain_vs_control_per_gpu_second'], '+.2e'):>10}"
                    f"{f(s['start']['exact_match'], '.3f'):>12}{f(s['end']['exact_match'], '.3f'):>10}"
                    f"{f(s['gain_vs_control']['exact_match']):>14}")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------------------------
# Pictures
# ----------------------------------------------------------------------------------------------------------------

def plot_curves(records: Mapping[str, RunRecord], labels: Mapping[str, str], path: str, title: str) -> None:
    """Held-out reward and exact-match accuracy against GPU-seconds, one line per run (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rec in records.items():
        xs = [p["gpu_seconds"] for p in rec.curve]
        style = dict(marker="o", markersize=3, label=labels[name], linestyle="--" if name == "control" else "-")
        axes[0].plot(xs, [p["reward"] for p in rec.curve], **style)
        pts = [(x, p["exact_match"]) for x, p in zip(xs, rec.curve) if p["exact_match"] is not None]
        if pts:
            axes[1].plot(*zip(*pts), **style)
    for ax, what in zip(axes, ("held-out OCR reward (rapidocr, mean@1)", "held-out exact-match accuracy")):
        ax.set_xlabel("GPU-seconds of training (validation excluded)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compose_grids(records: Mapping[str, RunRecord], labels: Mapping[str, str], path: str) -> None:
    """One PNG: a row per run, its step-0 validation grid (before) beside its last one (after), each labelled."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    cells = []
    for name, rec in records.items():
        if not rec.grids:
            raise RuntimeError(f"run {name!r} logged no {GRID_TAG} image")
        row = []
        for when in ("before", "after"):
            step, png = rec.grids[when]
            row.append((f"{labels[name]}: {when} (step {step})", Image.open(io.BytesIO(png)).convert("RGB")))
        cells.append(row)
    label_h, pad = 16, 6
    cell_w = max(max(im.width, int(ImageDraw.Draw(im).textlength(text, font=font)) + 4)
                 for row in cells for text, im in row)
    cell_h = max(im.height for row in cells for _, im in row) + label_h
    sheet = Image.new("RGB", (2 * cell_w + 3 * pad, len(cells) * (cell_h + pad) + pad), "white")
    draw = ImageDraw.Draw(sheet)
    for r, row in enumerate(cells):
        for c, (text, im) in enumerate(row):
            x, y = pad + c * (cell_w + pad), pad + r * (cell_h + pad)
            draw.text((x, y + 2), text, fill="black", font=font)
            sheet.paste(im, (x, y + label_h))
    sheet.save(path, format="PNG")


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__ + "\nScaling: " + SCALING,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default=os.environ.get("MODEL_PATH"),
                   help="pipeline folder (the small pretrained Qwen-Image layout); default $MODEL_PATH")
    p.add_argument("--train_files", help="RL prompts (verl-omni parquet, data_source 'ocr', train templates)")
    p.add_argument("--val_files", help="held-out prompts (data_source 'ocr', templates not in --train_files)")
    p.add_argument("--out_dir", default="outputs/bench_learning",
                   help="where the JSON, the plot, the grids and the log go")
    p.add_argument("--work_dir", default=None, help="the runs' output dirs (default <out_dir>/runs); each run's "
                                                    "folder is deleted and rewritten")
    p.add_argument("--budget_s", type=float, default=60.0,
                   help="per run: the trainers' --max_wall_time_s (stop at the first step boundary after this)")
    p.add_argument("--steps", type=int, default=None, help="per run: this many steps instead of --budget_s")
    p.add_argument("--algorithms", default="control,nft,dppo,grpo",
                   help=f"comma-separated subset of {list(ALGORITHMS)} (run in this order; the control first, so a "
                        "session cut short still has the floor to compare against)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="trainer device; its rollout worker shares it (cuda:0 or cpu)")
    p.add_argument("--ocr_workers", type=int, default=max(1, min(16, (os.cpu_count() or 1) - 2)),
                   help="RapidOCR engine processes per trainer (--rapidocr_workers); default: cores - 2, <= 16")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="[ALGO.]KEY=VALUE",
                   help="change a trainer flag of every run (KEY=VALUE) or of one (e.g. nft.mix_beta=0.5); applied "
                        "after the budget, so control.max_wall_time_s=20 shortens only the control")
    p.add_argument("--timeout_s", type=float, default=None,
                   help="kill a run after this long (default 3 x budget + 600 s, or 1800 s with --steps)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: tiny Qwen-Image, 64^2, 2 steps each, rapidocr in-process, built-in prompts "
                        "(no learning expected; checks the whole path)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.algorithms.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown or not names:
        p.error(f"--algorithms {args.algorithms!r}: unknown {unknown}; known {list(ALGORITHMS)}")
    args.names = names
    if args.smoke and args.steps is None:
        args.steps = 2
    if not args.smoke and not (args.model_path and args.train_files and args.val_files):
        p.error("--model_path, --train_files and --val_files are required (or --smoke)")
    return args


def write_report(records: Mapping[str, RunRecord], runs: dict[str, dict[str, Any]], labels: Mapping[str, str],
                 header: Mapping[str, Any], out_dir: str, title: str, say=print) -> dict[str, Any]:
    """Summarize finished runs (`records` from read_run, `runs` their per-run JSON entries, updated in place) and
    write the JSON, the plot and the grids into `out_dir`; prints the table and the verdict through `say`.
    Returns the JSON document."""
    summary = summarize_runs(records)
    for name, s in summary.items():
        runs[name].update(s)
    result = verdict(summary, labels)
    doc = {**header, "runs": runs, "result": result, "files": dict(FILES)}
    plot_curves(records, labels, os.path.join(out_dir, FILES["plot"]), title)
    compose_grids(records, labels, os.path.join(out_dir, FILES["grids"]))
    tmp = os.path.join(out_dir, FILES["json"] + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_finite(doc), f, indent=2, allow_nan=False, default=str)
    os.replace(tmp, os.path.join(out_dir, FILES["json"]))
    say("\n" + table(summary, records, labels))
    say(result["statement"])
    if "papers" in result:
        say(result["papers"])
    say(f"wrote {', '.join(os.path.join(out_dir, v) for v in FILES.values())}")
    return doc


def run_entry(algo: Algorithm, flags: Mapping[str, Any], argv: Sequence[str], rec: RunRecord, wall_s: float,
              run_dir: str) -> dict[str, Any]:
    """One run's JSON entry before the summary (settings, command, steps, GPU-seconds, curves, timings)."""
    meta_path = os.path.join(run_dir, "run_metadata.json")
    meta = json.load(open(meta_path, encoding="utf-8")) if os.path.isfile(meta_path) else {}
    return {
        "algorithm": algo.label, "script": algo.script, "recipe": algo.recipe, "settings": dict(flags),
        "command": ["torchrun", "--nproc_per_node", "1", algo.script, *argv],
        "steps": rec.steps, "gpu_seconds": rec.gpu_seconds, "wall_seconds": wall_s,
        "validation_seconds": rec.timing_s.get("testing"), "timing_s": rec.timing_s,
        "final_step_validated": rec.final_step_validated, "curve": rec.curve, "train_curve": rec.train_curve,
        "grid_steps": {k: v[0] for k, v in rec.grids.items()}, "git_commit": meta.get("git_commit"),
        "versions": meta.get("versions"),
    }


def main(argv=None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON document it wrote."""
    import torch

    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    work_dir = args.work_dir or os.path.join(args.out_dir, "runs")
    os.makedirs(work_dir, exist_ok=True)
    log_path = os.path.join(args.out_dir, FILES["log"])
    open(log_path, "w").close()

    def say(text: str) -> None:
        print(text, flush=True)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(text + "\n")

    overrides = parse_overrides(args.overrides, list(ALGORITHMS))
    common = dict(COMMON)
    device = "cpu" if args.smoke else ("cuda" if args.device == "auto" and torch.cuda.is_available() else
                                       ("cpu" if args.device == "auto" else args.device))
    common.update(device=device, rollout_devices="cuda:0" if device == "cuda" else "cpu",
                  rapidocr_workers=args.ocr_workers, **({"rollout_threads": 1} if device == "cpu" else {}))
    if args.smoke:
        common.update(SMOKE)
        model_path = args.model_path or tiny_qwen_image()
        if args.train_files and args.val_files:
            train_files, val_files = args.train_files, args.val_files
        else:
            train_files, val_files = make_smoke_data(os.path.join(work_dir, "data"))
    else:
        model_path, train_files, val_files = args.model_path, args.train_files, args.val_files
    check_inputs(model_path, train_files, val_files)
    budget_s = None if args.steps is not None else args.budget_s
    if budget_s is not None:
        require_flag(sorted({ALGORITHMS[n].script for n in args.names}), "--max_wall_time_s")
    timeout_s = args.timeout_s or (1800.0 if budget_s is None else 3 * budget_s + 600)

    labels = {n: ALGORITHMS[n].label for n in args.names}
    header = {
        "benchmark": "bench_learning", "schema_version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": sys.argv[1:] if argv is None else list(argv), "smoke": args.smoke, "model_path": model_path,
        "train_files": train_files, "val_files": val_files, "device": device,
        "budget": ({"mode": "steps", "total_training_steps": args.steps} if budget_s is None else
                   {"mode": "max_wall_time_s", "max_wall_time_s": budget_s}),
        "gpu_seconds_definition": GPU_SECONDS, "control": CONTROL_WHY, "scaling": SCALING,
        "held_out": {"reward_key": REWARD_KEY, "exact_match_key": EXACT_KEY,
                     "exact_match_definition": "rewards.ocr_exact_match: the whole transcription equals the target "
                                               "after removing whitespace and lowercasing",
                     **{k: common[k] for k in ("val_max_samples", "val_num_inference_steps", "val_seed",
                                               "test_freq")}},
    }
    title = (f"bench_learning: {', '.join(labels.values())}; "
             + (f"{args.steps} steps each" if budget_s is None else f"{budget_s:g} s budget each"))

    records: dict[str, RunRecord] = {}
    runs: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for name in args.names:
        algo = ALGORITHMS[name]
        if args.smoke:
            algo = Algorithm(algo.name, algo.label, algo.script, dict(algo.flags, **SMOKE_ALGO[algo.script]),
                             algo.recipe)
        flags = run_flags(algo, common, overrides, budget_s=budget_s, steps=args.steps)
        run_dir = os.path.join(work_dir, name)
        shutil.rmtree(run_dir, ignore_errors=True)
        flags.update(model_path=model_path, train_files=train_files, val_files=val_files, output_dir=run_dir)
        trainer_argv = to_argv(flags)
        say(f"== {name} ({algo.label}): {algo.script} {' '.join(trainer_argv)}")
        start = time.perf_counter()
        try:  # a failed run is reported and the others still run (one GPU session may be all there is)
            run_trainer(algo.script, trainer_argv, nproc=1, timeout_s=timeout_s, log_path=log_path)
            rec = read_run(run_dir)
        except (AssertionError, TimeoutError, RuntimeError) as error:
            failed[name] = str(error)[-4000:]
            runs[name] = {"algorithm": algo.label, "script": algo.script, "settings": flags, "error": failed[name]}
            say(f"   {name} FAILED: {str(error)[-1500:]}")
            continue
        wall = time.perf_counter() - start
        records[name] = rec
        runs[name] = run_entry(algo, flags, trainer_argv, rec, wall, run_dir)
        pending = args.names[args.names.index(name) + 1:]
        if pending:  # a report after every run: a session cut short still leaves the JSON and the pictures
            write_report(records, runs, {n: labels[n] for n in records}, {**header, "complete": False,
                         "pending": pending}, args.out_dir, title, say=lambda _: None)
        last = rec.curve[-1]
        say(f"   {name}: {rec.steps} steps, {rec.gpu_seconds:.1f} GPU-s, {wall:.1f} s wall; held-out reward "
            f"{rec.curve[0]['reward']:.3f} -> {last['reward']:.3f} (step {last['step']})"
            + ("" if rec.final_step_validated else f"; the last step ({rec.steps}) was not validated"))

    if not records:
        raise SystemExit(f"every run failed ({', '.join(failed)}); see {log_path}")
    doc = write_report(records, runs, {n: labels[n] for n in records}, {**header, "complete": True},
                       args.out_dir, title, say=say)
    if failed:
        raise SystemExit(f"runs {', '.join(failed)} failed (their errors are in {FILES['json']} and {log_path}); "
                         f"the report covers {', '.join(records)}")
    return doc


def _finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


if __name__ == "__main__":
    main()
