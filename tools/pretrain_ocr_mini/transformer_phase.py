"""Phase 2: the transformer on cached latents (flow matching, EMA, held-out evals that decide the stop),
the size sweep and the final evaluation."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .data import TRAIN_TEMPLATES, eval_seeds, heldout_prompts, periodic_prompts, train_prompts
from .nets import (adaln_zero_init, encode_latents, encode_prompts, flow_matching_loss, round_to_bf16_, sample_images,
                   schedule_mu, start_point_action, train_sigmas, transformer_config)
from .ocr_pool import PendingScore, ocr_metrics
from .pictures import save_grid
from .state import Run, save_state
from .vae_phase import warmup_factor


@dataclass
class LatentData:
    latents: torch.Tensor      # (N, L, 64) bf16, packed normalised
    prompt_ids: torch.Tensor   # (N,) int64 into the prompt table
    embeds: torch.Tensor       # (P, T, D) fp32 prompt embeddings, right-padded
    mask: torch.Tensor         # (P, T) int64


def build_latent_data(run: Run, vae: torch.nn.Module, images: torch.Tensor) -> LatentData:
    """Latents of the renders; image i shows word i mod W (render_training_images) and gets a random training
    template, i.e. prompt id (i mod W) * len(TRAIN_TEMPLATES) + template."""
    args = run.args
    t0 = time.monotonic()
    latents = encode_latents(vae, images, args.encode_batch, run.amp)
    n, n_words, n_templates = images.shape[0], len(run.words), len(TRAIN_TEMPLATES)
    gen = torch.Generator(device=run.device).manual_seed(args.seed * 1000 + 17 + len(run.state["calls"]))
    template = torch.randint(0, n_templates, (n,), device=run.device, generator=gen)
    prompt_ids = (torch.arange(n, device=run.device) % n_words) * n_templates + template
    table = encode_prompts(run.base, train_prompts(run.words))
    run.log(f"[data] encoded {n} latents {tuple(latents.shape[1:])} and {len(table)} prompt embeddings "
            f"{tuple(table.embeds.shape[1:])} in {time.monotonic() - t0:.1f} s")
    return LatentData(latents, prompt_ids, table.embeds.float(), table.mask)


def should_compile(mode: str, expected_train_s: float, min_s: float) -> bool:
    """'blocks' / 'none' as given; 'auto' compiles when this call expects at least `min_s` seconds of training:
    compiling costs about a minute once per call and pays back only over a few minutes of faster steps."""
    if mode not in ("auto", "blocks", "none"):
        raise ValueError(f"--compile must be auto, blocks or none, got {mode!r}")
    return mode == "blocks" or (mode == "auto" and expected_train_s >= min_s)


def compile_blocks(transformer: torch.nn.Module) -> None:
    """torch.compile of each QwenImageTransformerBlock (diffusers' regional compilation; one graph, reused)."""
    transformer.compile_repeated_blocks(dynamic=False)


def uncompile_blocks(transformer: torch.nn.Module) -> None:
    for block in transformer.transformer_blocks:
        block._compiled_call_impl = None
    torch._dynamo.reset()


def ema_snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


class HeldoutEval:
    """Periodic held-out evals: sample with the EMA weights (uncompiled copy), score on the pool asynchronously,
    decide the stop. Eval i keeps a CPU snapshot of the weights it sampled with (the last two), so a decision
    restores exactly the evaluated weights; the state's weights at the start of the call stand for the previous
    call's last eval."""

    def __init__(self, run: Run, ema_model, ema: torch.nn.Module):
        self.run, self.model, self.ema = run, ema_model, ema
        self.items = periodic_prompts(run.words)
        self.pending: PendingScore | None = None
        curve = run.state["curves"]["eval"]
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {len(curve) - 1: ema_snapshot(ema)} if curve else {}
        self.decision: str | None = None
        self.decided: dict[str, Any] | None = None
        self.last_train_s: float | None = None

    def submit(self) -> None:
        run, args, st = self.run, self.run.args, self.run.state["transformer"]
        prompts = [p for p, _ in self.items for _ in range(args.eval_seeds)]
        targets = [w for _, w in self.items for _ in range(args.eval_seeds)]
        seeds = [s for i in range(len(self.items)) for s in eval_seeds(i, args.eval_seeds)]
        index = len(run.state["curves"]["eval"])
        images = sample_images(self.model, prompts, seeds, args.eval_steps, args.resolution, run.amp,
                               args.eval_batch)
        self.snapshots[index] = ema_snapshot(self.ema)
        for old in [k for k in self.snapshots if k < index - 1]:
            del self.snapshots[old]
        meta = {"index": index, "total_s": run.total_s(), "phase_s": st["seconds"], "train_s": st["train_seconds"],
                "step": st["steps"], "images": st["images"], "steps": args.eval_steps}
        self.pending = run.pool.score(images, targets, meta)
        self.last_train_s = st["train_seconds"]

    def collect(self, wait: bool = False) -> bool:
        """Record a finished eval (True if one was recorded); sets `decision` once an eval ends the phase."""
        if self.pending is None or (not wait and not self.pending.ready()):
            return False
        run, args, meta = self.run, self.run.args, self.pending.meta
        scores, texts, ocr_s = self.pending.get(timeout_s=max(30.0, run.time_left()))
        self.pending = None
        run.record_ocr_rate(len(scores), ocr_s)
        metrics = ocr_metrics(scores.reshape(len(self.items), args.eval_seeds))
        curve = run.state["curves"]["eval"]
        previous = curve[-1]["mean"] if curve else None
        entry = {**meta, **metrics}
        curve.append(entry)
        action = start_point_action(metrics["mean"], previous, window=tuple(args.window),
                                    stop_reward=args.stop_reward)
        examples = ", ".join(f"{w}->{t!r}" for (_, w), t in zip(self.items[:4], texts[::args.eval_seeds][:4]))
        run.log(f"[eval] held-out @ {meta['train_s']:.0f} s of training (step {meta['step']}, {meta['images']} img): "
                f"reward {metrics['mean']:.3f} exact {metrics['exact']:.3f} within-prompt std "
                f"{metrics['within_std']:.3f} ({metrics['n_prompts']}x{metrics['n_seeds']}, {args.eval_steps} steps, "
                f"OCR {ocr_s:.1f} s) -> {action}; e.g. {examples}")
        if action != "continue":
            keep = meta["index"] if action == "stop" else meta["index"] - 1
            if keep not in self.snapshots:
                run.log(f"[eval] no snapshot of eval {keep}; keeping eval {meta['index']}'s weights")
                keep, action = meta["index"], "stop"
            self.ema.load_state_dict(self.snapshots[keep])
            self.decision = action
            self.decided = next(e for e in curve if e["index"] == keep)
        return True


def flow_matching_backward(model, data: LatentData, idx: torch.Tensor, mu: float, gen: torch.Generator,
                           amp: Callable) -> torch.Tensor:
    """One batch's `flow_matching_loss` (latents `data.latents[idx]`, their prompts, fresh noise and sigmas from
    `gen`) and its backward; returns the detached loss."""
    from models.base import PromptEmbeds

    x0 = data.latents[idx].float()
    pid = data.prompt_ids[idx]
    noise = torch.randn(x0.shape, generator=gen, device=x0.device)
    sigmas = train_sigmas(idx.shape[0], mu, gen, x0.device)
    with amp():
        loss = flow_matching_loss(model, x0, PromptEmbeds(data.embeds[pid], data.mask[pid]), sigmas, noise)
    loss.backward()
    return loss.detach()


def parse_sweep(items: Sequence[str], default_lr: float) -> list[dict[str, Any]]:
    """'LAYERSxWIDTH' or 'LAYERSxWIDTH:LR' items -> [{layers, width, lr, name}]."""
    out = []
    for item in items:
        shape, _, lr = item.partition(":")
        layers, _, width = shape.partition("x")
        try:
            out.append({"layers": int(layers), "width": int(width), "lr": float(lr) if lr else default_lr,
                        "name": item})
        except ValueError:
            raise SystemExit(f"--sweep {item!r}: expected LAYERSxWIDTH or LAYERSxWIDTH:LR, e.g. 4x160 or 4x160:1e-3")
    return out


def sweep_transformers(run: Run, vae: torch.nn.Module, data: LatentData) -> dict[str, Any]:
    """Train each --sweep configuration from adaLN-zero init for --sweep_s seconds (eager, same data order,
    noise and lr schedule; --batch_size, --warmup_steps, --grad_clip) and record its loss curve against
    training seconds; the best is the lowest mean loss over the last third of its time. A loss curve at equal
    GPU-seconds, not the OCR reward: at a minute of training nothing is legible yet. Stored in state['sweep']."""
    from diffusers import QwenImageTransformer2DModel

    args, device = run.args, run.device
    text_dim = run.state["config"]["transformer"]["joint_attention_dim"]
    mu = schedule_mu(run.base.scheduler_config, data.latents.shape[1])
    results = []
    for entry in parse_sweep(args.sweep, args.lr):
        config = transformer_config(entry["layers"], entry["width"], args.head_dim, text_dim)
        torch.manual_seed(args.seed)
        transformer = QwenImageTransformer2DModel(**config)
        adaln_zero_init(transformer)
        transformer.to(device).train()
        params = list(transformer.parameters())
        model = run.wrapper(transformer, vae)
        opt = torch.optim.AdamW(params, lr=entry["lr"], betas=(0.9, 0.99), weight_decay=args.weight_decay,
                                **({"fused": True} if device.type == "cuda" else {}))
        gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + 7)
        curve, train_s, step, next_log, acc, acc_n = [], 0.0, 0, args.log_every_s / 2, 0.0, 0
        while train_s < args.sweep_s and run.time_left() > run.reserve():
            t0 = time.monotonic()
            for group in opt.param_groups:
                group["lr"] = entry["lr"] * warmup_factor(step, args.warmup_steps)
            idx = torch.randint(0, data.latents.shape[0], (args.batch_size,), generator=gen, device=device)
            loss = flow_matching_backward(model, data, idx, mu, gen, run.amp)
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            acc, acc_n = acc + float(loss), acc_n + 1  # syncs: the timing is of whole steps
            step += 1
            if step > 1:  # the first step (allocations, autotuning) is not timed
                train_s += time.monotonic() - t0
            if train_s >= next_log:
                curve.append({"train_s": round(train_s, 2), "step": step, "loss": acc / acc_n})
                acc, acc_n, next_log = 0.0, 0, train_s + args.log_every_s / 2
        tail = [c["loss"] for c in curve if c["train_s"] >= 2 * train_s / 3] or [float("nan")]
        result = {**entry, "params": sum(p.numel() for p in params), "steps": step, "train_s": train_s,
                  "images_per_s": step * args.batch_size / max(train_s, 1e-9), "tail_loss": float(np.mean(tail)),
                  "curve": curve}
        results.append(result)
        run.log(f"[sweep] {entry['name']}: {result['params'] / 1e6:.2f}M params, {step} steps in {train_s:.0f} s "
                f"({result['images_per_s']:.0f} img/s), loss over the last third {result['tail_loss']:.4f}")
        del transformer, model, opt, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    finished = [r for r in results if math.isfinite(r["tail_loss"])]
    best = min(finished, key=lambda r: r["tail_loss"]) if finished else None
    sweep = {"seconds_each": args.sweep_s, "batch_size": args.batch_size, "results": results,
             "best": best["name"] if best else None}
    run.state.setdefault("sweeps", []).append(sweep)
    run.log(f"[sweep] best: {sweep['best']} (pass its --layers/--width/--lr to the next call)")
    return sweep


