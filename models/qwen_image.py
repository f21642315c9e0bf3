"""Qwen-Image (diffusers QwenImagePipeline layout) behind the FlowModel interface.

Conventions hidden here:
- prompts go through the Qwen-Image chat template; the encoder's last hidden states lose the 34-token system prefix
  (drop_idx), are cut to `max_sequence_length` and right-padded with a fresh 0/1 mask;
- latents are packed 2x2: (B, 16, H/8, W/8) -> (B, (H/16)(W/16), 64), channel index c*4 + 2*py + px (channel
  slowest, the opposite of Boogu);
- the transformer takes timestep = sigma (the pipeline's `t / 1000`) and predicts v = eps - x0 (diffusers convention,
  returned unchanged);
- true CFG: uncond + s*(cond - uncond), rescaled per token to the conditional norm; only with a negative prompt;
- the schedule uses the dynamic mu from the image-token count and the scheduler config, with shift_terminal.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

import torch

import losses
from models.base import FlowModel, NotLoaded, PromptEmbeds, chat_messages, per_row_noise, read_json, to_uint8

# System prompt of verl-omni's qwenimage_ocr.py converter (the pipeline drops its 34-token prefix); the data_prep
# converters bake it into the parquet's chat-message lists.
QWEN_IMAGE_SYSTEM_PROMPT = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of "
    "the objects and background:"
)

# The pipeline's prompt template and the number of tokens of its prefix (system turn + "<|im_start|>user\n").
PROMPT_PREFIX = f"<|im_start|>system\n{QWEN_IMAGE_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
PROMPT_TEMPLATE = PROMPT_PREFIX + "{}<|im_end|>\n<|im_start|>assistant\n"
DROP_IDX = 34
TOKENIZER_MAX_LENGTH = 1024  # the pipeline's hard cap on prompt tokens after the prefix
LATENT_CHANNELS = 16


def prompt_token_lengths(tokenizer: Any, prompts: Sequence[Any]) -> list[int]:
    """The token count of each prompt after the template prefix (what `max_sequence_length` cuts in
    `encode_prompt`), untruncated: needs the tokenizer only, no model."""
    ids = tokenizer([render_prompt(p) for p in prompts], truncation=False)["input_ids"]
    return [len(row) - DROP_IDX for row in ids]


def render_prompt(prompt: str | Sequence[dict[str, Any]]) -> str:
    """The text the tokenizer sees for one prompt.

    A plain string gets the pipeline template. A chat-message list (as stored in the parquet: system + user, each
    with string content) is rendered verbatim in the Qwen chat format with the assistant generation prompt; it must
    reproduce the template's system turn, because exactly DROP_IDX prefix tokens are dropped afterwards.
    """
    if isinstance(prompt, str):
        return PROMPT_TEMPLATE.format(prompt)
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(m, dict) for m in prompt):
        raise TypeError(f"a prompt must be a str or a list of chat messages (dicts), got {type(prompt).__name__}")
    text = ""
    for m in prompt:
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user") or not isinstance(content, str):
            raise ValueError(
                f"Qwen-Image prompts accept system/user messages with string content, got role={role!r}, "
                f"content type {type(content).__name__}"
            )
        text += f"<|im_start|>{role}\n{content}<|im_end|>\n"
    text += "<|im_start|>assistant\n"
    if not text.startswith(PROMPT_PREFIX) or len(prompt) != 2:
        raise ValueError(
            "Qwen-Image message prompts must be [system, user] with the Qwen-Image system prompt "
            f"({QWEN_IMAGE_SYSTEM_PROMPT!r}); the encoder drops exactly that {DROP_IDX}-token prefix. "
            "Re-create the parquet with the data_prep converter or pass plain strings."
        )
    return text


def qwen_image_sigmas(scheduler_config: dict[str, Any], num_steps: int, image_seq_len: int) -> torch.Tensor:
    """sigmas (N+1,) float32 of the released Qwen-Image scheduler: mu from the packed token count (dynamic shift),
    exponential shift, the config's terminal stretch, trailing 0 (`losses.flow_sigmas`). Shared by the wrapper and
    the vllm-omni RL pipeline."""
    cfg = scheduler_config
    mu = losses.time_shift_mu(
        image_seq_len,
        base_seq_len=cfg.get("base_image_seq_len", 256),
        max_seq_len=cfg.get("max_image_seq_len", 4096),
        base_shift=cfg.get("base_shift", 0.5),
        max_shift=cfg.get("max_shift", 1.15),
    )
    return losses.flow_sigmas(num_steps, mu=mu, shift_terminal=cfg.get("shift_terminal"))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) or (B, C, 1, H, W) -> (B, (H/2)(W/2), 4C); feature index c*4 + 2*py + px (channel slowest)."""
    if latents.ndim == 5:
        if latents.shape[2] != 1:
            raise ValueError(f"expected a single frame (B, C, 1, H, W), got {tuple(latents.shape)}")
        latents = latents[:, :, 0]
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height/width must be even to pack 2x2, got {h}x{w}")
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(packed: torch.Tensor, latent_h: int, latent_w: int) -> torch.Tensor:
    """Inverse of pack_latents: (B, (h/2)(w/2), 4C) -> (B, C, h, w)."""
    b, n, f = packed.shape
    if n != (latent_h // 2) * (latent_w // 2) or f % 4:
        raise ValueError(f"packed latents {tuple(packed.shape)} do not match a {latent_h}x{latent_w} latent grid")
    x = packed.reshape(b, latent_h // 2, latent_w // 2, f // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, f // 4, latent_h, latent_w)


def qwen_image_forward_flops(config: Any, image_tokens: int, text_tokens: Sequence[int]) -> float:
    """Forward FLOPs of `QwenImageTransformer2DModel` (diffusers 0.40) for len(text_tokens) samples of
    `image_tokens` image and text_tokens[b] text tokens; config: the transformer's config (attribute access).

    verl-omni's formula divided by 3 (it counts forward + backward), with
    dim = heads·head_dim, L layers, per sample b with n_i image and n_t text tokens:
      2·(L·12·dim² + in_channels·dim + p²·out_channels·dim)·n_i     image stream (QKV+out 4, MLP 8; in/out proj)
    + 2·(L·12·dim² + joint_attention_dim·dim)·n_t                   text stream (+ txt_in)
    + 2·L·12·dim²                                                   per-sample modulation (img_mod, txt_mod)
    + 4·L·dim·(n_i + n_t)²                                          joint attention (QK^T and AV)
    plus the per-sample terms verl-omni leaves out (< 0.01% at the released size): the timestep MLP 2·(256·dim +
    dim²) and the output modulation 2·2·dim²."""
    cfg = config
    dim = cfg.num_attention_heads * cfg.attention_head_dim
    layers, p = cfg.num_layers, cfg.patch_size
    out_channels = cfg.out_channels or cfg.in_channels
    per_image_token = 2 * (layers * 12 * dim**2 + cfg.in_channels * dim + p * p * out_channels * dim)
    per_text_token = 2 * (layers * 12 * dim**2 + cfg.joint_attention_dim * dim)
    per_sample = 2 * layers * 12 * dim**2 + 2 * (256 * dim + dim**2) + 2 * 2 * dim**2
    total = 0.0
    for n_t in text_tokens:
        n = image_tokens + int(n_t)
        total += per_image_token * image_tokens + per_text_token * int(n_t) + per_sample + 4 * layers * dim * n * n
    return float(total)


class QwenImageModel(FlowModel):
    family = "qwen_image"
    # verl-omni's Qwen-Image OCR recipe; all bind inside `transformer_blocks`.
    default_lora_targets = (
        "to_q", "to_k", "to_v", "to_out.0",
        "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )
    lora_block_prefixes = ("transformer_blocks",)
    cfg_argument = "true_cfg_scale"  # the pipelines' keyword (and user flag) for the CFG scale
    default_negative_prompt = " "  # the released pipeline's default negative prompt (one space)
    supports_reference_images = False  # text-to-image only
    vllm_omni_pipeline = "engines.vllm_omni_pipelines.RLQwenImagePipeline"  # vllm-omni's RL pipeline class

    @classmethod
    def vae_scale_factor_of(cls, vae_config: Any) -> int:
        """2^len(temperal_downsample) of the Qwen-Image VAE config."""
        return 2 ** len(vae_config.temperal_downsample)

    @classmethod
    def load_kwargs(cls, args: Any) -> dict[str, Any]:
        """--max_sequence_length: the prompt token cap of `encode_prompt`."""
        return {"max_sequence_length": args.max_sequence_length}

    @classmethod
    def prompt_token_counter(cls, model_path: str) -> Callable[[Sequence[Any]], list[int]]:
        """`prompt_token_lengths` with the pipeline folder's tokenizer (no model)."""
        from transformers import Qwen2Tokenizer

        tokenizer = Qwen2Tokenizer.from_pretrained(os.path.join(model_path, "tokenizer"))
        return functools.partial(prompt_token_lengths, tokenizer)

    @classmethod
    def vllm_omni_text(cls, system: str, user: str) -> str:
        """The user text, when the system turn is Qwen-Image's own (`render_prompt` raises otherwise)."""
        render_prompt(chat_messages(system, user))
        return user

    @classmethod
    def released_chat(cls, text: str) -> list[dict[str, str]]:
        """[QWEN_IMAGE_SYSTEM_PROMPT, text]: the pipeline's one system prompt (verl-omni's qwenimage_ocr.py rows:
        the prompt line, and the negative " " with the same system prompt)."""
        return chat_messages(QWEN_IMAGE_SYSTEM_PROMPT, text)

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: torch.nn.Module,
        text_encoder: torch.nn.Module,
        tokenizer: Any,
        scheduler_config: dict[str, Any],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_sequence_length: int = 512,
        cfg_batch: bool = False,
    ) -> None:
        super().__init__(device=device, dtype=dtype, cfg_batch=cfg_batch)
        if not 1 <= max_sequence_length <= TOKENIZER_MAX_LENGTH:
            raise ValueError(f"max_sequence_length must be in [1, {TOKENIZER_MAX_LENGTH}], got {max_sequence_length}")
        self.transformer = transformer
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.tokenizer.padding_side = "right"
        self.scheduler_config = dict(scheduler_config)
        self.max_sequence_length = max_sequence_length
        self.vae_scale_factor = self.vae_scale_factor_of(vae.config)
        self._check_scheduler_config()
        # drop_idx is only right if the tokenizer splits the template prefix into exactly DROP_IDX tokens.
        self.prefix_ids = self.tokenizer(PROMPT_PREFIX, add_special_tokens=False)["input_ids"]
        if len(self.prefix_ids) != DROP_IDX:
            raise ValueError(
                f"the tokenizer splits the Qwen-Image prompt prefix into {len(self.prefix_ids)} tokens, not "
                f"{DROP_IDX}; this is not the Qwen2.5-VL tokenizer the checkpoint expects"
            )

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_sequence_length: int = 512,
        cfg_batch: bool = False,
        transformer_only: bool = False,
    ) -> "QwenImageModel":
        """Load transformer/, vae/, text_encoder/, tokenizer/ and the raw scheduler/scheduler_config.json.
        `cfg_batch=True` runs true CFG as one forward over the doubled batch (see `guided_velocity`).
        `transformer_only=True` (trainer ranks) skips the text encoder and the VAE weights (`models.base.NotLoaded`
        keeps their configs): velocities, schedules and sizes work, prompt encoding and decoding raise."""
        for sub in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
            if not os.path.isdir(os.path.join(path, sub)):
                raise FileNotFoundError(f"{path} has no {sub}/ folder; expected a Qwen-Image pipeline directory")
        scheduler_config = read_json(os.path.join(path, "scheduler", "scheduler_config.json"), "scheduler config")
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

        transformer = QwenImageTransformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
        tokenizer = Qwen2Tokenizer.from_pretrained(os.path.join(path, "tokenizer"))
        if transformer_only:
            vae = NotLoaded("VAE", read_json(os.path.join(path, "vae", "config.json"), "VAE config"))
            text_encoder = NotLoaded("text encoder")
            transformer.to(device).eval()
        else:
            vae = AutoencoderKLQwenImage.from_pretrained(path, subfolder="vae", torch_dtype=dtype)
            text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(os.path.join(path, "text_encoder"),
                                                                              dtype=dtype)
            for m in (transformer, vae, text_encoder):
                m.to(device).eval()
            vae.requires_grad_(False)
            text_encoder.requires_grad_(False)
        return cls(
            transformer, vae, text_encoder, tokenizer, scheduler_config,
            device=device, dtype=dtype, max_sequence_length=max_sequence_length, cfg_batch=cfg_batch,
        )

    # ---- schedule ---------------------------------------------------------------------------------------------
    def _check_scheduler_config(self) -> None:
        """Fail closed on scheduler settings that `schedule` does not reproduce (it implements the released
        dynamic exponential shift + terminal stretch over 1000 train timesteps, nothing else)."""
        cfg = self.scheduler_config
        if not cfg.get("use_dynamic_shifting", False) or cfg.get("time_shift_type", "exponential") != "exponential":
            raise ValueError(
                "Qwen-Image expects a scheduler config (FlowMatchEulerDiscreteScheduler) with use_dynamic_shifting=true and "
                f"time_shift_type='exponential'; got {cfg!r}"
            )
        unsupported = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                                   "stochastic_sampling") if cfg.get(k, False)]
        if unsupported or cfg.get("num_train_timesteps", 1000) != 1000:
            raise ValueError(
                f"unsupported Qwen-Image scheduler settings {unsupported or ['num_train_timesteps']} in {cfg!r}; "
                "the wrapper reproduces the released config only"
            )

    def image_seq_len(self, height: int, width: int) -> int:
        """Number of packed image tokens (H/16)(W/16)."""
        h, w = self.latent_hw(height, width)
        return (h // 2) * (w // 2)

    def schedule(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """sigmas (N+1,) float32: dynamic mu from the token count, exponential shift, terminal stretch, trailing 0."""
        return qwen_image_sigmas(self.scheduler_config, num_steps, self.image_seq_len(height, width))

    # ---- prompts ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompt(self, prompts: Sequence[Any], images: Sequence[Any] | None = None) -> PromptEmbeds:
        """prompts: list of str or [system, user] message lists -> PromptEmbeds (B, L<=max_sequence_length, D)."""
        if images is not None and any(im is not None for im in images):
            raise ValueError("Qwen-Image (text-to-image) takes no reference images; pass images=None")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
            raise TypeError("encode_prompt takes a LIST of prompts (str or message lists), one per sample")
        if len(prompts) == 0:
            raise ValueError("encode_prompt needs at least one prompt")
        texts = [render_prompt(p) for p in prompts]
        tok = self.tokenizer(
            texts, max_length=TOKENIZER_MAX_LENGTH + DROP_IDX, padding=True, truncation=True, return_tensors="pt"
        )
        input_ids = tok["input_ids"].to(self.device)
        attention_mask = tok["attention_mask"].to(self.device)
        prefix = torch.tensor(self.prefix_ids, device=self.device)
        if not bool((input_ids[:, :DROP_IDX] == prefix).all()):
            raise RuntimeError("a tokenised prompt does not start with the Qwen-Image system prefix; cannot drop it")
        out = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        hidden = out.hidden_states[-1]  # (B, T, D)
        rows = [h[m.bool()][DROP_IDX:][: self.max_sequence_length] for h, m in zip(hidden, attention_mask)]
        joined = PromptEmbeds.cat([PromptEmbeds(r[None], torch.ones(1, r.shape[0], dtype=torch.int64, device=r.device))
                                   for r in rows])  # right-padded with zeros, mask 0 on the padding
        return PromptEmbeds(joined.embeds.to(self.dtype), joined.mask)

    # ---- latents ----------------------------------------------------------------------------------------------
    def prepare_noise(self, height: int, width: int, generators: Sequence[torch.Generator]) -> torch.Tensor:
        """fp32 noise (B, (H/16)(W/16), 64): per row a (1, 16, H/8, W/8) draw from generators[b], then packed."""
        h, w = self.latent_hw(height, width)
        noise = per_row_noise((1, LATENT_CHANNELS, h, w), generators, self.device)  # (B, 1, 16, h, w)
        return pack_latents(noise[:, 0])

    def _latent_grid(self, num_tokens: int, height: int | None, width: int | None) -> tuple[int, int]:
        """(H/8, W/8) of packed latents; square when no size is given."""
        if height is None and width is None:
            side = int(round(num_tokens**0.5))
            if side * side != num_tokens:
                raise ValueError(
                    f"packed latents with {num_tokens} tokens are not square; pass height= and width= explicitly"
                )
            return 2 * side, 2 * side
        if height is None or width is None:
            raise ValueError("pass both height and width (or neither, for square images)")
        h, w = self.latent_hw(height, width)
        if (h // 2) * (w // 2) != num_tokens:
            raise ValueError(f"{num_tokens} packed tokens do not match a {height}x{width} image")
        return h, w

    # ---- transformer ------------------------------------------------------------------------------------------
    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        prompt: PromptEmbeds,
        ref_latents: torch.Tensor | None = None,
        *,
        height: int | None = None,
        width: int | None = None,
    ) -> torch.Tensor:
        """latents (B, L, 64), sigmas (B,) -> fp32 velocity v = eps - x0, (B, L, 64).

        The timestep input is sigma, formed as the pipeline does: (1000 sigma) cast to the model dtype, / 1000.
        """
        if ref_latents is not None:
            raise ValueError("Qwen-Image (text-to-image) takes no reference latents")
        if latents.ndim != 3:
            raise ValueError(f"Qwen-Image latents must be packed (B, L, 64), got {tuple(latents.shape)}")
        b = latents.shape[0]
        if len(prompt) != b:
            raise ValueError(f"{len(prompt)} prompt rows for {b} latent rows")
        h, w = self._latent_grid(latents.shape[1], height, width)
        sigmas = self.check_sigmas(sigmas, b).to(self.device)
        timestep = (sigmas * 1000.0).to(self.dtype) / 1000
        out = self.transformer(
            hidden_states=latents.to(device=self.device, dtype=self.dtype),
            encoder_hidden_states=prompt.embeds.to(device=self.device, dtype=self.dtype),
            encoder_hidden_states_mask=prompt.mask.to(self.device),
            timestep=timestep,
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return out.float()

    def guided_velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        prompt: PromptEmbeds,
        negative: PromptEmbeds | None,
        scale: float,
        ref_latents: torch.Tensor | None = None,
        *,
        height: int | None = None,
        width: int | None = None,
    ) -> torch.Tensor:
        """True CFG with the per-token norm rescale when scale > 1 (a negative is then required); else plain.

        `self.cfg_batch` False: two forwards (prompt, then negative). True: one forward over [latents ; latents]
        with [prompt ; negative] right-padded to a common length (`cfg_batch_inputs`), split back into cond and
        uncond and combined by the same `losses.apply_cfg` call. Exact up to float rounding: in diffusers 0.40
        `QwenImageTransformer2DModel` text token i always gets RoPE position (image extent + i) whatever the
        padded width (the table is only longer), padded text keys are masked out of the joint attention
        (`encoder_hidden_states_mask`, always passed here), and everything else in the text stream is per token.
        """
        if not self.check_guidance(scale, negative, self.cfg_argument):
            return self.predict_velocity(latents, sigmas, prompt, ref_latents, height=height, width=width)
        if self.cfg_batch:
            b = latents.shape[0]
            x2, sigmas2, pair, refs2 = self.cfg_batch_inputs(latents, sigmas, prompt, negative, ref_latents)
            both = self.predict_velocity(x2, sigmas2, pair, refs2, height=height, width=width)
            cond, uncond = both[:b], both[b:]
        else:
            cond = self.predict_velocity(latents, sigmas, prompt, ref_latents, height=height, width=width)
            uncond = self.predict_velocity(latents, sigmas, negative, ref_latents, height=height, width=width)
        return losses.apply_cfg(cond, uncond, scale, renorm=True)

    def forward_flops(self, image_tokens: int, text_tokens: Sequence[int],
                      ref_tokens: Sequence[Sequence[int]] | None = None) -> float:
        """`qwen_image_forward_flops` of this transformer (text-to-image: no reference tokens)."""
        if ref_tokens is not None and any(ref_tokens):
            raise ValueError("Qwen-Image (text-to-image) takes no reference latents")
        return qwen_image_forward_flops(self.transformer.config, image_tokens, text_tokens)

    # ---- VAE --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """Packed latents (B, L, 64) -> uint8 images (B, 3, H, W): unpack, z * std + mean, VAE decode, frame 0."""
        h, w = self._latent_grid(latents.shape[1], height, width)
        z = unpack_latents(latents.to(self.device), h, w)[:, :, None]  # (B, 16, 1, h, w)
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        z = z / inv_std + mean
        images = self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0][:, :, 0]
        return to_uint8(images)
