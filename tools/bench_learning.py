r"""Learning benchmark: DiffusionNFT, Flow-DPPO and Flow-GRPO, each at its recipe's samples per optimizer step, over
several seeds, against one lr = 0 control, from one model folder, scored by the `rapidocr` OCR reward on every
held-out prompt; held-out reward, its standard error and exact-match accuracy against GPU-seconds, with error bars.

    python3 tools/bench_learning.py --model_path MODEL --train_files train.parquet --val_files test.parquet \
        --out_dir OUT --work_dir outputs/bench_learning_runs --concurrent 10 --resume  # one GPU
    python3 tools/bench_learning.py --smoke --out_dir /tmp/bench_smoke            # CPU: tiny Qwen-Image, 64², 2 steps

Runs (each `torchrun --nproc_per_node 1` in its own process group, the trainer rank and its rollout worker sharing
one device, e.g. cuda:0):
  control  train_dppo.py --lr 0                the Flow-DPPO run without updates, once (see CONTROL_WHY)
  nft      train_nft.py                        verl-omni's Qwen-Image DiffusionNFT OCR recipe, --seeds times
  dppo     train_dppo.py                       scripts/run_qwen_image_ocr_lora.sh (Flow-DPPO), --seeds times
  grpo     train_dppo.py --loss flow_grpo      verl-omni's Flow-GRPO settings (clip 1e-5, noise 1.2), --seeds times
  grpo_fg  train_dppo.py --loss flow_grpo      flow_grpo's own settings (clip 1e-4, noise 0.7); not run by default

Budget: `--budget_s S` is S GPU-seconds of training per run. Short solo calibration runs (`--calibration_steps`)
measure each algorithm's seconds per step first; each algorithm then runs the number of steps that fills S (so every
run gets the same GPU time, and all seeds of an algorithm the same steps). `--steps N` runs N steps instead.
`--concurrent N` runs N trainers at a time on the GPU; their GPU-seconds are then the solo calibration's (GPU_SECONDS).

Outputs in --out_dir, rewritten after every run: bench_learning.json (every setting, command, curve and summary),
bench_learning.png (one band, mean +- std over seeds, per algorithm against GPU-seconds), bench_learning.md (the
table), bench_learning_grids.png (validation grids before / after, seed 0) and bench_learning.log (every trainer's
output). An interrupted bench (SIGINT / SIGTERM) stops every trainer it started; `--resume` reuses finished runs.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)

from trainer_runs import free_port, images, scalars  # noqa: E402

REWARD_KEY = "val-core/ocr/reward/mean@1"
EXACT_KEY = "val-aux/ocr/ocr/exact_match/mean@1"   # rewards.py's `ocr/exact_match` extra, as validation logs it
TRAIN_REWARD_KEY = "critic/rewards/mean"
STEP_TIME_KEY = "perf/time_per_step"
RATIO_KEYS = ("actor/ratio_min", "actor/ratio_max")  # Flow-DPPO / Flow-GRPO: extremes over each step's samples
SKIPPED_KEY = "actor/skipped_steps"                # optimizer steps skipped so far (non-finite loss or gradient)
GRID_TAG = "val/samples"
JUDGE_LOG = "judge_replies.jsonl"                   # training.scoring.JUDGE_LOG: every validated reply, per sample
GAINS = (0.05, 0.1)                                 # the held-out gains whose GPU-seconds the table reports
FILES = {"json": "bench_learning.json", "plot": "bench_learning.png", "markdown": "bench_learning.md",
         "grids": "bench_learning_grids.png", "log": "bench_learning.log"}

GPU_SECONDS = (
    "the sum over training steps of the trainer's perf/time_per_step: per RL step, from drawing the batch to the "
    "end of the adapter sync, i.e. rollout on the GPU, reward scoring (RapidOCR on the CPU pool, while the GPU "
    "waits), advantages, the update and the sync. Not counted: setup (model load, rollout worker start), "
    "validation, TensorBoard logging and checkpoints. With --concurrent 1 each run's own step times are used (the "
    "run had the GPU alone). With --concurrent N > 1 the runs share the GPU and the CPU, so their own step times "
    "are inflated: step s of a run is placed at t_first + (s - 1) * t_rest, where t_first is step 1 and t_rest the "
    "mean of the later steps of a solo calibration run of the same algorithm and settings (--calibration_steps "
    "steps, no validation, run alone before the others); the run's own shared times are kept as 'shared_seconds'.")
CONTROL_WHY = (
    "train_dppo.py with the Flow-DPPO flags and --lr 0: with lr = 0 AdamW changes nothing (decoupled weight decay "
    "is lr * wd = 0), so the policy stays the starting model while the run still does every part of a step. Its "
    "held-out curve is the start point at every evaluation (same prompts, same seeds) and shows the evaluation's "
    "own non-determinism, if any; it runs once, since it does not depend on the training seed.")
START_POINT = (
    "the base model scored by exactly the bench's held-out evaluation: every prompt of --val_files (ocr_mini: 256 = "
    "64 words x 4 held-out templates), one sample each with the fixed seed rollout.row_seed(val_seed 42, 1, prompt "
    "index), 20-step ODE, 128x128, true CFG 1.0, rapidocr reward (mean over prompts, its standard error, and exact "
    "match). It is every run's step-0 evaluation and the control's value at every step. Measured for ocr_mini on "
    "one H200 (2026-12-04, docs/lab/measurements/2026-12-04/bench_learning_h200.json; the same to every digit on "
    "2026-12-05, on an H200 and an H100): reward 0.417 +- 0.022 (standard error over prompts), exact match 0.191.")

# Why each setting is what it is (printed by --help, copied into the JSON and the markdown).
WHY: dict[str, str] = {
    "samples per update": (
        "each algorithm at its recipe's samples per optimizer step, one update per rollout step: Flow-DPPO and "
        "Flow-GRPO 16 prompts x 16 = 256 (verl-omni), DiffusionNFT 12 x 16 = 192 (verl-omni's mini-batch of 12 "
        "prompts). Measured (2026-12-04, docs/lab/measurements/2026-12-04/dppo_grpo_learning_analysis.md): at 32 "
        "samples per update the Flow-DPPO/GRPO gradient is noise (cosine between two batches' gradients "
        "0.00-0.09, against 0.33-0.41 for DiffusionNFT) and the held-out reward fell (-0.047, -0.005); at 256 per"
        " update Flow-DPPO learned (+0.07 to +0.1 held-out). One update per step also makes the Flow-GRPO ratio 1"
        " in every update, so its clip (and Flow-DPPO's mask) never binds there: at these defaults Flow-DPPO and "
        "Flow-GRPO take the same gradient (their losses differ only from a second update per step on, e.g. --set "
        "grpo.train_batch_size=32)."),
    "--scale": (
        "multiplies every algorithm's prompts per step alike (rollout_n 16 kept), e.g. 0.5 -> 8 x 16 and 6 x 16, "
        "if the GPU-second budget cannot afford the recipes' batches; the ratio between the algorithms stays. "
        "Measured at 0.5 (2026-12-04, bench_learning_scale0.5_h200.json, 3 seeds, lr 3e-4): DiffusionNFT +0.124 "
        "+- 0.013, Flow-DPPO +0.117 +- 0.030 over the control, within the spread of the recipes' batches."),
    "lr": (
        "3e-4 for every trained run, the recipes' value, kept because no other value measured is better for all. "
        "Measured on one H200 (2026-12-04, docs/lab/measurements/2026-12-04/bench_learning_h200.json and "
        "bench_learning_lr1e-3_h200.json), gain over the control in ~105 GPU-s: at 3e-4 DiffusionNFT +0.114, "
        "Flow-DPPO/GRPO +0.094, flow_grpo's GRPO +0.122 (3 seeds each); at 1e-3 DiffusionNFT +0.137 (2 seeds) but "
        "Flow-DPPO +0.086 (2), Flow-GRPO +0.064 (1) and flow_grpo's GRPO +0.018 (1: 0.558 at 85 GPU-s, then "
        "0.434). --set lr=1e-3 runs that value."),
    "budget": (
        "--budget_s 240 GPU-seconds of training per run; each algorithm runs the steps that fill it at its "
        "calibrated step time, rounded down to a multiple of the evaluation interval (so 202-239 GPU-s ran). "
        "At 120 GPU-s (one H200, 2026-12-04) DiffusionNFT was still rising, +0.114 +- 0.002 over the control in "
        "102 GPU-s (3 seeds). At 240 (one H100, 2026-12-05, docs/lab/measurements/2026-12-05/"
        "bench_learning_240_h100.json; the whole default table in 23.3 minutes) DiffusionNFT reached +0.164 +- "
        "0.018 in 207 GPU-s, still rising, Flow-DPPO +0.173 +- 0.041 in 239 and Flow-GRPO +0.151 +- 0.064 in 202."),
    "calibration": (
        "--calibration_steps 8 solo steps per algorithm; its step time is the mean of steps 2-8 (step 1 holds "
        "compilation and the workers' warm-up) and that mean's standard error widens the efficiency ratios' +- "
        "(an error shared by every seed of the algorithm). Single steps vary: one 4-step calibration of the control "
        "(2026-12-04) had later steps of 2.1, 2.6 and 4.8 s."),
    "seeds": (
        "--seeds runs per trained algorithm (trainer --seed 42, 43, ...: rollout noise and data order), the "
        "control once; the table gives mean +- std over seeds. The held-out prompts and their seeds stay fixed."),
    "held-out": (
        "every prompt of the test split (val_max_samples 0: all 256 of ocr_mini, 4 templates x 64 words), fixed "
        "seeds, 20 ODE steps, before training and --evals times after it (the last step always). The old default "
        "(64 prompts of one template, one seed) had a standard error of about 0.037."),
    "model and images": (
        "LoRA rank 16 / alpha 32 (the recipes' alpha/rank = 2) for the 3.85M-parameter model, 128^2 images, 10 "
        "rollout steps (recipes), true CFG 1.0 for every run (one sampler, one start point), wd 1e-4 (recipes); "
        "reward rapidocr (CPU) instead of the recipes' Qwen3-VL GenRM."),
    "Flow-DPPO / Flow-GRPO SDE": (
        "verl-omni's: SDE noise level 1.2, window of 2 steps starting in [0, 5), DPPO KL mask 1e-5, GRPO clip 1e-5 "
        "and advantages clamped to +-5. grpo_fg runs flow_grpo's values instead (clip 1e-4, noise level 0.7)."),
}

# Shared by every run (WHY says why); --set KEY=VALUE / ALGO.KEY=VALUE changes any of them.
COMMON: dict[str, Any] = dict(
    height=128, width=128, num_inference_steps=10, val_num_inference_steps=20, true_cfg_scale=1.0,
    max_sequence_length=256, rollout_n=16, micro_batch_size=32, lora_rank=16, lora_alpha=32, lr=3e-4,
    weight_decay=1e-4, rollout_max_batch_size=64, seed=42, val_seed=42, val_before_train=True, val_max_samples=0,
    num_val_images=8, log_every=1, keep_last=1, save_freq=10**9, resume="never", ocr_backend="rapidocr",
    rapidocr_det_limit_side_len=256)
DPPO_FLAGS: dict[str, Any] = dict(loss="flow_dppo", kl_mask_threshold=1e-5, noise_level=1.2, sde_type="sde",
                                  sde_window_size=2, sde_window_range="0,5")


@dataclass
class Algorithm:
    name: str
    label: str
    script: str
    prompts: int                 # prompts per step = per optimizer step (one update per step), before --scale
    flags: dict[str, Any]
    recipe: str


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("control", "lr = 0 control", "train_dppo.py", 16, dict(DPPO_FLAGS, lr=0.0), CONTROL_WHY),
    Algorithm("nft", "DiffusionNFT", "train_nft.py", 12,
              dict(mix_beta=0.1, ref_kl_coef=1e-4, adv_clip_max=5.0, timestep_fraction=1.0, adv_mode="continuous",
                   old_policy_decay_schedule="delayed_linear_to_0_999", old_policy_update_interval=2),
              "verl-omni Qwen-Image DiffusionNFT OCR LoRA recipe: ODE rollouts with the `old` adapter, mix_beta 0.1, "
              "ref_kl_coef 1e-4, adv_clip_max 5, timestep_fraction 1.0, continuous, old policy "
              "delayed_linear_to_0_999 every 2 steps, true CFG 1.0; mini-batch 12 prompts x 16 (the recipe draws "
              "24 per step for 2 updates; here 12 per step, one update), lr 3e-4, wd 1e-4"),
    Algorithm("dppo", "Flow-DPPO", "train_dppo.py", 16, dict(DPPO_FLAGS),
              "scripts/run_qwen_image_ocr_lora.sh (verl-omni Flow-DPPO Qwen-Image OCR): kl_mask_threshold 1e-5, "
              "sde, noise 1.2, SDE window 2 in [0,5], mini-batch 16 prompts x 16 (the recipe: 32 per step, 2 "
              "updates; here 16 per step, one update), lr 3e-4, wd 1e-4 (true CFG 1.0 here, 4.0 there)"),
    Algorithm("grpo", "Flow-GRPO", "train_dppo.py", 16,
              dict(DPPO_FLAGS, loss="flow_grpo", clip_ratio=1e-5, adv_clip_max=5.0),
              "verl-omni's Flow-GRPO Qwen-Image OCR recipe: the Flow-DPPO recipe with --loss flow_grpo "
              "--clip_ratio 1e-5, advantages clamped to +-5"),
    Algorithm("grpo_fg", "Flow-GRPO (flow_grpo)", "train_dppo.py", 16,
              dict(DPPO_FLAGS, loss="flow_grpo", clip_ratio=1e-4, noise_level=0.7, adv_clip_max=5.0),
              "Flow-GRPO with flow_grpo's own settings (config/grpo.py): clip range 1e-4, SDE noise level 0.7; "
              "otherwise as grpo"),
)}
DEFAULT_ALGORITHMS = "control,nft,dppo,grpo"

# --smoke: the same runs on CPU with the tiny random-weight Qwen-Image (no learning is expected, only the path).
SMOKE: dict[str, Any] = dict(
    device="cpu", rollout_devices="cpu", rollout_threads=1, height=64, width=64, num_inference_steps=4,
    val_num_inference_steps=2, rollout_n=2, micro_batch_size=2, lora_rank=4, lora_alpha=8, lr=1e-2,
    rollout_max_batch_size=16, val_max_samples=2, num_val_images=2)
SMOKE_PROMPTS = 1                                   # prompts per step of every smoke run
SMOKE_ALGO: dict[str, dict[str, Any]] = {"train_nft.py": dict(timestep_fraction=0.5),   # K = 2 of 4 steps
                                          "train_dppo.py": dict(sde_window_range="0,3")}  # the window fits 4 steps
SMOKE_WORDS = ["open", "stop", "cafe", "exit", "hello", "sale"]
SMOKE_TEMPLATES = {"train": ['A sign that says "{}"', 'A poster with the word "{}"'],
                   "test": ['A label reading "{}"']}


# ----------------------------------------------------------------------------------------------------------------
# The math (pure functions; tests/test_bench_learning.py checks each against values computed by hand)
# ----------------------------------------------------------------------------------------------------------------

def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation with ddof 1) of `values`; std 0.0 for one value, (None, None) for none."""
    n = len(values)
    if n == 0:
        return None, None
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def standard_error(values: Sequence[float]) -> float | None:
    """Standard error of the mean of `values`: sample std (ddof 1) / sqrt(n); None for fewer than 2 values."""
    if len(values) < 2:
        return None
    return mean_std(values)[1] / math.sqrt(len(values))