def train_transformer(run: Run, vae: torch.nn.Module, transformer: torch.nn.Module, data: LatentData) -> None:
    """Flow-matching training until the start point, --transformer_max_s (cumulative) or the call's deadline.
    The EMA copy (`run.ema`, uncompiled, what evals sample and what is saved) ends holding the chosen weights."""
    args, st = run.args, run.state["transformer"]
    device, n = run.device, data.latents.shape[0]
    ema = copy.deepcopy(transformer).requires_grad_(False).eval()
    run.ema = ema
    ema_model, model = run.wrapper(ema, vae), run.wrapper(transformer, vae)
    transformer.train().requires_grad_(True)
    params, ema_params = list(transformer.parameters()), list(ema.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay,
                            **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + 101 + len(run.state["calls"]))
    mu = schedule_mu(run.base.scheduler_config, data.latents.shape[1])
    evaluator = HeldoutEval(run, ema_model, ema)
    expected_s = min(run.time_left() - run.reserve(), args.transformer_max_s - st["train_seconds"])
    compiled = should_compile(args.compile, expected_s, args.compile_min_s)
    if compiled:
        compile_blocks(transformer)
    step0, seconds0, train0, t_phase = st["steps"], st["seconds"], st["train_seconds"], time.monotonic()
    train_s, timed_images, first, skips, reason = 0.0, 0, True, 0, "the call's deadline"
    next_eval, next_log, loss_acc, acc_n = args.eval_every_s, args.log_every_s, None, 0
    perm, ptr = torch.randperm(n, generator=gen, device=device), 0
    run.log(f"[transformer] training {sum(p.numel() for p in params) / 1e6:.2f}M params on {n} latents, batch "
            f"{args.batch_size}, lr {args.lr}, ema {args.ema_decay}, mu {mu:.3f}, compile {args.compile} -> "
            f"{'blocks' if compiled else 'none'} (~{expected_s:.0f} s of training expected), from step "
            f"{step0} ({st['images']} images, {train0:.0f} s of training so far)")
    while True:
        st["seconds"], st["train_seconds"] = seconds0 + time.monotonic() - t_phase, train0 + train_s
        if evaluator.collect():
            save_state(run, None, ema)  # a crash later keeps this call's progress
            if evaluator.decision is not None:
                reason = f"start point ({evaluator.decision})"
                break
        if st["train_seconds"] >= args.transformer_max_s:
            reason = f"--transformer_max_s {args.transformer_max_s} reached"
            break
        if run.time_left() < run.reserve():
            break
        if evaluator.pending is None and train_s >= next_eval:
            evaluator.submit()
            next_eval = train_s + args.eval_every_s
        if ptr + args.batch_size > n:
            perm, ptr = torch.randperm(n, generator=gen, device=device), 0
        idx = perm[ptr:ptr + args.batch_size]
        ptr += args.batch_size
        k = st["steps"] - step0
        for group in opt.param_groups:
            group["lr"] = args.lr * warmup_factor(k, args.warmup_steps)
        if first:
            run.log("[transformer] first step" + (" (torch.compile of the repeated blocks)" if compiled else ""))
        t_step = time.monotonic()
        try:
            loss = flow_matching_backward(model, data, idx, mu, gen, run.amp)
        except Exception as e:  # compile problems surface in the first step; the math is the same without it
            if not (first and compiled):
                raise
            run.log(f"[transformer] WARNING: torch.compile failed ({type(e).__name__}: {str(e)[:400]}); "
                    "continuing EAGER (same numbers, slower)")
            opt.zero_grad(set_to_none=True)
            uncompile_blocks(transformer)
            compiled = False
            continue
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        if bool(torch.isfinite(grad_norm)):
            opt.step()
            decay = min(args.ema_decay, (1 + k) / (10 + k))
            torch._foreach_lerp_(ema_params, [p.detach() for p in params], 1.0 - decay)
            st["steps"] += 1
            st["images"] += args.batch_size
            loss_acc = loss.detach() if loss_acc is None else loss_acc + loss.detach()
            acc_n, skips = acc_n + 1, 0
        else:
            skips += 1
            run.log(f"[transformer] non-finite gradient at step {st['steps']}: skipped ({skips} in a row)")
            if skips >= 20:
                raise RuntimeError("20 consecutive non-finite gradients; lower --lr (the last saved state is kept)")
        opt.zero_grad(set_to_none=True)
        dt = time.monotonic() - t_step
        if first:
            run.log(f"[transformer] first step took {dt:.1f} s")
            st.setdefault("first_step_s", []).append(round(dt, 2))
            first = False
            continue
        train_s += dt
        timed_images += args.batch_size
        if train_s >= next_log and acc_n:
            mean_loss = float(loss_acc) / acc_n
            run.state["curves"]["loss"].append({"total_s": run.total_s(), "phase_s": st["seconds"],
                                                "train_s": train0 + train_s, "step": st["steps"],
                                                "images": st["images"], "loss": mean_loss})
            run.log(f"[transformer] step {st['steps']} img {st['images']} ({timed_images / train_s:.0f} img/s) "
                    f"loss {mean_loss:.4f} lr {opt.param_groups[0]['lr']:.1e} left {run.time_left():.0f} s")
            loss_acc, acc_n, next_log = None, 0, train_s + args.log_every_s
    st["seconds"], st["train_seconds"] = seconds0 + time.monotonic() - t_phase, train0 + train_s
    if evaluator.pending is not None:
        evaluator.collect(wait=True)
    if evaluator.decision is None and (evaluator.last_train_s is None or st["train_seconds"] > evaluator.last_train_s):
        evaluator.submit()  # the end-of-call point of the curve, on the weights that are saved
        evaluator.collect(wait=True)
    if evaluator.decision is not None:
        reason = f"start point ({evaluator.decision})"
        run.state["start_point"] = {"action": evaluator.decision, "eval": evaluator.decided}
        run.state["phase"] = "done"
    st["seconds"] = seconds0 + time.monotonic() - t_phase
    transformer.requires_grad_(False).eval()
    if compiled:
        uncompile_blocks(transformer)
    run.log(f"[transformer] stopped after {st['train_seconds']:.0f} s of training ({st['seconds']:.0f} s in the "
            f"phase), step {st['steps']}, {st['images']} images: {reason}")


