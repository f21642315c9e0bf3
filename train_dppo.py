"""Online Flow-DPPO (and the Flow-GRPO baseline with --loss flow_grpo) with LoRA under FSDP2, for Boogu-Image and
Qwen-Image.

    torchrun --nproc_per_node=3 train_dppo.py --model_path $MODEL_PATH --train_files train.parquet \
        --val_files test.parquet --rollout_devices cuda:3 ...            # see scripts/run_*.sh for the recipes

One rollout step:
  1. rollout: the rollout workers sample with the current policy (`default` adapter) and a Flow-SDE window
     (noise_level inside the window, Euler outside), storing the window's latents, timesteps (1000·σ) and log-probs;
  2. rewards -> group advantages over the global batch (verl-omni's estimator: unbiased std over the reward
     repeated across the W stored steps);
  3. old log-probs and transition means are RECOMPUTED by the trainer with the same weights before the update, so
     the first mini-batch has ratio = 1 exactly (the rollout's own log-probs only feed the rollout_corr/* check);
  4. update: mini-batches in prompts (one AdamW step each), micro-batches accumulated over samples x stored steps;
     each stored step is replayed through the model wrapper (same CFG as rollout) and `losses.sde_step` with the
     stored next latent, then `losses.flow_dppo_loss` (divergence-masked, A not clamped) or
     `losses.flow_grpo_loss` (clipped ratio, A clamped to ±adv_clip_max);
  5. the policy is synced to the rollout workers (every LoRA module must bind); logging, validation, checkpoints.
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
    g = parser.add_argument_group("Flow-DPPO / Flow-GRPO")
    g.add_argument("--loss", default="flow_dppo", choices=["flow_dppo", "flow_grpo"])
    g.add_argument("--noise_level", type=float, default=1.0, help="η inside the SDE window")
    g.add_argument("--sde_type", default="sde", choices=losses.SDE_TYPES,
                   help="'sde' (Flow-GRPO; required for DPPO's add_kl_coefficient) or 'cps'")
    g.add_argument("--sde_window_size", type=int, default=None,
                   help="stochastic + trained steps per sample (default: all steps but the last)")
    g.add_argument("--sde_window_range", default=None, help="'lo,hi': window start ~ UniformInt{lo..hi-w}")
    g.add_argument("--kl_mask_threshold", type=float, default=1e-5, help="DPPO trust region on the mean-reduced KL")
    g.add_argument("--no_add_kl_coefficient", dest="add_kl_coefficient", action="store_false",
                   help="DPPO: divide the mean shift by 2 only, not by 2(std_dev_t·√-dt)²")
    g.add_argument("--clip_ratio", type=float, default=1e-4, help="GRPO ratio clip ε")
    g.add_argument("--adv_clip_max", type=float, default=5.0, help="GRPO advantage clamp (DPPO does not clamp)")
    g.add_argument("--no_global_std", dest="global_std", action="store_false", help="per-group std")
    g.add_argument("--no_norm_adv_by_std", dest="norm_adv_by_std", action="store_false")
    args = parser.parse_args(argv)
    if not args.model_path or not args.train_files:
        parser.error("--model_path and --train_files are required (or $MODEL_PATH / $TRAIN_FILES)")
    if args.loss == "flow_dppo" and args.add_kl_coefficient and args.sde_type != "sde":
        parser.error("Flow-DPPO's add_kl_coefficient assumes sde_type=sde (cps has no √-dt transition scale)")
    if args.noise_level <= 0:
        parser.error("--noise_level must be > 0: Flow-DPPO/GRPO train on the SDE's transition densities")
    return args


def replay(model, latents, timesteps, next_latents, prompt, negative, ref_latents, sigmas, scale, args):
    """Log-prob and mean of the stored transition latents -> next_latents at `timesteps` (1000·σ, looked up in the
    schedule by exact equality) under the model's current weights, with the rollout's CFG and SDE."""
    sigma, sigma_next = losses.sigmas_at_timesteps(timesteps, sigmas)
    velocity = model.guided_velocity(latents, sigma, prompt, negative, scale, ref_latents, height=args.height,
                                     width=args.width)
    return losses.sde_step(latents, velocity, sigma, sigma_next, noise_level=args.noise_level,
                           sde_type=args.sde_type, sigma_max=sigmas[1], prev_sample=next_latents)


def main(argv=None) -> None:
    args = parse_args(argv)
    config = vars(args)
    window_range = tuple(int(v) for v in args.sde_window_range.split(",")) if args.sde_window_range else None
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
        lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, adapter_names=(T.ADAPTER_DEFAULT,), device=device,
        precision=args.precision, activation_checkpointing=args.activation_checkpointing,
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
                                  sampler=sampler, adapter_names=(T.ADAPTER_DEFAULT,))
        start_step = state["step"]
        stepper.load_state_dict(state["trainer_state"]["grad_stepper"])

    rollout = DistributedRollout(model_path, args.rollout_devices.split(","),
                                 engine=args.rollout_engine,
                                 dtype=args.rollout_dtype if device.type == "cuda" else "float32",
                                 max_batch_size=args.rollout_max_batch_size, timeout_s=args.rollout_timeout_s,
                                 log_dir=os.path.join(args.output_dir, "rollout_logs"),
                                 threads_per_worker=args.rollout_threads, cfg_batch=args.cfg_batch)
    adapters_root = os.path.join(args.output_dir, "rollout_adapters")
    sync = lambda step: T.sync_rollout_adapter(  # noqa: E731
        rollout, model.transformer, T.ADAPTER_DEFAULT, lora_config, adapters_root, step, num_lora_modules,
        engine_names=args.rollout_engine == "vllm_omni")
    sync(start_step)
    validate = lambda step: T.validate(model, rollout, scorer, val_data, args, step, scale, logger)  # noqa: E731
    if args.val_before_train and val_data is not None and start_step == 0:
        validate(0)

    # ---------------------------------------------------------------- loop
    progress = T.Progress(args.total_training_steps, start_step)
    for step in range(start_step + 1, args.total_training_steps + 1):
        step_start, timings = time.perf_counter(), {}
        batch = sampler.next_batch()
        rows = [train_data[i] for i in batch.local]
        n_local = len(rows) * args.rollout_n

        # 1. SDE rollout with the current policy
        with T.timer("gen", timings):
            request = T.rollout_request(
                rows, n=args.rollout_n, first_row=rank * n_local, seed=args.seed, step=step,
                num_inference_steps=args.num_inference_steps, height=args.height, width=args.width,
                family=model.family, scale=scale, noise_level=args.noise_level, sde_type=args.sde_type,
                sde_window_size=args.sde_window_size, sde_window_range=window_range, return_log_probs=True,
                return_trajectory=True)
            result = rollout.generate(request)
        num_w = result.all_timesteps.shape[1]

        # 2. rewards -> advantages (std over the reward repeated across the W stored steps)
        with T.timer("reward", timings):
            scored = T.score_samples(scorer, result.images, rows, args.rollout_n)
        with T.timer("adv", timings):
            advantages, metrics = T.global_advantages(scored, args.rollout_n, global_std=args.global_std,
                                                      norm_by_std=args.norm_adv_by_std, num_steps=num_w)
        advantages = advantages.to(device)

        latents = result.all_latents.to(device)                   # (B, W+1, ...) fp32
        timesteps = result.all_timesteps.to(device)               # (B, W)
        prompt = PromptEmbeds(result.prompt_embeds, result.prompt_mask).to(device)
        negative = (PromptEmbeds(result.negative_embeds, result.negative_mask).to(device)
                    if result.negative_embeds is not None else None)
        ref_latents = result.ref_latents.to(device) if result.ref_latents is not None else None
        sigmas = result.metadata["sigmas"].to(device)

        def micro_batch(rows_: torch.Tensor) -> dict:
            return dict(prompt=prompt.index(rows_), negative=negative.index(rows_) if negative is not None else None,
                        ref=ref_latents[rows_] if ref_latents is not None else None)

        # 3. old log-probs and means, recomputed with the weights that sampled (ratio = 1 at the first update)
        old_log_probs = torch.empty(n_local, num_w, device=device)
        old_means = torch.empty_like(latents[:, 1:])
        with T.timer("old_log_prob", timings), torch.no_grad():
            for micro in range(0, n_local, args.micro_batch_size):
                rows_ = torch.arange(micro, min(micro + args.micro_batch_size, n_local), device=device)
                mb = micro_batch(rows_)
                for j in range(num_w):
                    out = replay(model, latents[rows_, j], timesteps[rows_, j], latents[rows_, j + 1], mb["prompt"],
                                 mb["negative"], mb["ref"], sigmas, scale, args)
                    old_log_probs[rows_, j] = out.log_prob
                    old_means[rows_, j] = out.prev_sample_mean
        rollout_gap = (old_log_probs - result.all_log_probs.to(device)).abs()
        # 4. update the policy
        accumulator = T.MetricAccumulator()
        accumulator.add({"rollout_corr/logprob_abs_diff_mean": rollout_gap.mean(),
                         "rollout_corr/logprob_abs_diff_max": rollout_gap.max()})
        samples_per_mini = (mini_prompts // world) * args.rollout_n
        with T.timer("update_actor", timings):
            for _ in range(args.ppo_epochs):
                for mini in range(0, n_local, samples_per_mini):
                    micro_starts = range(mini, mini + samples_per_mini, args.micro_batch_size)
                    for micro in micro_starts:
                        rows_ = torch.arange(micro, micro + args.micro_batch_size, device=device)
                        mb = micro_batch(rows_)
                        for j in range(num_w):
                            out = replay(model, latents[rows_, j], timesteps[rows_, j], latents[rows_, j + 1],
                                         mb["prompt"], mb["negative"], mb["ref"], sigmas, scale, args)
                            if args.loss == "flow_dppo":
                                loss, loss_metrics = losses.flow_dppo_loss(
                                    out.log_prob, old_log_probs[rows_, j], advantages[rows_], out.prev_sample_mean,
                                    old_means[rows_, j], out.std_dev_t, out.sqrt_neg_dt,
                                    kl_mask_threshold=args.kl_mask_threshold,
                                    add_kl_coefficient=args.add_kl_coefficient)
                            else:
                                loss, loss_metrics = losses.flow_grpo_loss(
                                    out.log_prob, old_log_probs[rows_, j], advantages[rows_],
                                    clip_ratio=args.clip_ratio, adv_clip_max=args.adv_clip_max)
                            (loss / (len(micro_starts) * num_w)).backward()
                            accumulator.add({f"actor/{key}": value for key, value in loss_metrics.items()})
                    accumulator.add(stepper.step(optimizer))

        # 5. sync the policy to the rollout workers; logging, validation, checkpoint
        timings.update(sync(step))
        metrics.update(accumulator.reduce())
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
                              adapter_names=(T.ADAPTER_DEFAULT,), trainer_state={"grad_stepper": stepper.state_dict()},
                              keep_last=args.keep_last)
    rollout.close()
    logger.close()
    T.cleanup_distributed()


if __name__ == "__main__":
    main()
