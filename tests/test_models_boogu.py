"""Boogu-Image: our transformer (released names, save/load, padding, checkpointing) and the FlowModel wrapper's
conventions (t = 1 - sigma, negated output, static v1 schedule, system-prompt quirk, edit CFG, sizes).

Runs on the tiny checkpoints built by tools/build_tiny_models.py (session fixture `tiny_models`)."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import PIL.Image
import pytest
import torch

from losses import flow_sigmas
from models import load_model
from models.boogu_image import (
    BOOGU_LORA_TARGETS,
    BOOGU_T2I_SYSTEM_PROMPT,
    BOOGU_TI2I_SYSTEM_PROMPT,
    BooguImageModel,
    boogu_schedule_mu,
    boogu_system_prompt,
    reference_size,
    vlm_reference_image,
)
from models.boogu_image_transformer import BooguImageTransformer2DModel

torch.set_num_threads(1)

TINY_CFG = dict(patch_size=2, in_channels=16, hidden_size=48, num_layers=2, num_double_stream_layers=1,
                num_refiner_layers=1, num_attention_heads=2, num_kv_heads=1, multiple_of=16,
                axes_dim_rope=(8, 8, 8), axes_lens=(256, 64, 64),
                instruction_feature_configs=dict(instruction_feat_dim=32, reduce_type="mean",
                                                 num_instruction_feat_layers=1),
                timestep_scale=1000.0)

LONG_PROMPT = 'A neon shop sign that reads "OPEN ALL NIGHT" above a rainy street, cinematic lighting, 35mm photo'


# ---------------------------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tiny_models) -> BooguImageModel:
    return load_model(os.path.join(tiny_models, "boogu_image_base"))


@pytest.fixture(scope="module")
def edit(tiny_models) -> BooguImageModel:
    return load_model(os.path.join(tiny_models, "boogu_image_edit"))


def tiny_transformer(seed: int = 0) -> BooguImageTransformer2DModel:
    torch.manual_seed(seed)
    return BooguImageTransformer2DModel(**TINY_CFG).eval()


def random_image(seed: int, height: int = 72, width: int = 104) -> PIL.Image.Image:
    rng = np.random.RandomState(seed)
    return PIL.Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))


def native_boogu_timesteps(num_steps: int, seq_len: int = 4096, base_shift: float = 0.5,
                           max_shift: float = 1.15) -> np.ndarray:
    """Boogu's own scheduler, written independently from its description: t = linspace(0, 1, N+1)[:-1]
    in float32, logistic v1 shift t' = 1 - e^mu / (e^mu + (1/(1-t) - 1)) with mu linear in seq_len
    (256 -> base_shift, 4096 -> max_shift), then t = 1 appended. Boogu time: 0 = noise."""
    t = np.linspace(0, 1, num_steps + 1, dtype=np.float32)[:-1]
    mu = base_shift + (max_shift - base_shift) * (seq_len - 256) / (4096 - 256)
    one_minus_t = np.clip(1.0 - t, 1e-8, 1.0 - 1e-8)
    shifted = (1.0 - math.exp(mu) / (math.exp(mu) + (1.0 / one_minus_t - 1.0))).astype(np.float32)
    return np.concatenate([shifted, np.ones(1, dtype=np.float32)])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------------------------------------------------------
# transformer: names, save/load, padding, checkpointing
# ---------------------------------------------------------------------------------------------------------------


def expected_state_dict_keys(n_double: int, n_single: int, n_refiner: int) -> set[str]:
    """The released checkpoint's key names, generated per block."""
    attn = ["to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight", "norm_q.weight", "norm_k.weight"]
    ffn = ["linear_1.weight", "linear_2.weight", "linear_3.weight"]
    ada = ["linear.weight", "linear.bias", "norm.weight"]
    post = ["ffn_norm1.weight", "norm2.weight", "ffn_norm2.weight"]
    keys = {"x_embedder.weight", "x_embedder.bias", "ref_image_patch_embedder.weight",
            "ref_image_patch_embedder.bias", "image_index_embedding",
            "time_caption_embed.timestep_embedder.linear_1.weight", "time_caption_embed.timestep_embedder.linear_1.bias",
            "time_caption_embed.timestep_embedder.linear_2.weight", "time_caption_embed.timestep_embedder.linear_2.bias",
            "time_caption_embed.caption_embedder.0.weight", "time_caption_embed.caption_embedder.1.weight",
            "time_caption_embed.caption_embedder.1.bias",
            "norm_out.linear_1.weight", "norm_out.linear_1.bias", "norm_out.linear_2.weight", "norm_out.linear_2.bias"}
    for i in range(n_refiner):
        for name in ("noise_refiner", "ref_image_refiner", "context_refiner"):
            keys |= {f"{name}.{i}.attn.{k}" for k in attn} | {f"{name}.{i}.feed_forward.{k}" for k in ffn}
            keys |= {f"{name}.{i}.{k}" for k in post}
            if name == "context_refiner":  # unmodulated: plain RMSNorm
                keys.add(f"{name}.{i}.norm1.weight")
            else:
                keys |= {f"{name}.{i}.norm1.{k}" for k in ada}
    for i in range(n_single):
        p = f"single_stream_layers.{i}"
        keys |= {f"{p}.attn.{k}" for k in attn} | {f"{p}.feed_forward.{k}" for k in ffn}
        keys |= {f"{p}.norm1.{k}" for k in ada} | {f"{p}.{k}" for k in post}
    for i in range(n_double):
        p = f"double_stream_layers.{i}"
        joint = f"{p}.img_instruct_attn"
        keys |= {f"{joint}.processor.{n}.weight" for n in ("img_to_q", "img_to_k", "img_to_v", "instruct_to_q",
                                                            "instruct_to_k", "instruct_to_v", "img_out", "instruct_out")}
        keys |= {f"{joint}.to_out.0.weight", f"{joint}.norm_q.weight", f"{joint}.norm_k.weight"}
        keys |= {f"{p}.img_self_attn.{k}" for k in attn}
        for ff in ("img_feed_forward", "instruct_feed_forward"):
            keys |= {f"{p}.{ff}.{k}" for k in ffn}
        for norm in ("img_norm1", "img_norm2", "img_norm3", "instruct_norm1", "instruct_norm2"):
            keys |= {f"{p}.{norm}.{k}" for k in ada}
        for norm in ("img_ffn_norm1", "img_attn_norm", "img_self_attn_norm", "img_ffn_norm2", "instruct_ffn_norm1",
                     "instruct_attn_norm", "instruct_ffn_norm2"):
            keys.add(f"{p}.{norm}.weight")
    return keys


