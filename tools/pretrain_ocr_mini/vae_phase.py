"""Phase 1: train the VAE on the renders until its held-out reconstructions read back, then freeze it."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from .data import LUMA, render_batch, train_render_seeds, vae_eval_seeds
from .nets import Fast2dConvs, latent_stats, round_to_bf16_, vae_loss, vae_reconstruct
from .ocr_pool import PendingScore, ocr_metrics
from .pictures import save_grid
from .state import Run, save_state


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up multiplier of the lr at 0-based step `step`: min(1, (step + 1) / warmup_steps); 1 when
    warmup_steps is 0 (no warm-up)."""
    if warmup_steps < 0:
        raise ValueError(f"warm-up steps must be >= 0, got {warmup_steps}")
    return 1.0 if warmup_steps == 0 else min(1.0, (step + 1) / warmup_steps)


@torch.no_grad()
def flat_colour_l1(images: torch.Tensor) -> float:
    """The collapse level of the VAE: the L1 (in the [-1, 1] units of `vae_loss`) of the best predictor that
    paints every image in one of two flat colours, a light one or a dark one.

    images uint8 (N, 3, H, W). Each image goes to the light group if its mean luma is >= 0.5, else to the dark
    group; a group's colour is the per-channel median of all its pixels (the L1-optimal constant); the level is
    the mean over images of mean |x - colour of its group|. A VAE that has learned only the background's
    brightness sits at this level (0.238 on the thin-font renders where two earlier runs stalled).
    """
    x = images.float() / 127.5 - 1.0
    luma = torch.tensor(LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    light = (x * luma).sum(1).mean(dim=(1, 2)) >= 0.0
    total = x.new_zeros(())
    for group in (light, ~light):
        if group.any():
            g = x[group]
            colour = g.transpose(0, 1).reshape(3, -1).median(dim=1).values.view(1, 3, 1, 1)
            total += (g - colour).abs().mean(dim=(1, 2, 3)).sum()
    return float(total / x.shape[0])


def vae_collapsed(l1: float, level: float, step: int, *, check_step: int, ratio: float) -> bool:
    """The early plateau check: True when, at `step` >= `check_step` (0 = never), the training L1 is still at
    least `ratio` x the flat-colour level. A healthy run is ~40% below the level by step ~900 (0.6 x); the two
    collapsed runs were at 0.95-1.0 x at step 1,000 and after."""
    return check_step > 0 and step >= check_step and l1 >= ratio * level


def render_training_images(run: Run) -> torch.Tensor:
    args, call = run.args, len(run.state["calls"]) - 1
    seeds = list(train_render_seeds(call, args.num_images))
    words = [run.words[i % len(run.words)] for i in range(args.num_images)]
    t0 = time.monotonic()
    images = run.pool.render(words, seeds, args.resolution, run.device)
    dt = time.monotonic() - t0
    run.log(f"[data] rendered {len(seeds)} images {args.resolution}^2 on {run.pool.workers} workers in {dt:.1f} s "
            f"({len(seeds) / max(dt, 1e-9):.0f} img/s), seeds {seeds[0]}..{seeds[-1]}")
    return images


def vae_eval_set(run: Run) -> tuple[torch.Tensor, list[str]]:
    n = run.args.vae_eval_images
    words = [run.words[i % len(run.words)] for i in range(n)]
    arr = render_batch(words, list(vae_eval_seeds(n)), run.args.resolution)
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous().to(run.device), words


def record_vae_eval(run: Run, pending: PendingScore) -> dict[str, float]:
    scores, _, ocr_s = pending.get()
    run.record_ocr_rate(len(scores), ocr_s)
    metrics = ocr_metrics(scores[:, None])
    meta = pending.meta
    run.state["curves"]["vae_eval"].append({"total_s": meta["total_s"], "vae_s": meta["vae_s"], "step": meta["step"],
                                            "mean": metrics["mean"], "exact": metrics["exact"]})
    run.log(f"[vae] eval @ {meta['vae_s']:.0f} s (step {meta['step']}): reconstruction OCR reward "
            f"{metrics['mean']:.3f}, exact {metrics['exact']:.3f} ({len(scores)} images, OCR {ocr_s:.1f} s)")
    return metrics


def train_vae(run: Run, vae: torch.nn.Module, images: torch.Tensor) -> bool:
    """Train until the target reconstruction reward, --vae_max_s (cumulative) or the call's deadline.
    Returns True when the VAE is finished (target or max time), False when the call ran out of time."""
    args, st = run.args, run.state["vae"]
    eval_images, eval_words = vae_eval_set(run)
    level = st.setdefault("flat_l1", flat_colour_l1(images[:2048]))
    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, betas=(0.9, 0.99), weight_decay=0.0,
                            **({"fused": True} if run.device.type == "cuda" else {}))
    gen = torch.Generator(device=run.device).manual_seed(args.seed * 1000 + len(run.state["calls"]))
    n, step0, images0, seconds0, t_phase = images.shape[0], st["steps"], st["images"], st["seconds"], time.monotonic()
    pending, next_eval, next_log = None, 0.0, args.log_every_s
    loss_acc, l1_acc, acc_n, done, reason = 0.0, 0.0, 0, False, "the call's deadline"
    clip = args.vae_grad_clip if args.vae_grad_clip > 0 else float("inf")
    run.log(f"[vae] training {sum(p.numel() for p in vae.parameters()) / 1e6:.2f}M params, batch {args.vae_batch}, "
            f"lr {args.vae_lr}, warm-up {args.vae_warmup_steps} steps, grad clip "
            f"{args.vae_grad_clip if args.vae_grad_clip > 0 else 'off'}, from step {step0}, {seconds0:.0f} s so far; "
            f"flat-colour L1 level of the data {level:.4f} (collapse check at step {args.vae_plateau_step}: "
            f"L1 >= {args.vae_plateau_ratio} x level)")
    while True:
        elapsed = time.monotonic() - t_phase
        st["seconds"] = seconds0 + elapsed
        if pending is not None and pending.ready():
            metrics = record_vae_eval(run, pending)
            pending = None
            save_state(run, vae, None)  # a crash later keeps this call's progress
            if metrics["mean"] >= args.vae_target_reward:
                done, reason = True, f"reconstruction reward {metrics['mean']:.3f} >= {args.vae_target_reward}"
                break
        if st["seconds"] >= args.vae_max_s:
            done, reason = True, f"--vae_max_s {args.vae_max_s} reached"
            break
        if run.time_left() < run.reserve():
            break
        if pending is None and elapsed >= next_eval:
            vae.eval()
            recon = vae_reconstruct(vae, eval_images, run.amp)
            vae.train()
            pending = run.pool.score(recon, eval_words, {"total_s": run.total_s(), "vae_s": st["seconds"],
                                                         "step": st["steps"]})
            next_eval = elapsed + args.vae_eval_every_s
        idx = torch.randint(0, n, (args.vae_batch,), generator=gen, device=run.device)
        lr = args.vae_lr * warmup_factor(st["steps"] - step0, args.vae_warmup_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        with Fast2dConvs(vae), run.amp():
            loss, l1, _ = vae_loss(vae, images[idx], args.vae_kl_weight, gen)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(vae.parameters(), clip)
        norm_v, loss_v, l1_v = torch.stack([grad_norm, loss.detach(), l1]).tolist()  # one device sync per step
        if math.isfinite(norm_v):
            opt.step()
            st["steps"] += 1
            st["images"] += args.vae_batch
            loss_acc, l1_acc, acc_n = loss_acc + loss_v, l1_acc + l1_v, acc_n + 1
        else:
            run.log(f"[vae] non-finite gradient at step {st['steps']}: step skipped")
        opt.zero_grad(set_to_none=True)
        if elapsed >= next_log and acc_n:
            run.state["curves"]["vae_loss"].append({"total_s": run.total_s(), "vae_s": st["seconds"],
                                                    "step": st["steps"], "loss": loss_acc / acc_n,
                                                    "l1": l1_acc / acc_n})
            l1_mean = l1_acc / acc_n
            run.log(f"[vae] step {st['steps']} img {st['images']} ({(st['images'] - images0) / elapsed:.0f} img/s) "
                    f"loss {loss_acc / acc_n:.4f} l1 {l1_mean:.4f} = {l1_mean / level:.2f} x flat level "
                    f"lr {lr:.1e} left {run.time_left():.0f} s")
            loss_acc, l1_acc, acc_n, next_log = 0.0, 0.0, 0, elapsed + args.log_every_s
            if not st.get("plateau_checked") and vae_collapsed(
                    l1_mean, level, st["steps"], check_step=args.vae_plateau_step, ratio=args.vae_plateau_ratio):
                st["collapsed"] = {"step": st["steps"], "l1": l1_mean, "flat_l1": level}
                reason = (f"COLLAPSED: L1 {l1_mean:.4f} at step {st['steps']} is still {l1_mean / level:.2f} x the "
                          f"data's flat-colour level {level:.4f} (>= {args.vae_plateau_ratio}); a healthy run is "
                          f"~0.6 x by step 900. Change the data or the VAE flags and start a fresh --state_dir")
                break
            if args.vae_plateau_step and st["steps"] >= args.vae_plateau_step:
                st["plateau_checked"] = True
    if pending is not None:  # keep the last result for the curve
        record_vae_eval(run, pending)
    st["seconds"] = seconds0 + time.monotonic() - t_phase
    vae.eval().requires_grad_(False)
    run.log(f"[vae] stopped after {st['seconds']:.0f} s, step {st['steps']}, {st['images']} images: {reason}")
    if "collapsed" in st:
        save_state(run, vae, None)
        raise SystemExit(f"[vae] {reason}")
    return done


def finalize_vae(run: Run, vae: torch.nn.Module, images: torch.Tensor) -> None:
    """Round to bf16 (the shipped weights), write the latent statistics into the config, measure the final
    reconstruction reward (and that of the clean renders) and save vae_recon.png (renders above, reconstructions
    below)."""
    args = run.args
    round_to_bf16_(vae)
    n = min(images.shape[0], args.stats_images)
    mean, std = latent_stats(vae, images[:n], args.encode_batch, run.amp)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    eval_images, eval_words = vae_eval_set(run)
    recon = vae_reconstruct(vae, eval_images, run.amp)
    recon_job, clean_job = run.pool.score(recon, eval_words), run.pool.score(eval_images.cpu(), eval_words)
    metrics = ocr_metrics(recon_job.get()[0][:, None])
    clean = float(clean_job.get()[0].mean())
    run.state["vae"]["final_recon"] = {**metrics, "clean_render_mean": clean}
    run.state["curves"]["vae_eval"].append({"total_s": run.total_s(), "vae_s": run.state["vae"]["seconds"],
                                            "step": run.state["vae"]["steps"], "mean": metrics["mean"],
                                            "exact": metrics["exact"]})
    run.log(f"[vae] final (bf16): reconstruction OCR reward {metrics['mean']:.3f}, exact {metrics['exact']:.3f} "
            f"(clean renders {clean:.3f}); latent mean {np.round(mean, 2).tolist()}, std {np.round(std, 2).tolist()}")
    k = min(16, eval_images.shape[0])
    save_grid(torch.cat([eval_images[:k].cpu(), recon[:k]]), cols=k, path=run.state_dir / "vae_recon.png")
    run.state["phase"] = "transformer"
