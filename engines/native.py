"""Layer 4 of the rollout code: the native engine (diffusers/torch via `models/`), one per device.

Sampling, per sample b with its own generator g_b seeded from `seeds[b]`:
  1. initial noise from g_b (model-native layout, fp32); for edit, the reference VAE latents are sampled next
     from g_b;
  2. SDE window start from g_b (only when `sde_window_size` is set): start ~ UniformInt{lo, ..., hi - w};
  3. for every step i: velocity (with the model's CFG), then `losses.sde_step` in fp32 — inside the window with
     `noise_level` (noise from g_b), outside it with 0 (Euler, no noise drawn).
So a sample never depends on how requests are batched or split across workers.

Imports torch, `models/` and the lower layers `engines.sampler`, `engines.contract` and `engines.layout`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator, Sequence

import torch

from engines.contract import RolloutRequest, RolloutResult
from engines.layout import open_adapter_buffer, unpack_adapter
from engines.sampler import rl_denoise, sde_window_starts, window_length


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
                 max_batch_size: int = 8, cfg_batch: bool = False, compile_blocks: bool = False,
                 **model_kwargs: Any) -> None:
        from models import load_model
        from models.base import compile_blocks as compile_transformer_blocks

        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        # cfg_batch: CFG as one transformer forward over [cond ; uncond] (FlowModel.guided_velocity); the trainer's
        # replay must use the same mode (it is reported in every result's metadata as "cfg_batch").
        self.model = load_model(model_path, device=device, dtype=dtype, cfg_batch=cfg_batch, **model_kwargs)
        self.model.transformer.requires_grad_(False)
        if compile_blocks:  # the adapter, bound later, recompiles each block class once
            compile_transformer_blocks(self.model.transformer, self.model.blocks_to_compile)
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
        scale = float(request.cfg_scale)
        guided = scale > 1.0  # with its negative prompts (`RolloutRequest.validate`)
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