def test_state_dict_keys_equal_released_names():
    cfg = dict(TINY_CFG, num_layers=5, num_double_stream_layers=2, num_refiner_layers=2)
    torch.manual_seed(0)
    model = BooguImageTransformer2DModel(**cfg)
    keys = set(model.state_dict())
    expected = expected_state_dict_keys(n_double=2, n_single=3, n_refiner=2)
    assert keys == expected, f"missing {sorted(expected - keys)[:8]}, unexpected {sorted(keys - expected)[:8]}"
    # Spot checks named in the spec, and GQA shapes (k/v project to kv_heads * head_dim).
    sd = model.state_dict()
    assert sd["double_stream_layers.0.img_instruct_attn.processor.img_to_q.weight"].shape == (48, 48)
    assert sd["double_stream_layers.0.img_instruct_attn.processor.instruct_to_k.weight"].shape == (24, 48)
    assert sd["single_stream_layers.2.attn.to_v.weight"].shape == (24, 48)
    assert sd["single_stream_layers.0.norm1.linear.weight"].shape == (4 * 48, 48)
    assert sd["image_index_embedding"].shape == (5, 48)
    # Spec check 1: 62 nn.Linear leaves in a 1-double / 1-single / 1-refiner layout.
    one = BooguImageTransformer2DModel(**TINY_CFG)
    assert sum(isinstance(m, torch.nn.Linear) for m in one.modules()) == 62


RELEASED_CFG = dict(patch_size=2, in_channels=16, out_channels=None, hidden_size=3360, num_layers=40,
                    num_double_stream_layers=8, num_refiner_layers=2, num_attention_heads=28, num_kv_heads=7,
                    multiple_of=256, ffn_dim_multiplier=None, norm_eps=1e-5, axes_dim_rope=(40, 40, 40),
                    axes_lens=(2048, 1664, 1664),
                    instruction_feature_configs=dict(instruction_feat_dim=4096, reduce_type="mean",
                                                     num_instruction_feat_layers=1),
                    prompt_tuning_configs=dict(use_prompt_tuning=False), timestep_scale=1000.0)


