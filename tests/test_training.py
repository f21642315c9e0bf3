"""Tests for training.py (the shared trainer plumbing). CPU, fast; one torchrun (2 ranks, gloo) FSDP2 test.

Single-process tests run inside a 1-process gloo group (what `init_distributed` creates without torchrun), so the
FSDP2 / DTensor code paths are exercised here too; the 2-rank test checks sharding across processes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, HERE]

import training as T  # noqa: E402
from training.adapters import clean_rollout_adapters, prune_rollout_adapters  # noqa: E402
from training.checkpoint import (CHECKPOINT_FORMAT, find_latest, load_checkpoint, save_checkpoint,  # noqa: E402
                                 verify_checkpoint)
from training.data import PromptSampler  # noqa: E402
from training.distributed import (all_gather_cat, get_rank, get_world_size, is_local_main_process,  # noqa: E402
                                  is_main_process, seed_everything)
from training.logs import (Progress, TensorBoardLogger, reward_metrics, validation_metrics,  # noqa: E402
                           write_run_metadata)
from training.model import (adapter_params, adapter_state_dict, add_lora_adapters,  # noqa: E402
                            apply_activation_checkpointing, full_tensor, mixed_precision_policy, prepare_transformer,
                            shard_transformer)
from training.optim import GradStepper, build_optimizer, ema_adapter_  # noqa: E402
from training.perf import perf_metrics  # noqa: E402
from training.resume import prepare_resume  # noqa: E402
from training.resume_policy import (RESUME_BLOCKING, RESUME_LOGGED, RESUME_PATHS, config_fingerprint,  # noqa: E402
                                    content_fingerprints, sha256_file)
from training.lifecycle import StopSignals  # noqa: E402
from models import lora  # noqa: E402
from models.base import transformer_blocks  # noqa: E402
from _tiny_lora import BLOCK_PREFIXES, TARGETS, TinyFlowTransformer  # noqa: E402

torch.set_num_threads(1)

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """A 1-process gloo group for the module (env restored afterwards so later subprocesses start clean)."""
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


def make_model(lora_seed: int = 1, adapters=("default", "old"), shard: bool = True, rank: int = 3):
    """Tiny transformer (base weights always from seed 0) with LoRA adapters whose A and B are random non-zero."""
    torch.manual_seed(0)
    model = TinyFlowTransformer()
    torch.manual_seed(lora_seed)
    cfg = add_lora_adapters(model, target_modules=TARGETS, rank=rank, alpha=2.0 * rank, adapter_names=adapters,
                            block_prefixes=BLOCK_PREFIXES)
    with torch.no_grad():
        for name in adapters:
            for _, p in adapter_params(model, name):
                p.normal_(0, 0.2)
    if shard:
        shard_transformer(model, BLOCK_PREFIXES)
    return model, cfg


def full_params(model, adapter):
    return adapter_state_dict(model, adapter)


# ---------------------------------------------------------------------------------------------------------------
# distributed helpers
# ---------------------------------------------------------------------------------------------------------------


def test_init_distributed_single_process(one_process_group):
    info = one_process_group
    assert (info.rank, info.world_size, info.local_rank, info.backend) == (0, 1, 0, "gloo")
    assert info.is_main and info.is_local_main and info.node_rank == 0
    assert get_rank() == 0 and get_world_size() == 1 and is_main_process() and is_local_main_process()
    assert T.init_distributed("cpu") == info  # idempotent


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
# LoRA, adapters, activation checkpointing, FSDP2
# ---------------------------------------------------------------------------------------------------------------


def test_lora_layout_and_trainable_set():
    model, cfg = make_model(shard=False)
    default = [n for n, _ in adapter_params(model, "default")]
    old = [n for n, _ in adapter_params(model, "old")]
    # 3 blocks x 2 targets x (A, B)
    assert len(default) == len(old) == 12
    assert "blocks.0.to_q.lora_A.default.weight" in default and "blocks.2.ff.lora_B.old.weight" in old
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(default)
    assert all(p.dtype == torch.float32 for _, p in adapter_params(model, "old"))
    assert cfg.r == 3 and cfg.lora_alpha == 6.0
    assert sorted(full_params(model, "default"))[0] == "blocks.0.ff.lora_A.weight"


def test_lora_binding_fails_closed():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="bind no module"):
        add_lora_adapters(TinyFlowTransformer(), target_modules=("to_q", "to_qq"), rank=2, alpha=2,
                          block_prefixes=BLOCK_PREFIXES)
    with pytest.raises(ValueError, match="outside the transformer blocks"):
        add_lora_adapters(TinyFlowTransformer(), target_modules=("to_q", "proj_in"), rank=2, alpha=2,
                          block_prefixes=BLOCK_PREFIXES)
    with pytest.raises(ValueError, match="not a child"):
        transformer_blocks(TinyFlowTransformer(), ("transformer_blocks",))


@pytest.mark.parametrize("shard", [False, True])
def test_adapter_switching_and_disabling(shard):
    model, _ = make_model(shard=shard)
    torch.manual_seed(0)
    base = TinyFlowTransformer()
    x = torch.randn(2, 5, 4)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        y_default = model(x)
        with T.use_adapter(model, "old"):
            y_old = model(x)
            assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
        with lora.lora_disabled(model):
            y_ref = model(x)
            assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
        y_default_again = model(x)
    assert not torch.allclose(y_default, y_old) and not torch.allclose(y_default, y_ref)
    torch.testing.assert_close(y_ref, base(x).detach(), rtol=0, atol=1e-6)  # disabled = the frozen base model
    assert torch.equal(y_default, y_default_again)  # "default" active again after the contexts
    with T.use_adapter(model, "old"):
        y_old2 = model(x).detach()
    assert torch.equal(y_old, y_old2)
    with pytest.raises(ValueError, match="adapter 'nope' is missing"):
        with T.use_adapter(model, "nope"):
            pass


def test_nft_forward_pattern_with_checkpointing_and_fsdp():
    """DiffusionNFT's pattern: policy forward with grad, old and reference forwards under no_grad inside the adapter
    contexts, then backward (with "default" active again). With activation checkpointing + FSDP2 the gradients must
    equal those of a plain model that only ran the policy forward."""
    plain, _ = make_model(shard=False)
    ck, _ = make_model(shard=False)
    apply_activation_checkpointing(ck, BLOCK_PREFIXES)
    shard_transformer(ck, BLOCK_PREFIXES)
    x = torch.randn(2, 5, 4)
    plain(x).pow(2).mean().backward()
    loss = ck(x).pow(2).mean()
    with torch.no_grad():
        with T.use_adapter(ck, "old"):
            ck(x)
        with lora.lora_disabled(ck):
            ck(x)
    loss.backward()
    for (n, p), (_, q) in zip(adapter_params(plain, "default"), adapter_params(ck, "default")):
        torch.testing.assert_close(full_tensor(q.grad), p.grad, rtol=1e-6, atol=1e-7, msg=n)
    assert all(q.grad is None for _, q in adapter_params(ck, "old"))


def test_activation_checkpointing_keeps_names_and_grads():
    ref, _ = make_model(shard=False)
    ck, _ = make_model(shard=False)
    names = [n for n, _ in ck.named_parameters()]
    assert apply_activation_checkpointing(ck, BLOCK_PREFIXES) == 3
    assert [n for n, _ in ck.named_parameters()] == names
    x = torch.randn(2, 5, 4)
    ref(x).pow(2).mean().backward()
    ck(x).pow(2).mean().backward()
    for (n, p), (_, q) in zip(adapter_params(ref, "default"), adapter_params(ck, "default")):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


def test_fsdp2_sharded_matches_unsharded():
    from torch.distributed.tensor import DTensor

    ref, _ = make_model(shard=False)
    sharded, _ = make_model(shard=True)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    x = torch.randn(2, 5, 4)
    torch.testing.assert_close(sharded(x), ref(x), rtol=0, atol=1e-6)


def test_mixed_precision_policy():
    cpu = mixed_precision_policy(torch.device("cpu"), "bf16")
    assert cpu.param_dtype is None and cpu.reduce_dtype is None  # CPU always computes in fp32
    gpu = mixed_precision_policy(torch.device("cuda", 0), "bf16")
    assert gpu.param_dtype == torch.bfloat16 and gpu.reduce_dtype == torch.float32
    assert mixed_precision_policy(torch.device("cuda", 0), "fp32").param_dtype is None
    with pytest.raises(ValueError, match="precision"):
        mixed_precision_policy(torch.device("cpu"), "fp16")


# ---------------------------------------------------------------------------------------------------------------
# optimizer, grad clipping, non-finite skip, old adapter
# ---------------------------------------------------------------------------------------------------------------


def test_optimizer_covers_default_adapter_only():
    model, _ = make_model()
    opt = build_optimizer(model, lr=1e-3, weight_decay=1e-4)
    opt_params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert opt_params == {id(p) for _, p in adapter_params(model, "default")}
    assert opt.param_groups[0]["weight_decay"] == 1e-4 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert not opt.defaults["fused"]  # CPU; fused=True is chosen for CUDA params


def test_non_finite_grad_norm_skips_step():
    model, _ = make_model()
    opt = build_optimizer(model, lr=1e-2)
    stepper = GradStepper(max_grad_norm=1.0)
    before = full_params(model, "default")
    x = torch.randn(2, 5, 4)
    x[0, 0, 0] = float("nan")
    model(x).pow(2).mean().backward()
    m = stepper.step(opt)
    assert m["actor/step_skipped"] == 1.0 and m["actor/skipped_steps"] == 1.0 and math.isnan(m["actor/grad_norm"])
    after = full_params(model, "default")
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update
    assert not opt.state  # the optimizer never stepped
    assert all(p.grad is None for _, p in adapter_params(model, "default"))  # grads dropped
    model(torch.randn(2, 5, 4)).pow(2).mean().backward()
    m = stepper.step(opt)
    assert m["actor/step_skipped"] == 0.0 and m["actor/skipped_steps"] == 1.0 and math.isfinite(m["actor/grad_norm"])
    assert any(not torch.equal(before[k], v) for k, v in full_params(model, "default").items())
    assert stepper.state_dict()["skipped_steps"] == 1


def test_grad_norm_clipping_with_dtensor_grads():
    model, _ = make_model()
    params = [p for _, p in adapter_params(model, "default")]
    opt = torch.optim.SGD(params, lr=1.0)  # SGD with lr 1: the update IS the clipped gradient
    model(torch.randn(2, 5, 4)).pow(2).mean().backward()
    expected_norm = math.sqrt(sum(float(full_tensor(p.grad).double().pow(2).sum()) for p in params))
    before = {n: full_tensor(p.detach()).clone() for n, p in adapter_params(model, "default")}
    m = GradStepper(max_grad_norm=1e-3).step(opt)
    assert m["actor/grad_norm"] == pytest.approx(expected_norm, rel=1e-6) and expected_norm > 1e-3
    update = math.sqrt(sum(float((full_tensor(p.detach()) - before[n]).double().pow(2).sum())
                           for n, p in adapter_params(model, "default")))
    assert update == pytest.approx(1e-3, rel=1e-4)


@pytest.mark.parametrize("shard", [False, True])
def test_old_adapter_copy_and_ema(shard):
    model, _ = make_model(shard=shard)
    d0, o0 = full_params(model, "default"), full_params(model, "old")
    assert any(not torch.equal(d0[k], o0[k]) for k in d0)
    ema_adapter_(model, 0.25)
    o1 = full_params(model, "old")
    for k in d0:
        torch.testing.assert_close(o1[k], 0.25 * o0[k] + 0.75 * d0[k], rtol=0, atol=1e-7)
    assert all(torch.equal(d0[k], v) for k, v in full_params(model, "default").items())  # source untouched
    lora.copy_adapter_(model, "default", "old")
    o2 = full_params(model, "old")
    assert all(torch.equal(d0[k], o2[k]) for k in d0)


def test_adapters_equal_is_exact_and_names_a_missing_adapter():
    """`adapters_equal` (NFT's --old_from_update test): True only when every LoRA tensor of both adapters is bit
    for bit the same; one element one ulp away, or a NaN in both, is unequal."""
    model, _ = make_model()
    assert not T.adapters_equal(model)  # make_model gives `old` its own random values
    lora.copy_adapter_(model, "default", "old")
    assert T.adapters_equal(model) and T.adapters_equal(model, "old", "default")
    layer = next(iter(lora.lora_layers(model, "old").values()))
    weight = layer.lora_B["old"].weight
    with torch.no_grad():
        weight.view(-1)[-1] = torch.nextafter(weight.view(-1)[-1], torch.tensor(math.inf))
    assert not T.adapters_equal(model)
    lora.copy_adapter_(model, "default", "old")
    with torch.no_grad():
        layer.lora_A["old"].weight.view(-1)[0] = math.nan
        layer.lora_A["default"].weight.view(-1)[0] = math.nan
    assert not T.adapters_equal(model)
    with pytest.raises(ValueError, match="'missing' is missing"):
        T.adapters_equal(model, "default", "missing")


def test_old_policy_refresh_follows_schedule():
    model, _ = make_model()
    d0, o0 = full_params(model, "default"), full_params(model, "old")
    zeros = {"old_policy/update_applied": 0.0, "old_policy/copy_update": 0.0, "old_policy/ema_update": 0.0,
             "old_policy/decay": 0.0}
    # not due (interval 2, step 1): nothing changes, all metrics 0
    assert T.old_policy_refresh(model, 1, interval=2, schedule="delayed_linear_to_0_999") == zeros
    assert all(torch.equal(o0[k], v) for k, v in full_params(model, "old").items())
    # step 76 of delayed_linear_to_0_999: EMA with d = 0.0075
    m = T.old_policy_refresh(model, 76, interval=2, schedule="delayed_linear_to_0_999")
    assert m == {"old_policy/update_applied": 1.0, "old_policy/copy_update": 0.0, "old_policy/ema_update": 1.0,
                 "old_policy/decay": pytest.approx(0.0075)}
    o1 = full_params(model, "old")
    for k in d0:
        torch.testing.assert_close(o1[k], 0.0075 * o0[k] + 0.9925 * d0[k], rtol=0, atol=1e-7)
    # step 74 (still warm-up): hard copy
    m = T.old_policy_refresh(model, 74, interval=2, schedule="delayed_linear_to_0_999")
    assert m["old_policy/copy_update"] == 1.0 and m["old_policy/decay"] == 0.0
    assert all(torch.equal(d0[k], v) for k, v in full_params(model, "old").items())
    # an explicit decay overrides the schedule
    assert T.old_policy_refresh(model, 3, decay=0.25)["old_policy/decay"] == 0.25
    with pytest.raises(ValueError, match="interval"):
        T.old_policy_refresh(model, 3, interval=0)


# ---------------------------------------------------------------------------------------------------------------
# sampler
# ---------------------------------------------------------------------------------------------------------------


def test_sampler_deterministic_epochs_and_shards():
    a = PromptSampler(10, 4, seed=3)
    b = PromptSampler(10, 4, seed=3)
    seq_a = [a.next_batch() for _ in range(5)]
    seq_b = [b.next_batch() for _ in range(5)]
    assert [s.indices for s in seq_a] == [s.indices for s in seq_b]
    assert [(s.epoch, s.step_in_epoch) for s in seq_a] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    epoch0 = seq_a[0].indices + seq_a[1].indices
    assert len(set(epoch0)) == 8  # no repeats inside an epoch (tail of 2 dropped)
    assert seq_a[0].indices != seq_a[2].indices  # reshuffled per epoch
    c = PromptSampler(10, 4, seed=4)
    assert c.next_batch().indices != seq_a[0].indices
    assert PromptSampler(10, 4, seed=3, shuffle=False).next_batch().indices == [0, 1, 2, 3]
    # sharding: the ranks' local slices partition the global batch, identical global batch on every rank
    ranks = [PromptSampler(12, 6, seed=1, rank=r, world_size=3) for r in range(3)]
    for _ in range(3):
        batches = [s.next_batch() for s in ranks]
        assert all(bt.indices == batches[0].indices for bt in batches)
        assert sum((bt.local for bt in batches), []) == batches[0].indices
        assert all(len(bt.local) == 2 for bt in batches)


def test_mini_and_micro_batches_cover_each_epoch_in_order():
    as_lists = lambda batches: [[mb.tolist() for mb in mini] for mini in batches]  # noqa: E731
    assert as_lists(T.mini_batches(8, 4, 2, epochs=2)) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]] * 2
    assert [mb.tolist() for mb in T.micro_batches(2, 8, 3)] == [[2, 3, 4], [5, 6, 7]]
    with pytest.raises(ValueError, match="micro-batches of 4 do not tile the 6 samples"):
        list(T.mini_batches(6, 6, 4))  # a short last micro-batch would weigh its samples more
    with pytest.raises(ValueError, match="mini-batches of 4 do not tile the 5 samples"):
        list(T.mini_batches(5, 4, 1))
    assert T.micro_batches(0, 4, 4)[0].dtype == torch.long


def test_sampler_resume_and_refusals():
    s = PromptSampler(9, 3, seed=11)
    for _ in range(4):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))  # survives JSON (stored in trainer_state.json)
    cont = [s.next_batch().indices for _ in range(4)]
    r = PromptSampler(9, 3, seed=11)
    r.load_state_dict(state)
    assert [r.next_batch().indices for _ in range(4)] == cont
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(9, 3, seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_len"):
        PromptSampler(10, 3, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="divisible"):
        PromptSampler(10, 3, seed=0, rank=0, world_size=2)
    with pytest.raises(ValueError, match="fewer than"):
        PromptSampler(2, 3, seed=0)


# ---------------------------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------------------------

CONFIG = {"lr": 1e-2, "lora_rank": 3, "seed": 0, "total_training_steps": 5, "model_path": "/tiny"}


def _train_step(model, opt, stepper, sampler, data) -> float:
    """One step that draws from every RNG the trainers use (torch, numpy, python) and from the sampler."""
    batch = sampler.next_batch()
    x = data[batch.local] + 0.1 * torch.randn(len(batch.local), 5, 4)
    x = x * float(1 + 0.01 * np.random.rand()) * float(1 + 0.01 * random.random())
    loss = model(x).pow(2).mean()
    loss.backward()
    stepper.step(opt)
    return float(loss.detach())


def _fresh_run(lora_seed: int):
    model, cfg = make_model(lora_seed=lora_seed)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.01)
    return model, cfg, opt, GradStepper(max_grad_norm=0.5), PromptSampler(12, 2, seed=5)


def _save(root, step, model, cfg, opt, stepper, sampler, config=CONFIG):
    return save_checkpoint(root, step, transformer=model, optimizer=opt, lora_config=cfg, config=config,
                           sampler=sampler, adapter_names=("default", "old"),
                           trainer_state={"stepper": stepper.state_dict()})


def _load(path, model, opt, sampler, config=CONFIG):
    return load_checkpoint(path, transformer=model, optimizer=opt, config=config, sampler=sampler,
                           adapter_names=("default", "old"))


@pytest.fixture
def trained_checkpoint(tmp_path):
    """Run 5 steps, saving after step 3; return (root, losses of steps 4-5, final adapters, final optimizer)."""
    torch.manual_seed(0)
    data = torch.randn(12, 5, 4)
    model, cfg, opt, stepper, sampler = _fresh_run(lora_seed=1)
    seed_everything(42)
    for _ in range(3):
        _train_step(model, opt, stepper, sampler, data)
    T.old_policy_refresh(model, 3, decay=0.5)
    root = str(tmp_path / "ckpt")
    _save(root, 3, model, cfg, opt, stepper, sampler)
    losses_45 = [_train_step(model, opt, stepper, sampler, data) for _ in range(2)]
    return root, data, losses_45, full_params(model, "default"), opt.state_dict()


def test_exact_resume(trained_checkpoint):
    root, data, losses_45, final_default, final_opt = trained_checkpoint
    path = find_latest(root)
    assert path == os.path.join(root, "step_00000003")
    model, _, opt, stepper, sampler = _fresh_run(lora_seed=99)  # different LoRA init: the load must overwrite it
    seed_everything(1234)  # different RNG state: the load must restore it
    state = _load(path, model, opt, sampler)
    stepper.load_state_dict(state["trainer_state"]["stepper"])
    assert state["step"] == 3 and sampler.state_dict()["step_in_epoch"] == 3
    resumed = [_train_step(model, opt, stepper, sampler, data) for _ in range(2)]
    assert resumed == losses_45  # bit-exact next-step losses
    now = full_params(model, "default")
    assert all(torch.equal(now[k], final_default[k]) for k in now)
    opt_state = opt.state_dict()["state"]
    for i, s in final_opt["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(full_tensor(opt_state[i][key]), full_tensor(s[key])), (i, key)


def test_resume_without_rng_restore_would_differ(trained_checkpoint):
    """Control for test_exact_resume: the RNG restore is what makes it exact (the test can fail)."""
    root, data, losses_45, _, _ = trained_checkpoint
    model, _, opt, stepper, sampler = _fresh_run(lora_seed=99)
    _load(find_latest(root), model, opt, sampler)
    seed_everything(1234)  # clobber the restored RNG
    assert _train_step(model, opt, stepper, sampler, data) != losses_45[0]


def test_checkpoint_layout_and_atomic_save(trained_checkpoint, monkeypatch):
    root, *_ = trained_checkpoint
    path = find_latest(root)
    files = set(json.load(open(os.path.join(path, "COMPLETE")))["files"])
    assert files == {"adapters/default/adapter_config.json", "adapters/default/adapter_model.safetensors",
                     "adapters/old/adapter_config.json", "adapters/old/adapter_model.safetensors",
                     "optimizer.pt", "rng.pt", "trainer_state.json"}
    state = json.load(open(os.path.join(path, "trainer_state.json")))
    assert state["step"] == 3 and state["world_size"] == 1
    optim = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)  # plain tensors and containers
    assert len(torch.load(os.path.join(path, "rng.pt"), weights_only=True)) == 1
    assert sorted(optim["state"]) == sorted(n for n, _ in make_model(shard=False)[0].named_parameters()
                                            if ".lora_" in n and ".default." in n)
    assert set(optim["state"]["blocks.0.to_q.lora_A.default.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert optim["param_groups"][0]["lr"] == 1e-2
    assert set(state["versions"]) >= {"torch", "diffusers", "transformers", "peft", "python"}
    assert re.fullmatch(r"[0-9a-f]{64}", state["config_fingerprint"])
    assert state["fingerprinted_config"] == {"lora_rank": 3, "lr": 0.01, "seed": 0}  # a path may move: not here
    assert state["logged_config"] == {"model_path": "/tiny", "total_training_steps": 5}
    manifest = json.load(open(os.path.join(path, "COMPLETE")))
    entry = manifest["files"]["optimizer.pt"]
    assert manifest["format"] == CHECKPOINT_FORMAT
    assert entry["size"] == os.path.getsize(os.path.join(path, "optimizer.pt"))
    assert entry["sha256"] == hashlib.sha256(open(os.path.join(path, "optimizer.pt"), "rb").read()).hexdigest()
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]
    # a crash in the middle of a save leaves only a temp dir; "latest" still points at the complete step 3
    model, cfg, opt, stepper, sampler = _fresh_run(lora_seed=1)
    real_save = torch.save

    def crash(obj, f, *a, **k):
        if str(f).endswith("rng.pt"):
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        _save(root, 7, model, cfg, opt, stepper, sampler)
    monkeypatch.setattr(torch, "save", real_save)
    assert not os.path.exists(os.path.join(root, "step_00000007"))
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]  # the failed save cleaned its temp dir
    assert find_latest(root) == path
    # a process killed mid-save leaves a temp dir behind: ignored
    shutil.copytree(path, os.path.join(root, ".tmp-step_00000007-deadbeef"))
    assert find_latest(root) == path
    # keep_last prunes older complete checkpoints only once the new one is in place; re-saving a step replaces it
    _save(root, 8, model, cfg, opt, stepper, sampler)
    save_checkpoint(root, 9, transformer=model, optimizer=opt, lora_config=cfg, config=CONFIG, sampler=sampler,
                    adapter_names=("default", "old"), keep_last=2)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000008", "step_00000009"]
    _save(root, 9, model, cfg, opt, stepper, sampler)
    assert find_latest(root).endswith("step_00000009")
    verify_checkpoint(find_latest(root))
    # a save that cannot write keeps the newest checkpoint even with keep_last=1
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(root, 10, transformer=model, optimizer=opt, lora_config=cfg, config=CONFIG,
                        sampler=sampler, adapter_names=("default", "old"), keep_last=1)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(n for n in os.listdir(root) if n.startswith("step_")) == ["step_00000008", "step_00000009"]


def test_config_mismatch_is_refused_with_key_names(trained_checkpoint):
    root, *_ = trained_checkpoint
    model, _, opt, _, sampler = _fresh_run(lora_seed=1)
    bad = dict(CONFIG, lr=2e-2, lora_rank=4, new_flag=True)
    with pytest.raises(T.CheckpointError) as e:
        _load(find_latest(root), model, opt, sampler, config=bad)
    msg = str(e.value)
    assert "lr: checkpoint=0.01 now=0.02" in msg and "lora_rank: checkpoint=3 now=4" in msg
    assert "new_flag: checkpoint='<absent>' now=True" in msg and "seed" not in msg
    # keys that may change on resume (e.g. total_training_steps) do not block it
    _load(find_latest(root), model, opt, sampler, config=dict(CONFIG, total_training_steps=500))


def test_partial_and_corrupt_checkpoints_fail_clearly(trained_checkpoint):
    root, *_ = trained_checkpoint
    good = find_latest(root)

    def fresh():
        model, _, opt, _, sampler = _fresh_run(lora_seed=1)
        return model, opt, sampler

    # a newer step directory without the marker is skipped by find_latest (with a warning) and refused by load
    partial = os.path.join(root, "step_00000004")
    shutil.copytree(good, partial)
    os.remove(os.path.join(partial, "COMPLETE"))
    with pytest.warns(UserWarning, match="step_00000004"):
        assert find_latest(root) == good
    with pytest.raises(T.CheckpointError, match="partial"):
        _load(partial, *fresh())
    # a truncated file is caught by the manifest
    trunc = os.path.join(root, "step_00000005")
    shutil.copytree(good, trunc)
    weights = os.path.join(trunc, "adapters", "old", "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(T.CheckpointError, match="corrupt.*adapter_model.safetensors"):
        _load(trunc, *fresh())
    # same size but garbage bytes: caught by the sha256 manifest; without it the reader's error names the path
    garbage = os.path.join(root, "step_00000006")
    shutil.copytree(good, garbage)
    weights = os.path.join(garbage, "adapters", "default", "adapter_model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "wb") as f:
        f.write(b"\xff" * size)
    with pytest.raises(T.CheckpointError, match="sha256"):
        _load(garbage, *fresh())
    model, opt, sampler = fresh()
    with pytest.raises(T.CheckpointError, match="cannot read LoRA adapter"):
        load_checkpoint(garbage, transformer=model, optimizer=opt, config=CONFIG, sampler=sampler,
                        adapter_names=("default", "old"), verify_sha256=False)
    # only incomplete step directories: refuse instead of silently starting fresh
    lonely = os.path.join(root, "..", "only_partial")
    os.makedirs(lonely)
    shutil.copytree(partial, os.path.join(lonely, "step_00000004"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(T.CheckpointError, match="none is complete"):
            find_latest(lonely)
    assert find_latest(str(os.path.join(root, "..", "does_not_exist"))) is None


def test_checkpoint_adapter_loads_in_diffusers(tmp_path):
    """The saved adapter directory is what diffusers' `load_lora_weights` (Qwen-Image pipeline mixin) loads:
    every tensor binds, values equal, and the LoRA scale alpha/r survives (diffusers would assume alpha = r)."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.loaders import QwenImageLoraLoaderMixin
    from peft.tuners.lora import LoraLayer

    kw = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
              num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4))
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(**kw)
    cfg = add_lora_adapters(transformer, target_modules=("to_q", "to_k", "img_mlp.net.2"), rank=4, alpha=8.0,
                            adapter_names=("default", "old"), block_prefixes=("transformer_blocks",))
    with torch.no_grad():
        for _, p in adapter_params(transformer, "default"):
            p.normal_()
    shard_transformer(transformer, ("transformer_blocks",))
    opt = build_optimizer(transformer, lr=1e-3)
    path = save_checkpoint(str(tmp_path), 1, transformer=transformer, optimizer=opt, lora_config=cfg,
                           config={"x": 1}, adapter_names=("default", "old"))
    saved = adapter_state_dict(transformer, "default")

    class Pipe(QwenImageLoraLoaderMixin):  # the mixin QwenImagePipeline uses, without text encoder / VAE
        def __init__(self, transformer):
            self.transformer = transformer
            self.hf_device_map = None
            self.components = {"transformer": transformer}

    torch.manual_seed(0)
    fresh = QwenImageTransformer2DModel(**kw)
    Pipe(fresh).load_lora_weights(os.path.join(path, "adapters", "default"), adapter_name="ckpt")
    loaded = {re.sub(r"\.ckpt\.", ".", n): p for n, p in fresh.named_parameters() if ".lora_" in n}
    assert set(loaded) == set(saved) and len(saved) == 2 * 3 * 2
    assert all(torch.equal(loaded[k].detach(), saved[k]) for k in saved)
    scalings = {m.scaling["ckpt"] for m in fresh.modules() if isinstance(m, LoraLayer)}
    assert scalings == {2.0}
    # and models/lora.py (the rollout engine's loader) reads the same directory, binding every module
    torch.manual_seed(0)
    engine_side = QwenImageTransformer2DModel(**kw)
    assert lora.import_adapter(engine_side, os.path.join(path, "adapters", "old"), adapter_name="old") == 6
    old_saved = adapter_state_dict(transformer, "old")
    old_loaded = {re.sub(r"\.old\.", ".", n): p for n, p in engine_side.named_parameters() if ".lora_" in n}
    assert all(torch.equal(old_loaded[k].detach(), old_saved[k]) for k in old_saved)


