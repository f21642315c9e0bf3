"""scripts/sample.py, scripts/evaluate.py and scripts/compare_runs.py on the tiny checkpoints, run as the README's
"After training" commands on a real DiffusionNFT run, and checked against that run's in-training validation.

One NFT run (torchrun, 2 ranks, tiny Qwen-Image, 1 step) started from an --init_adapter, validating with
--val_adapter default, a cosine lr schedule and EMA old-policy refresh: its log file, its validation grid (all
ranks' samples), its checkpoint (the old adapter started as a copy of the init adapter, the schedule's state), then
the README commands on it: evaluate.py must reproduce the in-training val-core number for `:default` exactly (and
give another one for `:old`), and sample.py under torchrun must draw the same images as evaluate.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from test_trainers import cli, run_trainer, scalars, val_grid  # noqa: E402

# one pytest-xdist worker runs this module (pytest.ini: --dist loadgroup): its module fixtures are costly
pytestmark = pytest.mark.xdist_group("test_sample_evaluate")

KEY = "val-core/jpeg_compressibility/reward/mean@1"


def make_adapter(model_path: str, out_dir: str, *, rank: int = 4, alpha: float = 8.0, seed: int = 0) -> str:
    """A PEFT folder with random non-zero A and B for the model's default LoRA targets (so it changes outputs)."""
    from models import load_model, lora

    model = load_model(model_path, transformer_only=True)
    torch.manual_seed(seed)
    lora.add_lora(model, rank=rank, alpha=alpha)
    with torch.no_grad():
        for layer in lora.lora_layers(model.transformer).values():
            layer.lora_A["default"].weight.normal_(0, 0.3)
            layer.lora_B["default"].weight.normal_(0, 0.3)
    lora.export_adapter(model.transformer, out_dir)
    return out_dir


def readme_commands() -> list[str]:
    """The commands of the README's "After training" bash block (comments and blank lines dropped)."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = text.split("## After training", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("  #", 1)[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def nft_run(tiny_models, tmp_path_factory):
    from data_prep.make_demo_data import make_demo_data

    root = tmp_path_factory.mktemp("after_training")
    make_demo_data(root / "data", model="qwen_image")
    model_path = os.path.join(tiny_models, "qwen_image")
    init = make_adapter(model_path, str(root / "init_adapter"))
    out = root / "runs" / "nft"
    proc = run_trainer("train_nft.py", cli(
        model_path=model_path, train_files=root / "data" / "train.parquet", val_files=root / "data" / "test.parquet",
        val_max_samples=4, num_val_images=4, lr=1e-2, lr_scheduler="cosine", old_policy_decay=0.5,
        val_adapter="default", init_adapter=init, output_dir=out), nproc=1)
    return {"root": root, "out": out, "model_path": model_path, "init": init, "proc": proc}


@pytest.mark.slow  # the module fixture `nft_run` is a whole trainer run
def test_nft_run_log_grid_and_checkpoint(nft_run):
    from training.console import LOG_FILE
    from models import lora

    out, proc = nft_run["out"], nft_run["proc"]
    log = (out / LOG_FILE).read_text()
    for line in ("step 1/1", "validation @ step 1", "init adapter: 'default' starts from"):
        assert line in log, f"{line!r} missing from {LOG_FILE}:\n{log}"
    assert "Warning" not in log and "Warning" not in proc.stderr, proc.stderr[-3000:]  # nothing avoidable
    assert val_grid(out).width == 4 * 64  # --num_val_images 4 of the 4 validated prompts
    ckpt = out / "checkpoints" / "step_00000001"
    state = json.loads((ckpt / "trainer_state.json").read_text())["trainer_state"]["lr_scheduler"]
    assert state["spec"]["schedule"] == "cosine" and state["state"]["last_epoch"] == 1
    # NFT's `old` started as a copy of --init_adapter: after one EMA refresh (decay 0.5), old = (init + default) / 2
    init = lora.read_adapter(nft_run["init"])[1]
    default = lora.read_adapter(str(ckpt / "adapters" / "default"))[1]
    old = lora.read_adapter(str(ckpt / "adapters" / "old"))[1]
    assert set(init) == set(old) == set(default)
    moved = 0.0
    for path in init:
        for ab in ("A", "B"):
            torch.testing.assert_close(old[path][ab], 0.5 * init[path][ab] + 0.5 * default[path][ab])
            moved = max(moved, float((default[path][ab] - init[path][ab]).abs().max()))
    assert moved > 0  # default was trained away from the init, so the check above could fail


@pytest.mark.slow  # a whole trainer run (`nft_run`), then the README's commands on it
def test_readme_after_training_commands(nft_run, tmp_path):
    """The README's commands as written (paths substituted for the tiny run), then: evaluate.py's number for the
    validated adapter is the in-training validation's, bit for bit; sample.py under torchrun draws evaluate's images."""
    out, root = nft_run["out"], nft_run["root"]
    subs = {"outputs/demo/data/test.parquet": str(root / "data" / "test.parquet"), "outputs/demo": str(out),
            "outputs/*": str(root / "runs") + "/*", "step_00000020": "step_00000001"}
    commands = readme_commands()
    assert [re.search(r"scripts/\w+\.py", c).group(0) for c in commands] == [
        "scripts/evaluate.py", "scripts/sample.py", "scripts/compare_runs.py"], commands
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    outputs = []
    for command in commands:
        for old, new in subs.items():
            command = command.replace(old, new)
        command = re.sub(r"^python3 ", shlex.quote(sys.executable) + " ", command)
        command = re.sub(r"^torchrun ", shlex.quote(sys.executable) + " -m torch.distributed.run ", command)
        proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        outputs.append(proc.stdout)

    trained = [v for s, v in scalars(out)[KEY] if s == 1]
    report = json.loads((out / "eval" / "metrics.json").read_text())
    by_adapter = {a["adapter"].rsplit(":", 1)[-1]: a for a in report["adapters"]}
    # one code path: the same number (TensorBoard stores float32, so compare in float32)
    assert np.float32(by_adapter["default"]["metrics"][KEY]) == np.float32(trained[0])
    assert by_adapter["old"]["metrics"][KEY] != by_adapter["default"]["metrics"][KEY]  # so the check can fail
    assert by_adapter["default"]["bound_modules"] > 0 and by_adapter["base"]["bound_modules"] == 0
    assert KEY in outputs[0] and "base" in outputs[0]
    lines = (out / "eval" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 4 and all(json.loads(line)["seed"] for line in lines)
    # sample.py (2 ranks, all 8 test prompts) vs evaluate.py (1 process, prompts 0..3): same seeds and weights; the
    # rank holding prompts 0..3 batches them exactly as evaluate.py did, so those images are identical
    samples = out / "samples"
    assert len([f for f in os.listdir(samples) if f.endswith(".png") and f != "grid.png"]) == 8
    assert len((samples / "samples.jsonl").read_text().splitlines()) == 8
    assert Image.open(samples / "grid.png").size == (4 * 64, 2 * (64 + 4 * 12 + 4))  # both ranks' 8 images
    for i in range(4):
        a = np.asarray(Image.open(samples / f"{i:05d}.png"))
        b = np.asarray(Image.open(out / "eval" / "images" / "2_step_00000001-default" / f"{i:05d}.png"))
        assert np.array_equal(a, b), i
    # compare_runs lists the run's last validation value
    assert str(out) in outputs[2] and KEY in outputs[2] and f"{trained[0]:.4f}" in outputs[2]


def test_sample_boogu_edit_with_a_reference_image_and_an_adapter(tiny_models, tmp_path, capsys):
    """Boogu Edit from a text prompt + a reference image, two seeds per prompt, with a PEFT adapter folder: PNGs at
    the reference's size, a grid and records; every adapter module binds; the two seeds give two images."""
    import sample
    from models import lora

    model_path = os.path.join(tiny_models, "boogu_image_edit")
    adapter = make_adapter(model_path, str(tmp_path / "lora"))
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(tmp_path / "ref.png")
    sample.main(["--model_path", model_path, "--prompt", 'Change the text to "SALE"',
                 "--image", str(tmp_path / "ref.png"), "--num_per_prompt", "2", "--num_inference_steps", "2",
                 "--device", "cpu", "--adapter", adapter, "--output_dir", str(tmp_path / "out")])
    assert f"{len(lora.read_adapter(adapter)[1])} LoRA modules bound" in capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [r["file"] for r in records] == ["00000.png", "00001.png"] and records[0]["seed"] != records[1]["seed"]
    assert (records[0]["height"], records[0]["width"]) == (64, 64)  # the reference's size by default
    first, second = (np.asarray(Image.open(tmp_path / "out" / r["file"])) for r in records)
    assert first.shape == (64, 64, 3) and not np.array_equal(first, second)
    assert Image.open(tmp_path / "out" / "grid.png").width == 2 * 64