def test_released_config_shapes_and_size():
    """The released config on the meta device: 10.293B parameters with biases, GQA k/v width 840,
    SwiGLU inner 13568, temb 1024, caption 4096 -> 3360, and the full key set."""
    with torch.device("meta"):
        model = BooguImageTransformer2DModel(**RELEASED_CFG)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(10.293e9, rel=1e-4)
    sd = model.state_dict()
    assert set(sd) == expected_state_dict_keys(n_double=8, n_single=32, n_refiner=2)
    assert sd["single_stream_layers.31.attn.to_k.weight"].shape == (840, 3360)
    assert sd["double_stream_layers.7.img_instruct_attn.processor.instruct_to_v.weight"].shape == (840, 3360)
    assert sd["noise_refiner.1.feed_forward.linear_1.weight"].shape == (13568, 3360)
    assert sd["single_stream_layers.0.norm1.linear.weight"].shape == (4 * 3360, 1024)
    assert sd["time_caption_embed.caption_embedder.1.weight"].shape == (3360, 4096)
    assert sd["x_embedder.weight"].shape == (3360, 64) and sd["norm_out.linear_2.weight"].shape == (64, 3360)


def test_tiny_checkpoint_loads_with_zero_missing_keys(tiny_models):
    path = os.path.join(tiny_models, "boogu_image_base", "transformer")
    model, info = BooguImageTransformer2DModel.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    released_keys = {"patch_size", "in_channels", "out_channels", "hidden_size", "num_layers",
                     "num_double_stream_layers", "num_refiner_layers", "num_attention_heads", "num_kv_heads",
                     "multiple_of", "ffn_dim_multiplier", "norm_eps", "axes_dim_rope", "axes_lens",
                     "instruction_feature_configs", "prompt_tuning_configs", "timestep_scale"}
    assert released_keys <= set(raw) and raw["_class_name"] == "BooguImageTransformer2DModel"


def run_tiny(model, latents, t, feats, mask, refs=None):
    with torch.no_grad():
        return model(latents, t, feats, instruction_attention_mask=mask, ref_image_hidden_states=refs)


