"""training/logs.py: the captions and the training-rollout grid that TensorBoard shows (`rollout/samples`); the
`--logger wandb` checks that need no wandb installed (tests/test_wandb_logger.py has those that do)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from training.logs import rollout_grid, sample_caption


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
