"""The shared math of online RL for flow-matching image models: schedules, the SDE step, advantages, losses.

Every function here is a pure function on tensors: no I/O, no model code, no hidden state; device- and
dtype-agnostic (float64 inputs give float64 math, which the tests use for exact checks). Where the references
(flow_grpo, DiffusionNFT, verl-omni) disagree, the conventions follow verl-omni:

* sigma convention (diffusers / Qwen-Image): ``x_sigma = (1 - sigma) x0 + sigma eps``, sigma runs 1 (noise) -> 0
  (data), velocity ``v = eps - x0``, Euler step ``x' = x + (sigma' - sigma) v``. Boogu-Image runs its own time
  ``t = 1 - sigma`` and predicts ``-v``; the model wrappers convert, nothing here knows about Boogu.
* scheduler timesteps are ``1000 * sigma`` in float32; rollout and replay must build them bit-identically.
* log-probs are MEANS over all non-batch dimensions (a per-element log density), shape ``(B,)``.

The losses' metric dicts hold 0-dim detached tensors on the inputs' device under verl-omni's names (the trainers
prefix ``actor/``; a ``_max`` / ``_min`` name is reduced as the extreme over micro-batches and ranks): a loss reads nothing on the host, and a NaN/inf loss is returned as is (`training.GradStepper`
checks finiteness once per optimizer step). Argument checks raise ValueError where they cost no host read.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch

__all__ = [
    "SDEStep",
    "apply_cfg",
    "check_sde_sigmas",
    "diffusion_nft_loss",
    "ema_update_",
    "flow_dppo_loss",
    "flow_grpo_loss",
    "flow_sigmas",
    "group_advantages",
    "old_policy_decay",
    "reward_probability",
    "sde_step",
    "select_train_timesteps",
    "sigmas_at_timesteps",
    "time_shift_mu",
]

SDE_TYPES = ("sde", "cps")
ADV_MODES = ("continuous", "positive_only", "negative_only", "one_only", "binary")
# schedule name -> (warm-up steps, rate per step, maximum decay); d(step) = 0 if step < warm else
# min((step - warm) * rate, max)
DECAY_SCHEDULES = {
    "copy": (0, 0.0, 0.0),
    "linear_to_0_5": (0, 0.001, 0.5),
    "delayed_linear_to_0_999": (75, 0.0075, 0.999),
}


# --- Schedules -----------------------------------------------------------------------------------------


def time_shift_mu(
    image_seq_len: int, *, base_seq_len: int, max_seq_len: int, base_shift: float, max_shift: float
) -> float:
    """Resolution-dependent shift ``mu``, linear in the image token count.

    ``mu = base_shift + (max_shift - base_shift) * (L - base_seq_len) / (max_seq_len - base_seq_len)``,
    evaluated as diffusers' ``calculate_shift`` does (``m = Δshift/Δlen``, ``b = base_shift - m*base_len``,
    ``mu = L*m + b``, float64) so the float32 schedule built from it is bit-identical to verl-omni's.

    Qwen-Image: ``L = (H/16)(W/16)`` with 256 / 8192 / 0.5 / 0.9 from its scheduler config (512² -> 0.5387097).
    """
    if max_seq_len == base_seq_len:
        raise ValueError(f"max_seq_len ({max_seq_len}) must differ from base_seq_len ({base_seq_len})")
    if image_seq_len <= 0:
        raise ValueError(f"image_seq_len must be positive, got {image_seq_len}")
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return float(image_seq_len * m + b)


def flow_sigmas(num_steps: int, *, mu: float, shift_terminal: float | None = None) -> torch.Tensor:
    """Sigma schedule ``(N+1,)`` float32, from 1 down to a trailing 0.

    1. ``s_k = linspace(1, 1/N, N)`` (float64), cast to float32.
    2. Exponential time shift ``s'_k = e^mu / (e^mu + (1/s_k - 1))`` (so ``s'_0 = 1`` exactly).
    3. Optional terminal stretch ``s''_k = 1 - (1 - s'_k) (1 - shift_terminal) / (1 - s'_{N-1})`` so that the
       last evaluated sigma equals ``shift_terminal`` (Qwen-Image: 0.02; Boogu-Image: none).
    4. Append ``sigma_N = 0``.

    Steps 2-3 run in float32 numpy with Python scalars rounded to float32 first, exactly the float path of
    diffusers' ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=..., mu=...)`` under numpy 2, so the
    scheduler timesteps ``1000 * sigmas[:-1]`` (a float32 multiply) equal verl-omni's bit for bit; replay looks
    timesteps up by exact equality.

    Boogu-Image's released static "v1" shift is this formula with ``mu = 1.15`` (its logistic shift of
    ``t = 1 - sigma`` is the same function).
    """
    if not isinstance(num_steps, (int, np.integer)) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
    if not math.isfinite(mu):
        raise ValueError(f"mu must be finite, got {mu}")
    if shift_terminal is not None:
        if not 0.0 < shift_terminal < 1.0:
            raise ValueError(f"shift_terminal must lie in (0, 1), got {shift_terminal}")
        if num_steps < 2:
            raise ValueError("shift_terminal needs num_steps >= 2 (the stretch divides by 1 - sigma_{N-1})")
    one = np.float32(1.0)
    base = np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32)
    exp_mu = np.float32(math.exp(mu))
    shifted = exp_mu / (exp_mu + (one / base - one))
    if shift_terminal is not None:
        one_minus = one - shifted
        scale = one_minus[-1] / np.float32(1.0 - shift_terminal)
        shifted = one - one_minus / scale
    sigmas = torch.from_numpy(np.ascontiguousarray(shifted, dtype=np.float32))
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])


def sigmas_at_timesteps(timesteps: torch.Tensor, sigmas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Look stored scheduler timesteps up in a schedule by EXACT equality: ``(sigma, sigma_next)``, each
    shaped like ``timesteps``.

    ``timesteps`` are ``1000 * sigma`` float32 values a rollout stored; ``sigmas`` is the ``(N+1,)`` schedule the
    replay rebuilt with `flow_sigmas`. Step ``i`` has ``timesteps[i] = sigmas[i] * 1000`` (float32 multiply) and
    moves from ``sigmas[i]`` to ``sigmas[i + 1]``. A timestep that is not in the schedule means rollout and
    replay built different schedules (a silent RL breaker), so it raises instead of rounding to the nearest.
    """
    sigmas = sigmas.to(torch.float32)
    schedule_timesteps = sigmas[:-1] * 1000
    stored = timesteps.to(device=sigmas.device, dtype=torch.float32)
    matches = stored.reshape(-1, 1) == schedule_timesteps.reshape(1, -1)
    found = matches.any(dim=1)
    if not bool(found.all().item()):
        missing = stored.reshape(-1)[~found][:4].tolist()
        raise ValueError(f"timesteps {missing} are not in the replay schedule {schedule_timesteps.tolist()}: rollout "
                         "and replay built different schedules (check num_inference_steps, size, mu, shift_terminal)")
    index = matches.float().argmax(dim=1)
    return sigmas[index].reshape(timesteps.shape), sigmas[index + 1].reshape(timesteps.shape)