def tiny_inputs(seed: int = 0, batch: int = 2, lengths=(5, 9)):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(batch, max(lengths), 32, generator=g)
    mask = torch.zeros(batch, max(lengths), dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    latents = torch.randn(batch, 16, 8, 12, generator=g)
    refs = torch.randn(batch, 16, 6, 8, generator=g)
    t = torch.tensor([0.3, 0.8])[:batch]
    return latents, t, feats, mask, refs


def test_save_load_round_trip(tmp_path):
    model = tiny_transformer(1)
    model.save_pretrained(tmp_path / "transformer")
    loaded, info = BooguImageTransformer2DModel.from_pretrained(tmp_path / "transformer", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    def plain(cfg):
        return {k: json.loads(json.dumps(v)) for k, v in cfg.items() if not k.startswith("_")}

    assert plain(loaded.config) == plain(model.config)
    latents, t, feats, mask, refs = tiny_inputs()
    assert torch.equal(run_tiny(loaded.eval(), latents, t, feats, mask, refs), run_tiny(model, latents, t, feats, mask, refs))


def test_transformer_padding_invariance():
    """A sample's output does not change when it is batched with a longer instruction (more right padding) or
    when extra padding columns are appended: T2I and edit."""
    model = tiny_transformer(2)
    latents, t, feats, mask, refs = tiny_inputs(lengths=(4, 11))
    for r in (None, refs):
        batched = run_tiny(model, latents, t, feats, mask, r)
        alone = run_tiny(model, latents[:1], t[:1], feats[:1, :4], mask[:1, :4], None if r is None else r[:1])
        padded = torch.nn.functional.pad(feats[:1], (0, 0, 0, 6), value=7.0)  # junk values in padding
        pad_mask = torch.nn.functional.pad(mask[:1], (0, 6))
        more_pad = run_tiny(model, latents[:1], t[:1], padded, pad_mask, None if r is None else r[:1])
        assert rel_err(batched[:1], alone) < 1e-5
        assert rel_err(more_pad, alone) < 1e-5
    # The mask is honoured: treating the padding as valid changes the output.
    leaky = run_tiny(model, latents[:1], t[:1], feats[:1], torch.ones_like(mask[:1]))
    assert rel_err(leaky, run_tiny(model, latents[:1], t[:1], feats[:1, :4], mask[:1, :4])) > 1e-3


def test_transformer_rejects_bad_inputs():
    model = tiny_transformer(3)
    latents, t, feats, mask, _ = tiny_inputs()
    left_padded = mask.flip(1)
    with pytest.raises(ValueError, match="right-padded"):
        run_tiny(model, latents, t, feats, left_padded)
    with pytest.raises(ValueError, match="axes_lens"):
        long = torch.randn(1, 300, 32)
        run_tiny(model, latents[:1], t[:1], long, torch.ones(1, 300, dtype=torch.long))
    with pytest.raises(ValueError, match="sum\\(axes_dim_rope\\)"):
        BooguImageTransformer2DModel(**dict(TINY_CFG, axes_dim_rope=(8, 8, 4)))


def test_gradient_checkpointing_matches_plain_backward():
    assert BooguImageTransformer2DModel._supports_gradient_checkpointing
    assert "BooguImageDoubleStreamTransformerBlock" in BooguImageTransformer2DModel._no_split_modules
    assert "BooguImageSingleStreamTransformerBlock" in BooguImageTransformer2DModel._no_split_modules
    latents, t, feats, mask, refs = tiny_inputs()
    grads = []
    for checkpointing in (False, True):
        model = tiny_transformer(4).train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        out = model(latents, t, feats, instruction_attention_mask=mask, ref_image_hidden_states=refs)
        out.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_rope_tables_survive_fsdp_input_casting():
    """FSDP2's MixedPrecisionPolicy casts floating tensors in a block's arguments to bf16 (through
    torch.distributed.utils._apply_to_tensors); the RoPE tables ride in a StreamContext that it leaves alone."""
    from torch.distributed.utils import _apply_to_tensors

    from models.boogu_image_transformer import StreamContext

    rope = (torch.rand(1, 4, 12), torch.rand(1, 4, 12))
    args = (torch.rand(1, 4, 48), StreamContext(None, rope), torch.rand(1, 48))
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t, args)
    assert cast[0].dtype == torch.bfloat16  # the cast is real
    assert cast[1].rope[0].dtype == torch.float32 and cast[1].rope[0] is rope[0]


def test_default_lora_targets_bind_inside_blocks_only():
    model = tiny_transformer(5)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for target in BOOGU_LORA_TARGETS:
        bound = [n for n in names if n == target or n.endswith("." + target)]
        assert bound, f"LoRA target {target!r} binds no module"
        assert all(n.split(".")[0] in BooguImageModel.lora_block_prefixes for n in bound), bound
    assert len(BOOGU_LORA_TARGETS) == 18


# ---------------------------------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_steps", [10, 28, 50])
def test_schedule_equals_native_boogu_v1(base, num_steps):
    native_t = native_boogu_timesteps(num_steps)
    native_sigmas = torch.from_numpy(1.0 - native_t)  # sigma = 1 - t, terminal t = 1 -> sigma = 0
    expected = flow_sigmas(num_steps, mu=1.15)
    for height, width in ((64, 64), (512, 512), (1024, 1024), (256, 768)):
        sigmas = base.schedule(num_steps, height, width)
        assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps + 1,)
        assert torch.equal(sigmas, expected)  # static v1: mu = 1.15 at every resolution
        assert (sigmas - native_sigmas).abs().max() < 1e-6
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    # A wrong mu (e.g. Qwen's dynamic one at 512^2) is measurably different: the comparison can fail.
    assert (flow_sigmas(num_steps, mu=0.5387097) - native_sigmas).abs().max() > 1e-2


