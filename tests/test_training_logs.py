"""training/logs.py: the captions and the training-rollout grid that TensorBoard shows (`rollout/samples`); the
`--logger wandb` checks that need no wandb installed (tests/test_wandb_logger.py has those that do); the reward,
advantage and validation metrics, metric accumulation, timers, the progress line, image grids and TensorBoard keys,
run metadata."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

import training as T  # noqa: E402
from training.logs import (Progress, TensorBoardLogger, reward_metrics, rollout_grid, sample_caption,  # noqa: E402
                           validation_metrics, write_run_metadata)
from training.optim import GradStepper, build_optimizer  # noqa: E402
from training.perf import perf_metrics  # noqa: E402
from _training_helpers import make_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_process_group")  # a 1-process gloo group (tests/conftest.py)


# ---------------------------------------------------------------------------------------------------------------
# captions, the training-rollout grid, --logger wandb without wandb
# ---------------------------------------------------------------------------------------------------------------


def test_sample_caption_names_the_reward_the_judge_reply_and_the_user_prompt():
    chat = [{"role": "system", "content": "be helpful"}, {"role": "user", "content": "a sign saying OPEN"}]
    assert sample_caption(0.73125, chat, "OPEN") == "r=0.731 | judge: 'OPEN' | a sign saying OPEN"
    assert sample_caption(0.0, "a cat") == "r=0.000 | a cat"
    assert sample_caption(float("nan"), "a cat", "") == "not scored (non-finite) | judge: '' | a cat"


def test_rollout_grid_shows_whole_groups_one_prompt_per_row():
    n, h, w = 3, 16, 24
    images = torch.zeros(4 * n, 3, h, w, dtype=torch.uint8)
    for k in range(4 * n):
        images[k] = 20 * k  # each sample its own grey level, to find it in the grid
    rewards = torch.arange(4 * n, dtype=torch.float32) / 10
    grid = np.asarray(rollout_grid(images, ["p0", "p1", "p2", "p3"], n, rewards, max_images=7))
    cap_h = 4 * 12 + 4
    assert grid.shape == (2 * (h + cap_h), n * w, 3)  # 7 // 3 = 2 whole groups of 3, one row each
    for k in range(2 * n):  # sample j of prompt i sits in row i, column j
        row, col = divmod(k, n)
        assert (grid[row * (h + cap_h) + h // 2, col * w + w // 2] == 20 * k).all()
    one = np.asarray(rollout_grid(images, ["p0", "p1", "p2", "p3"], n, rewards, max_images=2))
    assert one.shape == (h + cap_h, n * w, 3)  # at least one whole group
    with pytest.raises(ValueError, match="for 3 prompts"):
        rollout_grid(images, ["p0", "p1", "p2"], n, rewards)


def test_logger_wandb_without_wandb_is_one_line_naming_the_fix(monkeypatch, tmp_path):
    """wandb is an optional extra: without it, --logger wandb is refused at start-up (WandbSetupError, raised on
    every rank; `setup_run` reports it as a PreflightError) in one line naming `pip install wandb`, and the
    TensorBoard writer it wraps is closed."""
    from training.logs import TensorBoardLogger, WandbLogger, WandbSetupError

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as when it is not installed
    tensorboard = TensorBoardLogger(str(tmp_path / "tensorboard"), enabled=True)
    with pytest.raises(WandbSetupError) as info:
        WandbLogger(tensorboard, str(tmp_path), config={}, project="p")
    message = str(info.value)
    assert "\n" not in message and message.startswith("--logger wandb: wandb cannot be imported")
    assert message.endswith("install it with `pip install wandb`, or drop --logger wandb"), message
    assert tensorboard.writer is None
    assert not os.path.exists(tmp_path / "wandb_run_id.txt")


def test_wandb_logger_of_another_rank_imports_nothing_and_writes_nothing(monkeypatch, tmp_path):
    """Ranks other than 0 (TensorBoardLogger disabled) get a no-op: wandb is never imported (here it could not be),
    no W&B run, no run id file, and every method does nothing."""
    from PIL import Image

    from training.logs import TensorBoardLogger, WandbLogger

    monkeypatch.setitem(sys.modules, "wandb", None)
    logger = WandbLogger(TensorBoardLogger(str(tmp_path / "tensorboard"), enabled=False), str(tmp_path),
                         config={"lr": 1.0}, project="p")
    assert not logger.enabled and logger.run is None
    logger.log_scalars({"x": float("nan")}, 1)
    logger.log_image("val/samples", Image.new("RGB", (4, 4)), 1)
    logger.log_text("run_metadata", "text")
    logger.flush()
    logger.close()
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------------
# logging and metrics
# ---------------------------------------------------------------------------------------------------------------


def test_reward_and_advantage_metrics():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    uids = ["a", "a", "b", "b", "c", "c"]
    adv = torch.tensor([[0.0, 0.0], [0.0, 0.0], [-1.0, -1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    m = reward_metrics(rewards, uids, adv)
    assert m == {
        "critic/rewards/mean": pytest.approx(4.0 / 6), "critic/rewards/max": 1.0, "critic/rewards/min": 0.0,
        "critic/rewards/zero_std_ratio": pytest.approx(2.0 / 3), "critic/rewards/std_mean": pytest.approx(0.5 / 3),
        "critic/rewards/group_size": 2.0,
        "critic/advantages/mean": 0.0, "critic/advantages/max": 1.0, "critic/advantages/min": -1.0,
    }
    m3 = reward_metrics(rewards, uids, extras={"pickscore_raw": [1, 2, 3, 4, 5, 6], "reward/ocr": [0.5] * 6})
    assert m3["critic/pickscore_raw/mean"] == 3.5 and m3["critic/reward/ocr/mean"] == 0.5
    m2 = reward_metrics(rewards[:, None].expand(6, 3), uids)  # (B, T): averaged over T first
    assert m2["critic/rewards/mean"] == pytest.approx(4.0 / 6) and "critic/advantages/mean" not in m2
    with pytest.raises(ValueError):
        reward_metrics(rewards, uids[:3])



def test_validation_metric_names():
    m = validation_metrics(["ocr", "ocr", "pickscore"], {"reward": [0.5, 1.0, 0.25], "pickscore_raw": [1, 2, 3]})
    assert m == {"val-core/ocr/reward/mean@1": 0.75, "val-aux/ocr/pickscore_raw/mean@1": 1.5,
                 "val-core/pickscore/reward/mean@1": 0.25, "val-aux/pickscore/pickscore_raw/mean@1": 3.0}
    # a bare-float reward gets "acc" (verl-omni's VisualRewardManager): acc is the core variable
    m = validation_metrics(["jpeg_compressibility"] * 2, {"reward": [0.1, 0.3], "acc": [0.1, 0.3]})
    assert set(m) == {"val-core/jpeg_compressibility/acc/mean@1", "val-aux/jpeg_compressibility/reward/mean@1"}
    m = validation_metrics(["flow_grpo/ocr"] * 4, {"reward": [0.0, 1.0, 1.0, 1.0]}, uids=[0, 0, 1, 1])
    assert m == {"val-core/flow_grpo/ocr/reward/mean@2": 0.75, "val-aux/flow_grpo/ocr/reward/std@2": 0.25}



def test_metric_accumulator_timer_perf_progress():
    acc = T.MetricAccumulator()
    acc.add({"actor/policy_loss": torch.tensor(1.0), "actor/ratio_mean": 1.0})
    acc.add({"actor/policy_loss": 3.0, "actor/ratio_mean": 1.0})
    assert acc.reduce() == {"actor/policy_loss": 2.0, "actor/ratio_mean": 1.0}
    assert acc.reduce() == {}
    # extremes stay extremes: one outlier micro-batch of three is not averaged away (a mean would give 1.67 / 0.83)
    for ratio_max, ratio_min in ((1.0, 1.0), (torch.tensor(3.0), torch.tensor(0.5)), (1.0, 1.0)):
        acc.add({"actor/ratio_max": ratio_max, "actor/ratio_min": ratio_min, "actor/kl": 0.25})
    assert acc.reduce() == {"actor/ratio_max": 3.0, "actor/ratio_min": 0.5, "actor/kl": 0.25}
    acc.add({"actor/ratio_max": float("nan"), "actor/ratio_min": torch.tensor(float("inf"))})
    acc.add({"actor/ratio_max": 2.0, "actor/ratio_min": 1.0})
    reduced = acc.reduce()
    assert math.isnan(reduced["actor/ratio_max"]) and reduced["actor/ratio_min"] == 1.0  # a NaN is never hidden
    timings: dict[str, float] = {}
    with T.timer("gen", timings):
        pass
    with T.timer("gen", timings):
        pass
    assert list(timings) == ["timing_s/gen"] and timings["timing_s/gen"] >= 0
    assert perf_metrics(64, 2.0, 4) == {"perf/total_num_images": 64.0, "perf/time_per_step": 2.0,
                                         "perf/throughput": 8.0}
    p = Progress(total_steps=10)
    p.line(1, 10.0)
    p.line(2, 2.0)
    line = p.line(3, 2.0, {"critic/rewards/mean": 0.5})
    assert line.startswith("step 3/10 | 2.00s/step | ETA 0:00:14") and "rewards/mean 0.5" in line



def test_image_grid_and_tensorboard_keys(tmp_path):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images = torch.zeros(3, 3, 32, 48, dtype=torch.uint8)
    images[1] = 255
    grid = T.image_grid(images, ["a prompt | reward 0.50", "b", "c"], ncols=2)
    assert isinstance(grid, Image.Image) and grid.size == (96, 2 * (32 + 4 * 12 + 4))
    caption = np.asarray(grid)[32:32 + 14, :48]
    assert (caption < 128).any()  # caption text drawn under the first image
    with pytest.raises(ValueError, match="captions"):
        T.image_grid(images, ["only one"])

    log_dir = str(tmp_path / "tb")
    logger = TensorBoardLogger(log_dir)
    model, _ = make_model()
    metrics = {}
    metrics.update(reward_metrics(torch.tensor([0.0, 1.0]), ["a", "a"], torch.tensor([-1.0, 1.0])))
    metrics.update(T.old_policy_refresh(model, 1))
    metrics.update(perf_metrics(2, 1.0, 1))
    metrics.update(validation_metrics(["ocr"], {"reward": [0.5]}))
    model(torch.randn(1, 5, 4)).sum().backward()
    stepper = GradStepper()
    metrics.update(stepper.step(build_optimizer(model, lr=1e-3)))
    metrics.update(stepper.counters())  # as Run.end_step logs them, once per step
    with T.timer("step", metrics):
        pass
    logger.log_scalars(metrics, step=1)
    logger.log_image("val/samples", grid, step=1)
    logger.close()
    ea = EventAccumulator(log_dir)
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert tags == set(metrics)
    for key in ("critic/rewards/mean", "critic/rewards/zero_std_ratio", "critic/advantages/max",
                "old_policy/update_applied", "old_policy/copy_update", "old_policy/ema_update", "old_policy/decay",
                "perf/throughput", "perf/time_per_step", "timing_s/step", "val-core/ocr/reward/mean@1",
                "actor/grad_norm", "actor/skipped_steps"):
        assert key in tags, key
    assert ea.Tags()["images"] == ["val/samples"]



def test_write_run_metadata(tmp_path):
    meta = write_run_metadata(str(tmp_path), {"lr": 1e-4, "targets": ("to_q",)}, seeds={"seed": 42})
    on_disk = json.load(open(tmp_path / "run_metadata.json"))
    assert on_disk == json.loads(json.dumps(meta))
    assert on_disk["config"] == {"lr": 1e-4, "targets": ["to_q"]} and on_disk["seeds"] == {"seed": 42}
    assert set(on_disk["versions"]) >= {"torch", "diffusers", "transformers", "peft"}
    in_git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode == 0
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?" if in_git else "unknown", on_disk["git_commit"])
