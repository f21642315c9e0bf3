"""`setup_run` / `Run`: the setup both trainers do before their loop and the tail of every step (log, validate,
checkpoint), so each trainer file holds only its algorithm."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Mapping
import torch
from models import lora

from .distributed import cleanup_distributed, init_distributed, seed_everything
from .model import ADAPTER_DEFAULT, prepare_transformer
from .optim import GradStepper, build_optimizer
from .data import PromptSampler
from .checkpoint import load_checkpoint, save_checkpoint
from .logs import Progress, TensorBoardLogger, perf_metrics, write_run_metadata
from .step import (check_batch_sizes, guidance_of, load_flow_model, parse_lora_init, resolve_device, resume_path,
                   sync_rollout_adapter, validate)

__all__ = ["Run", "setup_run"]


@dataclass
class Run:
    """Everything a trainer builds before its loop (see `setup_run`) plus the per-step tail both trainers share.

    The trainer files keep what differs between the algorithms: the rollout request, the advantages, the update,
    and which adapter the rollout workers sample with (`sync_rollout`)."""

    args: Any
    config: dict[str, Any]
    device: torch.device
    rank: int
    world: int
    logger: TensorBoardLogger
    model: Any                     # the FlowModel wrapper (transformer only: trainer ranks never encode or decode)
    scale: float                   # the CFG scale of rollout and replay (1.0 = unguided)
    adapter_names: tuple[str, ...]
    lora_config: Any
    num_lora_modules: int          # the rollout workers must bind exactly this many modules at every sync
    optimizer: torch.optim.Optimizer
    stepper: GradStepper
    train_data: Any
    val_data: Any
    sampler: PromptSampler
    mini_prompts: int              # prompts per optimizer step (global)
    scorer: Any
    rollout: Any                   # rollout.DistributedRollout
    ckpt_root: str
    adapters_root: str
    start_step: int
    progress: Progress

    def steps(self) -> range:
        """The steps still to run: start_step + 1 .. total_training_steps."""
        return range(self.start_step + 1, self.args.total_training_steps + 1)

    def sync_rollout(self, adapter: str, step: int) -> dict[str, float]:
        """Publish `adapter` to the rollout workers as version `step` (see `sync_rollout_adapter`). Collective."""
        return sync_rollout_adapter(self.rollout, self.model.transformer, adapter, self.lora_config,
                                    self.adapters_root, step, self.num_lora_modules,
                                    engine_names=self.args.rollout_engine == "vllm_omni")

    def validate(self, step: int) -> dict[str, float]:
        """ODE validation on the test split (see `validate`). Collective."""
        return validate(self.model, self.rollout, self.scorer, self.val_data, self.args, step, self.scale,
                        self.logger)

    def end_step(self, step: int, metrics: dict[str, float], timings: Mapping[str, float], step_start: float,
                 epoch: int) -> None:
        """The tail of a step: timing and throughput metrics, TensorBoard, the progress line, validation every
        --test_freq steps and at the end, a checkpoint every --save_freq steps and at the end. Collective."""
        args = self.args
        step_time = time.perf_counter() - step_start
        metrics.update(timings)
        metrics.update(perf_metrics(args.train_batch_size * args.rollout_n, step_time, self.world))
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(epoch)
        if step % args.log_every == 0:
            self.logger.log_scalars(metrics, step)
        if self.rank == 0:
            print(self.progress.line(step, step_time, metrics), flush=True)
        last = step == args.total_training_steps
        if self.val_data is not None and ((args.test_freq and step % args.test_freq == 0) or last):
            self.validate(step)
        if step % args.save_freq == 0 or last:
            save_checkpoint(self.ckpt_root, step, transformer=self.model.transformer, optimizer=self.optimizer,
                            lora_config=self.lora_config, config=self.config, sampler=self.sampler,
                            adapter_names=self.adapter_names,
                            trainer_state={"grad_stepper": self.stepper.state_dict()}, keep_last=args.keep_last)

    def close(self) -> None:
        self.rollout.close()
        self.logger.close()
        cleanup_distributed()


def setup_run(args, *, adapter_names: tuple[str, ...]) -> Run:
    """Both trainers' setup, in order: distributed init and seeds; TensorBoard and run metadata (config, versions,
    git commit); the model (transformer only), LoRA adapters `adapter_names` + FSDP2; AdamW; train/val data, the
    sampler and the batch-size checks; the reward scorer; `--resume` (adapters, optimizer, RNG, sampler cursor,
    grad-skip count); the rollout workers of this node. Adapters are NOT yet synced to the workers: the trainer does
    that with the adapter its algorithm samples from."""
    from data_prep.dataset import PromptDataset
    from models import resolve_model_path
    import rewards
    from rollout import DistributedRollout, check_rollout_python

    config = vars(args)
    dist_info = init_distributed(resolve_device(args.device))
    device, rank, world = dist_info.device, dist_info.rank, dist_info.world_size
    seed_everything(args.seed)
    # --rollout_python, model-free, on the rank of each node that will start its rollout workers
    rollout_env = check_rollout_python(args.rollout_python, args.rollout_engine) if dist_info.is_local_main \
        else None
    logger = TensorBoardLogger(os.path.join(args.output_dir, "tensorboard"))
    write_run_metadata(args.output_dir, config, seeds={"seed": args.seed, "val_seed": args.val_seed}, logger=logger,
                       rollout_env=rollout_env)

    model_path = resolve_model_path(args.model_path)
    model = load_flow_model(model_path, args, device)
    scale = guidance_of(model, args)
    targets = args.lora_target_modules.split(",") if args.lora_target_modules else list(model.default_lora_targets)
    lora_config = prepare_transformer(
        model.transformer, block_prefixes=model.lora_block_prefixes, target_modules=targets,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, adapter_names=adapter_names, device=device,
        precision=args.precision, activation_checkpointing=args.activation_checkpointing,
        init_lora_weights=parse_lora_init(args.lora_init_weights))
    num_lora_modules = len(lora.lora_layers(model.transformer, ADAPTER_DEFAULT))
    optimizer = build_optimizer(model.transformer, lr=args.lr, weight_decay=args.weight_decay,
                                betas=tuple(float(b) for b in args.adam_betas.split(",")))
    stepper = GradStepper(args.max_grad_norm)

    train_data = PromptDataset(args.train_files, guidance=scale > 1.0)
    val_data = PromptDataset(args.val_files, guidance=scale > 1.0) if args.val_files else None
    sampler = PromptSampler(len(train_data), args.train_batch_size, seed=args.seed, rank=rank, world_size=world)
    mini_prompts = args.ppo_mini_batch_size or args.train_batch_size
    check_batch_sizes(args.train_batch_size, mini_prompts, args.rollout_n, args.micro_batch_size, world)
    scorer = rewards.RewardScorer(rewards.RewardConfig.from_args(args))

    start_step = 0
    ckpt_root = os.path.join(args.output_dir, "checkpoints")
    resume_from = resume_path(args.resume, ckpt_root)
    if resume_from:
        state = load_checkpoint(resume_from, transformer=model.transformer, optimizer=optimizer, config=config,
                                sampler=sampler, adapter_names=adapter_names)
        start_step = state["step"]
        stepper.load_state_dict(state["trainer_state"]["grad_stepper"])

    rollout = DistributedRollout(model_path, args.rollout_devices.split(","), engine=args.rollout_engine,
                                 dtype=args.rollout_dtype if device.type == "cuda" else "float32",
                                 max_batch_size=args.rollout_max_batch_size, timeout_s=args.rollout_timeout_s,
                                 log_dir=os.path.join(args.output_dir, "rollout_logs"),
                                 threads_per_worker=args.rollout_threads, cfg_batch=args.cfg_batch,
                                 python=args.rollout_python)
    return Run(args=args, config=config, device=device, rank=rank, world=world, logger=logger, model=model,
               scale=scale, adapter_names=tuple(adapter_names), lora_config=lora_config,
               num_lora_modules=num_lora_modules, optimizer=optimizer, stepper=stepper, train_data=train_data,
               val_data=val_data, sampler=sampler, mini_prompts=mini_prompts, scorer=scorer, rollout=rollout,
               ckpt_root=ckpt_root, adapters_root=os.path.join(args.output_dir, "rollout_adapters"),
               start_step=start_step, progress=Progress(args.total_training_steps, start_step))
