"""tools/bench_step.py in its CPU smoke mode: the JSON schema, the ratio taken from the baseline and optimized
runs of the same invocation, the Flow-DPPO bypass numerics (`optimized_bypass`, `--old_log_probs rollout`, against
`optimized`, the recipes' recompute): with a zero rollout/trainer gap (fp32, CPU, one rank, one micro-batch) every
loss, ratio and grad norm equals the recompute run's, the first-pass ratio stays within exp(±gap), and no
old-log-prob pass runs; --profile's traces and tables; --baseline_json (round trip, refusals)."""

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
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_step.py"), "--smoke", "--out",
                           str(out / "bench.json"), "--workdir", str(out / "work"), "--profile", "--configs",
                           "baseline,optimized,optimized_bypass"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text()), proc.stdout, out / "bench.json"


@pytest.mark.slow  # the module fixture `smoke` runs the whole bench_step.py --smoke (about a minute)
def test_schema_and_ratio_from_the_same_invocation(smoke):
    result, stdout, _ = smoke
    assert result["bench"] == "bench_step" and result["schema_version"] == 1 and result["smoke"] is True
    entry = result["recipes"]["qwen_dppo"]
    runs = entry["runs"]
    assert set(runs) == {"baseline", "optimized", "optimized_bypass"}
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
    # the recipes' own DPPO setting is the measured optimized path; bypass is its own configuration
    assert "--old_log_probs recompute" in opt["command"] and "--old_log_probs recompute" in base["command"]
    assert "--old_log_probs rollout" in runs["optimized_bypass"]["command"]
    assert "--base_weights_dtype fp32" in base["command"]
    assert "qwen_dppo" in stdout and "optimized" in stdout  # the printed table
    assert "baseline: measured in this invocation" in stdout


@pytest.mark.slow  # the module fixture `smoke` runs the whole bench_step.py --smoke (about a minute)
def test_bypass_reproduces_recompute_when_the_gap_is_zero(smoke):
    result, _, _ = smoke
    runs = result["recipes"]["qwen_dppo"]["runs"]
    base, opt = runs["optimized"], runs["optimized_bypass"]
    # one mini-batch per step: the optimized recompute takes the old log-probs from the update's own forward (no
    # pass of their own, as bypass); the baseline keeps the separate pass (--old_from_update off)
    assert "old_log_prob" not in base["phase_s"] and "old_log_prob" not in opt["phase_s"]
    assert "old_log_prob" in runs["baseline"]["phase_s"] and "--old_from_update off" in runs["baseline"]["command"]
    for b, o in zip(base["steps"], opt["steps"]):
        bm, om = b["metrics"], o["metrics"]
        gap = om["rollout_corr/logprob_abs_diff_max"]  # bypass: measured in the first update pass
        assert math.exp(-gap) - 1e-7 <= om["actor/ratio_min"] <= om["actor/ratio_max"] <= math.exp(gap) + 1e-7
        assert bm["actor/ratio_mean"] == 1.0  # recompute: exactly 1 at the first (only) update
        assert bm["rollout_corr/logprob_abs_diff_max"] == gap == 0.0  # fp32 CPU, equal batch shapes
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/ratio_mean", "actor/ratio_std", "actor/approx_kl",
                    "actor/kl_new_old_max", "critic/rewards/mean"):
            assert om[key] == bm[key], key


