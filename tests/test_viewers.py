"""The README's viewer works in the installed environment: a run's TensorBoard logs (written by the trainers' own
logger) are read back by TensorBoard's event reader, and `tensorboard --logdir <run>/tensorboard` (the README's
command, bound to 127.0.0.1 on a free port) starts and serves the run's scalar and image tags over HTTP.

tensorboard 2.20 imported `pkg_resources`, which setuptools >= 81 no longer ships: the server then died at start-up
with ModuleNotFoundError while the reader still worked, so both are checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sysconfig
import threading
import time
import urllib.request

from PIL import Image

from trainer_runs import images, scalars
from training.logs import TensorBoardLogger


def write_run_logs(run_dir: str) -> None:
    """Two steps of scalars and one image under <run_dir>/tensorboard, as a trainer writes them."""
    logger = TensorBoardLogger(os.path.join(run_dir, "tensorboard"), enabled=True)
    for step in (1, 2):
        logger.log_scalars({"critic/rewards/mean": 0.5 * step, "actor/lr": 1e-4}, step)
    logger.log_image("val/samples", Image.new("RGB", (32, 16), (200, 40, 40)), 2)
    logger.close()


def tensorboard_command() -> str:
    """The `tensorboard` console script of this interpreter's environment (what the README's command runs)."""
    path = os.path.join(sysconfig.get_path("scripts"), "tensorboard")
    assert os.path.isfile(path), f"no tensorboard console script at {path}: is tensorboard installed?"
    return path


def read_url(proc: subprocess.Popen, deadline_s: float) -> str:
    """The http://127.0.0.1:PORT/ address TensorBoard prints once it serves; its output if it dies or never does."""
    lines: list[str] = []
    found: list[str] = []

    def pump() -> None:
        for line in proc.stderr:
            lines.append(line)
            match = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            if match and not found:
                found.append(match.group(1))

    threading.Thread(target=pump, daemon=True).start()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and not found and proc.poll() is None:
        time.sleep(0.2)
    assert found, f"tensorboard did not start (exit {proc.poll()}):\n{''.join(lines)[-3000:]}"
    return found[0]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read().decode())


def test_the_event_reader_reads_a_runs_scalars_and_images(tmp_path):
    write_run_logs(str(tmp_path))
    assert scalars(str(tmp_path))["critic/rewards/mean"] == [(1, 0.5), (2, 1.0)]
    assert list(images(str(tmp_path), "val/samples")) == [2]


def test_tensorboard_server_starts_and_serves_the_runs_tags(tmp_path):
    write_run_logs(str(tmp_path))
    proc = subprocess.Popen([tensorboard_command(), "--logdir", str(tmp_path / "tensorboard"), "--host", "127.0.0.1",
                             "--port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = read_url(proc, deadline_s=90)
        end, tags = time.monotonic() + 60, {}
        while time.monotonic() < end:  # the data loader reads the logdir shortly after the server is up
            tags = get_json(url + "data/plugin/scalars/tags")
            if any("critic/rewards/mean" in run_tags for run_tags in tags.values()):
                break
            time.sleep(0.5)
        assert any("critic/rewards/mean" in run_tags for run_tags in tags.values()), tags
        image_tags = get_json(url + "data/plugin/images/tags")
        assert any("val/samples" in run_tags for run_tags in image_tags.values()), image_tags
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_compare_runs_prefix_takes_one_value_and_repeats(tmp_path, capsys):
    import compare_runs

    write_run_logs(str(tmp_path / "run"))
    compare_runs.main(["--prefix", "critic/rewards", str(tmp_path / "run")])  # the run folder is not a prefix
    out = capsys.readouterr().out
    assert "critic/rewards/mean" in out and "actor/lr" not in out and f"{1.0:.4f}" in out
    compare_runs.main([str(tmp_path / "run"), "--prefix", "critic/", "--prefix", "actor/"])
    out = capsys.readouterr().out
    assert "critic/rewards/mean" in out and "actor/lr" in out


def test_grid_captions_wrap_at_words_and_end_with_an_ellipsis():
    from training.logs import _wrap

    text = "r=0.123 | a photo of a lighthouse at dusk with seagulls over the rocky shore and a red boat"
    lines = _wrap(text, 64 * 2, 3)  # 21 characters per line, 3 lines
    assert len(lines) == 3 and lines[-1].endswith(" ...")
    words = set(text.split())
    assert all(word in words for line in lines for word in line.removesuffix(" ...").split()), lines


def test_evaluate_names_grids_and_image_folders_by_adapter():
    import evaluate

    assert evaluate.adapter_label(0, "base") == "0_base"
    assert evaluate.adapter_label(2, "outputs/run/checkpoints/step_00000300:default") == "2_step_00000300-default"
    assert evaluate.adapter_label(1, "my loras/ocr v2/") == "1_ocr_v2"


def test_the_end_of_run_summary_names_steps_time_validation_checkpoint_and_logs():
    from training.logs import run_summary

    line = run_summary(3, 10, 125.0, {"val-core/ocr/reward/mean@1": 0.51234, "val/other": 1.0},
                       "out/checkpoints/step_00000010", "out")
    assert line == ("done: steps 3-10 in 0:02:05 (15.62 s/step) | last validation val-core/ocr/reward/mean@1 0.5123 "
                    "| checkpoint out/checkpoints/step_00000010 | logs out/tensorboard and out/train.log")
