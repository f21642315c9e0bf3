#!/usr/bin/env python3
"""Benchmark whole RL steps at the released model sizes: the real `train_nft.py` / `train_dppo.py` (torchrun
subprocesses) on random-weight checkpoints in the released layouts, each recipe's settings scaled to the GPUs
present, the baseline configuration (today's path) and the optimised one measured in ONE invocation.

    python tools/bench_step.py --recipe qwen_dppo                    # one recipe, baseline and optimized
    python tools/bench_step.py --recipe boogu_nft --configs baseline,optimized,optimized_train_cfg
    python tools/bench_step.py --smoke --out /tmp/bench_step.json    # CPU smoke run on the tiny Qwen-Image
    python tools/bench_step.py --recipe qwen_nft --configs optimized --baseline_json none --profile --out a.json
    python tools/bench_step.py --recipe qwen_nft --configs optimized --baseline_json a.json \
        --baseline_config optimized --optimized_flags="--attention_backend cudnn"     # a change against today's path

Recipes (the shipped scripts' settings; per GPU as the recipes have them per GPU, the prompt count scaled so that
every trainer rank gets its recipe micro-batch; JSON-only JPEG compressibility reward as the cost-free stand-in for
the judge; 512², 10 rollout steps, LoRA 64/128, activation checkpointing of every block):
  qwen_dppo  Qwen-Image, Flow-DPPO (verl-omni's recipe: true CFG 4, noise 1.2, window 2 in [0,5]); 16 images and
             micro 16 per trainer GPU;
  qwen_nft   Qwen-Image, DiffusionNFT (verl-omni's recipe: no CFG, mix_beta 0.1, ref_kl_coef 1e-4); 16 images
             per trainer GPU, micro 16 (verl-omni's is 8: one micro-batch of 16 halves the host's work per image,
             0.30 -> 0.35 images/GPU/s on one H200 with 26% of its memory free; docs/lab/PERFORMANCE_LOG.md);
  boogu_nft  Boogu-Image-0.1-Base, DiffusionNFT (the seed recipe: guidance 4, mix_beta 0.1, ref_kl_coef 10,
             adv_clip_max 1); 12 images, micro 12 per trainer GPU.
Configurations (the flags that differ; everything else is the recipe's):
  baseline             today's path: fp32 frozen base (`--base_weights_dtype fp32`), training forwards with the
                       rollout's CFG, old log-probs recomputed in a pass of their own and a separate NFT old
                       forward (`--old_from_update off`), adapter sync through disk, reserved layout (one GPU:
                       the rollout worker shares cuda:0; several: the last GPU rollout-only);
  optimized            bf16 frozen base, CFG-free NFT training forwards (`--train_cfg off`), the recipes' own DPPO
                       setting (`--old_log_probs recompute`: they keep it for the trust region),
                       `--rollout_devices colocated` when the trainer supports it, `--compile blocks` (measured
                       on one H200: 1.33-1.35x for Qwen-Image, 1.37x for Boogu-Image), plus --optimized_flags (e.g.
                       the flags of a change under test: `--attention_backend cudnn`, `--compile off`);
  optimized_bypass     optimized with DPPO's bypass (`--old_log_probs rollout`: no old-log-prob pass; DPPO only);
  optimized_train_cfg  optimized but with the rollout's CFG in the NFT training forwards (`--train_cfg rollout`; NFT
                       only);
  optimized_ckpt_half  optimized with selective checkpointing of half the blocks.
The ratio of every configuration is taken against `baseline` of the same recipe: measured in the same invocation,
or, with --baseline_json PATH, the `baseline` runs of an earlier invocation's JSON (any bench_step JSON holding
them, e.g. `--configs baseline --out base.json`; --baseline_config optimized takes that JSON's `optimized` runs
instead, to measure a change against today's optimized path), refused when its machine (GPU names and count, torch,
CUDA, Python) or its measurement flags (sizes, batch, warm-up, and --baseline_flags when the baseline is `baseline`)
differ from this invocation's; with --baseline_mismatch_ok it is used anyway and the output says loudly what
differs. --baseline_json none measures no baseline (no ratios; e.g. a first profile). The output says where the
baseline came from.

--profile: each run records a torch.profiler trace (CPU + CUDA activities, no shapes / stacks / memory) of its last
step (`--profile_step`): every trainer rank from the step's start to the end of its first --profile_micro_steps
update micro-steps (`training.ProfileWindow`: a bounded window, so that the trace of a 20-micro-step Qwen-Image
update takes seconds to write and read, not minutes), every rollout worker its generate call of that step. The bench
prints a table per trace: per phase (the trainers' timing_s/* phases, the window's `update_window`, the rollout
worker's `gen`, and the recorded step) wall / device-busy / device-idle ms, the longest idle gap, the device events,
memory copies, host reads (`.item()`) and syncs, the top kernels by device time and which host code issued the
copies (`training.profile_table`); the tables go into the JSON (run["profile"]) and the gzipped traces to
--profile_dir. The profiled step is left out of the timing means when another measured step remains (--profile's
default --steps 3 with one warm-up step: step 2 is timed, 3 profiled).

What is reported per run (JSON at --out, rewritten after every run, so a killed call still returns the finished
runs; also printed): images / GPU / s = images per step / (mean step time x every GPU the layout uses: trainer
ranks, rollout GPUs, --judge_gpus), the per-phase times (timing_s/* from the trainer's TensorBoard), perf/mfu/*
and perf/tflop/*, the trainer ranks' peak torch memory (perf/max_memory_*), every GPU process's peak memory
(nvidia-smi polled once a second; per GPU when the container hides process ids), the exit status and the tail of
a failed run's log (an OOM is a result, not a crash of the benchmark). Step 1 is a warm-up and excluded.

Time on one H200 (measured; docs/PERFORMANCE.md has each recipe's runtimes): the checkpoint build takes 40-66 s per
family (in a subprocess, written once and shared by the recipe's runs), trainer and rollout worker start in about
1.3 min, the compiled first step adds ~2-3 min (Qwen-Image) or ~4 min (Boogu-Image), then a step takes 20-45 s. At
60 blocks the `qwen_dppo` baseline (fp32 base) does not fit on one H200, so it is recorded as failed and the ratio is n/a; use
--qwen_layers 40 for a ratio that fits. A baseline measured once (`--configs baseline` or any earlier JSON) and
passed as --baseline_json saves its runs in every later call.
--deadline_s stops starting runs that cannot finish in time (estimated from the runs before) and kills a run that
overruns it (recorded as timeout, with the step times its progress lines printed). --smoke starts its runs at once
(on CPU their times mean nothing; it checks the plumbing, the JSON and the numerics of the configurations).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import gzip
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "tools")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

SCHEMA_VERSION = 1
FAMILY_OF = {"qwen_dppo": "qwen_image", "qwen_nft": "qwen_image", "boogu_nft": "boogu_image"}
TRAINER_OF = {"qwen_dppo": "train_dppo.py", "qwen_nft": "train_nft.py", "boogu_nft": "train_nft.py"}
# recipes whose optimized runs compile the transformer blocks (measured on one H200, docs/lab/PERFORMANCE_LOG.md)
COMPILED_RECIPES = ("qwen_dppo", "qwen_nft", "boogu_nft")
CONFIGS = ("baseline", "optimized", "optimized_bypass", "optimized_train_cfg", "optimized_ckpt_half")
ONLY_FOR = {"optimized_train_cfg": "train_nft.py", "optimized_bypass": "train_dppo.py"}  # trainer-specific configs
# what a baseline of an earlier invocation must share with this one (`baseline_problems`)
MACHINE_KEYS = ("gpu_names", "gpus", "torch", "cuda", "python")
MEASUREMENT_ARGS = ("smoke", "per_gpu_images", "judge_gpus", "warmup_steps", "train_rows", "qwen_layers",
                    "boogu_double_layers", "boogu_single_layers", "boogu_refiner_layers", "baseline_flags")
BLOCKS = {"qwen_image": lambda a: a.qwen_layers,
          "boogu_image": lambda a: a.boogu_double_layers + a.boogu_single_layers + 3 * a.boogu_refiner_layers}
# MEASUREMENT_ARGS added after JSONs were written: their value in those JSONs
LATER_ARG_DEFAULTS = {"train_rows": 0}
# metrics copied per step into the JSON (numerics of the runs, next to their timings)
METRIC_PREFIXES = ("timing_s/", "perf/", "actor/", "rollout_corr/", "critic/rewards/mean")


# ---------------------------------------------------------------------------------------------------------------
# Recipes and configurations -> trainer flags
# ---------------------------------------------------------------------------------------------------------------


def recipe_flags(recipe: str, per_gpu_images: int, trainer_ranks: int, smoke: bool) -> tuple[list[str], int]:
    """(trainer flags of the recipe's algorithm and batch, images per step) for `trainer_ranks` ranks."""
    if recipe == "qwen_dppo":
        n, micro = (2, 4) if smoke else (16, 16)
        flags = ["--true_cfg_scale", "4.0", "--loss", "flow_dppo", "--kl_mask_threshold", "1e-5", "--noise_level",
                 "1.2", "--sde_type", "sde", "--sde_window_size", "2", "--sde_window_range", "0,5" if not smoke
                 else "0,3", "--lr", "3e-4", "--weight_decay", "1e-4"]
    elif recipe == "qwen_nft":
        n, micro = (2, 4) if smoke else (16, 16)
        flags = ["--true_cfg_scale", "1.0", "--mix_beta", "0.1", "--ref_kl_coef", "1e-4", "--adv_clip_max", "5.0",
                 "--old_policy_decay_schedule", "delayed_linear_to_0_999", "--old_policy_update_interval", "2",
                 "--lr", "3e-4", "--weight_decay", "1e-4"]
    elif recipe == "boogu_nft":
        n, micro = (2, 4) if smoke else (12, 12)
        flags = ["--guidance_scale", "4.0", "--mix_beta", "0.1", "--ref_kl_coef", "10.0", "--adv_clip_max", "1.0",
                 "--old_policy_decay_schedule", "delayed_linear_to_0_999", "--old_policy_update_interval", "2",
                 "--lr", "1e-4", "--weight_decay", "1e-4"]
    else:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {sorted(FAMILY_OF)}")
    images_per_rank = per_gpu_images or (n * 2 if smoke else n)
    if images_per_rank % n or images_per_rank % micro:
        raise ValueError(f"{recipe}: --per_gpu_images {images_per_rank} must be a multiple of the group size {n} "
                         f"and of the micro-batch {micro}")
    prompts = images_per_rank // n * trainer_ranks
    flags += ["--train_batch_size", str(prompts), "--rollout_n", str(n), "--micro_batch_size", str(micro),
              "--rollout_max_batch_size", str(images_per_rank)]
    return flags, prompts * n


def config_flags(config: str, recipe: str, blocks: int, args) -> list[str]:
    """The flags that make `config` (see the module docstring); the layout is chosen in `layout_of`."""
    nft = TRAINER_OF[recipe] == "train_nft.py"
    if config == "baseline":
        flags = ["--base_weights_dtype", "fp32"] + (["--train_cfg", "rollout"] if nft else
                                                    ["--old_log_probs", "recompute"])
        if trainer_supports("--old_from_update"):  # a separate old forward / old log-prob pass for every sample
            flags += ["--old_from_update", "off"]
        return flags + shlex.split(args.baseline_flags)
    flags = ["--base_weights_dtype", "compute"]
    if nft:
        flags += ["--train_cfg", "rollout" if config == "optimized_train_cfg" else "off"]
    else:
        flags += ["--old_log_probs", "rollout" if config == "optimized_bypass" else "recompute"]
    if config == "optimized_ckpt_half":
        flags += ["--activation_checkpointing_blocks", str(blocks // 2)]
    if recipe in COMPILED_RECIPES and not args.smoke:
        flags += ["--compile", "blocks"]
    return flags + shlex.split(args.optimized_flags)


def trainer_supports(flag_text: str) -> bool:
    """Whether the trainers' flags or the rollout module mention `flag_text` (e.g. the colocated rollout layout),
    read from the source so that no process is started for it (`training/step.py` in checkouts from before the
    split of training/)."""
    for name in (os.path.join("training", "flags.py"), os.path.join("training", "step.py"), "rollout.py"):
        if not os.path.isfile(os.path.join(REPO, name)):
            continue
        with open(os.path.join(REPO, name), encoding="utf-8") as f:
            if flag_text in f.read():
                return True
    return False


def layout_of(config: str, gpus: int, smoke: bool) -> dict[str, Any]:
    """Trainer ranks, --rollout_devices and the GPUs the layout occupies."""
    if smoke:
        return {"trainer_ranks": 1, "rollout_devices": "cpu", "gpus_used": 1, "name": "cpu"}
    if config != "baseline" and trainer_supports("colocated"):
        return {"trainer_ranks": gpus, "rollout_devices": "colocated", "gpus_used": gpus, "name": "colocated"}
    if gpus == 1:  # one GPU: the rollout worker shares the trainer's GPU
        return {"trainer_ranks": 1, "rollout_devices": "cuda:0", "gpus_used": 1, "name": "shared cuda:0"}
    return {"trainer_ranks": gpus - 1, "rollout_devices": f"cuda:{gpus - 1}", "gpus_used": gpus,
            "name": f"reserved (rollout on cuda:{gpus - 1})"}


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints and data
# ---------------------------------------------------------------------------------------------------------------


def build_in_subprocess(family: str, workdir: str, args) -> tuple[str, float]:
    """Build the released-size random checkpoint (`bench_rollout.build_checkpoint`: all blocks here) in a child
    process, so this process never holds GPU memory. Returns (path, seconds)."""
    start = time.perf_counter()
    code = ("import sys, types, torch; sys.path[:0] = [%r, %r]; import bench_rollout; "
            "a = types.SimpleNamespace(quick=False, qwen_layers=%d, boogu_double_layers=%d, boogu_single_layers=%d, "
            "boogu_refiner_layers=%d); print(bench_rollout.build_checkpoint(%r, %r, a, torch.device('cuda'), "
            "torch.bfloat16))") % (REPO, os.path.join(REPO, "tools"), args.qwen_layers, args.boogu_double_layers,
                                   args.boogu_single_layers, args.boogu_refiner_layers, family, workdir)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the {family} checkpoint failed:\n{proc.stderr[-4000:]}")
    return proc.stdout.strip().splitlines()[-1], time.perf_counter() - start


def tiny_checkpoint(family: str) -> str:
    """The tiny checkpoint of the smoke mode ($TINY_MODELS_DIR, built there when missing)."""
    import build_tiny_models

    root = os.environ.get("TINY_MODELS_DIR") or os.path.join(REPO, ".cache", "tiny_models")
    os.makedirs(root, exist_ok=True)
    name = "qwen_image" if family == "qwen_image" else "boogu_image_base"
    build_tiny_models.build_one(name, root, force=False)
    return os.path.join(root, name)


def demo_data(family: str, workdir: str, train_rows: int = 0) -> str:
    """The demo prompts' train split for `family` (written once per workdir); with `train_rows` > 0 a copy of its
    first `train_rows` rows (`--train_rows`)."""
    from pathlib import Path

    import pandas as pd

    from data_prep.make_demo_data import make_demo_data

    out = Path(workdir) / f"data_{family}"
    if not (out / "train.parquet").is_file():
        make_demo_data(out, model=family)
    if not train_rows:
        return str(out / "train.parquet")
    subset = out / f"train_{train_rows}_rows.parquet"
    pd.read_parquet(out / "train.parquet").head(train_rows).to_parquet(subset)
    return str(subset)


# ---------------------------------------------------------------------------------------------------------------
# Measuring one run
# ---------------------------------------------------------------------------------------------------------------


class GpuMemoryPoller:
    """Peak GPU memory per process (pid -> MiB, with its command line) and per GPU, from nvidia-smi once a second.
    Containers often hide process ids from nvidia-smi; the per-GPU numbers are then all there is."""

    def __init__(self) -> None:
        self.by_pid: dict[int, dict[str, Any]] = {}
        self.by_gpu: dict[int, float] = {}
        self.available = shutil.which("nvidia-smi") is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _query(self, what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for pid, used in self._query("compute-apps=pid,used_memory"):
                    entry = self.by_pid.setdefault(int(pid), {"peak_mib": 0.0, "cmd": _cmdline(int(pid))})
                    entry["peak_mib"] = max(entry["peak_mib"], float(used))
                for index, used in self._query("gpu=index,memory.used"):
                    self.by_gpu[int(index)] = max(self.by_gpu.get(int(index), 0.0), float(used))
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            self._stop.wait(1.0)

    def __enter__(self) -> "GpuMemoryPoller":
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(timeout=15)

    def report(self) -> dict[str, Any]:
        return {"per_process_gib": {str(pid): {"peak_gib": v["peak_mib"] / 1024, "cmd": v["cmd"]}
                                    for pid, v in sorted(self.by_pid.items())},
                "per_gpu_gib": {str(i): mib / 1024 for i, mib in sorted(self.by_gpu.items())},
                "source": "nvidia-smi" if self.available else "unavailable"}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"


def read_scalars(run_dir: str) -> dict[str, dict[int, float]]:
    """Every TensorBoard scalar of a finished run: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = os.path.join(run_dir, "tensorboard")
    if not os.path.isdir(path):
        return {}
    events = EventAccumulator(path, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def progress_step_times(stdout: str) -> dict[int, float]:
    """Step times from the trainer's progress lines ("step 2/3 | 21.40s/step | ..."): what survives a kill."""
    times = {}
    for line in stdout.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 2 and parts[0].startswith("step ") and parts[1].endswith("s/step"):
            try:
                times[int(parts[0].split()[1].split("/")[0])] = float(parts[1][:-len("s/step")])
            except ValueError:
                continue
    return times


def summarize(run: dict[str, Any], scalars: dict[str, dict[int, float]], step_times: dict[int, float],
              images_per_step: int, warmup: int, profiled: tuple[int, ...] = ()) -> None:
    """Fill the per-step table and the means over the measured steps (all but the first `warmup`, and but the
    `profiled` ones when another remains: `run["timing_includes_profiler"]` says which) into `run`."""
    times = {s: v for s, v in scalars.get("perf/time_per_step", {}).items()} or step_times
    steps = sorted(times)
    run["steps"] = [{"step": s, "time_s": times[s],
                     "metrics": {k: v[s] for k, v in sorted(scalars.items())
                                 if s in v and k.startswith(METRIC_PREFIXES)}} for s in steps]
    measured = [s for s in steps if s > warmup] or steps[-1:]
    if profiled:
        clean = [s for s in measured if s not in profiled]
        measured = clean or measured
        run["timing_includes_profiler"] = not clean
    run["measured_steps"] = measured
    if not measured:
        return
    step_time = statistics.mean(times[s] for s in measured)
    run["step_time_s"] = step_time
    run["images_per_step"] = images_per_step
    run["images_per_gpu_s"] = images_per_step / (step_time * run["gpus_counted"])
    mean = lambda key: statistics.mean(scalars[key][s] for s in measured if s in scalars[key])  # noqa: E731
    run["phase_s"] = {k[len("timing_s/"):]: mean(k) for k in sorted(scalars) if k.startswith("timing_s/")
                      and any(s in scalars[k] for s in measured)}
    run["mfu"] = {k[len("perf/mfu/"):]: mean(k) for k in sorted(scalars) if k.startswith("perf/mfu/")
                  and any(s in scalars[k] for s in measured)}
    run["trainer_memory_gib"] = {k[len("perf/"):]: max(scalars[k].values()) for k in sorted(scalars)
                                 if k.startswith("perf/max_memory_")}


def trainer_argv(recipe: str, config: str, model_path: str, train_files: str, run_dir: str,
                 args) -> tuple[list[str], dict[str, Any], int]:
    """(the trainer's flags, the layout, images per step) of one run."""
    family = FAMILY_OF[recipe]
    layout = layout_of(config, args.gpus, args.smoke)
    flags, images = recipe_flags(recipe, args.per_gpu_images, layout["trainer_ranks"], args.smoke)
    blocks = BLOCKS[family](args) if not args.smoke else 4
    size = ["--height", "64", "--width", "64", "--num_inference_steps", "4", "--lora_rank", "4", "--lora_alpha", "8",
            "--device", "cpu", "--rollout_threads", "1"] if args.smoke else \
        ["--height", "512", "--width", "512", "--num_inference_steps", "10", "--lora_rank", "64", "--lora_alpha",
         "128", "--device", "cuda", "--precision", "bf16", "--rollout_dtype", "bfloat16", "--max_sequence_length",
         "256", "--activation_checkpointing"]
    common = ["--model_path", model_path, "--train_files", train_files, "--rollout_devices", layout["rollout_devices"],
              "--total_training_steps", str(args.steps), "--save_freq", "1000000", "--resume", "never",
              "--output_dir", run_dir, "--seed", "42"] + size + (["--profile_step", str(args.steps), "--profile_micro_steps",
                                                                  str(args.profile_micro_steps)] if args.profile
                                                                 else [])
    # later flags win in argparse: the configuration's override the recipe's
    return common + flags + config_flags(config, recipe, blocks, args), layout, images


def run_config(recipe: str, config: str, model_path: str, train_files: str, out_dir: str, args,
               deadline: float) -> dict[str, Any]:
    run_dir = os.path.join(out_dir, f"{recipe}-{config}")
    shutil.rmtree(run_dir, ignore_errors=True)
    argv, layout, images = trainer_argv(recipe, config, model_path, train_files, run_dir, args)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(layout["trainer_ranks"]),
               "--master_port", str(_free_port()), os.path.join(REPO, TRAINER_OF[recipe]), *argv]
    run: dict[str, Any] = {"recipe": recipe, "config": config, "trainer": TRAINER_OF[recipe], "layout": layout,
                           "gpus_counted": layout["gpus_used"] + args.judge_gpus, "command": shlex.join(command),
                           "status": "running"}
    inherited = [p for p in [os.environ.get("PYTHONPATH")] if p]  # e.g. wheels installed with pip --target
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, *inherited]),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    run["started_at"] = _now()
    start = time.perf_counter()
    with GpuMemoryPoller() if not args.smoke else _Null() as poller:
        # its own session, so that on a time-out the whole tree (torchrun, its ranks, their rollout workers) is
        # stopped by this one process-group id
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=max(deadline - time.time(), 1.0))
            code = proc.returncode
            run["status"] = "ok" if code == 0 else ("oom" if "out of memory" in stderr.lower() else "failed")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            code, run["status"] = None, "timeout"
    run["finished_at"] = _now()
    run["wall_s"] = time.perf_counter() - start
    run["returncode"] = code
    if poller is not None and not args.smoke:
        run["process_memory"] = poller.report()
    if run["status"] != "ok":
        run["error_tail"] = (stdout[-1500:] + "\n" + stderr[-4000:]).strip()
    try:  # a failed or killed run may still have flushed some steps
        scalars = read_scalars(run_dir)
    except Exception:  # noqa: BLE001 (a truncated event file)
        scalars = {}
    profiled = (args.steps,) if args.profile else ()
    summarize(run, scalars, progress_step_times(stdout), images, args.warmup_steps, profiled)
    if args.profile:
        run["profile"] = collect_profiles(run_dir, f"{recipe}-{config}", args.profile_dir, args.smoke)
    return run


