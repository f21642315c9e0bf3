"""training/checkpoint.py: the atomic save and its layout, exact `load_checkpoint`, the refusals (a changed config, a
partial or corrupt checkpoint, an untrusted pickle, NaN/inf weights), a save killed mid-write, the diffusers load."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

import training as T  # noqa: E402
from training.checkpoint import (CHECKPOINT_FORMAT, find_latest, load_checkpoint, save_checkpoint,  # noqa: E402
                                 verify_checkpoint)
from training.distributed import seed_everything  # noqa: E402
from training.model import (adapter_params, adapter_state_dict, add_lora_adapters, full_tensor,  # noqa: E402
                            shard_transformer)
from training.optim import build_optimizer  # noqa: E402
from training.resume import prepare_resume  # noqa: E402
from training.resume_policy import sha256_file  # noqa: E402
from models import lora  # noqa: E402
from _training_helpers import (CONFIG, fresh_run, load_state, save_state, train_step, full_params,  # noqa: E402
                               make_model)

pytestmark = pytest.mark.usefixtures("one_process_group")  # a 1-process gloo group (tests/conftest.py)


# ---------------------------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------------------------


def test_exact_resume(trained_checkpoint):
    root, data, losses_45, final_default, final_opt = trained_checkpoint
    path = find_latest(root)
    assert path == os.path.join(root, "step_00000003")
    model, _, opt, stepper, sampler = fresh_run(lora_seed=99)  # different LoRA init: the load must overwrite it
    seed_everything(1234)  # different RNG state: the load must restore it
    state = load_state(path, model, opt, sampler)
    stepper.load_state_dict(state["trainer_state"]["stepper"])
    assert state["step"] == 3 and sampler.state_dict()["step_in_epoch"] == 3
    resumed = [train_step(model, opt, stepper, sampler, data) for _ in range(2)]
    assert resumed == losses_45  # bit-exact next-step losses
    now = full_params(model, "default")
    assert all(torch.equal(now[k], final_default[k]) for k in now)
    opt_state = opt.state_dict()["state"]
    for i, s in final_opt["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(full_tensor(opt_state[i][key]), full_tensor(s[key])), (i, key)



def test_resume_without_rng_restore_would_differ(trained_checkpoint):
    """Control for test_exact_resume: the RNG restore is what makes it exact (the test can fail)."""
    root, data, losses_45, _, _ = trained_checkpoint
    model, _, opt, stepper, sampler = fresh_run(lora_seed=99)
    load_state(find_latest(root), model, opt, sampler)
    seed_everything(1234)  # clobber the restored RNG
    assert train_step(model, opt, stepper, sampler, data) != losses_45[0]



def test_checkpoint_layout_and_atomic_save(trained_checkpoint, monkeypatch):
    root, *_ = trained_checkpoint
    path = find_latest(root)
    files = set(json.load(open(os.path.join(path, "COMPLETE")))["files"])
    assert files == {"adapters/default/adapter_config.json", "adapters/default/adapter_model.safetensors",
                     "adapters/old/adapter_config.json", "adapters/old/adapter_model.safetensors",
                     "optimizer.pt", "rng.pt", "trainer_state.json"}
    state = json.load(open(os.path.join(path, "trainer_state.json")))
    assert state["step"] == 3 and state["world_size"] == 1
    optim = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)  # plain tensors and containers
    assert len(torch.load(os.path.join(path, "rng.pt"), weights_only=True)) == 1
    assert sorted(optim["state"]) == sorted(n for n, _ in make_model(shard=False)[0].named_parameters()
                                            if ".lora_" in n and ".default." in n)
    assert set(optim["state"]["blocks.0.to_q.lora_A.default.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert optim["param_groups"][0]["lr"] == 1e-2
    assert set(state["versions"]) >= {"torch", "diffusers", "transformers", "peft", "python"}
    assert re.fullmatch(r"[0-9a-f]{64}", state["config_fingerprint"])
    assert state["fingerprinted_config"] == {"lora_rank": 3, "lr": 0.01, "seed": 0}  # a path may move: not here
    assert state["logged_config"] == {"model_path": "/tiny", "total_training_steps": 5}
    manifest = json.load(open(os.path.join(path, "COMPLETE")))
    entry = manifest["files"]["optimizer.pt"]
    assert manifest["format"] == CHECKPOINT_FORMAT
    assert entry["size"] == os.path.getsize(os.path.join(path, "optimizer.pt"))
    assert entry["sha256"] == hashlib.sha256(open(os.path.join(path, "optimizer.pt"), "rb").read()).hexdigest()
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]
    # a crash in the middle of a save leaves only a temp dir; "latest" still points at the complete step 3
    model, cfg, opt, stepper, sampler = fresh_run(lora_seed=1)
    real_save = torch.save

    def crash(obj, f, *a, **k):
        if str(f).endswith("rng.pt"):
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        save_state(root, 7, model, cfg, opt, stepper, sampler)
    monkeypatch.setattr(torch, "save", real_save)
    assert not os.path.exists(os.path.join(root, "step_00000007"))
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]  # the failed save cleaned its temp dir
    assert find_latest(root) == path
    # a process killed mid-save leaves a temp dir behind: ignored
    shutil.copytree(path, os.path.join(root, ".tmp-step_00000007-deadbeef"))
    assert find_latest(root) == path
    # keep_last prunes older complete checkpoints only once the new one is in place; re-saving a step replaces it
    save_state(root, 8, model, cfg, opt, stepper, sampler)
    save_checkpoint(root, 9, transformer=model, optimizer=opt, lora_config=cfg, config=CONFIG, sampler=sampler,
                    adapter_names=("default", "old"), keep_last=2)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000008", "step_00000009"]
    save_state(root, 9, model, cfg, opt, stepper, sampler)
    assert find_latest(root).endswith("step_00000009")
    verify_checkpoint(find_latest(root))
    # a save that cannot write keeps the newest checkpoint even with keep_last=1
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(root, 10, transformer=model, optimizer=opt, lora_config=cfg, config=CONFIG,
                        sampler=sampler, adapter_names=("default", "old"), keep_last=1)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000008", "step_00000009"]



def test_config_mismatch_is_refused_with_key_names(trained_checkpoint):
    root, *_ = trained_checkpoint
    model, _, opt, _, sampler = fresh_run(lora_seed=1)
    bad = dict(CONFIG, lr=2e-2, lora_rank=4, new_flag=True)
    with pytest.raises(T.CheckpointError) as e:
        load_state(find_latest(root), model, opt, sampler, config=bad)
    msg = str(e.value)
    assert "lr: checkpoint=0.01 now=0.02" in msg and "lora_rank: checkpoint=3 now=4" in msg
    assert "new_flag: checkpoint='<absent>' now=True" in msg and "seed" not in msg
    # keys that may change on resume (e.g. total_training_steps) do not block it
    load_state(find_latest(root), model, opt, sampler, config=dict(CONFIG, total_training_steps=500))



def test_partial_and_corrupt_checkpoints_fail_clearly(trained_checkpoint):
    root, *_ = trained_checkpoint
    good = find_latest(root)

    def fresh():
        model, _, opt, _, sampler = fresh_run(lora_seed=1)
        return model, opt, sampler

    # a newer step directory without the marker is skipped by find_latest (with a warning) and refused by load
    partial = os.path.join(root, "step_00000004")
    shutil.copytree(good, partial)
    os.remove(os.path.join(partial, "COMPLETE"))
    with pytest.warns(UserWarning, match="step_00000004"):
        assert find_latest(root) == good
    with pytest.raises(T.CheckpointError, match="partial"):
        load_state(partial, *fresh())
    # a truncated file is caught by the manifest
    trunc = os.path.join(root, "step_00000005")
    shutil.copytree(good, trunc)
    weights = os.path.join(trunc, "adapters", "old", "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(T.CheckpointError, match="corrupt.*adapter_model.safetensors"):
        load_state(trunc, *fresh())
    # same size but garbage bytes: caught by the sha256 manifest; without it the reader's error names the path
    garbage = os.path.join(root, "step_00000006")
    shutil.copytree(good, garbage)
    weights = os.path.join(garbage, "adapters", "default", "adapter_model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "wb") as f:
        f.write(b"\xff" * size)
    with pytest.raises(T.CheckpointError, match="sha256"):
        load_state(garbage, *fresh())
    model, opt, sampler = fresh()
    with pytest.raises(T.CheckpointError, match="cannot read LoRA adapter"):
        load_checkpoint(garbage, transformer=model, optimizer=opt, config=CONFIG, sampler=sampler,
                        adapter_names=("default", "old"), verify_sha256=False)
    # only incomplete step directories: refuse instead of silently starting fresh
    lonely = os.path.join(root, "..", "only_partial")
    os.makedirs(lonely)
    shutil.copytree(partial, os.path.join(lonely, "step_00000004"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(T.CheckpointError, match="none is complete"):
            find_latest(lonely)
    assert find_latest(str(os.path.join(root, "..", "does_not_exist"))) is None



def test_checkpoint_adapter_loads_in_diffusers(tmp_path):
    """The saved adapter directory is what diffusers' `load_lora_weights` (Qwen-Image pipeline mixin) loads:
    every tensor binds, values equal, and the LoRA scale alpha/r survives (diffusers would assume alpha = r)."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.loaders import QwenImageLoraLoaderMixin
    from peft.tuners.lora import LoraLayer

    kw = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
              num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4))
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(**kw)
    cfg = add_lora_adapters(transformer, target_modules=("to_q", "to_k", "img_mlp.net.2"), rank=4, alpha=8.0,
                            adapter_names=("default", "old"), block_prefixes=("transformer_blocks",))
    with torch.no_grad():
        for _, p in adapter_params(transformer, "default"):
            p.normal_()
    shard_transformer(transformer, ("transformer_blocks",))
    opt = build_optimizer(transformer, lr=1e-3)
    path = save_checkpoint(str(tmp_path), 1, transformer=transformer, optimizer=opt, lora_config=cfg,
                           config={"x": 1}, adapter_names=("default", "old"))
    saved = adapter_state_dict(transformer, "default")

    class Pipe(QwenImageLoraLoaderMixin):  # the mixin QwenImagePipeline uses, without text encoder / VAE
        def __init__(self, transformer):
            self.transformer = transformer
            self.hf_device_map = None
            self.components = {"transformer": transformer}

    torch.manual_seed(0)
    fresh = QwenImageTransformer2DModel(**kw)
    Pipe(fresh).load_lora_weights(os.path.join(path, "adapters", "default"), adapter_name="ckpt")
    loaded = {re.sub(r"\.ckpt\.", ".", n): p for n, p in fresh.named_parameters() if ".lora_" in n}
    assert set(loaded) == set(saved) and len(saved) == 2 * 3 * 2
    assert all(torch.equal(loaded[k].detach(), saved[k]) for k in saved)
    scalings = {m.scaling["ckpt"] for m in fresh.modules() if isinstance(m, LoraLayer)}
    assert scalings == {2.0}
    # and models/lora.py (the rollout engine's loader) reads the same directory, binding every module
    torch.manual_seed(0)
    engine_side = QwenImageTransformer2DModel(**kw)
    assert lora.import_adapter(engine_side, os.path.join(path, "adapters", "old"), adapter_name="old") == 6
    old_saved = adapter_state_dict(transformer, "old")
    old_loaded = {re.sub(r"\.old\.", ".", n): p for n, p in engine_side.named_parameters() if ".lora_" in n}
    assert all(torch.equal(old_loaded[k].detach(), old_saved[k]) for k in old_saved)


