"""Issue 19's checks that need no trainer run: every adapter verified wherever it is read (a checkpoint's sha256
manifest, finiteness), non-finite rollout samples never scored and their step skipped, and the refusals that come
before any model loads (--rollout_n 1, a negative reward weight, too few rows, CUDA rollout devices on a CPU host,
a wrong-rank --init_adapter, a malicious pickle) plus the truncated-prompt count. The whole-trainer checks are in
tests/test_lifecycle.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

import rewards as R
import rollout
import train_dppo
import train_nft
import training as T
from training.checkpoint import MARKER
from training.optim import GradStepper
from training.preflight import run_preflight
from training.scoring import RewardStream, nonfinite_rows, score_finite
from models import lora
from test_preflight import flags, refused, rewrite  # noqa: F401 (fixture)
from test_trainers import REPO, cli, demo_data  # noqa: F401 (fixture)

MODULE = "transformer_blocks.0.attn.to_q"


def write_adapter(folder, *, r: int = 4, alpha: float = 8.0, value: float | None = None) -> str:
    """A PEFT adapter folder of one module (A (r, 16), B (16, r)); `value` sets one entry of A."""
    os.makedirs(folder, exist_ok=True)
    a = torch.full((r, 16), 0.047)
    if value is not None:
        a[0, 3] = value
    save_file({f"transformer.{MODULE}.lora_A.weight": a, f"transformer.{MODULE}.lora_B.weight": torch.zeros(16, r)},
              os.path.join(folder, lora.ADAPTER_WEIGHTS))
    with open(os.path.join(folder, lora.ADAPTER_CONFIG), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["to_q"]}, f)
    return str(folder)


def write_checkpoint_with_adapter(root) -> str:
    """A checkpoint folder holding adapters/default and a COMPLETE manifest of it (sizes + sha256)."""
    ckpt = os.path.join(root, "step_00000001")
    write_adapter(os.path.join(ckpt, "adapters", "default"))
    with open(os.path.join(ckpt, "trainer_state.json"), "w") as f:
        json.dump({"step": 1}, f)
    from training.checkpoint import _manifest

    manifest = _manifest(ckpt, 1)
    with open(os.path.join(ckpt, MARKER), "w") as f:
        json.dump(manifest, f)
    return ckpt


def flip_one_weight(adapter_dir: str, value: float) -> None:
    """Rewrite one weight of the adapter in place: same tensor shapes, so the same file size."""
    path = os.path.join(adapter_dir, lora.ADAPTER_WEIGHTS)
    size = os.path.getsize(path)
    tensors = load_file(path)
    tensors[f"transformer.{MODULE}.lora_A.weight"][0, 3] = value
    save_file(tensors, path)
    assert os.path.getsize(path) == size


def test_a_checkpoint_adapter_is_checked_against_its_manifest_and_any_adapter_for_finiteness(tmp_path):
    ckpt = write_checkpoint_with_adapter(tmp_path / "checkpoints")
    path, config, modules = T.verify_adapter_spec(ckpt + ":default")  # the control: intact
    assert path.endswith("adapters/default") and config["r"] == 4 and set(modules) == {MODULE}
    flip_one_weight(os.path.join(ckpt, "adapters", "default"), 1.6e37)  # finite, but not what was saved
    with pytest.raises(T.CheckpointError, match=r"adapters/default/adapter_model\.safetensors.*do not match the "
                                                r"sha256 in its COMPLETE manifest"):
        T.verify_adapter_spec(ckpt + ":default")
    plain = write_adapter(tmp_path / "nan", value=float("nan"))  # a plain PEFT folder: no manifest, finiteness only
    with pytest.raises(T.CheckpointError, match=r"LoRA adapter .*/nan: 1 tensors hold NaN/inf \(e\.g\. "
                                                r"\['transformer_blocks\.0\.attn\.to_q\.lora_A'\]\)"):
        T.verify_adapter_spec(plain)
    T.verify_adapter_spec(write_adapter(tmp_path / "fine"))


def test_binding_a_non_finite_adapter_is_refused_in_every_engine_path():
    """models.lora.bind_adapter is where the rollout workers (disk and tensor sync), evaluate.py and sample.py bind
    an adapter: NaN/inf is refused there before anything is copied."""
    layer = torch.nn.Linear(16, 16)
    model = torch.nn.Module()
    model.transformer_blocks = torch.nn.ModuleList([torch.nn.Module()])
    model.transformer_blocks[0].attn = torch.nn.Module()
    model.transformer_blocks[0].attn.to_q = layer
    config = {"r": 4, "lora_alpha": 8.0, "target_modules": ["to_q"]}
    good = {MODULE: {"A": torch.full((4, 16), 0.05), "B": torch.zeros(16, 4)}}
    assert lora.bind_adapter(model, config, good) == 1
    bad = {MODULE: {"A": torch.full((4, 16), 0.05), "B": torch.full((16, 4), float("inf"))}}
    with pytest.raises(ValueError, match=r"1 LoRA tensors hold NaN/inf .*refusing to bind a corrupt adapter"):
        lora.bind_adapter(model, config, bad, source="adapter tensors v3")
    kept = lora.lora_layers(model, "default")[MODULE].lora_A["default"].weight
    assert torch.equal(kept, good[MODULE]["A"])  # the refused set changed nothing


@pytest.mark.parametrize("script", ["sample.py", "evaluate.py"])
def test_evaluate_and_sample_refuse_a_corrupt_adapter_before_loading_the_model(script, tmp_path, tiny_models):
    ckpt = write_checkpoint_with_adapter(tmp_path / "checkpoints")
    flip_one_weight(os.path.join(ckpt, "adapters", "default"), 1.6e37)
    model = os.path.join(tiny_models, "qwen_image")
    argv = {"sample.py": ["--model_path", model, "--prompt", "a cat", "--adapter", ckpt + ":default"],
            "evaluate.py": ["--model_path", model, "--val_files", "unused.parquet", "--adapters", "base",
                            ckpt + ":default"]}[script]
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", script), *argv, "--output_dir",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-3000:]  # argparse: refused at parse time, before any model
    assert re.search(r"do not match the sha256 in its COMPLETE manifest", proc.stderr), proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_non_finite_rollout_samples_are_never_scored_and_skip_the_step():
    """`nonfinite_rows` finds NaN/inf in the latents (or trajectory / log-probs); `score_finite` never hands those
    samples to a reward; `GradStepper.reject_batch` skips every update of the step like a non-finite loss."""
    result = rollout.RolloutResult(images=torch.zeros(4, 3, 8, 8, dtype=torch.uint8),
                                   latents_clean=torch.zeros(4, 2, 3), prompt_embeds=torch.zeros(4, 2, 8),
                                   prompt_mask=torch.ones(4, 2, dtype=torch.int64), seeds=[0, 1, 2, 3], metadata={})
    result.latents_clean[1, 0, 2] = float("nan")
    result.all_log_probs = torch.zeros(4, 2)
    result.all_log_probs[3, 1] = float("inf")
    assert nonfinite_rows(result) == [1, 3]

    class Recording(R.RewardScorer):
        def __init__(self, by_chunk: bool = True):
            super().__init__()
            self.seen, self.by_chunk = [], by_chunk

        def scores_rows_independently(self, data_sources):
            return self.by_chunk  # False: the whole-rank path (PickScore, the local GenRM)

        def score_batch(self, images, ground_truths, data_sources, extra_infos=None):
            self.seen.append(list(ground_truths))
            return super().score_batch(images, ground_truths, data_sources, extra_infos)

    scorer = Recording()
    inputs = {"ground_truths": ["a", "b", "c", "d"], "data_sources": ["jpeg_compressibility"] * 4,
              "extra_infos": [None] * 4}
    scored = score_finite(scorer, result.images, inputs, nonfinite_rows(result))
    assert scorer.seen == [["a", "c"]]  # the non-finite samples never reached the reward
    assert torch.isnan(scored.rewards[[1, 3]]).all()  # NaN: left out of the reward statistics, never a 0.0
    assert torch.isnan(scored.extras["reward/jpeg_compressibility"][[1, 3]]).all()
    # the overlapped path (RewardStream on the node's driver) skips them too, chunk by chunk or per rank
    for by_chunk in (True, False):
        scorer = Recording(by_chunk)
        stream = RewardStream(scorer, [inputs], [4])
        stream.on_chunk(2, result.select([2, 3]))
        stream.on_chunk(0, result.select([0, 1]))
        (streamed,) = stream.finish()
        stream.close()
        assert sorted(sum(scorer.seen, [])) == ["a", "c"], by_chunk
        # bit-equal, NaN at the skipped samples
        assert torch.allclose(streamed.rewards, scored.rewards, rtol=0, atol=0, equal_nan=True), by_chunk

    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    stepper = GradStepper(1.0)
    stepper.reject_batch("2 non-finite rollout sample(s) (NaN/inf latents; not scored)")
    for _ in range(2):  # every mini-batch of the step
        param.grad = torch.ones(3)
        out = stepper.step(optimizer)
        assert out["actor/step_skipped"] == 1.0
    assert torch.equal(param.detach(), torch.ones(3)) and stepper.consecutive_skips == 2
    assert stepper.last_skip_reason.startswith("2 non-finite rollout sample(s)")
    stepper.reject_batch("")
    param.grad = torch.ones(3)
    assert stepper.step(optimizer)["actor/step_skipped"] == 0.0


def test_model_free_refusals_come_at_preflight(flags, tmp_path, monkeypatch):  # noqa: F811
    refused(cli(**flags, rollout_n=1), r"--rollout_n 1: .*group-relative.*every advantage 0.*--rollout_n 2 or more")
    refused(cli(**flags, rollout_n=1, train_batch_size=2), r"--rollout_n 1", parse=train_nft.parse_args)
    refused(cli(**flags, reward_weights="jpeg_compressibility=-1"),
            r"jpeg_compressibility=-1 is negative.*--allow_negative_reward_weights")
    run_preflight(train_dppo.parse_args(cli(**flags, reward_weights="jpeg_compressibility=-1") +
                                        ["--allow_negative_reward_weights"]), 1)
    small = rewrite(flags["train_files"], tmp_path / "small.parquet", lambda rows: rows.__delitem__(slice(3, None)))
    refused(cli(**{**flags, "train_files": small}, train_batch_size=4, rollout_n=2, micro_batch_size=2),
            rf"--train_files {re.escape(small)}: 3 row\(s\), fewer than --train_batch_size 4 .*at most 3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused(cli(**flags, rollout_devices="cuda:0,cpu"),
            r"--rollout_devices cuda:0,cpu: cuda:0 but this host has no CUDA device.*--rollout_devices cpu")
    wrong = write_adapter(tmp_path / "r8", r=8, alpha=8.0)
    refused(cli(**flags, init_adapter=wrong), rf"--init_adapter {re.escape(wrong)}: r=8, lora_alpha=8.0.*this run has "
                                              r"--lora_rank 4 --lora_alpha 8")
    bad = write_adapter(tmp_path / "nan4", value=float("nan"))
    with pytest.raises(SystemExit):  # refused by the flag's own type, at parse time
        train_dppo.parse_args(cli(**flags, init_adapter=bad))


def test_prompts_beyond_the_text_encoder_length_are_counted(flags, tmp_path):  # noqa: F811
    def lengthen(rows):
        rows[2]["prompt"][-1]["content"] = "grand opening " * 400  # ~800 tokens

    long = rewrite(flags["train_files"], tmp_path / "long.parquet", lengthen)
    found = run_preflight(train_dppo.parse_args(cli(**{**flags, "train_files": long}, max_sequence_length=256)), 1)
    cut = found["truncated_prompts"]
    assert cut["count"] == 1 and cut["rows"] == ["--train_files row 2"] and cut["longest"] > 256
    assert cut["total"] == len(pq.read_table(long)) + len(pq.read_table(flags["val_files"]))
    assert "truncated_prompts" not in run_preflight(train_dppo.parse_args(cli(**flags)), 1)


@pytest.mark.slow
def test_run_length_below_the_checkpoint_is_refused_before_the_model_and_a_long_prompt_is_warned_once(
        demo_data, tiny_models, tmp_path):  # noqa: F811
    """Through the real CLI: a run whose one prompt is longer than --max_sequence_length warns once; relaunched with
    --total_training_steps below its checkpoint's step it is refused, and equal to it it has nothing to do, both
    before the model loads. Slow: three trainer launches (~1 min)."""
    from test_trainers import run_trainer

    def lengthen(rows):
        rows[1]["prompt"][-1]["content"] = "grand opening " * 200  # ~400 tokens

    data = rewrite(demo_data["qwen_image"] / "train.parquet", tmp_path / "long.parquet", lengthen)
    out = tmp_path / "run"
    argv = cli(model_path=os.path.join(tiny_models, "qwen_image"), train_files=data, lr=1e-2, output_dir=out,
               resume="auto", max_sequence_length=128, total_training_steps=2)
    first = run_trainer("train_dppo.py", argv, nproc=1)
    warnings = [line for line in first.stdout.splitlines() if line.startswith("WARNING: ")]
    assert len(warnings) == 1 and re.match(r"WARNING: 1 of 56 prompts are longer than --max_sequence_length 128 "
                                           r"tokens \(the longest \d+\) and are cut .*--train_files row 1", warnings[0])
    shorter = run_trainer("train_dppo.py", [*argv, "--total_training_steps", "1"], nproc=1, expect_ok=False)
    assert shorter.returncode != 0
    assert re.search(rf"PreflightError: --total_training_steps 1 is below the step of the checkpoint to resume "
                     rf"\({re.escape(str(out))}/checkpoints/step_00000002, step 2\): pass --total_training_steps 2 or "
                     r"more", shorter.stderr), shorter.stderr[-3000:]
    same = run_trainer("train_dppo.py", argv, nproc=1)
    assert f"nothing to do: {out}/checkpoints/step_00000002 is at step 2 = --total_training_steps" in same.stdout
    for proc in (shorter, same):
        assert "loading the transformer" not in proc.stdout


def test_validation_never_scores_non_finite_samples_and_counts_them(demo_data):  # noqa: F811
    """run_validation (in-training validation and scripts/evaluate.py): a sample with NaN latents is not scored,
    its record says so, the val-core means are over the others and val-aux/nonfinite_samples counts it (a NaN
    policy's black images used to rank best)."""
    import argparse

    from data_prep.dataset import PromptDataset

    dataset = PromptDataset(demo_data["qwen_image"] / "test.parquet", guidance=False)

    class Client:
        def generate(self, request):
            n = len(request)
            result = rollout.RolloutResult(
                images=torch.full((n, 3, 8, 8), 255, dtype=torch.uint8), latents_clean=torch.zeros(n, 2, 3),
                prompt_embeds=torch.zeros(n, 2, 8), prompt_mask=torch.ones(n, 2, dtype=torch.int64),
                seeds=list(request.seeds), metadata={})
            result.latents_clean[1] = float("nan")
            return result

    seen = []

    class Scorer(R.RewardScorer):
        def score_batch(self, images, ground_truths, data_sources, extra_infos=None):
            seen.extend(ground_truths)
            return super().score_batch(images, ground_truths, data_sources, extra_infos)

    args = argparse.Namespace(val_max_samples=4, val_seed=42, val_num_inference_steps=2, height=64, width=64,
                              num_val_images=0)
    outcome = T.run_validation(Client(), Scorer(), dataset, args, cfg_scale=1.0)
    assert seen == [dataset[i].ground_truth for i in (0, 2, 3)]  # sample 1 never reached the reward
    assert outcome.samples[1]["nonfinite"] is True and outcome.samples[1]["reward"] != outcome.samples[1]["reward"]
    assert outcome.metrics["val-aux/nonfinite_samples"] == 1.0
    finite = [s["reward"] for k, s in enumerate(outcome.samples) if k != 1]
    assert outcome.metrics["val-core/jpeg_compressibility/reward/mean@1"] == pytest.approx(sum(finite) / 3)
