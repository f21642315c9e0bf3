"""tools/bench_learning.py: the math (standard error, time to a gain, DiffusionNFT's efficiency ratio with its
spread, the bands, the calibrated GPU-seconds and step budget), each against values computed by hand; the fair
default flags (parsed by the trainers' own parsers); reading runs back; the summary, JSON, markdown and plots; the
scheduler's bookkeeping (calibration, concurrency, resume, the run-time limit, failures) with a fake launcher; the
refusal without a GPU; stopping every child on SIGTERM; and (slow) the CPU smoke run end to end."""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch

import bench_learning as B
from trainer_runs import REPO

# one pytest-xdist worker runs this module (pytest.ini: --dist loadgroup): its module fixtures are costly
pytestmark = pytest.mark.xdist_group("test_bench_learning")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path) -> None:
    from PIL import Image

    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.width > 100 and im.height > 100, (path, im.size)


# ------------------------------------------------------------------------------------------------------------------
# The math, against values computed independently (by hand or with the statistics module)
# ------------------------------------------------------------------------------------------------------------------

def test_mean_std_and_standard_error():
    values = [0.2, 0.5, 0.4, 0.9]
    mean, std = B.mean_std(values)
    assert mean == pytest.approx(statistics.mean(values)) and std == pytest.approx(statistics.stdev(values))
    assert B.standard_error(values) == pytest.approx(statistics.stdev(values) / 2.0)
    assert B.standard_error([1.0, 2.0, 3.0, 4.0]) == pytest.approx(math.sqrt(5 / 3) / 2)  # 0.6455
    assert B.mean_std([0.7]) == (0.7, 0.0) and B.mean_std([]) == (None, None)
    assert B.standard_error([0.7]) is None and B.standard_error([]) is None


def test_time_to_gain_interpolates_or_takes_the_first_evaluation_past_it():
    curve = [(0.0, 0.40), (10.0, 0.42), (20.0, 0.50), (30.0, 0.47), (40.0, 0.60)]
    assert B.time_to_gain(curve, 0.05) == pytest.approx(10 + 0.03 / 0.08 * 10)      # 13.75
    assert B.time_to_gain(curve, 0.05, interpolate=False) == 20.0
    assert B.time_to_gain(curve, 0.10) == pytest.approx(20.0)                       # exactly at an evaluation
    assert B.time_to_gain(curve, 0.15) == pytest.approx(30 + (0.55 - 0.47) / 0.13 * 10)  # after a dip
    assert B.time_to_gain(curve, 0.25) is None                                      # not reached
    assert B.time_to_gain([(0.0, 0.4), (5.0, 0.3)], 0.05) is None


def test_efficiency_ratio_with_its_spread_and_bounds():
    r = B.efficiency_ratio([10.0, 20.0], [30.0, 50.0, 40.0])
    # mean 40 / mean 15; delta method with cv_nft = 7.0711 / 15, cv_other = 10 / 40; pairs 30/20 .. 50/10
    assert r["ratio"] == pytest.approx(40 / 15)
    assert r["std"] == pytest.approx(40 / 15 * math.sqrt((math.sqrt(50) / 15) ** 2 + (10 / 40) ** 2))  # 1.4229
    assert r["std"] == pytest.approx(1.4229, abs=1e-4)
    assert (r["min"], r["max"]) == (pytest.approx(1.5), pytest.approx(5.0))
    assert r["reached"] == {"nft": "2/2", "other": "3/3"} and r["lower_bound"] is None
    partial = B.efficiency_ratio([10.0, 20.0], [30.0, None])
    assert partial["ratio"] == pytest.approx(2.0) and partial["reached"]["other"] == "1/2"
    never = B.efficiency_ratio([10.0, 20.0], [None, None], [100.0, 120.0])
    assert never["ratio"] is None and never["lower_bound"] == pytest.approx(100 / 15)
    assert B.efficiency_ratio([None], [5.0])["ratio"] is None
    one = B.efficiency_ratio([10.0], [25.0])
    assert one["ratio"] == pytest.approx(2.5) and one["std"] == 0.0 and one["std_total"] == 0.0
    # the calibrations' relative errors (shared by all seeds of an algorithm) add once to the seeds' variance
    cal = B.efficiency_ratio([10.0, 20.0], [30.0, 50.0, 40.0], calibration_cv=(0.03, 0.04))
    assert cal["std"] == pytest.approx(r["std"])
    assert cal["std_total"] == pytest.approx(40 / 15 * math.sqrt((math.sqrt(50) / 15) ** 2 + (10 / 40) ** 2
                                                                  + 0.03 ** 2 + 0.04 ** 2))
    assert B.efficiency_ratio([10.0], [25.0], calibration_cv=(0.03, 0.04))["std_total"] == pytest.approx(1.25 * 0.05 * 2)
    assert B._ratio_text(cal).startswith(f"2.67x ± {cal['std_total']:.2f} [")


