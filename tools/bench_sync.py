#!/usr/bin/env python3
"""Benchmark the adapter sync to the rollout workers: the disk path (every step a versioned PEFT safetensors folder
that the workers read) against the tensor path (the adapter handed over in memory: one flat float32 buffer on the
trainer GPU shared through CUDA IPC; a memory file on CPU), in ONE run, at the released LoRA size.

    python tools/bench_sync.py                            # GPU: Qwen-Image, released width, 60 blocks, LoRA r64
    python tools/bench_sync.py --device cpu --quick       # smoke test on CPU (tiny widths, seconds)

The checkpoint is built by `tools/bench_rollout.py`'s `build_checkpoint` (released transformer widths, tiny text
encoder and VAE, random weights, nothing downloaded; ~41 GB in bf16 at 60 blocks, written once to --workdir), or
taken from --model_path. The LoRA is the trainers' default Qwen-Image target list at rank --lora_rank over every
block: 60 blocks x 12 targets = 720 modules, 425M parameters, 1.7 GB in fp32 at r64; random non-zero A and B on
the benchmark's GPU, as a trainer rank holds them after FSDP2's gather.

Both paths are the trainers' own code: disk = what `training.sync_rollout_adapter` does with `--rollout_sync disk`
(device-to-host copies, `save_adapter_dir`, `DistributedRollout.load_adapter`), tensors = `training.publish_tensors`
(`--rollout_sync tensors`). Each repeat times both, interleaved, until every worker answered with its bound-module
count (checked against the module count). The benchmark process stands in for trainer rank 0 on cuda:0; one worker
runs on cuda:0 (the colocated layout: same GPU) and, with --peer and a second GPU, another on cuda:1 (a reserved
rollout GPU: it maps the buffer on cuda:0 and copies it over). FSDP2's all-gather of the adapter (the same in both
paths) is not part of it.

Agreement: after each path has synced the same adapter, one small rollout (1 sample, 256x256, 2 steps, no CFG)
must give the same latents bit for bit; the same rollout repeated after the same sync is the kernels' own floor.
Prints a table and, with --json, writes the numbers; exits 1 if the paths disagree or a worker bound the wrong
count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)

import rollout  # noqa: E402
from training.adapters import publish_tensors  # noqa: E402
from training.model import adapter_config_dict, save_adapter_dir  # noqa: E402


def lora_layout(model_path: str, rank: int) -> tuple[list[tuple[str, tuple[int, ...]]], list[str]]:
    """[(key, shape)] of the trainers' default Qwen-Image LoRA at `rank` over the checkpoint's transformer (built on
    the meta device: only names and shapes), and the target list."""
    from diffusers import QwenImageTransformer2DModel

    from models import lora
    from models.qwen_image import QwenImageModel

    config = QwenImageTransformer2DModel.load_config(os.path.join(model_path, "transformer"))
    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel.from_config(config)
    targets = list(QwenImageModel.default_lora_targets)
    modules = dict(transformer.named_modules())
    layout = []
    for path in lora.validate_lora_targets(transformer, targets, QwenImageModel.lora_block_prefixes):
        linear = modules[path]
        layout += [(f"{path}.lora_A.weight", (rank, linear.in_features)),
                   (f"{path}.lora_B.weight", (linear.out_features, rank))]
    return layout, targets


def random_adapter(layout, device: torch.device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=g, device=device) * 0.02 for _, shape in layout]


def small_request() -> rollout.RolloutRequest:
    return rollout.RolloutRequest(prompts=['A sign that reads "OPEN"'], seeds=[7], num_inference_steps=2, height=256,
                                  width=256, cfg_scale=1.0)


def sync_disk(client, layout, tensors, lora_config, root: str, version: int) -> list[int]:
    """`training.sync_rollout_adapter`'s disk path on one rank: host copies, an atomic PEFT folder, the workers
    read it."""
    state = {key: t.to("cpu", torch.float32).clone() for (key, _), t in zip(layout, tensors)}
    path = os.path.join(root, f"v{version:08d}")
    save_adapter_dir(state, lora_config, path)
    counts = client.load_adapter(path, f"v{version}")
    for old in sorted(d for d in os.listdir(root) if d.startswith("v"))[:-2]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return counts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (smoke test)")
    p.add_argument("--model_path", default=None, help="an existing Qwen-Image pipeline folder (default: build one)")
    p.add_argument("--qwen-layers", dest="qwen_layers", type=int, default=60, help="blocks of the built checkpoint")
    p.add_argument("--lora_rank", type=int, default=64)
    p.add_argument("--lora_alpha", type=float, default=None, help="default: the rank")
    p.add_argument("--repeats", type=int, default=5, help="timed syncs per path (after one warm-up each)")
    p.add_argument("--peer", action="store_true", help="also a worker on cuda:1 (a reserved rollout GPU)")
    p.add_argument("--workdir", default=None, help="where the checkpoint and adapter folders go (default: temp)")
    p.add_argument("--json", default=None, help="also write the numbers to this file")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny widths, rank 4, 2 repeats, 64x64 check")
    args = p.parse_args(argv)
    if args.quick:
        args.lora_rank, args.repeats = min(args.lora_rank, 4), min(args.repeats, 2)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv=None, client: rollout.DistributedRollout | None = None) -> int:
    """`client`: an already started rollout client on --model_path to use (and leave running) instead of starting
    one (the tests reuse theirs)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but CUDA is not available; use --device cpu --quick for a smoke test")
    if args.peer and (device.type != "cuda" or torch.cuda.device_count() < 2):
        sys.exit("--peer needs a second GPU")
    device = torch.device("cuda:0") if device.type == "cuda" else device
    started = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_sync-")
    os.makedirs(workdir, exist_ok=True)
    own_client = client is None
    try:
        model_path = args.model_path
        build_s = 0.0
        if model_path is None:
            import bench_rollout

            t0 = time.perf_counter()
            model_path = bench_rollout.build_checkpoint(
                "qwen_image", workdir, argparse.Namespace(quick=args.quick, qwen_layers=args.qwen_layers), device,
                torch.bfloat16 if device.type == "cuda" else torch.float32)
            build_s = time.perf_counter() - t0
            if device.type == "cuda":
                torch.cuda.empty_cache()
        layout, targets = lora_layout(model_path, args.lora_rank)
        from peft import LoraConfig

        alpha = float(args.lora_rank if args.lora_alpha is None else args.lora_alpha)
        lora_config = LoraConfig(r=args.lora_rank, lora_alpha=alpha, target_modules=targets)
        config = adapter_config_dict(lora_config)
        n_modules, numel = len(layout) // 2, rollout.layout_numel(rollout.adapter_layout(layout))
        adapters = [random_adapter(layout, device, seed) for seed in (1, 2)]
        workers = ["cuda:0"] + (["cuda:1"] if args.peer else []) if device.type == "cuda" else ["cpu"]
        if not own_client:
            workers = [worker.devices for worker in client.group.workers]
        print(f"bench_sync: {model_path} on {workers}, LoRA r{args.lora_rank} over {n_modules} modules = "
              f"{numel / 1e6:.1f}M parameters ({numel * 4 / 1e9:.2f} GB fp32), {args.repeats} repeats; "
              f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda"
                                              else ""), flush=True)
        t0 = time.perf_counter()
        if own_client:
            client = rollout.DistributedRollout(model_path, workers, trainer_device=device.type, sync="tensors",
                                                dtype="bfloat16" if device.type == "cuda" else "float32",
                                                max_batch_size=1, log_dir=os.path.join(workdir, "logs"))
        load_s = time.perf_counter() - t0
        root = os.path.join(workdir, "rollout_adapters")
        os.makedirs(root, exist_ok=True)
        request = small_request()
        if args.quick:
            request.height = request.width = 64

        times: dict[str, list[float]] = {"disk": [], "tensors": []}
        counts_ok, version = True, 0
        for repeat in range(args.repeats + 1):  # repeat 0 is the warm-up
            for name in ("disk", "tensors"):
                version += 1
                tensors = adapters[version % 2]
                t0 = time.perf_counter()
                if name == "disk":
                    counts = sync_disk(client, layout, tensors, lora_config, root, version)
                else:
                    counts = publish_tensors(client, layout, tensors, config, f"v{version}")
                elapsed = time.perf_counter() - t0
                counts_ok &= counts == [n_modules] * len(workers)
                if repeat:
                    times[name].append(elapsed)

        # agreement: the same adapter through either path, then the same small rollout
        sync_disk(client, layout, adapters[0], lora_config, root, version + 1)
        via_disk = client.generate(request)
        floor = client.generate(request)
        publish_tensors(client, layout, adapters[0], config, f"v{version + 2}")
        via_tensors = client.generate(request)
        kernels_repeat = torch.equal(via_disk.latents_clean, floor.latents_clean)
        identical = torch.equal(via_disk.latents_clean, via_tensors.latents_clean)
        max_diff = (via_disk.latents_clean - via_tensors.latents_clean).abs().max().item()
    finally:
        if own_client and client is not None:
            client.close()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    row: dict[str, Any] = {"workers": workers, "lora_rank": args.lora_rank, "modules": n_modules, "params": numel,
                           "bytes_fp32": numel * 4, "build_s": build_s, "worker_start_s": load_s,
                           "bound_counts_ok": bool(counts_ok), "identical_rollout": bool(identical),
                           "max_abs_latent_diff": max_diff, "kernels_repeat_identical": bool(kernels_repeat)}
    print(f"\n{'path':<9} {'median s':>9} {'min s':>8} {'GB/s':>7}")
    for name in ("disk", "tensors"):
        median, best = statistics.median(times[name]), min(times[name])
        row[name] = {"median_s": median, "min_s": best, "times_s": times[name]}
        print(f"{name:<9} {median:9.3f} {best:8.3f} {numel * 4 / 1e9 / median:7.2f}")
    row["ratio"] = row["disk"]["median_s"] / row["tensors"]["median_s"]
    print(f"\nratio = disk median / tensors median = {row['ratio']:.2f}x (target: tensors <= 0.3 s per sync on one "
          f"node); bound-module counts {'ok' if counts_ok else 'WRONG'}; rollout after either path "
          f"{'bit-identical' if identical else f'differs (max |d| {max_diff:.3g})'} (a repeated rollout: "
          f"{'identical' if kernels_repeat else 'differs: kernels are not deterministic here'}); total wall time "
          f"{time.perf_counter() - started:.0f}s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, **row}, f, indent=2)
    ok = counts_ok and (identical or not kernels_repeat)
    if not ok:
        print("SYNC CHECK FAILED: " + ("wrong bound-module counts" if not counts_ok else
                                       "the tensor path changed the rollout"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