@pytest.mark.slow  # uses the module fixture `smoke` (the whole bench_step.py --smoke)
def test_profile_traces_and_tables(smoke):
    """--profile: every run's trainer rank and rollout worker wrote a gzipped trace of the last step, and its table
    has the phases the trainer timed, with the host reads the loss metrics no longer make."""
    result, stdout, _ = smoke
    for config, run in result["recipes"]["qwen_dppo"]["runs"].items():
        profile = run["profile"]
        assert set(profile["traces"]) == {"trainer-rank0", "profile-worker-0"}, config
        for trace in profile["traces"].values():
            assert os.path.isfile(trace["path"]) and 0 < trace["bytes"] < 8 * 2**20
        trainer = {row["phase"]: row for row in profile["tables"]["trainer-rank0"]["phases"]}
        assert {"step", "update_actor", "update_weights"} <= set(trainer), config
        assert ("old_log_prob" in trainer) == (config == "baseline")  # the only one with a separate pass
        worker = {row["phase"]: row for row in profile["tables"]["profile-worker-0"]["phases"]}
        assert worker["gen"]["busy_ms"] > 0 and worker["gen"]["device_events"] > 0
        update = trainer["update_actor"]
        assert 0 < update["busy_ms"] <= update["wall_ms"] and update["idle_ms"] >= 0
        assert run["timing_includes_profiler"] is True  # 2 steps: the measured one is the profiled one
        # the losses read nothing on the host (metrics stay on the device, finiteness is read once per optimizer
        # step). What remains on CPU are AdamW's per-parameter step reads (the fused CUDA AdamW has none) and the
        # optimizer step's own checks: fewer than the 2 x 15 reads the two DPPO loss calls made when each read its own
        assert update["host_reads"] < 2 * 15 + 42, update
    assert "top CPU op (self time)s in update_actor" in stdout