def test_band_interpolates_every_curve_onto_the_common_points():
    xs, mean, std = B.band([[(0.0, 0.0), (10.0, 1.0)], [(0.0, 0.0), (5.0, 1.0), (20.0, 2.0)]])
    assert xs == [0.0, 5.0, 10.0]                        # cut at the shorter curve's end
    assert mean == pytest.approx([0.0, 0.75, (1.0 + 4 / 3) / 2])
    assert std == pytest.approx([0.0, math.sqrt(2 * 0.25 ** 2), statistics.stdev([1.0, 4 / 3])])
    xs, mean, std = B.band([[(0.0, 0.3), (4.0, 0.5)]])
    assert xs == [0.0, 4.0] and mean == [0.3, 0.5] and std == [0.0, 0.0]


def test_calibration_step_budget_scale_and_eta():
    assert B.calibration_times([3.0, 1.0, 2.0]) == (3.0, 1.5) and B.calibration_times([2.0]) == (2.0, 2.0)
    cal = {"nft": {"step_times": [9.0, 5.0, 7.0, 6.0], "t_first_t_rest": [9.0, 6.0], "t_rest_se": 1 / math.sqrt(3)},
           "dppo": {"step_times": [4.0, 2.0], "t_first_t_rest": [4.0, 2.0], "t_rest_se": None}}
    assert B.calibration_errors(cal, ["nft", "dppo"]) == {"nft": pytest.approx(1 / math.sqrt(3) / 6), "dppo": 0.0}
    assert B.calibration_errors(cal, ["dppo"])["nft"] == 0.0             # runs timed on their own steps: no such error
    assert B.calibration_text(cal["nft"]) == "step 1 9.00 s, then 6.00 ± 0.58 s/step (se over 3 steps)"
    assert B.calibration_text(cal["dppo"]) == "step 1 4.00 s, then 2.00 s/step (1 later step, no spread)"
    assert [B.calibrated_gpu_seconds(s, 3.0, 1.5) for s in (0, 1, 4)] == [0.0, 3.0, 7.5]
    assert B.steps_for_budget(120, 5.0, 3.5, 6) == (30, 6)   # 1 + floor(115 / 3.5) = 33 fit -> 5 x 6
    assert B.steps_for_budget(10, 1.0, 1.0, 5) == (10, 2)
    assert B.steps_for_budget(2, 5.0, 3.5, 6) == (1, 1)      # at least one step
    assert B.steps_for_budget(12, 2.0, 1.0, 20) == (11, 1)
    assert [B.scaled_prompts(p, s) for p, s in ((16, 1.0), (16, 0.5), (12, 0.5), (12, 0.01))] == [16, 8, 6, 1]
    assert B.eta_seconds(3, 10, [5.0, 1.0, 2.0, 3.0]) == pytest.approx(14.0) and B.eta_seconds(3, 3, [1.0]) == 0


# ------------------------------------------------------------------------------------------------------------------
# Flags: the fair defaults, parsed by the trainers' own parsers
# ------------------------------------------------------------------------------------------------------------------

def test_fair_defaults_each_recipe_batch_one_update_per_step_one_lr():
    flags = {n: B.run_flags(a, B.COMMON, {}, steps=10, test_freq=2) for n, a in B.ALGORITHMS.items()}
    per_update = {n: int(f["ppo_mini_batch_size"]) * f["rollout_n"] for n, f in flags.items()}
    assert per_update == {"control": 256, "nft": 192, "dppo": 256, "grpo": 256, "grpo_fg": 256}
    assert all(f["train_batch_size"] == f["ppo_mini_batch_size"] for f in flags.values())   # one update per step
    assert {n: f["lr"] for n, f in flags.items()} == {"control": 0.0, "nft": 3e-4, "dppo": 3e-4, "grpo": 3e-4,
                                                      "grpo_fg": 3e-4}
    assert flags["grpo"]["clip_ratio"] == 1e-5 and flags["grpo"]["noise_level"] == 1.2
    assert flags["grpo_fg"]["clip_ratio"] == 1e-4 and flags["grpo_fg"]["noise_level"] == 0.7
    assert flags["nft"]["val_max_samples"] == 0 and flags["nft"]["val_before_train"]        # every held-out prompt
    half = {n: B.run_flags(a, B.COMMON, {}, steps=1, test_freq=1, scale=0.5)["train_batch_size"]
            for n, a in B.ALGORITHMS.items()}
    assert half == {"control": 8, "nft": 6, "dppo": 8, "grpo": 8, "grpo_fg": 8}
    over = B.parse_overrides(["lr=1e-3", "grpo.clip_ratio=1e-4", "grpo.noise_level=0.7"], list(B.ALGORITHMS))
    grpo = B.run_flags(B.ALGORITHMS["grpo"], B.COMMON, over, steps=1, test_freq=1)
    dppo = B.run_flags(B.ALGORITHMS["dppo"], B.COMMON, over, steps=1, test_freq=1)
    control = B.run_flags(B.ALGORITHMS["control"], B.COMMON, over, steps=1, test_freq=1)
    assert (grpo["clip_ratio"], grpo["noise_level"], grpo["lr"]) == ("1e-4", "0.7", "1e-3")
    assert dppo["noise_level"] == 1.2 and dppo["lr"] == "1e-3" and control["lr"] == 0.0
    for bad in (["lr"], ["=1"], ["nosuch.lr=1"], ["control.lr=1e-3"]):
        with pytest.raises(ValueError):
            B.parse_overrides(bad, list(B.ALGORITHMS))
    assert B.to_argv(dict(a=1, flag=True, off=False, gone=None, named="none")) == ["--a", "1", "--flag"]
    calib = B.to_argv(B.calibration_flags(dict(flags["nft"], val_files="v.parquet"), 3))
    assert "--val_files" not in calib and "--val_before_train" not in calib
    assert calib[calib.index("--total_training_steps") + 1] == "3"


