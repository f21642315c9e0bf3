"""tools/bench_rollout.py --device cpu --quick: the benchmark runs end to end on a fresh clone, both CFG modes agree,
and its FLOP counts are the models' own formula (`FlowModel.forward_flops`) of both branches and every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_cpu_run_agrees_and_counts_flops_with_the_models_formula(tmp_path):
    from types import SimpleNamespace

    from models.qwen_image import qwen_image_forward_flops

    out = tmp_path / "bench_rollout.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_rollout.py"), "--device", "cpu",
                           "--quick", "--json", str(out), "--workdir", str(tmp_path / "work")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout.split("==== summary ====")[1]
    assert summary.count("[ok]") == 2  # batched CFG's velocity within tolerance of sequential, each family
    result = json.loads(out.read_text())
    steps, batch = result["args"]["steps"], result["args"]["batch"]
    rows = {row["family"]: row for row in result["rows"]}
    assert set(rows) == {"qwen_image", "boogu_image"}
    for row in rows.values():
        assert row["rollout_tflop"] == row["velocity_tflop"] * steps
        # a velocity is both branches: the conditional batch plus a non-empty negative batch
        assert row["velocity_tflop"] > row["tflop_per_forward"] * batch > 0
    # the per-sample figure is the Qwen-Image formula of the quick config at the mean prompt length, by hand:
    # dim 32, 2 layers, 64 -> 16 channels, patch 2; 1 sample of n_i image and n_t text tokens
    qwen = rows["qwen_image"]
    n_i, n_t = qwen["image_tokens"], qwen["text_tokens"]
    dim, layers, joint = 32, 2, 32
    by_hand = (2 * (layers * 12 * dim**2 + 64 * dim + 4 * 16 * dim) * n_i + 2 * (layers * 12 * dim**2 + joint * dim) * n_t
               + 2 * layers * 12 * dim**2 + 2 * (256 * dim + dim**2) + 4 * dim**2 + 4 * layers * dim * (n_i + n_t) ** 2)
    config = SimpleNamespace(num_attention_heads=2, attention_head_dim=16, num_layers=2, patch_size=2, in_channels=64,
                             out_channels=16, joint_attention_dim=joint)
    assert qwen_image_forward_flops(config, n_i, [n_t]) == by_hand
    # text_tokens is the mean rounded, so the per-sample figure lies within one token's cost of it
    one_token = 2 * (layers * 12 * dim**2 + joint * dim) + 8 * layers * dim * (n_i + n_t + 1)
    assert abs(qwen["tflop_per_forward"] * 1e12 - by_hand) <= one_token