def test_schedule_mu_from_raw_scheduler_json(base):
    raw = dict(base.scheduler_config)
    assert raw["do_shift"] is True and raw["dynamic_time_shift"] is False and raw["time_shift_version"] == "v1"
    assert boogu_schedule_mu(raw, latent_tokens=1) == pytest.approx(1.15, abs=1e-12)
    dynamic = dict(raw, dynamic_time_shift=True)
    tokens = 128 * 128  # 1024^2 latents -> 16384 // 4 = 4096 -> max_shift
    assert boogu_schedule_mu(dynamic, latent_tokens=tokens) == pytest.approx(1.15, abs=1e-12)
    assert boogu_schedule_mu(dynamic, latent_tokens=64 * 64) == pytest.approx(0.5 + 0.65 * (1024 - 256) / 3840)
    for bad in (dict(raw, time_shift_version="v2"), dict(raw, do_shift=False), dict(raw, seq_len=None),
                {k: v for k, v in raw.items() if k != "time_shift_version"}):
        with pytest.raises(ValueError, match="scheduler_config"):
            boogu_schedule_mu(bad, latent_tokens=4096)


# ---------------------------------------------------------------------------------------------------------------
# time direction and sign
# ---------------------------------------------------------------------------------------------------------------


def test_velocity_is_negated_output_at_boogu_time(base):
    prompt = base.encode_prompt(["a red bicycle", LONG_PROMPT])
    x = base.prepare_noise(64, 96, [torch.Generator().manual_seed(s) for s in (1, 2)])
    sigmas = torch.tensor([0.9, 0.25])
    v = base.predict_velocity(x, sigmas, prompt)
    with torch.no_grad():
        u = base.transformer(x, 1 - sigmas, prompt.embeds, instruction_attention_mask=prompt.mask)
        u_sigma = base.transformer(x, sigmas, prompt.embeds, instruction_attention_mask=prompt.mask)
    assert v.dtype == torch.float32
    assert torch.equal(v, -u)
    assert rel_err(v, -u_sigma) > 1e-2  # feeding sigma instead of t would be caught


def test_euler_loop_in_sigma_space_equals_native_boogu_loop(base):
    """10 Euler steps x <- x + (sigma_next - sigma) v through the wrapper == the native Boogu loop
    x <- x + (t_next - t) u with Boogu's own time grid and the raw transformer."""
    num_steps, height, width = 10, 64, 96
    prompt = base.encode_prompt(["a red bicycle", LONG_PROMPT])
    noise = base.prepare_noise(height, width, [torch.Generator().manual_seed(s) for s in (3, 4)])

    sigmas = base.schedule(num_steps, height, width)
    x = noise.clone()
    for i in range(num_steps):
        v = base.predict_velocity(x, sigmas[i].expand(2), prompt)
        x = x + (sigmas[i + 1] - sigmas[i]) * v

    t_native = torch.from_numpy(native_boogu_timesteps(num_steps))
    y = noise.clone()
    with torch.no_grad():
        for i in range(num_steps):
            u = base.transformer(y, t_native[i].expand(2), prompt.embeds, instruction_attention_mask=prompt.mask)
            y = y + (t_native[i + 1] - t_native[i]) * u

    assert rel_err(x, y) < 1e-4
    # Without the negation the loop runs the wrong way: far from the native result.
    z = noise.clone()
    for i in range(num_steps):
        z = z - (sigmas[i + 1] - sigmas[i]) * base.predict_velocity(z, sigmas[i].expand(2), prompt)
    assert rel_err(z, y) > 0.1


def test_timestep_cast_to_latent_dtype_before_model(base):
    """The released pipeline rounds t = 1 - sigma to the latent dtype (bf16 in production) before the model's
    x1000 scaling; a bf16 wrapper must feed exactly that rounded value."""
    import copy

    bf16 = BooguImageModel(transformer=copy.deepcopy(base.transformer).to(torch.bfloat16),
                           text_encoder=base.text_encoder, processor=base.processor, vae=base.vae,
                           scheduler_config=base.scheduler_config, dtype=torch.bfloat16)
    seen = {}
    hook = bf16.transformer.time_caption_embed.time_proj.register_forward_pre_hook(
        lambda module, args: seen.update(t=args[0]))
    prompt = base.encode_prompt(["a cat"])
    x = base.prepare_noise(64, 64, [torch.Generator().manual_seed(0)])
    sigma = torch.tensor([0.966])
    try:
        v = bf16.predict_velocity(x, sigma, prompt)
    finally:
        hook.remove()
    t_bf16 = (1 - sigma).to(torch.bfloat16)
    assert seen["t"].dtype == torch.bfloat16 and torch.equal(seen["t"], t_bf16)
    assert t_bf16.float().item() != pytest.approx((1 - sigma).item(), abs=1e-6)  # the rounding is real
    with torch.no_grad():
        u = bf16.transformer(x.to(torch.bfloat16), t_bf16, prompt.embeds.to(torch.bfloat16),
                             instruction_attention_mask=prompt.mask)
    assert v.dtype == torch.float32 and torch.equal(v, -u.float())


