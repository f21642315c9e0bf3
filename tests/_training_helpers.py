"""Helpers of the tests/test_training_*.py files (not collected): the tiny LoRA transformer they train (from
tests/_tiny_lora.py), a few steps of a tiny run and its checkpoints, the torchrun environment variables. The fixtures
built on them (`one_process_group`, `trained_checkpoint`) are in tests/conftest.py."""

from __future__ import annotations

import random

import numpy as np
import torch

from training.checkpoint import load_checkpoint, save_checkpoint
from training.data import PromptSampler
from training.model import adapter_params, adapter_state_dict, add_lora_adapters, shard_transformer
from training.optim import GradStepper, build_optimizer
from _tiny_lora import BLOCK_PREFIXES, TARGETS, TinyFlowTransformer

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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


CONFIG = {"lr": 1e-2, "lora_rank": 3, "seed": 0, "total_training_steps": 5, "model_path": "/tiny"}


def train_step(model, opt, stepper, sampler, data) -> float:
    """One step that draws from every RNG the trainers use (torch, numpy, python) and from the sampler."""
    batch = sampler.next_batch()
    x = data[batch.local] + 0.1 * torch.randn(len(batch.local), 5, 4)
    x = x * float(1 + 0.01 * np.random.rand()) * float(1 + 0.01 * random.random())
    loss = model(x).pow(2).mean()
    loss.backward()
    stepper.step(opt)
    return float(loss.detach())


def fresh_run(lora_seed: int):
    model, cfg = make_model(lora_seed=lora_seed)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.01)
    return model, cfg, opt, GradStepper(max_grad_norm=0.5), PromptSampler(12, 2, seed=5)


def save_state(root, step, model, cfg, opt, stepper, sampler, config=CONFIG):
    return save_checkpoint(root, step, transformer=model, optimizer=opt, lora_config=cfg, config=config,
                           sampler=sampler, adapter_names=("default", "old"),
                           trainer_state={"stepper": stepper.state_dict()})


def load_state(path, model, opt, sampler, config=CONFIG):
    return load_checkpoint(path, transformer=model, optimizer=opt, config=config, sampler=sampler,
                           adapter_names=("default", "old"))
