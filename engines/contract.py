"""Layer 2 of the rollout code: the request/result contract that every engine answers and that crosses the
process boundary as plain data (`to_dict` / `from_dict`), and the engine names.

Imports torch, `losses`, `models.base` and `engines.sampler` only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

import losses
from engines.sampler import sde_window_starts
from models.base import PromptEmbeds

if TYPE_CHECKING:
    from models.base import Conditioning

ENGINES = ("native", "vllm_omni")


# ---------------------------------------------------------------------------------------------------------
# The contract
# ---------------------------------------------------------------------------------------------------------


def _check_keys(cls: type, data: dict[str, Any], what: str) -> None:
    """ValueError listing the keys of `data` that are not fields of the dataclass `cls`, or the fields without a
    default that `data` lacks (a message must say what it means, never fall back to a default)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; valid keys: {sorted(names)}")
    missing = sorted(f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING and f.name not in data)
    if missing:
        raise ValueError(f"missing {what} keys {missing}")


@dataclass
class RolloutRequest:
    """One batch of samples to generate (all at one size and step count).

    prompts: per sample, a str or a chat-message list ``[{"role", "content"}, ...]`` as stored in the parquet.
    negative_prompts: per sample (same forms), required when guidance is active.
    images: per sample reference image (uint8 (3, H, W) tensor or PIL) for Boogu edit, else None.
    seeds: per-sample seeds (see `row_seed`).
    cfg_scale: the CFG scale s of every sample, velocity = uncond + s·(cond - uncond) (s <= 1: no CFG, no negative
    prompts needed); each engine hands it to its family's pipeline argument (`FlowModel.cfg_argument`).
    noise_level / sde_type / sde_window_size / sde_window_range: the SDE knobs (noise_level 0 = ODE rollout).
    return_log_probs / return_trajectory: store the window's log-probs / latents and timesteps.
    """

    prompts: list
    seeds: list[int]
    num_inference_steps: int
    height: int
    width: int
    cfg_scale: float
    negative_prompts: list | None = None
    images: list | None = None
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
        """Build from a plain dict; unknown or missing keys are an error (a typo must not silently use a default)."""
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
        if isinstance(self.cfg_scale, bool) or not isinstance(self.cfg_scale, (int, float)) \
                or not math.isfinite(self.cfg_scale):
            raise ValueError(f"cfg_scale must be a finite number (1.0 = no CFG), got {self.cfg_scale!r}")
        if self.cfg_scale > 1.0 and self.negative_prompts is None:
            raise ValueError(f"cfg_scale {self.cfg_scale} > 1 needs negative prompts (one per sample); pass "
                             "negative_prompts or set cfg_scale to 1.0 to disable CFG")
        if not isinstance(self.num_inference_steps, int) or self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be a positive int, got {self.num_inference_steps!r}")
        if self.sde_type not in losses.SDE_TYPES:
            raise ValueError(f"sde_type must be one of {losses.SDE_TYPES}, got {self.sde_type!r}")
        if not self.noise_level >= 0:
            raise ValueError(f"noise_level must be >= 0, got {self.noise_level}")
        if self.return_log_probs and self.noise_level == 0:
            raise ValueError("return_log_probs needs noise_level > 0 (an ODE rollout has no transition density)")
        if self.sde_window_size is not None:
            sde_window_starts(self.num_inference_steps, self.sde_window_size, self.sde_window_range, [],
                              sde_type=self.sde_type)
        elif self.sde_window_range is not None:
            raise ValueError("sde_window_range needs sde_window_size (without it every step but the last is "
                             "stochastic and trained)")
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

