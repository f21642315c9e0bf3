"""Shared pytest fixtures: the tiny checkpoints (built once per session, cached) and single-threaded torch."""

from __future__ import annotations

import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
if os.path.join(REPO, "scripts") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "scripts"))

torch.set_num_threads(1)


def tiny_models_dir() -> str:
    """$TINY_MODELS_DIR, else <repo>/.cache/tiny_models."""
    return os.environ.get("TINY_MODELS_DIR") or os.path.join(REPO, ".cache", "tiny_models")


@pytest.fixture(scope="session")
def tiny_models() -> str:
    """Directory holding the tiny checkpoints (qwen_image/, boogu_image_base/, ...).

    Builds every checkpoint that is not yet complete (a folder is complete once its `.complete` marker, written
    last, holds the hash of the builder script), so a cache built by the same builders is reused as is. Under
    pytest-xdist (pytest.ini: `-n 2`) every worker runs this: an exclusive lock on `<dir>/.lock` lets one build while
    the others wait, then find the folders complete.
    """
    import fcntl

    import build_tiny_models

    out = tiny_models_dir()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in build_tiny_models.builders():
            build_tiny_models.build_one(name, out, force=False)
    return out