def test_help_says_why():
    text = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_learning.py"), "--help"],
                          capture_output=True, text=True, timeout=120).stdout
    for needed in ("cosine between two batches' gradients 0.00-0.09", "16 prompts x 16 = 256", "12 x 16 = 192",
                   "3e-4", "--concurrent", "start point", "--seeds", "calibration"):
        assert needed in " ".join(text.split()), needed


@pytest.mark.parametrize("name", list(B.ALGORITHMS))
@pytest.mark.parametrize("smoke", [False, True])
def test_every_run_parses_with_its_trainers_own_parser(name, smoke):
    import importlib

    algo = B.ALGORITHMS[name]
    common = {**B.COMMON, **(B.SMOKE if smoke else {}), "device": "cpu", "rollout_devices": "cpu"}
    if smoke:
        algo = B.Algorithm(algo.name, algo.label, algo.script, B.SMOKE_PROMPTS,
                           dict(algo.flags, **B.SMOKE_ALGO[algo.script]), "")
    trainer = importlib.import_module(algo.script[:-3])
    flags = B.run_flags(algo, common, {}, steps=6, test_freq=3)
    args = trainer.parse_args(B.to_argv(dict(flags, model_path="m", train_files="t.parquet", output_dir="o")))
    assert args.lr == (0.0 if name == "control" else common["lr"]) and args.total_training_steps == 6
    assert args.test_freq == 3 and args.val_max_samples == 0 or smoke
    assert args.ocr_backend == "rapidocr" and args.val_before_train and args.true_cfg_scale == 1.0
    assert args.train_batch_size == args.ppo_mini_batch_size == algo.prompts
    if algo.script == "train_dppo.py":
        assert args.loss == ("flow_dppo" if name in ("dppo", "control") else "flow_grpo")
    else:
        assert args.mix_beta == 0.1 and args.old_policy_update_interval == 2
    calib = trainer.parse_args(B.to_argv(dict(B.calibration_flags(flags, 2), model_path="m", train_files="t")))
    assert calib.total_training_steps == 2 and not calib.val_before_train and not calib.val_files


# ------------------------------------------------------------------------------------------------------------------
# Reading runs, the summary, the files (synthetic TensorBoard logs written by the trainers' own logger)
# ------------------------------------------------------------------------------------------------------------------

def fake_run(run_dir, step_times, val: dict[int, tuple[float, float]], *, grid_steps=(0,),
             samples: dict[int, list[float]] | None = None) -> None:
    """A run dir as the trainers leave it: perf/time_per_step per step, validation reward / exact-match at the
    given steps, a training reward, timings, validation grids (training.logs' logger and image_grid) and the
    per-sample validation rewards in judge_replies.jsonl (`samples`, else two samples around each mean)."""
    from training.logs import TensorBoardLogger, image_grid

    os.makedirs(run_dir, exist_ok=True)
    logger = TensorBoardLogger(os.path.join(run_dir, "tensorboard"), enabled=True)
    for step, t in enumerate(step_times, start=1):
        logger.log_scalars({B.STEP_TIME_KEY: t, B.TRAIN_REWARD_KEY: 0.1 * step, "timing_s/gen": t / 2,
                            "timing_s/reward": t / 4}, step)
    for step, (reward, exact) in val.items():
        logger.log_scalars({B.REWARD_KEY: reward, B.EXACT_KEY: exact, "timing_s/testing": 1.5}, step)
    for step in grid_steps:
        shade = torch.full((2, 3, 32, 32), 40 * step % 255, dtype=torch.uint8)
        logger.log_image(B.GRID_TAG, image_grid(shade, [f"step {step}", "b"]), step)
    logger.close()
    with open(os.path.join(run_dir, B.JUDGE_LOG), "w") as f:
        for step, (reward, _) in val.items():
            for k, r in enumerate((samples or {}).get(step, [reward - 0.1, reward + 0.1])):
                f.write(json.dumps({"phase": "val", "step": step, "sample": k, "reward": r}) + "\n")
            f.write(json.dumps({"phase": "train", "step": step, "sample": 0, "reward": 99.0}) + "\n")


