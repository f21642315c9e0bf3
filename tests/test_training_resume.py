"""training/resume_policy.py and training/resume.py: which flags a resume may change, the config and content
fingerprints that check it, and `prepare_resume` (integrity with the previous checkpoint named, --resume never)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import training as T
from training.checkpoint import find_latest, load_checkpoint
from training.resume import prepare_resume
from training.resume_policy import (RESUME_BLOCKING, RESUME_LOGGED, RESUME_PATHS, config_fingerprint,
                                    content_fingerprints)
from _training_helpers import CONFIG, fresh_run, save_state, train_step

pytestmark = pytest.mark.usefixtures("one_process_group")  # a 1-process gloo group (tests/conftest.py)


# ---------------------------------------------------------------------------------------------------------------
# the resume policy: every flag classified, the config fingerprint, moved paths and changed content
# ---------------------------------------------------------------------------------------------------------------


def test_every_trainer_flag_has_a_resume_class():
    """A new flag must be classified (blocking / logged / path) in training/resume_policy.py."""
    import train_dppo
    import train_nft

    flags = set()
    for trainer in (train_nft, train_dppo):
        flags |= set(vars(trainer.parse_args(["--model_path", "m", "--train_files", "t"])))
    flags.add("cfg_scale")  # no flag: setup_run resolves it (training.resolve_cfg_scale) into the run's config
    classes = (RESUME_BLOCKING, RESUME_LOGGED, set(RESUME_PATHS))
    unclassified = sorted(f for f in flags if not any(f in c for c in classes))
    assert not unclassified, f"classify in training/resume_policy.py (RESUME_BLOCKING / LOGGED / PATHS): {unclassified}"
    assert not (RESUME_BLOCKING & RESUME_LOGGED)
    assert not set(RESUME_PATHS) & (RESUME_BLOCKING | RESUME_LOGGED)
    assert not sorted(set().union(*classes) - flags), "classified names that are no flag of either trainer"



def test_a_checkpoint_of_a_removed_operational_flag_still_resumes():
    """--loss_metrics (logged, never fingerprinted) is gone: a checkpoint whose config holds it resumes, the key
    reported as changed; a removed blocking key would be refused (the fingerprint covers it)."""
    from training.checkpoint import CheckpointError, check_resume_config
    from training.resume_policy import RESUME_MUTABLE_KEYS, logged_values

    now = {"lr": 1e-3, "seed": 1, "save_freq": 5}
    old = {**now, "loss_metrics": "device"}
    ignore = set(RESUME_MUTABLE_KEYS) | {"loss_metrics"}  # the classification the old checkpoint was written under
    digest, values = config_fingerprint(old, ignore)
    state = {"world_size": 1, "adapters": ["default"], "config_fingerprint": digest, "fingerprinted_config": values,
             "logged_config": logged_values(old, ignore)}
    assert "loss_metrics" not in RESUME_MUTABLE_KEYS
    lines = check_resume_config("ckpt", state, now, adapter_names=["default"])
    assert lines == ["changed since the checkpoint (operational flags and paths, allowed):\n  "
                     "loss_metrics: checkpoint='device' now='<absent>'"]
    with pytest.raises(CheckpointError, match="seed"):
        check_resume_config("ckpt", state, {"lr": 1e-3, "save_freq": 5}, adapter_names=["default"])


def test_config_fingerprint():
    h1, v1 = config_fingerprint({"a": 1, "b": (1, 2), "total_training_steps": 3})
    h2, _ = config_fingerprint({"b": [1, 2], "a": 1, "total_training_steps": 300})
    h3, _ = config_fingerprint({"a": 2, "b": (1, 2)})
    assert h1 == h2 != h3 and v1 == {"a": 1, "b": [1, 2]}



def test_resume_policy_moved_paths_operational_flags_and_changed_content(tmp_path):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"rows" * 1000)
    model_dir = tmp_path / "model"
    (model_dir / "transformer").mkdir(parents=True)
    (model_dir / "transformer" / "config.json").write_text('{"num_layers": 2}')
    weights = model_dir / "transformer" / "weights.safetensors"
    weights.write_bytes(bytes(range(256)) * (12 << 10))  # 3 MiB: fingerprinted by its first and last MiB
    flags = dict(lr=1e-2, seed=0, train_files=str(data), model_path=str(model_dir), genrm_url="http://a:1",
                 rollout_max_batch_size=16, total_training_steps=5)

    def config(**changes):
        merged = {**flags, **changes}
        return {**merged, **content_fingerprints(merged)}

    model, cfg, opt, stepper, sampler = fresh_run(lora_seed=1)
    root = str(tmp_path / "run" / "checkpoints")
    save_state(root, 1, model, cfg, opt, stepper, sampler, config=config())
    # the run folder moved (same bytes elsewhere) and operational flags changed: allowed, each change printed
    moved = tmp_path / "elsewhere"
    shutil.copytree(model_dir, moved / "model")
    shutil.copy(data, moved / "train.parquet")
    plan = prepare_resume("auto", root, config(train_files=str(moved / "train.parquet"),
                                               model_path=str(moved / "model"), genrm_url="http://b:2",
                                               rollout_max_batch_size=4, total_training_steps=9),
                          adapter_names=("default", "old"))
    text = "\n".join(plan.messages)
    assert plan.step == 1 and "operational" in text
    for key in ("genrm_url", "rollout_max_batch_size", "total_training_steps", "train_files", "model_path"):
        assert f"\n  {key}:" in text, key
    # different data under the same name (same size) or another model's weights: refused, naming the content key
    data.write_bytes(b"ROWS" * 1000)
    with pytest.raises(T.CheckpointError, match=r"train_files@content: checkpoint='sha256:"):
        prepare_resume("auto", root, config(), adapter_names=("default", "old"))
    data.write_bytes(b"rows" * 1000)
    with open(weights, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"x" * 10)
    with pytest.raises(T.CheckpointError, match=r"model_path@content"):
        prepare_resume("auto", root, config(), adapter_names=("default", "old"))
    # a blocking flag: refused with the fix named; --resume_force turns it into a warning naming the key
    with pytest.raises(T.CheckpointError, match=r"lr: checkpoint=0\.01 now=0\.1[\s\S]*--resume_force"):
        prepare_resume("auto", root, config(lr=0.1, model_path=str(moved / "model")),
                       adapter_names=("default", "old"))
    plan = prepare_resume("auto", root, config(lr=0.1, model_path=str(moved / "model")),
                          adapter_names=("default", "old"), force=True)
    assert any(m.startswith("WARNING --resume_force") and "lr: checkpoint=0.01 now=0.1" in m for m in plan.messages)


# ---------------------------------------------------------------------------------------------------------------
# prepare_resume: a corrupt newest checkpoint names the previous one, --resume never moves earlier runs aside
# ---------------------------------------------------------------------------------------------------------------


def test_same_size_corruption_is_caught_and_names_the_previous_checkpoint(tmp_path):
    torch.manual_seed(0)
    data = torch.randn(12, 5, 4)
    model, cfg, opt, stepper, sampler = fresh_run(lora_seed=1)
    root = str(tmp_path / "checkpoints")
    for step in (1, 2):
        train_step(model, opt, stepper, sampler, data)
        save_state(root, step * 2, model, cfg, opt, stepper, sampler)
    newest = os.path.join(root, "step_00000004")
    weights = os.path.join(newest, "adapters", "default", "adapter_model.safetensors")
    with open(weights, "r+b") as f:  # one flipped byte in the tensor data: same size, still a valid file
        f.seek(os.path.getsize(weights) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    # without the sha256 check this loads silently (sizes match, the adapter parses): the fault the manifest catches
    other, _, other_opt, _, _ = fresh_run(lora_seed=2)
    load_checkpoint(newest, transformer=other, optimizer=other_opt, config=CONFIG, adapter_names=("default", "old"),
                    verify_sha256=False)
    with pytest.raises(T.CheckpointError) as e:
        prepare_resume("auto", root, CONFIG, adapter_names=("default", "old"))
    previous = os.path.join(root, "step_00000002")
    msg = str(e.value)
    assert "step_00000004 is corrupt" in msg and "adapter_model.safetensors" in msg and "sha256" in msg
    assert f"--resume {previous}" in msg
    # following the advice: the corrupt newest is moved aside (kept), the run continues from step 2
    plan = prepare_resume(previous, root, CONFIG, adapter_names=("default", "old"))
    assert (plan.path, plan.step, plan.purge_step) == (previous, 2, 3)
    moved = [m for m in plan.messages if "step_00000004" in m]
    assert moved and os.path.isdir(os.path.join(moved[0].split(" aside to ")[1], "step_00000004"))
    assert find_latest(root) == previous
    with pytest.raises(T.CheckpointError) as e:  # a --resume folder that does not exist names the ones that do
        prepare_resume(os.path.join(root, "step_00000003"), root, CONFIG, adapter_names=("default", "old"))
    assert "no such checkpoint directory" in str(e.value) and str([previous]) in str(e.value)



def test_resume_never_moves_earlier_checkpoints_and_logs_aside(trained_checkpoint, tmp_path):
    root, *_ = trained_checkpoint
    tensorboard = os.path.join(os.path.dirname(root), "tensorboard")
    os.makedirs(tensorboard)
    plan = prepare_resume("never", root, CONFIG, set_aside_with_checkpoints=(tensorboard,))
    assert plan.path is None and plan.step == 0 and plan.purge_step == 0
    dest = plan.messages[-1].split(" aside to ")[1].split(" (")[0]
    assert os.path.isdir(os.path.join(dest, os.path.basename(root), "step_00000003"))
    assert os.path.isdir(os.path.join(dest, "tensorboard")) and not os.path.exists(root)
    assert prepare_resume("never", root, CONFIG).messages == ()  # nothing left to move
