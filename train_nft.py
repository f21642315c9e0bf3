"""Online DiffusionNFT with LoRA under FSDP2, for Boogu-Image and Qwen-Image.

    torchrun --nproc_per_node=3 train_nft.py --model_path $MODEL_PATH --train_files train.parquet \
        --val_files test.parquet --rollout_devices cuda:3 ...            # see scripts/run_*.sh for the recipes

One rollout step:
  1. rollout: each node's local rank 0 sends its ranks' prompts (x rollout_n) to the node's rollout workers, which
     sample with the `old` adapter and a deterministic ODE (Euler) sampler, at the run's CFG scale; the rewards
     (chosen by each row's data_source) are scored as each chunk finishes, while the next chunk samples. With
     --rollout_policy_lag 1 the next step's rollout samples (with the same `old`) while this step trains;
  2. group advantages over the global batch (global std) -> DiffusionNFT optimality probabilities
     r = clamp(A, -C, C) / 2C + 1/2;
  3. update: per sample K training timesteps (integer 1000·σ of the rollout schedule, one fixed-seed permutation
     per row), x_t = (1 - t) x0 + t ε with fresh ε, forwards of the `old` adapter (in the first mini-batch, the
     policy's own forward when `old` equals it: --old_from_update), the `default` adapter (with grad) and, when
     ref_kl_coef > 0, the base model (adapters off) - each through the model wrapper, so Boogu is
     negated and guided exactly as in rollout (--train_cfg rollout, the default) or CFG-free (--train_cfg off:
     one conditional pass per forward instead of two; the rollout keeps its CFG) - then
     `losses.diffusion_nft_loss`, accumulated over micro-batches x K and one AdamW step per mini-batch;
  4. the `old` adapter is refreshed (hard copy / EMA by `old_policy_decay`) every old_policy_update_interval steps
     and synced to the rollout workers, which must bind every LoRA module of the actor;
  5. logging, validation (ODE, val steps, seed 42), checkpoints (atomic; --resume continues exactly).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Iterator, NamedTuple

import torch

import losses
import training as T
from models import lora


# The CFG scale when neither --guidance_scale nor --true_cfg_scale is given, per model family, where this trainer's
# default differs from the model's (`models.base.DEFAULT_CFG_SCALE`): verl-omni's Qwen-Image DiffusionNFT recipe
# samples without CFG. train_dppo.py keeps the model defaults.
CFG_SCALE_DEFAULTS = {"qwen_image": 1.0}


def parse_args(argv=None) -> argparse.Namespace:
    parser = T.ArgumentParser(description=__doc__)
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
    g.add_argument("--val_adapter", default=T.ADAPTER_OLD, choices=[T.ADAPTER_OLD, T.ADAPTER_DEFAULT],
                   help="adapter validation samples with: 'old' (verl-omni) or 'default' (the official DiffusionNFT "
                        "code); the training rollout keeps sampling with 'old'")
    g.add_argument("--no_global_std", dest="global_std", action="store_false", help="per-group std")
    g.add_argument("--no_norm_adv_by_std", dest="norm_adv_by_std", action="store_false")
    g.add_argument("--train_cfg", default="rollout", choices=["rollout", "off"],
                   help="CFG of the training forwards (old, reference, policy): 'rollout' = the rollout's scale "
                        "(2 transformer passes each when guided), 'off' = CFG-free (DiffusionNFT's design; 1 pass "
                        "each); the rollout always samples with its CFG")
    g.add_argument("--rollout_policy_lag", type=int, default=0, choices=[0, 1],
                   help="1 = sample step k+1 with `old` while step k trains (one refresh of `old` behind; logged as "
                        "rollout/policy_lag); needs rollout GPUs no trainer uses; off until a learning comparison "
                        "says it is free")
    args = parser.parse_args(argv)
    if not args.model_path or not args.train_files:
        parser.error("--model_path and --train_files are required (or $MODEL_PATH / $TRAIN_FILES)")
    parser.check_ranges(args, [
        ("mix_beta", lambda v: v > 0, "> 0"), ("adv_clip_max", lambda v: v > 0, "> 0"),
        ("ref_kl_coef", lambda v: v >= 0, ">= 0"), ("adaptive_weight_min", lambda v: v > 0, "> 0"),
        ("timestep_fraction", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("old_policy_decay", lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("old_policy_update_interval", lambda v: v >= 1, ">= 1")])
    problem = T.check_rollout_lag(args)
    if problem:
        parser.error(problem)
    return args


def old_and_reference(model, forward, with_old: bool, with_reference: bool):
    """The no-grad targets of one training forward `forward()` (the wrapper's velocity at this x_t, t, conditioning
    and CFG): with the `old` adapter when `with_old`, and with the base model (every adapter off) when
    `with_reference`; None for each one not asked for."""
    v_old = v_ref = None
    with torch.no_grad():
        if with_old:
            with T.use_adapter(model.transformer, T.ADAPTER_OLD):
                v_old = forward()
        if with_reference:
            with lora.lora_disabled(model.transformer):
                v_ref = forward()
    return v_old, v_ref


class TrainingForward(NamedTuple):
    """The inputs of `losses.diffusion_nft_loss` at one training timestep of a micro-batch of b samples."""

    x0: torch.Tensor  # (b, *D) the clean latents
    xt: torch.Tensor  # (b, *D) x_t = (1 - t) x0 + t ε, fresh ε
    t: torch.Tensor  # (b,)
    v: torch.Tensor  # (b, *D) the policy's velocity at (x_t, t), with grad
    v_old: torch.Tensor  # (b, *D) the `old` adapter's (the policy's own, detached, when `old` equals it)
    v_ref: torch.Tensor | None  # (b, *D) the base model's (adapters off), or None without ref_kl_coef


def training_forwards(model, x0: torch.Tensor, cond: Any, timesteps: torch.Tensor, mb: torch.Tensor, scale: float,
                      args, with_old: bool) -> Iterator[tuple[int, TrainingForward]]:
    """The training forwards of the samples `mb` ((b,) row indices of x0 (B, *D) and of the rollout's conditioning
    `cond`): for each k of their K training `timesteps` (B, K) (integer 1000·σ), noise x_t with fresh ε and yield
    (k, the policy's velocity there with the no-grad targets: `old_and_reference`, the `old` forward left out without
    `with_old`), each through the model wrapper at CFG `scale`."""
    x0_mb, cond_mb = x0[mb], cond.index(mb)
    for k in range(timesteps.shape[1]):
        t = timesteps[mb, k].float() / 1000  # (b,)
        t_b = t.reshape(-1, *([1] * (x0_mb.ndim - 1)))
        xt = (1 - t_b) * x0_mb + t_b * torch.randn_like(x0_mb)  # (b, *D)
        forward = lambda: model.guided_velocity(xt, t, cond_mb.prompt, cond_mb.negative, scale,  # noqa: E731
                                                cond_mb.ref_latents, height=args.height, width=args.width)
        v_old, v_ref = old_and_reference(model, forward, with_old, with_reference=args.ref_kl_coef > 0)
        v = forward()
        yield k, TrainingForward(x0_mb, xt, t, v, v.detach() if v_old is None else v_old, v_ref)


def main(argv=None) -> None:
    args = parse_args(argv)
    # ---------------------------------------------------------------- setup (training.setup_run)
    run = T.setup_run(args, adapter_names=(T.ADAPTER_DEFAULT, T.ADAPTER_OLD), cfg_defaults=CFG_SCALE_DEFAULTS)
    model, device, rank, world, scale = run.model, run.device, run.rank, run.world, run.cfg_scale
    train_scale = scale if args.train_cfg == "rollout" else 1.0  # CFG of the training forwards
    if run.start_step == 0:
        lora.copy_adapter_(model.transformer, T.ADAPTER_DEFAULT, T.ADAPTER_OLD)  # rollouts start from the policy
    run.sync_rollout(T.ADAPTER_OLD, run.start_step)
    if args.val_before_train and run.val_data is not None and run.start_step == 0:
        run.validate(0)

    def request_for(rows, step):  # this rank's deterministic ODE rollout of `rows` at `step`
        return T.rollout_request(
            rows, n=args.rollout_n, first_row=rank * len(rows) * args.rollout_n, seed=args.seed, step=step,
            num_inference_steps=args.num_inference_steps, height=args.height, width=args.width, cfg_scale=scale,
            noise_level=0.0)

    # ---------------------------------------------------------------- loop
    for step in run.steps():
        step_start, timings = time.perf_counter(), {}
        batch = run.sampler.next_batch()
        rows = [run.train_data[i] for i in batch.local]
        n_local = len(rows) * args.rollout_n

        # 1. rollout with the `old` adapter (deterministic ODE) and its rewards, scored as chunks finish
        result, scored = T.rollout_and_score(run, request_for(rows, step), rows, timings, step)
        if T.lag_next_rollout(run, step):  # --rollout_policy_lag 1: step + 1 samples while this step trains
            next_rows = [run.train_data[i] for i in T.peek_batch(run.sampler).local]
            T.submit_rollout(run, request_for(next_rows, step + 1), next_rows)

        # 2. advantages -> optimality probabilities
        with T.timer("adv", timings):
            advantages, metrics = T.global_advantages(scored, args.rollout_n, global_std=args.global_std,
                                                      norm_by_std=args.norm_adv_by_std)
            reward_prob = losses.reward_probability(advantages, adv_clip_max=args.adv_clip_max,
                                                    adv_mode=args.adv_mode).to(device)  # (B,) in [0, 1]

        # 3. update the `default` adapter: K timesteps per sample, x_t = (1 - t) x0 + t ε with fresh ε
        x0 = result.latents_clean.to(device)  # (B, *D) the rollout's clean latents
        cond = result.conditioning(device)  # the prompt / negative embeddings and references the rollout used
        schedule_timesteps = result.metadata["sigmas"][:-1] * 1000
        train_timesteps = losses.select_train_timesteps(
            schedule_timesteps.expand(n_local, -1), timestep_fraction=args.timestep_fraction,
            seed=args.timestep_shuffle_seed).to(device)  # (B, K), integer 1000·σ
        num_k = train_timesteps.shape[1]
        accumulator = T.MetricAccumulator()
        samples_per_mini = (run.mini_prompts // world) * args.rollout_n
        micro_steps_per_update = samples_per_mini // args.micro_batch_size * num_k  # micro-batches x K
        with T.timer("update_actor", timings):
            # `old` equal to the policy (a hard-copy refresh since the last update): until the first optimizer step
            # the policy's own forward is the old one (--old_from_update). Compiled blocks still run it in the
            # process's first step, so that its graph compiles there with the others, not in a later step
            old_is_policy = (args.old_from_update == "on" and (args.compile != "blocks" or step > run.start_step + 1)
                             and T.adapters_equal(model.transformer))
            steps = T.micro_steps(
                n_local, samples_per_mini, args.micro_batch_size, num_k, epochs=args.ppo_epochs, device=device,
                forwards=lambda i, mb: training_forwards(model, x0, cond, train_timesteps, mb, train_scale, args,
                                                         with_old=not (i == 0 and old_is_policy)))
            for i, mb, k, fwd, last in steps:
                loss, loss_metrics = losses.diffusion_nft_loss(
                    fwd.v, fwd.v_old, fwd.x0, fwd.xt, fwd.t, reward_prob[mb], mix_beta=args.mix_beta,
                    adv_clip_max=args.adv_clip_max, ref_prediction=fwd.v_ref, ref_kl_coef=args.ref_kl_coef,
                    adaptive_weight_min=args.adaptive_weight_min)
                run.stepper.backward(loss / micro_steps_per_update)
                accumulator.add({f"actor/{key}": value for key, value in loss_metrics.items()})
                if last:
                    accumulator.add(run.stepper.step(run.optimizer))

        # 4. refresh the `old` adapter and sync it to the rollout workers
        old_metrics = T.old_policy_refresh(model.transformer, step, interval=args.old_policy_update_interval,
                                           schedule=args.old_policy_decay_schedule, decay=args.old_policy_decay)
        if old_metrics["old_policy/update_applied"]:  # an unchanged `old` needs no new rollout version
            timings.update(run.sync_rollout(T.ADAPTER_OLD, step))

        # 5. logging (with perf/mfu/* of each phase), validation, checkpoint
        metrics.update(accumulator.reduce())
        metrics.update(old_metrics)
        passes_without_old = samples_per_mini if old_is_policy else 0  # of the n_local x ppo_epochs sample passes
        metrics.update(T.nft_perf_metrics(run, cond, timings, num_k=num_k, train_scale=train_scale,
                                          old_fraction=1 - passes_without_old / (n_local * args.ppo_epochs)))
        run.end_step(step, metrics, timings, step_start, batch.epoch)
    run.close()


if __name__ == "__main__":
    T.run_cli(main)  # one line per failure on the console, the traceback in <output_dir>/train.log
