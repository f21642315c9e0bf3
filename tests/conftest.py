"""Shared pytest fixtures: the tiny checkpoints (built once per session, cached), single-threaded torch, and for the
tests/test_training_*.py files a 1-process gloo group and a trained tiny checkpoint (tests/_training_helpers.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
for _folder in ("scripts", "tools"):  # the user scripts (sample, evaluate, torchrun) and the developer tools
    if os.path.join(REPO, _folder) not in sys.path:
        sys.path.insert(0, os.path.join(REPO, _folder))

torch.set_num_threads(1)


def pytest_ignore_collect(collection_path, config):
    """tests/vllm_omni_env/ imports vllm_omni at module top: it is collected only where vllm_omni imports (the
    vllm-omni test environment, `-m vllm_omni_env`; pytest.ini). Elsewhere its marker deselects it anyway."""
    if collection_path.name == "vllm_omni_env" and collection_path.is_dir():
        import importlib.util

        return importlib.util.find_spec("vllm_omni") is None
    return None


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


@pytest.fixture(scope="module")
def one_process_group():
    """A 1-process gloo group for the module (env restored afterwards so later subprocesses start clean): what
    `init_distributed` creates without torchrun, so the FSDP2 / DTensor code paths run in one process too. A module
    asks for it with `pytestmark = pytest.mark.usefixtures("one_process_group")`."""
    import training as T
    from _training_helpers import DIST_ENV

    saved = {k: os.environ.get(k) for k in DIST_ENV}
    created = not torch.distributed.is_initialized()
    info = T.init_distributed("cpu")
    assert {k: os.environ.get(k) for k in DIST_ENV} == saved  # the environment is left untouched
    yield info
    if created:
        T.cleanup_distributed()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def trained_checkpoint(tmp_path):
    """Run 5 steps, saving after step 3; return (root, the data, losses of steps 4-5, final adapters, final
    optimizer)."""
    import training as T
    from training.distributed import seed_everything
    from _training_helpers import fresh_run, save_state, train_step, full_params

    torch.manual_seed(0)
    data = torch.randn(12, 5, 4)
    model, cfg, opt, stepper, sampler = fresh_run(lora_seed=1)
    seed_everything(42)
    for _ in range(3):
        train_step(model, opt, stepper, sampler, data)
    T.old_policy_refresh(model, 3, decay=0.5)
    root = str(tmp_path / "ckpt")
    save_state(root, 3, model, cfg, opt, stepper, sampler)
    losses_45 = [train_step(model, opt, stepper, sampler, data) for _ in range(2)]
    return root, data, losses_45, full_params(model, "default"), opt.state_dict()