def test_read_run_own_or_calibrated_gpu_seconds_and_standard_errors(tmp_path):
    fake_run(tmp_path, [2.0, 1.0, 1.0, 0.5], {0: (0.3, 0.1), 2: (0.4, 0.2), 4: (0.5, 0.25)}, grid_steps=(0, 2, 4),
             samples={0: [0.1, 0.3, 0.5], 2: [0.4, 0.4]})
    rec = B.read_run(str(tmp_path))
    assert rec.steps == 4 and rec.step_times == [2.0, 1.0, 1.0, 0.5] and rec.gpu_seconds == pytest.approx(4.5)
    assert [(p["step"], p["gpu_seconds"]) for p in rec.curve] == [(0, 0.0), (2, pytest.approx(3.0)),
                                                                (4, pytest.approx(4.5))]
    assert [p["reward"] for p in rec.curve] == pytest.approx([0.3, 0.4, 0.5])
    assert [p["exact_match"] for p in rec.curve] == pytest.approx([0.1, 0.2, 0.25])
    assert rec.curve[0]["reward_se"] == pytest.approx(statistics.stdev([0.1, 0.3, 0.5]) / math.sqrt(3))
    assert rec.curve[0]["n"] == 3 and rec.curve[1]["reward_se"] == 0.0           # training replies ignored
    assert rec.curve[2]["reward_se"] == pytest.approx(statistics.stdev([0.4, 0.6]) / math.sqrt(2))
    assert rec.grids["before"][0] == 0 and rec.grids["after"][0] == 4 and rec.grids["after"][1][:8] == PNG_MAGIC
    shared = B.read_run(str(tmp_path), calibration=(1.0, 0.5))                    # placed on the solo calibration
    assert [p["gpu_seconds"] for p in shared.curve] == pytest.approx([0.0, 1.5, 2.5])
    assert [p["shared_seconds"] for p in shared.curve] == pytest.approx([0.0, 3.0, 4.5])
    assert [p["gpu_seconds"] for p in shared.train_curve] == pytest.approx([1.0, 1.5, 2.0, 2.5])


def test_read_run_refuses_runs_without_a_start_point_or_steps(tmp_path):
    fake_run(tmp_path / "no_start", [1.0, 1.0], {2: (0.4, 0.2)})
    with pytest.raises(RuntimeError, match="step-0 validation"):
        B.read_run(str(tmp_path / "no_start"))
    assert B.read_run(str(tmp_path / "no_start"), need_validation=False).steps == 2   # a calibration run
    fake_run(tmp_path / "no_steps", [], {0: (0.4, 0.2)})
    with pytest.raises(RuntimeError, match="time_per_step"):
        B.read_run(str(tmp_path / "no_steps"))


def record(points, steps=None):
    """A RunRecord from [(gpu_seconds, reward), ...] (steps 0, 1, 2, ...)."""
    curve = [{"step": i, "gpu_seconds": t, "reward": r, "reward_se": 0.01, "n": 256, "exact_match": r / 2}
             for i, (t, r) in enumerate(points)]
    return B.RunRecord(steps=steps or len(points) - 1, step_times=[1.0] * (len(points) - 1), curve=curve,
                       train_curve=[], timing_s={})


def test_summary_per_algorithm_efficiency_targets_and_table():
    control = record([(0, 0.40), (10, 0.40), (20, 0.40)])
    nft = [record([(0, 0.40), (10, 0.50), (20, 0.60)]), record([(0, 0.40), (10, 0.46), (20, 0.56)])]
    grpo = [record([(0, 0.40), (20, 0.44), (40, 0.48)]), record([(0, 0.40), (20, 0.42), (40, 0.44)])]
    runs = {"control": [B.summarize_run(control, control)],
            "nft": [B.summarize_run(r, control) for r in nft], "grpo": [B.summarize_run(r, control) for r in grpo]}
    assert runs["nft"][0]["gain_vs_control"] == pytest.approx(0.2)
    assert runs["nft"][0]["gpu_seconds_to_gain"] == {"0.05": pytest.approx(5.0), "0.1": pytest.approx(10.0)}
    assert runs["nft"][1]["gpu_seconds_to_gain"] == {"0.05": pytest.approx(10 * 5 / 6),
                                                     "0.1": pytest.approx(10 + 10 * 0.04 / 0.10)}
    assert runs["grpo"][0]["gpu_seconds_to_gain"] == {"0.05": pytest.approx(25.0), "0.1": None}
    assert runs["grpo"][1]["gpu_seconds_to_gain"]["0.05"] is None
    per = {n: B.summarize_algorithm(r) for n, r in runs.items()}
    g = per["nft"]["gain_vs_control"]
    assert (g["mean"], g["std"], g["n"]) == (pytest.approx(0.18), pytest.approx(statistics.stdev([0.2, 0.16])), 2)
    assert g["se"] == pytest.approx(statistics.stdev([0.2, 0.16]) / math.sqrt(2))
    assert per["grpo"]["gpu_seconds_to_gain"]["0.05"]["reached"] == "1/2"
    assert per["grpo"]["gpu_seconds_to_gain"]["0.1"]["mean"] is None
    assert per["control"]["gain_vs_control"]["mean"] == 0.0
    eff = B.efficiency(per, {"grpo": [40.0, 40.0], "nft": [20.0, 20.0], "control": [20.0]})
    assert set(eff) == {"grpo"}
    assert eff["grpo"]["0.05"]["ratio"] == pytest.approx(25.0 / ((5.0 + 50 / 6) / 2))
    assert eff["grpo"]["0.1"]["ratio"] is None and eff["grpo"]["0.1"]["lower_bound"] == pytest.approx(40 / 12)
    t = B.targets(per)
    assert t["nft"] == {"needed_gain": 0.15, "met": True}           # 0.18 >= 0.15 and >= 3 se (se 0.02)
    assert t["grpo"]["needed_gain"] == 0.05 and "control" not in t
    low = B.targets({"nft": {"gain_vs_control": {"mean": 0.16, "se": 0.06}}})
    assert low["nft"]["met"] is False                                # >= 0.15 but < 3 se
    settings = {n: {"samples_per_update": 256, "lr": 3e-4, "steps": 2, "test_freq": 1} for n in per}
    rows = B.table_rows(per, eff, {"control": "lr = 0 control", "nft": "DiffusionNFT", "grpo": "Flow-GRPO"},
                        settings)
    assert len(rows) == 4 and rows[0][0] == "algorithm"
    text = B.console_table(rows) + "\n" + B.markdown_table(rows)
    assert "+0.180 ± 0.028" in text and "not reached" in text and "> 3.33x" in text and "(1/2)" in text
    assert B.markdown_table(rows).splitlines()[1].count("---") == len(rows[0])


