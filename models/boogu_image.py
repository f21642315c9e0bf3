"""Boogu-Image-0.1 (Base = T2I, Edit = TI2I): the `FlowModel` wrapper around our transformer.

`BooguImageModel` -- the `models.base.FlowModel` wrapper that owns every Boogu convention: `t = 1 - sigma`
(cast to the latent dtype before the model), the output negated to the diffusers convention `v = eps - x0`,
Boogu's standard CFG, the system-prompt rule (including the empty-instruction quirk), reference images
through the VLM and the VAE, the static v1 schedule read from the raw scheduler JSON. The transformer itself,
`BooguImageTransformer2DModel`, is in `models/boogu_image_transformer.py` (one model per file, as in diffusers).

"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

import numpy as np
import PIL.Image
import torch
import torch.nn as nn

from losses import flow_sigmas, time_shift_mu
from models.base import FlowModel, NotLoaded, PromptEmbeds, chat_messages, per_row_noise, read_json, to_uint8
# the wrapper's transformer; tools/build_tiny_models.py also imports it from here (left as is: that script's sha256
# keys the cache of tiny checkpoints)
from models.boogu_image_transformer import BooguImageTransformer2DModel, boogu_image_forward_flops

BOOGU_MAX_PIXELS = 2048 * 2048  # output (and VAE reference) pixel cap of the released pipeline
VLM_MAX_PIXELS = 384 * 384  # reference-image copy shown to the VLM (released `max_vlm_input_pil_pixels`)
VLM_MAX_SIDE = 384 * 2  # released `max_vlm_input_pil_side_length`
VAE_REF_MAX_SIDE = 2048 * 2  # released `max_input_image_side_length`
IMAGE_PLACEHOLDER = "<image>"

# Text-to-image system prompt (non-empty instruction, no input image).
BOOGU_T2I_SYSTEM_PROMPT = (
    "You are a helpful assistant that generates high-quality images based on user instructions. "
    "The instructions are as follows."
)

# TI2I-unified system prompt. The released pipeline also uses it for EMPTY instructions, including the default
# negative prompt "" in text-to-image mode. Keep that quirk: "fixing" it shifts the prompt distribution.
BOOGU_TI2I_SYSTEM_PROMPT = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then explain "
    "how the user's text instruction should alter or modify the image. Generate a new image that meets the user's "
    "requirements while maintaining consistency with the original input where appropriate."
)

# verl-omni's Boogu recipe: 18 names that bind in both the trainer tree and the vllm-omni port.
BOOGU_LORA_TARGETS = (
    "to_q", "to_k", "to_v", "to_out.0",
    "img_to_q", "img_to_k", "img_to_v", "img_out",
    "instruct_to_q", "instruct_to_k", "instruct_to_v", "instruct_out",
    "feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3",
    "img_feed_forward.linear_1", "img_feed_forward.linear_2", "img_feed_forward.linear_3",
)
BOOGU_BLOCK_PREFIXES = ("double_stream_layers", "single_stream_layers", "context_refiner", "noise_refiner",
                        "ref_image_refiner")


def boogu_system_prompt(instruction: str, has_image: bool) -> str:
    """The released pipeline's rule (`system_prompt_follows_task_type=False`): T2I prompt for a non-empty
    instruction without images; the TI2I prompt otherwise -- including an EMPTY/whitespace instruction without
    images (the default negative ""). That last case is a deliberate upstream quirk; keep it."""
    if not has_image and instruction.strip():
        return BOOGU_T2I_SYSTEM_PROMPT
    return BOOGU_TI2I_SYSTEM_PROMPT


def boogu_schedule_mu(scheduler_config: dict[str, Any], *, latent_tokens: int) -> float:
    """`mu` of the exponential shift (losses.flow_sigmas) equivalent to Boogu's v1 logistic time shift.

    Reads the raw `scheduler_config.json` keys with the upstream scheduler's constructor defaults for absent
    keys (do_shift=True, dynamic_time_shift=True, time_shift_version="v2", seq_len=None, base 0.5, max 1.15).
    Static v1 (the released setting): mu = lin(seq_len); dynamic v1: mu = lin(max(1, latent_tokens // 4)) with
    latent_tokens = (H/8)(W/8); lin maps 256 -> base_shift and 4096 -> max_shift. Anything else raises.
    """
    cfg = scheduler_config
    do_shift = cfg.get("do_shift", True)
    dynamic = cfg.get("dynamic_time_shift", True)
    version = cfg.get("time_shift_version", "v2")
    seq_len = cfg.get("seq_len")
    base_shift, max_shift = float(cfg.get("base_shift", 0.5)), float(cfg.get("max_shift", 1.15))
    where = "Boogu scheduler/scheduler_config.json"
    if not do_shift:
        raise ValueError(f"{where}: do_shift=false (no time shift) is not supported; the released checkpoints use "
                         "do_shift=true, dynamic_time_shift=false, time_shift_version='v1', seq_len=4096")
    if version != "v1":
        raise ValueError(f"{where}: time_shift_version={version!r} is not supported (only the released 'v1' "
                         "logistic shift maps onto losses.flow_sigmas); a missing key means upstream's default 'v2'")
    if dynamic:
        tokens = max(1, int(latent_tokens) // 4)
    else:
        if seq_len is None or int(seq_len) <= 0:
            raise ValueError(f"{where}: static v1 shift needs seq_len > 0 (upstream silently applies no shift "
                             f"otherwise), got seq_len={seq_len!r}")
        tokens = int(seq_len)
    return time_shift_mu(tokens, base_seq_len=256, max_seq_len=4096, base_shift=base_shift, max_shift=max_shift)


def _to_pil(image: Any) -> PIL.Image.Image:
    """PIL image or uint8 (3, H, W) tensor -> RGB PIL image."""
    if isinstance(image, PIL.Image.Image):
        return image.convert("RGB")
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"reference image tensors must be uint8 (3, H, W), got {image.dtype} {tuple(image.shape)}")
        return PIL.Image.fromarray(image.permute(1, 2, 0).cpu().numpy())
    raise TypeError(f"reference image must be a PIL.Image or a uint8 (3, H, W) tensor, got {type(image).__name__}")


def _fit_size(height: int, width: int, *, max_pixels: int, max_side: int, multiple: int = 16) -> tuple[int, int]:
    """The released BooguImageProcessor size rule: scale down (never up) so that H*W <= max_pixels and the
    longer side <= max_side, then floor each side to a multiple of `multiple`."""
    ratio = min((max_pixels / (height * width)) ** 0.5, max_side / max(height, width), 1.0)
    new_h, new_w = int(height * ratio) // multiple * multiple, int(width * ratio) // multiple * multiple
    if new_h <= 0 or new_w <= 0:
        raise ValueError(f"reference image {width}x{height} is too small (needs at least {multiple} px per side)")
    return new_h, new_w


def vlm_reference_image(image: Any) -> PIL.Image.Image:
    """The reference-image copy given to the VLM: <= 384*384 pixels, <= 768 per side, multiples of 16 (lanczos)."""
    pil = _to_pil(image)
    h, w = _fit_size(pil.height, pil.width, max_pixels=VLM_MAX_PIXELS, max_side=VLM_MAX_SIDE)
    return pil if (h, w) == (pil.height, pil.width) else pil.resize((w, h), resample=PIL.Image.LANCZOS)


def reference_size(image: Any) -> tuple[int, int]:
    """(height, width) of the VAE copy of a reference image (<= 2048*2048 pixels, <= 4096 per side, multiples of
    16). With one reference the released pipeline generates at this size (`align_res=True`)."""
    pil = _to_pil(image)
    return _fit_size(pil.height, pil.width, max_pixels=BOOGU_MAX_PIXELS, max_side=VAE_REF_MAX_SIDE)


def _messages_to_conversation(messages: Sequence[dict[str, Any]], image: Optional[PIL.Image.Image]) -> list[dict]:
    """Parquet chat messages [{"role", "content": str}] -> typed-content conversation; each "<image>" in a user
    message consumes the sample's reference image (exactly one placeholder when an image is given, none else)."""
    conversation, used = [], 0
    for message in messages:
        role, content = message["role"], message["content"]
        if not isinstance(content, str):
            raise ValueError(f"chat message content must be a string, got {type(content).__name__}")
        parts: list[dict[str, Any]] = []
        pieces = content.split(IMAGE_PLACEHOLDER) if role == "user" else [content]
        for k, text in enumerate(pieces):
            if k > 0:
                used += 1
                if image is None or used > 1:
                    raise ValueError(f"chat message has {used} '{IMAGE_PLACEHOLDER}' placeholder(s) but the sample "
                                     f"carries {0 if image is None else 1} reference image(s)")
                parts.append({"type": "image", "image": image})
            if text or len(pieces) == 1:
                parts.append({"type": "text", "text": text})
        conversation.append({"role": role, "content": parts})
    if image is not None and used == 0:
        raise ValueError(f"a reference image was given but the chat messages have no '{IMAGE_PLACEHOLDER}' "
                         "placeholder; Boogu edit prompts put the image in the user message (text-only negatives "
                         "are encoded without images)")
    return conversation


def _string_to_conversation(instruction: str, image: Optional[PIL.Image.Image]) -> list[dict]:
    """Released layout: [system, user(reference image first, then the instruction text)]."""
    user = ([{"type": "image", "image": image}] if image is not None else []) + [{"type": "text", "text": instruction}]
    return [{"role": "system", "content": [{"type": "text", "text": boogu_system_prompt(instruction, image is not None)}]},
            {"role": "user", "content": user}]


class BooguImageModel(FlowModel):
    """Boogu-Image-0.1 Base/Edit behind the `FlowModel` interface (diffusers conventions outside, Boogu inside).

    Loads a pipeline directory: transformer/ (our `BooguImageTransformer2DModel`, or upstream's with
    `use_upstream_transformer=True`), mllm/ (Qwen3-VL; its inner model's post-norm last_hidden_state are the
    instruction features), processor/ (Qwen3VLProcessor), vae/ (AutoencoderKL, scaling/shift from its config),
    scheduler/scheduler_config.json (read raw: diffusers would drop its custom keys).
    """

    family = "boogu_image"
    default_lora_targets = BOOGU_LORA_TARGETS
    lora_block_prefixes = BOOGU_BLOCK_PREFIXES
    # the 40 blocks over the joint sequence; the refiners (2 per stream, ~5% of the FLOPs at 512^2, each class its
    # own compilations) stay eager
    compile_block_prefixes = ("double_stream_layers", "single_stream_layers")
    cfg_argument = "guidance_scale"  # the pipelines' keyword (and user flag) for the CFG scale
    default_negative_prompt = ""  # the released pipeline's default negative prompt (empty: the TI2I system prompt)
    supports_reference_images = True  # Edit: one reference image per prompt ("<image>" in the user message)
    vllm_omni_pipeline = "engines.vllm_omni_pipelines.RLBooguImagePipeline"  # vllm-omni's RL pipeline class

    @classmethod
    def default_size(cls, reference: Any | None = None) -> tuple[int, int]:
        """The released pipeline's output size for one reference image (`reference_size`); 512x512 without one."""
        return reference_size(reference) if reference is not None else (512, 512)

    @classmethod
    def vae_scale_factor_of(cls, vae_config: Any) -> int:
        """2^(len(block_out_channels) - 1) of the Boogu-Image VAE config (AutoencoderKL)."""
        return 2 ** (len(vae_config.block_out_channels) - 1)

    @classmethod
    def vllm_omni_text(cls, system: str, user: str) -> str:
        """The instruction (a leading "<image>" dropped) when the chat is the released layout: the system prompt
        by the T2I/TI2I rule (`boogu_system_prompt`), at most one leading "<image>"; ValueError otherwise."""
        has_image = user.startswith(IMAGE_PLACEHOLDER)
        text = user[len(IMAGE_PLACEHOLDER):] if has_image else user
        if system != boogu_system_prompt(text, has_image) or IMAGE_PLACEHOLDER in text:
            raise ValueError("the vllm_omni engine takes Boogu message prompts only when they equal the released "
                             "[system, user] layout (system prompt by the T2I/TI2I rule, at most one leading <image>); "
                             "use --rollout_engine native for custom system prompts")
        return text

    @classmethod
    def released_chat(cls, text: str) -> list[dict[str, str]]:
        """[system by `boogu_system_prompt`, text]: BOOGU_T2I_SYSTEM_PROMPT for a non-empty text, and
        BOOGU_TI2I_SYSTEM_PROMPT for the default negative "" ON PURPOSE: the released pipeline encodes every empty
        instruction with it. Do not "fix" it."""
        return chat_messages(boogu_system_prompt(text, has_image=False), text)

    def __init__(self, *, transformer: nn.Module, text_encoder: nn.Module, processor: Any, vae: nn.Module,
                 scheduler_config: dict[str, Any], device: Union[torch.device, str] = "cpu",
                 dtype: torch.dtype = torch.float32, freqs_cis: Optional[Sequence[torch.Tensor]] = None,
                 cfg_batch: bool = False) -> None:
        super().__init__(device=device, dtype=dtype, cfg_batch=cfg_batch)
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.processor = processor
        self.vae = vae
        self.scheduler_config = scheduler_config
        self.vae_scale_factor = self.vae_scale_factor_of(vae.config)
        self.latent_channels = transformer.config.in_channels
        self.scaling_factor = float(vae.config.scaling_factor)
        self.shift_factor = float(vae.config.shift_factor or 0.0)
        self._freqs_cis = freqs_cis  # only for the upstream class, which takes the tables as an argument
        boogu_schedule_mu(scheduler_config, latent_tokens=4096)  # unsupported settings fail at load time

    @classmethod
    def from_pretrained(cls, path: str, *, device: Union[torch.device, str] = "cpu",
                        dtype: torch.dtype = torch.float32, use_upstream_transformer: bool = False,
                        cfg_batch: bool = False, transformer_only: bool = False) -> "BooguImageModel":
        """Load a Boogu-Image pipeline directory in `dtype` on `device`; every module is in eval mode with
        requires_grad off (trainers add LoRA parameters, or re-enable what they fine-tune).

        `use_upstream_transformer=True` imports the transformer class from the upstream `boogu` package instead
        of ours (raises ImportError when it is not importable; never a silent fallback). Upstream picks its
        attention kernels from the process environment variable `device` at import time (flash-attn and triton
        when it contains "cuda" and they are installed, SDPA otherwise): set it before loading.

        `cfg_batch=True` runs CFG as one forward over the doubled batch (see `guided_velocity`).

        `transformer_only=True` (trainer ranks) skips the MLLM and the VAE weights (`models.base.NotLoaded` keeps
        their configs): velocities, schedules and sizes work, prompt encoding, reference encoding and decoding
        raise."""
        from diffusers import AutoencoderKL
        from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor

        index = read_json(os.path.join(path, "model_index.json"), "model_index.json")
        if index.get("_class_name") != "BooguImagePipeline":
            raise ValueError(f"{path}/model_index.json: _class_name={index.get('_class_name')!r}, expected "
                             "'BooguImagePipeline'")
        for sub in ("transformer", "mllm", "processor", "vae", "scheduler"):
            if not os.path.isdir(os.path.join(path, sub)):
                raise FileNotFoundError(f"{path} has no {sub}/ folder; a Boogu-Image pipeline needs transformer/ "
                                        "mllm/ processor/ scheduler/ vae/")
        scheduler_config = read_json(os.path.join(path, "scheduler", "scheduler_config.json"), "Boogu scheduler config")
        boogu_schedule_mu(scheduler_config, latent_tokens=4096)  # unsupported settings fail before any weight loads

        freqs_cis = None
        if use_upstream_transformer:
            try:
                from boogu.models.transformers.rope import BooguImageRotaryPosEmbed
                from boogu.models.transformers.transformer_boogu import (
                    BooguImageTransformer2DModel as transformer_cls,
                )
            except ImportError as e:
                raise ImportError("use_upstream_transformer=True needs the upstream `boogu` package (and einops) "
                                  "importable; install Boogu-Image with --no-deps or drop the flag") from e
        else:
            transformer_cls = BooguImageTransformer2DModel
        transformer = transformer_cls.from_pretrained(os.path.join(path, "transformer"), torch_dtype=dtype)
        if use_upstream_transformer:
            cfg = transformer.config
            freqs_cis = BooguImageRotaryPosEmbed.get_freqs_cis(cfg.axes_dim_rope, cfg.axes_lens, theta=10000)
        processor = Qwen3VLProcessor.from_pretrained(os.path.join(path, "processor"))
        if transformer_only:
            text_encoder = NotLoaded("MLLM (text encoder)")
            vae = NotLoaded("VAE", read_json(os.path.join(path, "vae", "config.json"), "VAE config"))
            transformer.to(device).eval().requires_grad_(False)
        else:
            mllm = Qwen3VLForConditionalGeneration.from_pretrained(os.path.join(path, "mllm"), dtype=dtype)
            text_encoder = mllm.model  # the released pipeline drops lm_head (only its prompt rewriter needs it)
            vae = AutoencoderKL.from_pretrained(os.path.join(path, "vae"), torch_dtype=dtype)
            for module in (transformer, text_encoder, vae):
                module.to(device).eval().requires_grad_(False)
        return cls(transformer=transformer, text_encoder=text_encoder, processor=processor, vae=vae,
                   scheduler_config=scheduler_config, device=device, dtype=dtype, freqs_cis=freqs_cis,
                   cfg_batch=cfg_batch)

    # ---- sizes and schedule ----------------------------------------------------------------------------------
    def validate_size(self, height: int, width: int) -> None:
        super().validate_size(height, width)
        if height * width > BOOGU_MAX_PIXELS:
            raise ValueError(f"boogu_image: {width}x{height} = {height * width} pixels exceeds the released "
                             f"pipeline's 2048*2048 = {BOOGU_MAX_PIXELS} limit; lower height/width")

    def schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """sigmas (N+1,) float32: Boogu's v1 time shift as `losses.flow_sigmas(N, mu)` (released: mu = 1.15 at
        every resolution), no terminal stretch."""
        h, w = self.latent_hw(height, width)
        return flow_sigmas(num_steps, mu=boogu_schedule_mu(self.scheduler_config, latent_tokens=h * w))

    # ---- prompts -----------------------------------------------------------------------------------------------
    def tokenize_prompts(self, prompts: Sequence[Any], images: Optional[Sequence[Any]] = None):
        """Processor inputs (input_ids, attention_mask, mm_token_type_ids, pixel_values, image_grid_thw) for
        `encode_prompt`: chat template without a generation prompt, right padding. See `encode_prompt`."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise TypeError("prompts must be a non-empty list of str or of chat-message lists")
        if images is None:
            images = [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"got {len(images)} images for {len(prompts)} prompts (use None for text-only rows)")
        conversations = []
        for prompt, image in zip(prompts, images):
            vlm_image = None if image is None else vlm_reference_image(image)
            if isinstance(prompt, str):
                conversations.append(_string_to_conversation(prompt, vlm_image))
            else:
                conversations.append(_messages_to_conversation(prompt, vlm_image))
        inputs = self.processor.apply_chat_template(
            conversations, tokenize=True, return_dict=True, return_tensors="pt", add_generation_prompt=False,
            processor_kwargs=dict(padding=True, padding_side="right"),
        )
        mask = inputs["attention_mask"]
        if not torch.equal(mask.bool(), torch.arange(mask.shape[1])[None] < mask.sum(1, keepdim=True)):
            raise RuntimeError("the Qwen3-VL processor did not right-pad the instructions; Boogu needs right padding")
        return inputs

    @torch.no_grad()
    def encode_prompt(self, prompts: Sequence[Any], images: Optional[Sequence[Any]] = None) -> PromptEmbeds:
        """Encode a batch of instructions with the Qwen3-VL encoder.

        prompts: list of str (the released system-prompt rule is applied) or list of chat-message lists
            [{"role", "content": str}] (used verbatim; "<image>" in user content consumes the sample's image).
        images: None or a per-sample list of None / reference image (PIL or uint8 (3, H, W)); the VLM sees a
            copy resized to <= 384*384 pixels (multiples of 16). Negatives in edit are encoded WITHOUT images.
        Returns right-padded embeds (B, L, D) in the model dtype (padding zeroed) and mask (B, L) int64.
        """
        inputs = self.tokenize_prompts(prompts, images)
        inputs = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        features = self.text_encoder(**inputs).last_hidden_state
        mask = inputs["attention_mask"].to(torch.int64)
        return PromptEmbeds(features.to(self.dtype) * mask[..., None].to(self.dtype), mask)

    # ---- latents -----------------------------------------------------------------------------------------------
    def prepare_noise(self, height: int, width: int, generators: Sequence[torch.Generator]) -> torch.Tensor:
        """fp32 noise (B, 16, H/8, W/8); row b drawn only from generators[b]."""
        h, w = self.latent_hw(height, width)
        return per_row_noise((self.latent_channels, h, w), generators, self.device)

    @torch.no_grad()
    def encode_reference(self, images: Sequence[Any], generators: Sequence[torch.Generator]) -> torch.Tensor:
        """Reference latents (B, 16, h, w) fp32: each image resized as the released pipeline does (<= 2048*2048
        pixels, <= 4096 per side, multiples of 16, lanczos), VAE-encoded with a latent sample drawn from its row's
        generator, then `(z - shift_factor) * scaling_factor`. All images must give the same size."""
        if len(images) != len(generators):
            raise ValueError(f"got {len(generators)} generators for {len(images)} reference images")
        if any(image is None for image in images):
            raise ValueError("encode_reference needs a reference image for every row (reference latents are one "
                             "(B, 16, h, w) tensor); run text-to-image rows in a separate batch")
        latents = []
        for image, generator in zip(images, generators):
            pil = _to_pil(image)
            h, w = _fit_size(pil.height, pil.width, max_pixels=BOOGU_MAX_PIXELS, max_side=VAE_REF_MAX_SIDE)
            if (h, w) != (pil.height, pil.width):
                pil = pil.resize((w, h), resample=PIL.Image.LANCZOS)
            pixels = torch.from_numpy(np.asarray(pil, dtype=np.float32) / 255.0).permute(2, 0, 1)
            pixels = (pixels * 2 - 1)[None].to(self.device, self.dtype)
            z = self.vae.encode(pixels).latent_dist.sample(generator=generator)
            latents.append(((z.float() - self.shift_factor) * self.scaling_factor)[0])
        if len({tuple(z.shape) for z in latents}) != 1:
            raise ValueError(f"reference images give different latent sizes {[tuple(z.shape) for z in latents]}; "
                             "batch references of one size (resize them to the output size first)")
        return torch.stack(latents)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, height: Optional[int] = None,
               width: Optional[int] = None) -> torch.Tensor:
        """Latents (B, 16, H/8, W/8) -> uint8 images (B, 3, H, W). `height`/`width` (optional) are checked."""
        self._check_latent_size(latents, height, width)
        z = latents.to(self.device, self.dtype) / self.scaling_factor + self.shift_factor
        return to_uint8(self.vae.decode(z, return_dict=False)[0])

    # ---- the model ---------------------------------------------------------------------------------------------
    def _boogu_forward(self, latents: torch.Tensor, sigmas: torch.Tensor, prompt: PromptEmbeds,
                       ref_latents: Optional[torch.Tensor]) -> torch.Tensor:
        """Raw transformer output u = x0 - eps in the model dtype. t = 1 - sigma (float32), then cast to the
        latent (= model) dtype before the model scales it by 1000, as the released pipeline rounds it."""
        batch = latents.shape[0]
        sigmas = self.check_sigmas(sigmas, batch).to(self.device)
        if len(prompt) != batch:
            raise ValueError(f"prompt batch {len(prompt)} != latent batch {batch}")
        x = latents.to(self.device, self.dtype)
        t = (1.0 - sigmas).to(x.dtype)
        refs = None
        if ref_latents is not None:
            if ref_latents.ndim != 4 or ref_latents.shape[0] != batch:
                raise ValueError(f"ref_latents must be (B, C, h, w) with B={batch}, got {tuple(ref_latents.shape)}")
            refs = [[r] for r in ref_latents.to(self.device, self.dtype)]
        return self.transformer(x, t, prompt.embeds.to(self.device, self.dtype), self._freqs_cis,
                                prompt.mask.to(self.device), ref_image_hidden_states=refs)

    def forward_flops(self, image_tokens: int, text_tokens: Sequence[int],
                      ref_tokens: Optional[Sequence[Sequence[int]]] = None) -> float:
        """`boogu_image_forward_flops` of this transformer."""
        return boogu_image_forward_flops(self.transformer.config, image_tokens, text_tokens, ref_tokens)

    def _check_latent_size(self, latents: torch.Tensor, height: Optional[int], width: Optional[int]) -> None:
        """The FlowModel contract passes the image size along (packed layouts need it); Boogu latents carry it, so
        a given size only has to agree with them."""
        if height is None and width is None:
            return
        if height is None or width is None:
            raise ValueError(f"pass both height and width or neither, got height={height}, width={width}")
        expected = self.latent_hw(height, width)
        if tuple(latents.shape[-2:]) != expected:
            raise ValueError(f"latents {tuple(latents.shape)} do not match a {height}x{width} image")

    def predict_velocity(self, latents: torch.Tensor, sigmas: torch.Tensor, prompt: PromptEmbeds,
                         ref_latents: Optional[torch.Tensor] = None, *, height: Optional[int] = None,
                         width: Optional[int] = None) -> torch.Tensor:
        """Velocity v = eps - x0 (fp32, diffusers convention) at sigmas (B,): the NEGATED Boogu output."""
        self._check_latent_size(latents, height, width)
        return -self._boogu_forward(latents, sigmas, prompt, ref_latents).float()

    def guided_velocity(self, latents: torch.Tensor, sigmas: torch.Tensor, prompt: PromptEmbeds,
                        negative: Optional[PromptEmbeds], scale: float,
                        ref_latents: Optional[torch.Tensor] = None, *, height: Optional[int] = None,
                        width: Optional[int] = None) -> torch.Tensor:
        """Boogu text CFG with `guidance_scale` (released default 4.0): `pos + (s - 1) * (pos - neg)` in that
        order and in the model dtype, as the released pipeline computes it, then negated to fp32. In edit the
        negative forward keeps the reference latents (text-only negative). scale <= 1 -> predict_velocity.

        `self.cfg_batch` False: two forwards (prompt, then negative). True: one forward over [latents ; latents]
        with [prompt ; negative] right-padded to a common length and the reference latents duplicated
        (`cfg_batch_inputs`), split back into pos and neg and combined by the same expression. Exact up to float
        rounding: each sample's noise/reference RoPE positions start at its own valid instruction length (not the
        padded width), padded instruction keys are masked in every attention, and the rest is per token."""
        self._check_latent_size(latents, height, width)
        if not self.check_guidance(scale, negative, self.cfg_argument):
            return self.predict_velocity(latents, sigmas, prompt, ref_latents)
        if self.cfg_batch:
            b = latents.shape[0]
            both = self._boogu_forward(*self.cfg_batch_inputs(latents, sigmas, prompt, negative, ref_latents))
            pos, neg = both[:b], both[b:]
        else:
            pos = self._boogu_forward(latents, sigmas, prompt, ref_latents)
            neg = self._boogu_forward(latents, sigmas, negative, ref_latents)
        return -(pos + (scale - 1.0) * (pos - neg)).float()