@pytest.mark.slow  # uses the module fixture `smoke` (the whole bench_step.py --smoke)
def test_a_large_trace_is_kept_without_its_cpu_ops(smoke, tmp_path):
    """Over the size limit, the kept copy drops the CPU ops (what a device call returns is limited); the table is
    still read from the whole trace."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import bench_step
    from engines.profiler import load_trace

    result, _, path = smoke
    kept = bench_step.collect_profiles(str(path.parent / "work" / "qwen_dppo-optimized"), "x", str(tmp_path),
                                       smoke=True, max_bytes=0)
    trace = kept["traces"]["trainer-rank0"]
    assert trace["cpu_ops_dropped"] and trace["bytes"] < trace["original_bytes"]
    events = load_trace(trace["path"])
    assert not any(e.get("cat") == "cpu_op" for e in events)
    assert any(str(e.get("name")).startswith("timing_s/update_actor") for e in events)
    assert kept["tables"]["trainer-rank0"] == result["recipes"]["qwen_dppo"]["runs"]["optimized"]["profile"][
        "tables"]["trainer-rank0"]


@pytest.mark.slow  # uses the module fixture `smoke` (the whole bench_step.py --smoke)
def test_baseline_json_is_taken_from_an_earlier_run(smoke, tiny_models, tmp_path):
    """--baseline_json: the earlier smoke run's baseline is used as is (no baseline run), the output and the JSON
    say where it came from; a malformed file or one from another machine is refused before anything runs."""
    result, _, path = smoke
    env = dict(os.environ, TINY_MODELS_DIR=tiny_models, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    bench = [sys.executable, os.path.join(REPO, "tools", "bench_step.py"), "--smoke", "--workdir",
             str(tmp_path / "work"), "--out", str(tmp_path / "again.json")]
    # optimized_train_cfg does not apply to Flow-DPPO: no run starts, only the baseline is read in
    proc = subprocess.run(bench + ["--configs", "optimized_train_cfg", "--baseline_json", str(path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads((tmp_path / "again.json").read_text())
    base = again["recipes"]["qwen_dppo"]["runs"]["baseline"]
    assert base["source"] == str(path) and base["started_at"] == result["recipes"]["qwen_dppo"]["runs"]["baseline"][
        "started_at"]
    assert again["baseline_source"]["mismatches"] == [] and again["baseline_source"]["git_commit"] == \
        result["git_commit"]
    assert f"baseline: the baseline runs of {path}" in proc.stdout and "baseline (file)" in proc.stdout
    # --baseline_config: another configuration of the file serves (a change measured against today's path)
    proc = subprocess.run(bench + ["--configs", "optimized_train_cfg", "--baseline_json", str(path),
                                   "--baseline_config", "optimized_bypass"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and f"baseline: the optimized_bypass runs of {path}" in proc.stdout, proc.stderr
    assert json.loads((tmp_path / "again.json").read_text())["recipes"]["qwen_dppo"]["runs"]["baseline"][
        "command"] == result["recipes"]["qwen_dppo"]["runs"]["optimized_bypass"]["command"]
    # refusals, each before any run
    broken = tmp_path / "broken.json"
    broken.write_text('{"bench": "bench_step"')
    other = json.loads(path.read_text())
    other["machine"]["torch"] = "0.0.1"
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(other))
    for baseline, message in ((broken, "cannot be read as JSON"), (foreign, "machine torch: baseline '0.0.1'")):
        proc = subprocess.run(bench[:3] + ["--workdir", str(tmp_path / "refused"), "--configs", "optimized",
                                           "--baseline_json", str(baseline)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "refused").exists()


def test_configs_must_include_the_baseline():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_step.py"), "--smoke", "--configs",
                           "optimized"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "must include baseline" in proc.stderr and "--baseline_json none" in proc.stderr
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_step.py"), "--smoke", "--configs",
                           "baseline,optimized", "--baseline_json", "x.json"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "drop baseline from --configs" in proc.stderr


def _fake_result(**machine) -> dict:
    """A minimal bench_step JSON as `main` writes it, with one measured qwen_dppo baseline run."""
    import bench_step

    args = bench_step.parse_args(["--gpus", "1"])
    info = {"host": "h", "gpus": 1, "torch": "2.11.0", "cuda": "13.0", "gpu_names": ["NVIDIA H200"],
            "python": "3.12.3", **machine}
    return {"bench": "bench_step", "schema_version": bench_step.SCHEMA_VERSION, "started_at": "t0", "args": vars(args),
            "git_commit": "abc", "machine": info,
            "recipes": {"qwen_dppo": {"runs": {"baseline": {"status": "ok", "images_per_gpu_s": 0.5,
                                                            "step_time_s": 32.0, "started_at": "t1"}}}}}


def test_baseline_round_trip_and_refusals(tmp_path):
    """write_json -> load_baseline gives back the runs; baseline_problems names every machine or measurement
    difference; a file without an ok baseline of the recipe, of another schema or not JSON is refused."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import bench_step

    earlier = _fake_result()
    path = str(tmp_path / "base.json")
    bench_step.write_json(earlier, path)
    loaded, runs = bench_step.load_baseline(path, ["qwen_dppo"])
    assert runs["qwen_dppo"] == earlier["recipes"]["qwen_dppo"]["runs"]["baseline"]
    now = vars(bench_step.parse_args(["--gpus", "1", "--configs", "optimized", "--baseline_json", path]))
    assert bench_step.baseline_problems(loaded, dict(earlier["machine"], host="other"), now) == []  # host may differ
    problems = bench_step.baseline_problems(loaded, dict(earlier["machine"], gpu_names=["NVIDIA H100"]),
                                            dict(now, qwen_layers=40))
    assert problems == ["machine gpu_names: baseline ['NVIDIA H200'], now ['NVIDIA H100']",
                        "--qwen_layers: baseline 60, now 40"]
    assert bench_step.baseline_problems(loaded, earlier["machine"], dict(now, baseline_flags="--x"),
                                        "optimized") == []  # the baseline flags matter only for `baseline` runs
    # a JSON written before --train_rows existed measured all the prompts: comparable with 0, not with 1
    del loaded["args"]["train_rows"]
    assert bench_step.baseline_problems(loaded, earlier["machine"], now) == []
    assert bench_step.baseline_problems(loaded, earlier["machine"], dict(now, train_rows=1)) == [
        "--train_rows: baseline 0, now 1"]
    with pytest.raises(bench_step.BaselineError, match="has no measured optimized run"):
        bench_step.load_baseline(path, ["qwen_dppo"], "optimized")
    assert bench_step.baseline_line({"baseline_source": {"path": None}}).startswith("baseline: none")
    ratio = bench_step.ratios({"baseline": runs["qwen_dppo"], "optimized": {"images_per_gpu_s": 0.6,
                                                                            "step_time_s": 16 / 0.6}})
    assert ratio["optimized"]["images_per_gpu_s_ratio"] == pytest.approx(1.2)
    with pytest.raises(bench_step.BaselineError, match="recipe qwen_nft has no measured baseline run"):
        bench_step.load_baseline(path, ["qwen_nft"])
    failed = _fake_result()
    failed["recipes"]["qwen_dppo"]["runs"]["baseline"] = {"status": "oom"}
    bench_step.write_json(failed, path)
    with pytest.raises(bench_step.BaselineError, match=r"no measured baseline run \(oom\)"):
        bench_step.load_baseline(path, ["qwen_dppo"])
    bench_step.write_json(dict(_fake_result(), schema_version=0), path)
    with pytest.raises(bench_step.BaselineError, match="not a bench_step JSON"):
        bench_step.load_baseline(path, ["qwen_dppo"])
    with open(path, "w") as f:
        f.write("[1, 2")
    with pytest.raises(bench_step.BaselineError, match="cannot be read as JSON"):
        bench_step.load_baseline(path, ["qwen_dppo"])


