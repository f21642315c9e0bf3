"""The README's own-data snippet, run as written: it must write splits that the demo's layout (2 trainer ranks,
--train_batch_size 2) accepts."""

from __future__ import annotations

import re
import runpy
import shlex
from pathlib import Path

import training as T
import train_nft

REPO = Path(__file__).resolve().parents[1]


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
    assert T.check_datasets(args, world, guided=False) == ["pickscore"] * 4