def test_run_health_reads_skips_and_the_ratio_range_and_says_them_in_one_line():
    dppo = {B.SKIPPED_KEY: [(1, 0.0), (2, 1.0), (3, 1.0)], B.RATIO_KEYS[0]: [(1, 1.0), (2, 0.97), (3, 0.99)],
            B.RATIO_KEYS[1]: [(1, 1.0), (2, 1.02), (3, 1.01)]}
    assert B.run_health(dppo) == {"skipped_steps": 1, "ratio_range": [0.97, 1.02]}
    assert B.run_health({B.SKIPPED_KEY: [(1, 0.0), (2, 0.0)]}) == {"skipped_steps": 0}   # DiffusionNFT: no ratio
    assert B.run_health({}) == {}
    runs = {"dppo_s0": {"algorithm": "dppo", "health": {"skipped_steps": 0, "ratio_range": [1.0, 1.0]}},
            "dppo_s1": {"algorithm": "dppo", "health": {"skipped_steps": 0, "ratio_range": [0.99, 1.0]}},
            "nft_s0": {"algorithm": "nft", "health": {"skipped_steps": 0}},
            "grpo_s0": {"algorithm": "grpo", "error": "exit 1"}}                          # failed: no health
    labels = {"dppo": "Flow-DPPO", "nft": "DiffusionNFT"}
    assert B.health_text(runs, labels) == ("Health: no optimizer step skipped in any of the 3 runs; importance ratio "
                                           "over every step and seed: Flow-DPPO [0.99, 1].")
    runs["nft_s0"]["health"]["skipped_steps"] = 2
    assert B.health_text(runs, labels).startswith("Health: optimizer steps skipped: nft_s0 2; ")
    cost = {"wall_s": 1230.0, "calibration_wall_s": 330.0, "runs_wall_s": 900.0, "reused": []}
    assert B.cost_text(cost) == "Cost: this invocation ran 20.5 min wall (330 s of solo calibrations, 900 s of runs)."
    assert B.cost_text(dict(cost, reused=["control"])).endswith(
        "; 1 run(s) reused from an earlier invocation (--resume), their time not included (control).")


def test_write_report_files_and_schema(tmp_path):
    jobs, state = [], {"records": {}, "runs": {}, "failed": {}, "calibration": {}, "settings": {},
                       "clock": {"started": time.monotonic() - 60.0, "calibrated": None, "reused": []}}
    plans = {"control": (0.3, 0.3), "nft_s0": (0.3, 0.6), "nft_s1": (0.3, 0.5), "dppo_s0": (0.3, 0.4)}
    for name, (start, end) in plans.items():
        algo = B.ALGORITHMS[name.split("_")[0]]
        fake_run(tmp_path / "runs" / name, [5.0] * 4, {0: (start, 0.1), 2: ((start + end) / 2, 0.2), 4: (end, 0.3)},
                 grid_steps=(0, 4))
        job = B.Job(name, algo, {"lr": 3e-4}, str(tmp_path / "runs" / name))
        jobs.append(job)
        state["records"][name] = B.read_run(job.run_dir)
        state["runs"][name] = B.run_entry(job, state["records"][name], 30.0, False)
        state["settings"][algo.name] = {"samples_per_update": 256, "lr": 3e-4, "steps": 4, "test_freq": 2}
    jobs.append(B.Job("dppo_s1", B.ALGORITHMS["dppo"], {}, str(tmp_path / "runs" / "dppo_s1")))  # not run yet
    out = tmp_path / "out"
    out.mkdir()
    lines = []
    labels = {n: a.label for n, a in B.ALGORITHMS.items()}
    doc = B.write_report(state, jobs, labels, {"created": "now", "gpu": "NVIDIA H200", "gpu_seconds_source": "own",
                                               "argv": ["--x"]},
                         str(out), "t", complete=False, say=lines.append)
    assert sorted(os.listdir(out)) == sorted(v for k, v in B.FILES.items() if k != "log")
    loaded = json.loads((out / B.FILES["json"]).read_text())
    assert loaded == json.loads(json.dumps(B._finite(doc))) and loaded["complete"] is False
    assert loaded["pending"] == ["dppo_s1"] and loaded["start_point"]["reward"] == pytest.approx(0.3)
    assert loaded["start_point"]["reward_se"] == pytest.approx(statistics.stdev([0.2, 0.4]) / math.sqrt(2))
    assert loaded["algorithms"]["nft"]["gain_vs_control"]["mean"] == pytest.approx(0.25)
    assert loaded["algorithms"]["nft"]["seeds"] == 2 and loaded["algorithms"]["dppo"]["seeds"] == 1
    assert loaded["efficiency_nft_over"]["dppo"]["0.05"]["ratio"] is not None
    for name in plans:
        for key in ("settings", "command", "steps", "gpu_seconds", "gpu_seconds_source", "curve", "start", "end",
                    "gain_vs_control", "gpu_seconds_to_gain"):
            assert key in loaded["runs"][name], (name, key)
    assert_png(out / B.FILES["plot"])
    assert_png(out / B.FILES["grids"])
    md = (out / B.FILES["markdown"]).read_text()
    assert "| DiffusionNFT | 2 |" in md and "INCOMPLETE" in md and "`python3 tools/bench_learning.py --x`" in md
    assert loaded["cost"]["wall_s"] >= 60.0 and loaded["cost"]["runs_wall_s"] == 0.0   # still calibrating
    assert "Cost: this invocation ran 1.0 min wall" in md and "Health: " in md
    assert md.splitlines()[2].startswith("Created now on one NVIDIA H200; INCOMPLETE; ")   # the card: H100 or H200
    assert "DiffusionNFT" in "\n".join(lines) and "start point" in "\n".join(lines)