# ---------------------------------------------------------------------------------------------------------------
# reliability: integrity, untrusted pickles, killed saves, the resume policy, divergence, rollout adapter versions
# ---------------------------------------------------------------------------------------------------------------


def _rewrite_manifest_entry(path: str, rel: str) -> None:
    """Make the COMPLETE manifest agree with a file replaced on purpose (an attacker controls the whole folder)."""
    marker_path = os.path.join(path, "COMPLETE")
    marker = json.load(open(marker_path))
    full = os.path.join(path, rel)
    marker["files"][rel] = {"size": os.path.getsize(full), "sha256": sha256_file(full)}
    json.dump(marker, open(marker_path, "w"))


class _CreatesAFile:
    """A pickle payload: unpickling it calls open(path, "w"), i.e. runs code of the file's author."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_malicious_pickle_in_a_checkpoint_is_refused_and_never_runs(trained_checkpoint, tmp_path):
    root, *_ = trained_checkpoint
    path = find_latest(root)
    evidence = str(tmp_path / "payload_ran")
    torch.save({"state": {"x": _CreatesAFile(evidence)}, "param_groups": []}, os.path.join(path, "optimizer.pt"))
    _rewrite_manifest_entry(path, "optimizer.pt")  # integrity alone cannot catch it: the manifest matches
    verify_checkpoint(path)
    model, _, opt, _, sampler = _fresh_run(lora_seed=1)
    with pytest.raises(T.CheckpointError, match=r"optimizer\.pt holds pickled objects.*weights_only"):
        _load(path, model, opt, sampler)
    assert not os.path.exists(evidence)  # the payload did not run
    # prepare_resume (model-free, before a trainer loads its model) refuses it already
    with pytest.raises(T.CheckpointError, match=r"optimizer\.pt holds pickled objects.*weights_only"):
        prepare_resume("auto", root, CONFIG, adapter_names=("default", "old"))
    assert not os.path.exists(evidence)
    torch.load(os.path.join(path, "optimizer.pt"), weights_only=False)  # control: a plain unpickle runs it
    assert os.path.exists(evidence)


def test_same_size_corruption_is_caught_and_names_the_previous_checkpoint(tmp_path):
    torch.manual_seed(0)
    data = torch.randn(12, 5, 4)
    model, cfg, opt, stepper, sampler = _fresh_run(lora_seed=1)
    root = str(tmp_path / "checkpoints")
    for step in (1, 2):
        _train_step(model, opt, stepper, sampler, data)
        _save(root, step * 2, model, cfg, opt, stepper, sampler)
    newest = os.path.join(root, "step_00000004")
    weights = os.path.join(newest, "adapters", "default", "adapter_model.safetensors")
    with open(weights, "r+b") as f:  # one flipped byte in the tensor data: same size, still a valid file
        f.seek(os.path.getsize(weights) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    # without the sha256 check this loads silently (sizes match, the adapter parses): the fault the manifest catches
    other, _, other_opt, _, _ = _fresh_run(lora_seed=2)
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


_KILLED_SAVE = r"""
import os, sys, time
import torch
from training.checkpoint import save_checkpoint
from training.model import add_lora_adapters
from training.optim import build_optimizer
from _tiny_lora import BLOCK_PREFIXES, TARGETS, TinyFlowTransformer

