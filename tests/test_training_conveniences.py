"""The trainers' conveniences, on CPU in one process (tiny LoRA transformer, 1-process gloo group): the lr schedule
and its exact resume, adapter paths (`PATH` / `CHECKPOINT:default|old`), --init_adapter, --val_adapter (validation
samples with the chosen adapter and leaves the rollout's adapter as it was), the console log file and --help
defaults. The end-to-end runs are in tests/test_sample_evaluate.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch

import training as T
from training.adapters import load_init_adapter, resolve_adapter_dir
from training.checkpoint import load_checkpoint, save_checkpoint
from training.console import tee_console
from training.model import (adapter_params, adapter_state_dict, add_lora_adapters, save_adapter_dir,
                            shard_transformer)
from training.optim import (build_lr_scheduler, build_optimizer, load_lr_scheduler_state_, lr_multiplier,
                            lr_scheduler_state)
from training.run import Run
from models import lora
from _tiny_lora import BLOCK_PREFIXES, TARGETS, TinyFlowTransformer

pytestmark = pytest.mark.usefixtures("one_process_group")  # a 1-process gloo group (tests/conftest.py)


def tiny_model(seed: int, adapters=("default", "old"), rank: int = 2, alpha: float = 4.0):
    """Tiny transformer (base from seed 0) with LoRA adapters of random non-zero A and B (from `seed`), sharded."""
    torch.manual_seed(0)
    model = TinyFlowTransformer()
    cfg = add_lora_adapters(model, target_modules=TARGETS, rank=rank, alpha=alpha, adapter_names=adapters,
                            block_prefixes=BLOCK_PREFIXES)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name in adapters:
            for _, p in adapter_params(model, name):
                p.normal_(0, 0.5)
    shard_transformer(model, BLOCK_PREFIXES)
    return model, cfg


def export(model, cfg, adapter: str, out: str) -> str:
    save_adapter_dir(adapter_state_dict(model, adapter), cfg, out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# lr schedule
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule, warmup, total, floor, expected", [
    ("constant", 0, 10, 0.0, [1.0, 1.0, 1.0]),
    ("constant", 4, 10, 0.0, [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]),                  # s / W, then 1
    ("linear", 0, 10, 0.0, [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]),                      # 1 - s / T
    ("linear", 2, 6, 0.2, [0.0, 0.5, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]),             # r + (1 - r)(1 - (s - W)/(T - W))
    ("cosine", 2, 10, 0.1, [0.0, 0.5, 1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 8)) / 2,
                            0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2]),
    ("cosine", 0, 4, 0.0, [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 - 0.5 * math.cos(math.pi / 4), 0.0]),
])
def test_lr_multiplier_hand_values(schedule, warmup, total, floor, expected):
    got = [lr_multiplier(s, schedule=schedule, warmup_steps=warmup, total_steps=total, min_lr_ratio=floor)
           for s in range(len(expected))]
    assert got == pytest.approx(expected, abs=1e-12)


def test_lr_scheduler_resumes_exactly_through_a_checkpoint(tmp_path):
    """An optimizer + cosine schedule stepped 2 times, checkpointed (trainer_state JSON), restored into fresh
    objects: the next lrs equal the uninterrupted run's; a fresh schedule without the restore would not."""
    def build():
        model, cfg = tiny_model(1, adapters=("default",))
        optimizer = build_optimizer(model, lr=0.1)
        return model, cfg, optimizer, build_lr_scheduler(optimizer, schedule="cosine", warmup_steps=1,
                                                         total_steps=6, min_lr_ratio=0.1)

    def step(model, optimizer, scheduler):
        lr = optimizer.param_groups[0]["lr"]
        model(torch.ones(1, 2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        return lr

    model, cfg, optimizer, scheduler = build()
    straight = [step(model, optimizer, scheduler) for _ in range(5)]
    assert straight[0] == 0.0 and straight[1] == pytest.approx(0.1)

    model, cfg, optimizer, scheduler = build()
    [step(model, optimizer, scheduler) for _ in range(2)]
    path = save_checkpoint(str(tmp_path / "ckpt"), 2, transformer=model, optimizer=optimizer, lora_config=cfg,
                           config={"x": 1}, trainer_state={"lr_scheduler": lr_scheduler_state(scheduler)})
    model, cfg, optimizer, scheduler = build()
    state = load_checkpoint(path, transformer=model, optimizer=optimizer, config={"x": 1})
    fresh_lr = optimizer.param_groups[0]["lr"]  # what a resume that forgets the schedule would continue from
    load_lr_scheduler_state_(scheduler, state["trainer_state"]["lr_scheduler"])
    resumed = [step(model, optimizer, scheduler) for _ in range(3)]
    assert resumed == straight[2:]
    forgot = build_lr_scheduler(build_optimizer(tiny_model(1, adapters=("default",))[0], lr=0.1),
                                schedule="cosine", warmup_steps=1, total_steps=6, min_lr_ratio=0.1)
    # the optimizer restore keeps this run's hyper-parameters (the warm-up's lr 0 at construction): without the
    # scheduler restore the run would continue at the wrong lr
    assert forgot.get_last_lr()[0] != straight[2] and fresh_lr != pytest.approx(straight[2])

    # a decaying schedule was laid out over total_steps: another --total_training_steps is refused
    other = build_lr_scheduler(optimizer, schedule="cosine", warmup_steps=1, total_steps=9, min_lr_ratio=0.1)
    with pytest.raises(ValueError, match="--total_training_steps 6"):
        load_lr_scheduler_state_(other, state["trainer_state"]["lr_scheduler"])
    with pytest.raises(ValueError, match="no lr scheduler state"):
        load_lr_scheduler_state_(other, None)
    json.dumps(state["trainer_state"])  # it rides in trainer_state.json


# ---------------------------------------------------------------------------------------------------------------
# adapter paths and --init_adapter
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A complete training checkpoint with adapters default and old (different values), and a PEFT folder."""
    root = tmp_path_factory.mktemp("ckpt")
    model, cfg = tiny_model(3)
    optimizer = build_optimizer(model, lr=0.1)
    path = save_checkpoint(str(root / "run" / "checkpoints"), 7, transformer=model, optimizer=optimizer,
                           lora_config=cfg, config={}, adapter_names=("default", "old"))
    return SimpleNamespace(path=path, run=str(root / "run"), peft=export(model, cfg, "old", str(root / "peft")),
                           default=adapter_state_dict(model, "default"), old=adapter_state_dict(model, "old"))


def test_resolve_adapter_dir(checkpoint, tmp_path):
    assert resolve_adapter_dir(checkpoint.peft) == checkpoint.peft
    assert resolve_adapter_dir(checkpoint.path + ":old") == os.path.join(checkpoint.path, "adapters", "old")
    assert resolve_adapter_dir(checkpoint.path + ":default") == os.path.join(checkpoint.path, "adapters", "default")
    with pytest.raises(ValueError, match=r"holds the adapters \['default', 'old'\]: name one"):
        resolve_adapter_dir(checkpoint.path)
    with pytest.raises(ValueError, match="is a PEFT adapter folder, not a checkpoint"):
        resolve_adapter_dir(checkpoint.peft + ":old")
    with pytest.raises(ValueError, match="looks like a run directory.*step_00000007"):
        resolve_adapter_dir(checkpoint.run)
    with pytest.raises(ValueError, match=f"{tmp_path} is neither a PEFT adapter folder"):
        resolve_adapter_dir(str(tmp_path))
    partial = tmp_path / "step_00000001"
    (partial / "adapters").mkdir(parents=True)
    with pytest.raises(ValueError, match="is partial"):
        resolve_adapter_dir(str(partial) + ":default")
    parser = argparse.ArgumentParser()
    parser.add_argument("--init_adapter", type=T.adapter_arg)
    assert parser.parse_args(["--init_adapter", checkpoint.peft]).init_adapter == checkpoint.peft
    with pytest.raises(SystemExit):
        parser.parse_args(["--init_adapter", str(tmp_path)])


def test_init_adapter_loads_exactly_and_fails_closed(checkpoint, tmp_path, capsys):
    model, _ = tiny_model(9)
    n = len(lora.lora_layers(model, "default"))
    assert load_init_adapter(model, None, lora_rank=2, lora_alpha=4.0, expected_modules=n) == 0
    assert load_init_adapter(model, checkpoint.path + ":old", lora_rank=2, lora_alpha=4.0, expected_modules=n) == n
    loaded = adapter_state_dict(model, "default")
    assert loaded.keys() == checkpoint.old.keys()
    assert all(torch.equal(loaded[k], checkpoint.old[k]) for k in loaded)
    assert "init adapter: 'default' starts from" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--lora_rank 2 --lora_alpha 6.0"):
        load_init_adapter(model, checkpoint.peft, lora_rank=2, lora_alpha=6.0, expected_modules=n)
    # an adapter over other modules (only to_q): strict, names the missing tensors
    small = TinyFlowTransformer()
    cfg = add_lora_adapters(small, target_modules=("to_q",), rank=2, alpha=4.0, block_prefixes=BLOCK_PREFIXES)
    with pytest.raises(ValueError, match="missing 6"):
        load_init_adapter(model, export(small, cfg, "default", str(tmp_path / "q")), lora_rank=2, lora_alpha=4.0,
                          expected_modules=n)


# ---------------------------------------------------------------------------------------------------------------
# --val_adapter: validation samples with the chosen adapter, the rollout keeps its own
# ---------------------------------------------------------------------------------------------------------------


class RecordingRollout:
    """Stands in for the rollout workers: holds the last loaded adapter and records what every generate sampled
    with (the version label and the adapter's tensors). Synchronous, with adapters published through disk."""
    has_pending, sync_mode = False, "disk"

    def __init__(self):
        self.loaded, self.generated, self.versions_published = None, [], 0

    def load_adapter(self, path, version):
        self.versions_published += 1
        _, modules = lora.read_adapter(path)
        self.loaded = (version, {f"{m}.lora_{ab}.weight": t for m, pair in modules.items() for ab, t in pair.items()})
        return [len(modules)]

    def generate(self, request):
        self.generated.append(self.loaded)
        images = torch.randint(0, 255, (len(request), 3, 16, 16), dtype=torch.uint8)
        return SimpleNamespace(images=images)


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("val_adapter", ["default", "old"])
def test_val_adapter_samples_with_the_chosen_adapter_and_restores_the_rollout(tmp_path, val_adapter):
    from data_prep.dataset import PromptRow
    import rewards

    model, cfg = tiny_model(5)
    client = RecordingRollout()
    scorer = SimpleNamespace(score_batch=lambda images, ground_truths, data_sources, extra_infos: rewards.RewardResult(
        rewards=images.float().mean((1, 2, 3)), extras={}))
    rows = [PromptRow(index=i, prompt=[{"role": "user", "content": f"p{i}"}], negative_prompt=None, images=[],
                      ground_truth="", data_source="src") for i in range(3)]
    args = argparse.Namespace(val_adapter=val_adapter, output_dir=str(tmp_path), rollout_engine="native",
                              val_max_samples=0, val_seed=42, val_num_inference_steps=2, height=16, width=16,
                              num_val_images=2, cfg_scale=1.0)
    required = {f.name: None for f in dataclasses.fields(Run) if f.default is dataclasses.MISSING}
    run = Run(**{**required, "args": args, "model": SimpleNamespace(transformer=model, family="qwen_image"),
                 "lora_config": cfg, "num_lora_modules": len(lora.lora_layers(model, "default")),
                 "val_data": rows, "scorer": scorer, "rollout": client, "rank": 0, "world": 1,
                 "adapters_root": str(tmp_path / "rollout_adapters"),
                 "logger": SimpleNamespace(log_scalars=lambda *a: None, log_image=lambda *a: None)})
    default, old = adapter_state_dict(model, "default"), adapter_state_dict(model, "old")
    assert not same(default, old)
    run.sync_rollout("old", 3)  # DiffusionNFT's rollout adapter, version 3
    metrics = run.validate(3)
    label, tensors = client.generated[-1]
    assert same(tensors, default if val_adapter == "default" else old), "validation sampled with the wrong adapter"
    assert label == ("val-default-v3" if val_adapter == "default" else "v3")
    assert client.loaded[0] == "v3" and same(client.loaded[1], old)  # the next training rollout samples `old` v3
    assert "val-core/src/reward/mean@1" in metrics
    assert client.versions_published == 1  # the swap and re-sync publish no new policy (rollout/policy_lag)

    # a reward that fails in validation ends the run through the run's failure policy: the last finished step is
    # written (Lifeboat.fail_with_checkpoint) and the error raised, not left to the other ranks' gather timeout
    def broken(*a, **k):
        raise ConnectionError("judge down")
    fatal = []
    run.scorer = SimpleNamespace(score_batch=broken)
    run.lifeboat = SimpleNamespace(fail_with_checkpoint=lambda e, what, agreed: fatal.append((str(e), what, agreed)))
    with pytest.raises(ConnectionError, match="judge down"):
        run.validate(4)
    assert fatal == [("judge down", "the validation", True)]


# ---------------------------------------------------------------------------------------------------------------
# console log file, --help
# ---------------------------------------------------------------------------------------------------------------


def test_tee_console_mirrors_rank0_and_every_ranks_errors(tmp_path, monkeypatch):
    import training.console as console

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after the test, whatever tee_console installs
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    monkeypatch.setattr(console, "launch_rank", lambda: 1)
    path = tee_console(str(tmp_path))
    assert not isinstance(sys.stdout, console._Tee)  # ranks > 0: stderr only
    print("rank-1 chatter")
    sys.stderr.write("Traceback (most recent call last):\n  boom")
    sys.stderr.write("\nRuntimeError: boom\n")
    assert tee_console(str(tmp_path)) == path  # idempotent: no second layer
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    monkeypatch.setattr(console, "launch_rank", lambda: 0)
    tee_console(str(tmp_path))
    print("step 1/1 | rank 0 line")
    lines = open(path, encoding="utf-8").read().splitlines()
    assert "rank-1 chatter" not in "\n".join(lines)
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ "  # every line starts with its UTC time
    assert all(re.match(stamp, line) for line in lines), lines
    log = [re.sub("^" + stamp, "", line) for line in lines]
    assert log[:3] == ["[rank 1] Traceback (most recent call last):", "[rank 1]   boom", "[rank 1] RuntimeError: boom"]
    assert log[3].startswith("==== ") and log[4] == "step 1/1 | rank 0 line"


def test_tee_console_keeps_the_log_when_the_terminal_is_gone(tmp_path, monkeypatch):
    """A closed terminal (SIGHUP) makes every write to it fail with EIO: the console log file still gets every line,
    and neither print nor flush raises, so the save that follows the hangup can report itself."""
    import errno

    import training.console as console

    class ClosedTerminal:
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")

        def flush(self):
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sys, "stdout", ClosedTerminal())
    monkeypatch.setattr(sys, "stderr", ClosedTerminal())
    monkeypatch.setattr(console, "launch_rank", lambda: 0)
    path = tee_console(str(tmp_path))
    print("received SIGHUP: stopping at the end of this step", flush=True)
    sys.stderr.write("saved checkpoint step_00000001\n")
    sys.stderr.flush()
    text = open(path, encoding="utf-8").read()
    assert "received SIGHUP: stopping" in text and "saved checkpoint step_00000001" in text


@pytest.mark.parametrize("script", ["train_nft", "train_dppo"])
def test_help_shows_every_default(script, capsys):
    module = __import__(script)
    with pytest.raises(SystemExit):
        module.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--lr LR, --learning_rate LR AdamW peak learning rate (see --lr_scheduler) (default: 1e-06)" in text
    assert "--lora_rank LORA_RANK default: 64" in text  # a flag without help text still shows its default
    assert "--lr_scheduler {constant,linear,cosine}" in text and "(default: constant)" in text
    assert ("--val_adapter {old,default}" in text) == (script == "train_nft")
