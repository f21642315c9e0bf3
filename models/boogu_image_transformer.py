"""Boogu-Image-0.1's transformer `BooguImageTransformer2DModel`: our own implementation of the released model
(written from the published architecture; no upstream code), with its blocks, RoPE and attention helpers, the
token layout (`_Layout`, patchify / unpatchify) and `boogu_image_forward_flops`.

Config and state-dict keys equal the released checkpoint's, so `from_pretrained(<ckpt>/transformer)` loads the
real weights with no missing or unexpected key. `forward` takes the released inputs and returns the raw output
`u = x0 - eps` at Boogu time `t` (0 = noise, 1 = clean); the wrapper `models.boogu_image.BooguImageModel` holds
the conventions around it. May import torch and diffusers, nothing of this repository.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import RMSNorm as QKRMSNorm
from diffusers.utils import USE_PEFT_BACKEND, scale_lora_layers, unscale_lora_layers

RopeTable = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (..., L, head_dim // 2) float32


class StreamContext:
    """Per-stream attention inputs: key padding mask (B, L) bool or None, and RoPE (cos, sin) float32. A plain
    object on purpose: FSDP2's mixed-precision policy casts the floating tensors in a block's (pytree) arguments
    to the compute dtype; the RoPE tables must stay float32 (the released model keeps them complex128, which
    that cast never touches), so they travel inside an object the cast does not traverse."""

    __slots__ = ("key_mask", "rope")

    def __init__(self, key_mask: Optional[torch.Tensor], rope: RopeTable):
        self.key_mask, self.rope = key_mask, rope


def apply_rope(x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
    """Rotate adjacent channel pairs (2i, 2i+1) of `x` (B, L, H, D) by the angles in `rope` ((B, L, D/2) each):
    a complex multiply of the pair by exp(i*angle), computed in float32 and cast back."""
    cos, sin = rope[0][:, :, None, :], rope[1][:, :, None, :]
    pairs = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def rope_from_positions(positions: torch.Tensor, axes_dim: Sequence[int], theta: float) -> RopeTable:
    """3-axis RoPE tables for integer positions (..., 3) -> (cos, sin) each (..., sum(axes_dim)/2) float32. Per
    axis the inverse frequencies are theta^(-2i/d); angles in float64 (as the released model's complex128
    tables), rounded to float32 once."""
    angles = []
    for axis, dim in enumerate(axes_dim):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))
        angles.append(positions[..., axis].to(torch.float64)[..., None] * inv_freq)
    angle = torch.cat(angles, dim=-1)
    return angle.cos().float(), angle.sin().float()


def rope_from_tables(positions: torch.Tensor, freqs_cis: Sequence[torch.Tensor]) -> RopeTable:
    """Same as `rope_from_positions`, but gathered from caller-given per-axis complex tables (the released
    pipeline's `get_freqs_cis` output, each (axes_lens[i], axes_dim[i]/2))."""
    parts = [table.to(positions.device)[positions[..., axis].long()] for axis, table in enumerate(freqs_cis)]
    table = torch.cat(parts, dim=-1)
    return table.real.float(), table.imag.float()


def swiglu_inner_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """4*dim (times ffn_dim_multiplier), rounded up to a multiple of `multiple_of`."""
    inner_dim = 4 * dim if ffn_dim_multiplier is None else int(ffn_dim_multiplier * 4 * dim)
    return multiple_of * ((inner_dim + multiple_of - 1) // multiple_of)


class SwiGLUFeedForward(nn.Module):
    """`linear_2(silu(linear_1 x) * linear_3 x)`, inner dim `swiglu_inner_dim`, no biases. (Released name:
    LuminaFeedForward.)"""

    def __init__(self, dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]):
        super().__init__()
        inner_dim = swiglu_inner_dim(dim, multiple_of, ffn_dim_multiplier)
        self.linear_1 = nn.Linear(dim, inner_dim, bias=False)  # gate
        self.linear_2 = nn.Linear(inner_dim, dim, bias=False)  # down
        self.linear_3 = nn.Linear(dim, inner_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.linear_1(x)
        return self.linear_2(F.silu(gate.float()).to(gate.dtype) * self.linear_3(x))


class AdaRMSNormZero(nn.Module):
    """adaLN with RMSNorm: `linear(silu(temb))` -> (scale_a, gate_a, scale_b, gate_b); returns
    `(norm(x) * (1 + scale_a), gate_a, scale_b, gate_b)`. (Released name: LuminaRMSNormZero.)"""

    def __init__(self, dim: int, norm_eps: float):
        super().__init__()
        self.linear = nn.Linear(min(dim, 1024), 4 * dim, bias=True)
        self.norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, temb: torch.Tensor):
        scale_a, gate_a, scale_b, gate_b = self.linear(F.silu(temb)).chunk(4, dim=1)
        return self.norm(x) * (1 + scale_a[:, None]), gate_a, scale_b, gate_b


class AdaLayerNormOut(nn.Module):
    """Final adaptive LayerNorm + projection: `linear_2(LN(x) * (1 + linear_1(silu(temb))))`, LN without affine.
    (Released name: LuminaLayerNormContinuous.)"""

    def __init__(self, dim: int, temb_dim: int, out_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(temb_dim, dim, bias=True)
        self.norm = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.linear_2 = nn.Linear(dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale = self.linear_1(F.silu(temb).to(x.dtype))
        return self.linear_2(self.norm(x) * (1 + scale)[:, None, :])


class TimeCaptionEmbedding(nn.Module):
    """Timestep sinusoid (scaled by `timestep_scale`) -> MLP to min(hidden, 1024); instruction features ->
    RMSNorm -> Linear to hidden. (Released name: Lumina2CombinedTimestepCaptionEmbedding.)"""

    def __init__(self, hidden_size: int, instruction_feat_dim: int, norm_eps: float, timestep_scale: float):
        super().__init__()
        self.time_proj = Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0.0,
                                   scale=timestep_scale)
        self.timestep_embedder = TimestepEmbedding(in_channels=256, time_embed_dim=min(hidden_size, 1024))
        self.caption_embedder = nn.Sequential(
            nn.RMSNorm(instruction_feat_dim, eps=norm_eps), nn.Linear(instruction_feat_dim, hidden_size, bias=True)
        )

    def forward(self, timestep: torch.Tensor, instruction: torch.Tensor, dtype: torch.dtype):
        temb = self.timestep_embedder(self.time_proj(timestep).to(dtype))
        return temb, self.caption_embedder(instruction)


class QKNormAttention(nn.Module):
    """What both attentions share: per-head qk RMSNorm, RoPE, GQA SDPA with a key padding mask, and the final
    `to_out.0`. Names as diffusers `Attention` (`norm_q/norm_k`, `to_out.0`) so the released weights load."""

    def _add_norms_and_out(self, dim: int, heads: int, kv_heads: int) -> None:
        # Called by the subclass where the released model creates these (keeps parameter and init order).
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.scale = self.head_dim**-0.5
        self.norm_q = QKRMSNorm(self.head_dim, eps=1e-5)
        self.norm_k = QKRMSNorm(self.head_dim, eps=1e-5)
        self.to_out = nn.ModuleList([nn.Linear(heads * self.head_dim, dim, bias=False), nn.Dropout(0.0)])

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: StreamContext,
               dtype: torch.dtype) -> torch.Tensor:
        """query (B, L, H*D), key/value (B, L, H_kv*D) -> (B, L, H*D) in `dtype`, before `to_out`. K/V heads are
        repeated explicitly (as the released model; SDPA's `enable_gqa` with a mask falls back to the math
        kernel on some torch versions); ctx.key_mask (B, L) bool, True = attend, or None."""
        batch, length = query.shape[:2]
        query = self.norm_q(query.unflatten(-1, (self.heads, self.head_dim)))  # (B, L, H, D)
        key = self.norm_k(key.unflatten(-1, (self.kv_heads, self.head_dim)))  # (B, L, H_kv, D)
        value = value.unflatten(-1, (self.kv_heads, self.head_dim))  # (B, L, H_kv, D)
        query, key = apply_rope(query, ctx.rope).transpose(1, 2), apply_rope(key, ctx.rope).transpose(1, 2)
        value = value.transpose(1, 2)
        if self.kv_heads != self.heads:
            key = key.repeat_interleave(self.heads // self.kv_heads, dim=1)  # (B, H, L, D)
            value = value.repeat_interleave(self.heads // self.kv_heads, dim=1)  # (B, H, L, D)
        mask = None if ctx.key_mask is None else ctx.key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scale)  # (B, H, L, D)
        return out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim).to(dtype)

    def project_out(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_out[1](self.to_out[0](x))


class BooguSelfAttention(QKNormAttention):
    """GQA self-attention with per-head qk RMSNorm and RoPE (`to_q/to_k/to_v` as diffusers `Attention`)."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        head_dim = dim // heads
        self.to_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_k = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.to_v = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self._add_norms_and_out(dim, heads, kv_heads)

    def forward(self, x: torch.Tensor, ctx: StreamContext) -> torch.Tensor:
        return self.project_out(self.attend(self.to_q(x), self.to_k(x), self.to_v(x), ctx, x.dtype))


class JointAttentionProjections(nn.Module):
    """Per-stream projections of the double-stream joint attention. A plain container: the released model keeps
    these linears on its attention *processor*, so they live under the child name `processor` to keep the
    checkpoint's key names (`img_instruct_attn.processor.img_to_q.weight`, ...)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        self.img_to_q = nn.Linear(dim, q_dim, bias=False)
        self.img_to_k = nn.Linear(dim, kv_dim, bias=False)
        self.img_to_v = nn.Linear(dim, kv_dim, bias=False)
        self.instruct_to_q = nn.Linear(dim, q_dim, bias=False)
        self.instruct_to_k = nn.Linear(dim, kv_dim, bias=False)
        self.instruct_to_v = nn.Linear(dim, kv_dim, bias=False)
        self.instruct_out = nn.Linear(q_dim, q_dim, bias=False)
        self.img_out = nn.Linear(q_dim, q_dim, bias=False)


class BooguJointAttention(QKNormAttention):
    """Joint attention over [instruction ; image] with separate per-stream QKV and output projections, a
    shared qk RMSNorm, and a shared final `to_out.0` applied to both streams."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self._add_norms_and_out(dim, heads, kv_heads)
        self.processor = JointAttentionProjections(dim, heads, kv_heads, self.head_dim)

    def forward(self, img: torch.Tensor, instruct: torch.Tensor, layout: "_Layout") -> tuple[torch.Tensor, torch.Tensor]:
        p = self.processor
        query = layout.merge(p.instruct_to_q(instruct), p.img_to_q(img))  # (B, seq_max, H*D)
        key = layout.merge(p.instruct_to_k(instruct), p.img_to_k(img))  # (B, seq_max, H_kv*D)
        value = layout.merge(p.instruct_to_v(instruct), p.img_to_v(img))  # (B, seq_max, H_kv*D)
        instruct_out, img_out = layout.split(self.attend(query, key, value, layout.joint, img.dtype))
        # to_out is token-wise, so applying it per stream equals applying it to the merged sequence.
        return self.project_out(p.img_out(img_out)), self.project_out(p.instruct_out(instruct_out))


class BooguImageTransformerBlock(nn.Module):
    """Single-stream / refiner block: (adaLN-modulated unless `modulation=False`) self-attention and SwiGLU FFN
    with RMS post-norms and tanh gates."""

    def __init__(self, dim: int, heads: int, kv_heads: int, multiple_of: int,
                 ffn_dim_multiplier: Optional[float], norm_eps: float, modulation: bool = True):
        super().__init__()
        self.modulation = modulation
        self.attn = BooguSelfAttention(dim, heads, kv_heads)
        self.feed_forward = SwiGLUFeedForward(dim, multiple_of, ffn_dim_multiplier)
        self.norm1 = AdaRMSNormZero(dim, norm_eps) if modulation else nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm1 = nn.RMSNorm(dim, eps=norm_eps)
        self.norm2 = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm2 = nn.RMSNorm(dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, ctx: StreamContext, temb: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.modulation:
            if temb is None:
                raise ValueError("a modulated Boogu block needs the timestep embedding `temb`")
            normed, gate_attn, scale_ffn, gate_ffn = self.norm1(x, temb)
            x = x + gate_attn[:, None].tanh() * self.norm2(self.attn(normed, ctx))
            ffn_out = self.feed_forward(self.ffn_norm1(x) * (1 + scale_ffn[:, None]))
            return x + gate_ffn[:, None].tanh() * self.ffn_norm2(ffn_out)
        x = x + self.norm2(self.attn(self.norm1(x), ctx))
        return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))


class BooguImageNoiseRefinerTransformerBlock(BooguImageTransformerBlock):
    pass


class BooguImageRefImgRefinerTransformerBlock(BooguImageTransformerBlock):
    pass


class BooguImageContextRefinerTransformerBlock(BooguImageTransformerBlock):
    pass


class BooguImageSingleStreamTransformerBlock(BooguImageTransformerBlock):
    pass


class BooguImageDoubleStreamTransformerBlock(nn.Module):
    """Double-stream block: joint [instruction ; image] attention with per-stream projections, image-only
    self-attention, separate FFNs; image stream has three adaLNs, instruction stream two."""

    def __init__(self, dim: int, heads: int, kv_heads: int, multiple_of: int,
                 ffn_dim_multiplier: Optional[float], norm_eps: float):
        super().__init__()
        self.img_instruct_attn = BooguJointAttention(dim, heads, kv_heads)
        self.img_self_attn = BooguSelfAttention(dim, heads, kv_heads)
        self.img_feed_forward = SwiGLUFeedForward(dim, multiple_of, ffn_dim_multiplier)
        # adaLNs: img_norm1 before the joint attention, img_norm2 the FFN, img_norm3 the image self-attention.
        self.img_norm1, self.img_norm2, self.img_norm3 = (AdaRMSNormZero(dim, norm_eps) for _ in range(3))
        self.img_ffn_norm1, self.img_attn_norm, self.img_self_attn_norm, self.img_ffn_norm2 = (
            nn.RMSNorm(dim, eps=norm_eps) for _ in range(4))
        self.instruct_feed_forward = SwiGLUFeedForward(dim, multiple_of, ffn_dim_multiplier)
        self.instruct_norm1, self.instruct_norm2 = (AdaRMSNormZero(dim, norm_eps) for _ in range(2))
        self.instruct_ffn_norm1, self.instruct_attn_norm, self.instruct_ffn_norm2 = (
            nn.RMSNorm(dim, eps=norm_eps) for _ in range(3))

    def forward(self, img: torch.Tensor, instruct: torch.Tensor, temb: torch.Tensor, layout: "_Layout"):
        img_in1, img_gate_joint, img_scale_ffn, img_gate_ffn = self.img_norm1(img, temb)
        # The second and third adaLNs contribute only their first two chunks (the released design).
        img_in2, img_shift_ffn, _, _ = self.img_norm2(img, temb)
        img_in3, img_gate_self, _, _ = self.img_norm3(img, temb)
        ins_in1, ins_gate_joint, ins_scale_ffn, ins_gate_ffn = self.instruct_norm1(instruct, temb)
        ins_in2, ins_shift_ffn, _, _ = self.instruct_norm2(instruct, temb)

        img_joint, ins_joint = self.img_instruct_attn(img_in1, ins_in1, layout)
        img_self = self.img_self_attn(img_in3, layout.img)

        img = img + img_gate_joint[:, None].tanh() * self.img_attn_norm(img_joint)
        img = img + img_gate_self[:, None].tanh() * self.img_self_attn_norm(img_self)
        img_ffn_in = (1 + img_scale_ffn[:, None]) * img_in2 + img_shift_ffn[:, None]
        img = img + img_gate_ffn[:, None].tanh() * self.img_ffn_norm2(self.img_feed_forward(self.img_ffn_norm1(img_ffn_in)))

        instruct = instruct + ins_gate_joint[:, None].tanh() * self.instruct_attn_norm(ins_joint)
        ins_ffn_in = (1 + ins_scale_ffn[:, None]) * ins_in2 + ins_shift_ffn[:, None]
        instruct = instruct + ins_gate_ffn[:, None].tanh() * self.instruct_ffn_norm2(
            self.instruct_feed_forward(self.instruct_ffn_norm1(ins_ffn_in)))
        return img, instruct


def pad_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack (L_i, ...) rows into (N, max L_i, ...), zero-padded."""
    return nn.utils.rnn.pad_sequence(list(rows), batch_first=True)


def prefix_mask(lengths: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """(B, width) bool, True on the first lengths[b] positions of row b."""
    return torch.arange(width, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


class _Layout:
    """Per-forward token layout of a padded batch: where each sample's instruction, reference-image and noise
    tokens sit, the key masks, and the RoPE tables of every stream.

    Joint sequence of sample b: [instruction (cap_b) ; reference images ; noise image ; padding], exactly as the
    released model lays it out. Image stream of sample b: [reference images ; noise ; padding].
    A key mask is None when its stream has no padding (lets SDPA use its fastest kernel).
    """

    def __init__(self, cap_lens: list[int], ref_sizes: list[list[tuple[int, int]]],
                 img_sizes: list[tuple[int, int]], axes_dim: Sequence[int], axes_lens: Sequence[int],
                 theta: float, freqs_cis: Optional[Sequence[torch.Tensor]], device: torch.device):
        self.batch = len(cap_lens)
        self.ref_lens = [[h * w for h, w in sizes] for sizes in ref_sizes]
        self.img_lens = [h * w for h, w in img_sizes]
        self.comb_lens = [sum(r) + n for r, n in zip(self.ref_lens, self.img_lens)]
        self.seq_lens = [c + m for c, m in zip(cap_lens, self.comb_lens)]
        self.cap_max, self.comb_max, self.seq_max = max(cap_lens), max(self.comb_lens), max(self.seq_lens)
        self.img_max = max(self.img_lens)

        def key_mask(lengths: list[int], width: int) -> Optional[torch.Tensor]:
            return None if all(n == width for n in lengths) else prefix_mask(lengths, width, device)

        self.joint_valid = prefix_mask(self.seq_lens, self.seq_max, device)  # (B, seq_max)

        # Index of joint position s in cat([instruction (cap_max), image stream (comb_max)]).
        cap = torch.tensor(cap_lens, device=device)[:, None]
        pos = torch.arange(self.seq_max, device=device)[None, :]
        self.merge_index = torch.where(pos < cap, pos, self.cap_max + pos - cap).clamp(max=self.cap_max + self.comb_max - 1)
        # Index of image-stream position k in the joint sequence.
        self.split_index = (cap + torch.arange(self.comb_max, device=device)[None, :]).clamp(max=self.seq_max - 1)

        # Positions (3 axes). Instruction token i -> (i, i, i). Reference j of sample b -> axis 0 = cap_b + the
        # larger token side of every earlier reference; noise -> axis 0 = cap_b + the sum over all references.
        cap_pos = torch.arange(self.cap_max, device=device)[:, None].expand(-1, 3)  # (cap_max, 3)
        img_pos, noise_pos, ref_pos = [], [], []  # per sample / per sample / per reference: (n, 3) each
        max_axis = [0, 0, 0]
        for b in range(self.batch):
            shift = cap_lens[b]
            pieces = []
            for h, w in ref_sizes[b] + [img_sizes[b]]:
                rows = torch.arange(h, device=device)[:, None].expand(h, w).reshape(-1)
                cols = torch.arange(w, device=device)[None, :].expand(h, w).reshape(-1)
                pieces.append(torch.stack([torch.full_like(rows, shift), rows, cols], dim=-1))
                max_axis = [max(max_axis[0], shift), max(max_axis[1], h - 1), max(max_axis[2], w - 1)]
                shift += max(h, w)
            ref_pos += pieces[:-1]
            img_pos.append(torch.cat(pieces, dim=0))
            noise_pos.append(pieces[-1])
        max_axis[0] = max(max_axis[0], self.cap_max - 1)
        for axis in range(3):
            if max_axis[axis] >= axes_lens[axis]:
                raise ValueError(f"RoPE position {max_axis[axis]} on axis {axis} exceeds the model's axes_lens[{axis}]"
                                 f"={axes_lens[axis]} (instruction tokens + reference-image token sides on axis 0, "
                                 "image token rows/cols on axes 1-2). Use a shorter instruction or smaller images.")

        def rope(positions: torch.Tensor) -> RopeTable:
            if freqs_cis is not None:
                return rope_from_tables(positions, freqs_cis)
            return rope_from_positions(positions, axes_dim, theta)

        cap_rope, img_rope = rope(cap_pos[None].expand(self.batch, -1, -1)), rope(pad_rows(img_pos))  # (B, comb_max, 3)
        self.cap = StreamContext(key_mask(cap_lens, self.cap_max), cap_rope)
        self.img = StreamContext(key_mask(self.comb_lens, self.comb_max), img_rope)
        self.noise = StreamContext(key_mask(self.img_lens, self.img_max), rope(pad_rows(noise_pos)))  # (B, img_max, 3)
        self.joint = StreamContext(key_mask(self.seq_lens, self.seq_max),
                                   tuple(self.merge(c, i) for c, i in zip(cap_rope, img_rope)))
        # Reference images refined one per row: (num_refs, ref_max, ...).
        self.ref_owner = [b for b in range(self.batch) for _ in ref_sizes[b]]
        self.ref_flat_lens = [n for lens in self.ref_lens for n in lens]
        self.ref_index_in_sample = [j for b in range(self.batch) for j in range(len(ref_sizes[b]))]
        if ref_pos:
            self.ref = StreamContext(key_mask(self.ref_flat_lens, max(self.ref_flat_lens)), rope(pad_rows(ref_pos)))

    def merge(self, instruct: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        """(B, cap_max, F) + (B, comb_max, F) -> joint (B, seq_max, F); padding positions are zero."""
        both = torch.cat([instruct, img], dim=1)
        index = self.merge_index[:, :, None].expand(-1, -1, both.shape[-1])
        joint = torch.gather(both, 1, index)
        return torch.where(self.joint_valid[:, :, None], joint, torch.zeros((), dtype=joint.dtype, device=joint.device))

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint (B, seq_max, F) -> (instruction (B, cap_max, F), image stream (B, comb_max, F)). Positions
        beyond a sample's valid length hold arbitrary finite values; they never reach a valid token."""
        index = self.split_index[:, :, None].expand(-1, -1, joint.shape[-1])
        return joint[:, : self.cap_max], torch.gather(joint, 1, index)


def patchify(image: torch.Tensor, patch: int) -> torch.Tensor:
    """(..., C, H, W) -> (..., (H/p)(W/p), p*p*C); channel fastest, then column-in-patch, then row-in-patch."""
    *lead, c, h, w = image.shape
    x = image.reshape(*lead, c, h // patch, patch, w // patch, patch)
    x = x.permute(*range(len(lead)), -4, -2, -3, -1, -5)  # (..., h, w, p1, p2, c)
    return x.reshape(*lead, (h // patch) * (w // patch), patch * patch * c)


def unpatchify(tokens: torch.Tensor, height: int, width: int, patch: int) -> torch.Tensor:
    """Inverse of `patchify`: (..., (H/p)(W/p), p*p*C) -> (..., C, H, W)."""
    *lead, _, feat = tokens.shape
    c = feat // (patch * patch)
    x = tokens.reshape(*lead, height // patch, width // patch, patch, patch, c)
    x = x.permute(*range(len(lead)), -1, -5, -3, -4, -2)  # (..., c, h, p1, w, p2)
    return x.reshape(*lead, c, height, width)


class BooguImageTransformer2DModel(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """The Boogu-Image transformer: refiners -> double-stream blocks -> single-stream blocks -> adaLN output.

    Config keys, defaults and state-dict names equal the released `BooguImageTransformer2DModel`. The output is
    the released convention: `u = x0 - eps` at Boogu time `t` (0 = noise); see `BooguImageModel` for the
    diffusers convention.
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["BooguImageTransformerBlock", "BooguImageNoiseRefinerTransformerBlock",
                         "BooguImageRefImgRefinerTransformerBlock", "BooguImageContextRefinerTransformerBlock",
                         "BooguImageSingleStreamTransformerBlock", "BooguImageDoubleStreamTransformerBlock"]
    _skip_layerwise_casting_patterns = ["x_embedder", "norm", "embedding"]

    @register_to_config
    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 16,
        out_channels: Optional[int] = None,
        hidden_size: int = 2304,
        num_layers: int = 26,
        num_double_stream_layers: int = 2,
        num_refiner_layers: int = 2,
        num_attention_heads: int = 24,
        num_kv_heads: int = 8,
        multiple_of: int = 256,
        ffn_dim_multiplier: Optional[float] = None,
        norm_eps: float = 1e-5,
        axes_dim_rope: tuple[int, int, int] = (40, 40, 40),
        axes_lens: tuple[int, int, int] = (2048, 1664, 1664),
        instruction_feature_configs: dict[str, Any] = dict(  # noqa: B006 (never mutated; default = released)
            instruction_feat_dim=1024, reduce_type="mean", num_instruction_feat_layers=1),
        prompt_tuning_configs: dict[str, Any] = dict(use_prompt_tuning=False),  # noqa: B006
        timestep_scale: float = 1.0,
    ) -> None:
        # The defaults above are the released class's constructor defaults (placeholders, not the released
        # config: that one sets hidden 3360, 40 layers, timestep_scale 1000, ...).
        super().__init__()
        if hidden_size % num_attention_heads or hidden_size // num_attention_heads != sum(axes_dim_rope):
            raise ValueError(f"hidden_size // num_attention_heads ({hidden_size}//{num_attention_heads}) must equal "
                             f"sum(axes_dim_rope) ({sum(axes_dim_rope)})")
        if num_attention_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_attention_heads ({num_attention_heads})")
        if num_double_stream_layers > num_layers:
            raise ValueError(f"num_double_stream_layers ({num_double_stream_layers}) > num_layers ({num_layers})")
        if (prompt_tuning_configs or {}).get("use_prompt_tuning", False):
            raise ValueError("prompt_tuning_configs.use_prompt_tuning=true is not supported (the released "
                             "checkpoints set it false)")
        self.out_channels = out_channels or in_channels
        self.instruction_feature_configs = instruction_feature_configs
        feat_dim = self._instruction_feat_dim(instruction_feature_configs)
        block_args = (hidden_size, num_attention_heads, num_kv_heads, multiple_of, ffn_dim_multiplier, norm_eps)
        patch_dim = patch_size * patch_size * in_channels

        self.x_embedder = nn.Linear(patch_dim, hidden_size)
        self.ref_image_patch_embedder = nn.Linear(patch_dim, hidden_size)
        self.time_caption_embed = TimeCaptionEmbedding(hidden_size, feat_dim, norm_eps, timestep_scale)
        def blocks(cls: type[nn.Module], count: int, **kwargs: Any) -> nn.ModuleList:
            return nn.ModuleList([cls(*block_args, **kwargs) for _ in range(count)])

        self.noise_refiner = blocks(BooguImageNoiseRefinerTransformerBlock, num_refiner_layers)
        self.ref_image_refiner = blocks(BooguImageRefImgRefinerTransformerBlock, num_refiner_layers)
        self.context_refiner = blocks(BooguImageContextRefinerTransformerBlock, num_refiner_layers, modulation=False)
        self.double_stream_layers = blocks(BooguImageDoubleStreamTransformerBlock, num_double_stream_layers)
        self.single_stream_layers = blocks(BooguImageSingleStreamTransformerBlock, num_layers - num_double_stream_layers)
        self.norm_out = AdaLayerNormOut(hidden_size, min(hidden_size, 1024), patch_size * patch_size * self.out_channels)
        self.image_index_embedding = nn.Parameter(torch.randn(5, hidden_size) * 0.02)  # up to 5 reference images
        self.gradient_checkpointing = False

    @staticmethod
    def _instruction_feat_dim(cfg: dict[str, Any]) -> int:
        layers = max(cfg.get("num_instruction_feat_layers", 1), 1)
        dim = cfg.get("instruction_feat_dim", 4096)
        reduce_type = cfg.get("reduce_type", "concat").lower()
        if "cat" in reduce_type:
            return layers * dim
        if "mean" in reduce_type:
            return dim
        raise ValueError(f"instruction_feature_configs.reduce_type={cfg.get('reduce_type')!r}: use 'mean' or 'concat'")

    def _reduce_instruction_features(self, features: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
        if isinstance(features, torch.Tensor):
            return features
        cfg = self.instruction_feature_configs
        if len(features) != max(cfg.get("num_instruction_feat_layers", 1), 1):
            raise ValueError(f"got {len(features)} instruction feature layers, config expects "
                             f"{cfg.get('num_instruction_feat_layers', 1)}")
        if "cat" in cfg.get("reduce_type", "concat").lower():
            return torch.cat(list(features), dim=-1)
        return torch.stack(list(features)).mean(dim=0)

    def _run(self, block: nn.Module, *args):
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            return self._gradient_checkpointing_func(block, *args)
        return block(*args)

    def forward(
        self,
        hidden_states: Union[torch.Tensor, list[torch.Tensor]],
        timestep: torch.Tensor,
        instruction_hidden_states: Union[torch.Tensor, Sequence[torch.Tensor]],
        freqs_cis: Optional[Sequence[torch.Tensor]] = None,
        instruction_attention_mask: Optional[torch.Tensor] = None,
        ref_image_hidden_states: Optional[Union[torch.Tensor, list[Optional[list[torch.Tensor]]]]] = None,
        attention_kwargs: Optional[dict[str, Any]] = None,
        return_dict: bool = False,
    ):
        """Raw Boogu prediction `u = x0 - eps`.

        hidden_states: noisy latents (B, C, H, W), or a list of (C, h, w) of varying sizes.
        timestep: (B,) (or scalar) Boogu time in [0, 1], 0 = noise; scaled by `timestep_scale` inside.
        instruction_hidden_states: (B, L, D_feat) VLM features (or a list of layers, reduced per config).
        freqs_cis: optional per-axis complex RoPE tables (the released pipeline's `get_freqs_cis`); when None the
            tables are built here (same values).
        instruction_attention_mask: (B, L), 1 = valid, right-padded; None = all valid.
        ref_image_hidden_states: None, (B, C, h, w) (one reference per sample), or a per-sample list of None or
            a list of (C, h, w) reference latents (at most 5 per sample).
        attention_kwargs: only {"scale": s} (PEFT LoRA scale) is used.
        Returns (B, C, H, W) (a list when given a list); `Transformer2DModelOutput` if `return_dict`.
        """
        lora_scale = (attention_kwargs or {}).get("scale", 1.0)
        if USE_PEFT_BACKEND:
            scale_lora_layers(self, lora_scale)
        try:
            out = self._forward(hidden_states, timestep, instruction_hidden_states, freqs_cis,
                                instruction_attention_mask, ref_image_hidden_states)
        finally:
            if USE_PEFT_BACKEND:
                unscale_lora_layers(self, lora_scale)
        return Transformer2DModelOutput(sample=out) if return_dict else out

    def _forward(self, hidden_states, timestep, instruction_hidden_states, freqs_cis, instruction_mask, refs):
        cfg = self.config
        p = cfg.patch_size
        is_tensor = isinstance(hidden_states, torch.Tensor)
        images = list(hidden_states) if is_tensor else hidden_states
        if is_tensor and hidden_states.ndim != 4:
            raise ValueError(f"hidden_states must be (B, C, H, W), got {tuple(hidden_states.shape)}")
        batch, device, dtype = len(images), images[0].device, images[0].dtype
        for img in images:
            if img.shape[-1] % p or img.shape[-2] % p:
                raise ValueError(f"latent size {tuple(img.shape[-2:])} must be a multiple of patch_size={p}")

        instruction = self._reduce_instruction_features(instruction_hidden_states)
        if instruction.shape[0] != batch:
            raise ValueError(f"instruction batch {instruction.shape[0]} != latent batch {batch}")
        if instruction_mask is None:
            instruction_mask = torch.ones(instruction.shape[:2], dtype=torch.long, device=device)
        valid = instruction_mask.to(device=device).bool()
        cap_lens = valid.sum(dim=1).tolist()
        if not torch.equal(valid, prefix_mask(cap_lens, valid.shape[1], device)):
            raise ValueError("instruction_attention_mask must be right-padded (1s then 0s in every row)")
        if min(cap_lens) < 1:
            raise ValueError("every sample needs at least one valid instruction token")
        instruction = instruction[:, : max(cap_lens)]  # trailing all-padding columns never reach a valid token

        if isinstance(refs, torch.Tensor):
            if refs.ndim != 4 or refs.shape[0] != batch:
                raise ValueError(f"ref_image_hidden_states tensor must be (B, C, h, w), got {tuple(refs.shape)}")
            refs = [[r] for r in refs]
        refs = [[] for _ in range(batch)] if refs is None else [list(r) if r is not None else [] for r in refs]
        if len(refs) != batch:
            raise ValueError(f"ref_image_hidden_states has {len(refs)} entries for a batch of {batch}")
        max_refs = self.image_index_embedding.shape[0]
        for sample_refs in refs:
            if len(sample_refs) > max_refs:
                raise ValueError(f"at most {max_refs} reference images per sample")
            for r in sample_refs:
                if r.ndim != 3 or r.shape[-1] % p or r.shape[-2] % p:
                    raise ValueError(f"reference latents must be (C, h, w) with h, w multiples of {p}, got {tuple(r.shape)}")

        if timestep.ndim == 0:
            timestep = timestep.expand(batch)
        temb, instruction = self.time_caption_embed(timestep, instruction, dtype)

        ref_sizes = [[(r.shape[-2] // p, r.shape[-1] // p) for r in sample_refs] for sample_refs in refs]
        layout = _Layout(cap_lens, ref_sizes, [(img.shape[-2] // p, img.shape[-1] // p) for img in images],
                         cfg.axes_dim_rope, cfg.axes_lens, 10000.0, freqs_cis, device)

        # Noise tokens (B, img_max, D).
        if is_tensor:
            noise = self.x_embedder(patchify(hidden_states, p))
        else:
            noise = self.x_embedder(pad_rows([patchify(img, p) for img in images]))
        for block in self.context_refiner:
            instruction = self._run(block, instruction, layout.cap)
        for block in self.noise_refiner:
            noise = self._run(block, noise, layout.noise, temb)

        # Reference tokens, one image per row (num_refs, ref_max, D), refined with their owner's temb.
        flat_refs = [r for sample_refs in refs for r in sample_refs]
        if flat_refs:
            ref_tokens = self.ref_image_patch_embedder(pad_rows([patchify(r, p) for r in flat_refs]).to(dtype))
            ref_tokens = ref_tokens + self.image_index_embedding[layout.ref_index_in_sample][:, None, :].to(ref_tokens.dtype)
            ref_temb = temb[layout.ref_owner]
            for block in self.ref_image_refiner:
                ref_tokens = self._run(block, ref_tokens, layout.ref, ref_temb)
            # Image stream (B, comb_max, D): per sample [its references ; noise].
            rows = iter(ref_tokens[r, :n] for r, n in enumerate(layout.ref_flat_lens))
            img = pad_rows([torch.cat([next(rows) for _ in refs[b]] + [noise[b, : layout.img_lens[b]]], dim=0)
                       for b in range(batch)])
        else:
            img = noise  # no references anywhere: the image stream is the noise stream

        for block in self.double_stream_layers:
            img, instruction = self._run(block, img, instruction, temb, layout)
        joint = layout.merge(instruction, img)
        for block in self.single_stream_layers:
            joint = self._run(block, joint, layout.joint, temb)

        # Noise-image tokens only: joint positions [seq_b - img_b, seq_b).
        start = torch.tensor([s - n for s, n in zip(layout.seq_lens, layout.img_lens)], device=device)
        index = (start[:, None] + torch.arange(layout.img_max, device=device)[None, :]).clamp(max=layout.seq_max - 1)
        tokens = torch.gather(joint, 1, index[:, :, None].expand(-1, -1, joint.shape[-1]))
        tokens = self.norm_out(tokens, temb)
        if is_tensor:
            return unpatchify(tokens, hidden_states.shape[-2], hidden_states.shape[-1], p)
        return [unpatchify(tokens[b, : layout.img_lens[b]], lat.shape[-2], lat.shape[-1], p)
                for b, lat in enumerate(images)]


def boogu_image_forward_flops(config: Any, image_tokens: int, text_tokens: Sequence[int],
                              ref_tokens: Optional[Sequence[Sequence[int]]] = None) -> float:
    """Forward FLOPs of `BooguImageTransformer2DModel` (this module) for len(text_tokens) samples, derived from
    its blocks: matmuls only, 2 FLOPs per multiply-add; config: the transformer's config (attribute access).

    D = hidden_size, KV = num_kv_heads·D/heads, F = the SwiGLU inner width (4D·ffn_dim_multiplier rounded up to
    multiple_of), T = min(D, 1024) (timestep width). Per token of a self-attention block: q and out D² each, k and v
    D·KV each, FFN 3·D·F; its attention over n tokens 2·n²·D (QK^T and AV over all heads; GQA repeats K/V); an
    adaLN-modulated block adds T·4D per sample. Per sample with n_t text, n_i noise-image and per-reference n_r
    tokens (n_s = Σ n_r + n_i, the image stream of the double-stream blocks):
      embedders: caption feat·D per text token, x / ref patch p²·C·D per image / reference token, timestep MLP
        256·T + T²; output: linear_1 T·D per sample, linear_2 D·p²·C_out per noise token;
      refiners (R each): context on n_t (no modulation), noise on n_i, reference on each n_r separately;
      double-stream (L_d): per token of either stream 3D² + 2D·KV (per-stream q, k, v, out, shared to_out) + 3DF,
        joint attention 2·(n_t + n_s)²·D, image self-attention (2D² + 2D·KV)·n_s + 2·n_s²·D, 5 adaLNs;
      single-stream (L - L_d): self-attention blocks over n_t + n_s tokens.
    """
    cfg = config
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    kv = cfg.num_kv_heads * (d // heads)
    ffn = 3 * d * swiglu_inner_dim(d, cfg.multiple_of, cfg.ffn_dim_multiplier)
    t_dim = min(d, 1024)
    patch_in = cfg.patch_size**2 * cfg.in_channels
    patch_out = cfg.patch_size**2 * (cfg.out_channels or cfg.in_channels)
    feat = BooguImageTransformer2DModel._instruction_feat_dim(cfg.instruction_feature_configs)
    attn_lin = 2 * d * d + 2 * d * kv
    ada = t_dim * 4 * d
    refiners, double = cfg.num_refiner_layers, cfg.num_double_stream_layers
    single = cfg.num_layers - double

    def block(n: int, modulated: bool = True) -> int:  # multiply-adds of one self-attention block over n tokens
        return (attn_lin + ffn) * n + 2 * n * n * d + (ada if modulated else 0)

    total = 0
    for b, n_t in enumerate(text_tokens):
        n_t, n_i = int(n_t), int(image_tokens)
        refs = [int(r) for r in (ref_tokens[b] if ref_tokens is not None else [])]
        n_s = sum(refs) + n_i
        macs = feat * d * n_t + patch_in * d * (n_i + sum(refs)) + 256 * t_dim + t_dim * t_dim
        macs += t_dim * d + patch_out * d * n_i
        macs += refiners * (block(n_t, modulated=False) + block(n_i) + sum(block(r) for r in refs))
        macs += double * ((3 * d * d + 2 * d * kv + ffn) * (n_t + n_s) + 2 * (n_t + n_s) ** 2 * d
                          + attn_lin * n_s + 2 * n_s * n_s * d + 5 * ada)
        macs += single * block(n_t + n_s)
        total += 2 * macs
    return float(total)
