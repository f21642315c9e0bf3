"""Online Flow-DPPO (and the Flow-GRPO baseline with --loss flow_grpo) with LoRA under FSDP2, for Boogu-Image and
Qwen-Image.

    torchrun --nproc_per_node=3 train_dppo.py --model_path $MODEL_PATH --train_files train.parquet \
        --val_files test.parquet --rollout_devices cuda:3 ...            # see scripts/run_*.sh for the recipes

One rollout step:
  1. rollout: the rollout workers sample with the current policy (`default` adapter) and a Flow-SDE window
     (noise_level inside the window, Euler outside), storing the window's latents, timesteps (1000·σ) and log-probs;
     the rewards are scored as each chunk finishes, while the next chunk samples;
  2. group advantages over the global batch (verl-omni's estimator: unbiased std over the reward repeated across
     the W stored steps);
  3. old log-probs and transition means are RECOMPUTED by the trainer with the same weights, so the first
     mini-batch has ratio = 1 exactly (the rollout's own log-probs only feed the rollout_corr/* check): the first
     mini-batch's in its own update forward (no optimizer step has run yet), the later ones' in a replay pass
     before the update (--old_from_update off: every mini-batch's in that pass);
     with --old_log_probs rollout (verl-omni's bypass mode) the rollout's own log-probs and means are used instead,
     one forward pass per stored step fewer; rollout_corr/* is then measured in the first update mini-batch, whose
     weights still equal the rollout's, and its ratio differs from 1 by exactly that gap;
  4. update: mini-batches in prompts (one AdamW step each), micro-batches accumulated over samples x stored steps;
     each stored step is replayed through the model wrapper (same CFG as rollout) and `losses.sde_step` with the
     stored next latent, then `losses.flow_dppo_loss` (divergence-masked, A not clamped) or
     `losses.flow_grpo_loss` (clipped ratio, A clamped to ±adv_clip_max);
  5. the policy is synced to the rollout workers (every LoRA module must bind); logging, validation, checkpoints.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

import losses
import training as T
from engines.sampler import sde_window_starts


def parse_args(argv=None) -> argparse.Namespace:
    parser = T.ArgumentParser(description=__doc__)
    T.add_common_args(parser)
    g = parser.add_argument_group("Flow-DPPO / Flow-GRPO")
    g.add_argument("--loss", default="flow_dppo", choices=["flow_dppo", "flow_grpo"])
    g.add_argument("--noise_level", type=float, default=1.0, help="η inside the SDE window")
    g.add_argument("--sde_type", default="sde", choices=losses.SDE_TYPES,
                   help="'sde' (Flow-GRPO; required for DPPO's add_kl_coefficient) or 'cps'")
    g.add_argument("--sde_window_size", type=int, default=None,
                   help="stochastic + trained steps per sample (default: all steps but the last)")
    g.add_argument("--sde_window_range", default=None,
                   help="'lo,hi': window start ~ UniformInt{lo..hi-w} (with --sde_window_size only; unset: 0,5 as "
                        "verl-omni)")
    g.add_argument("--kl_mask_threshold", type=float, default=1e-5, help="DPPO trust region on the mean-reduced KL")
    g.add_argument("--no_add_kl_coefficient", dest="add_kl_coefficient", action="store_false",
                   help="DPPO: divide the mean shift by 2 only, not by 2(std_dev_t·√-dt)²")
    g.add_argument("--clip_ratio", type=float, default=1e-4, help="GRPO ratio clip ε")
    g.add_argument("--adv_clip_max", type=float, default=5.0, help="GRPO advantage clamp (DPPO does not clamp)")
    g.add_argument("--no_global_std", dest="global_std", action="store_false", help="per-group std")
    g.add_argument("--no_norm_adv_by_std", dest="norm_adv_by_std", action="store_false")
    g.add_argument("--old_log_probs", default="recompute", choices=["recompute", "rollout"],
                   help="'recompute': replay every stored step with the sampling weights before the update (step-1 "
                        "ratio exactly 1); 'rollout': verl-omni's bypass mode, the rollout's log-probs and (DPPO) "
                        "transition means are the old policy (no replay pass; the ratio then carries the "
                        "rollout/trainer gap logged as rollout_corr/*)")
    args = parser.parse_args(argv)
    if not args.model_path or not args.train_files:
        parser.error("--model_path and --train_files are required (or $MODEL_PATH / $TRAIN_FILES)")
    if args.loss == "flow_dppo" and args.add_kl_coefficient and args.sde_type != "sde":
        parser.error("Flow-DPPO's add_kl_coefficient assumes sde_type=sde (cps has no √-dt transition scale)")
    if not args.noise_level > 0:
        parser.error("--noise_level must be > 0: Flow-DPPO/GRPO train on the SDE's transition densities")
    window_range = None
    if args.sde_window_range is not None:
        if args.sde_window_size is None:
            parser.error("--sde_window_range needs --sde_window_size (without it every step but the last is trained; "
                         "a run started with it alone resumes with it dropped and --resume_force: it had no effect)")
        try:
            window_range = int_pair(args.sde_window_range)
        except ValueError as e:
            parser.error(f"--sde_window_range {e}")
    if args.sde_window_size is not None:  # the window must fit the range within the rollout's steps
        try:
            sde_window_starts(args.num_inference_steps, args.sde_window_size, window_range, [], sde_type=args.sde_type)
        except ValueError as e:
            parser.error(f"--sde_window_size / --sde_window_range / --num_inference_steps: {e}")
    parser.check_ranges(args, [("kl_mask_threshold", lambda v: v > 0, "> 0")] if args.loss == "flow_dppo" else
                        [("clip_ratio", lambda v: v > 0, "> 0"), ("adv_clip_max", lambda v: v > 0, "> 0")])
    return args


def int_pair(text: str) -> tuple[int, int]:
    """'lo,hi' -> (lo, hi), two integers with 0 <= lo < hi (--sde_window_range); ValueError otherwise."""
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{text!r}: expected two integers 'lo,hi'") from None
    if not 0 <= lo < hi:
        raise ValueError(f"{text!r}: expected 0 <= lo < hi")
    return lo, hi


@dataclass
class StoredWindow:
    """This rank's stored SDE window on the training device: latents (B, W+1, ...) fp32; sigma, sigma_next (B, W):
    transition j goes from latents[:, j] at sigma[:, j] to latents[:, j+1] at sigma_next[:, j] (the stored timesteps
    1000·σ looked up in the schedule by exact equality, checked once per step); sigma_max: the schedule's sigmas[1]
    (`losses.sde_step`); the rollout's conditioning `cond` (`models.base.Conditioning`)."""

    latents: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    sigma_max: torch.Tensor
    cond: Any


