"""training/distributed.py: the 1-process gloo group, the rank helpers, `seed_everything`; and two ranks under
torchrun (tests/_training_fsdp_worker.py: FSDP2 + LoRA + activation checkpointing + a checkpoint round trip)."""

from __future__ import annotations

import json
import math
import os
import random
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

import training as T  # noqa: E402
from training.distributed import (all_gather_cat, get_local_world_size, get_rank, get_world_size,  # noqa: E402
                                  is_main_process, seed_everything)
from _training_helpers import DIST_ENV  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_process_group")  # a 1-process gloo group (tests/conftest.py)


# ---------------------------------------------------------------------------------------------------------------
# distributed helpers
# ---------------------------------------------------------------------------------------------------------------


def test_init_distributed_single_process(one_process_group):
    info = one_process_group
    assert (info.rank, info.world_size, info.local_rank, info.backend) == (0, 1, 0, "gloo")
    assert info.is_main and info.is_local_main and info.node_rank == 0
    assert get_rank() == 0 and get_world_size() == 1 and is_main_process()
    assert T.init_distributed("cpu") == info  # idempotent


def test_cleanup_frees_the_group_after_a_model_library_imported_fsdp():
    """A fresh interpreter: init, then what loading a model imports (torch.distributed.fsdp pulls in
    torch.distributed.nn, whose default arguments would hold the live group), then cleanup. No gloo thread may
    outlive destroy_process_group: one left running aborted 2-rank scripts at interpreter exit (SIGABRT)."""
    code = ("import os\n"
            "from training.distributed import cleanup_distributed, init_distributed\n"
            "init_distributed('cpu')\n"
            "import torch.distributed.fsdp\n"
            "cleanup_distributed()\n"
            "print(sorted(open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')))\n")
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    threads = out.stdout.strip()
    assert "python" in threads and "gloo" not in threads, threads


@pytest.mark.parametrize("env, expected", [
    ({}, 1),                                           # a plain `python train_*.py`
    ({"WORLD_SIZE": "8"}, 8),                          # a launcher that sets no LOCAL_WORLD_SIZE: one node
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 4),  # torchrun, two nodes of 4
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": ""}, 8),
])
def test_local_world_size_reads_torchruns_env_then_assumes_one_node(monkeypatch, env, expected):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert get_local_world_size() == expected


def test_all_gather_cat_single_process():
    t = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(all_gather_cat(t), t)



def test_seed_everything_reproducible():
    seed_everything(5)
    a = (random.random(), np.random.rand(), torch.rand(()).item())
    seed_everything(5)
    b = (random.random(), np.random.rand(), torch.rand(()).item())
    seed_everything(6)
    c = (random.random(), np.random.rand(), torch.rand(()).item())
    assert a == b and a != c
    assert seed_everything(5, per_rank=True) == 5  # + rank 0


# ---------------------------------------------------------------------------------------------------------------
# two ranks under torchrun (gloo): FSDP2 + LoRA + activation checkpointing + checkpoint round trip
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # two ranks under torchrun (about a minute on 2 cores)
def test_fsdp2_lora_two_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={port}", os.path.join(HERE, "_training_fsdp_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    for r in (r0, r1):
        assert r["n_dtensor"] > 0  # parameters really are sharded DTensors
        assert r["old_equals_default"] and r["old_restored"]
        assert r["resume_loss_equal"] and r["resume_params_equal"] and r["resume_step"] == 2
        assert r["refresh"]["old_policy/copy_update"] == 1.0
        # one rank's non-finite loss, then one rank's non-finite update: both ranks skip both, weights unchanged
        assert r["skipped"] == [1.0, 1.0] and r["skips_left_params"] and "undone" in r["skip_reason"]
    assert (r0["loss_skip_reason"], r1["loss_skip_reason"]) == ("non-finite loss on another rank", "non-finite loss")
    # both ranks agree on every reduced metric, the global batches and the gathered adapter weights
    assert r0["steps"] == r1["steps"] and r0["batches"] == r1["batches"] and r0["default_sum"] == r1["default_sum"]
    assert r0["gathered"] == r1["gathered"] == [0.0, 0.0, 1.0, 1.0]  # all_gather_cat, rank order
    assert all("ranks logged different metric keys" in r["key_mismatch"] for r in (r0, r1))
    # a save failing on rank 0 raises on both ranks (rank 1 names rank 0's error) and leaves no step directory
    assert r0["failed_save"] == "OSError: disk full (simulated on rank 0)"
    assert r1["failed_save"].startswith("CheckpointError") and "rank 0" in r1["failed_save"]
    assert not r0["step9_exists"] and not r1["step9_exists"]
    assert r0["on_rank0"][:2] == [{"from": 0}, "lock"] and r1["on_rank0"][:2] == [{"from": 0}, None]
    assert r0["on_rank0"][2] == r1["on_rank0"][2] == "RuntimeError: OSError: lock held (simulated)"
    assert all(s["actor/rank"] == 0.5 for s in r0["steps"])  # mean over ranks of 0 and 1
    assert all((s["actor/rank_max"], s["actor/rank_min"]) == (1.0, 0.0) for s in r0["steps"] + r1["steps"])
    assert all(math.isnan(s["actor/nan_on_rank1_max"]) for s in r0["steps"] + r1["steps"])
    # the unused LoRA (blocks.2.ff) has no Adam state; the checkpoint round trip keeps exactly that
    assert r0["params_with_state"] == r1["params_with_state"] == [10, 10, 12]
    # sharded training equals an unsharded model trained on the full global batch
    for s, ref_norm, ref_loss in zip(r0["steps"], r0["ref_norms"], r0["ref_losses"]):
        assert s["actor/grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
        assert s["actor/loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert r0["ref_max_param_diff"] < 1e-6
