"""Rollouts: one request/response contract, the native engine (diffusers/torch via `models/`), and a group of
rollout worker subprocesses on GPUs reserved for rollout.

The trainers build a `RolloutRequest` (one prompt per sample, already repeated `n` times per group), hand it to a
`RolloutGroup`, and get a `RolloutResult` back in request order. Each worker process owns one engine on its own
device(s) (`CUDA_VISIBLE_DEVICES` set per worker) and loads LoRA adapters from the same PEFT directories a
vllm-omni engine would read. Everything that crosses the process boundary is plain data (CPU tensors and built-in
types, read with `torch.load(weights_only=True)`), so the workers may run another Python environment
(`--rollout_python`, e.g. vllm-omni's own torch stack); a start-up handshake refuses a peer of another protocol.

Sampling (native engine), per sample b with its own generator g_b seeded from `seeds[b]`:
  1. initial noise from g_b (model-native layout, fp32); for edit, the reference VAE latents are sampled next
     from g_b;
  2. SDE window start from g_b (only when `sde_window_size` is set): start ~ UniformInt{lo, ..., hi - w};
  3. for every step i: velocity (with the model's CFG), then `losses.sde_step` in fp32 — inside the window with
     `noise_level` (noise from g_b), outside it with 0 (Euler, no noise drawn).
So a sample never depends on how requests are batched or split across workers.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import io
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

import losses
from models.base import PromptEmbeds

if TYPE_CHECKING:
    from models.base import Conditioning

ENGINES = ("native", "vllm_omni")


# ---------------------------------------------------------------------------------------------------------
# Seeds and SDE windows (spec algorithms.md §3.1, §3.3)
# ---------------------------------------------------------------------------------------------------------


def row_seed(seed: int, global_step: int, row: int) -> int:
    """Per-row rollout seed: ``base = seed + global_step - 1``, ``(base * 1_000_003 + row) mod (2^63 - 1)``.

    ``row`` is the sample's GLOBAL index in the step's batch (after the interleaved repeat by n), so every
    sample of every group gets its own stream on every rank.
    """
    base = seed + global_step - 1
    return (base * 1_000_003 + row) % (2**63 - 1)


def sde_window_starts(
    num_steps: int, window_size: int | None, window_range: Sequence[int] | None, generators: Sequence[torch.Generator]
) -> list[int]:
    """First step of each sample's SDE window.

    ``window_size=None``: the window is steps [0, N-1) for everyone (every step but the last is stochastic and
    trained). Otherwise start ~ UniformInt{lo, ..., hi - w} from the sample's generator with ``(lo, hi) =
    window_range`` (default (0, 5), verl-omni's fallback); the window is [start, start + w).
    """
    if window_size is None:
        return [0] * len(generators)
    lo, hi = (0, 5) if window_range is None else (int(window_range[0]), int(window_range[1]))
    if window_size < 1 or lo < 0 or hi - window_size < lo or hi > num_steps:
        raise ValueError(
            f"sde_window_size={window_size} does not fit sde_window_range=({lo}, {hi}) within {num_steps} steps"
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
) -> tuple[torch.Tensor, list[list[torch.Tensor]], list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """The sampling loop of both engines (native and the vllm-omni RL pipelines) over a batch of rows.

    velocity_fn(latents (B, ...) fp32, sigma (B,) fp32) -> fp32 velocity v = eps - x0 (the model's CFG applied).
    Row b steps with `noise_level` and noise from generators[b] inside [window_starts[b], +window_size), Euler
    (no noise drawn) outside. Returns (final fp32 latents, per-row all_latents, all_timesteps, all_log_probs lists).
    """
    n, steps = latents.shape[0], sigmas.shape[0] - 1
    timesteps = sigmas[:-1] * 1000
    latents = latents.float()
    all_latents: list[list[torch.Tensor]] = [[] for _ in range(n)]
    all_timesteps: list[list[torch.Tensor]] = [[] for _ in range(n)]
    all_log_probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
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
                    timestep = timesteps[i].float().cpu()
                if keep_log_probs:
                    log_probs = step.log_prob.float().cpu()
                for j, b in enumerate(rows):
                    if keep_trajectory:
                        if not all_latents[b]:
                            all_latents[b].append(before[j])
                        all_latents[b].append(after[j])
                        all_timesteps[b].append(timestep)
                    if keep_log_probs:
                        all_log_probs[b].append(log_probs[j])
        latents = next_latents
    return latents, all_latents, all_timesteps, all_log_probs


# ---------------------------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------------------------


def _check_keys(cls: type, data: dict[str, Any], what: str) -> None:
    """ValueError listing the keys of `data` that are not fields of the dataclass `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; valid keys: {sorted(names)}")


@dataclass
class RolloutRequest:
    """One batch of samples to generate (all at one size and step count).

    prompts: per sample, a str or a chat-message list ``[{"role", "content"}, ...]`` as stored in the parquet.
    negative_prompts: per sample (same forms), required when guidance is active.
    images: per sample reference image (uint8 (3, H, W) tensor or PIL) for Boogu edit, else None.
    seeds: per-sample seeds (see `row_seed`).
    guidance_scale: Boogu-Image text CFG (None -> 4.0, the released default). true_cfg_scale: Qwen-Image true CFG
    (None -> 4.0, diffusers' default). Setting the other family's knob is an error.
    noise_level / sde_type / sde_window_size / sde_window_range: the SDE knobs (noise_level 0 = ODE rollout).
    return_log_probs / return_trajectory: store the window's log-probs / latents and timesteps.
    """

    prompts: list
    seeds: list[int]
    num_inference_steps: int
    height: int
    width: int
    negative_prompts: list | None = None
    images: list | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    noise_level: float = 0.0
    sde_type: str = "sde"
    sde_window_size: int | None = None
    sde_window_range: tuple[int, int] | None = None
    return_log_probs: bool = False
    return_trajectory: bool = False
    generator_device: str = "cpu"

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields for the process boundary (`from_dict` rebuilds it): reference images become
        uint8 (3, H, W) tensors (a PIL image is converted to RGB; tensors pass uncopied), so the message holds
        plain tensors and built-in types only (`check_plain`)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.images is not None:
            data["images"] = [None if im is None else image_to_uint8(im) for im in self.images]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RolloutRequest":
        """Build from a plain dict; unknown keys are an error (a typo must not silently use a default)."""
        _check_keys(cls, data, "rollout request")
        request = cls(**data)
        request.validate()
        return request

    def __len__(self) -> int:
        return len(self.prompts)

    def validate(self) -> None:
        n = len(self.prompts)
        if n == 0:
            raise ValueError("a rollout request needs at least one prompt")
        for name in ("seeds", "negative_prompts", "images"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        if not isinstance(self.num_inference_steps, int) or self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be a positive int, got {self.num_inference_steps!r}")
        if self.sde_type not in losses.SDE_TYPES:
            raise ValueError(f"sde_type must be one of {losses.SDE_TYPES}, got {self.sde_type!r}")
        if not self.noise_level >= 0:
            raise ValueError(f"noise_level must be >= 0, got {self.noise_level}")
        if self.return_log_probs and self.noise_level == 0:
            raise ValueError("return_log_probs needs noise_level > 0 (an ODE rollout has no transition density)")
        if self.sde_window_size is not None:
            sde_window_starts(self.num_inference_steps, self.sde_window_size, self.sde_window_range, [])
        if self.noise_level > 0 and self.sde_window_size is None and self.num_inference_steps < 2:
            raise ValueError("an SDE rollout without sde_window_size needs num_inference_steps >= 2")

    @staticmethod
    def concat(requests: Sequence["RolloutRequest"]) -> "RolloutRequest":
        """One request holding every sample of `requests` in order; their shared settings must agree."""
        if not requests:
            raise ValueError("RolloutRequest.concat needs at least one request")
        per_sample = ("prompts", "seeds", "negative_prompts", "images")
        first = requests[0]
        for other in requests[1:]:
            for f in dataclasses.fields(RolloutRequest):
                if f.name not in per_sample and getattr(other, f.name) != getattr(first, f.name):
                    raise ValueError(f"requests disagree on {f.name}: {getattr(first, f.name)!r} vs "
                                     f"{getattr(other, f.name)!r}")
            for name in ("negative_prompts", "images"):
                if (getattr(other, name) is None) != (getattr(first, name) is None):
                    raise ValueError(f"some requests carry {name} and others do not")
        join = lambda name: None if getattr(first, name) is None else [  # noqa: E731
            x for r in requests for x in getattr(r, name)]
        return dataclasses.replace(first, **{name: join(name) for name in per_sample})

    def select(self, rows: Sequence[int]) -> "RolloutRequest":
        """The sub-request of the given sample rows (shared settings kept)."""
        pick = lambda xs: None if xs is None else [xs[r] for r in rows]  # noqa: E731
        return dataclasses.replace(
            self, prompts=pick(self.prompts), seeds=pick(self.seeds), negative_prompts=pick(self.negative_prompts),
            images=pick(self.images),
        )


@dataclass
class RolloutResult:
    """Batched rollout outputs, rows in request order (all tensors on CPU).

    images: uint8 (B, 3, H, W). latents_clean: fp32 final latents in the model-native layout (Qwen packed
    (B, L, 64), Boogu (B, 16, h, w)).
    SDE rollouts with return_trajectory: all_latents fp32 (B, W+1, ...) = state at the window start and after every
    window step; all_timesteps fp32 (B, W) scheduler timesteps 1000·σ (descending). With return_log_probs:
    all_log_probs fp32 (B, W) (means over latent elements).
    prompt_embeds / prompt_mask and negative_embeds / negative_mask: the encoder outputs used (model dtype),
    right-padded. ref_latents: edit reference latents (B, 16, h, w) fp32.
    metadata: shared facts (engine, family, sigmas used, size, steps, adapter version and bound-module count).
    seeds: the per-sample seeds; window_starts: per-sample first SDE step (SDE rollouts).
    """

    images: torch.Tensor
    latents_clean: torch.Tensor
    prompt_embeds: torch.Tensor
    prompt_mask: torch.Tensor
    seeds: list[int]
    metadata: dict[str, Any]
    window_starts: list[int] | None = None
    negative_embeds: torch.Tensor | None = None
    negative_mask: torch.Tensor | None = None
    ref_latents: torch.Tensor | None = None
    all_latents: torch.Tensor | None = None
    all_timesteps: torch.Tensor | None = None
    all_log_probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.images.shape[0]

    def select(self, rows: Sequence[int]) -> "RolloutResult":
        """The given sample rows (per-sample fields indexed, metadata shared)."""
        rows = list(rows)
        index = torch.as_tensor(rows, dtype=torch.long)
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return RolloutResult(
            images=pick(self.images), latents_clean=pick(self.latents_clean), prompt_embeds=pick(self.prompt_embeds),
            prompt_mask=pick(self.prompt_mask), seeds=[self.seeds[r] for r in rows], metadata=self.metadata,
            window_starts=None if self.window_starts is None else [self.window_starts[r] for r in rows],
            negative_embeds=pick(self.negative_embeds), negative_mask=pick(self.negative_mask),
            ref_latents=pick(self.ref_latents), all_latents=pick(self.all_latents),
            all_timesteps=pick(self.all_timesteps), all_log_probs=pick(self.all_log_probs),
        )

    def conditioning(self, device: torch.device | str) -> "Conditioning":
        """The prompt / negative embeddings and reference latents the samples were generated with, on `device`:
        what the trainer's forwards condition on (so they reproduce the rollout's velocities)."""
        from models.base import Conditioning, PromptEmbeds

        negative = None if self.negative_embeds is None else PromptEmbeds(self.negative_embeds, self.negative_mask)
        return Conditioning(PromptEmbeds(self.prompt_embeds, self.prompt_mask), negative, self.ref_latents).to(device)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (no copies), for the process boundary: `from_dict` rebuilds it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RolloutResult":
        """Build from a plain dict; unknown keys are an error (a peer of another layout must not half-parse)."""
        _check_keys(cls, data, "rollout result")
        return cls(**data)

    @staticmethod
    def cat(parts: Sequence["RolloutResult"]) -> "RolloutResult":
        """Concatenate along the batch; prompt embeddings are right-padded to the longest part."""
        if not parts:
            raise ValueError("RolloutResult.cat needs at least one part")

        def cat_tensor(name: str) -> torch.Tensor | None:
            values = [getattr(p, name) for p in parts]
            if all(v is None for v in values):
                return None
            if any(v is None for v in values):
                raise ValueError(f"cannot concatenate rollout parts where only some carry {name}")
            return torch.cat(values)

        def cat_padded(embeds_name: str, mask_name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            embeds = [getattr(p, embeds_name) for p in parts]
            masks = [getattr(p, mask_name) for p in parts]
            if all(e is None for e in embeds):
                return None, None
            joined = PromptEmbeds.cat([PromptEmbeds(e, m) for e, m in zip(embeds, masks)])
            return joined.embeds, joined.mask

        metadata = dict(parts[0].metadata)
        for p in parts[1:]:
            for key in ("family", "height", "width", "num_inference_steps", "adapter_version"):
                if p.metadata.get(key) != metadata.get(key):
                    raise ValueError(f"rollout parts disagree on {key}: {p.metadata.get(key)} vs {metadata.get(key)}")
        prompt_embeds, prompt_mask = cat_padded("prompt_embeds", "prompt_mask")
        negative_embeds, negative_mask = cat_padded("negative_embeds", "negative_mask")
        return RolloutResult(
            images=cat_tensor("images"), latents_clean=cat_tensor("latents_clean"), prompt_embeds=prompt_embeds,
            prompt_mask=prompt_mask, seeds=[s for p in parts for s in p.seeds], metadata=metadata,
            window_starts=None if parts[0].window_starts is None else [s for p in parts for s in p.window_starts],
            negative_embeds=negative_embeds, negative_mask=negative_mask, ref_latents=cat_tensor("ref_latents"),
            all_latents=cat_tensor("all_latents"), all_timesteps=cat_tensor("all_timesteps"),
            all_log_probs=cat_tensor("all_log_probs"),
        )


# ---------------------------------------------------------------------------------------------------------
# The native engine
# ---------------------------------------------------------------------------------------------------------


def _image_key(image: Any) -> str:
    if image is None:
        return ""
    if isinstance(image, torch.Tensor):
        return hashlib.sha1(image.contiguous().cpu().numpy().tobytes()).hexdigest()
    return hashlib.sha1(image.tobytes()).hexdigest()


class NativeEngine:
    """Generates with diffusers/torch through the `models/` wrappers. One engine per device.

    The engine owns the base weights plus one LoRA slot; `load_adapter` replaces the adapter with the tensors of a
    PEFT directory (trainer or vllm-omni names) and returns how many modules they bound to.
    """

    name = "native"

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_batch_size: int = 8, cfg_batch: bool = False, **model_kwargs: Any) -> None:
        from models import load_model

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        # cfg_batch: CFG as one transformer forward over [cond ; uncond] (FlowModel.guided_velocity); the trainer's
        # replay must use the same mode (it is reported in every result's metadata as "cfg_batch").
        self.model = load_model(model_path, device=device, dtype=dtype, cfg_batch=cfg_batch, **model_kwargs)
        self.model.transformer.requires_grad_(False)
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.adapter_version: str | None = None
        self.bound_modules = 0

    # ---- LoRA -------------------------------------------------------------------------------------------------
    def load_adapter(self, adapter_dir: str, version: str) -> int:
        """Load a PEFT adapter directory (either name form); fail if any tensor binds to nothing."""
        from models import lora

        self.bound_modules = lora.load_adapter(self.model, adapter_dir)
        self.adapter_version = version
        return self.bound_modules

    # ---- generation -------------------------------------------------------------------------------------------
    def _encode(self, prompts: Sequence[Any], images: Sequence[Any] | None):
        """Encode each distinct (prompt, image) once, then index the rows back (groups repeat prompts n times)."""
        keys, unique, unique_images, rows = {}, [], [], []
        for i, p in enumerate(prompts):
            image = None if images is None else images[i]
            key = json.dumps(p, sort_keys=True) + "|" + _image_key(image)
            if key not in keys:
                keys[key] = len(unique)
                unique.append(p)
                unique_images.append(image)
            rows.append(keys[key])
        embeds = self.model.encode_prompt(unique, images=unique_images if images is not None else None)
        return embeds.index(rows)

    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> RolloutResult:
        request.validate()
        parts = []
        for start in range(0, len(request), self.max_batch_size):
            rows = list(range(start, min(start + self.max_batch_size, len(request))))
            parts.append(self._generate_chunk(request.select(rows)))
        return RolloutResult.cat(parts)

    def _generate_chunk(self, request: RolloutRequest) -> RolloutResult:
        model, n = self.model, len(request)
        height, width, steps = request.height, request.width, request.num_inference_steps
        model.validate_size(height, width)
        scale = self.model.resolve_guidance(request.guidance_scale, request.true_cfg_scale)
        guided = scale > 1.0
        if guided and request.negative_prompts is None:
            raise ValueError(
                f"{model.family}: guidance scale {scale} > 1 needs negative prompts (one per sample); pass "
                "negative_prompts or set the scale to 1.0 to disable CFG"
            )
        edit = request.images is not None and any(im is not None for im in request.images)
        generators = [torch.Generator(device=request.generator_device).manual_seed(int(s)) for s in request.seeds]

        prompt = self._encode(request.prompts, request.images if edit else None)
        # the edit negative is text-only: the reference image enters the negative pass as latents only
        negative = self._encode(request.negative_prompts, None) if guided else None
        latents = model.prepare_noise(height, width, generators).to(self.device)
        ref_latents = model.encode_reference(request.images, generators) if edit else None

        sigmas = model.schedule(steps, height, width).to(self.device)
        stochastic = request.noise_level > 0
        starts = sde_window_starts(steps, request.sde_window_size, request.sde_window_range, generators) \
            if stochastic else [steps] * n
        width_w = window_length(steps, request.sde_window_size) if stochastic else 0
        keep_trajectory = stochastic and request.return_trajectory
        velocity_fn = lambda x, sigma: model.guided_velocity(  # noqa: E731
            x, sigma, prompt, negative, scale, ref_latents, height=height, width=width)
        latents, all_latents, all_timesteps, all_log_probs = rl_denoise(
            velocity_fn, latents, sigmas, generators, starts, width_w, noise_level=request.noise_level,
            sde_type=request.sde_type, keep_trajectory=keep_trajectory, keep_log_probs=request.return_log_probs)

        images = model.decode(latents, height=height, width=width).cpu()
        metadata = {
            "engine": self.name,
            "family": model.family,
            "height": height,
            "width": width,
            "num_inference_steps": steps,
            "sigmas": sigmas.cpu(),
            "guidance": scale,
            "cfg_batch": model.cfg_batch,
            "noise_level": request.noise_level,
            "sde_type": request.sde_type,
            "window_size": width_w,
            "adapter_version": self.adapter_version,
            "bound_modules": self.bound_modules,
            "generator_device": request.generator_device,
        }
        result = RolloutResult(
            images=images, latents_clean=latents.float().cpu(), prompt_embeds=prompt.embeds.cpu(),
            prompt_mask=prompt.mask.cpu(), seeds=list(request.seeds), metadata=metadata,
            window_starts=starts if stochastic else None,
            negative_embeds=None if negative is None else negative.embeds.cpu(),
            negative_mask=None if negative is None else negative.mask.cpu(),
            ref_latents=None if ref_latents is None else ref_latents.float().cpu(),
        )
        if keep_trajectory:
            result.all_latents = torch.stack([torch.stack(rows) for rows in all_latents])
            result.all_timesteps = torch.stack([torch.stack(rows) for rows in all_timesteps])
        if request.return_log_probs:
            result.all_log_probs = torch.stack([torch.stack(rows) for rows in all_log_probs])
        return result


# ---------------------------------------------------------------------------------------------------------
# The vllm-omni engine (vllm-omni 0.30; imported lazily, only here). Custom pipelines: vllm_omni_pipelines.py
# ---------------------------------------------------------------------------------------------------------

# RL knobs carried in OmniDiffusionSamplingParams.extra_args, with the pipeline-side defaults.
VLLM_OMNI_RL_KEYS: dict[str, Any] = {
    "rl_noise_level": 0.0,
    "rl_sde_type": "sde",
    "rl_sde_window_size": None,
    "rl_sde_window_range": None,
    "rl_return_log_probs": False,
    "rl_return_trajectory": False,
}
VLLM_OMNI_PIPELINES = {
    "qwen_image": "vllm_omni_pipelines.RLQwenImagePipeline",
    "boogu_image": "vllm_omni_pipelines.RLBooguImagePipeline",
}
VLLM_OMNI_WORKER_EXTENSION = "vllm_omni_pipelines.RLWorkerExtension"


def vllm_omni_text(family: str, prompt: Any) -> str:
    """The text prompt the stock vllm-omni encoders take for one of our prompts.

    A str passes through. A chat-message list is accepted only where it is exactly what the stock encoder builds
    from a string: Qwen [Qwen-Image system, user] (checked by `models.qwen_image.render_prompt`); Boogu
    [system = the released rule's prompt for the user text, user without "<image>"]. Anything else raises, since
    the vllm-omni encoders cannot take arbitrary message lists.
    """
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, (list, tuple)) or len(prompt) != 2 or not all(isinstance(m, dict) for m in prompt):
        raise ValueError(f"a prompt must be a str or a [system, user] message list, got {prompt!r:.200}")
    system, user = prompt
    if system.get("role") != "system" or user.get("role") != "user" or not isinstance(user.get("content"), str):
        raise ValueError(f"message prompts must be [system, user] with string content, got {prompt!r:.200}")
    text = user["content"]
    if family == "qwen_image":
        from models.qwen_image import render_prompt

        render_prompt(list(prompt))  # raises unless the system turn is Qwen-Image's own
        return text
    from models.boogu_image import IMAGE_PLACEHOLDER, boogu_system_prompt

    has_image = text.startswith(IMAGE_PLACEHOLDER)
    if has_image:
        text = text[len(IMAGE_PLACEHOLDER):]
    if system.get("content") != boogu_system_prompt(text, has_image) or IMAGE_PLACEHOLDER in text:
        raise ValueError("the vllm_omni engine takes Boogu message prompts only when they equal the released "
                         "[system, user] layout (system prompt by the T2I/TI2I rule, at most one leading <image>); "
                         "use --rollout_engine native for custom system prompts")
    return text


def vllm_omni_prompt(family: str, request: RolloutRequest, row: int) -> dict[str, Any]:
    """The OmniTextPrompt dict of sample `row`: prompt, negative_prompt (when given), and for Boogu edit the
    reference image as `multi_modal_data` (PIL; the stock pre-process resizes it)."""
    out: dict[str, Any] = {"prompt": vllm_omni_text(family, request.prompts[row])}
    if request.negative_prompts is not None:
        out["negative_prompt"] = vllm_omni_text(family, request.negative_prompts[row])
    image = None if request.images is None else request.images[row]
    if image is not None:
        if family != "boogu_image":
            raise ValueError("reference images are only supported for Boogu-Image edit")
        if isinstance(image, torch.Tensor):
            import PIL.Image

            image = PIL.Image.fromarray(image.permute(1, 2, 0).contiguous().cpu().numpy())
        if (image.height, image.width) != (request.height, request.width):
            raise ValueError(
                f"reference image {image.width}x{image.height} != requested {request.width}x{request.height}: "
                "vllm-omni's Boogu pre-process sets the output size from the reference (align_res), so the "
                "vllm_omni engine needs references already at the output size; resize them first"
            )
        out["multi_modal_data"] = {"image": image}
    return out


def vllm_omni_sampling_kwargs(family: str, request: RolloutRequest, row: int) -> dict[str, Any]:
    """Keyword arguments of sample `row`'s OmniDiffusionSamplingParams (without the LoRA request).

    One request per sample: `seed` is per request in vllm-omni, and `generator_device` is pinned so the noise
    equals the native engine's. Guidance goes to the family's knob (Boogu `guidance_scale`, Qwen `true_cfg_scale`,
    both explicit so vllm-omni's defaulting never decides); the SDE knobs ride in `extra_args`.
    """
    if family == "boogu_image":
        if request.true_cfg_scale is not None:
            raise ValueError("Boogu-Image is guided by guidance_scale, not true_cfg_scale (a Qwen-Image knob)")
        guidance = {"guidance_scale": 4.0 if request.guidance_scale is None else float(request.guidance_scale)}
    elif family == "qwen_image":
        if request.guidance_scale is not None:
            raise ValueError("Qwen-Image is guided by true_cfg_scale; guidance_scale is for guidance-distilled models")
        guidance = {"true_cfg_scale": 4.0 if request.true_cfg_scale is None else float(request.true_cfg_scale)}
    else:
        raise ValueError(f"unknown family {family!r}")
    scale = next(iter(guidance.values()))
    if scale > 1.0 and request.negative_prompts is None:
        raise ValueError(f"{family}: guidance scale {scale} > 1 needs negative prompts (one per sample); pass "
                         "negative_prompts or set the scale to 1.0 to disable CFG")
    extra = {
        "rl_noise_level": float(request.noise_level),
        "rl_sde_type": request.sde_type,
        "rl_sde_window_size": request.sde_window_size,
        "rl_sde_window_range": None if request.sde_window_range is None else list(request.sde_window_range),
        "rl_return_log_probs": bool(request.return_log_probs),
        "rl_return_trajectory": bool(request.return_trajectory),
    }
    return dict(height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
                seed=int(request.seeds[row]), generator_device=request.generator_device, num_outputs_per_prompt=1,
                output_type="pil", extra_args=extra, **guidance)


def image_to_uint8(image: Any) -> torch.Tensor:
    """A post-processed image (PIL, or a float tensor in [0, 1] (3, H, W) / (1, 3, H, W)) -> uint8 (3, H, W)."""
    if isinstance(image, torch.Tensor):
        image = image[0] if image.ndim == 4 else image
        if image.dtype == torch.uint8:
            return image.cpu()
        return (image.float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    import numpy as np

    array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def parse_vllm_omni_output(output: Any) -> dict[str, Any]:
    """One OmniRequestOutput of our RL pipeline -> per-sample fields (see vllm_omni_pipelines' docstring).

    Reads `.error`, `.images`, and the dict-valued `.trajectory_latents` / `.trajectory_log_probs` and the tensor
    `.trajectory_timesteps`. Never `.latents` (vllm-omni sets it to the trajectory, not the final latent)."""
    if getattr(output, "error", None):
        raise RuntimeError(f"vllm-omni request {getattr(output, 'request_id', '?')} failed: {output.error}")
    images = getattr(output, "images", None) or []
    if len(images) != 1:
        raise RuntimeError(f"vllm-omni request {getattr(output, 'request_id', '?')} returned {len(images)} images, "
                           "expected 1 (is the custom RL pipeline class loaded?)")
    lat, extra = output.trajectory_latents, output.trajectory_log_probs
    if not isinstance(lat, dict) or not isinstance(extra, dict) or "latents_clean" not in lat:
        raise RuntimeError("vllm-omni output lacks the RL fields (trajectory_latents must be the RL pipeline's dict); "
                           f"the engine must run {sorted(VLLM_OMNI_PIPELINES.values())}")
    return {
        "image": image_to_uint8(images[0]),
        "latents_clean": lat["latents_clean"].float().cpu(),
        "all_latents": None if "all_latents" not in lat else lat["all_latents"].float().cpu(),
        "ref_latents": None if "ref_latents" not in lat else lat["ref_latents"].float().cpu(),
        "all_timesteps": None if output.trajectory_timesteps is None else output.trajectory_timesteps.float().cpu(),
        "all_log_probs": None if "all_log_probs" not in extra else extra["all_log_probs"].float().cpu(),
        "prompt_embeds": extra["prompt_embeds"].cpu(),
        "prompt_mask": extra["prompt_mask"].to(torch.int64).cpu(),
        "negative_embeds": extra["negative_embeds"].cpu() if "negative_embeds" in extra else None,
        "negative_mask": extra["negative_mask"].to(torch.int64).cpu() if "negative_mask" in extra else None,
        "sigmas": extra["sigmas"].float().cpu(),
        "window_start": int(extra["window_start"]),
        "guidance": float(extra["guidance"]),
    }


def assemble_vllm_omni_result(parts: Sequence[dict[str, Any]], request: RolloutRequest, *, family: str,
                              adapter_version: str | None, bound_modules: int) -> RolloutResult:
    """Per-sample parsed outputs (request order) -> a RolloutResult like the native engine's."""
    if len(parts) != len(request):
        raise RuntimeError(f"got {len(parts)} vllm-omni outputs for {len(request)} samples")
    steps = request.num_inference_steps
    stochastic = request.noise_level > 0
    width_w = window_length(steps, request.sde_window_size) if stochastic else 0

    def stack(name: str, needed: bool) -> torch.Tensor | None:
        values = [p[name] for p in parts]
        if not needed:
            return None
        if any(v is None for v in values):
            raise RuntimeError(f"vllm-omni outputs lack {name} (the request asked for it)")
        return torch.stack(values)

    def padded(name: str, mask_name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if parts[0][name] is None:
            return None, None
        joined = PromptEmbeds.cat([PromptEmbeds(p[name][None], p[mask_name][None]) for p in parts])
        return joined.embeds, joined.mask

    for p in parts[1:]:
        if not torch.equal(p["sigmas"], parts[0]["sigmas"]):
            raise RuntimeError("vllm-omni samples of one request used different sigma schedules")
    prompt_embeds, prompt_mask = padded("prompt_embeds", "prompt_mask")
    negative_embeds, negative_mask = padded("negative_embeds", "negative_mask")
    keep_trajectory = stochastic and request.return_trajectory
    metadata = {
        "engine": VllmOmniEngine.name, "family": family, "height": request.height, "width": request.width,
        "num_inference_steps": steps, "sigmas": parts[0]["sigmas"], "guidance": parts[0]["guidance"],
        "noise_level": request.noise_level, "sde_type": request.sde_type, "window_size": width_w,
        "adapter_version": adapter_version, "bound_modules": bound_modules,
        "generator_device": request.generator_device,
    }
    edit = request.images is not None and any(im is not None for im in request.images)
    return RolloutResult(
        images=torch.stack([p["image"] for p in parts]), latents_clean=stack("latents_clean", True),
        prompt_embeds=prompt_embeds, prompt_mask=prompt_mask, seeds=list(request.seeds), metadata=metadata,
        window_starts=[p["window_start"] for p in parts] if stochastic else None,
        negative_embeds=negative_embeds, negative_mask=negative_mask, ref_latents=stack("ref_latents", edit),
        all_latents=stack("all_latents", keep_trajectory), all_timesteps=stack("all_timesteps", keep_trajectory),
        all_log_probs=stack("all_log_probs", stochastic and request.return_log_probs),
    )


def write_engine_adapter(adapter_dir: str, out_dir: str) -> int:
    """Copy a PEFT adapter directory (trainer or vllm-omni names) to `out_dir` with vllm-omni module names (keys
    `base_model.model.<engine path>.lora_{A,B}.weight`, translated `target_modules`), atomically, through
    `models.lora.write_adapter_dir`. Returns the number of modules."""
    from models import lora

    config, modules = lora.read_adapter(adapter_dir)  # keys back in trainer names, whichever form the file had
    half = sorted(p for p, ab in modules.items() if set(ab) != {"A", "B"})
    if half:
        raise ValueError(f"{adapter_dir}: modules {half[:6]} lack lora_A or lora_B (both are required)")
    targets = config.get("target_modules")
    if not isinstance(targets, (list, tuple)):
        raise ValueError(f"{adapter_dir}: target_modules must be a list of module names, got {targets!r}")
    config = dict(config, target_modules=lora.from_engine_targets(targets))
    tensors = {f"{path}.lora_{x}.weight": ab[x] for path, ab in modules.items() for x in ("A", "B")}
    lora.write_adapter_dir(tensors, config, out_dir, engine_names=True, key_prefix="base_model.model.")
    return len(modules)


def rpc_bound_counts(replies: Any) -> list[int]:
    """The per-worker bound-module counts in an `AsyncOmni.collective_rpc("rl_bind_adapter")` reply (nested per
    stage / per worker). An error or TODO dict from any replica raises."""
    if isinstance(replies, bool):
        raise RuntimeError(f"rl_bind_adapter answered {replies!r}, expected a module count")
    if isinstance(replies, int):
        return [replies]
    if isinstance(replies, dict):
        raise RuntimeError(f"rl_bind_adapter failed on a replica: {replies}")
    if isinstance(replies, (list, tuple)):
        return [c for r in replies for c in rpc_bound_counts(r)]
    raise RuntimeError(f"rl_bind_adapter answered {replies!r}, expected a module count")


def import_vllm_omni() -> Any:
    """vllm_omni, or a clear error naming the fix."""
    try:
        import vllm_omni  # noqa: F401
        from vllm_omni.entrypoints.async_omni import AsyncOmni  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"the vllm_omni rollout engine needs vllm-omni 0.30 and vLLM 0.30 installed on the rollout machine "
            f"(pip install vllm==0.30.0 vllm-omni==0.30.0, a CUDA GPU); import failed: {e}. "
            "Use --rollout_engine native (the default) otherwise"
        ) from e
    return vllm_omni


class VllmOmniEngine:
    """`AsyncOmni` with our custom RL pipeline class; same interface as `NativeEngine`.

    One vllm-omni request per sample (per-sample seeds), submitted concurrently so the engine batches them
    (`max_num_seqs=max_batch_size`). LoRA: `load_adapter` writes a vllm-omni-named copy of the PEFT directory,
    registers it with a NEW `LoRARequest` id per version, runs vllm-omni's fail-closed bind check at once through
    the worker extension (`RLWorkerExtension.rl_bind_adapter`) and attaches the request to every later sample.
    """

    name = "vllm_omni"

    def __init__(self, model_path: str, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 max_batch_size: int = 8, cfg_batch: bool = False, **engine_kwargs: Any) -> None:
        import asyncio

        if cfg_batch:  # the RL pipelines run the two CFG branches sequentially; the replay must match the rollout
            raise ValueError("the vllm_omni engine runs CFG as two sequential forwards; drop --cfg_batch so the "
                             "trainer's replay uses the same CFG mode as the rollout")
        import_vllm_omni()
        from vllm_omni.entrypoints.async_omni import AsyncOmni

        if not str(device).startswith("cuda"):
            raise ValueError(f"the vllm_omni engine runs on CUDA GPUs only, got device={device!r}; use the native "
                             "engine on CPU")
        if not torch.cuda.is_available():  # fail here, plainly, not deep inside AsyncOmni's stage start-up
            raise RuntimeError(f"vllm_omni needs CUDA: torch {torch.__version__} in {sys.executable} sees no CUDA GPU "
                               f"(device={device!r}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                               "run the rollout workers on a GPU node or use --rollout_engine native")
        from models import model_family

        self.family = model_family(model_path)
        self.model_path = model_path
        self.adapter_version: str | None = None
        self.bound_modules = 0
        self._lora_request: Any = None
        self._next_lora_id = 1
        self._adapter_root = tempfile.mkdtemp(prefix="vllm-omni-adapters-")
        repo = os.path.dirname(os.path.abspath(__file__))  # workers import vllm_omni_pipelines by dotted path
        os.environ["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        kwargs = dict(
            model=model_path, dtype=str(dtype).replace("torch.", ""), max_num_seqs=max_batch_size,
            custom_pipeline_args={"pipeline_class": VLLM_OMNI_PIPELINES[self.family]},
            worker_extension_cls=VLLM_OMNI_WORKER_EXTENSION, max_cpu_loras=2,
        )
        kwargs.update(engine_kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-omni-loop", daemon=True)
        self._thread.start()

        async def build():
            return AsyncOmni(**kwargs)

        self.omni = self._run(build())
        import atexit

        atexit.register(self.close)  # the worker process exits by returning: stop vllm-omni's stage processes

    def _run(self, coroutine: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # ---- LoRA -------------------------------------------------------------------------------------------------
    def load_adapter(self, adapter_dir: str, version: str) -> int:
        """Register the adapter (vllm-omni names, new int id), bind it now (fail closed), return the bound count."""
        from vllm.lora.request import LoRARequest

        lora_id = self._next_lora_id
        engine_dir = os.path.join(self._adapter_root, f"{lora_id:06d}-{version}")
        expected = write_engine_adapter(adapter_dir, engine_dir)
        request = LoRARequest(lora_name=f"{version}#{lora_id}", lora_int_id=lora_id, lora_path=engine_dir)
        self._next_lora_id += 1

        async def register():
            if not await self.omni.add_lora(request):
                raise RuntimeError(f"vllm-omni did not load LoRA adapter {engine_dir} (add_lora returned False)")
            return await self.omni.collective_rpc("rl_bind_adapter", args=(request,))

        try:
            replies = self._run(register())
            counts = rpc_bound_counts(replies)
            if not counts or set(counts) != {expected}:
                raise RuntimeError(f"vllm-omni bound {counts} modules per worker, the file has {expected}")
        except Exception as e:
            try:  # do not leave the rejected adapter cached in the workers
                self._run(self.omni.remove_lora(lora_id))
            except Exception:
                pass
            shutil.rmtree(engine_dir, ignore_errors=True)
            raise RuntimeError(f"vllm-omni rejected adapter {adapter_dir} (version {version}): {e}. Its module names "
                               "must bind to the pipeline's LoRA layers (vllm-omni's fail-closed bind check)") from e
        if self._lora_request is not None:  # the previous version: out of the workers and off the disk
            self._run(self.omni.remove_lora(self._lora_request.lora_int_id))
            shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
        self._lora_request, self.adapter_version, self.bound_modules = request, version, counts[0]
        return self.bound_modules

    # ---- generation -------------------------------------------------------------------------------------------
    def build_requests(self, request: RolloutRequest) -> list[tuple[dict[str, Any], Any]]:
        """(prompt dict, OmniDiffusionSamplingParams) per sample, with the current LoRA request attached."""
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        return [(vllm_omni_prompt(self.family, request, b),
                 OmniDiffusionSamplingParams(lora_request=self._lora_request,
                                             **vllm_omni_sampling_kwargs(self.family, request, b)))
                for b in range(len(request))]

    def generate(self, request: RolloutRequest) -> RolloutResult:
        import asyncio
        import uuid

        request.validate()
        pairs = self.build_requests(request)
        tag = uuid.uuid4().hex[:8]

        async def one(b: int, prompt: dict, params: Any) -> Any:
            final = None
            async for out in self.omni.generate(prompt, request_id=f"rl-{tag}-{b}", sampling_params_list=[params]):
                final = out
            if final is None:
                raise RuntimeError(f"vllm-omni returned nothing for sample {b}")
            return final

        async def run_all():
            return await asyncio.gather(*(one(b, p, sp) for b, (p, sp) in enumerate(pairs)))

        outputs = self._run(run_all())
        parts = [parse_vllm_omni_output(o) for o in outputs]
        return assemble_vllm_omni_result(parts, request, family=self.family, adapter_version=self.adapter_version,
                                         bound_modules=self.bound_modules)

    def close(self) -> None:
        """Shut vllm-omni down (its stage processes and workers); idempotent."""
        omni, self.omni = getattr(self, "omni", None), None
        if omni is not None:
            omni.shutdown()
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if getattr(self, "_adapter_root", None):
            shutil.rmtree(self._adapter_root, ignore_errors=True)


def build_engine(engine: str, model_path: str, **kwargs: Any):
    """The engine named `engine` ("native" or "vllm_omni")."""
    if engine == "native":
        return NativeEngine(model_path, **kwargs)
    if engine == "vllm_omni":
        return VllmOmniEngine(model_path, **kwargs)
    raise ValueError(f"unknown rollout engine {engine!r}; choose from {ENGINES}")


# ---------------------------------------------------------------------------------------------------------
# Worker processes: length-prefixed messages over stdin/stdout, holding plain tensors and built-in types only
# ---------------------------------------------------------------------------------------------------------

# The trainer and its workers may run different Python environments (--rollout_python: e.g. vllm-omni's own torch
# 2.13 stack beside the trainer's torch 2.14), so every message is version-neutral: CPU tensors, None, bool, int,
# float, str, and lists / tuples / str-keyed dicts of those, written by torch.save and read back with
# torch.load(weights_only=True) (no pickled classes, so no import of the sender's code on the receiver), then
# checked again. Bump PROTOCOL_VERSION whenever a message's layout or meaning changes: the start-up handshake
# refuses a peer that speaks another version.
PROTOCOL_VERSION = 1
_MAGIC = b"FRLW"
_HEADER = struct.Struct("<4sQ")  # magic, payload length
_PLAIN_SCALARS = (type(None), bool, int, float, str)


class ProtocolError(RuntimeError):
    """A message that is not plain data (refused whole; the channel stays in step)."""


class ChannelBroken(ProtocolError):
    """Bytes that are not a frame of this protocol (the channel is out of step and must be closed)."""


def check_plain(value: Any, path: str = "message") -> None:
    """Raise `ProtocolError` naming the first value (by its path) that is not plain data.

    Plain: None, bool, int, float, str (exact types: numpy scalars, enums and other subclasses are refused), dense
    CPU `torch.Tensor`s (exact type: no Parameters or subclasses), and list / tuple / dict (str keys) of plain values.
    """
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return
    if kind is torch.Tensor:
        if value.device.type != "cpu" or value.layout != torch.strided:
            raise ProtocolError(f"{path}: only dense CPU tensors cross the rollout channel, got a {value.layout} "
                                f"tensor on {value.device}")
        return
    if kind in (list, tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{path}[{i}]")
        return
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise ProtocolError(f"{path}: dict keys must be str, got {type(key).__name__} {key!r:.60}")
            check_plain(item, f"{path}[{key!r}]")
        return
    raise ProtocolError(f"{path}: {kind.__module__}.{kind.__qualname__} cannot cross the rollout channel (plain "
                        "tensors, None, bool, int, float, str, list, tuple and str-keyed dict only; convert it, "
                        "e.g. a PIL image to a uint8 (3, H, W) tensor, a numpy value to a tensor or a Python number)")


def _send(stream, message: Any) -> None:
    """Write one message (refused with `ProtocolError` before anything is written unless it is plain data)."""
    check_plain(message)
    buffer = io.BytesIO()
    torch.save(message, buffer)
    payload = buffer.getvalue()
    stream.write(_HEADER.pack(_MAGIC, len(payload)))
    stream.write(payload)
    stream.flush()


def _read_exact(stream, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            raise EOFError("the peer closed the channel")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _recv(stream) -> Any:
    """One message; works on buffered and raw (short-reading) streams.

    The payload is read with `torch.load(weights_only=True)` (no arbitrary classes are ever unpickled) and then
    checked by `check_plain` (weights_only also admits e.g. OrderedDict, torch.Size, dtypes, Parameters): anything
    else raises `ProtocolError` after the whole frame was consumed, so the channel stays usable."""
    magic, length = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    if magic != _MAGIC:
        raise ChannelBroken(f"the peer sent bytes that are not a rollout-channel frame (magic {magic!r}, expected "
                            f"{_MAGIC!r}): something else wrote to the channel, or the peer is not a flowrl rollout "
                            "worker")
    payload = _read_exact(stream, length)
    try:
        message = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as e:  # pickle.UnpicklingError for a forbidden global; anything else is a corrupt payload
        text = str(e)
        reason = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else text
        reason = reason.strip().split(" was not an allowed global")[0]  # "Unsupported global: GLOBAL numpy...."
        raise ProtocolError(f"refused a message that is not plain tensors / built-in types "
                            f"({type(e).__name__}: {reason[:300]})") from None
    check_plain(message, "received message")
    return message


def _distribution_version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def peer_info() -> dict[str, Any]:
    """This side's handshake: protocol version, interpreter, and the versions of the libraries a worker uses
    (read from the installed distributions, nothing is imported)."""
    import platform

    info: dict[str, Any] = {"protocol": PROTOCOL_VERSION, "executable": sys.executable,
                            "python": platform.python_version(), "torch": str(torch.__version__)}
    for name in ("diffusers", "transformers", "peft", "vllm", "vllm-omni"):
        info[name] = _distribution_version(name)
    return info


def _describe(info: dict[str, Any]) -> str:
    return (f"rollout protocol {info.get('protocol')!r} (python {info.get('python')}, torch {info.get('torch')}, "
            f"{info.get('executable')})")


def handshake_error(ours: dict[str, Any], theirs: Any, *, peer: str) -> str | None:
    """Why a peer's handshake is unacceptable, or None. `peer` names the other side ("the rollout worker")."""
    if type(theirs) is not dict or theirs.get("op") != "hello" or "protocol" not in theirs:
        return (f"{peer} did not open with a protocol handshake (it runs an older or foreign rollout.py); this side "
                f"speaks {_describe(ours)}: run the same flowrl checkout on both sides")
    if theirs["protocol"] != ours["protocol"]:
        return (f"{peer} speaks {_describe(theirs)}, this side speaks {_describe(ours)}: incompatible message "
                "formats; run the same flowrl checkout on both sides")
    return None


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (no orphans even if the trainer is
    SIGKILLed); elsewhere the worker still exits on EOF of its stdin."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _private_stdout():
    """The channel: a private copy of fd 1, with fd 1 itself (and sys.stdout) pointed at stderr, so nothing a
    library prints, from Python or C, or from a child process it starts, can corrupt the message stream."""
    channel = os.fdopen(os.dup(1), "wb")  # os.dup's fd is not inherited by child processes
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


PROBE_MARKER = "FLOWRL_ROLLOUT_PROBE "


def _import_engine(engine: str) -> None:
    """Import everything the engine's worker needs (ImportError / RuntimeError naming the package otherwise)."""
    if engine == "native":
        import diffusers  # noqa: F401
        import peft  # noqa: F401
        import safetensors.torch  # noqa: F401
        import transformers  # noqa: F401

        import models.boogu_image  # noqa: F401  (what NativeEngine's model loading imports)
        import models.lora  # noqa: F401
        import models.qwen_image  # noqa: F401
    elif engine == "vllm_omni":
        import_vllm_omni()
        from vllm.lora.request import LoRARequest  # noqa: F401

        import vllm_omni_pipelines  # noqa: F401  (the custom RL pipelines the engine loads by dotted path)
    else:
        raise ValueError(f"unknown rollout engine {engine!r}; choose from {ENGINES}")


def probe_main(engine: str) -> None:
    """`python rollout.py --probe --engine E`: import what engine E needs in THIS interpreter, then print one line
    `PROBE_MARKER + json(peer_info())` on the real stdout. An import failure exits non-zero with its traceback
    on stderr. Loads no model."""
    channel = _private_stdout()
    _import_engine(engine)
    channel.write((PROBE_MARKER + json.dumps(dict(peer_info(), engine=engine)) + "\n").encode())
    channel.flush()


class RolloutEnvError(RuntimeError):
    """--rollout_python cannot run the rollout workers (raised before any model is loaded)."""


def _worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker / probe process: ours plus `extra`, with this repository first on PYTHONPATH."""
    env = dict(os.environ, **(extra or {}))
    repo = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def check_rollout_python(python: str | None, engine: str, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """The --rollout_python start-up check (model-free; run it before any model is loaded).

    Runs `python rollout.py --probe --engine <engine>`: the interpreter must exist and run, import this
    repository's rollout module and the engine's libraries (native: torch, diffusers, transformers, peft and
    `models/`; vllm_omni: vllm-omni, vLLM and `vllm_omni_pipelines`), and speak our protocol version. Returns its
    `peer_info()` (python / torch / diffusers / transformers / peft / vllm / vllm-omni versions, the resolved
    interpreter) for run_metadata.json; raises `RolloutEnvError` naming --rollout_python and the fix otherwise.
    `python=None` means this interpreter: the native engine's imports are then checked in this process (the
    trainer imports the same packages anyway); vllm_omni is always probed in a subprocess."""
    if engine not in ENGINES:
        raise ValueError(f"unknown rollout engine {engine!r}; choose from {ENGINES}")
    if engine == "native" and python in (None, sys.executable):
        try:
            _import_engine(engine)
        except ImportError as e:
            raise RolloutEnvError(f"--rollout_python (this interpreter, {sys.executable}) cannot import the native "
                                  f"rollout engine: {e}; pip install -r requirements.txt") from e
        return dict(peer_info(), engine=engine)
    flag = f"--rollout_python {python}" if python else f"--rollout_python (default: this interpreter, {sys.executable})"
    path = python or sys.executable
    resolved = path if os.sep in path else shutil.which(path)
    fix = (f"pass the bin/python of an environment that has the {engine} engine's packages "
           + ("(pip install -r requirements.txt)" if engine == "native" else
              "(vllm-omni 0.30 + vLLM 0.30 + diffusers 0.40 + transformers<5.15 + peft; README: two environments)")
           + ", or leave the flag out to use the trainer's own interpreter")
    if not resolved or not os.path.isfile(resolved):
        raise RolloutEnvError(f"{flag}: no such file{'' if os.sep in path else ' on PATH'}; {fix}")
    if not os.access(resolved, os.X_OK):
        raise RolloutEnvError(f"{flag}: {resolved} is not executable; {fix}")
    command = [resolved, os.path.abspath(__file__), "--probe", "--engine", engine]
    try:
        proc = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s,
                              env=_worker_env())
    except subprocess.TimeoutExpired:
        raise RolloutEnvError(f"{flag}: importing the {engine} engine took over {timeout_s:.0f} s; {fix}") from None
    except OSError as e:  # e.g. not a program (exec format error), permission denied
        raise RolloutEnvError(f"{flag}: {resolved} could not be run ({e}); {fix}") from None
    lines = proc.stdout.decode(errors="replace").splitlines()
    found = [line[len(PROBE_MARKER):] for line in lines if line.startswith(PROBE_MARKER)]
    if proc.returncode != 0 or not found:
        tail = "\n".join(proc.stderr.decode(errors="replace").strip().splitlines()[-12:]) or "<no output>"
        raise RolloutEnvError(f"{flag} cannot run the {engine} rollout engine: `{' '.join(command)}` exited "
                              f"{proc.returncode}. Its stderr ends:\n{tail}\n{fix}")
    info = json.loads(found[-1])
    problem = handshake_error(peer_info(), dict(info, op="hello"), peer=f"the interpreter of {flag}")
    if problem:
        raise RolloutEnvError(problem)
    return info


def worker_main(argv: Sequence[str] | None = None) -> None:
    """Entry point of one rollout worker process (`python rollout.py --worker ...`)."""
    parser = argparse.ArgumentParser(description="rollout worker (started by RolloutGroup)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--engine", default="native", choices=ENGINES)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--cfg-batch", action="store_true",
                        help="run CFG as one transformer forward over [cond ; uncond] instead of two")
    args = parser.parse_args(argv)
    _die_with_parent()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    channel_in, channel_out = sys.stdin.buffer, _private_stdout()
    ours = peer_info()
    _send(channel_out, {"op": "hello", **ours})  # before any heavy import: a mismatch is refused within seconds
    try:
        problem = handshake_error(ours, _recv(channel_in), peer="the trainer")
    except EOFError:
        return
    except ProtocolError as e:
        problem = f"the trainer's handshake was refused: {e}"
    if problem:
        _send(channel_out, {"ok": False, "error": f"ProtocolError: {problem}", "traceback": ""})
        return
    try:
        engine = build_engine(args.engine, args.model_path, device=args.device, dtype=getattr(torch, args.dtype),
                              max_batch_size=args.max_batch_size, cfg_batch=args.cfg_batch)
        _send(channel_out, {"ok": True, "ready": True})
    except Exception as e:  # report the load failure to the parent, then exit
        _send(channel_out, {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return
    while True:
        try:
            message = _recv(channel_in)
        except (EOFError, ChannelBroken):
            return
        except ProtocolError as e:  # the frame was consumed: refuse it and stay in step
            _send(channel_out, {"ok": False, "error": f"ProtocolError: {e}", "traceback": ""})
            continue
        op = message.get("op") if type(message) is dict else None
        try:
            if op == "generate":
                result = engine.generate(RolloutRequest.from_dict(message["request"]))
                reply = {"ok": True, "result": result.to_dict()}
            elif op == "load_adapter":
                reply = {"ok": True, "bound_modules": engine.load_adapter(message["path"], message["version"])}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        try:
            _send(channel_out, reply)
        except ProtocolError as e:  # refused before a byte was written: report it instead of the reply
            _send(channel_out, {"ok": False, "error": f"ProtocolError: the worker's reply to {op!r}: {e}",
                                "traceback": ""})


class RolloutError(RuntimeError):
    """A rollout worker failed, died or hung; the message carries its stderr tail."""


@dataclass
class _Worker:
    index: int
    devices: str
    process: subprocess.Popen
    log_path: str

    def stderr_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "<no log>"


class RolloutGroup:
    """Rollout worker subprocesses, one per entry of `devices`.

    devices: e.g. ["cuda:3"] or ["cuda:2", "cuda:3"] (each worker then sees only its GPU through
    `CUDA_VISIBLE_DEVICES` and runs on cuda:0), or ["cpu", "cpu"] for tests. Requests are split into contiguous
    row blocks across workers and the results gathered in order. A worker that dies, fails or exceeds `timeout_s`
    stops the group with a `RolloutError` carrying its stderr tail; `close()` (also on Ctrl-C, at exit, or when the
    parent dies) leaves no process behind.
    """

    def __init__(self, model_path: str, devices: Sequence[str], *, engine: str = "native", dtype: str = "float32",
                 max_batch_size: int = 8, timeout_s: float = 1800.0, startup_timeout_s: float = 1800.0,
                 log_dir: str | None = None, threads_per_worker: int = 0, env: dict[str, str] | None = None,
                 cfg_batch: bool = False, python: str | None = None) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown rollout engine {engine!r}; choose from {ENGINES}")
        if not devices:
            raise ValueError("a rollout group needs at least one device")
        self.timeout_s = timeout_s
        self.workers: list[_Worker] = []
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="rollout-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        script = os.path.abspath(__file__)
        try:
            for index, device in enumerate(devices):
                worker_env = _worker_env(env)
                local_device = device
                if device.startswith("cuda"):
                    gpu_ids = device.split(":", 1)[1] if ":" in device else "0"
                    worker_env["CUDA_VISIBLE_DEVICES"] = gpu_ids
                    local_device = "cuda:0"
                log_path = os.path.join(self.log_dir, f"rollout-worker-{index}.log")
                log = open(log_path, "ab")
                command = [python or sys.executable, script, "--worker", "--engine", engine, "--model-path", model_path,
                           "--device", local_device, "--dtype", dtype, "--max-batch-size", str(max_batch_size),
                           "--threads", str(threads_per_worker)] + (["--cfg-batch"] if cfg_batch else [])
                # unbuffered: select() on the pipe then sees every byte the worker wrote
                process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                           env=worker_env, bufsize=0)
                log.close()
                self.workers.append(_Worker(index, device, process, log_path))
            ours = peer_info()
            for worker in self.workers:  # the handshake: both sides send theirs, each refuses an incompatible peer
                try:
                    _send(worker.process.stdin, {"op": "hello", **ours})
                except (BrokenPipeError, OSError):
                    raise self._fail(worker, "is gone (could not send the handshake)") from None
            for worker in self.workers:
                problem = handshake_error(ours, self._read(worker, startup_timeout_s, "the handshake"),
                                          peer=f"rollout worker {worker.index} ({worker.devices})")
                if problem:
                    self.close()
                    raise RolloutError(f"{problem} (the worker runs --rollout_python {python or sys.executable})")
            for worker in self.workers:
                reply = self._read(worker, startup_timeout_s, "start-up")
                if not reply.get("ok"):
                    raise RolloutError(f"rollout worker {worker.index} ({worker.devices}) failed to start: "
                                       f"{reply.get('error')}\n{reply.get('traceback', '')}")
        except BaseException:
            self.close()
            raise

    # ---- plumbing ---------------------------------------------------------------------------------------------
    def _fail(self, worker: _Worker, what: str) -> RolloutError:
        self.close()
        return RolloutError(
            f"rollout worker {worker.index} ({worker.devices}) {what}; stderr tail ({worker.log_path}):\n"
            f"{worker.stderr_tail()}"
        )

    def _read(self, worker: _Worker, timeout_s: float, what: str) -> dict:
        stdout = worker.process.stdout
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._fail(worker, f"did not answer within {timeout_s:.0f} s during {what}")
            ready, _, _ = select.select([stdout], [], [], min(remaining, 1.0))
            if ready:
                try:
                    return _recv(stdout)
                except EOFError:
                    code = worker.process.wait(timeout=10)
                    raise self._fail(worker, f"died during {what} (exit code {code})") from None
                except ProtocolError as e:
                    raise self._fail(worker, f"sent a message that was refused during {what}: {e}") from None
            if worker.process.poll() is not None:
                raise self._fail(worker, f"died during {what} (exit code {worker.process.returncode})")

    def _call_all(self, messages: list[dict], what: str) -> list[dict]:
        """Send one message per worker (they run in parallel), then collect every reply in worker order.

        A worker that dies or hangs closes the group. A worker that reports an error (e.g. a request that
        violates the contract) stays alive: all replies are drained first, then the first error is raised.
        """
        for worker, message in zip(self.workers, messages):
            try:
                _send(worker.process.stdin, message)
            except (BrokenPipeError, OSError):
                raise self._fail(worker, f"is gone (could not send {what})") from None
        replies = [self._read(worker, self.timeout_s, what) for worker in self.workers[: len(messages)]]
        for worker, reply in zip(self.workers, replies):
            if not reply.get("ok"):
                raise RolloutError(f"rollout worker {worker.index} ({worker.devices}) failed during {what}: "
                                   f"{reply.get('error')}\n{reply.get('traceback', '')}")
        return replies

    # ---- API --------------------------------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Split the request's rows into contiguous blocks, one per worker, and gather the results in order."""
        request.validate()
        if not self.workers:
            raise RolloutError("the rollout group is closed")
        n, k = len(request), min(len(self.workers), len(request))
        bounds = [round(i * n / k) for i in range(k + 1)]
        messages = [{"op": "generate", "request": request.select(range(bounds[i], bounds[i + 1])).to_dict()}
                    for i in range(k)]
        replies = self._call_all(messages, "generate")
        return RolloutResult.cat([RolloutResult.from_dict(r["result"]) for r in replies])

    def load_adapter(self, adapter_dir: str, version: str) -> list[int]:
        """Every worker loads the PEFT adapter directory; returns each worker's bound-module count."""
        replies = self._call_all([{"op": "load_adapter", "path": adapter_dir, "version": version}] * self.num_workers,
                                 "load_adapter")
        return [int(r["bound_modules"]) for r in replies]

    def close(self) -> None:
        """Stop every worker (politely, then SIGKILL); idempotent."""
        workers, self.workers = self.workers, []
        for worker in workers:
            try:
                worker.process.stdin.close()
            except OSError:
                pass
        for worker in workers:
            try:
                worker.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()

    def __enter__(self) -> "RolloutGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------------------
# Trainer side: one rollout group per node, driven by the node's local rank 0
# ---------------------------------------------------------------------------------------------------------


class DistributedRollout:
    """What every trainer rank uses. On each node, local rank 0 owns a `RolloutGroup` on that node's rollout GPUs;
    `generate` gathers the node's per-rank requests (over a gloo subgroup of the node's ranks), runs them as one
    request and scatters each rank its own rows back. Without torch.distributed it is a plain group.

    Multi-node layout: every node runs `torchrun --nproc_per_node=<trainer GPUs>` and reserves `devices` (e.g.
    `cuda:3`) for its own rollout workers; adapter directories must be on a filesystem all nodes see.
    """

    def __init__(self, model_path: str, devices: Sequence[str], **group_kwargs: Any) -> None:
        import torch.distributed as dist

        self.distributed = dist.is_available() and dist.is_initialized()
        self.node_group, self.node_root = None, 0
        local_rank = 0
        if self.distributed:
            world = dist.get_world_size()
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            if world % local_world:
                raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}")
            # every rank must create every node's subgroup (a collective), then keep its own
            self.node_group, _ = dist.new_subgroups(group_size=local_world, backend="gloo")
            self.node_root = dist.get_global_rank(self.node_group, 0)
            if world > local_world and group_kwargs.get("log_dir"):
                # nodes share the output directory: each node's workers log into their own folder
                group_kwargs["log_dir"] = os.path.join(group_kwargs["log_dir"], f"node{dist.get_rank() // local_world}")
        self.group, error = None, None
        if local_rank == 0:
            try:
                self.group = RolloutGroup(model_path, devices, **group_kwargs)
            except Exception as e:  # reported after every rank has heard of it, so no rank waits forever
                error = e
        self._check_started(error)

    def _check_started(self, error: Exception | None) -> None:
        """Every rank learns whether every node's group started (so none waits forever on a failed node)."""
        if self.distributed:
            import torch.distributed as dist

            flags: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(flags, error is None)
            if error is None and not all(flags):
                raise RolloutError("a node's rollout group failed to start (see that node's log)")
        if error is not None:
            raise error

    @property
    def is_driver(self) -> bool:
        return self.group is not None

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """This rank's rows of the node's combined request, in order. Collective over the node's ranks."""
        if not self.distributed:
            return self.group.generate(request)
        import torch.distributed as dist

        size = dist.get_world_size(self.node_group)
        gathered: list[Any] = [None] * size if self.is_driver else None
        dist.gather_object(request.to_dict(), gathered, dst=self.node_root, group=self.node_group)
        parts: list[Any] = [None] * size
        if self.is_driver:
            error, result, sizes = None, None, []
            try:
                requests = [RolloutRequest.from_dict(r) for r in gathered]
                sizes = [len(r) for r in requests]
                result = self.group.generate(RolloutRequest.concat(requests))
            except Exception as e:  # every rank of the node must hear about it, not hang in the scatter
                error = f"{type(e).__name__}: {e}"
            start = 0
            for i in range(size):
                if error:
                    parts[i] = {"error": error}
                else:
                    parts[i] = {"result": result.select(range(start, start + sizes[i])).to_dict()}
                    start += sizes[i]
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, parts if self.is_driver else None, src=self.node_root, group=self.node_group)
        if "error" in mine[0]:
            raise RolloutError(f"rollout failed on this node: {mine[0]['error']}")
        return RolloutResult(**mine[0]["result"])

    def load_adapter(self, adapter_dir: str, version: str) -> list[int]:
        """Every node's workers load the adapter; returns this node's per-worker bound-module counts on every rank
        of the node. Collective over the node's ranks."""
        counts: Any = None
        error = None
        if self.is_driver:
            try:
                counts = self.group.load_adapter(adapter_dir, version)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        if not self.distributed:
            if error:
                raise RolloutError(error)
            return counts
        import torch.distributed as dist

        box = [{"counts": counts, "error": error}]
        dist.broadcast_object_list(box, src=self.node_root, group=self.node_group)
        if box[0]["error"]:
            raise RolloutError(f"adapter {adapter_dir} could not be loaded by the rollout workers: {box[0]['error']}")
        return box[0]["counts"]

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


if __name__ == "__main__":
    if "--worker" in sys.argv:
        import rollout as _rollout  # run the module's own copy, not __main__'s, so its classes have one identity

        _rollout.worker_main()
    elif "--probe" in sys.argv:
        import rollout as _rollout

        _probe = argparse.ArgumentParser(description="rollout environment probe (see check_rollout_python)")
        _probe.add_argument("--probe", action="store_true")
        _probe.add_argument("--engine", default="native")
        _rollout.probe_main(_probe.parse_args().engine)
    else:
        sys.exit("rollout.py is started by the trainers' RolloutGroup (python rollout.py --worker ...) or its "
                 "start-up check (python rollout.py --probe --engine native|vllm_omni)")