# ---------------------------------------------------------------------------------------------------------------
# reliability: untrusted pickles, killed saves, non-finite weights
# ---------------------------------------------------------------------------------------------------------------


def _rewrite_manifest_entry(path: str, rel: str) -> None:
    """Make the COMPLETE manifest agree with a file replaced on purpose (an attacker controls the whole folder)."""
    marker_path = os.path.join(path, "COMPLETE")
    marker = json.load(open(marker_path))
    full = os.path.join(path, rel)
    marker["files"][rel] = {"size": os.path.getsize(full), "sha256": sha256_file(full)}
    json.dump(marker, open(marker_path, "w"))



class _CreatesAFile:
    """A pickle payload: unpickling it calls open(path, "w"), i.e. runs code of the file's author."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))



def test_malicious_pickle_in_a_checkpoint_is_refused_and_never_runs(trained_checkpoint, tmp_path):
    root, *_ = trained_checkpoint
    path = find_latest(root)
    evidence = str(tmp_path / "payload_ran")
    torch.save({"state": {"x": _CreatesAFile(evidence)}, "param_groups": []}, os.path.join(path, "optimizer.pt"))
    _rewrite_manifest_entry(path, "optimizer.pt")  # integrity alone cannot catch it: the manifest matches
    verify_checkpoint(path)
    model, _, opt, _, sampler = fresh_run(lora_seed=1)
    with pytest.raises(T.CheckpointError, match=r"optimizer\.pt holds pickled objects.*weights_only"):
        load_state(path, model, opt, sampler)
    assert not os.path.exists(evidence)  # the payload did not run
    # prepare_resume (model-free, before a trainer loads its model) refuses it already
    with pytest.raises(T.CheckpointError, match=r"optimizer\.pt holds pickled objects.*weights_only"):
        prepare_resume("auto", root, CONFIG, adapter_names=("default", "old"))
    assert not os.path.exists(evidence)
    torch.load(os.path.join(path, "optimizer.pt"), weights_only=False)  # control: a plain unpickle runs it
    assert os.path.exists(evidence)



_KILLED_SAVE = r"""
import os, sys, time
import torch
from training.checkpoint import save_checkpoint
from training.model import add_lora_adapters
from training.optim import build_optimizer
from _tiny_lora import BLOCK_PREFIXES, TARGETS, TinyFlowTransformer