# --- The SDE step (rollout and replay) -----------------------------------------------------------------


class SDEStep(NamedTuple):
    """Result of `sde_step`. Shapes for a sample of shape ``(B, *D)``:

    prev_sample ``(B, *D)``, log_prob ``(B,)`` (``None`` when sampling with ``noise_level=0``),
    prev_sample_mean ``(B, *D)``, std_dev_t ``(B, 1, ..., 1)``, sqrt_neg_dt ``(B,)``.
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor
    sqrt_neg_dt: torch.Tensor


def _per_sample(value: float | torch.Tensor, batch: int, ndim: int, dtype, device, name: str) -> torch.Tensor:
    """Broadcast a scalar or ``(B,)`` tensor to ``(B, 1, ..., 1)`` with ``ndim`` dims."""
    value = torch.as_tensor(value, dtype=dtype, device=device)
    if value.ndim == 0:
        value = value.expand(batch)
    value = value.reshape(-1)
    if value.shape[0] != batch:
        raise ValueError(f"{name} must be a scalar or have shape ({batch},), got {tuple(value.shape)}")
    return value.reshape(batch, *([1] * (ndim - 1)))


def _randn(shape, generator, device, dtype) -> torch.Tensor:
    """Standard normal noise; a list of generators draws row ``b`` from ``generator[b]`` only."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
        rows = [torch.randn((1, *shape[1:]), generator=g, device=g.device, dtype=dtype) for g in generator]
        return torch.cat(rows).to(device)
    if generator is None:
        return torch.randn(shape, device=device, dtype=dtype)
    return torch.randn(shape, generator=generator, device=generator.device, dtype=dtype).to(device)


