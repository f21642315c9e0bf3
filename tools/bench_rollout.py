#!/usr/bin/env python3
"""Benchmark the native rollout engine: sequential CFG (two transformer forwards per step, the baseline) against
batched CFG (`cfg_batch=True`: one forward over [cond ; uncond]), in ONE run, on mid-size random-weight checkpoints
that this script builds itself in the real on-disk layout (nothing is downloaded).

    python tools/bench_rollout.py                         # GPU default: cuda, bf16, 16 x 512x512, 10 steps, CFG 4
    python tools/bench_rollout.py --device cpu --quick    # smoke test on CPU (tiny widths, < 1 min)

Checkpoints: `tools/build_tiny_models.py` builds each pipeline (tokenizer, tiny text encoder, tiny VAE,
scheduler config, model_index.json) and the transformer/ folder is then replaced by a mid-size one with the RELEASED
widths (Qwen-Image: 24 heads x 128, Boogu: hidden 3360, 28 heads / 7 kv heads, FFN 13568) and fewer layers
(flags), initialised on the target device and saved in the run dtype. So every GEMM and attention call has the
real per-layer shape; only depth is cut. The text encoders and VAEs stay tiny: prompt encoding and decoding are
identical in both modes (they only dilute the rollout ratio; see the `guided_velocity` rows for the transformer
alone).

What it measures, per family (median over --repeats, modes interleaved, CUDA-synchronised, after --warmup):
- `rollout`: `NativeEngine.generate` of one realistic SDE request (B samples, one chunk, window of 2 steps with
  log-probs and trajectory, real OCR-style prompts with a short negative), seconds and images/s;
- `guided_velocity`: one CFG velocity call on the same batch (the transformer part alone);
- ratio = baseline time / batched time (> 1 = batched is faster), peak GPU memory.
Agreement (so that a speed-up is honest): max relative difference max|a-b|/max|b| between batched and sequential
of one velocity call and of the rollout's final latents, log-probs and images; next to two noise floors measured in
the same run: the same sequential rollout repeated (kernel determinism) and the sequential rollout split into two
half-size chunks (how much merely changing the batch shape moves the numbers). The run exits 1 if the velocity
difference exceeds --max-velocity-rel-diff.

Cost estimate at the defaults (printed per family; the models' own FLOP formula, `FlowModel.forward_flops`, from
the built configs and each prompt's token count): Qwen-Image 8 layers (2.75B) ~2.0 TFLOP per sample-forward at 1024
image + ~34 text tokens (each token meets only its own stream's weights, about half the parameters), ~64 TFLOP per
CFG velocity of 16 samples (the negative ~6 tokens), ~0.64 PFLOP per 10-step rollout; Boogu 2 double + 6 single + 1
refiner each (2.48B) ~3.6 TFLOP per sample-forward (~60 instruction tokens, the negative's system prompt ~66),
~1.1 PFLOP per rollout. About 10 rollout-equivalents per family (2 warm-ups, 6 timed, 1 split-batch floor, ~12
velocity calls) = ~18 PFLOP in total: ~45 s at 400 TFLOP/s effective bf16 on an H200 (~1.5 min at 200), plus ~1 min
of imports, building and loading (each ~5 GB bf16 transformer is written and read once).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)

import build_tiny_models  # noqa: E402
import rollout  # noqa: E402
from models import family_class  # noqa: E402


# OCR-style prompts (written for this benchmark; the same kind and length as Flow-GRPO's OCR split: 30-60 tokens).
PROMPTS = [
    'A rustic wooden sign hanging above a bakery door, carved letters reading "Fresh Bread Daily", morning light '
    'catching the flour dust in the air, a bicycle parked beside the window.',
    'A neon sign glowing pink and blue in a rainy alley, spelling out "Open All Night", reflections shimmering in '
    'the puddles below.',
    'A chalkboard menu outside a seaside cafe with the words "Catch of the Day" written in looping white chalk, '
    'seagulls in the background.',
    'A vintage movie poster on a brick wall announcing "The Last Lighthouse" in bold art deco lettering, edges torn '
    'and faded by the sun.',
    'A close-up of a birthday cake with blue icing that says "Happy 30th Maya", candles lit, confetti scattered on '
    'the table.',
    'A highway billboard at sunset advertising "Mountain Springs Water" with a crisp photo of a glacier lake.',
    'A handwritten note on yellow paper stuck to a fridge reading "Buy milk and eggs", a magnet shaped like a '
    'strawberry holding it.',
    'A museum placard beneath a dinosaur skeleton reading "Tyrannosaurus Rex, Late Cretaceous", soft spotlights on '
    'the bones.',
]


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------


def qwen_transformer_config(args) -> dict[str, Any]:
    if args.quick:
        return dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                    num_attention_heads=2, joint_attention_dim=build_tiny_models.TINY_TEXT_HIDDEN,
                    guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    # released widths, fewer layers; the text width is the tiny encoder's
    return dict(patch_size=2, in_channels=64, out_channels=16, num_layers=args.qwen_layers, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=build_tiny_models.TINY_TEXT_HIDDEN,
                guidance_embeds=False, axes_dims_rope=(16, 56, 56))


def boogu_transformer_config(args) -> dict[str, Any]:
    config = dict(build_tiny_models.TINY_BOOGU_TRANSFORMER)
    if args.quick:
        return config
    # released widths, fewer layers; instruction_feat_dim = the tiny encoder's
    config.update(hidden_size=3360, num_attention_heads=28, num_kv_heads=7, multiple_of=256,
                  axes_dim_rope=(40, 40, 40), num_layers=args.boogu_double_layers + args.boogu_single_layers,
                  num_double_stream_layers=args.boogu_double_layers, num_refiner_layers=args.boogu_refiner_layers)
    return config


BUILDS = ("qwen_image", "boogu_image")  # the families build_checkpoint knows; a new family is added there first


def build_checkpoint(family: str, out_dir: str, args, device: torch.device, dtype: torch.dtype) -> str:
    """Build the pipeline folder `out_dir/family` (tiny encoder/VAE via build_tiny_models, mid-size transformer)."""
    path = os.path.join(out_dir, family)
    if os.path.exists(path):
        shutil.rmtree(path)
    torch.manual_seed(0)
    if family not in BUILDS:
        raise ValueError(f"{family}: this bench builds checkpoints of {', '.join(BUILDS)} only")
    if family == "qwen_image":
        from diffusers import QwenImageTransformer2DModel

        build_tiny_models.build_qwen_image(path)
        cls, config = QwenImageTransformer2DModel, qwen_transformer_config(args)
    else:
        from models.boogu_image_transformer import BooguImageTransformer2DModel

        build_tiny_models.build_boogu_image(path, edit=False)
        cls, config = BooguImageTransformer2DModel, boogu_transformer_config(args)
    shutil.rmtree(os.path.join(path, "transformer"))
    torch.manual_seed(1)
    with torch.device(device):  # random init on the target device: seconds instead of minutes for billions of weights
        transformer = cls(**config)
    transformer.to(dtype).save_pretrained(os.path.join(path, "transformer"))
    del transformer
    return path


# ---------------------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - start, out


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (float64)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def make_request(family: str, args) -> rollout.RolloutRequest:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    window = min(2, args.steps - 1) if args.steps > 1 else None
    return rollout.RolloutRequest(
        prompts=prompts, negative_prompts=[family_class(family).default_negative_prompt] * args.batch,
        seeds=[rollout.row_seed(args.seed, 1, i) for i in range(args.batch)],
        num_inference_steps=args.steps, height=args.height, width=args.width, noise_level=args.noise_level,
        sde_window_size=window, sde_window_range=(0, args.steps) if window else None,
        return_log_probs=window is not None, return_trajectory=window is not None, cfg_scale=args.scale)


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def bench_family(family: str, path: str, args, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    t0 = time.perf_counter()
    # one engine for both modes (same weights and memory state); the mode is the model's `cfg_batch` attribute,
    # which `NativeEngine(cfg_batch=...)` sets at load time
    engine = rollout.NativeEngine(path, device=str(device), dtype=dtype, max_batch_size=args.batch, cfg_batch=False)
    model = engine.model
    load_s = time.perf_counter() - t0
    request = make_request(family, args)

    # ---- one guided velocity call on the rollout's batch --------------------------------------------------------
    with torch.no_grad():
        prompt = model.encode_prompt(request.prompts)
        negative = model.encode_prompt(request.negative_prompts)
        generators = [torch.Generator().manual_seed(s) for s in request.seeds]
        latents = model.prepare_noise(args.height, args.width, generators).to(device)
        sigma = model.schedule(args.steps, args.height, args.width)[min(1, args.steps - 1)].expand(args.batch)
        size = dict(height=args.height, width=args.width)
        image_tokens = (args.height // 16) * (args.width // 16)
        text_tokens = prompt.mask.sum(1).tolist()  # valid tokens of each prompt
        # one CFG velocity = a forward of each branch, one without CFG (the model's FLOP formula: matmuls, 2 per
        # multiply-add)
        velocity_tflop = (model.forward_flops(image_tokens, text_tokens) + (
            model.forward_flops(image_tokens, negative.mask.sum(1).tolist()) if args.scale > 1 else 0.0)) / 1e12

        def velocity(mode: bool) -> torch.Tensor:
            model.cfg_batch = mode
            return model.guided_velocity(latents, sigma, prompt, negative, args.scale, **size)

        velocities, vel_times = {}, {False: [], True: []}
        for mode in (False, True):
            for _ in range(args.warmup):
                velocity(mode)
        for _ in range(args.velocity_repeats):
            for mode in (False, True):
                seconds, velocities[mode] = timed(lambda: velocity(mode), device)
                vel_times[mode].append(seconds)

    # ---- rollouts -------------------------------------------------------------------------------------------------
    def generate(mode: bool, max_batch_size: int | None = None) -> rollout.RolloutResult:
        model.cfg_batch = mode
        engine.max_batch_size = max_batch_size or args.batch
        try:
            return engine.generate(request)
        finally:
            engine.max_batch_size = args.batch

    for mode in (False, True):
        for _ in range(args.warmup):
            generate(mode)
    times: dict[bool, list[float]] = {False: [], True: []}
    results: dict[bool, list[rollout.RolloutResult]] = {False: [], True: []}
    peaks: dict[bool, float | None] = {}
    for _ in range(args.repeats):
        for mode in (False, True):
            reset_peak(device)
            seconds, result = timed(lambda: generate(mode), device)
            peak = peak_memory_gib(device)
            peaks[mode] = peak if peaks.get(mode) is None else max(peaks[mode], peak)
            times[mode].append(seconds)
            results[mode].append(result)
    split = generate(False, max_batch_size=max(1, args.batch // 2)) if args.batch > 1 else None
    model.cfg_batch = False

    seq, bat = results[False][-1], results[True][-1]
    agreement = {
        "velocity": rel_diff(velocities[True], velocities[False]),
        "latents_clean": rel_diff(bat.latents_clean, seq.latents_clean),
        "images_max_abs": (bat.images.int() - seq.images.int()).abs().max().item(),
        "log_probs_max_abs": None if seq.all_log_probs is None else
        (bat.all_log_probs - seq.all_log_probs).abs().max().item(),
        "floor_repeat": None if args.repeats < 2 else rel_diff(results[False][0].latents_clean, seq.latents_clean),
        "floor_split": None if split is None else rel_diff(split.latents_clean, seq.latents_clean),
        "metadata_cfg_batch": (seq.metadata["cfg_batch"], bat.metadata["cfg_batch"]),
    }
    return dict(family=family, load_s=load_s, times=times, vel_times=vel_times, peaks=peaks, agreement=agreement,
                tflop_per_forward=model.forward_flops(image_tokens, text_tokens) / len(text_tokens) / 1e12,
                velocity_tflop=velocity_tflop, rollout_tflop=velocity_tflop * args.steps,
                text_tokens=round(sum(text_tokens) / len(text_tokens)),
                image_tokens=image_tokens, params=sum(p.numel() for p in model.transformer.parameters()))


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def report(rows: list[dict[str, Any]], args) -> bool:
    ok = True
    print()
    header = (f"{'family':<12} {'what':<16} {'mode':<11} {'median s':>9} {'min s':>8} {'ratio':>6} {'img/s':>7} "
              f"{'TFLOP/s':>8} {'peak GiB':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        for what, times in (("rollout", row["times"]), ("guided_velocity", row["vel_times"])):
            base = statistics.median(times[False])
            for mode in (False, True):
                median = statistics.median(times[mode])
                if what == "rollout":
                    rate = f"{args.batch / median:7.2f}"
                    flops = row["rollout_tflop"] / median
                    peak = row["peaks"][mode]
                else:
                    rate, flops, peak = f"{'':>7}", row["velocity_tflop"] / median, None
                print(f"{row['family']:<12} {what:<16} {'batched' if mode else 'sequential':<11} {median:9.4f} "
                      f"{min(times[mode]):8.4f} {base / median:6.3f} {rate} {flops:8.1f} "
                      f"{'' if peak is None else f'{peak:8.2f}'}")
    print()
    print("agreement, batched vs sequential (max|a-b|/max|b| unless noted; floors: same mode repeated / split into "
          "two half-size chunks):")
    for row in rows:
        a = row["agreement"]
        limit = args.max_velocity_rel_diff
        verdict = "ok" if a["velocity"] <= limit else f"FAILED (> {limit:g})"
        ok &= a["velocity"] <= limit and a["metadata_cfg_batch"] == (False, True)
        fmt = lambda v: "n/a" if v is None else f"{v:.3g}"  # noqa: E731
        print(f"  {row['family']:<12} velocity {a['velocity']:.3g} [{verdict}]  final latents {a['latents_clean']:.3g}"
              f"  log-probs max abs {fmt(a['log_probs_max_abs'])}  images max abs {a['images_max_abs']}/255  |  "
              f"floors: repeat {fmt(a['floor_repeat'])}, split batch {fmt(a['floor_split'])}  |  metadata cfg_batch "
              f"{a['metadata_cfg_batch']}")
    return ok


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--families", nargs="+", default=list(BUILDS), choices=BUILDS,
                   help="the families whose mid-size checkpoints this bench builds")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                   help="model dtype (default bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--batch", type=int, default=16, help="samples per rollout (one engine chunk)")
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=10, help="num_inference_steps")
    p.add_argument("--scale", type=float, default=4.0,
                   help="CFG scale (the RolloutRequest's cfg_scale: Boogu guidance_scale / Qwen true_cfg_scale)")
    p.add_argument("--noise-level", type=float, default=0.7, help="SDE noise level of the rollout")
    p.add_argument("--repeats", type=int, default=3, help="timed rollouts per mode (median reported)")
    p.add_argument("--velocity-repeats", type=int, default=5, help="timed guided_velocity calls per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per mode first")
    p.add_argument("--qwen-layers", type=int, default=8, help="Qwen-Image transformer blocks (released: 60)")
    p.add_argument("--boogu-double-layers", type=int, default=2, help="Boogu double-stream blocks (released: 8)")
    p.add_argument("--boogu-single-layers", type=int, default=6, help="Boogu single-stream blocks (released: 32)")
    p.add_argument("--boogu-refiner-layers", type=int, default=1, help="Boogu refiner blocks each (released: 2)")
    p.add_argument("--max-velocity-rel-diff", type=float, default=None,
                   help="fail above this batched-vs-sequential velocity difference (default 1e-4 fp32, 3e-2 else)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where checkpoints are built (default: a temp dir, removed)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    p.add_argument("--json", default=None, help="also write the raw timings and agreement numbers to this file")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tiny widths, batch 2, 64x64, 2 steps, 1 repeat (use with --device cpu)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.height, args.width, args.steps = 2, 64, 64, 2
        args.repeats, args.velocity_repeats = 1, 2
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.max_velocity_rel_diff is None:
        args.max_velocity_rel_diff = 1e-4 if args.dtype == "float32" else 3e-2
    for name in ("batch", "steps", "repeats", "velocity_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()  # progress bars and load chatter would bury the table
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but CUDA is not available; use --device cpu --quick for a smoke test")
    started = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_rollout-")
    print(f"bench_rollout: {args.families} on {device} ({args.dtype}), batch {args.batch}, {args.height}x{args.width}, "
          f"{args.steps} steps, CFG {args.scale}, repeats {args.repeats}, warm-up {args.warmup}; "
          f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""))
    rows = []
    try:
        for family in args.families:
            t0 = time.perf_counter()
            path = build_checkpoint(family, workdir, args, device, dtype)
            build_s = time.perf_counter() - t0
            row = bench_family(family, path, args, device, dtype)
            print(f"  {family}: transformer {row['params'] / 1e9:.2f}B params, build {build_s:.1f}s, load "
                  f"{row['load_s']:.1f}s, ~{row['text_tokens']} text + {row['image_tokens']} image tokens/sample, "
                  f"~{row['tflop_per_forward']:.2f} TFLOP per sample-forward, ~{row['rollout_tflop']:.0f} TFLOP "
                  f"per rollout")
            rows.append(row)
            report([row], args)  # partial results survive a later failure or time-out
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print("\n==== summary ====")
    ok = report(rows, args)
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": [{**row, "times": {str(k): v for k, v in row["times"].items()},
                                                      "vel_times": {str(k): v for k, v in row["vel_times"].items()},
                                                      "peaks": {str(k): v for k, v in row["peaks"].items()}}
                                                     for row in rows]}, f, indent=2, default=str)
    print(f"\nratio = sequential median / this row's median (> 1: faster than the sequential-CFG baseline); "
          f"total wall time {time.perf_counter() - started:.0f}s")
    if not ok:
        print("AGREEMENT CHECK FAILED: batched CFG does not reproduce sequential CFG within tolerance")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
