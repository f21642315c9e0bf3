"""The models: VAE and transformer configs, the VAE's 2D fast path and latent statistics, and flow matching
through the Qwen-Image wrapper's conventions (training loss, ODE sampling, the start-point rule)."""

from __future__ import annotations

import types
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """RoPE axes (frame, height, width) summing to head_dim, all even: (16, 56, 56) at 128 as released."""
    a = max(2, (head_dim // 8) // 2 * 2)
    b = ((head_dim - a) // 2) // 2 * 2
    c = head_dim - a - b
    if min(a, b, c) <= 0 or a % 2 or b % 2 or c % 2:
        raise ValueError(f"head_dim {head_dim} cannot be split into three even RoPE axes")
    return a, b, c


def vae_config(base_dim: int, num_res_blocks: int) -> dict[str, Any]:
    """A small AutoencoderKLQwenImage: x8 spatial (3 downsamples), 16 latent channels as the wrapper expects."""
    return {"base_dim": base_dim, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": num_res_blocks,
            "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0}


def transformer_config(layers: int, width: int, head_dim: int, text_dim: int) -> dict[str, Any]:
    """A small QwenImageTransformer2DModel: packed 2x2 input (64 = 16 x 4 features), 16 output channels."""
    if width % head_dim:
        raise ValueError(f"--width {width} must be a multiple of --head_dim {head_dim}")
    return {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": layers,
            "attention_head_dim": head_dim, "num_attention_heads": width // head_dim,
            "joint_attention_dim": text_dim, "guidance_embeds": False, "axes_dims_rope": list(rope_axes(head_dim))}


def causal_convs(vae: torch.nn.Module) -> list[torch.nn.Module]:
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    return [m for m in vae.modules() if isinstance(m, QwenImageCausalConv3d)]


def is_frame_conv(conv: torch.nn.Module) -> bool:
    """A causal conv whose one-frame output uses only its last temporal tap (2*p_t zero frames before frame 0,
    kernel k_t = 2*p_t + 1, temporal stride 1); the temporal down/up-sampling convs are not, and never run on
    single frames."""
    kt = conv.kernel_size[0]
    return (conv._padding[4] == kt - 1 and conv._padding[5] == 0 and conv.stride[0] == 1
            and tuple(conv.dilation) == (1, 1, 1) and conv.groups == 1)


def build_vae(config: dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLQwenImage(**config) with the unused temporal taps of its frame convs zeroed.

    For a single frame, y = sum_k W[:, :, k] * pad(x)[k] with pad = 2 p_t zero frames, so only the last tap
    W[:, :, k_t - 1] ever sees data; zeroing the others makes the model exactly a per-frame image VAE (and the
    shipped file compresses) without changing any one-frame output.
    """
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(**config)
    with torch.no_grad():
        for conv in causal_convs(vae):
            if is_frame_conv(conv) and conv.kernel_size[0] > 1:
                conv.weight[:, :, :-1].zero_()
    return vae


def _frame_conv_forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[2] != 1 or cache_x is not None:
        return type(self).forward(self, x, cache_x)
    pad_w, pad_h = self._padding[0], self._padding[2]
    y = F.conv2d(x[:, :, 0], self.weight[:, :, -1], self.bias, stride=tuple(self.stride[1:]), padding=(pad_h, pad_w))
    return y.unsqueeze(2)


class Fast2dConvs:
    """Context manager: the VAE's frame convs run as Conv2d with their last temporal tap on one-frame inputs.

    Same numbers as the video path (see `build_vae`; `tests/test_pretrain_ocr_mini.py` checks it against
    `vae.encode` / `vae.decode`), without the 3x zero-padded temporal taps and the 3D kernels: the measured video
    VAE trained at ~700 images/s on an H200 at 128^2. Multi-frame inputs fall back to the original forward.
    """

    def __init__(self, vae: torch.nn.Module):
        self.convs = [c for c in causal_convs(vae) if is_frame_conv(c)]
        self.patched: list[torch.nn.Module] = []

    def __enter__(self) -> "Fast2dConvs":
        self.patched = [c for c in self.convs if "forward" not in c.__dict__]  # re-entrant: nested = no-op
        for conv in self.patched:
            conv.forward = types.MethodType(_frame_conv_forward, conv)
        return self

    def __exit__(self, *exc: Any) -> None:
        for conv in self.patched:
            conv.__dict__.pop("forward", None)
        self.patched = []


def vae_posterior(vae: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """images uint8 (B, 3, H, W) -> posterior (mean, logvar), each (B, 16, 1, H/8, W/8), as `vae.encode` computes
    them (logvar clamped to [-30, 20]); run it inside `Fast2dConvs` for speed."""
    x = (images.float() / 127.5 - 1.0)[:, :, None]
    h = vae.quant_conv(vae.encoder(x))
    mean, logvar = h.chunk(2, dim=1)
    return mean, logvar.clamp(-30.0, 20.0)


def vae_decode_train(vae: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    """Unclamped decoder output (B, 3, 1, H, W) of latents (B, 16, 1, h, w) (`vae.decode` clamps to [-1, 1])."""
    return vae.decoder(vae.post_quant_conv(z))


def vae_loss(vae: torch.nn.Module, images: torch.Tensor, kl_weight: float,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """L1(decode(z), x) + kl_weight * KL, z ~ N(mean, exp(logvar)) (reparameterised).

    KL is the per-element mean of 0.5 (mean^2 + exp(logvar) - 1 - logvar) against N(0, 1). Returns (total, l1, kl).
    """
    mean, logvar = vae_posterior(vae, images)
    noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    z = mean + torch.exp(0.5 * logvar) * noise
    recon = vae_decode_train(vae, z)
    x = (images.float() / 127.5 - 1.0)[:, :, None]
    l1 = (recon.float() - x).abs().mean()
    kl = 0.5 * (mean.float() ** 2 + logvar.float().exp() - 1.0 - logvar.float()).mean()
    return l1 + kl_weight * kl, l1.detach(), kl.detach()


@torch.no_grad()
def latent_stats(vae: torch.nn.Module, images: torch.Tensor, batch: int, amp: Callable) -> tuple[list, list]:
    """Per-channel mean and std (lists of 16 floats) of the posterior means of `images` (over batch, H, W)."""
    total = torch.zeros(16, dtype=torch.float64, device=images.device)
    total_sq = torch.zeros_like(total)
    count = 0
    with Fast2dConvs(vae), amp():
        for i in range(0, images.shape[0], batch):
            mean = vae_posterior(vae, images[i:i + batch])[0].double()
            total += mean.sum(dim=(0, 2, 3, 4))
            total_sq += (mean ** 2).sum(dim=(0, 2, 3, 4))
            count += mean.numel() // 16
    mu = total / count
    std = (total_sq / count - mu ** 2).clamp_min(1e-12).sqrt()
    return [float(v) for v in mu], [float(v) for v in std]


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, images: torch.Tensor, batch: int, amp: Callable) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> packed normalised latents (N, (H/16)(W/16), 64) bf16: posterior mean,
    (z - latents_mean) / latents_std per channel (the inverse of `QwenImageModel.decode`), then `pack_latents`."""
    from models.qwen_image import pack_latents

    cfg = vae.config
    mean_c = torch.tensor(cfg.latents_mean, device=images.device).view(1, -1, 1, 1)
    std_c = torch.tensor(cfg.latents_std, device=images.device).view(1, -1, 1, 1)
    parts = []
    with Fast2dConvs(vae), amp():
        for i in range(0, images.shape[0], batch):
            z = vae_posterior(vae, images[i:i + batch])[0][:, :, 0].float()
            parts.append(pack_latents((z - mean_c) / std_c).to(torch.bfloat16))
    return torch.cat(parts)


@torch.no_grad()
def vae_reconstruct(vae: torch.nn.Module, images: torch.Tensor, amp: Callable) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> uint8 reconstructions through `vae.decode` (the path the wrapper and RL use)."""
    from models.base import to_uint8

    with amp():
        with Fast2dConvs(vae):
            mean = vae_posterior(vae, images)[0]
        recon = vae.decode(mean, return_dict=False)[0][:, :, 0]
    return to_uint8(recon).cpu()


def adaln_zero_init(transformer: torch.nn.Module) -> None:
    """DiT's adaLN-Zero: zero the modulation Linears (shift = scale = gate = 0, so each block starts as the
    identity), the output norm's modulation and the output projection (the initial velocity is 0)."""
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            for mod in (block.img_mod[1], block.txt_mod[1]):
                mod.weight.zero_()
                mod.bias.zero_()
        transformer.norm_out.linear.weight.zero_()
        transformer.norm_out.linear.bias.zero_()
        transformer.proj_out.weight.zero_()
        transformer.proj_out.bias.zero_()


def round_to_bf16_(module: torch.nn.Module) -> None:
    """Round every parameter to bf16 in place (kept in its dtype): the weights then equal the shipped ones."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def params_finite(module: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Flow matching through the wrapper's conventions
# ---------------------------------------------------------------------------------------------------------------


def schedule_mu(scheduler_config: dict[str, Any], image_seq_len: int) -> float:
    """The dynamic shift mu of the Qwen-Image scheduler at `image_seq_len` packed tokens (the value
    `models.qwen_image.qwen_image_sigmas` uses; a test checks they agree)."""
    import losses

    cfg = scheduler_config
    return losses.time_shift_mu(image_seq_len, base_seq_len=cfg.get("base_image_seq_len", 256),
                                max_seq_len=cfg.get("max_image_seq_len", 4096), base_shift=cfg.get("base_shift", 0.5),
                                max_shift=cfg.get("max_shift", 1.15))


def train_sigmas(n: int, mu: float, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """(n,) fp32 training sigmas: logit-normal u = sigmoid(N(0, 1)) through the schedule's exponential shift.

    sigma = e^mu / (e^mu + (1/u - 1)); with u = sigmoid(n), 1/u - 1 = e^-n, so sigma = sigmoid(n + mu): the
    median sigma is sigmoid(mu), the shifted midpoint of the sampling schedule.
    """
    normal = torch.randn(n, generator=generator, device=device, dtype=torch.float32)
    return torch.sigmoid(normal + mu)


def flow_matching_loss(model, x0: torch.Tensor, prompt, sigmas: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the wrapper's velocity against v = eps - x0 at x_s = (1 - s) x0 + s eps.

    x0, noise: packed latents (B, L, 64); sigmas (B,); `model.predict_velocity` applies the transformer conventions
    (timestep = sigma, img_shapes from the packed grid, fp32 output).
    """
    s = sigmas.view(-1, 1, 1)
    x_s = (1.0 - s) * x0 + s * noise
    velocity = model.predict_velocity(x_s, sigmas, prompt)
    return F.mse_loss(velocity, noise - x0)


@torch.no_grad()
def encode_prompts(model, prompts: Sequence[Any], chunk: int = 64):
    """`model.encode_prompt` of each distinct prompt once (in chunks: the tiny encoder's forward also computes
    its 152k-token logits), indexed back to one row per prompt, right-padded to the longest."""
    from models.base import PromptEmbeds

    unique = list(dict.fromkeys(prompts))
    parts = [model.encode_prompt(unique[i:i + chunk]) for i in range(0, len(unique), chunk)]
    table = PromptEmbeds.cat(parts)
    where = {p: i for i, p in enumerate(unique)}
    return table.index([where[p] for p in prompts])


@torch.no_grad()
def sample_latents(model, prompts: Sequence[str], seeds: Sequence[int], steps: int, size: int, amp: Callable,
                   batch: int = 256) -> torch.Tensor:
    """fp32 packed latents (B, (size/16)^2, 64) of the native engine's ODE rollout: per-row generators seeded from
    `seeds` for the noise, the model's schedule, `rollout.rl_denoise` with noise_level 0, true CFG off."""
    import rollout

    with amp():
        embeds = encode_prompts(model, prompts)
    sigmas = model.schedule(steps, size, size).to(model.device)
    out = []
    for i in range(0, len(prompts), batch):
        rows = list(range(i, min(len(prompts), i + batch)))
        generators = [torch.Generator(device="cpu").manual_seed(int(seeds[r])) for r in rows]
        prompt = embeds.index(rows)
        with amp():
            latents = model.prepare_noise(size, size, generators).to(model.device)
            velocity_fn = lambda x, sigma: model.guided_velocity(  # noqa: E731
                x, sigma, prompt, None, 1.0, height=size, width=size)
            out.append(rollout.rl_denoise(velocity_fn, latents, sigmas, generators, [steps] * len(rows), 0,
                                          noise_level=0.0, sde_type="sde", keep_trajectory=False,
                                          keep_log_probs=False)[0])
    return torch.cat(out)


@torch.no_grad()
def sample_images(model, prompts: Sequence[str], seeds: Sequence[int], steps: int, size: int, amp: Callable,
                  batch: int = 256) -> torch.Tensor:
    """uint8 (B, 3, size, size) on the CPU: `sample_latents`, then the wrapper's decode."""
    latents = sample_latents(model, prompts, seeds, steps, size, amp, batch)
    with amp():
        return torch.cat([model.decode(latents[i:i + batch], height=size, width=size).cpu()
                          for i in range(0, latents.shape[0], batch)])


def start_point_action(mean: float, previous_mean: float | None, *, window: tuple[float, float],
                       stop_reward: float) -> str:
    """Decision after a held-out eval: 'continue', 'stop' (keep this eval's weights) or 'revert' (keep the
    previous eval's weights: this one overshot the window and the previous one was inside it)."""
    lo, hi = window
    if mean > hi:
        return "revert" if previous_mean is not None and lo <= previous_mean <= hi else "stop"
    return "stop" if mean >= max(lo, stop_reward) else "continue"
