"""Issue 29's adapter reads, through the real command lines: every adapter read verifies what can be verified and
says what could not. An adapter folder inside a checkpoint is checked against that checkpoint's COMPLETE manifest
(and refused without one) by evaluate.py, sample.py, export_adapter.py and --init_adapter alike; a standalone PEFT
folder is read with one line saying it is unverified; a refused checkpoint adapter names the previous complete
checkpoint that verifies, before any model loads (a resume too); evaluate.py takes its settings from the run's
verified checkpoint and refuses an edited run_metadata.json that disagrees with it.

The fast tests use checkpoints written by `training.write_checkpoint` (no model); the slow ones a real 2-step
train_nft.py run on the tiny Qwen-Image."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from training.checkpoint import MARKER, GatheredState, write_checkpoint
from models import lora
from test_trainers import REPO, cli, run_trainer
from trainer_runs import trainer_lines

MODULE = "transformer_blocks.0.attn.to_q"
WEIGHTS = os.path.join("adapters", "default", lora.ADAPTER_WEIGHTS)


def write_step(root: str, step: int, seed: int) -> str:
    """A complete checkpoint `<root>/step_<step>` (adapter `default` of one module, COMPLETE manifest) as the
    trainers write it (`training.write_checkpoint`), without a model."""
    torch.manual_seed(seed)
    adapter = {f"{MODULE}.lora_A.weight": torch.randn(4, 16) * 0.05,
               f"{MODULE}.lora_B.weight": torch.randn(16, 4) * 0.05}
    gathered = GatheredState(step=step, adapters={"default": adapter}, optim_state={"state": {}, "param_groups": []},
                             rng_states=[], trainer_json={"step": step, "adapters": ["default"]},
                             lora_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q"]))
    return write_checkpoint(root, gathered)


@pytest.fixture
def two_steps(tmp_path) -> tuple[str, str]:
    """(step 1, step 2): two complete checkpoints of one run folder."""
    root = str(tmp_path / "run" / "checkpoints")
    return write_step(root, 1, seed=1), write_step(root, 2, seed=2)


def scale_lora_b(adapter_dir: str, factor: float) -> None:
    """Every lora_B of the adapter times `factor` (finite, same shapes: what a manifest-less copy cannot reveal)."""
    path = os.path.join(adapter_dir, lora.ADAPTER_WEIGHTS)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    save_file({k: v * factor if ".lora_B." in k else v for k, v in tensors.items()}, path, metadata=metadata)


def reforge_zero_byte_adapter(ckpt: str) -> None:
    """Empty the checkpoint's default adapter weights and re-forge its COMPLETE entry to match (size 0, the sha256
    of no bytes): the manifest check passes, only reading the file can tell."""
    open(os.path.join(ckpt, WEIGHTS), "wb").close()
    with open(os.path.join(ckpt, MARKER), encoding="utf-8") as f:
        marker = json.load(f)
    marker["files"][WEIGHTS] = {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    with open(os.path.join(ckpt, MARKER), "w", encoding="utf-8") as f:
        json.dump(marker, f)


def run_script(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "scripts", script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def tool_argv(script: str, adapter: str, model: str, out: str) -> list[str]:
    """The command line of `script` reading `adapter` (sample.py / evaluate.py would load `model` next)."""
    return {"evaluate.py": ["--model_path", model, "--val_files", "unused.parquet", "--adapters", "base", adapter,
                            "--output_dir", out],
            "sample.py": ["--model_path", model, "--prompt", "a cat", "--adapter", adapter, "--output_dir", out],
            "export_adapter.py": [adapter, out]}[script]


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused tool printed (no traceback)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]  # argparse's usage lines may come before it
    assert "Traceback" not in proc.stderr and len(errors) == 1 and lines[-1] == errors[0], proc.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("script", ["evaluate.py", "sample.py", "export_adapter.py"])
def test_an_adapter_folder_inside_a_checkpoint_without_its_manifest_is_refused(script, two_steps, tmp_path,
                                                                                tiny_models):
    step1, step2 = two_steps
    os.remove(os.path.join(step2, MARKER))  # a hand copy / partial checkpoint: nothing to verify against
    folder = os.path.join(step2, "adapters", "default")
    scale_lora_b(folder, 1000.0)  # finite, and it would have ranked best
    out = str(tmp_path / "out")
    line = one_error_line(run_script(script, *tool_argv(script, folder, os.path.join(tiny_models, "qwen_image"), out)))
    assert folder in line and "COMPLETE" in line, line
    assert f"{step1}:default" in line, line  # the previous complete checkpoint, which verifies
    assert not os.path.exists(out)


def test_init_adapter_inside_a_checkpoint_without_its_manifest_is_refused_at_parse_time(two_steps, tmp_path):
    _, step2 = two_steps
    os.remove(os.path.join(step2, MARKER))
    folder = os.path.join(step2, "adapters", "default")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "train_nft.py"), "--init_adapter", folder,
                           "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "argument --init_adapter:" in proc.stderr and folder in proc.stderr and "COMPLETE" in proc.stderr, \
        proc.stderr[-3000:]


def test_a_bit_flipped_checkpoint_adapter_is_refused_by_export_naming_the_previous_checkpoint(two_steps, tmp_path):
    step1, step2 = two_steps
    folder = os.path.join(step2, "adapters", "default")
    size = os.path.getsize(os.path.join(folder, lora.ADAPTER_WEIGHTS))
    scale_lora_b(folder, -1.0)
    assert os.path.getsize(os.path.join(folder, lora.ADAPTER_WEIGHTS)) == size  # same size, other bytes
    for source in (step2 + ":default", os.path.join(step2, "adapters", "default")):
        line = one_error_line(run_script("export_adapter.py", source, tmp_path / "out"))
        assert "do not match the sha256 in its COMPLETE manifest" in line and f"{step1}:default" in line, line
    assert not (tmp_path / "out").exists()


def test_a_standalone_adapter_is_read_with_one_line_saying_it_is_unverified(two_steps, tmp_path):
    step1, _ = two_steps
    plain = str(tmp_path / "plain")
    shutil.copytree(os.path.join(step1, "adapters", "default"), plain)
    proc = run_script("export_adapter.py", plain, tmp_path / "a")
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "not verified" in line]
    assert len(said) == 1 and plain in said[0] and "no checksum" in said[0], proc.stdout + proc.stderr
    proc = run_script("export_adapter.py", step1 + ":default", tmp_path / "b")  # verified: nothing to say
    assert proc.returncode == 0 and "not verified" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", ["evaluate.py", "export_adapter.py"])
def test_a_zero_byte_adapter_with_a_reforged_manifest_names_the_previous_checkpoint(script, two_steps, tmp_path,
                                                                                    tiny_models):
    step1, step2 = two_steps
    reforge_zero_byte_adapter(step2)
    out = str(tmp_path / "out")
    argv = tool_argv(script, step2 + ":default", os.path.join(tiny_models, "qwen_image"), out)
    line = one_error_line(run_script(script, *argv))
    assert WEIGHTS in line and "not a readable safetensors file" in line and f"{step1}:default" in line, line
    assert not os.path.exists(out)


# ---------------------------------------------------------------------------------------------------------------
# a real run: the resume path and evaluate.py --run_dir
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tiny_models, tmp_path_factory):
    """A finished 2-step train_nft.py run (tiny Qwen-Image, one rank) with checkpoints at steps 1 and 2."""
    from data_prep.make_demo_data import make_demo_data

    root = tmp_path_factory.mktemp("finished_run")
    make_demo_data(root / "data", model="qwen_image")
    out = root / "run"
    run_trainer("train_nft.py", cli(model_path=os.path.join(tiny_models, "qwen_image"),
                                    train_files=root / "data" / "train.parquet",
                                    val_files=root / "data" / "test.parquet", save_freq=1, total_training_steps=2,
                                    output_dir=out), nproc=1)
    return out


def copy_run(run, tmp_path) -> str:
    """A copy of the finished run to tamper with."""
    dest = str(tmp_path / "run")
    shutil.copytree(run, dest)
    return dest


@pytest.mark.slow  # the module fixture is a whole trainer run
def test_a_resume_refuses_a_zero_byte_adapter_before_the_model_and_names_the_previous_checkpoint(finished_run,
                                                                                                 tmp_path,
                                                                                                 tiny_models):
    run = copy_run(finished_run, tmp_path)
    reforge_zero_byte_adapter(os.path.join(run, "checkpoints", "step_00000002"))
    meta = json.load(open(os.path.join(run, "run_metadata.json")))["config"]
    proc = run_trainer("train_nft.py", cli(model_path=meta["model_path"], train_files=meta["train_files"],
                                           val_files=meta["val_files"], save_freq=1, total_training_steps=3,
                                           resume="auto", output_dir=run), nproc=1, expect_ok=False)
    lines = trainer_lines(proc)
    assert proc.returncode != 0 and not any("loading the transformer" in line for line in lines), lines
    errors = [line for line in lines if WEIGHTS in line]
    assert len(errors) == 1 and "not a readable safetensors file" in errors[0], lines
    assert f"--resume {os.path.join(run, 'checkpoints', 'step_00000001')}" in errors[0], errors[0]


def edit_run_metadata(run: str, **values) -> None:
    path = os.path.join(run, "run_metadata.json")
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    meta["config"].update(values)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(meta, f)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["evaluate.py", "sample.py"])
def test_an_edited_run_metadata_is_refused_against_the_checkpoints_settings(script, finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    edit_run_metadata(run, height=128, cfg_scale=7.5)  # the checkpoint says 64 and 1.0 (train_nft.py on Qwen)
    ckpt = os.path.join(run, "checkpoints", "step_00000002")
    out = str(tmp_path / "out")
    argv = {"evaluate.py": ["--run_dir", run, "--adapters", ckpt + ":default", "--output_dir", out],
            "sample.py": ["--run_dir", run, "--adapter", ckpt + ":default", "--prompt", "a cat", "--output_dir",
                          out]}[script]
    line = one_error_line(run_script(script, *argv))
    assert os.path.join(run, "run_metadata.json") in line and ckpt in line, line
    assert "height: 128 in run_metadata.json, 64 in" in line and "cfg_scale: 7.5 in run_metadata.json, 1.0 in" \
        in line, line
    assert not os.path.exists(out)


@pytest.mark.slow
def test_evaluate_says_where_its_settings_come_from(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path)
    ckpt = os.path.join(run, "checkpoints", "step_00000002")
    proc = run_script("evaluate.py", "--run_dir", run, "--adapters", ckpt + ":default", "--val_max_samples", "1",
                      "--output_dir", tmp_path / "eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"settings: from {ckpt}/trainer_state.json (verified by its COMPLETE manifest)" in proc.stdout, proc.stdout
    settings = json.load(open(tmp_path / "eval" / "metrics.json"))["settings"]
    assert settings["height"] == 64 and settings["val_max_samples"] == 1  # the checkpoint's, and an explicit flag
    shutil.rmtree(os.path.join(run, "checkpoints"))  # no checkpoint: the settings are the run_metadata.json's
    proc = run_script("evaluate.py", "--run_dir", run, "--adapters", "base", "--val_max_samples", "1",
                      "--output_dir", tmp_path / "eval2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"settings: from {run}/run_metadata.json, not verified (" in proc.stdout, proc.stdout