def check_sde_sigmas(sigma: torch.Tensor, sigma_next: torch.Tensor, *, sde_type: str = "sde",
                     sigma_max: float | torch.Tensor | None = None) -> None:
    """Raise ValueError unless ``0 <= sigma_next < sigma <= 1`` elementwise (any equal shapes, e.g. ``(B, W)`` of a
    whole rollout's stored steps), and, for ``sde_type="sde"`` without ``sigma_max``, no ``sigma == 1``. One host
    sync (`sde_step` runs it on every call unless told the caller did)."""
    bad = (sigma <= 0) | (sigma > 1) | (sigma_next < 0) | (sigma_next >= sigma)
    needs_sigma_max = (sigma == 1) & (sde_type == "sde" and sigma_max is None)
    bad_any, needs_sigma_max_any = torch.stack([bad.any(), needs_sigma_max.any()]).tolist()
    if needs_sigma_max_any:
        raise ValueError("sigma == 1 needs sigma_max (the schedule's second sigma, sigmas[1]) for the sde noise scale")
    if bad_any:
        raise ValueError("sigmas must satisfy 0 <= sigma_next < sigma <= 1 for every sample")


def sde_step(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    noise_level: float,
    sde_type: str = "sde",
    sigma_max: float | torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    validate: bool = True,
) -> SDEStep:
    """One reverse Flow-SDE transition from ``sigma`` to ``sigma_next`` with its Gaussian log-prob.

    ``sample`` x ``(B, *D)`` and ``model_output`` v (diffusers convention) are upcast to float32 (float64 stays
    float64); ``sigma``/``sigma_next`` are per-sample ``(B,)`` (or scalars); ``dt = sigma_next - sigma < 0``.

    ``sde_type="sde"`` (Flow-GRPO):
        ``std_dev_t = eta * sqrt(sigma / (1 - s~))`` with ``s~ = sigma_max`` where ``sigma == 1`` (the schedule's
        SECOND sigma; the numerator keeps sigma = 1), else ``s~ = sigma``;
        ``mean = x (1 + std_dev_t^2 dt / (2 sigma)) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt``;
        transition std ``s = std_dev_t sqrt(-dt)``; ``x' = mean + s z``;
        ``log_prob = mean_d[ -(x' - mean)^2 / (2 s^2) - log s - log sqrt(2 pi) ]``.
    ``sde_type="cps"`` (coefficient-preserving):
        ``std = sigma_next sin(eta pi / 2)`` (the full transition std, returned as ``std_dev_t``),
        ``x0^ = x - sigma v``, ``eps^ = x + (1 - sigma) v``,
        ``mean = (1 - sigma_next) x0^ + sqrt(sigma_next^2 - std^2) eps^``, ``x' = mean + std z``,
        ``log_prob = -mean_d[(x' - mean)^2]`` (unnormalised, as verl-omni).

    ``x'`` is detached inside the log-prob, so its gradient flows only through ``mean`` (i.e. through v).
    With ``prev_sample`` given the log-prob of that sample is evaluated (replay); otherwise ``x'`` is drawn
    with ``generator`` (a list draws row b from ``generator[b]``, so results do not depend on batching).
    ``noise_level = 0`` is the plain Euler step ``x + dt v``: no noise is drawn and ``log_prob`` is ``None``
    (the density is degenerate; asking for the log-prob of a given sample there raises).
    ``validate=False`` skips `check_sde_sigmas` (one host sync) for a caller that checked these sigmas already.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    if not (math.isfinite(noise_level) and noise_level >= 0):
        raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level}")
    if sample.shape != model_output.shape:
        raise ValueError(f"sample {tuple(sample.shape)} and model_output {tuple(model_output.shape)} must have the "
                         "same shape")
    if sample.ndim < 2:
        raise ValueError(f"sample must be batched (B, ...), got shape {tuple(sample.shape)}")
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(f"prev_sample {tuple(prev_sample.shape)} must match sample {tuple(sample.shape)}")
    if prev_sample is not None and noise_level == 0:
        raise ValueError("the log-prob of a given prev_sample is undefined at noise_level=0 (a deterministic step)")

    dtype = torch.promote_types(sample.dtype, torch.float32)
    dtype = torch.promote_types(dtype, model_output.dtype)
    device = sample.device
    batch, ndim = sample.shape[0], sample.ndim
    x = sample.to(dtype)
    v = model_output.to(dtype)
    sigma = _per_sample(sigma, batch, ndim, dtype, device, "sigma")
    sigma_next = _per_sample(sigma_next, batch, ndim, dtype, device, "sigma_next")

    if validate:
        check_sde_sigmas(sigma, sigma_next, sde_type=sde_type, sigma_max=sigma_max)
    at_one = sigma == 1

    dt = sigma_next - sigma
    if sde_type == "sde":
        if sigma_max is None:
            denom_sigma = sigma
        else:
            sigma_max = torch.as_tensor(sigma_max, dtype=dtype, device=device)
            denom_sigma = torch.where(at_one, sigma_max, sigma)
        std_dev_t = torch.sqrt(sigma / (1 - denom_sigma)) * noise_level
        prev_sample_mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (
            1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)
        ) * dt
        transition_std = std_dev_t * torch.sqrt(-1 * dt)
    else:
        std_dev_t = sigma_next * math.sin(noise_level * math.pi / 2)
        pred_x0 = x - sigma * v
        pred_eps = x + v * (1 - sigma)
        prev_sample_mean = pred_x0 * (1 - sigma_next) + pred_eps * torch.sqrt(sigma_next**2 - std_dev_t**2)
        transition_std = std_dev_t
    sqrt_neg_dt = torch.sqrt(-1 * dt).reshape(batch)

    if noise_level == 0:
        return SDEStep(prev_sample_mean, None, prev_sample_mean, std_dev_t, sqrt_neg_dt)

    if prev_sample is None:
        noise = _randn(x.shape, generator, device, dtype)
        prev_sample = prev_sample_mean + transition_std * noise
    else:
        prev_sample = prev_sample.to(dtype)

    target = prev_sample.detach()
    reduce_dims = tuple(range(1, ndim))
    if sde_type == "sde":
        log_prob = (
            -((target - prev_sample_mean) ** 2) / (2 * transition_std**2)
            - torch.log(transition_std)
            - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=dtype, device=device)))
        )
    else:
        log_prob = -((target - prev_sample_mean) ** 2)
    return SDEStep(prev_sample, log_prob.mean(dim=reduce_dims), prev_sample_mean, std_dev_t, sqrt_neg_dt)


# --- Classifier-free guidance --------------------------------------------------------------------------


def apply_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float, *, renorm: bool = False) -> torch.Tensor:
    """Classifier-free guidance on two predictions of the same shape.

    Standard: ``uncond + scale (cond - uncond)``. (Boogu-Image's wrapper does not call this: it writes the same
    combination as ``pos + (s - 1)(pos - neg)`` in the model dtype, rounding as the released pipeline does.)
    ``renorm=True`` is Qwen-Image's true-CFG: the combination is rescaled to the conditional prediction's norm
    over the LAST dimension (per packed token, 64 channels for Qwen latents ``(B, L, 64)``), no epsilon:
    ``comb * ||cond||_{-1} / ||comb||_{-1}``.
    """
    if cond.shape != uncond.shape:
        raise ValueError(f"cond {tuple(cond.shape)} and uncond {tuple(uncond.shape)} must have the same shape")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    combined = uncond + scale * (cond - uncond)
    if not renorm:
        return combined
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    combined_norm = torch.norm(combined, dim=-1, keepdim=True)
    return combined * (cond_norm / combined_norm)


# --- Advantages ----------------------------------------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence,
    *,
    global_std: bool = True,
    norm_by_std: bool = True,
    eps: float = 1e-4,
    num_steps: int = 1,
) -> torch.Tensor:
    """Group-relative advantages ``(N,)`` (verl-omni's Flow-GRPO estimator; DiffusionNFT uses ``num_steps=1``).

    The reward ``(N,)`` is repeated over the ``num_steps`` (W) stored steps, ``S (N, W)``, as verl-omni stores it:
    * group mean ``m_g`` = mean of the group's rows of S (= the group's mean reward);
    * std: ``global_std`` -> unbiased ``torch.std`` over all N·W entries of S, i.e.
      ``sqrt(W·SS / (N·W - 1))`` with SS the rewards' sum of squared deviations (so it depends on W);
      otherwise the unbiased std over the group's ``(n_g, W)`` block; a group of one uses the batch std
      (global) or 1.0;
    * ``A_i = (R_i - m_g) / (std + eps)`` (eps is ADDED, not a floor), or ``R_i - m_g`` without ``norm_by_std``.
    Groups whose rewards are all equal get exactly ``A = 0`` (no learning signal; they stay in the batch).
    Integer rewards are promoted to float32; float inputs keep their dtype.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {rewards.shape[0]} rewards")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    if not bool(torch.isfinite(rewards).all().item()):
        raise ValueError("rewards contain NaN or inf: a failed reward must raise, never enter the advantages")
    rewards = rewards.detach()
    if not rewards.is_floating_point():
        rewards = rewards.float()
    scores = rewards[:, None].expand(-1, num_steps)
    batch_std = torch.std(scores) if global_std else None

    groups: dict = {}
    for row, gid in enumerate(group_ids):
        key = gid.item() if isinstance(gid, torch.Tensor) else gid
        groups.setdefault(key, []).append(row)

    advantages = torch.empty_like(rewards)
    for rows in groups.values():
        index = torch.as_tensor(rows, device=rewards.device)
        block = scores[index]
        mean = torch.mean(block)
        if global_std:
            std = batch_std
        elif len(rows) > 1:
            std = torch.std(block)
        else:
            std = torch.ones((), dtype=rewards.dtype, device=rewards.device)
        centred = rewards[index] - mean
        group_adv = centred / (std + eps) if norm_by_std else centred
        constant = bool((rewards[index] == rewards[index][0]).all().item())
        advantages[index] = torch.zeros_like(group_adv) if constant else group_adv
    return advantages


