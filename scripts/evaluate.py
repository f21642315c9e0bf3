#!/usr/bin/env python3
r"""Score one or several adapters (e.g. the base vs step 0 vs step N) on a test parquet with the run's reward,
exactly as in-training validation computes `val-core/<data_source>/reward/mean@1`, and print a comparison table.

    python3 scripts/evaluate.py --run_dir outputs/demo \
        --adapters base outputs/demo/checkpoints/step_00000010:default outputs/demo/checkpoints/step_00000020:default
    torchrun --nproc_per_node=4 scripts/evaluate.py --run_dir outputs/demo --adapters base lora_dir/ ...

Each adapter is `base` (LoRA off), a PEFT folder, or a checkpoint folder with `:default` / `:old`, verified before any
model loads and again where it is read (`training.verify_adapter_spec`: an adapter of a checkpoint, in either form,
against the checkpoint's COMPLETE manifest, refused without one; a standalone folder has no checksum and is scored
with one line saying it was not verified). The flags are the trainers' own (same names, defaults and meaning;
`--help` lists those used here) and `--run_dir` makes the run's values the defaults: model, --val_files,
--val_max_samples, --val_seed, --val_num_inference_steps, size, guidance, --rollout_dtype, --rollout_max_batch_size
and every reward flag. Those values are the ones the run's newest complete checkpoint was written with (its
trainer_state.json, verified by its COMPLETE manifest); the run's run_metadata.json must agree with them (an edited
or foreign one is refused, naming both values), and without a checkpoint they come from run_metadata.json,
unverified (the first line printed says where they came from). Without --run_dir, a model folder's own sampling
defaults (its sampling_defaults.json: size, steps as --val_num_inference_steps, CFG) come before the family's, as in
scripts/sample.py, with a warning for a size far from them. Scoring goes through
`training.run_validation`, the function in-training validation calls (prompt i sampled with seed
`rollout.row_seed(--val_seed, 1, i)`, ODE, rewards by data_source), with the rollout engine (`rollout.NativeEngine`)
in this process on this rank's device; `torchrun` splits the prompts over the ranks like the trainers do.

Writes to --output_dir (default <run_dir>/eval): metrics.json (every adapter's validation metrics), samples.jsonl
(one line per adapter and prompt: index, data_source, ground_truth, prompt, seed, reward, reward extras),
grid_<k>_<adapter>.png (the first --num_val_images samples of the k-th adapter, e.g. grid_0_base.png,
grid_2_step_00000300-default.png) and, with --save_images, images/<k>_<adapter>/<index>.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import training as T  # noqa: E402
from models import size_warning  # noqa: E402

# the trainer flags evaluate.py uses (besides every reward flag); the others are accepted and ignored
USED = ("model_path", "device", "val_files", "val_max_samples", "val_seed", "val_num_inference_steps", "height",
        "width", "guidance_scale", "true_cfg_scale", "num_val_images", "rollout_dtype", "rollout_max_batch_size",
        "cfg_batch", "rollout_threads")
NOT_FROM_RUN = ("output_dir", "device")  # where and on what evaluate runs is not the run's business


def parse_args(argv=None) -> argparse.Namespace:
    import rewards

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=T.HelpFormatter, conflict_handler="resolve")
    T.add_common_args(parser)  # the trainers' flags, so run_validation reads the same names as in training
    reward_flags = argparse.ArgumentParser(add_help=False)
    rewards.add_reward_args(reward_flags)
    shown = set(USED) | {a.dest for a in reward_flags._actions}
    for action in parser._actions:
        if action.option_strings and action.dest not in shown and action.dest != "help":
            action.help = argparse.SUPPRESS
    g = parser.add_argument_group("evaluate")
    g.add_argument("--run_dir", default=None, help="a trainer's --output_dir: its flags become the defaults")
    g.add_argument("--adapters", nargs="+", required=True,
                   help="'base', PEFT folders and/or CHECKPOINT:default|old, scored in this order")
    g.add_argument("--output_dir", default=None, help="default: <run_dir>/eval (required without --run_dir)")
    g.add_argument("--save_images", action="store_true",
                   help="also write every sample as images/<k>_<adapter>/<index>.png")
    g.add_argument("--rollout_threads", type=int, default=0,
                   help="torch CPU threads when sampling on the CPU (0 = torch's default). With --run_dir, the run's "
                        "rollout workers' count, which its validation sampled with: a CPU's sums depend on how many "
                        "threads share them, so this is what makes the numbers equal to the last bit")
    parser.set_defaults(run_cfg_scale=None)  # no flag: the --run_dir run's resolved CFG scale, for unset CFG flags
    from_run = {**{d: d for d in shown if d not in NOT_FROM_RUN}, "run_cfg_scale": "cfg_scale"}
    settings_from = T.set_defaults_from_checkpoint(parser, argv, from_run)  # the run's checkpoint, verified
    # without a run, the model folder's own sampling defaults; evaluate samples as validation does (--val_* steps)
    trained, folder_line = T.set_defaults_from_model_folder(parser, argv, steps_dest="val_num_inference_steps")
    settings_from = settings_from or folder_line
    args = parser.parse_args(argv)
    args.settings_from = settings_from
    args.size_warning = size_warning(trained, args.height, args.width)
    for spec in args.adapters:
        if spec != "base":
            try:  # where it is, its checkpoint's sha256 manifest, finiteness: before any model loads
                T.verify_adapter_spec(spec)
            except (ValueError, T.CheckpointError) as e:
                parser.error(f"--adapters {spec}: {e}")
    if not args.model_path or not args.val_files:
        parser.error("--model_path and --val_files are required (or --run_dir)")
    if args.output_dir is None:
        if not args.run_dir:
            parser.error("--output_dir is required without --run_dir")
        args.output_dir = os.path.join(args.run_dir, "eval")
    return args


def adapter_label(k: int, spec: str) -> str:
    """The file-name label of the k-th adapter: `<k>_<name>`, the name being `base`, a PEFT folder's name or a
    checkpoint's `step_XXXXXXXX-<adapter>` (e.g. `2_step_00000300-default`); other characters become `_`."""
    name = os.path.basename(spec.rstrip("/")).replace(":", "-")
    return f"{k}_" + re.sub(r"[^A-Za-z0-9._-]", "_", name)