def replay(model, window: StoredWindow, mb: torch.Tensor, scale: float, args) -> Iterator[tuple[int, losses.SDEStep]]:
    """Replay the samples `mb` ((b,) row indices) through their stored window: for each stored step j, yield
    (j, `losses.sde_step` output), the log-prob and mean of the stored transition latents[:, j] -> latents[:, j+1]
    under the model's current weights, with the rollout's conditioning, CFG `scale` and SDE."""
    cond = window.cond.index(mb)
    for j in range(window.sigma.shape[1]):
        latents, sigma = window.latents[mb, j], window.sigma[mb, j]
        # the velocity is not kept in this frame: a replay with grad frees one step's graph before the next
        yield j, losses.sde_step(latents, model.guided_velocity(latents, sigma, cond.prompt, cond.negative, scale,
                                                                cond.ref_latents, height=args.height, width=args.width),
                                 sigma, window.sigma_next[mb, j], noise_level=args.noise_level,
                                 sde_type=args.sde_type, sigma_max=window.sigma_max,
                                 prev_sample=window.latents[mb, j + 1], validate=False)


def recompute_old(model, window: StoredWindow, replayed: Sequence[torch.Tensor], scale: float, args,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The old policy's log-probs (B, W) and transition means (B, W, *D) of the samples in the micro-batches
    `replayed` ((b,) row indices each), replayed through their stored window with the current weights, i.e. the
    weights that sampled, before any optimizer step; the rows not replayed are left for the first update's own
    forwards to fill (--old_from_update on)."""
    old_log_probs = torch.empty(window.latents.shape[0], window.sigma.shape[1], device=window.latents.device)
    old_means = torch.empty_like(window.latents[:, 1:])
    # compiled blocks round a no-grad graph differently from the update's graph: replay with grad (outputs
    # detached) so the first update's ratio stays exactly 1 (models.base.compile_blocks)
    with torch.set_grad_enabled(args.compile == "blocks"):
        for mb in replayed:
            for j, out in replay(model, window, mb, scale, args):
                old_log_probs[mb, j], old_means[mb, j] = out.log_prob.detach(), out.prev_sample_mean.detach()
                del out  # its graph (the checkpointed block inputs) goes before the next replay
    return old_log_probs, old_means


def main(argv=None) -> None:
    args = parse_args(argv)
    window_range = int_pair(args.sde_window_range) if args.sde_window_range else None
    # ---------------------------------------------------------------- setup (training.setup_run)
    run = T.setup_run(args, adapter_names=(T.ADAPTER_DEFAULT,))
    model, device, rank, world, scale = run.model, run.device, run.rank, run.world, run.cfg_scale
    run.sync_rollout(T.ADAPTER_DEFAULT, run.start_step)
    if args.val_before_train and run.val_data is not None and run.start_step == 0:
        run.validate(0)

    # ---------------------------------------------------------------- loop
    for step in run.steps():
        step_start, timings = time.perf_counter(), {}
        batch = run.sampler.next_batch()
        rows = [run.train_data[i] for i in batch.local]
        n_local = len(rows) * args.rollout_n

        # 1. SDE rollout with the current policy and its rewards, scored as chunks finish
        request = T.rollout_request(
            rows, n=args.rollout_n, first_row=rank * n_local, seed=args.seed, step=step,
            num_inference_steps=args.num_inference_steps, height=args.height, width=args.width, cfg_scale=scale,
            noise_level=args.noise_level, sde_type=args.sde_type, sde_window_size=args.sde_window_size,
            sde_window_range=window_range, return_log_probs=True, return_trajectory=True)
        result, scored = T.rollout_and_score(run, request, rows, timings, step)
        num_w = result.all_timesteps.shape[1]

        # 2. advantages (std over the reward repeated across the W stored steps)
        with T.timer("adv", timings):
            advantages, metrics = T.global_advantages(scored, args.rollout_n, global_std=args.global_std,
                                                      norm_by_std=args.norm_adv_by_std, num_steps=num_w)
        advantages = advantages.to(device)  # (B,)

        sigmas = result.metadata["sigmas"].to(device)
        sigma, sigma_next = losses.sigmas_at_timesteps(result.all_timesteps.to(device), sigmas)  # (B, W) each
        losses.check_sde_sigmas(sigma, sigma_next, sde_type=args.sde_type, sigma_max=sigmas[1])
        cond = result.conditioning(device)  # the prompt / negative embeddings and references the rollout used
        window = StoredWindow(result.all_latents.to(device), sigma, sigma_next, sigmas[1], cond)

        # 3. old log-probs and means, recomputed with the weights that sampled (ratio = 1 at the first update): the
        #    first mini-batch's come from its own update forward below (no optimizer step has run yet), so this pass
        #    replays only the later mini-batches (none when the step makes one optimizer step; --old_from_update off
        #    replays all), or the rollout's own (--old_log_probs rollout)
        rollout_log_probs = result.all_log_probs.to(device)  # (B, W)
        samples_per_mini = (run.mini_prompts // world) * args.rollout_n
        micro_steps_per_update = samples_per_mini // args.micro_batch_size * num_w  # micro-batches x W
        first_from_update = args.old_log_probs == "recompute" and args.old_from_update == "on"
        if args.old_log_probs == "recompute":
            replayed = T.micro_batches(samples_per_mini if first_from_update else 0, n_local, args.micro_batch_size,
                                       device)
            with T.timer("old_log_prob", timings, skip=not replayed):
                old_log_probs, old_means = recompute_old(model, window, replayed, scale, args)  # (B, W), (B, W, *D)
            first_pass = None
        else:
            if args.loss == "flow_dppo" and result.all_means is None:
                raise RuntimeError("--old_log_probs rollout with --loss flow_dppo needs the rollout's transition means "
                                   "(all_means); this rollout engine did not return them")
            old_log_probs = rollout_log_probs
            old_means = None if result.all_means is None else result.all_means.to(device)  # (B, W, *D); GRPO: unused
            first_pass = torch.zeros_like(old_log_probs)  # (B, W) the first mini-batch's log-probs: rollout_corr
            replayed = []

        # 4. update the policy
        accumulator = T.MetricAccumulator()
        with T.timer("update_actor", timings):
            steps = T.micro_steps(n_local, samples_per_mini, args.micro_batch_size, num_w, epochs=args.ppo_epochs,
                                  device=device, forwards=lambda i, mb: replay(model, window, mb, scale, args))
            for i, mb, j, out, last in steps:
                if i == 0 and first_from_update:  # the weights that sampled: this forward is the old one
                    old_log_probs[mb, j], old_means[mb, j] = out.log_prob.detach(), out.prev_sample_mean.detach()
                elif i == 0 and first_pass is not None:  # the first mini-batch: weights = the rollout's
                    first_pass[mb, j] = out.log_prob.detach()
                if args.loss == "flow_dppo":
                    loss, loss_metrics = losses.flow_dppo_loss(
                        out.log_prob, old_log_probs[mb, j], advantages[mb], out.prev_sample_mean, old_means[mb, j],
                        out.std_dev_t, out.sqrt_neg_dt, kl_mask_threshold=args.kl_mask_threshold,
                        add_kl_coefficient=args.add_kl_coefficient)
                else:
                    loss, loss_metrics = losses.flow_grpo_loss(
                        out.log_prob, old_log_probs[mb, j], advantages[mb], clip_ratio=args.clip_ratio,
                        adv_clip_max=args.adv_clip_max)
                run.stepper.backward(loss / micro_steps_per_update)
                accumulator.add({f"actor/{key}": value for key, value in loss_metrics.items()})
                if last:
                    accumulator.add(run.stepper.step(run.optimizer))

        # rollout/trainer log-prob gap: of the recompute, or (bypass) of the first mini-batch's pass
        if first_pass is None:
            rollout_gap = (old_log_probs - rollout_log_probs).abs()
        else:
            rollout_gap = (first_pass - rollout_log_probs)[:samples_per_mini].abs()
        accumulator.add({"rollout_corr/logprob_abs_diff_mean": rollout_gap.mean(),
                         "rollout_corr/logprob_abs_diff_max": rollout_gap.max()})

        # 5. sync the policy to the rollout workers; logging (with perf/mfu/* of each phase), validation, checkpoint
        timings.update(run.sync_rollout(T.ADAPTER_DEFAULT, step))
        metrics.update(accumulator.reduce())
        metrics.update(T.dppo_perf_metrics(run, cond, timings, num_w=num_w,
                                            old_fraction=len(replayed) * args.micro_batch_size / n_local))
        run.end_step(step, metrics, timings, step_start, batch.epoch)
    run.close()


if __name__ == "__main__":
    T.run_cli(main)  # one line per failure on the console, the traceback in <output_dir>/train.log