def time_to_gain(curve: Sequence[tuple[float, float]], gain: float, *, interpolate: bool = True) -> float | None:
    """GPU-seconds at which a held-out curve [(gpu_seconds, reward), ...] (first point = the start, in time order)
    first reaches start + `gain`. With `interpolate`, linear between the last evaluation below that level and the
    first one at or past it; else that first evaluation's time. None when no evaluation reaches it."""
    level = curve[0][1] + gain
    for i, (t, r) in enumerate(curve):
        if r >= level:
            if i == 0 or not interpolate:
                return t
            t0, r0 = curve[i - 1]
            return t0 + (level - r0) / (r - r0) * (t - t0)   # r0 < level <= r, so r > r0
    return None


def efficiency_ratio(t_nft: Sequence[float | None], t_other: Sequence[float | None],
                     other_end: Sequence[float] = (), calibration_cv: tuple[float, float] = (0.0, 0.0),
                     ) -> dict[str, Any]:
    """How many times the GPU-seconds DiffusionNFT needed the other algorithm needs for the same held-out gain:
    t_nft / t_other are the per-seed GPU-seconds to that gain (None = not reached), other_end the other's per-seed
    final GPU-seconds. Over the seeds that reached it: ratio = mean(t_other) / mean(t_nft), its std over seeds by
    the delta method, std = ratio * sqrt(cv_other^2 + cv_nft^2) (cv = std / mean over seeds), and min / max over
    every seed pair. `calibration_cv` = (c_nft, c_other), the relative standard errors of the two algorithms'
    calibrated step times (0 for runs timed on their own steps): an error shared by all seeds of one algorithm, so
    it adds to the ratio's variance once, std_total = ratio * sqrt(cv_other^2 + cv_nft^2 + c_nft^2 + c_other^2).
    If DiffusionNFT reached the gain and the other never did, only a lower bound: min(other_end) / mean(t_nft).
    'reached' gives the counts as 'k/n'."""
    a = [t for t in t_nft if t is not None]
    b = [t for t in t_other if t is not None]
    out: dict[str, Any] = {"ratio": None, "std": None, "std_total": None, "calibration_cv": list(calibration_cv),
                           "min": None, "max": None, "lower_bound": None,
                           "reached": {"nft": f"{len(a)}/{len(t_nft)}", "other": f"{len(b)}/{len(t_other)}"}}
    if not a:
        return out
    mean_a, std_a = mean_std(a)
    if not b:
        if other_end:
            out["lower_bound"] = min(other_end) / mean_a
        return out
    mean_b, std_b = mean_std(b)
    ratio = mean_b / mean_a
    pairs = [y / x for x in a for y in b]
    seeds_var = (std_a / mean_a) ** 2 + (std_b / mean_b) ** 2
    out.update(ratio=ratio, std=ratio * math.sqrt(seeds_var),
               std_total=ratio * math.sqrt(seeds_var + sum(c ** 2 for c in calibration_cv)),
               min=min(pairs), max=max(pairs))
    return out


