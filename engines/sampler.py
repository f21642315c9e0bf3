"""Layer 1 of the rollout code: the sampler math that every engine shares (the native engine and the vllm-omni RL
pipelines): per-row seeds, SDE windows and the RL denoising loop, plus the RL knob names the vllm-omni pipelines
read from a request.

Imports only torch and `losses` (no other project module); it is the only module of the rollout code that
`engines/vllm_omni_pipelines.py` imports (which is what keeps that module free of an import cycle).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

import losses


# ---------------------------------------------------------------------------------------------------------
# Seeds and SDE windows
# ---------------------------------------------------------------------------------------------------------


def row_seed(seed: int, global_step: int, row: int) -> int:
    """Per-row rollout seed: ``base = seed + global_step - 1``, ``(base * 1_000_003 + row) mod (2^63 - 1)``.

    ``row`` is the sample's GLOBAL index in the step's batch (after the interleaved repeat by n), so every
    sample of every group gets its own stream on every rank.
    """
    base = seed + global_step - 1
    return (base * 1_000_003 + row) % (2**63 - 1)


def sde_window_starts(
    num_steps: int, window_size: int | None, window_range: Sequence[int] | None, generators: Sequence[torch.Generator],
    sde_type: str = "sde",
) -> list[int]:
    """First step of each sample's SDE window.

    ``window_size=None``: the window is steps [0, N-1) for everyone (every step but the last is stochastic and
    trained). Otherwise start ~ UniformInt{lo, ..., hi - w} from the sample's generator with ``(lo, hi) =
    window_range`` (default (0, 5), verl-omni's fallback); the window is [start, start + w). For ``sde_type="cps"``
    the range must end before the last step: its noise scale is sigma_next = 0 there, a deterministic transition
    with no log-prob to train.
    """
    if window_size is None:
        return [0] * len(generators)
    lo, hi = (0, 5) if window_range is None else (int(window_range[0]), int(window_range[1]))
    last = num_steps - 1 if sde_type == "cps" else num_steps
    if window_size < 1 or lo < 0 or hi - window_size < lo or hi > last:
        raise ValueError(
            f"sde_window_size={window_size} does not fit sde_window_range=({lo}, {hi}) within {num_steps} steps"
            + (" (cps: the last step is deterministic, so the range must end by step N - 1)"
               if sde_type == "cps" else "")
        )
    return [int(torch.randint(lo, hi - window_size + 1, (1,), generator=g).item()) for g in generators]


def window_length(num_steps: int, window_size: int | None) -> int:
    return num_steps - 1 if window_size is None else window_size


def rl_denoise(
    velocity_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    generators: Sequence[torch.Generator],
    window_starts: Sequence[int],
    window_size: int,
    *,
    noise_level: float,
    sde_type: str,
    keep_trajectory: bool,
    keep_log_probs: bool,
) -> tuple[torch.Tensor, list[list[torch.Tensor]], list[list[torch.Tensor]], list[list[torch.Tensor]],
           list[list[torch.Tensor]]]:
    """The sampling loop of both engines (native and the vllm-omni RL pipelines) over a batch of rows.

    velocity_fn(latents (B, ...) fp32, sigma (B,) fp32) -> fp32 velocity v = eps - x0 (the model's CFG applied).
    Row b steps with `noise_level` and noise from generators[b] inside [window_starts[b], +window_size), Euler
    (no noise drawn) outside. Returns (final fp32 latents, per-row all_latents, all_timesteps, all_log_probs,
    all_means lists); all_means (with keep_trajectory) holds each window step's transition mean μ(x_t) (fp32),
    what Flow-DPPO's bypass mode uses as μ_old instead of replaying the step.
    """
    n, steps = latents.shape[0], sigmas.shape[0] - 1
    timesteps = sigmas[:-1] * 1000
    latents = latents.float()
    all_latents: list[list[torch.Tensor]] = [[] for _ in range(n)]
    all_timesteps: list[list[torch.Tensor]] = [[] for _ in range(n)]
    all_log_probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
    all_means: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for i in range(steps):
        velocity = velocity_fn(latents, sigmas[i].expand(n)).float()
        in_window = [window_starts[b] <= i < window_starts[b] + window_size for b in range(n)]
        next_latents = torch.empty_like(latents)
        for inside in (True, False):
            rows = [b for b in range(n) if in_window[b] == inside]
            if not rows:
                continue
            index = torch.as_tensor(rows, device=latents.device)
            step = losses.sde_step(
                latents[index], velocity[index], sigmas[i], sigmas[i + 1],
                noise_level=noise_level if inside else 0.0, sde_type=sde_type, sigma_max=sigmas[1],
                generator=[generators[b] for b in rows] if inside else None,
            )
            next_latents[index] = step.prev_sample
            if inside and (keep_trajectory or keep_log_probs):
                # one device->host copy per stored tensor and step, not one per row
                if keep_trajectory:
                    before, after = latents[index].float().cpu(), step.prev_sample.float().cpu()
                    means = step.prev_sample_mean.float().cpu()
                    timestep = timesteps[i].float().cpu()
                if keep_log_probs:
                    log_probs = step.log_prob.float().cpu()
                for j, b in enumerate(rows):
                    if keep_trajectory:
                        if not all_latents[b]:
                            all_latents[b].append(before[j])
                        all_latents[b].append(after[j])
                        all_means[b].append(means[j])
                        all_timesteps[b].append(timestep)
                    if keep_log_probs:
                        all_log_probs[b].append(log_probs[j])
        latents = next_latents
    return latents, all_latents, all_timesteps, all_log_probs, all_means


# RL knobs carried in OmniDiffusionSamplingParams.extra_args, with the pipeline-side defaults (read by
# `engines.vllm_omni_pipelines.rl_settings`; `engines.vllm_omni.vllm_omni_sampling_kwargs` writes them).
VLLM_OMNI_RL_KEYS: dict[str, Any] = {
    "rl_noise_level": 0.0,
    "rl_sde_type": "sde",
    "rl_sde_window_size": None,
    "rl_sde_window_range": None,
    "rl_return_log_probs": False,
    "rl_return_trajectory": False,
}
