"""The README's own-data snippet, run as written: it must write splits that the demo's layout (2 trainer ranks,
--train_batch_size 2) accepts."""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

import train_nft
from training.preflight import check_datasets

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(REPO / "tools")]


def readme_block(heading: str, language: str) -> str:
    """The first ```language block after the README line `## heading`."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index(f"## {heading}\n"):]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def demo_flags() -> list[str]:
    """The trainer flags of scripts/run_demo.sh (its torchrun line, the shell variables filled in)."""
    script = (REPO / "scripts" / "run_demo.sh").read_text(encoding="utf-8")
    line = script[script.index("OMP_NUM_THREADS=1 torchrun "):script.index(' "$@"')].replace("\\\n", " ")
    line = line.replace("$TINY_MODELS_DIR", "tiny").replace("$OUT", "out")
    argv = shlex.split(line)
    return argv[argv.index("train_nft.py") + 1:]


def test_the_own_data_snippet_writes_splits_the_demo_layout_accepts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO))
    (tmp_path / "snippet.py").write_text(readme_block("Your own data", "python"), encoding="utf-8")
    runpy.run_path(str(tmp_path / "snippet.py"), run_name="__main__")
    args = train_nft.parse_args(demo_flags() + ["--train_files", "data/mine/train.parquet",
                                                "--val_files", "data/mine/test.parquet"])
    world = int(re.search(r"--nproc_per_node=(\d+)", (REPO / "scripts" / "run_demo.sh").read_text()).group(1))
    assert check_datasets(args, world, guided=False) == ["pickscore"] * 4


def bash_blocks(heading: str) -> list[str]:
    """Every ```bash block of the README section `## heading`, in order."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index(f"## {heading}\n"):].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def user_checkout(tmp_path: Path, tiny_models: str) -> tuple[Path, dict[str, str]]:
    """A folder that looks like a fresh checkout to the README's commands: every top-level entry of the repository
    linked in, no outputs/, `.cache/tiny_models` linked to the test session's tiny checkpoints (so the demo finds
    them complete and does not rebuild); `python3` and `torchrun` on PATH resolve to this interpreter."""
    work = tmp_path / "checkout"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in ("outputs", ".cache", ".git"):
            (work / entry.name).symlink_to(entry)
    (work / ".cache").mkdir()
    (work / ".cache" / "tiny_models").symlink_to(tiny_models)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    (bin_dir / "torchrun").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m torch.distributed.run "$@"\n')
    (bin_dir / "torchrun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("TINY_MODELS_DIR", "OUT", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return work, env


def run_pasted(block: str, work: Path, env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """Each command of a bash block as a user pastes it (continuation lines joined, comment lines skipped), in
    `work`; every one must succeed."""
    done = []
    for command in re.split(r"\n(?=\S)", block.strip()):
        if command.startswith("#"):
            continue
        proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                              timeout=1200)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        done.append(proc)
    return done


@pytest.mark.slow  # the whole demo (20 steps, 2 ranks + a rollout worker), then every After-training command
def test_the_demo_then_the_readme_commands_work_as_pasted(tiny_models, tmp_path):
    """A new user's path: the README's demo command, its After-training commands and its PEFT export and load, each
    pasted as written into a fresh checkout, on the demo's own output (outputs/demo, step_00000020). Then what the
    README says of them: evaluate.py gives in-training validation's number for step 20 and for the base model (to
    float32, as TensorBoard stores it), `:old` equals `:default` in the demo, sample.py draws evaluate.py's images,
    compare_runs lists the run, and PEFT loads the export without a missing-key warning."""
    import numpy as np
    from trainer_runs import scalars

    work, env = user_checkout(tmp_path, tiny_models)
    [demo] = bash_blocks("Demo (CPU, a few minutes)")
    # the demo's second line starts TensorBoard, a server (tests/test_viewers.py serves a run with that command)
    assert demo.splitlines()[1].startswith("tensorboard --logdir outputs/demo/tensorboard")
    [train] = run_pasted(demo.splitlines()[0], work, env)
    assert "done:" in train.stdout + train.stderr
    run = work / "outputs" / "demo"
    assert (run / "checkpoints" / "step_00000020").is_dir()

    after, export = bash_blocks("After training")
    evaluate, sample, compare = run_pasted(after, work, env)
    key = "val-core/jpeg_compressibility/reward/mean@1"
    trained = dict(scalars(str(run))[key])                         # {step: float32 value}
    report = json.loads((run / "eval" / "metrics.json").read_text())
    by_adapter = {a["adapter"].rsplit("/", 1)[-1]: a["metrics"][key] for a in report["adapters"]}
    assert set(by_adapter) == {"base", "step_00000020:old", "step_00000020:default"}, by_adapter
    assert np.float32(by_adapter["step_00000020:default"]) == np.float32(trained[20])
    assert np.float32(by_adapter["base"]) == np.float32(trained[0])
    assert by_adapter["step_00000020:old"] == by_adapter["step_00000020:default"]  # the demo's hard copy
    assert trained[20] > trained[0]                                  # "the mean reward rises"
    for name in ("grid_0_base.png", "grid_2_step_00000020-default.png"):
        assert (run / "eval" / name).is_file(), name
    shown = sorted(f for f in os.listdir(run / "samples") if f.endswith(".png") and f != "grid.png")
    assert shown and all(np.array_equal(np.asarray(Image.open(run / "samples" / f)), np.asarray(Image.open(
        run / "eval" / "images" / "2_step_00000020-default" / f))) for f in shown[:4])
    assert "outputs/demo" in compare.stdout and f"{trained[20]:.4f}" in compare.stdout

    exported = run_pasted(export, work, env)
    assert (run / "peft_default" / "adapter_config.json").is_file()
    assert "adapter keys" not in exported[-1].stderr, exported[-1].stderr    # PEFT's missing/unexpected-key warning


def test_the_own_reward_example_is_scored_as_the_readme_says(monkeypatch):
    """The README's brightness reward, pasted into rewards.py as its steps say (the function and the scorer's method
    from its python block, the REWARDS entry from its text): scored, per image, with no other change."""
    import textwrap

    import torch

    import rewards as R

    namespace = dict(vars(R))
    exec(textwrap.dedent(readme_block("Your own reward", "python")), namespace)  # noqa: S102 - the README's code
    monkeypatch.setattr(R, "brightness", namespace["brightness"], raising=False)
    monkeypatch.setattr(R.RewardScorer, "score_brightness", namespace["score_brightness"], raising=False)
    section = (REPO / "README.md").read_text(encoding="utf-8").split("## Your own reward\n")[1]
    entry = re.search(r'`"brightness": (Reward\(.*?\)),`', section).group(1)
    monkeypatch.setitem(R.REWARDS, "brightness", eval(entry, vars(R)))  # noqa: S307 - the README's table entry
    white, black = torch.full((3, 8, 8), 255, dtype=torch.uint8), torch.zeros(3, 8, 8, dtype=torch.uint8)
    scorer = R.RewardScorer()
    result = scorer.score_batch([white, black], ["", ""], ["brightness", "brightness"])
    assert result.rewards.tolist() == [1.0, 0.0] and result.extras["reward/brightness"].tolist() == [1.0, 0.0]
    assert scorer.scores_rows_independently(["brightness"])  # the rollout scores its chunks as they finish