def test_inputs_are_checked_before_any_run(tiny_models, tmp_path):
    model = os.path.join(tiny_models, "qwen_image")
    train, val = B.make_smoke_data(str(tmp_path / "data"))
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        B.check_inputs(str(tmp_path), train, val)
    with pytest.raises(FileNotFoundError, match="--val_files"):
        B.check_inputs(model, train, str(tmp_path / "missing.parquet"))
    from data_prep.make_demo_data import make_demo_data

    make_demo_data(tmp_path / "demo", model="qwen_image")  # jpeg_compressibility rows
    with pytest.raises(ValueError, match="data_source"):
        B.check_inputs(model, train, str(tmp_path / "demo" / "test.parquet"))
    B.check_inputs(model, train, val)


# ------------------------------------------------------------------------------------------------------------------
# main's bookkeeping with a fake launcher: calibration first and alone, concurrency, seeds, GPU-seconds from the
# calibration, the report after every run, failures, --resume, --max_runtime_s, budget -> steps, SIGTERM
# ------------------------------------------------------------------------------------------------------------------

class FakeLauncher:
    """Stands in for B.launch: leaves a run's logs as the trainer would (calibration runs: step times 2, 1, 1 s;
    runs: 3 s per step as if slowed by sharing, held-out reward rising by GAIN[algo] over the run) and returns a
    real short-lived child process, registered in B.LIVE."""
    GAIN = {"0.0": 0.0, "nft": 0.3, "dppo": 0.1}

    def __init__(self, fail=(), sleep=0.3):
        self.launched, self.max_live, self.fail, self.sleep = [], 0, set(fail), sleep

    def __call__(self, script, argv, log_path, env=None):
        argv = list(argv)
        get = lambda flag: argv[argv.index(flag) + 1] if flag in argv else None  # noqa: E731
        out, steps = get("--output_dir"), int(get("--total_training_steps"))
        name = os.path.basename(out)
        self.launched.append((name, argv))
        live = sum(p.poll() is None for p in B.LIVE.values())
        self.max_live = max(self.max_live, live + 1)
        if get("--val_files") is None:                                    # a calibration run
            fake_run(out, [2.0] + [1.0] * (steps - 1), {})
        else:
            every = int(get("--test_freq"))
            gain = 0.0 if get("--lr") == "0.0" else self.GAIN[name.split("_")[0]]
            val = {s: (0.3 + gain * s / steps, 0.1) for s in range(0, steps + 1, every)}
            fake_run(out, [3.0] * steps, val, grid_steps=(0, steps))
        with open(log_path, "w") as f:
            f.write("".join(f"step {s}/{steps} | 3.00s/step | ETA 0:00:00 | rewards/mean 0.5\n"
                            for s in range(1, steps + 1)))
        sleep = 0.1 if get("--val_files") is None else self.sleep
        code = f"import time; time.sleep({sleep}); raise SystemExit({1 if name in self.fail else 0})"
        proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        B.LIVE[proc.pid] = proc
        return proc