def lora_signature(adapter_dir: str) -> tuple:
    """(r, alpha, rsLoRA, targets) of a PEFT folder: adapters that differ in it need a fresh engine."""
    from models.base import read_json

    config = read_json(os.path.join(adapter_dir, "adapter_config.json"), "LoRA adapter config")
    return config.get("r"), config.get("lora_alpha"), bool(config.get("use_rslora")), sorted(config["target_modules"])


def summary(samples: list[dict], metrics: dict[str, float]) -> list[tuple[str, int, float, float]]:
    """(val-core key, n, mean, std over samples (ddof 0)) per data source; the mean is validation's own metric."""
    rows = []
    for key, mean in sorted(metrics.items()):
        if key.startswith("val-core/"):
            _, source, var, _ = key.split("/")
            values = np.asarray([s[var] for s in samples if s["data_source"] == source and not s.get("nonfinite")],
                                dtype=np.float64)
            rows.append((key, len(values), mean, float(values.std())))
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    from PIL import Image

    import rewards
    import rollout
    from data_prep.dataset import PromptDataset
    from models import lora, model_family, resolve_model_path

    info = T.init_distributed(T.resolve_device(args.device))
    rank = info.rank
    if info.device.type == "cpu" and args.rollout_threads > 0:
        torch.set_num_threads(args.rollout_threads)
    if rank == 0 and args.settings_from:
        print(args.settings_from, flush=True)
    if rank == 0 and args.size_warning:
        print(args.size_warning, file=sys.stderr, flush=True)
    model_path = resolve_model_path(args.model_path)
    scale = T.run_dir_cfg_scale(model_family(model_path), args)  # an explicit flag, else the --run_dir run's
    scorer = rewards.RewardScorer(rewards.RewardConfig.from_args(args))
    dtype = args.rollout_dtype if info.device.type == "cuda" else "float32"  # as the trainers start their workers

    def new_engine():
        return rollout.NativeEngine(model_path, device=str(info.device), dtype=getattr(torch, dtype),
                                    max_batch_size=args.rollout_max_batch_size, cfg_batch=args.cfg_batch)

    engine, signature = new_engine(), None
    dataset = PromptDataset(args.val_files, guidance=scale > 1.0)
    os.makedirs(args.output_dir, exist_ok=True)
    results = []
    for k, spec in enumerate(args.adapters):
        if spec == "base":
            path, bound = None, 0
            with lora.lora_disabled(engine.model.transformer):
                outcome = T.run_validation(engine, scorer, dataset, args, cfg_scale=scale)
        else:
            path = T.verify_adapter_spec(spec)[0]  # again where it is read (it may have changed since start-up)
            unverified = T.unverified_adapter_line(path)
            if unverified and rank == 0:
                print(unverified, flush=True)
            if signature is not None and lora_signature(path) != signature:
                engine = new_engine()  # another rank / alpha / target list: start from the base weights again
            bound = engine.load_adapter(path, spec)  # raises unless every tensor binds exactly one LoRA module
            signature = lora_signature(path)
            outcome = T.run_validation(engine, scorer, dataset, args, cfg_scale=scale)
        if args.save_images:  # each rank writes its own samples
            folder = os.path.join(args.output_dir, "images", adapter_label(k, spec))
            os.makedirs(folder, exist_ok=True)
            for record, image in zip(outcome.samples[outcome.first:], outcome.local_images):
                Image.fromarray(image.permute(1, 2, 0).numpy()).save(os.path.join(folder, f"{record['index']:05d}.png"))
        results.append({"adapter": spec, "path": path, "bound_modules": bound, "metrics": outcome.metrics,
                        "samples": outcome.samples, "images": outcome.images})

    if rank == 0:
        write_report(args, results)
    T.cleanup_distributed()
    broken = [f"{r['adapter']}: {int(r['metrics']['val-aux/nonfinite_samples'])} of {len(r['samples'])}"
              for r in results if r["metrics"].get("val-aux/nonfinite_samples")]
    if broken:  # its images are not a policy's: never scored, and the run says so rather than ranking it
        raise SystemExit(f"evaluate: samples came back non-finite (NaN/inf latents), were not scored and are left "
                         f"out of the means: {'; '.join(broken)}; that adapter is broken (its metrics.json entry "
                         f"counts them as val-aux/nonfinite_samples)")