def collect_profiles(run_dir: str, label: str, profile_dir: str, smoke: bool,
                     max_bytes: int = 15 * 2**20) -> dict[str, Any]:
    """The traces a --profile_step run wrote (trainer ranks under profile/, rollout workers under rollout_logs/):
    each one's table (`training.profile_table`, CPU ops as the "device" in --smoke), printed and returned, and the
    gzipped trace kept in `profile_dir` as <label>-<name>.json.gz (the run folder is deleted afterwards); a trace
    larger than `max_bytes` is kept without its CPU ops (kernels, CUDA runtime calls and annotations remain), so
    that it fits what a device call returns. The traces are read in parallel processes (reading the JSON is most
    of the time)."""
    from concurrent.futures import ProcessPoolExecutor

    found = sorted(glob.glob(os.path.join(run_dir, "profile", "*.json.gz"))
                   + glob.glob(os.path.join(run_dir, "rollout_logs", "**", "profile-*.json.gz"), recursive=True))
    out: dict[str, Any] = {"traces": {}, "tables": {}}
    if not found:
        out["error"] = "no trace written (the run ended before its profiled step?)"
        return out
    os.makedirs(profile_dir, exist_ok=True)
    names = [os.path.basename(path)[:-len(".json.gz")] for path in found]
    jobs = [(path, os.path.join(profile_dir, f"{label}-{name}.json.gz"), max_bytes, smoke)
            for path, name in zip(found, names)]
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        results = list(pool.map(_read_profile, *zip(*jobs)))
    for name, (trace, table, text) in zip(names, results):
        out["traces"][name] = trace
        out["tables"][name] = table
        if text:
            print(f"\nprofile {label} / {name} ({trace['path']}, {trace['bytes'] / 2**20:.1f} MiB"
                  f"{', CPU ops dropped' if trace['cpu_ops_dropped'] else ''}):\n{text}", flush=True)
    return out