def reward_probability(advantages: torch.Tensor, *, adv_clip_max: float, adv_mode: str = "continuous") -> torch.Tensor:
    """DiffusionNFT optimality probability ``r`` from advantages (same shape).

    ``A <- clamp(A, -C, C)``, then by mode: ``continuous`` (unchanged), ``positive_only`` clamp to [0, C],
    ``negative_only`` clamp to [-C, 0], ``one_only`` A <- 1 if A > 0 else 0, ``binary`` A <- sign(A);
    finally ``r = clamp(A / (2C) + 1/2, 0, 1)``. (``one_only``/``binary`` give r in {1/2 ± 1/(2C)}, not {0, 1}.)
    """
    if not (math.isfinite(adv_clip_max) and adv_clip_max > 0):
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    if adv_mode not in ADV_MODES:
        raise ValueError(f"adv_mode must be one of {ADV_MODES}, got {adv_mode!r}")
    if not bool(torch.isfinite(advantages).all().item()):
        raise ValueError("advantages contain NaN or inf")
    clipped = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        clipped = torch.clamp(clipped, 0, adv_clip_max)
    elif adv_mode == "negative_only":
        clipped = torch.clamp(clipped, -adv_clip_max, 0)
    elif adv_mode == "one_only":
        clipped = torch.where(clipped > 0, torch.ones_like(clipped), torch.zeros_like(clipped))
    elif adv_mode == "binary":
        clipped = torch.sign(clipped)
    return torch.clamp((clipped / adv_clip_max) / 2.0 + 0.5, 0, 1)