root, phase = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = TinyFlowTransformer()
cfg = add_lora_adapters(model, target_modules=TARGETS, rank=3, alpha=6.0, adapter_names=("default",),
                        block_prefixes=BLOCK_PREFIXES)
opt = build_optimizer(model, lr=1e-2)
save = lambda step: save_checkpoint(root, step, transformer=model, optimizer=opt, lora_config=cfg,
                                    config={"lr": 1e-2})
if phase == "new":  # killed while writing optimizer.pt of a new step
    save(1)
    real = torch.save
    def hang(obj, f, *a, **k):
        if str(f).endswith("optimizer.pt"):
            open(f, "wb").write(b"partial")
            print("killing time", flush=True)
            time.sleep(600)
        return real(obj, f, *a, **k)
    torch.save = hang
    save(2)
else:  # a re-save of step 1 killed between moving the old copy out and moving the new one in
    real = os.rename
    def hang(src, dst):
        real(src, dst)
        if os.path.basename(dst).startswith(".trash-"):
            print("killing time", flush=True)
            time.sleep(600)
    os.rename = hang
    save(1)
"""


def _run_until_killed(root: str, phase: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE]), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, root, phase], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "killing time"
        proc.kill()  # SIGKILL: no cleanup of any kind runs
    finally:
        proc.wait(timeout=60)


@pytest.mark.slow  # two real processes killed mid-save (about a minute on 2 cores)
def test_a_killed_save_leaves_the_newest_checkpoint_and_start_up_tidies(tmp_path):
    root = str(tmp_path / "checkpoints")
    _run_until_killed(root, "new")
    assert [n for n in os.listdir(root) if n.startswith(".tmp-step_00000002")]
    assert find_latest(root).endswith("step_00000001")
    _run_until_killed(root, "resave")
    assert not os.path.exists(os.path.join(root, "step_00000001"))  # mid-swap: only the .trash- copy holds it
    assert [n for n in os.listdir(root) if n.startswith(".trash-step_00000001")]
    plan = prepare_resume("auto", root, {"lr": 1e-2})
    text = "\n".join(plan.messages)
    assert "removed" in text and ".tmp-step_00000002" in text and "restored" in text
    assert plan.path == os.path.join(root, "step_00000001") and plan.step == 1
    assert sorted(os.listdir(root)) == ["step_00000001"]  # temp folders gone, the newest checkpoint back
    verify_checkpoint(plan.path)


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

    model, cfg, opt, stepper, sampler = _fresh_run(lora_seed=1)
    root = str(tmp_path / "run" / "checkpoints")
    _save(root, 1, model, cfg, opt, stepper, sampler, config=config())
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


def test_nonfinite_loss_gradient_or_update_skips_the_step_and_undoes_it():
    import losses

    model, _ = make_model()
    opt = build_optimizer(model, lr=1e-2)
    stepper = GradStepper(max_grad_norm=1.0)
    x = torch.randn(2, 5, 4)
    model(x).pow(2).mean().backward()
    assert stepper.step(opt)["actor/step_skipped"] == 0.0  # AdamW state exists from here on

    def snapshot():
        state = {n: {k: full_tensor(v).clone() for k, v in opt.state[p].items()} for n, p in adapter_params(model)}
        return full_params(model, "default"), state

    def unchanged(before):
        params, state = snapshot()
        return (all(torch.equal(params[k], before[0][k]) for k in params)
                and all(torch.equal(state[n][k], before[1][n][k]) for n in state for k in state[n]))

    before = snapshot()
    # 1. a non-finite loss: returned with its metrics, back-propagated, the step skipped
    v = model(x)
    finite_keys = set(losses.diffusion_nft_loss(v, v.detach(), x, x, torch.full((2,), 0.5), torch.full((2,), 0.5),
                                                mix_beta=0.1, adv_clip_max=1.0)[1])
    loss, metrics = stepper.checked_loss(losses.diffusion_nft_loss, v, v.detach() * float("nan"), x, x,
                                         torch.full((2,), 0.5), torch.full((2,), 0.5), mix_beta=0.1, adv_clip_max=1.0)
    assert not math.isfinite(loss.item()) and set(metrics) == finite_keys
    loss.backward()
    m = stepper.step(opt)
    assert m["actor/step_skipped"] == 1.0 and m["actor/consecutive_skips"] == 1.0
    assert "non-finite loss" in stepper.last_skip_reason and "old_prediction" in stepper.last_skip_reason
    assert unchanged(before)
    # a bad argument is still an error (never taken for a non-finite loss)
    with pytest.raises(ValueError, match="mix_beta"):
        stepper.checked_loss(losses.diffusion_nft_loss, v, v, x, x, torch.full((2,), 0.5), torch.full((2,), 0.5),
                             mix_beta=0.0, adv_clip_max=1.0)
    # 2. finite loss and gradient, but the update makes the weights non-finite (lr = inf): undone exactly
    opt.param_groups[0]["lr"] = float("inf")
    model(x).pow(2).mean().backward()
    m = stepper.step(opt)
    assert m["actor/step_skipped"] == 1.0 and "undone" in stepper.last_skip_reason
    assert unchanged(before) and stepper.consecutive_skips == 2
    # 3. an applied step ends the streak; the counters ride in the checkpoint's trainer state
    opt.param_groups[0]["lr"] = 1e-2
    model(x).pow(2).mean().backward()
    assert stepper.step(opt)["actor/step_skipped"] == 0.0 and not unchanged(before)
    restored = GradStepper()
    restored.load_state_dict(json.loads(json.dumps(stepper.state_dict())))
    assert (restored.skipped_steps, restored.consecutive_skips, restored.applied_steps) == (2, 0, 2)
    # 4. the very first update undone: the optimizer is back to "never stepped"
    fresh_opt = build_optimizer(model, lr=float("inf"))
    model(x).pow(2).mean().backward()
    assert GradStepper().step(fresh_opt)["actor/step_skipped"] == 1.0 and not fresh_opt.state


def test_a_checkpoint_is_never_written_from_nonfinite_weights(tmp_path):
    model, cfg, opt, stepper, sampler = _fresh_run(lora_seed=1)
    root = str(tmp_path / "ckpt")
    _save(root, 1, model, cfg, opt, stepper, sampler)
    with torch.no_grad():
        adapter_params(model, "default")[0][1].to_local().fill_(float("nan"))  # a DTensor shard (make_model shards)
    with pytest.raises(T.CheckpointError, match="NaN/inf"):
        _save(root, 2, model, cfg, opt, stepper, sampler)
    assert sorted(os.listdir(root)) == ["step_00000001"]


def test_rollout_adapter_versions_of_earlier_runs_never_remove_the_current_one(tmp_path):
    root = tmp_path / "rollout_adapters"
    for name in ("v00000002", "v00000003", "v00000006", ".v00000004.tmp.abc"):
        (root / name).mkdir(parents=True)
    line = clean_rollout_adapters(str(root))
    assert "v00000002..v00000006" in line and "4 entries" in line and not os.listdir(root)
    assert clean_rollout_adapters(str(root)) is None
    # a version published below leftovers of an earlier run (a resume from an earlier step)
    for name in ("v00000003", "v00000004", "v00000005", "v00000009", "v00000010"):
        (root / name).mkdir()
    assert prune_rollout_adapters(str(root), 5, keep=2) == ["v00000003", "v00000009", "v00000010"]
    assert sorted(os.listdir(root)) == ["v00000004", "v00000005"]  # the new one and the one the workers hold


@pytest.mark.parametrize("first", ["SIGTERM", "SIGHUP"])
def test_stop_signals_first_asks_repeat_within_3s_is_the_same_request(first):
    """A scheduler's SIGTERM and a closed terminal's SIGHUP both ask for a stop with a checkpoint; a repeat within
    3 s (torchrun's forwarded copy) changes nothing."""
    import signal

    first = getattr(signal, first)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        stop = StopSignals(announce=False).install()
        os.kill(os.getpid(), first)
        assert stop.signum == first
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's forwarded copy: no effect, the process lives on
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.signum == first
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------------------------------------------
# logging and metrics
# ---------------------------------------------------------------------------------------------------------------


def test_reward_and_advantage_metrics():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    uids = ["a", "a", "b", "b", "c", "c"]
    adv = torch.tensor([[0.0, 0.0], [0.0, 0.0], [-1.0, -1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    m = reward_metrics(rewards, uids, adv)
    assert m == {
        "critic/rewards/mean": pytest.approx(4.0 / 6), "critic/rewards/max": 1.0, "critic/rewards/min": 0.0,
        "critic/rewards/zero_std_ratio": pytest.approx(2.0 / 3), "critic/rewards/std_mean": pytest.approx(0.5 / 3),
        "critic/rewards/group_size": 2.0,
        "critic/advantages/mean": 0.0, "critic/advantages/max": 1.0, "critic/advantages/min": -1.0,
    }
    m3 = reward_metrics(rewards, uids, extras={"pickscore_raw": [1, 2, 3, 4, 5, 6], "reward/ocr": [0.5] * 6})
    assert m3["critic/pickscore_raw/mean"] == 3.5 and m3["critic/reward/ocr/mean"] == 0.5
    m2 = reward_metrics(rewards[:, None].expand(6, 3), uids)  # (B, T): averaged over T first
    assert m2["critic/rewards/mean"] == pytest.approx(4.0 / 6) and "critic/advantages/mean" not in m2
    with pytest.raises(ValueError):
        reward_metrics(rewards, uids[:3])


def test_validation_metric_names():
    m = validation_metrics(["ocr", "ocr", "pickscore"], {"reward": [0.5, 1.0, 0.25], "pickscore_raw": [1, 2, 3]})
    assert m == {"val-core/ocr/reward/mean@1": 0.75, "val-aux/ocr/pickscore_raw/mean@1": 1.5,
                 "val-core/pickscore/reward/mean@1": 0.25, "val-aux/pickscore/pickscore_raw/mean@1": 3.0}
    # a bare-float reward gets "acc" (verl-omni's VisualRewardManager): acc is the core variable
    m = validation_metrics(["jpeg_compressibility"] * 2, {"reward": [0.1, 0.3], "acc": [0.1, 0.3]})
    assert set(m) == {"val-core/jpeg_compressibility/acc/mean@1", "val-aux/jpeg_compressibility/reward/mean@1"}
    m = validation_metrics(["flow_grpo/ocr"] * 4, {"reward": [0.0, 1.0, 1.0, 1.0]}, uids=[0, 0, 1, 1])
    assert m == {"val-core/flow_grpo/ocr/reward/mean@2": 0.75, "val-aux/flow_grpo/ocr/reward/std@2": 0.25}


def test_metric_accumulator_timer_perf_progress():
    acc = T.MetricAccumulator()
    acc.add({"actor/policy_loss": torch.tensor(1.0), "actor/ratio_mean": 1.0})
    acc.add({"actor/policy_loss": 3.0, "actor/ratio_mean": 1.0})
    assert acc.reduce() == {"actor/policy_loss": 2.0, "actor/ratio_mean": 1.0}
    assert acc.reduce() == {}
    timings: dict[str, float] = {}
    with T.timer("gen", timings):
        pass
    with T.timer("gen", timings):
        pass
    assert list(timings) == ["timing_s/gen"] and timings["timing_s/gen"] >= 0
    assert perf_metrics(64, 2.0, 4) == {"perf/total_num_images": 64.0, "perf/time_per_step": 2.0,
                                         "perf/throughput": 8.0}
    p = Progress(total_steps=10)
    p.line(1, 10.0)
    p.line(2, 2.0)
    line = p.line(3, 2.0, {"critic/rewards/mean": 0.5})
    assert line.startswith("step 3/10 | 2.00s/step | ETA 0:00:14") and "rewards/mean 0.5" in line


def test_image_grid_and_tensorboard_keys(tmp_path):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images = torch.zeros(3, 3, 32, 48, dtype=torch.uint8)
    images[1] = 255
    grid = T.image_grid(images, ["a prompt | reward 0.50", "b", "c"], ncols=2)
    assert isinstance(grid, Image.Image) and grid.size == (96, 2 * (32 + 4 * 12 + 4))
    caption = np.asarray(grid)[32:32 + 14, :48]
    assert (caption < 128).any()  # caption text drawn under the first image
    with pytest.raises(ValueError, match="captions"):
        T.image_grid(images, ["only one"])

    log_dir = str(tmp_path / "tb")
    logger = TensorBoardLogger(log_dir)
    model, _ = make_model()
    metrics = {}
    metrics.update(reward_metrics(torch.tensor([0.0, 1.0]), ["a", "a"], torch.tensor([-1.0, 1.0])))
    metrics.update(T.old_policy_refresh(model, 1))
    metrics.update(perf_metrics(2, 1.0, 1))
    metrics.update(validation_metrics(["ocr"], {"reward": [0.5]}))
    model(torch.randn(1, 5, 4)).sum().backward()
    metrics.update(GradStepper().step(build_optimizer(model, lr=1e-3)))
    with T.timer("step", metrics):
        pass
    logger.log_scalars(metrics, step=1)
    logger.log_image("val/samples", grid, step=1)
    logger.close()
    ea = EventAccumulator(log_dir)
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert tags == set(metrics)
    for key in ("critic/rewards/mean", "critic/rewards/zero_std_ratio", "critic/advantages/max",
                "old_policy/update_applied", "old_policy/copy_update", "old_policy/ema_update", "old_policy/decay",
                "perf/throughput", "perf/time_per_step", "timing_s/step", "val-core/ocr/reward/mean@1",
                "actor/grad_norm", "actor/skipped_steps"):
        assert key in tags, key
    assert ea.Tags()["images"] == ["val/samples"]


def test_write_run_metadata(tmp_path):
    meta = write_run_metadata(str(tmp_path), {"lr": 1e-4, "targets": ("to_q",)}, seeds={"seed": 42})
    on_disk = json.load(open(tmp_path / "run_metadata.json"))
    assert on_disk == json.loads(json.dumps(meta))
    assert on_disk["config"] == {"lr": 1e-4, "targets": ["to_q"]} and on_disk["seeds"] == {"seed": 42}
    assert set(on_disk["versions"]) >= {"torch", "diffusers", "transformers", "peft"}
    in_git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode == 0
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?" if in_git else "unknown", on_disk["git_commit"])


def test_config_fingerprint():
    h1, v1 = config_fingerprint({"a": 1, "b": (1, 2), "total_training_steps": 3})
    h2, _ = config_fingerprint({"b": [1, 2], "a": 1, "total_training_steps": 300})
    h3, _ = config_fingerprint({"a": 2, "b": (1, 2)})
    assert h1 == h2 != h3 and v1 == {"a": 1, "b": [1, 2]}


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
    # both ranks agree on every reduced metric, the global batches and the gathered adapter weights
    assert r0["steps"] == r1["steps"] and r0["batches"] == r1["batches"] and r0["default_sum"] == r1["default_sum"]
    assert r0["gathered"] == r1["gathered"] == [0.0, 0.0, 1.0, 1.0]  # all_gather_cat, rank order
    assert all("ranks logged different metric keys" in r["key_mismatch"] for r in (r0, r1))
    # a save failing on rank 0 raises on both ranks (rank 1 names rank 0's error) and leaves no step directory
    assert r0["failed_save"] == "OSError: disk full (simulated on rank 0)"
    assert r1["failed_save"].startswith("CheckpointError") and "rank 0" in r1["failed_save"]
    assert not r0["step9_exists"] and not r1["step9_exists"]
    assert all(s["actor/rank"] == 0.5 for s in r0["steps"])  # mean over ranks of 0 and 1
    # the unused LoRA (blocks.2.ff) has no Adam state; the checkpoint round trip keeps exactly that
    assert r0["params_with_state"] == r1["params_with_state"] == [10, 10, 12]
    # sharded training equals an unsharded model trained on the full global batch
    for s, ref_norm, ref_loss in zip(r0["steps"], r0["ref_norms"], r0["ref_losses"]):
        assert s["actor/grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
        assert s["actor/loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert r0["ref_max_param_diff"] < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# the real tiny checkpoints: what the trainers do, through the model wrappers
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen_image", "boogu_image_edit"])
def test_prepare_real_tiny_transformer(tiny_models, name):
    """prepare_transformer (LoRA default+old, activation checkpointing, FSDP2) on the wrapper's transformer with its
    default targets and block prefixes; predict_velocity backpropagates into "default" only; "old" and the disabled
    (reference) pass go through the same wrapper, and the disabled pass equals an untouched model exactly."""
    from models import load_model

    path = os.path.join(tiny_models, name)
    model, untouched = load_model(path), load_model(path)
    prepare_transformer(model.transformer, block_prefixes=model.lora_block_prefixes,
                        target_modules=model.default_lora_targets, lora_rank=4, lora_alpha=8.0,
                        adapter_names=("default", "old"), device="cpu", activation_checkpointing=True)
    with torch.no_grad():
        for n, p in adapter_params(model.transformer, "default"):
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    prompt = model.encode_prompt(["a red bicycle", "a sign that says 'hi'"])
    x = model.prepare_noise(64, 64, [torch.Generator().manual_seed(s) for s in (1, 2)])
    kw = {"height": 64, "width": 64}
    if name == "boogu_image_edit":
        img = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        kw["ref_latents"] = model.encode_reference([img, img], [torch.Generator().manual_seed(s) for s in (5, 6)])
    sigmas = torch.tensor([0.7, 0.3])
    v = model.predict_velocity(x, sigmas, prompt, **kw)
    with torch.no_grad():
        with T.use_adapter(model.transformer, "old"):
            v_old = model.predict_velocity(x, sigmas, prompt, **kw)
        with lora.lora_disabled(model.transformer):
            v_base = model.predict_velocity(x, sigmas, prompt, **kw)
        v_untouched = untouched.predict_velocity(x, sigmas, prompt, **kw)
    assert torch.equal(v_base, v_untouched)
    assert torch.equal(v_old, v_base)  # "old" has B = 0 (not yet copied), so it equals the base model
    assert (v.detach() - v_base).abs().max() > 1e-3  # "default" has non-zero B
    v.pow(2).mean().backward()
    no_grad = {n for n, p in adapter_params(model.transformer, "default") if p.grad is None}
    if name == "qwen_image":  # the last dual-stream block's text outputs never reach the image: no gradient
        last = f"transformer_blocks.{len(model.transformer.transformer_blocks) - 1}"
        assert no_grad == {f"{last}.{m}.lora_{ab}.default.weight" for ab in "AB"
                           for m in ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")}
    else:
        assert not no_grad
    assert all(p.grad is None for _, p in adapter_params(model.transformer, "old"))
    assert all(p.grad is None for n, p in model.transformer.named_parameters() if ".lora_" not in n)
    m = GradStepper(max_grad_norm=1.0).step(build_optimizer(model.transformer, lr=1e-3))
    assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