def test_sample_and_evaluate_refuse_a_folder_that_is_no_adapter(tmp_path, capsys):
    import evaluate
    import sample

    bogus = tmp_path / "not_an_adapter"
    bogus.mkdir()
    for main, argv in ((sample.main, ["--model_path", "m", "--prompt", "x", "--output_dir", str(tmp_path),
                                      "--adapter", str(bogus)]),
                       (evaluate.main, ["--model_path", "m", "--val_files", "v", "--output_dir", str(tmp_path),
                                        "--adapters", "base", str(bogus)])):
        with pytest.raises(SystemExit):
            main(argv)
        err = capsys.readouterr().err
        assert str(bogus) in err and "neither a PEFT adapter folder" in err


def test_the_scripts_cfg_scale_comes_from_the_flag_or_the_run_and_fails_closed_for_an_old_run():
    """sample.py / evaluate.py: an explicit flag wins, else the --run_dir run's recorded cfg_scale, else (no run)
    4.0; a run folder that recorded no cfg_scale (an older version's) and no explicit flag is refused, not sampled
    at a default its training may not have used."""
    import argparse

    import training as T

    def args(**kw):
        return argparse.Namespace(**{"run_dir": None, "run_cfg_scale": None, "guidance_scale": None,
                                     "true_cfg_scale": None, **kw})

    assert T.run_dir_cfg_scale("qwen_image", args()) == 4.0
    assert T.run_dir_cfg_scale("qwen_image", args(run_dir="r", run_cfg_scale=1.0)) == 1.0
    assert T.run_dir_cfg_scale("qwen_image", args(run_dir="r", run_cfg_scale=1.0, true_cfg_scale=3.0)) == 3.0
    assert T.run_dir_cfg_scale("boogu_image", args(run_dir="r", guidance_scale=2.0)) == 2.0  # old run, explicit flag
    with pytest.raises(ValueError, match=r"--run_dir r records no cfg_scale .*pass --true_cfg_scale"):
        T.run_dir_cfg_scale("qwen_image", args(run_dir="r"))
