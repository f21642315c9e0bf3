"""Custom vllm-omni 0.30 RL pipelines: the stock `QwenImagePipeline` / `BooguImagePipeline` generating exactly as
`engines.native.NativeEngine` does, and returning what RL needs.

Loaded INSIDE vllm-omni's worker processes by dotted path (`custom_pipeline_args={"pipeline_class":
"engines.vllm_omni_pipelines.RLQwenImagePipeline"}`); the repo root must be on their PYTHONPATH. Only
`engines.vllm_omni.VllmOmniEngine` refers to this module (by name; the worker's probe imports it); nothing else in
the project imports vllm_omni. Layer 4 of the rollout code (`engines/__init__.py`): of the rollout code it imports
only `engines.sampler` (besides `losses`, `models/` and vllm-omni), so no import cycle runs through it.

Per request (one sample per request; the engine sends one request per sample so each has its own seed):
  1. the worker's generator g (`torch.Generator(generator_device).manual_seed(seed)`) draws the initial noise
     exactly like the native engine (`models.base.per_row_noise`; Qwen draws (1, 16, h, w) then packs), then, for
     Boogu edit, the reference latent sample (the stock `_build_ref_latents` with g), then the SDE window start
     (`engines.sampler.sde_window_starts`);
  2. sigmas from `losses.flow_sigmas` with the model's mu (Qwen: token-count shift + terminal stretch from the raw
     scheduler JSON; Boogu: `models.boogu_image.boogu_schedule_mu`, released static v1);
  3. every step: the stock transformer call (Qwen timestep = sigma; Boogu t = 1 - sigma and the output NEGATED),
     the model's CFG (Qwen true CFG with norm rescale via `losses.apply_cfg(renorm=True)` in fp32; Boogu's stock
     `combine_cfg_noise`, the released operation order in the model dtype), then `losses.sde_step` in fp32 with
     sigma_max = sigmas[1] (window steps with `noise_level` and noise from g; Euler outside);
  4. decode with the stock `_decode_latents` / `_decode_output`.

Return channel (vllm-omni 0.30; see notes/vllm_omni_api.md §0.5, §0.6): one `DiffusionOutput` per request, built
here (the stock `split_diffusion_output_by_request` drops trajectories), `output` = the decoded image tensor
(both architectures' registered post-process accept a plain tensor; Boogu's rejects an envelope), and the RL data
in the dict-valued `trajectory_*` fields, which the output formatter passes through untouched:
  trajectory_latents   = {"latents_clean": fp32 native layout, ["all_latents": (W+1, ...)], ["all_means": (W, ...)
                          transition means], ["ref_latents"]}
  trajectory_timesteps = (W,) fp32 scheduler timesteps 1000·sigma (only with a trajectory)
  trajectory_log_probs = {["all_log_probs": (W,)], "prompt_embeds", "prompt_mask", ["negative_embeds",
                          "negative_mask"], "sigmas": (N+1,), "window_start": int64 scalar, "guidance": fp32}
`engines.vllm_omni.parse_vllm_omni_output` reads exactly these keys.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch

import losses
from engines.sampler import VLLM_OMNI_RL_KEYS, rl_denoise, sde_window_starts, window_length
from models.base import DEFAULT_CFG_SCALE, per_row_noise
from models.boogu_image import boogu_schedule_mu
from models.qwen_image import LATENT_CHANNELS, pack_latents, qwen_image_sigmas

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.models.boogu_image.pipeline_boogu_image import BooguImagePipeline
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline
from vllm_omni.diffusion.models.qwen_image.rope_utils import txt_seq_lens_from_embeds


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers (run on CPU in tests/vllm_omni_env)
# ---------------------------------------------------------------------------------------------------------------


def read_scheduler_config(model_path: str) -> dict[str, Any]:
    """The RAW scheduler JSON (diffusers drops Boogu's time-shift keys on load)."""
    path = os.path.join(model_path, "scheduler", "scheduler_config.json")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def qwen_sigmas(scheduler_config: dict[str, Any], num_steps: int, height: int, width: int,
                vae_scale_factor: int = 8) -> torch.Tensor:
    """Qwen-Image sigmas (N+1,) fp32, as `QwenImageModel.schedule`: mu from the packed token count, terminal
    stretch from the config, via `losses.flow_sigmas`."""
    tokens = (height // vae_scale_factor // 2) * (width // vae_scale_factor // 2)
    return qwen_image_sigmas(scheduler_config, num_steps, tokens)


def boogu_sigmas(scheduler_config: dict[str, Any], num_steps: int, height: int, width: int,
                 vae_scale_factor: int = 8) -> torch.Tensor:
    """Boogu-Image sigmas (N+1,) fp32, as `BooguImageModel.schedule` (released static v1: mu = 1.15)."""
    tokens = (height // vae_scale_factor) * (width // vae_scale_factor)
    return losses.flow_sigmas(num_steps, mu=boogu_schedule_mu(scheduler_config, latent_tokens=tokens))


def rl_settings(sampling_params_list: Sequence[Any]) -> dict[str, Any]:
    """The RL knobs of a request batch from `extra_args` (defaults: an ODE rollout, nothing stored).

    vllm-omni's batch key ignores these keys (notes §0.10), so every request of a batch must carry the same values.
    """
    def one(sp: Any) -> dict[str, Any]:
        extra = dict(getattr(sp, "extra_args", None) or {})
        unknown = sorted(k for k in extra if k.startswith("rl_") and k not in VLLM_OMNI_RL_KEYS)
        if unknown:
            raise ValueError(f"unknown RL extra_args {unknown}; known: {sorted(VLLM_OMNI_RL_KEYS)}")
        out = {k: extra.get(k, default) for k, default in VLLM_OMNI_RL_KEYS.items()}
        if out["rl_sde_window_range"] is not None:
            out["rl_sde_window_range"] = tuple(int(x) for x in out["rl_sde_window_range"])
        return out

    settings = [one(sp) for sp in sampling_params_list]
    for other in settings[1:]:
        if other != settings[0]:
            raise ValueError(f"requests batched together disagree on RL extra_args: {settings[0]} vs {other}; "
                             "send one RL setting per batch (vllm-omni's batch key does not separate them)")
    return settings[0]


def request_outputs(
    images: torch.Tensor,
    latents: torch.Tensor,
    traj: tuple[list, list, list, list],
    *,
    prompt_embeds: torch.Tensor,
    prompt_mask: torch.Tensor,
    negative_embeds: torch.Tensor | None,
    negative_mask: torch.Tensor | None,
    ref_latents: torch.Tensor | None,
    sigmas: torch.Tensor,
    window_starts: Sequence[int],
    guidance: float,
) -> list[DiffusionOutput]:
    """One `DiffusionOutput` per row in the layout `engines.vllm_omni.parse_vllm_omni_output` reads (module
    docstring)."""
    all_latents, all_timesteps, all_log_probs, all_means = traj
    outs = []
    for b in range(images.shape[0]):
        lat = {"latents_clean": latents[b].float()}
        if all_latents[b]:
            lat["all_latents"] = torch.stack(all_latents[b])
        if all_means[b]:
            lat["all_means"] = torch.stack(all_means[b])
        if ref_latents is not None:
            lat["ref_latents"] = ref_latents[b].float()
        extra = {"prompt_embeds": prompt_embeds[b], "prompt_mask": prompt_mask[b].to(torch.int64),
                 "sigmas": sigmas.float(), "window_start": torch.tensor(int(window_starts[b])),
                 "guidance": torch.tensor(float(guidance))}
        if negative_embeds is not None:
            extra["negative_embeds"] = negative_embeds[b]
            extra["negative_mask"] = negative_mask[b].to(torch.int64)
        if all_log_probs[b]:
            extra["all_log_probs"] = torch.stack(all_log_probs[b])
        outs.append(DiffusionOutput(
            output=images[b : b + 1],
            trajectory_latents=lat,
            trajectory_timesteps=torch.stack(all_timesteps[b]) if all_timesteps[b] else None,
            trajectory_log_probs=extra,
            to_cpu=True,
        ))
    return outs


def _negatives(prompts: Sequence[Any]) -> list[str] | None:
    """Per-request negative prompts from the prompt dicts; None when no request carries one ("" is a negative)."""
    negs = [None if isinstance(p, str) else p.get("negative_prompt") for p in prompts]
    if all(n is None for n in negs):
        return None
    if any(n is None for n in negs):
        raise ValueError("some requests of the batch carry a negative_prompt and others do not")
    return negs


def _texts(prompts: Sequence[Any]) -> list[str]:
    return [p if isinstance(p, str) else (p.get("prompt") or "") for p in prompts]


def _generators(req: Any) -> list[torch.Generator]:
    gens = [sp.generator for sp in req.sampling_params_list]
    if not all(isinstance(g, torch.Generator) for g in gens):
        raise RuntimeError("every request needs its own torch.Generator (set a seed per request); the RL pipeline "
                           "does not accept per-output generator lists")
    return gens


def _check_scale(scale: float, negatives: list | None, knob: str) -> bool:
    if scale <= 1.0:
        return False
    if negatives is None:
        raise ValueError(f"{knob}={scale} > 1 needs a negative_prompt per request (\"\" is allowed); pass one or "
                         f"set {knob} <= 1 to disable CFG")
    return True


# ---------------------------------------------------------------------------------------------------------------
# Pipelines
# ---------------------------------------------------------------------------------------------------------------


class RLQwenImagePipeline(QwenImagePipeline):
    """Qwen-Image for RL rollouts (see the module docstring). Text-to-image only."""

    def __init__(self, *, od_config: Any, prefix: str = "") -> None:
        super().__init__(od_config=od_config, prefix=prefix)
        self.rl_scheduler_config = read_scheduler_config(od_config.model)

    def _rl_velocity(self, embeds, mask, img_shapes):
        """fp32 velocity v = eps - x0 of one branch; timestep = sigma, formed as (1000 sigma).to(dtype) / 1000."""
        txt_seq_lens = txt_seq_lens_from_embeds(embeds)

        def fn(latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            dtype = embeds.dtype
            x = latents.to(dtype)
            out = self.transformer(
                hidden_states=x, timestep=(sigma * 1000).to(device=x.device, dtype=dtype) / 1000, guidance=None,
                encoder_hidden_states_mask=mask, encoder_hidden_states=embeds, img_shapes=img_shapes,
                txt_seq_lens=txt_seq_lens, attention_kwargs=self.attention_kwargs, return_dict=False,
            )[0]
            return out.float()

        return fn

    @torch.no_grad()
    def forward(self, req: Any) -> list[DiffusionOutput]:
        sp = req.sampling_params_list[0]
        rl = rl_settings(req.sampling_params_list)
        dummy = req.is_dummy_run()
        height = sp.height or self.default_sample_size * self.vae_scale_factor
        width = sp.width or self.default_sample_size * self.vae_scale_factor
        if height % 16 or width % 16:
            raise ValueError(f"height/width must be multiples of 16, got {height}x{width}")
        steps = sp.num_inference_steps or 50
        if sp.num_outputs_per_prompt not in (0, 1):
            raise ValueError("the RL pipeline makes one output per request (send n requests with n seeds)")
        msl = sp.max_sequence_length or 1024
        prompts, negatives = _texts(req.prompts), _negatives(req.prompts)
        scale = 1.0 if dummy else (DEFAULT_CFG_SCALE if sp.true_cfg_scale is None else float(sp.true_cfg_scale))
        guided = _check_scale(scale, negatives, "true_cfg_scale")
        generators = _generators(req)
        n, device = len(prompts), self.device

        embeds, mask = self.encode_prompt(prompts, 1, max_sequence_length=msl)
        neg_embeds = neg_mask = None
        if guided:
            neg_embeds, neg_mask = self.encode_prompt(negatives, 1, max_sequence_length=msl,
                                                      prompt_name="negative_prompt")
        h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
        latents = pack_latents(per_row_noise((1, LATENT_CHANNELS, h, w), generators, device)[:, 0])
        sigmas = qwen_sigmas(self.rl_scheduler_config, steps, height, width, self.vae_scale_factor).to(device)
        stochastic = rl["rl_noise_level"] > 0
        starts = (sde_window_starts(steps, rl["rl_sde_window_size"], rl["rl_sde_window_range"], generators)
                  if stochastic else [steps] * n)
        size = window_length(steps, rl["rl_sde_window_size"]) if stochastic else 0

        img_shapes = [[(1, h // 2, w // 2)]] * n
        self.transformer.do_true_cfg = guided  # as the stock diffuse() sets it (read by the port's hooks)
        cond = self._rl_velocity(embeds, mask, img_shapes)
        uncond = self._rl_velocity(neg_embeds, neg_mask, img_shapes) if guided else None

        def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            v = cond(x, sigma)
            return losses.apply_cfg(v, uncond(x, sigma), scale, renorm=True) if guided else v

        latents, *traj = rl_denoise(velocity, latents, sigmas, generators, starts, size,
                                    noise_level=rl["rl_noise_level"], sde_type=rl["rl_sde_type"],
                                    keep_trajectory=stochastic and rl["rl_return_trajectory"],
                                    keep_log_probs=stochastic and rl["rl_return_log_probs"])
        images = self._decode_latents(latents, height, width, "pil").output
        return request_outputs(images, latents, tuple(traj), prompt_embeds=embeds, prompt_mask=mask,
                               negative_embeds=neg_embeds, negative_mask=neg_mask, ref_latents=None,
                               sigmas=sigmas, window_starts=starts, guidance=scale)


class RLBooguImagePipeline(BooguImagePipeline):
    """Boogu-Image (Base T2I and Edit TI2I, text guidance) for RL rollouts (see the module docstring)."""

    def __init__(self, *, od_config: Any, prefix: str = "") -> None:
        super().__init__(od_config=od_config, prefix=prefix)
        self.rl_scheduler_config = read_scheduler_config(od_config.model)

    def _rl_prediction(self, latents, sigma, embeds, mask, freqs_real, refs):
        """Raw Boogu output (x0 - eps, model dtype) at t = 1 - sigma (fp32, cast to the latent dtype by the
        stock `predict`)."""
        return self.predict(t=1.0 - sigma, latents=latents.to(embeds.dtype), instruction_embeds=embeds,
                            freqs_real=freqs_real, instruction_attention_mask=mask, ref_image_hidden_states=refs)

    @torch.no_grad()
    def forward(self, req: Any) -> list[DiffusionOutput]:
        if self._is_turbo:
            raise ValueError("the RL pipeline does not support Boogu-Image Turbo (DMD 4-step); use the Base/Edit "
                             "checkpoints")
        sp = req.sampling_params_list[0]
        rl = rl_settings(req.sampling_params_list)
        dummy = req.is_dummy_run()
        height = sp.height or self.default_sample_size * self.vae_scale_factor
        width = sp.width or self.default_sample_size * self.vae_scale_factor
        if height % 16 or width % 16 or height * width > 2048 * 2048:
            raise ValueError(f"height/width must be multiples of 16 with H*W <= 2048^2, got {height}x{width}")
        steps = sp.num_inference_steps or 50
        if sp.num_outputs_per_prompt not in (0, 1):
            raise ValueError("the RL pipeline makes one output per request (send n requests with n seeds)")
        if sp.guidance_scale_2_provided and sp.guidance_scale_2 != 1.0:
            raise ValueError("image guidance (guidance_scale_2) is not part of the RL rollout contract")
        prompts, negatives = _texts(req.prompts), _negatives(req.prompts)
        scale = 1.0 if dummy else (float(sp.guidance_scale) if sp.guidance_scale_provided else DEFAULT_CFG_SCALE)
        guided = _check_scale(scale, negatives, "guidance_scale")
        generators = _generators(req)
        n, device = len(prompts), self._execution_device
        prompt_images, preprocessed = self._extract_reference_images(req.prompts)
        edit = any(im is not None for im in preprocessed)
        if edit and not all(im is not None for im in preprocessed):
            raise ValueError("a batch mixes edit and text-to-image requests")

        embeds, mask, neg_embeds, neg_mask = self.encode_prompt(
            prompts, do_classifier_free_guidance=guided, negative_prompt=negatives if guided else None,
            num_images_per_prompt=1, device=device, max_sequence_length=sp.max_sequence_length or 1280,
            input_images=[[im] for im in prompt_images] if edit else None,
        )
        # the stock encoder leaves padding positions unzeroed; the native engine (and the trainer's replay) zero them
        embeds = embeds * mask[..., None].to(embeds.dtype)
        if guided:
            neg_embeds = neg_embeds * neg_mask[..., None].to(neg_embeds.dtype)
        h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
        latents = per_row_noise((self.transformer.in_channels, h, w), generators, device)
        refs = self._build_ref_latents(preprocessed, 1, device, generators) if edit else None  # drawn after noise
        ref_latents = torch.stack([r[0] for r in refs]).float() if edit else None
        sigmas = boogu_sigmas(self.rl_scheduler_config, steps, height, width, self.vae_scale_factor).to(device)
        stochastic = rl["rl_noise_level"] > 0
        starts = (sde_window_starts(steps, rl["rl_sde_window_size"], rl["rl_sde_window_range"], generators)
                  if stochastic else [steps] * n)
        size = window_length(steps, rl["rl_sde_window_size"]) if stochastic else 0
        freqs_real = type(self).rope_freqs(self.transformer)

        def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            pos = self._rl_prediction(x, sigma, embeds, mask, freqs_real, refs)
            if not guided:
                return -pos.float()
            # the edit negative is text-only but keeps the reference latents
            neg = self._rl_prediction(x, sigma, neg_embeds, neg_mask, freqs_real, refs)
            return -self.combine_cfg_noise(pos, neg, scale).float()

        latents, *traj = rl_denoise(velocity, latents, sigmas, generators, starts, size,
                                    noise_level=rl["rl_noise_level"], sde_type=rl["rl_sde_type"],
                                    keep_trajectory=stochastic and rl["rl_return_trajectory"],
                                    keep_log_probs=stochastic and rl["rl_return_log_probs"])
        images = self._decode_output(latents, "pil", self.vae.dtype, height, width, height, width).output
        return request_outputs(images, latents, tuple(traj), prompt_embeds=embeds, prompt_mask=mask,
                               negative_embeds=neg_embeds, negative_mask=neg_mask, ref_latents=ref_latents,
                               sigmas=sigmas, window_starts=starts, guidance=scale)

    @staticmethod
    def rope_freqs(transformer: Any) -> Any:
        """The stock forward's RoPE table (`BooguImageDoubleStreamRotaryPosEmbed.get_freqs_real`)."""
        from vllm_omni.diffusion.models.boogu_image.pipeline_boogu_image import BooguImageDoubleStreamRotaryPosEmbed

        return BooguImageDoubleStreamRotaryPosEmbed.get_freqs_real(transformer.axes_dim_rope, transformer.axes_lens,
                                                                   theta=10000)


class RLWorkerExtension:
    """`worker_extension_cls` for the diffusion workers: activate a LoRA request now (runs vllm-omni's fail-closed
    bind check) and report how many adapter modules bound."""

    def rl_bind_adapter(self, lora_request: Any) -> int:
        manager = getattr(self, "lora_manager", None)
        if manager is None:
            raise RuntimeError("the diffusion worker has no LoRA manager (the engine must be built with LoRA enabled)")
        manager.set_active_adapter(lora_request, 1.0)  # raises ValueError("... binding is incomplete ...")
        return len(manager._registered_adapters[lora_request.lora_int_id].loras)