def _read_profile(path: str, kept: str, max_bytes: int, smoke: bool) -> tuple[dict[str, Any], dict[str, Any], str]:
    """One trace of `collect_profiles`: (its kept copy's record, its table as a dict or {"error": ...}, the table
    as text or "")."""
    from engines.profiler import load_trace
    from training.profiling import format_profile_table, profile_table

    events = load_trace(path)
    slim = os.path.getsize(path) > max_bytes
    if slim:
        with gzip.open(kept, "wt", encoding="utf-8", compresslevel=6) as f:
            json.dump({"traceEvents": [e for e in events if e.get("cat") != "cpu_op"]}, f)
    else:
        shutil.copyfile(path, kept)
    trace = {"path": kept, "bytes": os.path.getsize(kept), "original_bytes": os.path.getsize(path),
             "cpu_ops_dropped": slim}
    try:
        table = profile_table(events, device="cpu" if smoke else "cuda")
    except ValueError as e:  # e.g. a trace without device events: say so, keep the others
        return trace, {"error": str(e)}, ""
    return trace, dataclasses.asdict(table), format_profile_table(table)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


class BaselineError(ValueError):
    """A --baseline_json that cannot serve: unreadable, not a bench_step JSON, or without an ok baseline run."""


def load_baseline(path: str, recipes: list[str], config: str = "baseline") -> tuple[dict[str, Any],
                                                                                  dict[str, dict[str, Any]]]:
    """(the earlier invocation's JSON, recipe -> its `config` run) from `path`; BaselineError when it is
    unreadable, not a bench_step JSON of this schema, or lacks an ok, measured `config` run of a recipe."""
    try:
        with open(path, encoding="utf-8") as f:
            earlier = json.load(f)
    except (OSError, ValueError) as e:
        raise BaselineError(f"--baseline_json {path}: cannot be read as JSON ({e})") from None
    if not isinstance(earlier, dict) or earlier.get("bench") != "bench_step" \
            or earlier.get("schema_version") != SCHEMA_VERSION:
        raise BaselineError(f"--baseline_json {path}: not a bench_step JSON of schema {SCHEMA_VERSION}")
    if not isinstance(earlier.get("machine"), dict) or not isinstance(earlier.get("args"), dict):
        raise BaselineError(f"--baseline_json {path}: no machine / args record")
    runs = {}
    for recipe in recipes:
        run = earlier.get("recipes", {}).get(recipe, {}).get("runs", {}).get(config)
        if not isinstance(run, dict) or run.get("status") != "ok" \
                or not isinstance(run.get("images_per_gpu_s"), (int, float)) \
                or not isinstance(run.get("step_time_s"), (int, float)):
            status = run.get("status") if isinstance(run, dict) else "absent"
            raise BaselineError(f"--baseline_json {path}: recipe {recipe} has no measured {config} run ({status}); "
                                f"measure one with --recipe {recipe} --configs {config}")
        runs[recipe] = run
    return earlier, runs