# ---------------------------------------------------------------------------------------------------------------
# prompts
# ---------------------------------------------------------------------------------------------------------------


def decoded(model: BooguImageModel, prompts, images=None) -> list[str]:
    inputs = model.tokenize_prompts(prompts, images)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    return [model.processor.tokenizer.decode(row[: int(m.sum())]) for row, m in zip(ids, mask)]


def test_system_prompt_rule_and_empty_prompt_quirk(base):
    assert boogu_system_prompt("a cat", has_image=False) == BOOGU_T2I_SYSTEM_PROMPT
    for empty in ("", " ", "\n\t"):
        assert boogu_system_prompt(empty, has_image=False) == BOOGU_TI2I_SYSTEM_PROMPT  # the quirk, kept
    assert boogu_system_prompt("make it blue", has_image=True) == BOOGU_TI2I_SYSTEM_PROMPT
    assert boogu_system_prompt("", has_image=True) == BOOGU_TI2I_SYSTEM_PROMPT

    t2i, empty, space = decoded(base, ["a cat", "", " "])
    assert t2i == f"<|im_start|>system\n{BOOGU_T2I_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\na cat<|im_end|>\n"
    assert empty == f"<|im_start|>system\n{BOOGU_TI2I_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
    assert space == f"<|im_start|>system\n{BOOGU_TI2I_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n <|im_end|>\n"
    assert "<|im_start|>assistant" not in t2i + empty  # no generation prompt

    # The encoder sees exactly that: "" embeds like an explicit TI2I-system chat, not like a T2I-system one.
    ti2i_chat = [{"role": "system", "content": BOOGU_TI2I_SYSTEM_PROMPT}, {"role": "user", "content": ""}]
    t2i_chat = [{"role": "system", "content": BOOGU_T2I_SYSTEM_PROMPT}, {"role": "user", "content": ""}]
    e_str, e_ti2i, e_t2i = (base.encode_prompt(p) for p in ([""], [ti2i_chat], [t2i_chat]))
    assert torch.equal(e_str.embeds, e_ti2i.embeds) and torch.equal(e_str.mask, e_ti2i.mask)
    assert e_t2i.embeds.shape != e_str.embeds.shape or not torch.equal(e_t2i.embeds, e_str.embeds)


def test_parquet_chat_messages_match_plain_strings(base):
    chat = [{"role": "system", "content": BOOGU_T2I_SYSTEM_PROMPT}, {"role": "user", "content": LONG_PROMPT}]
    a, b = base.encode_prompt([LONG_PROMPT]), base.encode_prompt([chat])
    assert torch.equal(a.embeds, b.embeds) and torch.equal(a.mask, b.mask)
    with pytest.raises(TypeError):
        base.encode_prompt(LONG_PROMPT)  # a bare string would be iterated per character


def test_prompt_padding_invariance_end_to_end(base):
    """Right padding: a short prompt's embeddings and velocity do not change when batched with a longer one."""
    both = base.encode_prompt(["a cat", LONG_PROMPT])
    alone = base.encode_prompt(["a cat"])
    n = int(alone.mask.sum())
    assert both.mask[0].tolist() == [1] * n + [0] * (both.mask.shape[1] - n)  # right-padded
    assert torch.allclose(both.embeds[0, :n], alone.embeds[0], atol=1e-5)
    assert both.embeds[0, n:].abs().max() == 0
    x = base.prepare_noise(64, 64, [torch.Generator().manual_seed(s) for s in (5, 6)])
    sig = torch.tensor([0.7, 0.7])
    v_both = base.predict_velocity(x, sig, both)
    v_alone = base.predict_velocity(x[:1], sig[:1], alone)
    assert rel_err(v_both[:1], v_alone) < 1e-5


# ---------------------------------------------------------------------------------------------------------------
# edit path and CFG
# ---------------------------------------------------------------------------------------------------------------


