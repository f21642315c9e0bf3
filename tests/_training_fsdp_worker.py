"""torchrun worker for tests/test_training_distributed.py::test_fsdp2_lora_two_ranks (not collected by pytest).

Runs on CPU/gloo under `torchrun --nproc_per_node=2`: LoRA ("default" + "old") + activation checkpointing + FSDP2
on a tiny model, two optimizer steps on per-rank data shards, metric reduction, the old-adapter copy, an atomic
checkpoint save and an exact load into a freshly built model. Rank 0 also trains an unsharded single-process
reference on the full batch (the mean of the per-rank losses = the full-batch loss, so gradients must agree).
Each rank writes its observations to <out>/rank<r>.json for the test to compare.
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
torch.set_num_threads(1)

import training as T  # noqa: E402
from training.checkpoint import find_latest, library_versions, load_checkpoint, save_checkpoint  # noqa: E402
from training.data import PromptSampler  # noqa: E402
from training.distributed import all_gather_cat, seed_everything  # noqa: E402
from training.model import (adapter_params, adapter_state_dict, add_lora_adapters,  # noqa: E402
                            apply_activation_checkpointing, mixed_precision_policy, shard_transformer)
from training.optim import GradStepper, build_optimizer  # noqa: E402
from models import lora  # noqa: E402
from _tiny_lora import BLOCK_PREFIXES, TARGETS, TinyFlowTransformer  # noqa: E402


def build(lora_seed: int, sharded: bool, device: str = "cpu"):
    torch.manual_seed(0)  # the base weights are the same pretrained checkpoint in every build
    model = TinyFlowTransformer(skip_last_ff=True)  # blocks.2.ff's LoRA never gets a gradient / Adam state
    if device == "cuda":  # GPU check: bf16 base weights on the GPU, fp32 LoRA, bf16 compute via FSDP2's policy
        model.to(device=torch.cuda.current_device(), dtype=torch.bfloat16)
    torch.manual_seed(lora_seed)
    lora_cfg = add_lora_adapters(model, target_modules=TARGETS, rank=3, alpha=6.0,
                                 adapter_names=("default", "old"), block_prefixes=BLOCK_PREFIXES)
    with torch.no_grad():  # non-zero B so the LoRA path matters (zero-initialised B hides bugs)
        for _, p in adapter_params(model, "default") + adapter_params(model, "old"):
            p.normal_(0, 0.2)
    if sharded:
        apply_activation_checkpointing(model, BLOCK_PREFIXES)
        shard_transformer(model, BLOCK_PREFIXES, mp_policy=mixed_precision_policy(torch.device(device), "bf16"))
    return model, lora_cfg


def main() -> None:
    out_dir = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"  # "cuda": a manual GPU check (NCCL, bf16, fused AdamW)
    info = T.init_distributed(device)
    assert info.backend == ("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo") and info.world_size == 2
    seed_everything(0, per_rank=False)
    data = torch.randn(16, 6, 4).to(info.device)  # 16 "prompts", identical on both ranks
    model, lora_cfg = build(1, sharded=True, device=device)
    from torch.distributed.tensor import DTensor

    n_dtensor = sum(isinstance(p, DTensor) for p in model.parameters())
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.01)
    stepper = GradStepper(max_grad_norm=0.05)
    sampler = PromptSampler(16, 4, seed=7, rank=info.rank, world_size=info.world_size)
    lora.copy_adapter_(model, "default", "old")  # old <- default at start
    acc = T.MetricAccumulator()
    steps = []
    batches = []
    for _ in range(2):
        batch = sampler.next_batch()
        batches.append(batch.indices)
        x = data[batch.local]
        loss = model(x).pow(2).mean()
        loss.backward()
        acc.add({"actor/loss": loss.detach(), "actor/rank": float(info.rank),
                 "actor/rank_max": torch.tensor(float(info.rank), device=info.device),
                 "actor/rank_min": float(info.rank),
                 "actor/nan_on_rank1_max": float("nan") if info.rank == 1 else 1.0})  # MAX alone drops a NaN
        m = stepper.step(opt)
        m.update(acc.reduce())
        steps.append(m)
    refresh = T.old_policy_refresh(model, 2, interval=2, schedule="copy")
    default_full = adapter_state_dict(model, "default")
    old_full = adapter_state_dict(model, "old")
    ckpt_root = os.path.join(out_dir, "ckpt")
    config = {"lr": 1e-2, "seed": 0}
    path = save_checkpoint(ckpt_root, 2, transformer=model, optimizer=opt, lora_config=lora_cfg, config=config,
                           sampler=sampler, adapter_names=("default", "old"),
                           trainer_state={"stepper": stepper.state_dict()})
    # next step of the uninterrupted run
    batch = sampler.next_batch()
    noise = torch.randn(()).to(info.device) + torch.randn((), device=info.device)  # CPU and device RNG draws
    loss3 = model(data[batch.local] + noise).pow(2).mean()
    loss3.backward()
    stepper.step(opt)
    after3 = adapter_state_dict(model, "default")

    # resume into a freshly built model (different LoRA init) + fresh optimizer / sampler
    model2, _ = build(123, sharded=True, device=device)
    opt2 = build_optimizer(model2, lr=1e-2, weight_decay=0.01)
    stepper2 = GradStepper(max_grad_norm=0.05)
    sampler2 = PromptSampler(16, 4, seed=7, rank=info.rank, world_size=info.world_size)
    torch.manual_seed(999)
    state = load_checkpoint(find_latest(ckpt_root), transformer=model2, optimizer=opt2, config=config,
                            sampler=sampler2, adapter_names=("default", "old"))
    stepper2.load_state_dict(state["trainer_state"]["stepper"])
    old_loaded = adapter_state_dict(model2, "old")
    batch2 = sampler2.next_batch()
    noise2 = torch.randn(()).to(info.device) + torch.randn((), device=info.device)
    loss3b = model2(data[batch2.local] + noise2).pow(2).mean()
    loss3b.backward()
    stepper2.step(opt2)
    after3b = adapter_state_dict(model2, "default")

    # a non-finite loss seen on rank 1 only, then a non-finite update on rank 1 only: both ranks skip (they agree).
    # The loss is NaN by a constant term, so its gradient (reduced over both ranks) stays finite
    before_skips = adapter_state_dict(model2, "default")
    skipped = []
    stepper2.backward(model2(data[batch2.local]).pow(2).mean() + (float("nan") if info.rank == 1 else 0.0))
    skipped.append(stepper2.step(opt2)["actor/step_skipped"])
    loss_skip_reason = stepper2.last_skip_reason
    opt2.param_groups[0]["lr"] = float("inf") if info.rank == 1 else 1e-2
    model2(data[batch2.local]).pow(2).mean().backward()
    skipped.append(stepper2.step(opt2)["actor/step_skipped"])
    opt2.param_groups[0]["lr"] = 1e-2
    after_skips = adapter_state_dict(model2, "default")

    bad = T.MetricAccumulator()
    bad.add({"actor/a" if info.rank == 0 else "actor/b": 1.0})
    try:
        bad.reduce()
        key_mismatch = "no error"
    except RuntimeError as e:
        key_mismatch = str(e)
    gathered = all_gather_cat(torch.full((2,), float(info.rank), device=info.device))
    # a save that fails on rank 0 only must raise on every rank (not leave rank 1 hanging in a collective)
    real_writer = T.checkpoint.save_adapter_dir  # the name checkpoint.py writes adapters with
    if info.rank == 0:
        def failing_writer(*a, **k):
            raise OSError("disk full (simulated on rank 0)")
        T.checkpoint.save_adapter_dir = failing_writer
    try:
        save_checkpoint(ckpt_root, 9, transformer=model2, optimizer=opt2, lora_config=lora_cfg, config=config,
                        sampler=sampler2, adapter_names=("default", "old"))
        failed_save = "no error"
    except Exception as e:  # noqa: BLE001
        failed_save = f"{type(e).__name__}: {e}"
    T.checkpoint.save_adapter_dir = real_writer
    # on_rank0: a shared result reaches both ranks; share=False keeps an unpicklable one (a lock) on rank 0
    import threading

    from training.distributed import on_rank0
    shared = on_rank0(lambda: {"from": 0}, catch=(ValueError,), exc_type=ValueError)
    kept = on_rank0(threading.Lock, catch=(ValueError,), exc_type=ValueError, share=False)

    def refuse():
        raise OSError("lock held (simulated)")
    try:
        on_rank0(refuse, catch=(OSError,), exc_type=RuntimeError, share=False)
        refused = "no error"
    except RuntimeError as e:
        refused = f"RuntimeError: {e}"

    result = {
        "on_rank0": [shared, type(kept).__name__ if kept is not None else None, refused],
        "rank": info.rank,
        "gathered": gathered.tolist(),
        "key_mismatch": key_mismatch,
        "failed_save": failed_save,
        "step9_exists": os.path.exists(os.path.join(ckpt_root, "step_00000009")),
        "n_dtensor": n_dtensor,
        "steps": steps,
        "batches": batches,
        "local_first": sampler.state_dict(),
        "refresh": refresh,
        "old_equals_default": all(torch.equal(default_full[k], old_full[k]) for k in default_full),
        "old_restored": all(torch.equal(old_full[k], old_loaded[k]) for k in old_full),
        "default_sum": float(sum(v.double().sum() for v in default_full.values())),
        "resume_loss_equal": bool(torch.equal(loss3.detach(), loss3b.detach())),
        "resume_params_equal": all(torch.equal(after3[k], after3b[k]) for k in after3),
        "resume_step": state["step"],
        "skipped": skipped,
        "skips_left_params": all(torch.equal(before_skips[k], after_skips[k]) for k in before_skips),
        "skip_reason": stepper2.last_skip_reason,
        "loss_skip_reason": loss_skip_reason,
        "ckpt_path": path,
        "fused": bool(opt.defaults["fused"]),
        "params_with_state": [len(opt.state), len(opt2.state), len(opt.param_groups[0]["params"])],
        "versions": library_versions(),
    }
    if info.rank == 0 and device == "cpu":  # unsharded reference on the full global batch
        ref, _ = build(1, sharded=False)
        ref_opt = build_optimizer(ref, lr=1e-2, weight_decay=0.01)
        ref_stepper = GradStepper(max_grad_norm=0.05)
        ref_norms, ref_losses = [], []
        for idx in batches:
            loss = ref(data[idx]).pow(2).mean()
            loss.backward()
            ref_losses.append(float(loss))
            ref_norms.append(ref_stepper.step(ref_opt)["actor/grad_norm"])
        ref_full = adapter_state_dict(ref, "default")
        result["ref_norms"] = ref_norms
        result["ref_losses"] = ref_losses
        result["ref_max_param_diff"] = max(float((ref_full[k] - default_full[k]).abs().max()) for k in ref_full)
    with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
        json.dump(result, f)
    T.cleanup_distributed()


if __name__ == "__main__":
    main()