def baseline_problems(earlier: dict[str, Any], machine: dict[str, Any], args: dict[str, Any],
                      config: str = "baseline") -> list[str]:
    """What differs between the invocation that measured a baseline (`earlier`, its JSON; its `config` runs serve)
    and this one: the machine (`MACHINE_KEYS`) and the flags that change what a run measures (`MEASUREMENT_ARGS`;
    --baseline_flags only when the `baseline` runs serve); [] = comparable."""
    out = [f"machine {key}: baseline {earlier['machine'].get(key)!r}, now {machine.get(key)!r}"
           for key in MACHINE_KEYS if earlier["machine"].get(key) != machine.get(key)]
    keys = [k for k in MEASUREMENT_ARGS if k != "baseline_flags" or config == "baseline"]
    before = {k: earlier["args"].get(k, LATER_ARG_DEFAULTS.get(k)) for k in keys}  # JSONs from before a flag existed
    out += [f"--{key}: baseline {before[key]!r}, now {args.get(key)!r}" for key in keys if before[key] != args.get(key)]
    return out


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every configuration against `baseline` of the same recipe: images/GPU/s ratio (> 1 = faster) and the step
    time ratio (baseline / this), or n/a with the reason."""
    out = {}
    base = runs.get("baseline", {})
    for config, run in runs.items():
        if config == "baseline":
            continue
        if "images_per_gpu_s" not in base or "images_per_gpu_s" not in run:
            why = f"baseline {base.get('status', 'not run')}, {config} {run.get('status')}"
            out[config] = {"vs": "baseline", "images_per_gpu_s_ratio": None, "step_time_ratio": None, "why": why}
            continue
        out[config] = {"vs": "baseline", "images_per_gpu_s_ratio": run["images_per_gpu_s"] / base["images_per_gpu_s"],
                       "step_time_ratio": base["step_time_s"] / run["step_time_s"]}
    return out


def write_json(result: dict[str, Any], path: str) -> None:
    result["finished_at"] = _now()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, sort_keys=True, default=str)
    os.replace(tmp, path)


def baseline_line(result: dict[str, Any]) -> str:
    """Where the baseline of `result` came from, with the differences when it was accepted despite them."""
    source = result.get("baseline_source")
    if not source:
        return "baseline: measured in this invocation"
    if source.get("path") is None:
        return "baseline: none (--baseline_json none): no ratios"
    line = (f"baseline: the {source['config']} runs of {source['path']} (measured {source['started_at']}, commit "
            f"{source['git_commit']}, host {source['host']}, flags {source['flags']!r}), not re-measured")
    if source["mismatches"]:
        line += ("\n!!! WARNING: THE BASELINE WAS MEASURED UNDER DIFFERENT CONDITIONS; ITS RATIOS ARE NOT A "
                 "COMPARISON:\n!!!   " + "\n!!!   ".join(source["mismatches"]))
    return line


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'recipe':<10} {'config':<20} {'status':<8} {'img/GPU/s':>9} {'ratio':>6} {'s/step':>7} {'gen':>6} "
          f"{'old_lp':>6} {'update':>7} {'sync':>5} {'mfu gen/old/upd':>17} {'mem GiB':>8}")
    for recipe, entry in result["recipes"].items():
        for config, run in entry["runs"].items():
            phase, mfu = run.get("phase_s", {}), run.get("mfu", {})
            ratio = entry.get("ratios", {}).get(config, {}).get("images_per_gpu_s_ratio")
            fmt = lambda v, w, p=2: f"{v:{w}.{p}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
            mfus = "/".join(f"{mfu[k]:.2f}" if k in mfu else "-" for k in ("gen", "old_log_prob", "update_actor"))
            memory = run.get("trainer_memory_gib", {}).get("max_memory_allocated_gb")
            label = f"{config} (file)" if "source" in run else config
            print(f"{recipe:<10} {label:<20} {run['status']:<8} {fmt(run.get('images_per_gpu_s'), 9, 3)} "
                  f"{fmt(1.0 if config == 'baseline' and 'step_time_s' in run else ratio, 6)} "
                  f"{fmt(run.get('step_time_s'), 7)} {fmt(phase.get('gen'), 6, 1)} "
                  f"{fmt(phase.get('old_log_prob'), 6, 1)} {fmt(phase.get('update_actor'), 7, 1)} "
                  f"{fmt(phase.get('update_weights'), 5, 1)} {mfus:>17} {fmt(memory, 8, 1)}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", action="append", choices=sorted(FAMILY_OF),
                   help="recipe to run (repeatable; default qwen_dppo, or qwen_dppo in --smoke)")
    p.add_argument("--configs", default="baseline,optimized", help=f"comma-separated, from {CONFIGS}")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per run (default 3 on GPU, 2 in --smoke)")
    p.add_argument("--warmup_steps", type=int, default=1, help="first steps excluded from the means")
    p.add_argument("--per_gpu_images", type=int, default=0, help="images per trainer GPU per step (0 = the recipe's)")
    p.add_argument("--train_rows", type=int, default=0,
                   help="train on only the first N prompts (0 = all 56): with N = the prompts per step, every step "
                        "has the sequence lengths of step 1, so no timed step pays cuDNN's attention plan build for "
                        "a new length (the steady state of a long run, whose prompt lengths have all been seen)")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    p.add_argument("--judge_gpus", type=int, default=0,
                   help="GPUs a real judge would occupy, added to the images/GPU/s denominator (JPEG reward here)")
    p.add_argument("--qwen_layers", type=int, default=60, help="Qwen-Image blocks (released: 60)")
    p.add_argument("--boogu_double_layers", type=int, default=8, help="Boogu double-stream blocks (released: 8)")
    p.add_argument("--boogu_single_layers", type=int, default=32, help="Boogu single-stream blocks (released: 32)")
    p.add_argument("--boogu_refiner_layers", type=int, default=2, help="Boogu refiner blocks each (released: 2)")
    p.add_argument("--baseline_flags", default="", help="extra trainer flags of the baseline runs")
    p.add_argument("--optimized_flags", default="", help="extra trainer flags of every optimized* run")
    p.add_argument("--deadline_s", type=float, default=570.0, help="wall-time budget of this invocation")
    p.add_argument("--workdir", default=None, help="checkpoints, data and run folders (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the workdir (checkpoints are large)")
    p.add_argument("--out", default="bench_step.json", help="the JSON report (rewritten after every run)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: tiny Qwen-Image (or Boogu) checkpoint, 64x64, 4 steps, 1 rank, 2 steps")
    p.add_argument("--baseline_json", default=None,
                   help="take the baseline runs from this earlier bench_step JSON instead of measuring them "
                        "('none': no baseline, no ratios)")
    p.add_argument("--baseline_config", default="baseline", choices=CONFIGS,
                   help="which configuration of --baseline_json serves as the baseline")
    p.add_argument("--baseline_mismatch_ok", action="store_true",
                   help="use --baseline_json even if its machine or measurement flags differ (printed loudly)")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler trace of every run's last step, and its per-phase table (see above)")
    p.add_argument("--profile_dir", default=None, help="where the traces go (default: <--out>.profiles/)")
    p.add_argument("--profile_micro_steps", type=int, default=2,
                   help="update micro-steps in each trainer's trace (0 = the whole profiled step)")
    args = p.parse_args(argv)
    args.recipe = args.recipe or ["qwen_dppo"]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = sorted(set(args.configs) - set(CONFIGS))
    if bad:
        p.error(f"unknown --configs {bad}; choose from {CONFIGS}")
    if args.baseline_json and "baseline" in args.configs:
        p.error("--baseline_json replaces the baseline run: drop baseline from --configs")
    if "baseline" not in args.configs and not args.baseline_json:
        p.error("--configs must include baseline (or take it from an earlier run with --baseline_json, or pass "
                "--baseline_json none): every ratio is against a baseline of the same machine")
    args.steps = args.steps or (2 if args.smoke else 3)
    args.profile_dir = args.profile_dir or f"{os.path.splitext(args.out)[0]}.profiles"
    if args.steps <= args.warmup_steps:
        p.error(f"--steps ({args.steps}) must exceed --warmup_steps ({args.warmup_steps}) to measure anything")
    if args.gpus is None:
        args.gpus = 0 if args.smoke else _visible_gpus()
    if not args.smoke and args.gpus < 1:
        p.error("no GPU visible: run on a GPU machine, or use --smoke on CPU")
    return args


def _visible_gpus() -> int:
    """GPU count without creating a CUDA context in this process (nvidia-smi, else torch)."""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = len([line for line in out.splitlines() if line.startswith("GPU ")])
        return len([v for v in visible.split(",") if v.strip()]) if visible else count
    import torch

    return torch.cuda.device_count()


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    deadline = started + args.deadline_s
    from training.logs import git_commit

    result: dict[str, Any] = {
        "bench": "bench_step", "schema_version": SCHEMA_VERSION, "started_at": _now(), "smoke": args.smoke,
        "args": vars(args), "git_commit": git_commit(REPO),
        "machine": machine_info(args.gpus),
        "peak_tflops_env": os.environ.get("FLOWRL_PEAK_TFLOPS"), "recipes": {}}
    baselines: dict[str, dict[str, Any]] = {}
    if args.baseline_json == "none":
        result["baseline_source"] = {"path": None}
    elif args.baseline_json:
        try:
            earlier, baselines = load_baseline(args.baseline_json, args.recipe, args.baseline_config)
        except BaselineError as e:
            print(f"bench_step: {e}", file=sys.stderr)
            return 2
        mismatches = baseline_problems(earlier, result["machine"], vars(args), args.baseline_config)
        flags = earlier["args"].get("baseline_flags" if args.baseline_config == "baseline" else "optimized_flags")
        result["baseline_source"] = {"path": os.path.abspath(args.baseline_json), "config": args.baseline_config,
                                     "flags": flags, "started_at": earlier.get("started_at"),
                                     "git_commit": earlier.get("git_commit"), "host": earlier["machine"].get("host"),
                                     "mismatches": mismatches}
        if mismatches and not args.baseline_mismatch_ok:
            print(f"bench_step: --baseline_json {args.baseline_json} was measured under different conditions "
                  f"(pass --baseline_mismatch_ok to compare anyway):\n  " + "\n  ".join(mismatches),
                  file=sys.stderr)
            return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_step-")
    os.makedirs(workdir, exist_ok=True)
    print(f"bench_step: recipes {args.recipe}, configs {args.configs}, {args.steps} steps per run (first "
          f"{args.warmup_steps} excluded), {'CPU smoke' if args.smoke else f'{args.gpus} GPU(s)'}, out {args.out}"
          f"\n{baseline_line(result)}", flush=True)
    status = 0
    try:
        families = sorted({FAMILY_OF[r] for r in args.recipe}, key=[FAMILY_OF[r] for r in args.recipe].index)
        for family in families:  # one checkpoint per family, deleted after its recipes (disk: 41 + 21 GB)
            if args.smoke:
                model_path, build_s = tiny_checkpoint(family), 0.0
            else:
                model_path, build_s = build_in_subprocess(family, workdir, args)
                print(f"  built {family} ({BLOCKS[family](args)} blocks) in {build_s:.0f}s")
            train_files = demo_data(family, workdir, args.train_rows)
            for recipe in [r for r in args.recipe if FAMILY_OF[r] == family]:
                entry = result["recipes"].setdefault(recipe, {"family": family, "build_s": build_s, "runs": {}})
                if recipe in baselines:
                    entry["runs"]["baseline"] = dict(baselines[recipe], source=result["baseline_source"]["path"],
                                                     source_config=args.baseline_config)
                configs = [c for c in args.configs if ONLY_FOR.get(c, TRAINER_OF[recipe]) == TRAINER_OF[recipe]]
                if args.smoke:  # CPU smoke: the runs at once (their times mean nothing here; halves the wall time)
                    from concurrent.futures import ThreadPoolExecutor

                    with ThreadPoolExecutor(max(1, len(configs))) as pool:
                        runs = list(pool.map(lambda c: run_config(recipe, c, model_path, train_files, workdir,
                                                                  args, deadline), configs))
                    entry["runs"].update(zip(configs, runs))
                    entry["ratios"] = ratios(entry["runs"])
                    status = max(status, int(any(r["status"] != "ok" for r in runs)))
                    continue
                last_wall = None
                for config in configs:
                    if last_wall is not None and time.time() + 0.8 * last_wall > deadline:
                        entry["runs"][config] = {"status": "skipped", "why": "not enough time left in --deadline_s"}
                        continue
                    run = run_config(recipe, config, model_path, train_files, workdir, args, deadline)
                    last_wall = run["wall_s"]
                    entry["runs"][config] = run
                    entry["ratios"] = ratios(entry["runs"])
                    write_json(result, args.out)
                    print(f"  {recipe}/{config}: {run['status']} in {run['wall_s']:.0f}s"
                          + (f", {run['images_per_gpu_s']:.3f} images/GPU/s" if "images_per_gpu_s" in run else ""))
                    if run["status"] not in ("ok", "oom", "timeout"):
                        status = 1
            if not args.smoke and not args.keep:
                shutil.rmtree(os.path.join(workdir, family), ignore_errors=True)
    finally:
        write_json(result, args.out)
        if args.workdir is None and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(result)
    print(f"\nratio = this configuration's images/GPU/s / the baseline's; {baseline_line(result)}\nJSON: {args.out}; "
          f"wall {time.time() - started:.0f}s")
    return status


def machine_info(gpus: int) -> dict[str, Any]:
    """What a baseline must share with a run compared against it (`MACHINE_KEYS`), plus the host name."""
    import platform

    import torch

    return {"host": socket.gethostname(), "gpus": gpus, "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "gpu_names": _gpu_names(), "python": platform.python_version()}


def _gpu_names() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main())