def test_main_calibrates_alone_then_runs_seeds_concurrently(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("TINY_MODELS_DIR", tiny_models)
    fake = FakeLauncher(fail={"dppo_s1"})
    monkeypatch.setattr(B, "launch", fake)
    out = tmp_path / "out"
    argv = ["--smoke", "--out_dir", str(out), "--algorithms", "nft,dppo,control", "--seeds", "2", "--concurrent",
            "3", "--calibration_steps", "3", "--steps", "4", "--evals", "2", "--ocr_workers", "2"]
    with pytest.raises(SystemExit, match="runs dppo_s1 failed"):
        B.main(argv)
    names = [n for n, _ in fake.launched]
    # every run, calibration or shared, scores with --ocr_workers processes (not split over the concurrent runs)
    assert {a[a.index("--rapidocr_workers") + 1] for _, a in fake.launched} == {"2"}
    assert names[:3] == ["calibrate_control", "calibrate_nft", "calibrate_dppo"]
    assert names[3:] == ["control", "nft_s0", "dppo_s0", "nft_s1", "dppo_s1"]
    assert fake.max_live == 3 and not B.LIVE
    seeds = {n: a[a.index("--seed") + 1] for n, a in fake.launched}
    assert (seeds["control"], seeds["nft_s0"], seeds["nft_s1"], seeds["dppo_s1"]) == ("42", "42", "43", "43")
    doc = json.loads((out / B.FILES["json"]).read_text())
    assert doc["complete"] is True and "solo calibration" in doc["gpu_seconds_source"]
    assert doc["calibration"]["nft"]["t_first_t_rest"] == [2.0, 1.0]
    assert doc["calibration"]["nft"]["t_rest_se"] == 0.0                   # later steps 1, 1: no spread
    calibrations = [line for line in (out / B.FILES["markdown"]).read_text().splitlines()
                    if line.startswith("Solo calibrations: ")]
    assert len(calibrations) == 1 and "DiffusionNFT step 1 2.00 s, then 1.00 ± 0.00 s/step (se over 2 steps)" in \
        calibrations[0]
    nft = doc["runs"]["nft_s0"]
    # calibrated: steps 0, 2, 4 at 0, 2 + 1, 2 + 3; the shared runs' own 3 s/step kept aside
    assert [p["gpu_seconds"] for p in nft["curve"]] == pytest.approx([0.0, 3.0, 5.0])
    assert [p["shared_seconds"] for p in nft["curve"]] == pytest.approx([0.0, 6.0, 12.0])
    assert "solo calibration" in nft["gpu_seconds_source"] and nft["gain_vs_control"] == pytest.approx(0.3)
    assert "exit 1" in doc["runs"]["dppo_s1"]["error"] and doc["algorithms"]["dppo"]["seeds"] == 1
    assert doc["algorithms"]["nft"]["gpu_seconds_to_gain"]["0.1"]["mean"] == pytest.approx(0.1 / 0.15 * 3.0)
    assert doc["efficiency_nft_over"]["dppo"]["0.05"]["ratio"] is not None
    assert "dppo_s1 FAILED" in (out / B.FILES["log"]).read_text()
    # --resume: the finished runs and calibrations are reused, only the failed one runs again
    fake2 = FakeLauncher()
    monkeypatch.setattr(B, "launch", fake2)
    doc = B.main(argv + ["--resume"])
    assert [n for n, _ in fake2.launched] == ["dppo_s1"] and doc["algorithms"]["dppo"]["seeds"] == 2
    assert doc["cost"]["reused"] == ["calibrate_control", "calibrate_nft", "calibrate_dppo", "control", "nft_s0",
                                     "dppo_s0", "nft_s1"]


def test_main_budget_becomes_steps_and_max_runtime_stops_launching(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("TINY_MODELS_DIR", tiny_models)
    fake = FakeLauncher()
    monkeypatch.setattr(B, "launch", fake)
    # budget 10 GPU-s at (2, 1): 9 steps fit, 3 evaluations -> every 3 steps; solo runs use their own times
    B.main(["--smoke", "--out_dir", str(tmp_path / "a"), "--algorithms", "nft", "--budget_s", "10", "--evals", "3"])
    [(_, calib), (_, run)] = fake.launched
    assert run[run.index("--total_training_steps") + 1] == "9" and run[run.index("--test_freq") + 1] == "3"
    doc = json.loads((tmp_path / "a" / B.FILES["json"]).read_text())
    assert doc["runs"]["nft_s0"]["gpu_seconds"] == pytest.approx(27.0) and "own" in doc["gpu_seconds_source"]
    fake.launched.clear()
    with pytest.raises(SystemExit) as stop:
        B.main(["--smoke", "--out_dir", str(tmp_path / "b"), "--algorithms", "control,nft", "--seeds", "2",
                "--max_runtime_s", "0"])
    assert stop.value.code == 3 and fake.launched == []
    doc = json.loads((tmp_path / "b" / B.FILES["json"]).read_text())
    assert doc["complete"] is False and doc["pending"] == ["control", "nft_s0", "nft_s1"]


def test_refuses_in_one_line_without_a_gpu(tmp_path):
    """Run with no GPU visible (CUDA_VISIBLE_DEVICES empty), so that it runs the same on a GPU machine."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_learning.py"), "--model_path", "m",
                           "--train_files", "t", "--val_files", "v", "--out_dir", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "no CUDA GPU" in proc.stderr and "--smoke" in proc.stderr and not (tmp_path / "o").exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_stop_all_kills_each_process_group_with_its_grandchildren():
    proc = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!; sleep 60"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    grandchild = int(proc.stdout.readline())
    B.LIVE[proc.pid] = proc
    assert _alive(grandchild) and B.stop_all(grace_s=2) == [proc.pid]
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild) and proc.poll() is not None and not B.LIVE


def test_sigterm_stops_every_running_trainer(tiny_models, tmp_path, monkeypatch):
    """SIGTERM to the bench while two (fake) trainers run: main exits 130 and both process groups are gone."""
    monkeypatch.setenv("TINY_MODELS_DIR", tiny_models)
    fake = FakeLauncher(sleep=60)
    pids = []

    def launch(script, argv, log_path, env=None):
        proc = fake(script, argv, log_path, env)
        pids.append(proc.pid)
        if len(pids) == 2:
            os.kill(os.getpid(), signal.SIGTERM)   # main's handler turns it into an orderly stop
        return proc

    monkeypatch.setattr(B, "launch", launch)
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        B.main(["--smoke", "--out_dir", str(tmp_path / "o"), "--algorithms", "nft", "--seeds", "2", "--concurrent",
                "2"])
    assert stop.value.code == 130 and len(pids) == 2 and signal.getsignal(signal.SIGTERM) == previous
    assert not any(_alive(p) for p in pids) and not B.LIVE
    assert "interrupted (SIGTERM)" in (tmp_path / "o" / B.FILES["log"]).read_text()


# ------------------------------------------------------------------------------------------------------------------
# The CPU smoke runs (real trainers; minutes on 2 cores, hence slow)
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smoke_end_to_end_with_seeds_calibration_and_two_concurrent_runs(tiny_models, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", TINY_MODELS_DIR=tiny_models, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_learning.py"), "--smoke",
                           "--algorithms", "control,nft", "--seeds", "2", "--concurrent", "2",
                           "--calibration_steps", "2", "--out_dir", str(out), "--work_dir", str(tmp_path / "runs")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    files = sorted(os.listdir(out))
    assert files == sorted(B.FILES.values()), files
    for name in files:
        assert (out / name).stat().st_size <= 16 * 2**20 and all(c.isalnum() or c in "._-" for c in name)
    doc = json.loads((out / B.FILES["json"]).read_text())
    assert doc["smoke"] and doc["complete"] and set(doc["runs"]) == {"control", "nft_s0", "nft_s1"}
    assert doc["device"] == "cpu" and doc["gpu"] is None
    assert set(doc["calibration"]) == {"control", "nft"} and "solo calibration" in doc["gpu_seconds_source"]
    t_first, t_rest = doc["calibration"]["nft"]["t_first_t_rest"]
    for name, run in doc["runs"].items():
        assert run["steps"] == 2 and [p["step"] for p in run["curve"]] == [0, 1, 2]
        assert run["curve"][-1]["gpu_seconds"] == pytest.approx(t_first + t_rest) or name == "control"
        assert all(p["exact_match"] is not None and p["n"] == 2 for p in run["curve"])
        assert run["settings"]["lr"] == (0.0 if name == "control" else B.SMOKE["lr"])
    assert doc["runs"]["nft_s1"]["settings"]["seed"] == 43 and doc["algorithms"]["nft"]["seeds"] == 2
    # the trainers' own keys: the control (train_dppo.py, lr 0) applies every update at a ratio of exactly 1
    assert doc["runs"]["control"]["health"] == {"skipped_steps": 0, "ratio_range": [1.0, 1.0]}
    assert doc["runs"]["nft_s0"]["health"] == {"skipped_steps": 0}
    assert 0 < doc["cost"]["calibration_wall_s"] < doc["cost"]["wall_s"] and doc["cost"]["reused"] == []
    assert "step 2/2" in proc.stdout or "step 1/2" in proc.stdout     # progress while training
    assert_png(out / B.FILES["plot"])
    assert_png(out / B.FILES["grids"])
    assert "| DiffusionNFT | 2 |" in (out / B.FILES["markdown"]).read_text()


def test_run_jobs_past_the_deadline_starts_nothing_but_lets_running_jobs_finish(tmp_path, monkeypatch):
    """Two slots: `slow` (1.5 s) and `quick` (0.2 s) start; when `quick` ends the deadline has passed, so `late`
    never starts, and `slow` still runs to its end and is reported (it was once abandoned to the caller's stop)."""
    sleeps = {"slow": 1.5, "quick": 0.2, "late": 0.1}

    def launch(script, argv, log_path, env=None):
        out = argv[argv.index("--output_dir") + 1]
        name = os.path.basename(out)
        os.makedirs(out)                                  # as a trainer does
        open(log_path, "w").close()
        proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({sleeps[name]})"],
                                start_new_session=True)
        B.LIVE[proc.pid] = proc
        return proc

    monkeypatch.setattr(B, "launch", launch)
    jobs = [B.Job(n, B.ALGORITHMS["nft"], {}, str(tmp_path / n)) for n in sleeps]
    done = []
    left = B.run_jobs(jobs, 2, timeout_s=60, say=lambda _: None, stop_launching_at=time.monotonic() + 0.1,
                      on_done=lambda job, proc, wall, error: done.append((job.name, proc.poll(), error)))
    assert [j.name for j in left] == ["late"]
    assert sorted(done) == [("quick", 0, None), ("slow", 0, None)] and not B.LIVE
    assert (tmp_path / "slow" / "bench_done.json").is_file()
