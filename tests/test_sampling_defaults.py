"""A model folder's own sampling defaults (`models.sampling_defaults`): written by the ocr_mini assembly, read by
scripts/sample.py when no run gives its settings, with a warning for a size far from the one it samples at."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from models import SAMPLING_DEFAULTS, sampling_defaults, size_warning

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sampling_defaults_are_read_and_checked(tmp_path):
    assert sampling_defaults(str(tmp_path)) == {} and sampling_defaults("Qwen/Qwen-Image") == {}
    (tmp_path / SAMPLING_DEFAULTS).write_text(json.dumps({"height": 128, "width": 128.0, "true_cfg_scale": 1}))
    assert sampling_defaults(str(tmp_path)) == {"height": 128, "width": 128, "true_cfg_scale": 1.0}
    for bad in ({"height": 0}, {"height": 127.5}, {"heigth": 128}, {"true_cfg_scale": "1"}, [128]):
        (tmp_path / SAMPLING_DEFAULTS).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=SAMPLING_DEFAULTS):
            sampling_defaults(str(tmp_path))


def test_sample_py_takes_the_model_folders_defaults_and_warns_far_from_them(tmp_path, tiny_models, capsys):
    """Before, sample.py drew ocr_mini at 512^2 with CFG 4 (a flat grey image, no warning)."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import sample

    model = tmp_path / "model"
    shutil.copytree(os.path.join(tiny_models, "qwen_image"), model)
    base = ["--model_path", str(model), "--prompt", "a sign", "--output_dir", str(tmp_path / "out")]
    plain = sample.parse_args(base)
    assert (plain.height, plain.true_cfg_scale, plain.num_inference_steps) == (None, None, 50)
    (model / SAMPLING_DEFAULTS).write_text(json.dumps({"height": 128, "width": 128, "num_inference_steps": 20,
                                                       "true_cfg_scale": 1.0}))
    args = sample.parse_args(base)
    assert (args.height, args.width, args.num_inference_steps, args.true_cfg_scale) == (128, 128, 20, 1.0)
    assert args.settings_from.endswith(os.path.join(str(model), SAMPLING_DEFAULTS)) and args.size_warning is None
    explicit = sample.parse_args(base + ["--height", "512", "--width", "512", "--true_cfg_scale", "4"])
    assert (explicit.height, explicit.true_cfg_scale) == (512, 4.0)  # a flag given wins
    assert explicit.size_warning.startswith("warning: 512x512 is far from the 128x128 this model samples at")
    assert size_warning({"height": 128, "width": 128}, 256, 64) is None  # within 2x per side


@pytest.mark.parametrize("steps", [[10, 20], 20])
def test_the_ocr_mini_assembly_writes_the_defaults_it_was_evaluated_with(tmp_path, steps):
    from tools.pretrain_ocr_mini.ship import write_sampling_defaults

    info = {"recommended": {"height": 128, "width": 128, "num_inference_steps": steps, "true_cfg_scale": 1.0}}
    write_sampling_defaults(tmp_path, info)
    assert sampling_defaults(str(tmp_path)) == {"height": 128, "width": 128, "num_inference_steps": 20,
                                                "true_cfg_scale": 1.0}
    shipped = json.load(open(os.path.join(REPO, "assets", "ocr_mini", "build_info.json")))["recommended"]
    assert shipped["height"] == shipped["width"] == 128 and shipped["true_cfg_scale"] == 1.0


def test_evaluate_py_takes_the_model_folders_defaults_unless_a_run_gives_them(tmp_path, tiny_models):
    """evaluate.py without --run_dir samples as the folder says (its steps as the validation steps); a flag wins."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import evaluate

    model = tmp_path / "model"
    shutil.copytree(os.path.join(tiny_models, "qwen_image"), model)
    base = ["--model_path", str(model), "--val_files", str(tmp_path / "test.parquet"), "--adapters", "base",
            "--output_dir", str(tmp_path / "eval")]
    plain = evaluate.parse_args(base)
    assert (plain.height, plain.val_num_inference_steps, plain.true_cfg_scale) == (512, 50, None)
    (model / SAMPLING_DEFAULTS).write_text(json.dumps({"height": 128, "width": 128, "num_inference_steps": 20,
                                                       "true_cfg_scale": 1.0}))
    args = evaluate.parse_args(base)
    assert (args.height, args.width, args.val_num_inference_steps, args.true_cfg_scale) == (128, 128, 20, 1.0)
    assert args.settings_from.endswith(SAMPLING_DEFAULTS) and args.size_warning is None
    explicit = evaluate.parse_args(base + ["--height", "1024", "--width", "1024"])
    assert explicit.height == 1024 and explicit.size_warning.startswith("warning: 1024x1024 is far from the 128x128")