def test_reference_image_through_vlm_and_vae(edit):
    img = random_image(0)
    msgs = [{"role": "system", "content": BOOGU_TI2I_SYSTEM_PROMPT}, {"role": "user", "content": "<image>make it blue"}]
    (text,) = decoded(edit, ["make it blue"], [img])
    assert text.startswith(f"<|im_start|>system\n{BOOGU_TI2I_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n<|vision_start|>")
    assert text.endswith("<|vision_end|>make it blue<|im_end|>\n")
    inputs = edit.tokenize_prompts(["make it blue"], [img])
    assert "mm_token_type_ids" in inputs and int(inputs["mm_token_type_ids"].sum()) > 0
    assert decoded(edit, [msgs], [img]) == [text]
    with_img, other_img = edit.encode_prompt(["make it blue"], [img]), edit.encode_prompt(["make it blue"], [random_image(1)])
    assert not torch.equal(with_img.embeds, other_img.embeds)  # the VLM sees the image

    # VAE copy: per-row generator, batch-independent, (z - shift) * scale, sizes multiple of 16.
    gens = lambda: [torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)]  # noqa: E731
    imgs = [random_image(2, 64, 96), random_image(3, 64, 96)]
    refs = edit.encode_reference(imgs, gens())
    assert refs.shape == (2, 16, 8, 12) and refs.dtype == torch.float32
    assert torch.equal(refs[1:], edit.encode_reference(imgs[1:], gens()[1:]))
    with pytest.raises(ValueError, match="every row"):
        edit.encode_reference([imgs[0], None], gens())
    pixels = torch.from_numpy(np.asarray(imgs[0], dtype=np.float32) / 255.0).permute(2, 0, 1)[None] * 2 - 1
    with torch.no_grad():
        z = edit.vae.encode(pixels).latent_dist.sample(generator=torch.Generator().manual_seed(11))
    assert torch.allclose(refs[0], (z[0] - 0.1159) * 0.3611, atol=1e-6)
    assert edit.scaling_factor == pytest.approx(0.3611) and edit.shift_factor == pytest.approx(0.1159)