root, phase = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = TinyFlowTransformer()
cfg = add_lora_adapters(model, target_modules=TARGETS, rank=3, alpha=6.0, adapter_names=("default",),
                        block_prefixes=BLOCK_PREFIXES)
opt = build_optimizer(model, lr=1e-2)
save = lambda step: save_checkpoint(root, step, transformer=model, optimizer=opt, lora_config=cfg,
                                    config={"lr": 1e-2})
if phase == "new":  # killed while writing optimizer.pt of a new step
    save(1)
    real = torch.save
    def hang(obj, f, *a, **k):
        if str(f).endswith("optimizer.pt"):
            open(f, "wb").write(b"partial")
            print("killing time", flush=True)
            time.sleep(600)
        return real(obj, f, *a, **k)
    torch.save = hang
    save(2)
else:  # a re-save of step 1 killed between moving the old copy out and moving the new one in
    real = os.rename
    def hang(src, dst):
        real(src, dst)
        if os.path.basename(dst).startswith(".trash-"):
            print("killing time", flush=True)
            time.sleep(600)
    os.rename = hang
    save(1)
"""



def _run_until_killed(root: str, phase: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, root, phase], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "killing time"
        proc.kill()  # SIGKILL: no cleanup of any kind runs
    finally:
        proc.wait(timeout=60)



@pytest.mark.slow  # two real processes killed mid-save (about a minute on 2 cores)
def test_a_killed_save_leaves_the_newest_checkpoint_and_start_up_tidies(tmp_path):
    root = str(tmp_path / "checkpoints")
    _run_until_killed(root, "new")
    assert [n for n in os.listdir(root) if n.startswith(".tmp-step_00000002")]
    assert find_latest(root).endswith("step_00000001")
    _run_until_killed(root, "resave")
    assert not os.path.exists(os.path.join(root, "step_00000001"))  # mid-swap: only the .trash- copy holds it
    assert [n for n in os.listdir(root) if n.startswith(".trash-step_00000001")]
    plan = prepare_resume("auto", root, {"lr": 1e-2})
    text = "\n".join(plan.messages)
    assert "removed" in text and ".tmp-step_00000002" in text and "restored" in text
    assert plan.path == os.path.join(root, "step_00000001") and plan.step == 1
    assert sorted(os.listdir(root)) == ["step_00000001"]  # temp folders gone, the newest checkpoint back
    verify_checkpoint(plan.path)



def test_a_checkpoint_is_never_written_from_nonfinite_weights(tmp_path):
    model, cfg, opt, stepper, sampler = fresh_run(lora_seed=1)
    root = str(tmp_path / "ckpt")
    save_state(root, 1, model, cfg, opt, stepper, sampler)
    with torch.no_grad():
        adapter_params(model, "default")[0][1].to_local().fill_(float("nan"))  # a DTensor shard (make_model shards)
    with pytest.raises(T.CheckpointError, match="NaN/inf"):
        save_state(root, 2, model, cfg, opt, stepper, sampler)
    assert sorted(os.listdir(root)) == ["step_00000001"]