# --- Policy losses -------------------------------------------------------------------------------------


def _require_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shapes must match: {shapes}")


def _std(x: torch.Tensor, unbiased: bool) -> torch.Tensor:
    return x.std(unbiased=unbiased) if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio: float,
    adv_clip_max: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-GRPO clipped surrogate, mean over the given (sample, step) elements.

    ``rho = exp(logp - logp_old)``, ``A^ = clamp(A, -C, C)`` (C = ``adv_clip_max``),
    ``loss = mean[ max(-A^ rho, -A^ clamp(rho, 1 - eps, 1 + eps)) ]`` with eps = ``clip_ratio``.
    The gradient is zero where the clipped branch is active (A^ > 0, rho > 1 + eps or A^ < 0, rho < 1 - eps).
    Metrics: ``pg_loss``, ``ppo_kl = mean(logp_old - logp)``, ``pg_clipfrac = mean(|rho - 1| > eps)`` and its
    ``_higher`` / ``_lower`` parts, ``ratio_mean``, ``ratio_std`` (unbiased), ``ratio_min``, ``ratio_max``.
    """
    if not (math.isfinite(clip_ratio) and clip_ratio > 0):
        raise ValueError(f"clip_ratio must be > 0, got {clip_ratio}")
    if not (math.isfinite(adv_clip_max) and adv_clip_max > 0):
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    _require_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    advantages = torch.clamp(advantages.detach(), -adv_clip_max, adv_clip_max)
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    loss = torch.mean(torch.maximum(unclipped, clipped))
    with torch.no_grad():
        ratio_d = ratio.detach()
        metrics = {
            "pg_loss": loss.detach(),
            "ppo_kl": torch.mean(-log_ratio.detach()),
            "pg_clipfrac": ((ratio_d - 1.0).abs() > clip_ratio).float().mean(),
            "pg_clipfrac_higher": (ratio_d - 1.0 > clip_ratio).float().mean(),
            "pg_clipfrac_lower": (1.0 - ratio_d > clip_ratio).float().mean(),
            "ratio_mean": ratio_d.mean(),
            "ratio_std": _std(ratio_d, unbiased=True),
            "ratio_min": ratio_d.min(),
            "ratio_max": ratio_d.max(),
        }
    return loss, metrics


def flow_dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    prev_sample_mean: torch.Tensor,
    old_prev_sample_mean: torch.Tensor,
    std_dev_t: torch.Tensor,
    sqrt_neg_dt: torch.Tensor,
    *,
    kl_mask_threshold: float = 1e-5,
    add_kl_coefficient: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO: unclipped surrogate with a divergence trust-region mask, per sample of one stored step.

    Shapes: log-probs and advantages ``(B,)``, means ``(B, *D)``, ``std_dev_t`` ``(B,)`` or ``(B, 1, ..., 1)``,
    ``sqrt_neg_dt`` ``(B,)``. A is NOT clamped.
    * ``rho = exp(logp - logp_old)``;
    * ``D = mean_d[(mu - mu_old)^2] / (2 sigma_t^2)`` with ``sigma_t = std_dev_t sqrt(-dt)`` when
      ``add_kl_coefficient`` (the exact equal-variance Gaussian KL per latent element; correct for
      ``sde_type="sde"``), else ``D = mean_d[(mu - mu_old)^2] / 2``;
    * ``high = D >= kl_mask_threshold``; ``pos_rm = high & rho > 1 & A > 0``; ``neg_rm = high & rho < 1 & A < 0``;
      ``keep = not (pos_rm or neg_rm)`` (detached): updates that already push further in the advantage's
      direction beyond the trust region are dropped, corrective ones are kept;
    * ``loss = mean_i[ keep_i ? -A_i rho_i : 0 ]`` (a select; masked elements contribute neither value nor
      gradient, even if their ratio overflowed); a non-finite ``D`` (no trust-region decision) makes it NaN, so the
      optimizer step is skipped.
    Metrics: ``pg_loss``, ``ppo_kl``, ``approx_kl = mean(log_ratio^2 / 2)``, ``ratio_{mean,std (population),min,max}``,
    ``kl_new_old_{mean,max}``, ``kl_mask_fraction``, ``pos_rm_fraction``, ``neg_rm_fraction``,
    ``masked_fraction``, ``unmasked_fraction``.
    """
    if not (math.isfinite(kl_mask_threshold) and kl_mask_threshold > 0):
        raise ValueError(f"kl_mask_threshold must be > 0, got {kl_mask_threshold}")
    _require_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    _require_same_shape(prev_sample_mean=prev_sample_mean, old_prev_sample_mean=old_prev_sample_mean)
    batch = log_prob.shape[0]
    if log_prob.ndim != 1 or not prev_sample_mean.shape[0] == std_dev_t.numel() == sqrt_neg_dt.numel() == batch:
        raise ValueError(f"need log_prob (B,), prev_sample_mean (B, ...), one std_dev_t, sqrt_neg_dt per sample, got "
                         f"{[tuple(x.shape) for x in (log_prob, prev_sample_mean, std_dev_t, sqrt_neg_dt)]}")
    advantages = advantages.detach()
    log_ratio = log_prob - old_log_prob.detach()
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        mean_sq = (prev_sample_mean.detach() - old_prev_sample_mean.detach()).pow(2)
        mean_sq = mean_sq.mean(dim=tuple(range(1, mean_sq.ndim))) if mean_sq.ndim > 1 else mean_sq
        sigma_t = std_dev_t.detach().reshape(batch) * sqrt_neg_dt.detach().reshape(batch)
        kl = mean_sq / (2 * sigma_t.pow(2)) if add_kl_coefficient else mean_sq / 2  # (B,)
        high = kl >= kl_mask_threshold
        pos_rm = high & (ratio > 1.0) & (advantages > 0)
        neg_rm = high & (ratio < 1.0) & (advantages < 0)
        masked = pos_rm | neg_rm
        keep = ~masked
    # exp of a zeroed log-ratio on masked rows keeps an overflowed ratio out of forward AND backward
    safe_ratio = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
    per_sample = torch.where(keep, -advantages * safe_ratio, torch.zeros_like(safe_ratio))
    loss = torch.mean(per_sample)
    loss = torch.where(torch.isfinite(kl).all(), loss, torch.full_like(loss, float("nan")))  # NaN D: no mask decision
    with torch.no_grad():
        log_ratio_d = log_ratio.detach()
        metrics = {
            "pg_loss": loss.detach(),
            "ppo_kl": torch.mean(-log_ratio_d),
            "approx_kl": (0.5 * log_ratio_d.pow(2)).mean(),
            "ratio_mean": ratio.mean(),
            "ratio_std": _std(ratio, unbiased=False),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
            "kl_new_old_mean": kl.mean(),
            "kl_new_old_max": kl.max(),
            "kl_mask_fraction": high.float().mean(),
            "pos_rm_fraction": pos_rm.float().mean(),
            "neg_rm_fraction": neg_rm.float().mean(),
            "masked_fraction": masked.float().mean(),
            "unmasked_fraction": keep.float().mean(),
        }
    return loss, metrics