def write_report(args, results: list[dict]) -> None:
    """Rank 0: metrics.json, samples.jsonl, grids, and the comparison table on stdout."""
    clean = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v  # noqa: E731  (JSON has no NaN)
    with open(os.path.join(args.output_dir, "samples.jsonl"), "w", encoding="utf-8") as f:
        for r in results:
            f.writelines(json.dumps({"adapter": r["adapter"], **{k: clean(v) for k, v in s.items()}}) + "\n"
                         for s in r["samples"])
    settings = {key: getattr(args, key) for key in USED}
    with open(os.path.join(args.output_dir, "metrics.json"), "w", encoding="utf-8") as f:
        json.dump({"settings": settings, "settings_from": args.settings_from,
                   "adapters": [{k: r[k] for k in ("adapter", "path", "bound_modules", "metrics")} for r in results]},
                  f, indent=2, default=str)
    for k, r in enumerate(results):
        if len(r["images"]):
            captions = [f"r={s['reward']:.3f} | {s['prompt']}" for s in r["samples"][:len(r["images"])]]
            grid = f"grid_{adapter_label(k, r['adapter'])}.png"
            T.image_grid(r["images"], captions).save(os.path.join(args.output_dir, grid))
    width = max(len("adapter"), *(len(r["adapter"]) for r in results))
    print(f"{'adapter':<{width}}  {'bound':>5}  {'metric':<48} {'n':>5} {'mean':>10} {'std':>10}")
    for r in results:
        for key, n, mean, std in summary(r["samples"], r["metrics"]):
            print(f"{r['adapter']:<{width}}  {r['bound_modules']:>5}  {key:<48} {n:>5} {mean:>10.4f} {std:>10.4f}")
    print(f"wrote metrics.json, samples.jsonl and grids to {args.output_dir}", flush=True)


if __name__ == "__main__":
    main()
