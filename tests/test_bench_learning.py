"""scripts/bench_learning.py: the trainer flags it builds (parsed by the trainers' own parsers), the curves it reads
back from TensorBoard against GPU-seconds, the summary / verdict arithmetic, the JSON, plot and grid files, and
(slow) the CPU smoke run of all four trainers end to end."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

import bench_learning as B
from trainer_runs import REPO, scalars

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
# Flags
# ------------------------------------------------------------------------------------------------------------------

def test_run_flags_budget_steps_overrides_and_pinned_control_lr():
    overrides = B.parse_overrides(["lr=3e-4", "nft.mix_beta=0.5", "dppo.noise_level=0.9"], list(B.ALGORITHMS))
    nft = B.run_flags(B.ALGORITHMS["nft"], B.COMMON, overrides, budget_s=45, steps=None)
    assert nft["lr"] == "3e-4" and nft["mix_beta"] == "0.5" and nft["max_wall_time_s"] == 45.0
    assert nft["total_training_steps"] >= 10**5 and "loss" not in nft
    control = B.run_flags(B.ALGORITHMS["control"], B.COMMON, overrides, budget_s=None, steps=3)
    assert control["lr"] == 0.0 and control["total_training_steps"] == 3 and "max_wall_time_s" not in control
    assert control["noise_level"] == B.DPPO_FLAGS["noise_level"]  # dppo.* overrides stay with dppo
    short = B.run_flags(B.ALGORITHMS["control"], B.COMMON, B.parse_overrides(["control.max_wall_time_s=20"],
                                                                             list(B.ALGORITHMS)), budget_s=45,
                        steps=None)
    assert short["max_wall_time_s"] == "20" and nft["max_wall_time_s"] == 45.0
    grpo = B.run_flags(B.ALGORITHMS["grpo"], B.COMMON, {}, budget_s=None, steps=2)
    assert grpo["loss"] == "flow_grpo" and grpo["clip_ratio"] == 1e-5
    argv = B.to_argv(dict(a=1, flag=True, off=False, gone=None, named="none"))
    assert argv == ["--a", "1", "--flag"]
    for bad in (["lr"], ["=1"], ["nosuch.lr=1"], ["control.lr=1e-3"]):
        with pytest.raises(ValueError):
            B.parse_overrides(bad, list(B.ALGORITHMS))
    with pytest.raises(ValueError, match="exactly one"):
        B.run_flags(B.ALGORITHMS["nft"], B.COMMON, {}, budget_s=10, steps=2)


@pytest.mark.parametrize("name", list(B.ALGORITHMS))
@pytest.mark.parametrize("smoke", [False, True])
def test_every_run_parses_with_its_trainers_own_parser(name, smoke):
    """Each run's argv (common settings + recipe + budget) is accepted by the trainer's parse_args, with the values
    the benchmark states; the time-budget flag is used only if the trainers have it (else main refuses clearly)."""
    import importlib

    algo = B.ALGORITHMS[name]
    common = {**B.COMMON, **(B.SMOKE if smoke else {}), "device": "cpu", "rollout_devices": "cpu"}
    if smoke:
        algo = B.Algorithm(algo.name, algo.label, algo.script, dict(algo.flags, **B.SMOKE_ALGO[algo.script]), "")
    trainer = importlib.import_module(algo.script[:-3])
    flags = B.run_flags(algo, common, {}, budget_s=None, steps=2)
    args = trainer.parse_args(B.to_argv(dict(flags, model_path="m", train_files="t.parquet")))
    assert args.lr == (0.0 if name == "control" else common["lr"]) and args.total_training_steps == 2
    assert args.ocr_backend == "rapidocr" and args.val_before_train and args.true_cfg_scale == 1.0
    assert args.rollout_n == common["rollout_n"]
    if algo.script == "train_dppo.py":
        assert args.loss == ("flow_grpo" if name == "grpo" else "flow_dppo") and args.noise_level == 1.2
    else:
        assert args.mix_beta == 0.1 and args.old_policy_update_interval == 2
    has_budget = B.trainer_accepts(algo.script, "--max_wall_time_s")
    assert B.trainer_accepts(algo.script, "--lr", "0.1") and not B.trainer_accepts(algo.script, "--no_such_flag")
    if has_budget:
        budget = B.run_flags(algo, common, {}, budget_s=30, steps=None)
        assert trainer.parse_args(B.to_argv(dict(budget, model_path="m", train_files="t"))).max_wall_time_s == 30


def test_budget_path_needs_the_trainers_time_stop_flag(tiny_models, tmp_path):
    """The budget path stops before any run, pointing to --steps, when a trainer lacks the stop flag."""
    B.require_flag(["train_nft.py", "train_dppo.py"], "--lr")
    with pytest.raises(SystemExit, match="train_dppo.py has no --mix_beta.*--steps"):
        B.require_flag(["train_nft.py", "train_dppo.py"], "--mix_beta")
    if not all(B.trainer_accepts(s, "--max_wall_time_s") for s in ("train_nft.py", "train_dppo.py")):
        train, val = B.make_smoke_data(str(tmp_path / "data"))
        with pytest.raises(SystemExit, match="--max_wall_time_s"):
            B.main(["--model_path", os.path.join(tiny_models, "qwen_image"), "--train_files", train,
                    "--val_files", val, "--budget_s", "5", "--out_dir", str(tmp_path / "out")])
        assert not (tmp_path / "out" / "runs" / "nft").exists()


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
# Reading runs, the summary, the files (synthetic TensorBoard logs written by the trainers' own logger)
# ------------------------------------------------------------------------------------------------------------------

def fake_run(run_dir, step_times, val: dict[int, tuple[float, float]], *, grid_steps=(0,)) -> None:
    """A run dir as the trainers leave it: perf/time_per_step per step, validation reward / exact-match at the
    given steps, a training reward, timings and validation grids (training.logs' logger and image_grid)."""
    from training.logs import TensorBoardLogger, image_grid

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


def test_read_run_puts_validation_points_at_accumulated_step_time(tmp_path):
    fake_run(tmp_path, [2.0, 1.0, 1.0, 0.5], {0: (0.3, 0.1), 2: (0.4, 0.2), 4: (0.5, 0.25)}, grid_steps=(0, 2, 4))
    rec = B.read_run(str(tmp_path))
    assert rec.steps == 4 and rec.gpu_seconds == pytest.approx(4.5)
    assert [(p["step"], p["gpu_seconds"]) for p in rec.curve] == [(0, 0.0), (2, pytest.approx(3.0)),
                                                                (4, pytest.approx(4.5))]
    assert [p["reward"] for p in rec.curve] == pytest.approx([0.3, 0.4, 0.5])
    assert [p["exact_match"] for p in rec.curve] == pytest.approx([0.1, 0.2, 0.25])
    assert rec.timing_s["testing"] == pytest.approx(4.5) and rec.timing_s["gen"] == pytest.approx(2.25)
    assert rec.final_step_validated and rec.grids["before"][0] == 0 and rec.grids["after"][0] == 4
    assert rec.grids["after"][1][:8] == PNG_MAGIC
    assert [p["gpu_seconds"] for p in rec.train_curve] == pytest.approx([2.0, 3.0, 4.0, 4.5])


def test_read_run_refuses_runs_without_a_start_point_or_steps(tmp_path):
    fake_run(tmp_path / "no_start", [1.0, 1.0], {2: (0.4, 0.2)})
    with pytest.raises(RuntimeError, match="step-0 validation"):
        B.read_run(str(tmp_path / "no_start"))
    fake_run(tmp_path / "no_steps", [], {0: (0.4, 0.2)})
    with pytest.raises(RuntimeError, match="time_per_step"):
        B.read_run(str(tmp_path / "no_steps"))


def synthetic_records(tmp_path) -> dict[str, B.RunRecord]:
    """nft: +0.30 in 30 GPU-s, dppo: +0.20 in 20, grpo: +0.05 in 20 (last step not validated), control: +0.01."""
    plans = {"nft": ([10.0] * 3, {0: (0.3, 0.1), 2: (0.45, 0.2), 3: (0.6, 0.4)}),
             "dppo": ([5.0] * 4, {0: (0.3, 0.1), 4: (0.5, 0.3)}),
             "grpo": ([5.0] * 5, {0: (0.3, 0.1), 4: (0.35, 0.1)}),
             "control": ([6.0] * 4, {0: (0.3, 0.1), 4: (0.31, 0.1)})}
    records = {}
    for name, (times, val) in plans.items():
        fake_run(tmp_path / name, times, val, grid_steps=(0, max(val)))
        records[name] = B.read_run(str(tmp_path / name))
    return records


def test_summary_gains_rates_and_verdict(tmp_path):
    records = synthetic_records(tmp_path)
    summary = B.summarize_runs(records)
    assert summary["nft"]["gain"]["reward"] == pytest.approx(0.3)
    assert summary["nft"]["gain_vs_control"]["reward"] == pytest.approx(0.29)
    assert summary["nft"]["gain_vs_control"]["exact_match"] == pytest.approx(0.3)
    assert summary["nft"]["reward_gain_vs_control_per_gpu_second"] == pytest.approx(0.29 / 30)
    assert summary["dppo"]["reward_gain_vs_control_per_gpu_second"] == pytest.approx(0.19 / 20)
    # grpo's last validated step is 4 (20 GPU-s), not its 5th step (25 GPU-s)
    assert summary["grpo"]["end"]["gpu_seconds"] == pytest.approx(20.0) and not records["grpo"].final_step_validated
    assert summary["grpo"]["reward_gain_vs_control_per_gpu_second"] == pytest.approx(0.04 / 20)
    assert summary["control"]["gain_vs_control"]["reward"] == pytest.approx(0.0)
    assert summary["nft"]["gpu_seconds_to_start_plus_0.1"] == pytest.approx(20.0)
    assert summary["grpo"]["gpu_seconds_to_start_plus_0.1"] is None
    labels = {n: B.ALGORITHMS[n].label for n in records}
    result = B.verdict(summary, labels)
    assert result["fastest"] == "nft" and result["ranking"] == ["nft", "dppo", "grpo"]
    assert result["ratio_to_runner_up"] == pytest.approx((0.29 / 30) / (0.19 / 20))
    assert result["nft_vs_grpo"] == pytest.approx((0.29 / 30) / (0.04 / 20)) and result["papers_agree"] is True
    assert "DiffusionNFT learned fastest" in result["statement"]
    # nothing beats the control -> said so, no ordering claimed
    flat = {n: dict(s, reward_gain_vs_control_per_gpu_second=-0.001) for n, s in summary.items()}
    flat_result = B.verdict(flat, labels)
    assert flat_result["statement"].startswith("no algorithm") and flat_result["papers_agree"] is None
    # without a control run the gains over it are unknown
    alone = B.summarize_runs({"nft": records["nft"]})
    assert alone["nft"]["gain_vs_control"]["reward"] is None and B.verdict(alone, labels)["fastest"] is None


def test_write_report_files_and_schema(tmp_path):
    records = synthetic_records(tmp_path / "runs")
    labels = {n: B.ALGORITHMS[n].label for n in records}
    runs = {n: B.run_entry(B.ALGORITHMS[n], {"lr": 1e-3}, ["--lr", "1e-3"], r, 99.0, str(tmp_path / "runs" / n))
            for n, r in records.items()}
    out = tmp_path / "out"
    out.mkdir()
    lines = []
    doc = B.write_report(records, runs, labels, {"benchmark": "bench_learning"}, str(out), "t", say=lines.append)
    assert sorted(os.listdir(out)) == sorted(v for k, v in B.FILES.items() if k != "log")
    loaded = json.loads((out / B.FILES["json"]).read_text())
    assert loaded == json.loads(json.dumps(doc)) and loaded["result"]["fastest"] == "nft"
    for name in ("nft", "dppo", "grpo", "control"):
        run = loaded["runs"][name]
        for key in ("settings", "command", "recipe", "steps", "gpu_seconds", "curve", "start", "end",
                    "gain_vs_control", "reward_gain_vs_control_per_gpu_second", "timing_s", "grid_steps"):
            assert key in run, (name, key)
    assert_png(out / B.FILES["plot"])
    assert_png(out / B.FILES["grids"])
    from PIL import Image

    with Image.open(out / B.FILES["grids"]) as grid:  # 4 rows of (before | after)
        one = Image.open(io.BytesIO(records["nft"].grids["before"][1]))
        assert grid.width >= 2 * one.width and grid.height >= 4 * one.height
    text = "\n".join(lines)
    assert "DiffusionNFT" in text and "lr = 0 control" in text and "learned fastest" in text


# ------------------------------------------------------------------------------------------------------------------
# The CPU smoke run (four real trainer runs: ~2-3 minutes on 2 idle cores, hence slow)
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smoke_runs_all_four_trainers_and_writes_the_files(tiny_models, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", TINY_MODELS_DIR=tiny_models, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_learning.py"), "--smoke",
                           "--out_dir", str(out), "--work_dir", str(tmp_path / "runs")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    # what comes back from the device tool: at most 8 plain files, <= 16 MiB, safe names
    files = sorted(os.listdir(out))
    assert files == sorted(B.FILES.values()), files
    for name in files:
        assert (out / name).stat().st_size <= 16 * 2**20 and all(c.isalnum() or c in "._-" for c in name)
    doc = json.loads((out / B.FILES["json"]).read_text())
    assert doc["smoke"] and doc["budget"] == {"mode": "steps", "total_training_steps": 2}
    assert set(doc["runs"]) == {"nft", "dppo", "grpo", "control"}
    for name, run in doc["runs"].items():
        tb = scalars(tmp_path / "runs" / name)
        step_times = [v for _, v in tb[B.STEP_TIME_KEY]]
        assert run["steps"] == 2 and len(step_times) == 2
        assert run["gpu_seconds"] == pytest.approx(sum(step_times)) and 0 < run["gpu_seconds"] < run["wall_seconds"]
        assert [p["step"] for p in run["curve"]] == [0, 2] and run["final_step_validated"]
        assert run["curve"][-1]["gpu_seconds"] == pytest.approx(run["gpu_seconds"])
        assert all(p["exact_match"] is not None for p in run["curve"])  # rewards.py's ocr/exact_match extra
        assert run["settings"]["ocr_backend"] == "rapidocr" and run["settings"]["total_training_steps"] == 2
        assert run["settings"]["lr"] == (0.0 if name == "control" else B.SMOKE["lr"])
        assert run["grid_steps"] == {"before": 0, "after": 2}
        assert run["gain_vs_control"]["reward"] is not None
    assert doc["runs"]["grpo"]["settings"]["loss"] == "flow_grpo" and doc["runs"]["nft"]["script"] == "train_nft.py"
    assert doc["result"]["statement"] in proc.stdout
    assert_png(out / B.FILES["plot"])
    assert_png(out / B.FILES["grids"])
    log = (out / B.FILES["log"]).read_text()
    assert log.count("validation @ step 0") == 4 and "train_nft.py" in log


def test_main_reports_a_failed_run_and_keeps_the_others(tiny_models, tmp_path, monkeypatch):
    """main's loop with the trainer launch replaced by a fake that leaves a run's logs (or fails for grpo): the
    flags reach the launcher, a failed run is reported in the JSON and on exit, the other three are summarized."""
    launched = []

    def fake_run_trainer(script, argv, *, nproc, timeout_s, log_path):
        launched.append((script, list(argv)))
        if len(launched) == 2:  # the control ran first, and its report is on disk before the next run starts
            partial = json.loads((tmp_path / "out" / B.FILES["json"]).read_text())
            assert partial["complete"] is False and list(partial["runs"]) == ["control"]
            assert partial["pending"] == ["nft", "dppo", "grpo"]
        if "flow_grpo" in argv:
            raise AssertionError("boom: the trainer failed")
        out = argv[argv.index("--output_dir") + 1]
        gain = 0.0 if argv[argv.index("--lr") + 1] == "0.0" else 0.2
        fake_run(out, [1.0, 2.0], {0: (0.3, 0.1), 2: (0.3 + gain, 0.1 + gain)}, grid_steps=(0, 2))

    monkeypatch.setenv("TINY_MODELS_DIR", tiny_models)
    monkeypatch.setattr(B, "run_trainer", fake_run_trainer)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="runs grpo failed"):
        B.main(["--smoke", "--out_dir", str(out), "--set", "nft.mix_beta=0.3"])
    assert [s for s, _ in launched] == ["train_dppo.py", "train_nft.py", "train_dppo.py", "train_dppo.py"]
    nft_argv = launched[1][1]
    assert nft_argv[nft_argv.index("--mix_beta") + 1] == "0.3" and "--max_wall_time_s" not in nft_argv
    assert nft_argv[nft_argv.index("--total_training_steps") + 1] == "2"
    doc = json.loads((out / B.FILES["json"]).read_text())
    assert doc["complete"] is True
    assert "boom" in doc["runs"]["grpo"]["error"] and "curve" not in doc["runs"]["grpo"]
    assert doc["runs"]["nft"]["gain_vs_control"]["reward"] == pytest.approx(0.2)
    assert doc["runs"]["nft"]["reward_gain_vs_control_per_gpu_second"] == pytest.approx(0.2 / 3.0)
    assert doc["result"]["fastest"] in ("nft", "dppo") and "nft_vs_grpo" not in doc["result"]
    assert_png(out / B.FILES["plot"])
    assert_png(out / B.FILES["grids"])
    assert "grpo FAILED" in (out / B.FILES["log"]).read_text()
