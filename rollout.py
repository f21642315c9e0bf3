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
import math
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
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

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
    window step; all_timesteps fp32 (B, W) scheduler timesteps 1000·σ (descending); all_means fp32 (B, W, ...) the
    transition mean of every window step (`losses.sde_step`'s prev_sample_mean). With return_log_probs:
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
    all_means: torch.Tensor | None = None

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
            all_means=pick(self.all_means),
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
            all_log_probs=cat_tensor("all_log_probs"), all_means=cat_tensor("all_means"),
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

    def load_adapter_tensors(self, message: dict[str, Any]) -> int:
        """The tensor sync (`load_adapter_tensors` op): bind the adapter tensors a trainer rank shares in memory
        (`AdapterBuffer`), with the same checks and copies as a PEFT directory (`models.lora.bind_adapter`)."""
        from models import lora

        source = message["source"]
        if source.get("kind") == "cuda_ipc" and message.get("torch_version") != str(torch.__version__):
            raise RuntimeError(f"CUDA IPC handles from torch {message.get('torch_version')} cannot be opened by this "
                               f"worker's torch {torch.__version__}; run trainer and workers with the same torch or "
                               "use --rollout_sync disk")
        flat = open_adapter_buffer(source, self.device)
        try:
            modules = unpack_adapter(flat, message["layout"])
            self.bound_modules = lora.load_adapter_tensors(self.model, message["config"], modules,
                                                           source=f"adapter tensors {message['version']}")
        finally:
            modules = flat = None  # the trainer frees its buffer once we answer: keep no view of it
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self.adapter_version = message["version"]
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

    def generate(self, request: RolloutRequest) -> RolloutResult:
        return RolloutResult.cat([part for _, part in self.generate_chunks(request)])

    @torch.no_grad()
    def generate_chunks(self, request: RolloutRequest) -> Iterator[tuple[int, RolloutResult]]:
        """(first row, result) of each chunk of `max_batch_size` rows, in order, as soon as it is sampled."""
        request.validate()
        for start in range(0, len(request), self.max_batch_size):
            rows = list(range(start, min(start + self.max_batch_size, len(request))))
            yield start, self._generate_chunk(request.select(rows))

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
        latents, all_latents, all_timesteps, all_log_probs, all_means = rl_denoise(
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
            result.all_means = torch.stack([torch.stack(rows) for rows in all_means])
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
        "all_means": None if "all_means" not in lat else lat["all_means"].float().cpu(),
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
        all_means=stack("all_means", keep_trajectory),
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
    bad = lora.nonfinite_tensors(tensors)
    if bad:  # vllm-omni binds what it is given: refuse here what bind_adapter refuses for the native engine
        raise ValueError(f"{adapter_dir}: {len(bad)} LoRA tensors hold NaN/inf (e.g. {bad[:3]}); refusing to hand "
                         f"a corrupt adapter to the engine")
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

    def generate_chunks(self, request: RolloutRequest) -> Iterator[tuple[int, RolloutResult]]:
        """The whole request as one chunk (vllm-omni batches its requests itself)."""
        yield 0, self.generate(request)

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
# Node layouts (which GPU each rollout worker uses) and adapter tensors handed over without a disk round trip
# ---------------------------------------------------------------------------------------------------------

COLOCATED = "colocated"
SYNC_MODES = ("auto", "tensors", "disk")


def gpu_index(device: str) -> int | None:
    """k for "cuda:k" ("cuda" = 0), None for any other device."""
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def visible_gpu(index: int, visible: str | None = None) -> str:
    """The CUDA_VISIBLE_DEVICES entry (a number, GPU UUID or MIG id) for the GPU that this process calls
    `cuda:<index>`: the index-th entry of this process's CUDA_VISIBLE_DEVICES (`visible`, default the environment's),
    or the index itself when none is set. So `--rollout_devices cuda:3` means the trainer's cuda:3, as in torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not 0 <= index < len(entries):
        raise ValueError(f"cuda:{index} is not visible to this process: CUDA_VISIBLE_DEVICES={visible!r} lists "
                         f"{len(entries)} GPU(s); name a rollout device among cuda:0..cuda:{len(entries) - 1}")
    return entries[index]


def worker_cuda_devices(device: str, ipc_source: int | None = None,
                        visible: str | None = None) -> tuple[str, int | None]:
    """(CUDA_VISIBLE_DEVICES of a worker on `device`, the worker's cuda index of the trainer GPU `ipc_source`).

    device: "cuda:k" (or "cuda:k,l" for a worker using several GPUs), k = this process's cuda:k (`visible_gpu`);
    the worker sees its own GPU(s) first (it runs on its cuda:0). ipc_source: this process's cuda index of the
    trainer GPU that shares adapter tensors with the worker (None: no tensor sync); when it is not one of the
    worker's own GPUs it is made visible too, after them (the worker maps the buffer there and copies it over)."""
    ids = device.split(":", 1)[1] if ":" in device else "0"
    own = [visible_gpu(int(g), visible) if g.isdigit() else g for g in ids.split(",")]
    if ipc_source is None:
        return ",".join(own), None
    peer = visible_gpu(ipc_source, visible)
    if peer in own:
        return ",".join(own), own.index(peer)
    return ",".join(own + [peer]), len(own)


def node_worker_devices(devices: Sequence[str], *, local_world_size: int, trainer_device: str) -> list[str]:
    """One node's rollout worker devices from `--rollout_devices`: "colocated" = one worker per trainer rank of the
    node, on that rank's own device (local rank r trains on cuda:r, so its worker gets cuda:r; CPU trainers get CPU
    workers); anything else is taken as given (GPUs reserved for rollout, e.g. ["cuda:3"])."""
    devices = [d.strip() for d in devices]
    if COLOCATED not in devices:
        return devices
    if len(devices) != 1:
        raise ValueError(f"--rollout_devices {COLOCATED} stands alone (got {','.join(devices)})")
    if trainer_device not in ("cuda", "cpu"):
        raise ValueError(f"trainer device must be 'cuda' or 'cpu', got {trainer_device!r}")
    return [f"cuda:{r}" if trainer_device == "cuda" else "cpu" for r in range(local_world_size)]


def adapter_sources(devices: Sequence[str], *, local_world_size: int, trainer_device: str) -> list[int]:
    """For each worker, the node-local trainer rank whose copy of the adapter it receives in a tensor sync: the rank
    that trains on the worker's own GPU where there is one (colocated: worker r <- rank r, the same GPU), else local
    rank 0 (reserved rollout GPUs: the workers read rank 0's GPU buffer; CPU: rank 0's memory file)."""
    out = []
    for device in devices:
        k = gpu_index(device)
        out.append(k if trainer_device == "cuda" and k is not None and k < local_world_size else 0)
    return out


def resolve_sync(sync: str, *, engine: str, trainer_device: str, devices: Sequence[str]) -> str:
    """`--rollout_sync`: "tensors" (hand each worker the adapter tensors in memory; the native engine with trainers
    and workers both on CUDA or both on CPU) or "disk" (a versioned PEFT directory that every worker reads; what
    vllm-omni needs). "auto" picks tensors wherever they work."""
    if sync not in SYNC_MODES:
        raise ValueError(f"--rollout_sync must be one of {SYNC_MODES}, got {sync!r}")
    kinds = {"cuda" if gpu_index(d) is not None else d.split(":")[0] for d in devices}
    possible = engine == "native" and kinds == {trainer_device}
    if sync == "auto":
        return "tensors" if possible else "disk"
    if sync == "tensors" and not possible:
        raise ValueError(f"--rollout_sync tensors needs the native engine with trainers and rollout workers on the "
                         f"same kind of device (got engine {engine}, trainer {trainer_device}, workers "
                         f"{list(devices)}); use --rollout_sync disk")
    return sync


def adapter_layout(named_shapes: Sequence[tuple[str, Sequence[int]]]) -> list[list[Any]]:
    """The plain-data layout of a flat adapter buffer: [[key, [shape...]], ...] in buffer order, keys
    `<trainer module path>.lora_A.weight` / `.lora_B.weight`; each tensor starts where the previous one ends."""
    return [[str(key), [int(d) for d in shape]] for key, shape in named_shapes]


def layout_numel(layout: Sequence[Sequence[Any]]) -> int:
    return sum(math.prod(shape) for _, shape in layout)


def unpack_adapter(flat: torch.Tensor, layout: Sequence[Sequence[Any]]) -> dict[str, dict[str, torch.Tensor]]:
    """{module path: {"A": view, "B": view}} of a flat buffer laid out by `adapter_layout` (views, no copies). A
    malformed layout (bad key, duplicate, sizes that do not add up to the buffer) raises."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for key, shape in layout:
        path, sep, suffix = str(key).rpartition(".lora_")
        if not sep or suffix not in ("A.weight", "B.weight") or not path:
            raise ValueError(f"adapter tensor key {key!r} is not '<module>.lora_A.weight' / '<module>.lora_B.weight'")
        which = suffix[0]
        if which in modules.get(path, {}):
            raise ValueError(f"adapter tensor {key!r} appears twice in the layout")
        n = math.prod(shape)
        if offset + n > flat.numel():
            raise ValueError(f"the adapter layout needs more than the buffer's {flat.numel()} elements (at {key!r})")
        modules.setdefault(path, {})[which] = flat[offset:offset + n].view(*shape)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"the adapter layout covers {offset} of the buffer's {flat.numel()} elements")
    return modules


def _memory_file(nbytes: int) -> tuple[int, str, bool]:
    """(fd, path other processes of this machine can open, unlink on close?) of a file of `nbytes` in memory: an
    anonymous memfd (Linux; freed with its last mapping, even if this process dies), else a file in /dev/shm or the
    temp directory."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("flowrl-adapter")
        path, unlink = f"/proc/{os.getpid()}/fd/{fd}", False
    else:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        fd, path = tempfile.mkstemp(prefix="flowrl-adapter-", dir=folder)
        unlink = True
    os.ftruncate(fd, nbytes)
    return fd, path, unlink


class AdapterBuffer:
    """One flat float32 buffer that holds a LoRA adapter's tensors back to back (`adapter_layout` order) on a trainer
    rank, for this node's rollout workers to read without a disk round trip: on a GPU through CUDA IPC (a worker on
    the same GPU maps this very memory; one on another GPU of the node maps it on that GPU and copies it over, one
    device-to-device copy), on the CPU as a memory file that the workers map read-only. `share()` is plain data for
    the worker message; `close()` frees the buffer (only after every worker answered)."""

    def __init__(self, numel: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._fd: int | None = None
        if self.device.type == "cuda":
            self.tensor = torch.empty(numel, dtype=torch.float32, device=self.device)
        elif self.device.type == "cpu":
            self._fd, self._path, self._unlink = _memory_file(numel * 4)
            self.tensor = torch.from_file(self._path, shared=True, size=numel, dtype=torch.float32)
        else:
            raise ValueError(f"an adapter buffer lives on a CUDA GPU or the CPU, not {self.device}")

    def share(self) -> dict[str, Any]:
        """Plain data (ints, bytes, str, bool) from which `open_adapter_buffer` maps this buffer in a worker."""
        if self.device.type == "cpu":
            return {"kind": "file", "path": self._path, "numel": self.tensor.numel()}
        torch.cuda.synchronize(self.device)  # the buffer is filled before any worker reads it
        try:
            (_, handle, storage_size, storage_offset, ref_counter_handle, ref_counter_offset, event_handle,
             event_sync_required) = self.tensor.untyped_storage()._share_cuda_()
        except RuntimeError as e:
            raise RuntimeError(f"could not export the adapter buffer through CUDA IPC ({e}); use --rollout_sync disk"
                               ) from e
        return {"kind": "cuda_ipc", "handle": handle, "storage_size": int(storage_size),
                "storage_offset": int(storage_offset), "ref_counter_handle": ref_counter_handle,
                "ref_counter_offset": int(ref_counter_offset), "event_handle": event_handle,
                "event_sync_required": bool(event_sync_required), "offset": int(self.tensor.storage_offset()),
                "numel": self.tensor.numel()}

    def close(self) -> None:
        self.tensor = None
        if self._fd is not None:
            os.close(self._fd)
            if self._unlink:
                os.unlink(self._path)
            self._fd = None
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # free what the workers released


def open_adapter_buffer(source: dict[str, Any], device: torch.device) -> torch.Tensor:
    """In a worker: the flat float32 buffer that a trainer rank shares (`AdapterBuffer.share()`, with "device" set
    by the group to this worker's index of the trainer's GPU), on `device`: mapped in place when it already lives
    there, else copied over once."""
    numel = int(source["numel"])
    if source["kind"] == "file":
        flat = torch.from_file(source["path"], shared=False, size=numel, dtype=torch.float32)
    elif source["kind"] == "cuda_ipc":
        index = int(source["device"])
        storage = torch.UntypedStorage._new_shared_cuda(
            index, source["handle"], source["storage_size"], source["storage_offset"], source["ref_counter_handle"],
            source["ref_counter_offset"], source["event_handle"], source["event_sync_required"])
        flat = torch.empty(0, dtype=torch.float32, device=f"cuda:{index}").set_(
            storage, source["offset"], (numel,), (1,))
        torch.cuda.synchronize(index)  # the producer's event (if any) is waited for on that device's stream
    else:
        raise ValueError(f"unknown adapter buffer kind {source['kind']!r}")
    return flat.to(device)


def release_memory(device: str) -> dict[str, float]:
    """In a worker after a request: return the CUDA cache to the GPU (a colocated trainer rank trains next on it)
    and report, in GiB, the peak allocated during the request and what the worker still holds (allocated /
    reserved). {} on CPU."""
    if not (str(device).startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    gib = 1024.0 ** 3
    peak = torch.cuda.max_memory_allocated() / gib
    torch.cuda.empty_cache()
    out = {"peak_gib": peak, "allocated_gib": torch.cuda.memory_allocated() / gib,
           "reserved_gib": torch.cuda.memory_reserved() / gib}
    torch.cuda.reset_peak_memory_stats()
    return out


# ---------------------------------------------------------------------------------------------------------
# Worker processes: length-prefixed messages over stdin/stdout, holding plain tensors and built-in types only
# ---------------------------------------------------------------------------------------------------------

# The trainer and its workers may run different Python environments (--rollout_python: e.g. vllm-omni's own torch
# 2.13 stack beside the trainer's torch 2.14), so every message is version-neutral: CPU tensors, None, bool, int,
# float, str, bytes, and lists / tuples / str-keyed dicts of those, written by torch.save and read back with
# torch.load(weights_only=True) (no pickled classes, so no import of the sender's code on the receiver), then
# checked again. Bump PROTOCOL_VERSION whenever a message's layout or meaning changes: the start-up handshake
# refuses a peer that speaks another version.
PROTOCOL_VERSION = 1
_MAGIC = b"FRLW"
_HEADER = struct.Struct("<4sQ")  # magic, payload length
_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)  # bytes: CUDA IPC handles


class ProtocolError(RuntimeError):
    """A message that is not plain data (refused whole; the channel stays in step)."""


class ChannelBroken(ProtocolError):
    """Bytes that are not a frame of this protocol (the channel is out of step and must be closed)."""


def check_plain(value: Any, path: str = "message") -> None:
    """Raise `ProtocolError` naming the first value (by its path) that is not plain data.

    Plain: None, bool, int, float, str, bytes (exact types: numpy scalars, enums and other subclasses are refused), dense
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
                        "tensors, None, bool, int, float, str, bytes, list, tuple and str-keyed dict only; convert it, "
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


def _die_with_parent(parent_pid: int = 0) -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (no orphans even if the trainer is
    SIGKILLed); elsewhere the worker still exits on EOF of its stdin. `parent_pid`: the pid of the trainer that
    started this worker; if it died before the signal was armed (this process was already re-parented), exit now."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)  # the trainer is gone: nobody will ever read this worker


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
    parser.add_argument("--attention-backend", default="auto", help="SDPA backend (models.base.attention_backend)")
    parser.add_argument("--profile-generate", type=int, default=0,
                        help="record a torch.profiler trace of the N-th generate request (0 = off)")
    parser.add_argument("--profile-path", default="", help="where that trace goes (gzipped Chrome JSON)")
    parser.add_argument("--parent-pid", type=int, default=0, help="the trainer's pid (exit if it is already gone)")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    # a terminal Ctrl-C (same process group) or a scheduler's SIGTERM must not kill the worker before the trainer
    # has finished its step: the parent closes it (stdin EOF, then SIGKILL; PDEATHSIG if the parent dies)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    from models.base import attention_backend

    profiler = None
    if args.profile_generate > 0:
        from training.profiling import step_profiler

        profiler = step_profiler(args.profile_path, step=args.profile_generate, first_step=1,
                                 cuda=args.device.startswith("cuda"))
        profiler.start()
    with attention_backend(args.attention_backend):
        _serve(engine, channel_in, channel_out, args.device, profiler)


def _serve(engine: Any, channel_in, channel_out, device: str, profiler: Any) -> None:
    """The worker's request loop (until the trainer closes the channel); `profiler` (or None) is stepped after
    every generate request."""
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
            if op == "generate":  # streamed: one message per finished chunk, then "done" (or an error, which ends it)
                with torch.profiler.record_function("timing_s/gen"):
                    for start, part in engine.generate_chunks(RolloutRequest.from_dict(message["request"])):
                        _send(channel_out, {"ok": True, "chunk": {"start": start, "result": part.to_dict()}})
                if profiler is not None:
                    profiler.step()
                reply = {"ok": True, "done": True, "memory": release_memory(device)}
            elif op == "load_adapter":
                reply = {"ok": True, "bound_modules": engine.load_adapter(message["path"], message["version"])}
            elif op == "load_adapter_tensors":
                if not hasattr(engine, "load_adapter_tensors"):
                    raise RuntimeError(f"the {engine.name} engine reads adapters from PEFT directories only; use "
                                       "--rollout_sync disk")
                reply = {"ok": True, "bound_modules": engine.load_adapter_tensors(message)}
                release_memory(device)
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
    ipc_index: int | None = None  # this worker's cuda index of the trainer GPU that shares adapter tensors with it

    def stderr_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "<no log>"


class PendingRollout:
    """A request in flight on a `RolloutGroup` (`RolloutGroup.submit`). One reader thread per worker takes the
    worker's streamed chunks off its pipe as they arrive, so a worker never stalls on a full pipe while the caller
    does other work (trains, scores), and calls `on_chunk(first_row, part)` from that thread for each chunk (row
    numbers of the whole request). `wait()` returns the whole result in request order."""

    def __init__(self, group: "RolloutGroup", request: RolloutRequest, blocks: Sequence[tuple[int, int]],
                 on_chunk: Callable[[int, RolloutResult], None] | None) -> None:
        self.group, self.request, self.on_chunk = group, request, on_chunk
        self.workers = list(group.workers[: len(blocks)])
        self.blocks = list(blocks)                   # (first row, rows) of each worker's share
        self.submitted_at = time.monotonic()
        self.last_chunk_at: float | None = None      # when the last chunk arrived (monotonic)
        self.memory: list[dict[str, float]] = []     # each worker's `release_memory` report
        self._parts: list[tuple[int, RolloutResult]] = []
        self._lock = threading.Lock()
        self._active = [self.submitted_at] * len(blocks)    # last sign of life of each worker
        self._finished = [threading.Event() for _ in blocks]
        self._outcome: list[tuple[str, str]] = [("", "")] * len(blocks)  # ("done"|"error"|"died"|"broken", detail)
        self._callback_error: BaseException | None = None
        self._threads = [threading.Thread(target=self._read, args=(i,), name=f"rollout-reader-{i}", daemon=True)
                         for i in range(len(blocks))]
        for thread in self._threads:
            thread.start()

    def _read(self, i: int) -> None:
        worker, (first, _) = self.workers[i], self.blocks[i]
        try:
            while True:
                message = _recv(worker.process.stdout)
                self._active[i] = time.monotonic()
                if not message.get("ok"):
                    self._outcome[i] = ("error", f"{message.get('error')}\n{message.get('traceback', '')}")
                    return
                if message.get("done"):
                    with self._lock:
                        self.memory.append(dict(message.get("memory") or {}))
                    self._outcome[i] = ("done", "")
                    return
                row, part = first + int(message["chunk"]["start"]), RolloutResult.from_dict(message["chunk"]["result"])
                with self._lock:
                    self._parts.append((row, part))
                    self.last_chunk_at = time.monotonic()
                if self.on_chunk is not None and self._callback_error is None:
                    try:
                        self.on_chunk(row, part)
                    except BaseException as e:  # noqa: BLE001 - raised by wait(), in the caller's thread
                        self._callback_error = e
        except EOFError:
            self._outcome[i] = ("died", "")
        except Exception as e:  # a message that cannot be read leaves the channel unusable
            self._outcome[i] = ("broken", f"{type(e).__name__}: {e}")
        finally:
            self._finished[i].set()

    def done(self) -> bool:
        """Every worker has answered (its last chunk, or an error)."""
        return all(event.is_set() for event in self._finished)

    def drain(self) -> None:
        """Wait until every worker has answered this request; the workers are then free for the next one. A worker
        that dies or stays silent longer than the group's `timeout_s` closes the group (`RolloutError` with its
        stderr tail); a worker's error reply is kept for `wait()`."""
        timeout = self.group.timeout_s
        for i, worker in enumerate(self.workers):
            while not self._finished[i].wait(1.0):
                if worker.process.poll() is not None:  # its reader sees the end of the pipe next
                    self._finished[i].wait(10.0)
                    break
                if time.monotonic() - self._active[i] > timeout:
                    raise self.group._fail(worker, f"did not answer within {timeout:.0f} s during generate")
            kind, detail = self._outcome[i]
            if kind in ("died", "") or (kind == "broken" and worker.process.poll() is not None):
                try:
                    code = worker.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    code = None
                raise self.group._fail(worker, f"died during generate (exit code {code})")
            if kind == "broken":
                raise self.group._fail(worker, f"sent an unreadable reply during generate ({detail})")
        if self.group._pending is self:
            self.group._pending = None

    def wait(self) -> RolloutResult:
        """The whole result in request order, once every worker answered (`drain`). A worker's error reply or an
        exception of `on_chunk` is raised here, after every worker finished (the workers stay usable)."""
        self.drain()
        for worker, (kind, detail) in zip(self.workers, self._outcome):
            if kind == "error":
                raise RolloutError(f"rollout worker {worker.index} ({worker.devices}) failed during generate: {detail}")
        if self._callback_error is not None:
            raise self._callback_error
        parts = sorted(self._parts, key=lambda item: item[0])
        rows = [row for row, _ in parts]
        starts = [0]
        for _, part in parts[:-1]:
            starts.append(starts[-1] + len(part))
        if rows != starts or not parts or starts[-1] + len(parts[-1][1]) != len(self.request):
            raise RolloutError(f"the rollout workers returned rows {rows} (chunks of {[len(p) for _, p in parts]}) for "
                               f"a request of {len(self.request)} rows")
        return RolloutResult.cat([part for _, part in parts])


class RolloutGroup:
    """Rollout worker subprocesses, one per entry of `devices`.

    devices: e.g. ["cuda:3"] or ["cuda:2", "cuda:3"] (each worker then sees only its GPU through
    `CUDA_VISIBLE_DEVICES` and runs on cuda:0; "cuda:k" is this process's cuda:k, see `visible_gpu`), or
    ["cpu", "cpu"] for tests. ipc_sources: per worker, this process's cuda index of the trainer GPU that will share
    adapter tensors with it (`load_adapter_tensors`), or None; a GPU other than the worker's own is made visible to
    it as its cuda:1. Requests are split into contiguous row blocks across workers; each worker streams its results
    back chunk by chunk (`submit`), gathered in order. A worker that dies, fails or exceeds `timeout_s` stops the
    group with a `RolloutError` carrying its stderr tail; `close()` (also on Ctrl-C, at exit, or when the parent
    dies) leaves no process behind. attention_backend: the workers' SDPA backend (`models.base.attention_backend`);
    profile_generate N > 0: each worker records a torch.profiler trace of its N-th generate request into
    `log_dir`/profile-worker-<index>.json.gz (`training.step_profiler`).
    """

    def __init__(self, model_path: str, devices: Sequence[str], *, engine: str = "native", dtype: str = "float32",
                 max_batch_size: int = 8, timeout_s: float = 1800.0, startup_timeout_s: float = 1800.0,
                 log_dir: str | None = None, threads_per_worker: int = 0, env: dict[str, str] | None = None,
                 cfg_batch: bool = False, ipc_sources: Sequence[int | None] | None = None,
                 python: str | None = None, attention_backend: str = "auto", profile_generate: int = 0) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown rollout engine {engine!r}; choose from {ENGINES}")
        if not devices:
            raise ValueError("a rollout group needs at least one device")
        self.timeout_s = timeout_s
        self.workers: list[_Worker] = []
        self._pending: PendingRollout | None = None
        self.closed_reason = ""
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="rollout-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        script = os.path.abspath(__file__)
        try:
            for index, device in enumerate(devices):
                worker_env = _worker_env(env)
                local_device, ipc_index = device, None
                if device.startswith("cuda"):
                    worker_env["CUDA_VISIBLE_DEVICES"], ipc_index = worker_cuda_devices(
                        device, None if ipc_sources is None else ipc_sources[index])
                    local_device = "cuda:0"
                log_path = os.path.join(self.log_dir, f"rollout-worker-{index}.log")
                log = open(log_path, "ab")
                command = [python or sys.executable, script, "--worker", "--engine", engine, "--model-path", model_path,
                           "--device", local_device, "--dtype", dtype, "--max-batch-size", str(max_batch_size),
                           "--threads", str(threads_per_worker), "--attention-backend", attention_backend,
                           "--parent-pid", str(os.getpid())] \
                    + (["--cfg-batch"] if cfg_batch else []) + (["--profile-generate", str(profile_generate),
                       "--profile-path", os.path.join(self.log_dir, f"profile-worker-{index}.json.gz")]
                      if profile_generate > 0 else [])
                # unbuffered: select() on the pipe then sees every byte the worker wrote
                process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                           env=worker_env, bufsize=0)
                log.close()
                self.workers.append(_Worker(index, device, process, log_path, ipc_index))
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
        self.closed_reason = f"rollout worker {worker.index} ({worker.devices}) {what}"
        return RolloutError(f"{self.closed_reason}; stderr tail ({worker.log_path}):\n{worker.stderr_tail()}")

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
        A submitted request still sampling is finished first (its results stay with its `PendingRollout`).
        """
        self._finish_pending()
        if not self.workers:
            raise RolloutError(f"the rollout group is closed{': ' + self.closed_reason if self.closed_reason else ''}")
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
        return self.submit(request).wait()

    def submit(self, request: RolloutRequest,
               on_chunk: Callable[[int, RolloutResult], None] | None = None) -> PendingRollout:
        """Send the request to the workers (contiguous row blocks, one per worker) and return at once; the
        `PendingRollout` collects the chunks as the workers stream them (`on_chunk(first_row, part)` for each, from a
        reader thread) and `wait()` gives the whole result. One request is in flight at a time: a new request or
        any other call first waits until the previous one has finished sampling."""
        request.validate()
        self._finish_pending()
        if not self.workers:
            raise RolloutError(f"the rollout group is closed{': ' + self.closed_reason if self.closed_reason else ''}")
        n, k = len(request), min(len(self.workers), len(request))
        bounds = [round(i * n / k) for i in range(k + 1)]
        for i, worker in enumerate(self.workers[:k]):
            message = {"op": "generate", "request": request.select(range(bounds[i], bounds[i + 1])).to_dict()}
            try:
                _send(worker.process.stdin, message)
            except (BrokenPipeError, OSError):
                raise self._fail(worker, "is gone (could not send generate)") from None
        self._pending = PendingRollout(self, request, [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(k)],
                                       on_chunk)
        return self._pending

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.drain()

    def load_adapter(self, adapter_dir: str, version: str) -> list[int]:
        """Every worker loads the PEFT adapter directory; returns each worker's bound-module count."""
        replies = self._call_all([{"op": "load_adapter", "path": adapter_dir, "version": version}] * self.num_workers,
                                 "load_adapter")
        return [int(r["bound_modules"]) for r in replies]

    def load_adapter_tensors(self, shares: Sequence[dict[str, Any]], layout: list, config: dict[str, Any],
                             version: str) -> list[int]:
        """Every worker binds the adapter tensors of its trainer rank's `AdapterBuffer` (`shares[i]` = that buffer's
        `share()`), laid out by `layout` (`adapter_layout`) with the PEFT `config`; no disk round trip. Returns each
        worker's bound-module count. The message is plain data (CUDA IPC handles are bytes); a CUDA IPC handle needs
        the same torch on both sides, which the worker checks."""
        messages = []
        for worker, share in zip(self.workers, shares):
            source = dict(share)
            if source.get("kind") == "cuda_ipc":
                if worker.ipc_index is None:
                    raise RolloutError(f"rollout worker {worker.index} ({worker.devices}) was started without "
                                       "access to a trainer GPU (ipc_sources), so it cannot map CUDA IPC tensors")
                source["device"] = worker.ipc_index
            messages.append({"op": "load_adapter_tensors", "version": version, "config": config, "layout": layout,
                             "source": source, "torch_version": str(torch.__version__)})
        if len(messages) != self.num_workers:
            raise RolloutError(f"{len(messages)} adapter shares for {self.num_workers} rollout workers")
        replies = self._call_all(messages, "load_adapter_tensors")
        return [int(r["bound_modules"]) for r in replies]

    def close(self) -> None:
        """Stop every worker (politely, then SIGKILL); idempotent."""
        self._pending = None
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

    Layouts (`node_worker_devices`): `devices` = GPUs reserved for rollout on every node (e.g. ["cuda:3"]), or
    ["colocated"]: one worker per trainer rank of the node, on that rank's GPU (the trainer empties its CUDA cache
    before each rollout, the worker after each request). Multi-node: every node runs `torchrun
    --nproc_per_node=<trainer GPUs>`; disk adapter versions must be on a filesystem all nodes see.

    Besides `generate`, the trainers use `submit` / `collect` (the rollout runs while the driver scores finished
    chunks, or while the ranks train: `--rollout_policy_lag`) and `load_adapter_tensors` (`sync` = "tensors": each
    worker gets the adapter from a trainer rank of its own node in memory, `AdapterBuffer`).
    """

    def __init__(self, model_path: str, devices: Sequence[str], *, trainer_device: str = "cpu", sync: str = "disk",
                 collective_timeout_s: float | None = None, **group_kwargs: Any) -> None:
        """collective_timeout_s: timeout of the node subgroups (None = torch's default); the trainers pass the one
        of their main group (`training.collective_timeout_s`), above every rollout timeout, so that a node's ranks
        waiting for the driver hear its RolloutError instead of timing out first."""
        import datetime

        import torch.distributed as dist

        self.distributed = dist.is_available() and dist.is_initialized()
        self.node_group, self.node_root = None, 0
        local_rank, local_world = 0, 1
        if self.distributed:
            world = dist.get_world_size()
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            if world % local_world:
                raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}")
            # every rank must create every node's subgroup (a collective), then keep its own
            timeout = None if collective_timeout_s is None else datetime.timedelta(seconds=collective_timeout_s)
            self.node_group, _ = dist.new_subgroups(group_size=local_world, backend="gloo", timeout=timeout)
            self.node_root = dist.get_global_rank(self.node_group, 0)
            if world > local_world and group_kwargs.get("log_dir"):
                # nodes share the output directory: each node's workers log into their own folder
                group_kwargs["log_dir"] = os.path.join(group_kwargs["log_dir"], f"node{dist.get_rank() // local_world}")
        if COLOCATED in devices and group_kwargs.get("engine", "native") != "native":
            raise ValueError(f"--rollout_devices {COLOCATED} is for the native engine; the vllm_omni engine manages "
                             "its GPU memory itself and needs rollout GPUs of its own (e.g. --rollout_devices cuda:3)")
        devices = node_worker_devices(devices, local_world_size=local_world, trainer_device=trainer_device)
        self.sync_mode = resolve_sync(sync, engine=group_kwargs.get("engine", "native"), trainer_device=trainer_device,
                                      devices=devices)
        self.adapter_sources = adapter_sources(devices, local_world_size=local_world, trainer_device=trainer_device)
        self.feeds_workers = self.sync_mode == "tensors" and local_rank in self.adapter_sources
        self._local_rank = local_rank
        self.device = torch.device(f"cuda:{local_rank}" if trainer_device == "cuda" else "cpu")
        # a worker samples on this rank's GPU: hand it the cached memory before every rollout
        self.shares_gpu = trainer_device == "cuda" and local_rank in [gpu_index(d) for d in devices]
        self.versions_published = 0          # adapter versions loaded so far (`rollout/policy_lag` counts them)
        self._pending: dict[str, Any] | None = None
        if self.sync_mode == "tensors" and trainer_device == "cuda":
            group_kwargs["ipc_sources"] = self.adapter_sources
        self.group, error = None, None
        if local_rank == 0:
            try:
                self.group = RolloutGroup(model_path, devices, **group_kwargs)
            except Exception as e:  # reported after every rank has heard of it, so no rank waits forever
                error = e
        self._check_started(error)

    def _check_started(self, error: Exception | None) -> None:
        """Every rank learns whether every node's group started, and the first failed driver's error (so none waits
        forever on a failed node, and every rank's log says why)."""
        if self.distributed:
            import torch.distributed as dist

            messages: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
            failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
            if error is None and failed:
                raise RolloutError(f"the rollout group of rank {failed[0][0]} failed to start: {failed[0][1]}")
        if error is not None:
            raise error

    @property
    def is_driver(self) -> bool:
        return self.group is not None

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """This rank's rows of the node's combined request, in order. Collective over the node's ranks."""
        self._release_trainer_cache()
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
            self.versions_published += 1
            return counts
        import torch.distributed as dist

        box = [{"counts": counts, "error": error}]
        dist.broadcast_object_list(box, src=self.node_root, group=self.node_group)
        if box[0]["error"]:
            raise RolloutError(f"adapter {adapter_dir} could not be loaded by the rollout workers: {box[0]['error']}")
        self.versions_published += 1
        return box[0]["counts"]

    # ---- overlapped rollouts, lagged rollouts and the tensor sync (the trainers' path) ------------------------
    def _release_trainer_cache(self) -> None:
        if self.shares_gpu:
            torch.cuda.empty_cache()

    def _node_gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value` on the driver (in node-rank order), None elsewhere. Collective over the node."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size(self.node_group) if self.is_driver else None
        dist.gather_object(value, gathered, dst=self.node_root, group=self.node_group)
        return gathered

    @property
    def has_pending(self) -> bool:
        """A rollout was submitted and not yet collected (on every rank of the node alike)."""
        return self._pending is not None

    def submit(self, request: RolloutRequest, *, payload: Any = None,
               consumer: Callable[[list[Any], list[int]], Any] | None = None) -> None:
        """Start this rank's share of the node's next rollout and return without waiting for it. Collective over the
        node's ranks: the requests (and each rank's `payload`, plain data such as what scoring needs) go to the
        driver, which submits them as one request. On the driver, `consumer(payloads, sizes)` (optional) builds the
        object that sees every chunk as the workers stream it (`on_chunk(first_row, part)`, called from reader
        threads, rows of the node's combined request) and whose `finish()` returns one value per rank at `collect`
        (`close()` at the end, in every case). At most one rollout is pending; `collect` ends it. An error on the
        driver is reported to every rank by `collect`."""
        if self._pending is not None:
            raise RolloutError("a rollout is already pending on this rank: collect it first")
        self._release_trainer_cache()
        gathered = self._node_gather({"request": request.to_dict(), "payload": payload})
        state: dict[str, Any] = {"request": request, "versions": self.versions_published,
                                 "submitted": time.monotonic()}
        if self.is_driver:
            try:
                requests = [RolloutRequest.from_dict(g["request"]) for g in gathered]
                state["sizes"] = [len(r) for r in requests]
                if consumer is not None:
                    state["stream"] = consumer([g["payload"] for g in gathered], state["sizes"])
                on_chunk = state["stream"].on_chunk if consumer is not None else None
                state["rollout"] = self.group.submit(RolloutRequest.concat(requests), on_chunk=on_chunk)
            except Exception as e:  # every rank hears of it at collect
                state["error"] = e
        self._pending = state

    def finish_pending(self) -> None:
        """Driver: wait until the pending rollout's last chunk is in (its consumer may still be working), so that
        the workers are free, e.g. for the next adapter version. Other ranks: nothing. Errors wait for `collect`."""
        state = self._pending
        if state is not None and self.is_driver and "rollout" in state and "error" not in state:
            try:
                state["rollout"].drain()
            except Exception as e:
                state["error"] = e

    def collect(self, request: RolloutRequest, *, lagged: bool = False) -> tuple[RolloutResult, Any, dict[str, float]]:
        """This rank's rows of the pending rollout (which must have been submitted with this `request`), the
        consumer's value for this rank (None without a consumer) and the driver's timings. Collective over the
        node's ranks. Timings (seconds, wall clock on the node's driver): `timing_s/gen` the wait for the samples
        from `submit` (or from this call when `lagged`: the samples came while the ranks trained),
        `timing_s/gen_sampling` submit to last chunk, `timing_s/reward` the consumer's work left after the last chunk
        (the part not hidden behind sampling), `timing_s/reward_total` the consumer's busy span (`busy_s()`);
        `rollout/policy_lag` the adapter versions loaded since the submit; `rollout/worker_mem_*_gib` the largest
        worker's CUDA peak / held memory after the request."""
        state = self._pending
        if state is None:
            raise RolloutError("collect: no rollout is pending (submit one first)")
        if state["request"].seeds != request.seeds or state["request"].prompts != request.prompts:
            raise RolloutError("collect: the pending rollout was submitted for other rows (seeds or prompts differ)")
        self._pending = None
        began = time.monotonic()
        lag = {"rollout/policy_lag": float(self.versions_published - state["versions"])}
        parts: list[Any] = []
        driver_error: Exception | None = None
        if self.is_driver:
            stream = state.get("stream")
            try:
                if "error" in state:
                    raise state["error"]
                pending = state["rollout"]
                result = pending.wait()
                sampled = pending.last_chunk_at or time.monotonic()
                values = stream.finish() if stream is not None else [None] * len(state["sizes"])
                scored = time.monotonic()
                stats = {"timing_s/gen": max(0.0, sampled - (began if lagged else state["submitted"])),
                         "timing_s/gen_sampling": sampled - state["submitted"]}
                if stream is not None:
                    stats["timing_s/reward"] = max(0.0, scored - max(sampled, began))
                    stats["timing_s/reward_total"] = float(stream.busy_s())
                for key in ("peak_gib", "reserved_gib"):
                    held = [m[key] for m in pending.memory if key in m]
                    if held:
                        stats[f"rollout/worker_mem_{key.replace('_gib', '')}_gib"] = max(held)
                start = 0
                for size, value in zip(state["sizes"], values):
                    parts.append({"result": result.select(range(start, start + size)).to_dict(), "value": value,
                                  "stats": stats})
                    start += size
            except Exception as e:  # every rank of the node must hear about it, not hang in the scatter
                driver_error = e
                parts = [{"error": f"{type(e).__name__}: {e}"}] * len(state.get("sizes") or [None] * self._node_size())
            finally:
                if stream is not None:
                    stream.close()
        if self.distributed:
            import torch.distributed as dist

            box: list[Any] = [None]
            dist.scatter_object_list(box, parts if self.is_driver else None, src=self.node_root,
                                     group=self.node_group)
            mine_part = box[0]
        else:
            mine_part = parts[0]
        if driver_error is not None:
            raise driver_error
        if "error" in mine_part:
            raise RolloutError(f"rollout or its scoring failed on this node: {mine_part['error']}")
        return RolloutResult(**mine_part["result"]), mine_part["value"], {**mine_part["stats"], **lag}

    def _node_size(self) -> int:
        if not self.distributed:
            return 1
        import torch.distributed as dist

        return dist.get_world_size(self.node_group)

    def load_adapter_tensors(self, buffer: AdapterBuffer | None, layout: list, config: dict[str, Any],
                             version: str) -> list[int]:
        """The tensor sync: every worker of the node binds the adapter from its source rank's `buffer`
        (`adapter_sources`; None on ranks that feed no worker) without a disk round trip; returns this node's
        per-worker bound-module counts on every rank of the node. Collective over the node's ranks; the buffers
        may be freed once it returns."""
        # one share per worker fed: each CUDA IPC share carries its own reference count for its reader
        fed = self.adapter_sources.count(self._local_rank)
        shares = self._node_gather([buffer.share() for _ in range(fed)] if buffer is not None else None)
        counts: Any = None
        error = None
        if self.is_driver:
            try:
                missing = sorted({s for s in self.adapter_sources if not shares[s]})
                if missing:
                    raise RolloutError(f"local ranks {missing} shared no adapter tensors")
                counts = self.group.load_adapter_tensors([shares[s].pop() for s in self.adapter_sources], layout,
                                                         config, version)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        if self.distributed:
            import torch.distributed as dist

            box = [{"counts": counts, "error": error}]
            dist.broadcast_object_list(box, src=self.node_root, group=self.node_group)
            counts, error = box[0]["counts"], box[0]["error"]
        if error:
            raise RolloutError(f"adapter {version} (tensors) could not be loaded by the rollout workers: {error}")
        self.versions_published += 1
        return counts

    def close(self) -> None:
        state, self._pending = self._pending, None
        if state is not None and state.get("stream") is not None:  # a rollout never collected (the run stopped)
            state["stream"].close()
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
