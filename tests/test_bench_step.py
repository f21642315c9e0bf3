"""scripts/bench_step.py in its CPU smoke mode: the JSON schema, the ratio taken from the baseline and optimized
runs of the same invocation, and the Flow-DPPO bypass numerics (`--old_log_probs rollout` in the optimized run):
with a zero rollout/trainer gap (fp32, CPU, one rank, one micro-batch) every loss, ratio and grad norm equals the
recompute baseline's, the first-pass ratio stays within exp(±gap), and no old-log-prob pass runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

# one pytest-xdist worker runs this module (pytest.ini: --dist loadgroup): its module fixtures are costly
pytestmark = pytest.mark.xdist_group("test_bench_step")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_step")
    env = dict(os.environ, TINY_MODELS_DIR=tiny_models, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("FLOWRL_PEAK_TFLOPS", None)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_step.py"), "--smoke", "--out",
                           str(out / "bench.json"), "--workdir", str(out / "work")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text()), proc.stdout


@pytest.mark.slow  # the module fixture `smoke` runs the whole bench_step.py --smoke (about a minute)
def test_schema_and_ratio_from_the_same_invocation(smoke):
    result, stdout = smoke
    assert result["bench"] == "bench_step" and result["schema_version"] == 1 and result["smoke"] is True
    entry = result["recipes"]["qwen_dppo"]
    runs = entry["runs"]
    assert set(runs) == {"baseline", "optimized"}
    for run in runs.values():
        assert run["status"] == "ok" and run["returncode"] == 0
        # both runs belong to this invocation
        assert result["started_at"] <= run["started_at"] <= run["finished_at"] <= result["finished_at"]
        assert [s["step"] for s in run["steps"]] == [1, 2] and run["measured_steps"] == [2]  # step 1 = warm-up
        step_time = run["steps"][1]["time_s"]
        assert run["step_time_s"] == step_time > 0
        assert run["images_per_gpu_s"] == pytest.approx(run["images_per_step"] / (step_time * run["gpus_counted"]))
        assert run["images_per_step"] == 4 and run["gpus_counted"] == 1
        for phase in ("gen", "reward", "update_actor", "update_weights"):
            assert run["phase_s"][phase] > 0, phase
        assert run["steps"][1]["metrics"]["perf/tflop/update_actor"] > 0
    base, opt = runs["baseline"], runs["optimized"]
    ratio = entry["ratios"]["optimized"]
    assert ratio["vs"] == "baseline"
    assert ratio["step_time_ratio"] == pytest.approx(base["step_time_s"] / opt["step_time_s"])
    assert ratio["images_per_gpu_s_ratio"] == pytest.approx(opt["images_per_gpu_s"] / base["images_per_gpu_s"])
    assert "--old_log_probs rollout" in opt["command"] and "--old_log_probs recompute" in base["command"]
    assert "--base_weights_dtype fp32" in base["command"]
    assert "qwen_dppo" in stdout and "optimized" in stdout  # the printed table


@pytest.mark.slow  # the module fixture `smoke` runs the whole bench_step.py --smoke (about a minute)
def test_bypass_reproduces_recompute_when_the_gap_is_zero(smoke):
    result, _ = smoke
    runs = result["recipes"]["qwen_dppo"]["runs"]
    base, opt = runs["baseline"], runs["optimized"]
    assert "old_log_prob" in base["phase_s"] and "old_log_prob" not in opt["phase_s"]  # the pass is skipped
    for b, o in zip(base["steps"], opt["steps"]):
        bm, om = b["metrics"], o["metrics"]
        gap = om["rollout_corr/logprob_abs_diff_max"]  # bypass: measured in the first update pass
        assert math.exp(-gap) - 1e-7 <= om["actor/ratio_min"] <= om["actor/ratio_max"] <= math.exp(gap) + 1e-7
        assert bm["actor/ratio_mean"] == 1.0  # recompute: exactly 1 at the first (only) update
        assert bm["rollout_corr/logprob_abs_diff_max"] == gap == 0.0  # fp32 CPU, equal batch shapes
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/ratio_mean", "actor/ratio_std", "actor/approx_kl",
                    "actor/kl_new_old_max", "critic/rewards/mean"):
            assert om[key] == bm[key], key


def test_configs_must_include_the_baseline():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_step.py"), "--smoke", "--configs",
                           "optimized"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "must include baseline" in proc.stderr


@pytest.mark.parametrize("gpus", [1, 4])
def test_gpu_runs_build_flags_every_trainer_accepts(gpus):
    """The GPU runs cannot run here: their trainer flags (every recipe x configuration, 1 and 4 GPUs) must at least
    parse in the trainer they go to, with the configuration's values winning over the recipe's."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import bench_step
    import train_dppo
    import train_nft

    args = bench_step.parse_args(["--gpus", str(gpus), "--recipe", "boogu_nft"])
    for recipe, trainer in bench_step.TRAINER_OF.items():
        for config in bench_step.CONFIGS:
            argv, layout, images = bench_step.trainer_argv(recipe, config, "/m", "/t.parquet", "/out", args)
            parsed = (train_nft if trainer == "train_nft.py" else train_dppo).parse_args(argv)
            assert parsed.device == "cuda" and parsed.activation_checkpointing and parsed.height == 512
            assert parsed.base_weights_dtype == ("fp32" if config == "baseline" else "compute")
            assert images == parsed.train_batch_size * parsed.rollout_n
            assert images // layout["trainer_ranks"] % parsed.micro_batch_size == 0
            if trainer == "train_nft.py":
                assert parsed.train_cfg == ("off" if config in ("optimized", "optimized_ckpt_half") else "rollout")
            else:
                assert parsed.old_log_probs == ("recompute" if config == "baseline" else "rollout")
            if config == "optimized_ckpt_half":
                assert parsed.activation_checkpointing_blocks == bench_step.BLOCKS[bench_step.FAMILY_OF[recipe]](
                    args) // 2
    assert bench_step.layout_of("baseline", gpus, False)["gpus_used"] == gpus