def diffusion_nft_loss(
    forward_prediction: torch.Tensor,
    old_prediction: torch.Tensor,
    x0: torch.Tensor,
    xt: torch.Tensor,
    t: torch.Tensor,
    reward_prob: torch.Tensor,
    *,
    mix_beta: float,
    adv_clip_max: float,
    ref_prediction: torch.Tensor | None = None,
    ref_kl_coef: float = 0.0,
    adaptive_weight_min: float = 1e-5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's forward-process objective (verl-omni ``DiffusionNFTLoss``, = the official inline loss).

    Predictions are velocities in the diffusers convention (``v = eps - x0``; negate Boogu outputs first), all
    ``(B, *D)``; ``x0`` clean latents, ``xt = (1 - t) x0 + t eps``; ``t`` ``(B,)`` or broadcastable;
    ``reward_prob`` r ``(B,)`` (or ``(B, K)``, averaged). With beta = ``mix_beta``, C = ``adv_clip_max``:
    * implicit policies ``v+ = beta v_theta + (1 - beta) v_old``, ``v- = (1 + beta) v_old - beta v_theta``;
    * ``x0^± = xt - t v±``;
    * adaptive weights (no gradient, float64): ``w± = max(w_min, mean_d |x0^± - x0|)``;
    * ``L± = mean_d[(x0^± - x0)^2 / w±]``;
    * ``policy_loss = mean_i C [r_i L+_i + (1 - r_i) L-_i] / beta`` (the ×C is inside, /beta on both branches);
    * ``ref_kl_loss = mean_i mean_d[(v_theta - v_ref)^2]`` (a velocity MSE to the frozen base, not a true KL);
    * ``loss = policy_loss + ref_kl_coef * ref_kl_loss``.
    ``v_old`` and ``v_ref`` are detached. With ``v_theta == v_old`` both branches coincide:
    ``L+ = L- = mean_d[(x0^ - x0)^2] / max(w_min, mean_d|x0^ - x0|)`` and ``policy_loss = mean_i C L_i / beta``.
    Metrics: ``policy_loss``, ``positive_loss = mean_i L+_i``, ``negative_loss = mean_i L-_i`` (before r, /beta,
    ×C), ``ref_kl_loss`` (0 without a reference), ``old_deviate = mean (v_theta - v_old)^2``,
    ``reward_prob_mean``, ``total_loss``. ``reward_prob`` must lie in [0, 1] (`reward_probability`'s output does;
    not checked here, that would be a host read per call).
    """
    if not (math.isfinite(mix_beta) and mix_beta > 0):
        raise ValueError(f"mix_beta must be > 0, got {mix_beta}")
    if not (math.isfinite(adv_clip_max) and adv_clip_max > 0):
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    if not (math.isfinite(ref_kl_coef) and ref_kl_coef >= 0):
        raise ValueError(f"ref_kl_coef must be >= 0, got {ref_kl_coef}")
    if not adaptive_weight_min > 0:
        raise ValueError(f"adaptive_weight_min must be > 0, got {adaptive_weight_min}")
    if ref_kl_coef > 0 and ref_prediction is None:
        raise ValueError("ref_kl_coef > 0 needs ref_prediction (the base model's velocity with adapters disabled)")
    shapes = dict(forward_prediction=forward_prediction, old_prediction=old_prediction, x0=x0, xt=xt)
    if ref_prediction is not None:
        shapes["ref_prediction"] = ref_prediction
    _require_same_shape(**shapes)
    batch, ndim = x0.shape[0], x0.ndim
    if t.numel() == batch:
        t = t.reshape(batch, *([1] * (ndim - 1)))
    elif t.numel() != 1:
        raise ValueError(f"t must hold one value per sample (B={batch}), got shape {tuple(t.shape)}")
    if reward_prob.shape[0] != batch:
        raise ValueError(f"reward_prob must start with the batch dim {batch}, got {tuple(reward_prob.shape)}")
    reward_weight = reward_prob.detach()
    if reward_weight.ndim > 1:
        reward_weight = reward_weight.flatten(1).mean(dim=1)
    reward_weight = reward_weight.to(device=x0.device, dtype=x0.dtype)

    old_prediction = old_prediction.detach()
    reduce_dims = tuple(range(1, ndim))
    positive_prediction = mix_beta * forward_prediction + (1.0 - mix_beta) * old_prediction
    negative_prediction = (1.0 + mix_beta) * old_prediction - mix_beta * forward_prediction
    positive_x0 = xt - t * positive_prediction
    negative_x0 = xt - t * negative_prediction
    with torch.no_grad():  # w±, (B, 1, ..., 1) each
        positive_weight, negative_weight = (
            (x0_hat.double() - x0.double()).abs().mean(dim=reduce_dims, keepdim=True)
            .clip(min=adaptive_weight_min).to(x0_hat.dtype) for x0_hat in (positive_x0, negative_x0))
    positive_loss = ((positive_x0 - x0) ** 2 / positive_weight).mean(dim=reduce_dims)
    negative_loss = ((negative_x0 - x0) ** 2 / negative_weight).mean(dim=reduce_dims)
    per_sample = reward_weight * positive_loss / mix_beta + (1.0 - reward_weight) * negative_loss / mix_beta
    policy_loss = (per_sample * adv_clip_max).mean()
    if ref_prediction is not None:
        ref_kl_loss = ((forward_prediction - ref_prediction.detach()) ** 2).mean(dim=reduce_dims).mean()
        loss = policy_loss + ref_kl_coef * ref_kl_loss
    else:
        ref_kl_loss = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
        loss = policy_loss
    with torch.no_grad():
        metrics = {
            "policy_loss": policy_loss.detach(),
            "positive_loss": positive_loss.detach().mean(),
            "negative_loss": negative_loss.detach().mean(),
            "ref_kl_loss": ref_kl_loss.detach(),
            "old_deviate": ((forward_prediction.detach() - old_prediction) ** 2).mean(),
            "reward_prob_mean": reward_weight.mean(),
            "total_loss": loss.detach(),
        }
    return loss, metrics


def select_train_timesteps(
    train_timesteps: torch.Tensor, *, timestep_fraction: float = 1.0, seed: int | None = 42
) -> torch.Tensor:
    """DiffusionNFT training timesteps ``(B, K)`` int64 from the rollout schedule's timesteps ``(B, N)``.

    ``K = max(1, int(N * timestep_fraction))``; each row is permuted independently (``torch.randperm`` on the
    CPU) and its first K entries kept, then cast to INTEGER scheduler timesteps, as verl-omni does: the training
    ``t = timestep / 1000`` is therefore ``floor(1000 sigma) / 1000`` (851.48 -> 0.851), not the exact rollout sigma.
    verl-omni re-seeds the generator with ``seed`` (its ``data_loader_seed``, 42) on every call, so the
    permutation pattern repeats every step; ``seed=None`` draws from torch's global generator instead.
    """
    if train_timesteps.ndim != 2:
        raise ValueError(f"train_timesteps must be (B, N), got {tuple(train_timesteps.shape)}")
    if not 0.0 < timestep_fraction <= 1.0:
        raise ValueError(f"timestep_fraction must lie in (0, 1], got {timestep_fraction}")
    num_steps = train_timesteps.shape[1]
    keep = max(1, int(num_steps * timestep_fraction))
    generator = None if seed is None else torch.Generator().manual_seed(int(seed))
    rows = [row[torch.randperm(num_steps, generator=generator)[:keep].to(row.device)] for row in train_timesteps]
    return torch.stack(rows).long()


# --- The DiffusionNFT old policy -----------------------------------------------------------------------


def old_policy_decay(step: int, schedule: str) -> float:
    """Decay ``d`` of the ``old`` adapter EMA at rollout step ``step`` (verl-omni: the rollout-step counter).

    ``d(step) = 0 if step < warm else min((step - warm) * rate, max)`` with (warm, rate, max):
    ``copy`` (0, 0, 0) -> always a hard copy; ``linear_to_0_5`` (0, 0.001, 0.5);
    ``delayed_linear_to_0_999`` (75, 0.0075, 0.999): 0 up to step 75, 0.0075 at 76, 0.999 from 209 on.
    """
    if schedule not in DECAY_SCHEDULES:
        raise ValueError(f"schedule must be one of {tuple(DECAY_SCHEDULES)}, got {schedule!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    warm, rate, maximum = DECAY_SCHEDULES[schedule]
    if step < warm:
        return 0.0
    return float(min((step - warm) * rate, maximum))


@torch.no_grad()
def ema_update_(
    old_params: Sequence[torch.Tensor], new_params: Sequence[torch.Tensor], decay: float
) -> None:
    """In place ``old <- decay * old + (1 - decay) * new`` for each pair; ``decay == 0`` is an exact copy.

    Meant for the LoRA tensors of the ``old`` and ``default`` adapters (works on FSDP2 DTensor shards that
    share a placement).
    """
    old_params, new_params = list(old_params), list(new_params)
    if len(old_params) != len(new_params):
        raise ValueError(f"old_params has {len(old_params)} tensors, new_params {len(new_params)}")
    if not (math.isfinite(decay) and 0.0 <= decay <= 1.0):
        raise ValueError(f"decay must lie in [0, 1], got {decay}")
    for i, (old, new) in enumerate(zip(old_params, new_params)):
        if old.shape != new.shape:
            raise ValueError(f"parameter {i}: old {tuple(old.shape)} vs new {tuple(new.shape)}")
    for old, new in zip(old_params, new_params):
        if decay == 0.0:
            old.copy_(new)
        else:
            old.mul_(decay).add_(new.to(old.dtype), alpha=1.0 - decay)