def test_train_rows_keeps_the_first_prompts(tmp_path):
    """--train_rows N trains on the first N demo prompts (every step then has step 1's sequence lengths)."""
    import pandas as pd

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import bench_step

    full = pd.read_parquet(bench_step.demo_data("qwen_image", str(tmp_path)))
    two = pd.read_parquet(bench_step.demo_data("qwen_image", str(tmp_path), train_rows=2))
    assert len(full) > 2 and len(two) == 2
    assert [row["prompt"][-1]["content"] for row in two.to_dict("records")] == [
        row["prompt"][-1]["content"] for row in full.head(2).to_dict("records")]


@pytest.mark.parametrize("gpus", [1, 4])
def test_gpu_runs_build_flags_every_trainer_accepts(gpus):
    """The GPU runs cannot run here: their trainer flags (every recipe x configuration, 1 and 4 GPUs) must at least
    parse in the trainer they go to, with the configuration's values winning over the recipe's."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import bench_step
    import train_dppo
    import train_nft

    args = bench_step.parse_args(["--gpus", str(gpus), "--recipe", "boogu_nft"])
    for recipe, trainer in bench_step.TRAINER_OF.items():
        for config in [c for c in bench_step.CONFIGS if bench_step.ONLY_FOR.get(c, trainer) == trainer]:
            argv, layout, images = bench_step.trainer_argv(recipe, config, "/m", "/t.parquet", "/out", args)
            parsed = (train_nft if trainer == "train_nft.py" else train_dppo).parse_args(argv)
            assert parsed.device == "cuda" and parsed.activation_checkpointing and parsed.height == 512
            assert parsed.base_weights_dtype == ("fp32" if config == "baseline" else "compute")
            assert images == parsed.train_batch_size * parsed.rollout_n
            assert images // layout["trainer_ranks"] % parsed.micro_batch_size == 0
            if trainer == "train_nft.py":
                assert parsed.train_cfg == ("off" if config in ("optimized", "optimized_ckpt_half") else "rollout")
            else:
                assert parsed.old_log_probs == ("rollout" if config == "optimized_bypass" else "recompute")
            assert parsed.profile_step == 0
            if config == "optimized_ckpt_half":
                assert parsed.activation_checkpointing_blocks == bench_step.BLOCKS[bench_step.FAMILY_OF[recipe]](
                    args) // 2
    assert bench_step.layout_of("baseline", gpus, False)["gpus_used"] == gpus