def test_reference_resize_rules():
    # VLM copy: <= 384*384 pixels and <= 768 a side, floored to multiples of 16, never upscaled.
    big = vlm_reference_image(PIL.Image.new("RGB", (1000, 600)))
    ratio = (384 * 384 / (1000 * 600)) ** 0.5
    assert big.size == (int(1000 * ratio) // 16 * 16, int(600 * ratio) // 16 * 16) == (480, 288)
    assert vlm_reference_image(PIL.Image.new("RGB", (100, 70))).size == (96, 64)
    assert vlm_reference_image(PIL.Image.new("RGB", (2000, 100))).size == (768, 32)  # side cap
    # VAE copy: <= 2048*2048 pixels.
    ratio = (2048 * 2048 / (3000 * 2000)) ** 0.5
    assert reference_size(PIL.Image.new("RGB", (3000, 2000))) == (int(2000 * ratio) // 16 * 16, int(3000 * ratio) // 16 * 16)
    assert reference_size(torch.zeros(3, 40, 72, dtype=torch.uint8)) == (32, 64)
    # what scripts/sample.py samples at without --height/--width: the reference's VAE size, else 512x512 (as any
    # family without reference images)
    from models.qwen_image import QwenImageModel

    assert BooguImageModel.default_size(torch.zeros(3, 40, 72, dtype=torch.uint8)) == (32, 64)
    assert BooguImageModel.default_size(None) == QwenImageModel.default_size(None) == (512, 512)


def test_edit_cfg_text_only_negative_keeps_reference_latents(edit):
    img = random_image(4, 64, 96)
    prompt = edit.encode_prompt(["make the sky green"], [img])
    negative = edit.encode_prompt([""])  # text-only negative: no images
    assert decoded(edit, [""])[0].count("<|vision_start|>") == 0
    refs = edit.encode_reference([img], [torch.Generator().manual_seed(0)])
    x = edit.prepare_noise(64, 96, [torch.Generator().manual_seed(7)])
    sig, scale = torch.tensor([0.6]), 4.0

    guided = edit.guided_velocity(x, sig, prompt, negative, scale, ref_latents=refs)
    with torch.no_grad():
        tr = edit.transformer
        pos = tr(x, 1 - sig, prompt.embeds, instruction_attention_mask=prompt.mask, ref_image_hidden_states=refs)
        neg_ref = tr(x, 1 - sig, negative.embeds, instruction_attention_mask=negative.mask, ref_image_hidden_states=refs)
        neg_noref = tr(x, 1 - sig, negative.embeds, instruction_attention_mask=negative.mask)
    assert torch.equal(guided, -(pos + (scale - 1) * (pos - neg_ref)))
    assert rel_err(guided, -(pos + (scale - 1) * (pos - neg_noref))) > 1e-3  # dropping refs would be caught
    # scale <= 1 is the plain conditional velocity; guidance without a negative fails closed.
    assert torch.equal(edit.guided_velocity(x, sig, prompt, None, 1.0, ref_latents=refs),
                       edit.predict_velocity(x, sig, prompt, ref_latents=refs))
    with pytest.raises(ValueError, match="negative"):
        edit.guided_velocity(x, sig, prompt, None, scale, ref_latents=refs)
    # A parquet negative must stay text-only: giving it the image without a placeholder is an error.
    neg_chat = [{"role": "system", "content": BOOGU_TI2I_SYSTEM_PROMPT}, {"role": "user", "content": ""}]
    with pytest.raises(ValueError, match="placeholder"):
        edit.encode_prompt([neg_chat], [img])
    assert torch.equal(edit.encode_prompt([neg_chat]).embeds, negative.embeds)


def test_t2i_cfg_formula(base):
    prompt, negative = base.encode_prompt(["a cat", LONG_PROMPT]), base.encode_prompt(["", ""])
    x = base.prepare_noise(64, 64, [torch.Generator().manual_seed(s) for s in (8, 9)])
    sig = torch.tensor([0.5, 0.3])
    guided = base.guided_velocity(x, sig, prompt, negative, 4.0)
    v_pos, v_neg = base.predict_velocity(x, sig, prompt), base.predict_velocity(x, sig, negative)
    assert torch.allclose(guided, v_pos + 3.0 * (v_pos - v_neg), atol=1e-6)  # standard CFG, no renorm
    assert rel_err(guided, v_pos) > 1e-2


# ---------------------------------------------------------------------------------------------------------------
# sizes, noise, decode, loading
# ---------------------------------------------------------------------------------------------------------------


def test_bad_sizes_raise_clear_errors(base):
    for h, w in ((100, 64), (64, 72), (0, 64), (-16, 64)):
        with pytest.raises(ValueError, match="multiple of 16|positive"):
            base.validate_size(h, w)
    with pytest.raises(ValueError, match="2048\\*2048"):
        base.validate_size(2048 + 16, 2048)
    base.validate_size(2048, 2048)
    base.validate_size(1024, 3072)  # tall/wide sizes are fine under the pixel cap
    with pytest.raises(ValueError):
        base.prepare_noise(100, 64, [torch.Generator().manual_seed(0)])
    with pytest.raises(ValueError):
        base.schedule(10, 64, 100)


def test_noise_per_row_generators_and_decode(base):
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    noise = base.prepare_noise(64, 96, gens([1, 2, 3]))
    assert noise.shape == (3, 16, 8, 12) and noise.dtype == torch.float32
    assert torch.equal(noise[1:2], base.prepare_noise(64, 96, gens([2])))
    images = base.decode(noise[:2])
    assert images.shape == (2, 3, 64, 96) and images.dtype == torch.uint8


def test_loading_checks_and_upstream_flag(tiny_models, tmp_path, monkeypatch):
    # The upstream class is used only on request, and a missing `boogu` package is an error, never a fallback.
    monkeypatch.setitem(sys.modules, "boogu", None)
    with pytest.raises(ImportError, match="boogu"):
        BooguImageModel.from_pretrained(os.path.join(tiny_models, "boogu_image_base"), use_upstream_transformer=True)
    # An unsupported scheduler config fails at load time.
    bad = tmp_path / "bad"
    (bad / "scheduler").mkdir(parents=True)
    src = os.path.join(tiny_models, "boogu_image_base")
    for name in ("model_index.json", "transformer", "mllm", "processor", "vae"):
        os.symlink(os.path.join(src, name), bad / name)
    (bad / "scheduler" / "scheduler_config.json").write_text('{"do_shift": true, "time_shift_version": "v2"}')
    with pytest.raises(ValueError, match="v2"):
        BooguImageModel.from_pretrained(str(bad))
