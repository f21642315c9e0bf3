"""training/logs.py: the captions and the training-rollout grid that TensorBoard shows (`rollout/samples`)."""

from __future__ import annotations

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
