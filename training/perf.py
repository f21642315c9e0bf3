"""Throughput and model FLOP utilisation (MFU) of a training step: images/s per GPU, each phase's model FLOPs
against the device's peak, and peak memory; `nft_perf_metrics` / `dppo_perf_metrics` are the one call each trainer
makes."""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .distributed import get_local_world_size, get_world_size

__all__ = ["perf_metrics", "PEAK_TFLOPS_ENV", "device_peak_flops", "rollout_device_count", "transformer_flops",
           "phase_perf_metrics", "nft_perf_metrics", "dppo_perf_metrics"]


def perf_metrics(num_images: int, step_time_s: float, num_gpus: int) -> dict[str, float]:
    """`perf/total_num_images`, `perf/time_per_step`, `perf/throughput` (images / (t_step * n_gpus))."""
    return {"perf/total_num_images": float(num_images), "perf/time_per_step": float(step_time_s),
            "perf/throughput": float(num_images) / (max(step_time_s, 1e-9) * max(num_gpus, 1))}


PEAK_TFLOPS_ENV = "FLOWRL_PEAK_TFLOPS"


# dense bf16 peaks (TFLOP/s) by device name; the H200 value is verl-omni's VERL_OMNI_DEVICE_FLOPS_TFLOPS=989
_PEAK_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("H20", 148.0), ("A100", 312.0),
                ("A800", 312.0), ("L40S", 362.0))


def device_peak_flops(device: torch.device | str) -> float | None:
    """The device's dense bf16 peak in FLOP/s: $FLOWRL_PEAK_TFLOPS (TFLOP/s) when set, else by CUDA device name
    (H200/H100/H800 989, A100/A800 312, ...); None when unknown (CPU, an unlisted GPU): MFU is then not logged."""
    env = os.environ.get(PEAK_TFLOPS_ENV)
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"${PEAK_TFLOPS_ENV}={env!r} is not a number (TFLOP/s, e.g. 989 for an H200)") from None
        if value <= 0:
            raise ValueError(f"${PEAK_TFLOPS_ENV} must be > 0, got {value}")
        return value * 1e12
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device).upper()
    return next((tflops * 1e12 for key, tflops in _PEAK_TFLOPS if key in name), None)