def band(curves: Sequence[Sequence[tuple[float, float]]]) -> tuple[list[float], list[float], list[float]]:
    """Mean and std (ddof 1; 0 for one curve) over curves [(x, y), ...] (x increasing), each linearly interpolated
    onto the union of their x values up to the smallest last x (so every curve covers every point). -> (x, mean,
    std)."""
    end = min(c[-1][0] for c in curves)
    xs = sorted({x for c in curves for x, _ in c if x <= end})
    means, stds = [], []
    for x in xs:
        ys = [_interp(c, x) for c in curves]
        m, s = mean_std(ys)
        means.append(m)
        stds.append(s)
    return xs, means, stds


def _interp(curve: Sequence[tuple[float, float]], x: float) -> float:
    """y at x on the polyline `curve` (x increasing; x within its range)."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return curve[0][1] if x <= curve[0][0] else curve[-1][1]


def calibrated_gpu_seconds(step: int, t_first: float, t_rest: float) -> float:
    """GPU-seconds after `step` steps of a run placed on its solo calibration: 0 at step 0, t_first after step 1,
    t_first + (step - 1) * t_rest after later steps."""
    return 0.0 if step <= 0 else t_first + (step - 1) * t_rest


def calibration_times(step_times: Sequence[float]) -> tuple[float, float]:
    """(t_first, t_rest) of a solo calibration run's per-step times: step 1 (compilation and warm-up land there)
    and the mean of the later steps (step 1 again when there is only one)."""
    if not step_times:
        raise ValueError("a calibration run needs at least one step")
    rest = list(step_times[1:]) or [step_times[0]]
    return float(step_times[0]), sum(rest) / len(rest)


def steps_for_budget(budget_s: float, t_first: float, t_rest: float, evals: int) -> tuple[int, int]:
    """(total steps, validation every k steps) for a run of `budget_s` GPU-seconds at the calibrated step times:
    the most steps whose calibrated GPU-seconds fit the budget (at least one), rounded to a multiple of k =
    ceil(steps / evals), so that the last step is validated and there are about `evals` evaluations after step 0."""
    fit = max(1, 1 + int(math.floor((budget_s - t_first) / t_rest)) if budget_s >= t_first else 1)
    every = max(1, math.ceil(fit / max(1, evals)))
    return max(every, fit // every * every), every


def scaled_prompts(prompts: int, scale: float) -> int:
    """Prompts per step under --scale: round(prompts * scale), at least 1."""
    return max(1, int(round(prompts * scale)))


def eta_seconds(step: int, total: int, step_times: Sequence[float]) -> float:
    """Seconds left for `total - step` steps at the mean of the observed step times (the first, warm-up step left
    out once there are others)."""
    times = list(step_times[1:]) or list(step_times)
    return 0.0 if not times else max(0, total - step) * sum(times) / len(times)


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
              steps: int, test_freq: int, seed_offset: int = 0, scale: float = 1.0,
              prompts: int | None = None) -> dict[str, Any]:
    """The trainer flags of one run: common settings, the batch (`prompts` per step, default the algorithm's
    recipe value times `scale`, as one mini-batch: one update per step), the algorithm's recipe flags, the step
    count and validation cadence, the seed (common seed + seed_offset), then --set overrides (every run's, then
    this algorithm's). The control's lr stays 0 whatever '*' overrides say."""
    n = prompts if prompts is not None else scaled_prompts(algo.prompts, scale)
    flags = {**common, "train_batch_size": n, "ppo_mini_batch_size": n, **algo.flags,
             "total_training_steps": int(steps), "test_freq": int(test_freq),
             "seed": int(common.get("seed", 42)) + seed_offset, **overrides.get("*", {}),
             **overrides.get(algo.name, {})}
    if algo.name == "control":
        flags["lr"] = 0.0
    return flags


def calibration_flags(flags: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """A solo calibration run's flags: the run's own, `steps` steps, no validation (no --val_files, no
    --val_before_train), so that its step times are the algorithm's alone."""
    return dict(flags, total_training_steps=int(steps), test_freq=0, val_before_train=False, val_files=None,
                num_val_images=0)


def to_argv(flags: Mapping[str, Any]) -> list[str]:
    """{flag: value} -> argparse argv; True -> a bare switch, False / None / "false" / "none" -> dropped."""
    argv: list[str] = []
    for key, value in flags.items():
        if value is None or value is False or str(value).lower() in ("false", "none"):
            continue
        argv += [f"--{key}"] if value is True or str(value).lower() == "true" else [f"--{key}", str(value)]
    return argv


def check_inputs(model_path: str, train_files: str, val_files: str) -> None:
    """Fail before any run starts: the model folder, both parquet files, and OCR rows in both."""
    import pyarrow.parquet as pq

    if not os.path.isfile(os.path.join(model_path, "model_index.json")):
        raise FileNotFoundError(f"--model_path {model_path}: no model_index.json (a pipeline folder is needed)")
    for flag, path in (("--train_files", train_files), ("--val_files", val_files)):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{flag} {path}: no such file (make it with data_prep/, e.g. ocr.py)")
    for flag, path in (("--train_files", train_files), ("--val_files", val_files)):
        sources = set(pq.read_table(path, columns=["data_source"]).column("data_source").to_pylist())
        if sources != {"ocr"}:
            raise ValueError(f"{flag} {path}: data_source {sorted(sources)}; this benchmark trains and evaluates on "
                             f"the OCR reward ({REWARD_KEY}), so every row must have data_source 'ocr'")


def make_smoke_data(out_dir: str) -> tuple[str, str]:
    """A few OCR prompts (train and held-out templates) through the project's converter -> (train, test) parquet."""
    from data_prep import ocr

    text_dir = os.path.join(out_dir, "prompts")
    os.makedirs(text_dir, exist_ok=True)
    for split, templates in SMOKE_TEMPLATES.items():
        with open(os.path.join(text_dir, f"{split}.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(t.format(w) for t in templates for w in SMOKE_WORDS) + "\n")
    ocr.main(["--model", "qwen_image", "--input_dir", text_dir, "--output_dir", out_dir])
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
    step_times: list[float]                       # perf/time_per_step of steps 1..steps (its own)
    curve: list[dict[str, Any]]                   # held-out: step, gpu_seconds, reward, reward_se, n, exact_match
    train_curve: list[dict[str, float]]           # step, gpu_seconds, reward (critic/rewards/mean)
    timing_s: dict[str, float]                    # sums of timing_s/* over the run (testing = validation)
    grids: dict[str, tuple[int, bytes]] = field(default_factory=dict)   # "before"/"after" -> (step, PNG)
    calibrated: bool = False                      # curve placed on a solo calibration (it shared the GPU)
    health: dict[str, Any] = field(default_factory=dict)  # skipped_steps; ratio_range [min, max] over every step

    @property
    def gpu_seconds(self) -> float:
        return self.curve[-1]["gpu_seconds"] if self.curve else sum(self.step_times)


def validation_rewards(run_dir: str) -> dict[int, list[float]]:
    """{step: every held-out sample's reward} from the run's judge_replies.jsonl (validation logs each reply)."""
    out: dict[int, list[float]] = {}
    path = os.path.join(run_dir, JUDGE_LOG)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if record.get("phase") == "val" and record.get("reward") == record.get("reward"):
                    out.setdefault(int(record["step"]), []).append(float(record["reward"]))
    return out


def run_health(m: Mapping[str, Sequence[tuple[int, float]]]) -> dict[str, Any]:
    """What says the run trained as intended, from its logged scalars `m`: the optimizer steps it skipped (the last
    `actor/skipped_steps`) and, for the ratio losses, the importance ratio's range over every step's samples. At one
    optimizer step per rollout step the old policy is the policy itself, so that range is exactly [1, 1]."""
    health: dict[str, Any] = {}
    if m.get(SKIPPED_KEY):
        health["skipped_steps"] = int(max(m[SKIPPED_KEY])[1])
    if all(m.get(k) for k in RATIO_KEYS):
        health["ratio_range"] = [min(v for _, v in m[RATIO_KEYS[0]]), max(v for _, v in m[RATIO_KEYS[1]])]
    return health


def read_run(run_dir: str, *, calibration: tuple[float, float] | None = None,
             need_validation: bool = True) -> RunRecord:
    """The run's held-out and training curves against GPU-seconds (GPU_SECONDS: its own cumulative step times, or
    the solo `calibration` (t_first, t_rest) when it shared the GPU; its own then go to 'shared_seconds'), the
    held-out standard error per evaluation (from the per-sample rewards), timing sums and the validation grids of
    its first and last evaluations. Raises when the run has no training step or (need_validation) no step-0
    evaluation and one after it."""
    m = scalars(run_dir)
    if STEP_TIME_KEY not in m:
        raise RuntimeError(f"{run_dir}: no {STEP_TIME_KEY} logged (did the trainer run a step?)")
    by_step = dict(m[STEP_TIME_KEY])
    steps = max(by_step)
    if sorted(by_step) != list(range(1, steps + 1)):
        raise RuntimeError(f"{run_dir}: {STEP_TIME_KEY} logged for steps {sorted(by_step)}, not 1..{steps}")
    step_times = [by_step[s] for s in range(1, steps + 1)]
    own = [0.0]
    for t in step_times:
        own.append(own[-1] + t)
    gpu = own if calibration is None else [calibrated_gpu_seconds(s, *calibration) for s in range(steps + 1)]
    reward = dict(m.get(REWARD_KEY, []))
    exact = dict(m.get(EXACT_KEY, []))
    if need_validation and (0 not in reward or not any(s > 0 for s in reward)):
        raise RuntimeError(f"{run_dir}: {REWARD_KEY} needs a step-0 validation (--val_before_train) and one after "
                           f"training; logged at steps {sorted(reward)}")
    samples = validation_rewards(run_dir)
    curve = []
    for s in sorted(reward):
        if s <= steps:
            point = {"step": s, "gpu_seconds": gpu[s], "reward": reward[s],
                     "reward_se": standard_error(samples.get(s, [])), "n": len(samples.get(s, [])),
                     "exact_match": exact.get(s)}
            if calibration is not None:
                point["shared_seconds"] = own[s]
            curve.append(point)
    train_curve = [{"step": s, "gpu_seconds": gpu[s], "reward": v} for s, v in m.get(TRAIN_REWARD_KEY, [])
                   if s <= steps]
    timing = {k.split("/", 1)[1]: sum(v for _, v in vals) for k, vals in m.items() if k.startswith("timing_s/")}
    record = RunRecord(steps=steps, step_times=step_times, curve=curve, train_curve=train_curve, timing_s=timing,
                       calibrated=calibration is not None, health=run_health(m))
    grids = images(run_dir, GRID_TAG)
    if grids:
        first, last = min(grids), max(grids)
        record.grids = {"before": (first, grids[first]), "after": (last, grids[last])}
    return record


# ----------------------------------------------------------------------------------------------------------------
# Running trainers: each in its own process group, polled from the main thread, all stopped on any exit
# ----------------------------------------------------------------------------------------------------------------

LIVE: dict[int, subprocess.Popen] = {}              # pid -> every trainer launcher this bench has running
PROGRESS = re.compile(r"step (\d+)/(\d+) \| ([0-9.]+)s/step(?:.*?rewards/mean ([-+0-9.eEna]+))?")


def _die_with_parent() -> None:  # runs in the child before exec: SIGTERM to torchrun if the bench dies (SIGKILL)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch(script: str, argv: Sequence[str], log_path: str, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start `scripts/torchrun.py --nproc_per_node 1 <script> argv` (OMP_NUM_THREADS=1, the repo first on
    PYTHONPATH) in a new process group, its stdout and stderr to `log_path`, registered in LIVE."""
    command = [sys.executable, os.path.join(REPO, "scripts", "torchrun.py"), "--nproc_per_node", "1",
               "--master_port", str(free_port()), os.path.join(REPO, script), *map(str, argv)]
    inherited = [p for p in [os.environ.get("PYTHONPATH")] if p]
    run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, *inherited]), **(env or {}))
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(command, cwd=REPO, env=run_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)
    LIVE[proc.pid] = proc
    return proc


def stop_all(grace_s: float = 10.0) -> list[int]:
    """SIGTERM every live trainer's process group (torchrun, the rank, its rollout worker and OCR pool), SIGKILL
    what is left after `grace_s`; returns the pids that were stopped. Safe to call twice."""
    stopped = []
    for pid, proc in list(LIVE.items()):
        if proc.poll() is None:
            stopped.append(pid)
            with _suppress():
                os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for pid, proc in list(LIVE.items()):
        with _suppress():
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        with _suppress():
            os.killpg(pid, signal.SIGKILL)   # the group: children that outlived their launcher too
        with _suppress():
            proc.wait(timeout=5)
        LIVE.pop(pid, None)
    return stopped


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, (ProcessLookupError, PermissionError, subprocess.TimeoutExpired))


class Interrupted(Exception):
    """SIGINT / SIGTERM / SIGHUP reached the bench."""


def _on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def read_progress(log_path: str) -> list[tuple[int, int, float, float | None]]:
    """[(step, total, seconds per step, training reward or None), ...] from a trainer's progress lines."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - (1 << 20)))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    out = []
    for step, total, seconds, reward in PROGRESS.findall(text):
        try:
            value = float(reward) if reward else None
        except ValueError:
            value = None
        out.append((int(step), int(total), float(seconds), value))
    return out


@dataclass
class Job:
    name: str                      # e.g. "nft_s1", "control", "calibrate_dppo"
    algo: Algorithm
    flags: dict[str, Any]
    run_dir: str
    seed_index: int = 0
    calibration: tuple[float, float] | None = None   # used when the run shares the GPU
    kind: str = "run"              # "run" or "calibration"

    @property
    def argv(self) -> list[str]:
        return to_argv(dict(self.flags, output_dir=self.run_dir))


def run_jobs(jobs: Sequence[Job], concurrent: int, *, timeout_s: float, say: Callable[[str], None],
             on_done: Callable[[Job, subprocess.Popen | None, float, str | None], None], resume: bool = False,
             stop_launching_at: float | None = None, progress_every_s: float = 10.0) -> list[Job]:
    """Run `jobs` at most `concurrent` at a time from this thread, printing each run's progress (step, training
    reward, ETA) at most every `progress_every_s`; `on_done(job, proc, wall_s, error)` after each (error None on
    success; proc None when --resume found the run finished with the same flags). Past `stop_launching_at`
    (time.monotonic()) no job starts, but the running ones still finish; returns the jobs not started. The caller
    stops the runs (stop_all) on any exit."""
    pending, running, not_started = list(jobs), [], []
    while pending or running:
        while pending and len(running) < concurrent:
            if stop_launching_at is not None and time.monotonic() > stop_launching_at:
                not_started, pending = pending, []
                break
            job = pending.pop(0)
            marker = os.path.join(job.run_dir, "bench_done.json")
            if resume and os.path.isfile(marker) and json.load(open(marker)).get("argv") == job.argv:
                say(f"== {job.name}: finished earlier with the same flags (--resume), reused")
                on_done(job, None, json.load(open(marker)).get("wall_seconds", 0.0), None)
                continue
            shutil.rmtree(job.run_dir, ignore_errors=True)
            os.makedirs(os.path.dirname(job.run_dir) or ".", exist_ok=True)
            say(f"== {job.name} ({job.algo.label}): {job.algo.script} {' '.join(job.argv)}")
            log = job.run_dir + ".console.log"
            running.append((job, launch(job.algo.script, job.argv, log), time.monotonic(), log, [-1, 0.0]))
        time.sleep(0.5)
        for entry in list(running):
            job, proc, start, log, last = entry
            now = time.monotonic()
            lines = read_progress(log)
            if lines and lines[-1][0] != last[0] and now - last[1] >= progress_every_s:
                step, total, _, reward = lines[-1]
                eta = eta_seconds(step, total, [t for _, _, t, _ in lines])
                say(f"   {job.name}: step {step}/{total}" + ("" if reward is None else f", reward {reward:.3f}")
                    + f", {now - start:.0f} s, ETA {eta:.0f} s")
                last[:] = [step, now]
            rc = proc.poll()
            if rc is None and now - start > timeout_s:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
                error = f"ran past {timeout_s:.0f} s and was killed"
            elif rc is None:
                continue
            else:
                error = None if rc == 0 else f"exit {rc}"
            LIVE.pop(proc.pid, None)
            running.remove(entry)
            if error:
                with open(log, encoding="utf-8", errors="replace") as f:
                    error += ":\n" + f.read()[-4000:]
            on_done(job, proc, now - start, error)
            if error is None:
                with open(os.path.join(job.run_dir, "bench_done.json"), "w") as f:
                    json.dump({"argv": job.argv, "wall_seconds": now - start}, f)
    return not_started


# ----------------------------------------------------------------------------------------------------------------
# Summary: per run, then per algorithm over its seeds, then DiffusionNFT's efficiency against each other algorithm
# ----------------------------------------------------------------------------------------------------------------

def summarize_run(rec: RunRecord, control: RunRecord | None) -> dict[str, Any]:
    """One run: start and end (first and last evaluation, with their standard errors), gain, gain over the
    control (its end minus its start minus the control's), and the GPU-seconds to each gain in GAINS over its
    start (time_to_gain, interpolated)."""
    first, last = rec.curve[0], rec.curve[-1]
    gain = last["reward"] - first["reward"]
    base = None if control is None else control.curve[-1]["reward"] - control.curve[0]["reward"]
    ex = (None if first["exact_match"] is None or last["exact_match"] is None
          else last["exact_match"] - first["exact_match"])
    points = [(p["gpu_seconds"], p["reward"]) for p in rec.curve]
    return {"start": {k: first[k] for k in ("reward", "reward_se", "n", "exact_match")},
            "end": {k: last[k] for k in ("step", "gpu_seconds", "reward", "reward_se", "n", "exact_match")},
            "gain": {"reward": gain, "exact_match": ex},
            "gain_vs_control": None if base is None else gain - base,
            "gpu_seconds_to_gain": {f"{g:g}": time_to_gain(points, g) for g in GAINS}}


def summarize_algorithm(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One algorithm over its seeds (summarize_run entries): mean +- std of the held-out end reward, of the gain
    over the control (and its standard error over seeds, std / sqrt(n)), of exact match at the end, and of the
    GPU-seconds to each gain among the seeds that reached it ('reached' k/n)."""
    def stats(values):
        values = [v for v in values if v is not None]
        m, s = mean_std(values)
        return {"mean": m, "std": s, "n": len(values)}

    gains = [r["gain_vs_control"] for r in runs]
    out = {"seeds": len(runs),
           "end_reward": stats([r["end"]["reward"] for r in runs]),
           "gain_vs_control": {**stats(gains), "se": standard_error([g for g in gains if g is not None])},
           "end_exact_match": stats([r["end"]["exact_match"] for r in runs]),
           "end_gpu_seconds": stats([r["end"]["gpu_seconds"] for r in runs]),
           "gpu_seconds_to_gain": {}}
    for g in GAINS:
        times = [r["gpu_seconds_to_gain"][f"{g:g}"] for r in runs]
        out["gpu_seconds_to_gain"][f"{g:g}"] = {**stats(times), "per_seed": times,
                                                "reached": f"{sum(t is not None for t in times)}/{len(times)}"}
    return out


def efficiency(per_algo: Mapping[str, Mapping[str, Any]], per_run_end: Mapping[str, Sequence[float]],
               reference: str = "nft", calibration_cv: Mapping[str, float] | None = None,
               ) -> dict[str, dict[str, Any]]:
    """{other algorithm: {gain: efficiency_ratio(reference's per-seed GPU-seconds to the gain, the other's)}} for
    every trained algorithm other than the reference (the control excluded). `calibration_cv`: per algorithm, the
    relative standard error of the calibrated step time its runs were placed on (absent: 0)."""
    if reference not in per_algo:
        return {}
    cv = calibration_cv or {}
    out = {}
    for name, s in per_algo.items():
        if name in (reference, "control"):
            continue
        out[name] = {f"{g:g}": efficiency_ratio(per_algo[reference]["gpu_seconds_to_gain"][f"{g:g}"]["per_seed"],
                                                s["gpu_seconds_to_gain"][f"{g:g}"]["per_seed"], per_run_end[name],
                                                (cv.get(reference, 0.0), cv.get(name, 0.0)))
                     for g in GAINS}
    return out


def calibration_errors(calibration: Mapping[str, Mapping[str, Any]], placed: Sequence[str]) -> dict[str, float]:
    """{algorithm: t_rest_se / t_rest} for the algorithms in `placed` (their runs' GPU-seconds came from their solo
    calibration); 0 for the others and where the calibration measured no spread (fewer than three steps)."""
    out = {}
    for name, c in calibration.items():
        se, t_rest = c.get("t_rest_se"), c["t_first_t_rest"][1]
        out[name] = se / t_rest if name in placed and se is not None and t_rest > 0 else 0.0
    return out


def calibration_text(c: Mapping[str, Any]) -> str:
    """One calibration as text: 'step 1 12.15 s, then 3.13 ± 0.12 s/step (se over 7 steps)', or without a spread
    (fewer than two later steps) '... 2.00 s/step (1 later step, no spread)'."""
    t_first, t_rest = c["t_first_t_rest"]
    rest = len(c["step_times"]) - 1
    if c.get("t_rest_se") is None:
        return f"step 1 {t_first:.2f} s, then {t_rest:.2f} s/step ({rest} later step{'s' * (rest != 1)}, no spread)"
    return f"step 1 {t_first:.2f} s, then {t_rest:.2f} ± {c['t_rest_se']:.2f} s/step (se over {rest} steps)"


def targets(per_algo: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The benchmark's targets per trained algorithm: mean gain over the control >= 0.05 (DiffusionNFT: >= 0.15) and
    >= 3 standard errors over seeds."""
    out = {}
    for name, s in per_algo.items():
        if name == "control":
            continue
        g = s["gain_vs_control"]
        need = 0.15 if name == "nft" else 0.05
        met = None if g["mean"] is None else (g["mean"] >= need and g["se"] is not None and g["mean"] >= 3 * g["se"])
        out[name] = {"needed_gain": need, "met": met}
    return out


def health_text(runs: Mapping[str, Mapping[str, Any]], labels: Mapping[str, str]) -> str:
    """One line: the optimizer steps each run skipped (none, or which) and each ratio loss's importance-ratio range
    over every step of every seed (exactly [1, 1] at one optimizer step per rollout step)."""
    healthy = {name: r["health"] for name, r in runs.items() if "health" in r}
    skipped = {name: h["skipped_steps"] for name, h in healthy.items() if h.get("skipped_steps")}
    parts = [("optimizer steps skipped: " + ", ".join(f"{n} {k}" for n, k in skipped.items())) if skipped else
             f"no optimizer step skipped in any of the {len(healthy)} runs"]
    ranges: dict[str, list[float]] = {}
    for name, h in healthy.items():
        if "ratio_range" in h:
            lo, hi = h["ratio_range"]
            old = ranges.setdefault(runs[name]["algorithm"], [lo, hi])
            ranges[runs[name]["algorithm"]] = [min(old[0], lo), max(old[1], hi)]
    if ranges:
        parts.append("importance ratio over every step and seed: " + "; ".join(
            f"{labels.get(a, a)} [{lo:.9g}, {hi:.9g}]" for a, (lo, hi) in ranges.items()))
    return "Health: " + "; ".join(parts) + "."


def cost_text(cost: Mapping[str, Any]) -> str:
    """One line: this invocation's wall time (solo calibrations, then the runs) and the runs it reused."""
    text = (f"Cost: this invocation ran {cost['wall_s'] / 60:.1f} min wall ({cost['calibration_wall_s']:.0f} s of "
            f"solo calibrations, {cost['runs_wall_s']:.0f} s of runs)")
    if cost["reused"]:
        text += (f"; {len(cost['reused'])} run(s) reused from an earlier invocation (--resume), their time not "
                 f"included ({', '.join(cost['reused'])})")
    return text + "."


def _pm(stat: Mapping[str, Any] | None, spec: str = ".3f", sign: str = "") -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    return f"{stat['mean']:{sign}{spec}} ± {stat['std']:{spec}}"


def _ratio_text(r: Mapping[str, Any]) -> str:
    if r["ratio"] is not None:
        return f"{r['ratio']:.2f}x ± {r.get('std_total', r['std']):.2f} [{r['min']:.2f}-{r['max']:.2f}]"
    if r["lower_bound"] is not None:
        return f"> {r['lower_bound']:.2f}x"
    return "-"


def table_rows(per_algo: Mapping[str, Mapping[str, Any]], eff: Mapping[str, Mapping[str, Any]],
               labels: Mapping[str, str], settings: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The summary table as rows of cells (header first), shared by the console and the markdown file."""
    head = ["algorithm", "seeds", "samples/update", "lr", "steps", "GPU-s", "held-out end", "gain vs control",
            "exact end", *[f"GPU-s to +{g:g}" for g in GAINS], *[f"NFT efficiency @+{g:g}" for g in GAINS]]
    rows = [head]
    for name, s in per_algo.items():
        st = settings[name]
        times = []
        for g in GAINS:
            t = s["gpu_seconds_to_gain"][f"{g:g}"]
            times.append("not reached" if t["mean"] is None else f"{_pm(t, '.1f')} ({t['reached']})")
        ratios = [("-" if name not in eff else _ratio_text(eff[name][f"{g:g}"])) for g in GAINS]
        gain = _pm(s["gain_vs_control"], ".3f", "+")
        if s["gain_vs_control"].get("se") is not None:
            gain += f" (se {s['gain_vs_control']['se']:.3f})"
        rows.append([labels[name], str(s["seeds"]), str(st["samples_per_update"]), f"{float(st['lr']):g}",
                     str(st["steps"]), _pm(s["end_gpu_seconds"], ".1f"), _pm(s["end_reward"]), gain,
                     _pm(s["end_exact_match"]), *times, *ratios])
    return rows


def console_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
                      *("| " + " | ".join(r) + " |" for r in rows[1:])])


# ----------------------------------------------------------------------------------------------------------------
# Pictures
# ----------------------------------------------------------------------------------------------------------------

def plot_bands(curves: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], labels: Mapping[str, str], path: str,
               title: str) -> None:
    """Held-out reward and exact match against GPU-seconds: per algorithm one band, mean +- std over its seeds'
    curves (band), the control dashed (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, what in ((axes[0], "reward", "held-out OCR reward (rapidocr, mean@1)"),
                          (axes[1], "exact_match", "held-out exact-match accuracy")):
        for name, seeds in curves.items():
            pts = [[(p["gpu_seconds"], p[key]) for p in c if p[key] is not None] for c in seeds]
            pts = [c for c in pts if c]
            if not pts:
                continue
            xs, mean, std = band(pts)
            line, = ax.plot(xs, mean, marker="o", markersize=3, linestyle="--" if name == "control" else "-",
                            label=f"{labels[name]} (n={len(pts)})")
            ax.fill_between(xs, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=line.get_color(), alpha=0.2)
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
    epilog = "Why each setting is what it is:\n" + "\n".join(f"  {k}: {v}" for k, v in WHY.items()) + \
        f"\n  start point: {START_POINT}\n  GPU-seconds: {GPU_SECONDS}"
    p = argparse.ArgumentParser(description=__doc__, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_path", default=os.environ.get("MODEL_PATH"),
                   help="pipeline folder (the small pretrained Qwen-Image layout); default $MODEL_PATH")
    p.add_argument("--train_files", help="RL prompts (verl-omni parquet, data_source 'ocr', train templates)")
    p.add_argument("--val_files", help="held-out prompts (data_source 'ocr', templates not in --train_files); "
                                       "every row is evaluated")
    p.add_argument("--out_dir", default="outputs/bench_learning", help="where the JSON, plot, table and log go")
    p.add_argument("--work_dir", default=None, help="the runs' output dirs (default <out_dir>/runs)")
    p.add_argument("--algorithms", default=DEFAULT_ALGORITHMS,
                   help=f"comma-separated subset of {list(ALGORITHMS)}; the control runs first, once")
    p.add_argument("--seeds", type=int, default=None,
                   help="runs per trained algorithm, trainer seeds 42, 43, ... (default 3; 1 with --smoke)")
    p.add_argument("--budget_s", type=float, default=None,
                   help="GPU-seconds of training per run; each algorithm runs the steps that fill it at its "
                        "calibrated step time (default 240; why: 'budget' below)")
    p.add_argument("--steps", type=int, default=None, help="this many steps per run instead of --budget_s")
    p.add_argument("--evals", type=int, default=6,
                   help="held-out evaluations after step 0 per run (every ceil(steps / evals) steps, the last "
                        "step always): the points of the curve that time-to-gain interpolates")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply every algorithm's prompts per step by this (the same factor for all)")
    p.add_argument("--concurrent", type=int, default=1,
                   help="trainers sharing the GPU at a time; > 1 takes GPU-seconds from solo calibration runs")
    p.add_argument("--calibration_steps", type=int, default=8,
                   help="steps of each algorithm's solo calibration run (needed for --budget_s or --concurrent > 1); "
                        "the mean of steps 2.. is the step time, its standard error enters the efficiency ratios "
                        "(default 8; why: 'calibration' below)")
    p.add_argument("--ocr_workers", type=int, default=None,
                   help="RapidOCR processes per run (default cores - 2, <= 16; 1 with --smoke). Per run, not "
                        "split over the concurrent runs: the solo calibrations score with as many, so a step's "
                        "reward time is that of a run alone on the machine; concurrent runs share the CPU, which "
                        "slows only their wall time")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="[ALGO.]KEY=VALUE",
                   help="change a trainer flag of every run (KEY=VALUE) or of one algorithm (e.g. "
                        "grpo.clip_ratio=1e-4, grpo.noise_level=0.7, lr=1e-3); applied last")
    p.add_argument("--resume", action="store_true",
                   help="reuse runs (and calibrations) in --work_dir that finished with the same trainer flags")
    p.add_argument("--max_runtime_s", type=float, default=None,
                   help="start no run after this many seconds of the bench; the runs already started finish (a "
                        "later --resume call continues); the report then says complete: false and the bench exits 3")
    p.add_argument("--timeout_s", type=float, default=1800.0, help="kill a run after this long (wall)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: tiny Qwen-Image, 64^2, 2 steps, 1 prompt x 2 samples, built-in prompts "
                        "(no learning expected; checks the whole path)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.algorithms.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown or not names:
        p.error(f"--algorithms {args.algorithms!r}: unknown {unknown}; known {list(ALGORITHMS)}")
    args.names = ["control"] * ("control" in names) + [n for n in dict.fromkeys(names) if n != "control"]
    if args.seeds is None:
        args.seeds = 1 if args.smoke else 3
    if args.ocr_workers is None:
        args.ocr_workers = 1 if args.smoke else max(1, min(16, (os.cpu_count() or 1) - 2))
    if args.smoke and args.steps is None and args.budget_s is None:
        args.steps = 2
    if args.budget_s is None:
        args.budget_s = 240.0
    if args.seeds < 1 or args.concurrent < 1 or args.calibration_steps < 1 or args.evals < 1 or args.scale <= 0:
        p.error("--seeds, --concurrent, --calibration_steps and --evals must be >= 1, --scale > 0")
    if not args.smoke and not (args.model_path and args.train_files and args.val_files):
        p.error("--model_path, --train_files and --val_files are required (or --smoke)")
    return args


def main(argv=None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON document it wrote."""
    args = parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_learning: no CUDA GPU here; the benchmark needs one (--smoke runs the CPU path)")
    os.makedirs(args.out_dir, exist_ok=True)
    work_dir = args.work_dir or os.path.join(args.out_dir, "runs")
    os.makedirs(work_dir, exist_ok=True)
    log_path = os.path.join(args.out_dir, FILES["log"])
    open(log_path, "a").close()

    def say(text: str) -> None:
        print(text, flush=True)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(text + "\n")

    overrides = parse_overrides(args.overrides, list(ALGORITHMS))
    device = "cpu" if args.smoke else "cuda"
    common = dict(COMMON, device=device, rollout_devices="cuda:0" if device == "cuda" else "cpu",
                  rapidocr_workers=args.ocr_workers)
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
    common.update(model_path=model_path, train_files=train_files, val_files=val_files)
    algos = {n: ALGORITHMS[n] for n in args.names}
    if args.smoke:
        algos = {n: Algorithm(a.name, a.label, a.script, SMOKE_PROMPTS, dict(a.flags, **SMOKE_ALGO[a.script]),
                              a.recipe) for n, a in algos.items()}
    labels = {n: a.label for n, a in algos.items()}
    shared = args.concurrent > 1
    header = {
        "benchmark": "bench_learning", "schema_version": 2,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": sys.argv[1:] if argv is None else list(argv), "smoke": args.smoke, "model_path": model_path,
        "train_files": train_files, "val_files": val_files, "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "seeds": args.seeds,
        "concurrent": args.concurrent, "scale": args.scale,
        "budget": ({"mode": "steps", "steps": args.steps} if args.steps is not None else
                   {"mode": "gpu_seconds", "budget_s": args.budget_s, "evals": args.evals}),
        "gpu_seconds_source": ("solo calibration runs (the runs shared the GPU: --concurrent "
                               f"{args.concurrent})" if shared else "each run's own step times (one run at a time)"),
        "gpu_seconds_definition": GPU_SECONDS, "control": CONTROL_WHY, "start_point_definition": START_POINT,
        "why": WHY, "gains": list(GAINS),
    }
    title = (f"bench_learning: {', '.join(labels.values())}; {args.seeds} seed(s); "
             + (f"{args.steps} steps" if args.steps is not None else f"{args.budget_s:g} GPU-s") + " per run")

    state: dict[str, Any] = {"records": {}, "runs": {}, "failed": {}, "calibration": {}, "settings": {},
                             "clock": {"started": time.monotonic(), "calibrated": None, "reused": []}}
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    deadline = None if args.max_runtime_s is None else time.monotonic() + args.max_runtime_s
    try:
        # 1. solo calibrations: each algorithm's step time at its own settings, alone on the GPU
        need_calibration = args.steps is None or shared
        base = {n: run_flags(a, common, overrides, steps=1, test_freq=1, scale=args.scale)
                for n, a in algos.items()}
        if need_calibration:
            def calibrated(job, proc, wall, error):
                if error:
                    raise RuntimeError(f"calibration {job.name} failed ({error[-2000:]})")
                if proc is None:
                    state["clock"]["reused"].append(job.name)
                rec = read_run(job.run_dir, need_validation=False)
                state["calibration"][job.algo.name] = {"step_times": rec.step_times,
                                                       "t_first_t_rest": calibration_times(rec.step_times),
                                                       "t_rest_se": standard_error(rec.step_times[1:]),
                                                       "steps": rec.steps}
            say(f"== calibrating {', '.join(algos)}: {args.calibration_steps} solo steps each, no validation")
            run_jobs([Job(f"calibrate_{n}", a, calibration_flags(base[n], args.calibration_steps),
                          os.path.join(work_dir, f"calibrate_{n}"), kind="calibration") for n, a in algos.items()],
                     1, timeout_s=args.timeout_s, say=say, on_done=calibrated, resume=args.resume)
            for n, c in state["calibration"].items():
                say(f"   {n}: {calibration_text(c)}")
        state["clock"]["calibrated"] = time.monotonic()
        # 2. the runs: control once, then seed after seed of every trained algorithm
        jobs = []
        for n, a in algos.items():
            if args.steps is not None:
                steps, every = args.steps, max(1, math.ceil(args.steps / args.evals))
            else:
                steps, every = steps_for_budget(args.budget_s, *state["calibration"][n]["t_first_t_rest"],
                                                args.evals)
            flags = dict(base[n], total_training_steps=steps, test_freq=every)
            flags.update({k: v for k, v in overrides.get("*", {}).items() if k in ("total_training_steps",
                                                                                   "test_freq")})
            flags.update({k: v for k, v in overrides.get(n, {}).items() if k in ("total_training_steps",
                                                                                 "test_freq")})
            state["settings"][n] = {"samples_per_update": int(flags["ppo_mini_batch_size"]) * int(flags["rollout_n"]),
                                    "lr": flags["lr"], "steps": flags["total_training_steps"],
                                    "test_freq": flags["test_freq"]}
            for k in range(1 if n == "control" else args.seeds):
                name = "control" if n == "control" else f"{n}_s{k}"
                jobs.append((k, Job(name, a, dict(flags, seed=int(flags["seed"]) + k),
                                    os.path.join(work_dir, name), seed_index=k,
                                    calibration=state["calibration"].get(n, {}).get("t_first_t_rest"))))
        jobs = [j for _, j in sorted(jobs, key=lambda kj: (kj[1].algo.name != "control", kj[0]))]
        state["names"] = [j.name for j in jobs]

        def finished(job, proc, wall, error):
            if proc is None:
                state["clock"]["reused"].append(job.name)
            if error:
                state["failed"][job.name] = error[-4000:]
                state["runs"][job.name] = {"algorithm": job.algo.name, "label": job.algo.label,
                                           "settings": job.flags, "error": state["failed"][job.name]}
                say(f"   {job.name} FAILED: {error[-1500:]}")
            else:
                rec = read_run(job.run_dir, calibration=job.calibration if shared else None)
                state["records"][job.name] = rec
                state["runs"][job.name] = run_entry(job, rec, wall, shared)
                last = rec.curve[-1]
                say(f"   {job.name}: {rec.steps} steps, {rec.gpu_seconds:.1f} GPU-s, {wall:.1f} s wall; held-out "
                    f"{rec.curve[0]['reward']:.3f} -> {last['reward']:.3f}"
                    + ("" if last["reward_se"] is None else f" (se {last['reward_se']:.3f}, n {last['n']})"))
                with open(job.run_dir + ".console.log", encoding="utf-8", errors="replace") as f, \
                        open(log_path, "a", encoding="utf-8") as log:
                    log.write(f.read())
            write_report(state, jobs, labels, header, args.out_dir, title, complete=False, say=lambda _: None)

        left = run_jobs(jobs, args.concurrent, timeout_s=args.timeout_s, say=say, on_done=finished,
                        resume=args.resume, stop_launching_at=deadline)
    except Interrupted as why:
        stopped = stop_all()
        say(f"bench_learning: interrupted ({why}); stopped {len(stopped)} running trainer(s); the report covers the "
            "finished runs")
        raise SystemExit(130)
    finally:
        stop_all()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if not state["records"] and not left:
        raise SystemExit(f"every run failed ({', '.join(state['failed'])}); see {log_path}")
    doc = write_report(state, jobs, labels, header, args.out_dir, title, complete=not left, say=say)
    if left:
        say(f"incomplete: {len(left)} run(s) not started before --max_runtime_s ({', '.join(j.name for j in left)}); "
            "run the same command with --resume to continue")
        raise SystemExit(3)
    if state["failed"]:
        raise SystemExit(f"runs {', '.join(state['failed'])} failed (their errors are in {FILES['json']} and "
                         f"{log_path}); the report covers {', '.join(state['records'])}")
    return doc


def run_entry(job: Job, rec: RunRecord, wall_s: float, shared: bool) -> dict[str, Any]:
    """One run's JSON entry before the summary (settings, command, steps, GPU-seconds and their source, curves)."""
    meta_path = os.path.join(job.run_dir, "run_metadata.json")
    meta = json.load(open(meta_path, encoding="utf-8")) if os.path.isfile(meta_path) else {}
    return {
        "algorithm": job.algo.name, "label": job.algo.label, "seed_index": job.seed_index,
        "script": job.algo.script, "recipe": job.algo.recipe, "settings": dict(job.flags),
        "command": ["torchrun", "--nproc_per_node", "1", job.algo.script, *job.argv],
        "steps": rec.steps, "gpu_seconds": rec.gpu_seconds, "wall_seconds": wall_s,
        "gpu_seconds_source": ("solo calibration (t_first, t_rest) = " + str(list(job.calibration))
                               if shared else "own step times (solo)"),
        "own_step_seconds": sum(rec.step_times), "timing_s": rec.timing_s, "health": rec.health, "curve": rec.curve,
        "train_curve": rec.train_curve, "grid_steps": {k: v[0] for k, v in rec.grids.items()},
        "git_commit": meta.get("git_commit"), "versions": meta.get("versions"),
    }


def write_report(state: Mapping[str, Any], jobs: Sequence[Job], labels: Mapping[str, str],
                 header: Mapping[str, Any], out_dir: str, title: str, *, complete: bool,
                 say: Callable[[str], None] = print) -> dict[str, Any]:
    """Summarize the finished runs (state["records"], their entries in state["runs"], updated in place) and write
    the JSON, the band plot, the markdown table and the grids into `out_dir`; prints the table through `say`.
    Returns the JSON document."""
    records, runs = state["records"], state["runs"]
    by_algo: dict[str, list[str]] = {}
    for job in jobs:
        if job.name in records:
            by_algo.setdefault(job.algo.name, []).append(job.name)
    control = records.get("control")
    for name, rec in records.items():
        runs[name].update(summarize_run(rec, control))
    per_algo = {a: summarize_algorithm([runs[n] for n in names]) for a, names in by_algo.items()}
    ends = {a: [runs[n]["end"]["gpu_seconds"] for n in names] for a, names in by_algo.items()}
    placed = [a for a, names in by_algo.items() if any(records[n].calibrated for n in names)]
    eff = efficiency(per_algo, ends, calibration_cv=calibration_errors(state["calibration"], placed))
    rows = table_rows(per_algo, eff, labels, state["settings"])
    start = control.curve[0] if control else None
    clock, now = state["clock"], time.monotonic()
    calibrated = clock["calibrated"] or now
    cost = {"wall_s": now - clock["started"], "calibration_wall_s": calibrated - clock["started"],
            "runs_wall_s": now - calibrated, "reused": list(clock["reused"])}
    doc = {**header, "complete": complete, "cost": cost, "pending": [j.name for j in jobs if j.name not in runs],
           "calibration": state["calibration"], "settings": state["settings"],
           "start_point": None if start is None else {k: start[k] for k in ("reward", "reward_se", "n",
                                                                            "exact_match")},
           "algorithms": per_algo, "efficiency_nft_over": eff, "targets": targets(per_algo), "runs": runs,
           "table": rows, "files": dict(FILES)}
    curves = {a: [records[n].curve for n in names] for a, names in by_algo.items()}
    plot_bands(curves, {a: labels[a] for a in curves}, os.path.join(out_dir, FILES["plot"]), title)
    firsts = {a: records[names[0]] for a, names in by_algo.items() if records[names[0]].grids}
    if firsts:
        compose_grids(firsts, labels, os.path.join(out_dir, FILES["grids"]))
    start_line = ("start point: -" if start is None else
                  f"start point (the control's step-0 evaluation): reward {start['reward']:.3f}"
                  + ("" if start["reward_se"] is None else f" ± {start['reward_se']:.3f} (se, n {start['n']})")
                  + ("" if start["exact_match"] is None else f", exact match {start['exact_match']:.3f}"))
    markdown = "\n\n".join([
        f"# {title}", f"Created {header['created']}" + (f" on one {header['gpu']}" if header.get("gpu") else "")
        + f"; {'complete' if complete else 'INCOMPLETE'}; GPU-seconds from "
        f"{header['gpu_seconds_source']}. {cost_text(cost)}", start_line, markdown_table(rows),
        "Gain vs control: mean ± std over seeds of (end - start) - the control's (end - start), se = std / sqrt(n). "
        "GPU-s to +g: over the seeds that reached start + g (interpolated between evaluations), k/n reached. NFT "
        "efficiency: the other's GPU-seconds to the gain / DiffusionNFT's (ratio of seed means ± delta-method "
        "std over seeds and, for runs placed on a solo calibration, the calibrated step times' standard errors "
        "[min-max over seed pairs]; '> x' when the other never reached it).",
        health_text(runs, labels),
        *(["Solo calibrations: " + "; ".join(f"{labels.get(n, n)} {calibration_text(c)}"
                                             for n, c in state["calibration"].items()) + "."]
          if state["calibration"] else []),
        "Command: `python3 tools/bench_learning.py " + " ".join(header["argv"]) + "`"]) + "\n"
    with open(os.path.join(out_dir, FILES["markdown"]), "w", encoding="utf-8") as f:
        f.write(markdown)
    tmp = os.path.join(out_dir, FILES["json"] + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_finite(doc), f, indent=2, allow_nan=False, default=str)
    os.replace(tmp, os.path.join(out_dir, FILES["json"]))
    say("\n" + start_line + "\n" + console_table(rows) + "\n" + health_text(runs, labels) + "\n" + cost_text(cost))
    say(f"wrote {', '.join(os.path.join(out_dir, v) for k, v in FILES.items() if k != 'log')}")
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