def final_eval(run: Run, vae: torch.nn.Module, ema: torch.nn.Module) -> None:
    """The start-point measurement on the weights that ship (bf16-rounded EMA): every held-out prompt x
    --final_seeds seeds at each --final_eval_steps; samples.png holds the first 16 prompts' scored images."""
    args = run.args
    round_to_bf16_(ema)
    model = run.wrapper(ema, vae)
    items = heldout_prompts(run.words)
    prompts = [p for p, _ in items for _ in range(args.final_seeds)]
    targets = [w for _, w in items for _ in range(args.final_seeds)]
    seeds = [s for i in range(len(items)) for s in eval_seeds(i, args.final_seeds)]
    jobs = []
    for steps in args.final_eval_steps:  # sample everything first, the OCR of one overlaps the next sampling
        images = sample_images(model, prompts, seeds, steps, args.resolution, run.amp, args.eval_batch)
        jobs.append((steps, images, run.pool.score(images, targets)))
    results, lo, hi = {}, args.window[0], args.window[1]
    for steps, _, job in jobs:
        scores, texts, ocr_s = job.get(timeout_s=max(30.0, run.time_left()))
        matrix = scores.reshape(len(items), args.final_seeds)
        metrics = ocr_metrics(matrix)
        per_word = {w: float(np.mean([matrix[i].mean() for i, (_, ww) in enumerate(items) if ww == w]))
                    for w in run.words}
        results[str(steps)] = {**metrics, "per_word": per_word, "rewards": matrix.round(4).tolist(),
                               "transcriptions": texts[:64]}
        run.log(f"[final] {steps} steps: held-out reward {metrics['mean']:.3f} exact {metrics['exact']:.3f} "
                f"within-prompt std {metrics['within_std']:.3f} spread {metrics['spread']:.2f} "
                f"({metrics['n_prompts']} prompts x {metrics['n_seeds']} seeds, OCR {ocr_s:.1f} s): "
                f"{'inside' if lo <= metrics['mean'] <= hi else 'OUTSIDE'} the start-point window [{lo}, {hi}]")
    tr = run.state["transformer"]
    run.state["final_eval"] = {"total_s": run.total_s(), "train_s": tr["train_seconds"], "step": tr["steps"],
                               "images": tr["images"], "by_steps": results, "prompts": [p for p, _ in items],
                               "seeds_per_prompt": args.final_seeds}
    count = min(16, len(items)) * args.final_seeds
    save_grid(jobs[0][1][:count], cols=args.final_seeds, path=run.state_dir / "samples.png")
    run.state["samples"] = {"file": "samples.png", "prompts": prompts[:count], "seeds": seeds[:count],
                            "steps": jobs[0][0], "cols": args.final_seeds, "size": args.resolution}