def rollout_device_count(rollout_devices: str) -> int:
    """Devices the rollout workers of the whole job run on: `--rollout_devices colocated` = the trainer GPUs
    (world size), else the per-node list times the number of nodes (WORLD_SIZE / LOCAL_WORLD_SIZE)."""
    world = get_world_size()
    if rollout_devices.strip() == "colocated":
        return world
    per_node = len([d for d in rollout_devices.split(",") if d.strip()])
    nodes = max(world // get_local_world_size(), 1)
    return per_node * nodes


def transformer_flops(model, cond, *, height: int, width: int, guided: bool) -> float:
    """Model FLOPs of one (guided) velocity call over every row of `cond` (`models.base.Conditioning`): the
    conditional forward plus, when `guided`, the unconditional one (its own text lengths), from the wrapper's
    `forward_flops` with (H/16)·(W/16) image tokens, the valid prompt tokens of each row and, for edit, each row's
    reference tokens ((h/2)·(w/2) of its reference latents)."""
    image_tokens = (height // 16) * (width // 16)
    refs = None
    if cond.ref_latents is not None:
        h, w = cond.ref_latents.shape[-2:]
        refs = [[(h // 2) * (w // 2)]] * cond.ref_latents.shape[0]
    flops = model.forward_flops(image_tokens, cond.prompt.mask.sum(dim=1).tolist(), refs)
    if guided:
        if cond.negative is None:
            raise ValueError("transformer_flops: guided=True but the conditioning has no negative prompt")
        flops += model.forward_flops(image_tokens, cond.negative.mask.sum(dim=1).tolist(), refs)
    return float(flops)


def phase_perf_metrics(timings: Mapping[str, float], phases: Mapping[str, tuple[float, int]],
                       device: torch.device | str) -> dict[str, float]:
    """`perf/mfu/<phase>` = FLOPs / (timing_s/<phase> · devices · peak) for each phase -> (FLOPs, devices) whose
    timing exists (FLOPs of the whole phase on those devices), `perf/tflop/<phase>` (the FLOPs, logged even without
    a known peak), and on CUDA `perf/max_memory_{allocated,reserved}_gb`: this process's peaks since start (the max
    over trainer ranks; per rank under `.../rank<r>` when there are several). Collective on CUDA (one
    all_gather_object of two floats per rank)."""
    peak = device_peak_flops(device)
    out: dict[str, float] = {}
    for phase, (flops, devices) in sorted(phases.items()):
        seconds = timings.get(f"timing_s/{phase}")
        if seconds is None:
            continue
        out[f"perf/tflop/{phase}"] = float(flops) / 1e12
        if peak is not None and seconds > 0:
            out[f"perf/mfu/{phase}"] = float(flops) / (seconds * max(devices, 1) * peak)
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        mine = (torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30)
        world = get_world_size()
        every: list[Any] = [mine]
        if world > 1 and dist.is_initialized():
            every = [None] * world
            dist.all_gather_object(every, mine)
        for i, key in enumerate(("allocated", "reserved")):
            out[f"perf/max_memory_{key}_gb"] = max(v[i] for v in every)
            if world > 1:
                out.update({f"perf/max_memory_{key}_gb/rank{r}": v[i] for r, v in enumerate(every)})
    return out


def _rollout_flops(run, cond) -> float:
    """Model FLOPs of one velocity call of the rollout over this rank's rows (`cond`), at the run's CFG scale."""
    return transformer_flops(run.model, cond, height=run.args.height, width=run.args.width,
                             guided=run.cfg_scale > 1.0)


def _gen_phase(run, per_rank: float) -> tuple[float, int]:
    """(FLOPs, devices) of the step's rollout: every rank's samples (`per_rank` FLOPs per velocity call on each),
    --num_inference_steps calls each, on the job's rollout devices."""
    return per_rank * run.args.num_inference_steps * get_world_size(), rollout_device_count(run.args.rollout_devices)


def nft_perf_metrics(run, cond, timings: Mapping[str, float], *, num_k: int, train_scale: float,
                     old_fraction: float = 1.0) -> dict[str, float]:
    """`phase_perf_metrics` of one DiffusionNFT step of `run` (a `training.Run`; `cond`: this rank's rollout
    conditioning). gen: see `_gen_phase`; update_actor: per sample K = `num_k` timesteps x (the policy's forward and
    backward = 3 forwards, the `old` forward = 1 in the fraction `old_fraction` of the sample passes that ran it,
    the reference forward = 1 when --ref_kl_coef > 0) x --ppo_epochs, each at the training forwards' CFG
    `train_scale`. Collective on CUDA."""
    args = run.args
    per_rank = _rollout_flops(run, cond)
    per_train = per_rank if (train_scale > 1.0) == (run.cfg_scale > 1.0) else transformer_flops(
        run.model, cond, height=args.height, width=args.width, guided=train_scale > 1.0)
    forwards = 3 + old_fraction + (1 if args.ref_kl_coef > 0 else 0)
    return phase_perf_metrics(timings, {"gen": _gen_phase(run, per_rank),
                                        "update_actor": (per_train * num_k * forwards * args.ppo_epochs, 1)},
                              run.device)


def dppo_perf_metrics(run, cond, timings: Mapping[str, float], *, num_w: int,
                      old_fraction: float = 1.0) -> dict[str, float]:
    """`phase_perf_metrics` of one Flow-DPPO / Flow-GRPO step of `run` (`cond`: this rank's rollout conditioning):
    gen (`_gen_phase`); old_log_prob: one forward per stored step (W = `num_w`) per replayed sample (the fraction
    `old_fraction` of the rank's samples); update_actor: a forward and backward (3 forwards) per stored step per
    sample x --ppo_epochs; every forward at the rollout's CFG. Collective on CUDA."""
    per_rank = _rollout_flops(run, cond)
    return phase_perf_metrics(timings, {"gen": _gen_phase(run, per_rank),
                                        "old_log_prob": (per_rank * num_w * old_fraction, 1),
                                        "update_actor": (per_rank * num_w * 3 * run.args.ppo_epochs, 1)},
                              run.device)
