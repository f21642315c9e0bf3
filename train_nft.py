"""Online DiffusionNFT with LoRA under FSDP2, for Boogu-Image and Qwen-Image.

    torchrun --nproc_per_node=3 train_nft.py --model_path $MODEL_PATH --train_files train.parquet \
        --val_files test.parquet --rollout_devices cuda:3 ...            # see scripts/run_*.sh for the recipes

One rollout step:
  1. rollout: each node's local rank 0 sends its ranks' prompts (x rollout_n) to the node's rollout workers, which
     sample with the `old` adapter and a deterministic ODE (Euler) sampler, with the model's CFG;
  2. rewards (chosen by each row's data_source) -> group advantages over the global batch (global std) ->
     DiffusionNFT optimality probabilities r = clamp(A, -C, C) / 2C + 1/2;
  3. update: per sample K training timesteps (integer 1000·σ of the rollout schedule, one fixed-seed permutation
     per row), x_t = (1 - t) x0 + t ε with fresh ε, forwards of the `old` adapter, the `default` adapter (with
     grad) and, when ref_kl_coef > 0, the base model (adapters off) - each through the model wrapper, so Boogu is
     negated and guided exactly as in rollout - then `losses.diffusion_nft_loss`, accumulated over micro-batches
     x K and one AdamW step per mini-batch;
  4. the `old` adapter is refreshed (hard copy / EMA by `old_policy_decay`) every old_policy_update_interval steps
     and synced to the rollout workers, which must bind every LoRA module of the actor;
  5. logging, validation (ODE, val steps, seed 42), checkpoints (atomic; --resume continues exactly).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import losses
import rewards
import training as T
from data_prep.dataset import PromptDataset
from models import lora, resolve_model_path
from models.base import PromptEmbeds
from rollout import DistributedRollout


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    T.add_common_args(parser)
    g = parser.add_argument_group("DiffusionNFT")
    g.add_argument("--mix_beta", type=float, default=0.5, help="β of the implicit policies v± (> 0)")
    g.add_argument("--adv_clip_max", type=float, default=5.0, help="C: advantages clamped to ±C, loss scaled by C")
    g.add_argument("--ref_kl_coef", type=float, default=0.0, help="weight of the velocity MSE to the base model")
    g.add_argument("--adaptive_weight_min", type=float, default=1e-5)
    g.add_argument("--adv_mode", default="continuous", choices=losses.ADV_MODES)
    g.add_argument("--timestep_fraction", type=float, default=1.0, help="K = max(1, int(N * fraction)) per sample")
    g.add_argument("--timestep_shuffle_seed", type=int, default=42, help="fixed per-row permutation (verl-omni)")
    g.add_argument("--old_policy_decay_schedule", default="copy", choices=sorted(losses.DECAY_SCHEDULES))
    g.add_argument("--old_policy_decay", type=float, default=None, help="constant decay (overrides the schedule)")
    g.add_argument("--old_policy_update_interval", type=int, default=1, help="refresh `old` every N rollout steps")
    g.add_argument("--no_global_std", dest="global_std", action="store_false", help="per-group std")
    g.add_argument("--no_norm_adv_by_std", dest="norm_adv_by_std", action="store_false")
    args = parser.parse_args(argv)
    if not args.model_path or not args.train_files:
        parser.error("--model_path and --train_files are required (or $MODEL_PATH / $TRAIN_FILES)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    config = vars(args)
    # ---------------------------------------------------------------- setup
    dist_info = T.init_distributed(T.resolve_device(args.device))
    device, rank, world = dist_info.device, dist_info.rank, dist_info.world_size
    T.seed_everything(args.seed)
    logger = T.TensorBoardLogger(os.path.join(args.output_dir, "tensorboard"))
    T.write_run_metadata(args.output_dir, config, seeds={"seed": args.seed, "val_seed": args.val_seed}, logger=logger)

    model_path = resolve_model_path(args.model_path)
    model = T.load_flow_model(model_path, args, device)
    scale = T.guidance_of(model, args)
    targets = args.lora_target_modules.split(",") if args.lora_target_modules else list(model.default_lora_targets)
    lora_config = T.prepare_transformer(
        model.transformer, block_prefixes=model.lora_block_prefixes, target_modules=targets,
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, adapter_names=(T.ADAPTER_DEFAULT, T.ADAPTER_OLD),
        device=device, precision=args.precision, activation_checkpointing=args.activation_checkpointing,
        init_lora_weights=T.parse_lora_init(args.lora_init_weights))
    num_lora_modules = len(lora.lora_layers(model.transformer, T.ADAPTER_DEFAULT))
    optimizer = T.build_optimizer(model.transformer, lr=args.lr, weight_decay=args.weight_decay,
                                  betas=tuple(float(b) for b in args.adam_betas.split(",")))
    stepper = T.GradStepper(args.max_grad_norm)

    train_data = PromptDataset(args.train_files, guidance=scale > 1.0)
    val_data = PromptDataset(args.val_files, guidance=scale > 1.0) if args.val_files else None
    sampler = T.PromptSampler(len(train_data), args.train_batch_size, seed=args.seed, rank=rank, world_size=world)
    mini_prompts = args.ppo_mini_batch_size or args.train_batch_size
    T.check_batch_sizes(args.train_batch_size, mini_prompts, args.rollout_n, args.micro_batch_size, world)
    scorer = rewards.RewardScorer(rewards.RewardConfig.from_args(args))

    start_step = 0
    ckpt_root = os.path.join(args.output_dir, "checkpoints")
    resume_from = T.resume_path(args.resume, ckpt_root)
    if resume_from:
        state = T.load_checkpoint(resume_from, transformer=model.transformer, optimizer=optimizer, config=config,
                                  sampler=sampler, adapter_names=(T.ADAPTER_DEFAULT, T.ADAPTER_OLD))
        start_step = state["step"]
        stepper.load_state_dict(state["trainer_state"]["grad_stepper"])
    else:
        lora.copy_adapter_(model.transformer, T.ADAPTER_DEFAULT, T.ADAPTER_OLD)  # rollouts start from the policy

    rollout = DistributedRollout(model_path, args.rollout_devices.split(","), engine=args.rollout_engine,
                                 dtype=args.rollout_dtype if device.type == "cuda" else "float32",
                                 max_batch_size=args.rollout_max_batch_size, timeout_s=args.rollout_timeout_s,
                                 log_dir=os.path.join(args.output_dir, "rollout_logs"),
                                 threads_per_worker=args.rollout_threads, cfg_batch=args.cfg_batch)
    adapters_root = os.path.join(args.output_dir, "rollout_adapters")
    sync = lambda step: T.sync_rollout_adapter(  # noqa: E731
        rollout, model.transformer, T.ADAPTER_OLD, lora_config, adapters_root, step, num_lora_modules,
        engine_names=args.rollout_engine == "vllm_omni")
    sync(start_step)
    validate = lambda step: T.validate(  # noqa: E731
        model, rollout, scorer, val_data, args, step, scale, logger)
    if args.val_before_train and val_data is not None and start_step == 0:
        validate(0)

    # ---------------------------------------------------------------- loop
    progress = T.Progress(args.total_training_steps, start_step)
    for step in range(start_step + 1, args.total_training_steps + 1):
        step_start, timings = time.perf_counter(), {}
        batch = sampler.next_batch()
        rows = [train_data[i] for i in batch.local]
        n_local = len(rows) * args.rollout_n

        # 1. rollout with the `old` adapter, deterministic ODE
        with T.timer("gen", timings):
            request = T.rollout_request(
                rows, n=args.rollout_n, first_row=rank * n_local, seed=args.seed, step=step,
                num_inference_steps=args.num_inference_steps, height=args.height, width=args.width,
                family=model.family, scale=scale, noise_level=0.0)
            result = rollout.generate(request)

        # 2. rewards -> advantages -> optimality probabilities
        with T.timer("reward", timings):
            scored = T.score_samples(scorer, result.images, rows, args.rollout_n)
        with T.timer("adv", timings):
            advantages, metrics = T.global_advantages(scored, args.rollout_n, global_std=args.global_std,
                                                      norm_by_std=args.norm_adv_by_std)
            reward_prob = losses.reward_probability(advantages, adv_clip_max=args.adv_clip_max,
                                                    adv_mode=args.adv_mode).to(device)

        # 3. update the `default` adapter
        x0 = result.latents_clean.to(device)
        prompt = PromptEmbeds(result.prompt_embeds, result.prompt_mask).to(device)
        negative = (PromptEmbeds(result.negative_embeds, result.negative_mask).to(device)
                    if result.negative_embeds is not None else None)
        ref_latents = result.ref_latents.to(device) if result.ref_latents is not None else None
        schedule_timesteps = result.metadata["sigmas"][:-1] * 1000
        train_timesteps = losses.select_train_timesteps(
            schedule_timesteps.expand(n_local, -1), timestep_fraction=args.timestep_fraction,
            seed=args.timestep_shuffle_seed).to(device)
        num_k = train_timesteps.shape[1]
        accumulator = T.MetricAccumulator()
        samples_per_mini = (mini_prompts // world) * args.rollout_n
        with T.timer("update_actor", timings):
            for _ in range(args.ppo_epochs):
                for mini in range(0, n_local, samples_per_mini):
                    micro_starts = range(mini, mini + samples_per_mini, args.micro_batch_size)
                    for micro in micro_starts:
                        rows_ = torch.arange(micro, micro + args.micro_batch_size, device=device)
                        mb = dict(x0=x0[rows_], prompt=prompt.index(rows_),
                                  negative=negative.index(rows_) if negative is not None else None,
                                  ref=ref_latents[rows_] if ref_latents is not None else None)
                        for k in range(num_k):
                            t = train_timesteps[rows_, k].float() / 1000
                            noise = torch.randn_like(mb["x0"])
                            t_b = t.reshape(-1, *([1] * (mb["x0"].ndim - 1)))
                            xt = (1 - t_b) * mb["x0"] + t_b * noise
                            forward = lambda: model.guided_velocity(  # noqa: E731
                                xt, t, mb["prompt"], mb["negative"], scale, mb["ref"], height=args.height,
                                width=args.width)
                            with torch.no_grad():
                                with T.use_adapter(model.transformer, T.ADAPTER_OLD):
                                    v_old = forward()
                                v_ref = None
                                if args.ref_kl_coef > 0:
                                    with lora.lora_disabled(model.transformer):
                                        v_ref = forward()
                            v = forward()
                            loss, loss_metrics = losses.diffusion_nft_loss(
                                v, v_old, mb["x0"], xt, t, reward_prob[rows_], mix_beta=args.mix_beta,
                                adv_clip_max=args.adv_clip_max, ref_prediction=v_ref, ref_kl_coef=args.ref_kl_coef,
                                adaptive_weight_min=args.adaptive_weight_min)
                            (loss / (len(micro_starts) * num_k)).backward()
                            accumulator.add({f"actor/{key}": value for key, value in loss_metrics.items()})
                    accumulator.add(stepper.step(optimizer))

        # 4. refresh the `old` adapter and sync it to the rollout workers
        old_metrics = T.old_policy_refresh(model.transformer, step, interval=args.old_policy_update_interval,
                                           schedule=args.old_policy_decay_schedule, decay=args.old_policy_decay)
        timings.update(sync(step))

        # 5. logging, validation, checkpoint
        metrics.update(accumulator.reduce())
        metrics.update(old_metrics)
        step_time = time.perf_counter() - step_start
        metrics.update(timings)
        metrics.update(T.perf_metrics(args.train_batch_size * args.rollout_n, step_time, world))
        metrics["training/global_step"] = float(step)
        metrics["training/epoch"] = float(batch.epoch)
        if step % args.log_every == 0:
            logger.log_scalars(metrics, step)
        if rank == 0:
            print(progress.line(step, step_time, metrics), flush=True)
        if val_data is not None and ((args.test_freq and step % args.test_freq == 0) or step == args.total_training_steps):
            validate(step)
        if step % args.save_freq == 0 or step == args.total_training_steps:
            T.save_checkpoint(ckpt_root, step, transformer=model.transformer, optimizer=optimizer,
                              lora_config=lora_config, config=config, sampler=sampler,
                              adapter_names=(T.ADAPTER_DEFAULT, T.ADAPTER_OLD),
                              trainer_state={"grad_stepper": stepper.state_dict()}, keep_last=args.keep_last)
    rollout.close()
    logger.close()
    T.cleanup_distributed()


if __name__ == "__main__":
    main()
