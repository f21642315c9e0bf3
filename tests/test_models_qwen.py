"""Qwen-Image wrapper: prompt prefix drop, packing, timestep input, true-CFG, schedule, pipeline equivalence."""

from __future__ import annotations

import os

import pytest
import torch

from models import load_model
from models.base import PromptEmbeds
from models.qwen_image import (DROP_IDX, PROMPT_PREFIX, QWEN_IMAGE_SYSTEM_PROMPT, QwenImageModel, pack_latents,
                               render_prompt, unpack_latents)

PROMPTS = ['A storefront sign that reads "OPEN 24 HOURS"', 'a cat']
NEG = " "


@pytest.fixture(scope="module")
def qwen_dir(tiny_models):
    return os.path.join(tiny_models, "qwen_image")


@pytest.fixture(scope="module")
def model(qwen_dir) -> QwenImageModel:
    m = load_model(qwen_dir)
    assert isinstance(m, QwenImageModel)
    return m


@pytest.fixture(scope="module")
def pipe(qwen_dir):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(qwen_dir, local_files_only=True)


def gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


# ---- prompts --------------------------------------------------------------------------------------------------


def test_prefix_is_exactly_34_tokens_of_the_system_template(model):
    ids = model.tokenizer(PROMPT_PREFIX, add_special_tokens=False)["input_ids"]
    assert len(ids) == DROP_IDX == 34
    assert model.tokenizer.decode(ids) == PROMPT_PREFIX
    # the template of a prompt tokenises to the prefix followed by the prompt's own tokens
    full = model.tokenizer(render_prompt("a cat"), add_special_tokens=False)["input_ids"]
    assert full[:DROP_IDX] == ids
    assert model.tokenizer.decode(full[DROP_IDX:]) == "a cat<|im_end|>\n<|im_start|>assistant\n"


def test_encode_prompt_drops_prefix_and_matches_encoder(model):
    pe = model.encode_prompt(PROMPTS)
    assert pe.mask.dtype == torch.int64 and pe.mask.shape == pe.embeds.shape[:2]
    for i, p in enumerate(PROMPTS):
        tok = model.tokenizer([render_prompt(p)], return_tensors="pt")
        hidden = model.text_encoder(**tok, output_hidden_states=True).hidden_states[-1][0]
        n = tok["input_ids"].shape[1] - DROP_IDX
        assert int(pe.mask[i].sum()) == n
        torch.testing.assert_close(pe.embeds[i, :n], hidden[DROP_IDX:], rtol=1e-5, atol=1e-5)
        assert bool((pe.embeds[i, n:] == 0).all()) and bool((pe.mask[i, n:] == 0).all())
    # the shorter prompt is right-padded
    assert int(pe.mask[1].sum()) < pe.mask.shape[1]


def test_encode_prompt_equals_diffusers_pipeline(model, pipe):
    pe = model.encode_prompt(PROMPTS)
    ref, ref_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
    torch.testing.assert_close(pe.embeds, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(pe.mask, ref_mask.to(torch.int64))


def test_message_list_prompt_equals_plain_string(model):
    msgs = [{"role": "system", "content": QWEN_IMAGE_SYSTEM_PROMPT}, {"role": "user", "content": PROMPTS[0]}]
    assert render_prompt(msgs) == render_prompt(PROMPTS[0])
    a = model.encode_prompt([msgs, [{"role": "system", "content": QWEN_IMAGE_SYSTEM_PROMPT},
                                    {"role": "user", "content": NEG}]])
    b = model.encode_prompt([PROMPTS[0], NEG])
    assert torch.equal(a.embeds, b.embeds) and torch.equal(a.mask, b.mask)


def test_message_list_with_other_system_prompt_raises(model):
    with pytest.raises(ValueError, match="system prompt"):
        model.encode_prompt([[{"role": "system", "content": "You are a helpful assistant."},
                              {"role": "user", "content": "a cat"}]])
    with pytest.raises(ValueError, match="system prompt"):
        model.encode_prompt([[{"role": "user", "content": "a cat"}]])


def test_max_sequence_length_truncates(qwen_dir, model):
    short = QwenImageModel(model.transformer, model.vae, model.text_encoder, model.tokenizer, model.scheduler_config,
                           max_sequence_length=5)
    full = model.encode_prompt(PROMPTS)
    cut = short.encode_prompt(PROMPTS)
    assert cut.embeds.shape[1] == 5
    torch.testing.assert_close(cut.embeds, full.embeds[:, :5])
    with pytest.raises(ValueError, match="max_sequence_length"):
        QwenImageModel(model.transformer, model.vae, model.text_encoder, model.tokenizer, model.scheduler_config,
                       max_sequence_length=1025)


# ---- latents ---------------------------------------------------------------------------------------------------


def test_packing_channel_slowest_and_round_trip(pipe):
    b, c, h, w = 2, 16, 6, 4
    lat = torch.arange(b * c * h * w, dtype=torch.float32).reshape(b, c, h, w)
    packed = pack_latents(lat)
    assert packed.shape == (b, (h // 2) * (w // 2), 4 * c)
    for i in range(h // 2):
        for j in range(w // 2):
            tok = i * (w // 2) + j
            for ch in range(c):
                for py in range(2):
                    for px in range(2):
                        assert packed[1, tok, ch * 4 + 2 * py + px] == lat[1, ch, 2 * i + py, 2 * j + px]
    assert torch.equal(unpack_latents(packed, h, w), lat)
    # same layout as diffusers' QwenImagePipeline._pack_latents on the 5D draw
    assert torch.equal(packed, pipe._pack_latents(lat[:, None].transpose(1, 2), b, c, h, w))


def test_noise_is_per_row(model):
    both = model.prepare_noise(64, 32, gens([7, 8]))
    alone = model.prepare_noise(64, 32, gens([8]))
    assert both.shape == (2, 4 * 2, 64) and both.dtype == torch.float32
    assert torch.equal(both[1], alone[0])
    # the draw is the pipeline's (1, 16, H/8, W/8) randn, then packed
    raw = torch.randn((1, 16, 8, 4), generator=torch.Generator().manual_seed(8))
    assert torch.equal(alone, pack_latents(raw))


@pytest.mark.parametrize("hw", [(63, 64), (64, 72), (0, 64), (-16, 64)])
def test_bad_sizes_raise(model, hw):
    with pytest.raises(ValueError):
        model.prepare_noise(*hw, gens([0]))
    with pytest.raises(ValueError):
        model.schedule(4, *hw)


def test_non_square_needs_explicit_size(model):
    pe = model.encode_prompt(["x"])
    x = model.prepare_noise(32, 64, gens([0]))
    with pytest.raises(ValueError, match="height= and width="):
        model.predict_velocity(x, torch.tensor([0.5]), pe)
    v = model.predict_velocity(x, torch.tensor([0.5]), pe, height=32, width=64)
    assert v.shape == x.shape
    assert model.decode(x, height=32, width=64).shape == (1, 3, 32, 64)


# ---- transformer call ------------------------------------------------------------------------------------------


def test_timestep_input_is_sigma(model):
    seen = {}

    def hook(_module, _args, kwargs):
        seen["timestep"] = kwargs["timestep"].clone()

    handle = model.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        pe = model.encode_prompt(PROMPTS)
        sig = torch.tensor([0.25, 0.875])
        model.predict_velocity(model.prepare_noise(32, 32, gens([0, 1])), sig, pe)
    finally:
        handle.remove()
    torch.testing.assert_close(seen["timestep"], sig, rtol=0, atol=1e-7)


def test_velocity_is_diffusers_convention_and_fp32(model):
    """Returned unchanged from the transformer (v = eps - x0; no negation for Qwen)."""
    pe = model.encode_prompt(PROMPTS)
    x = model.prepare_noise(32, 32, gens([0, 1]))
    sig = torch.tensor([0.6, 0.6])
    v = model.predict_velocity(x, sig, pe)
    raw = model.transformer(hidden_states=x, encoder_hidden_states=pe.embeds, encoder_hidden_states_mask=pe.mask,
                            timestep=sig, img_shapes=[[(1, 2, 2)]] * 2, return_dict=False)[0]
    assert v.dtype == torch.float32
    torch.testing.assert_close(v, raw.float())
    assert v.abs().mean() > 1e-3


def test_true_cfg_rescale_independent(model):
    pe = model.encode_prompt(PROMPTS)
    neg = model.encode_prompt([NEG, NEG])
    x = model.prepare_noise(32, 32, gens([3, 4]))
    sig = torch.tensor([0.9, 0.4])
    scale = 4.0
    with torch.no_grad():
        got = model.guided_velocity(x, sig, pe, neg, scale)
        cond = model.predict_velocity(x, sig, pe).double()
        uncond = model.predict_velocity(x, sig, neg).double()
    expect = torch.empty_like(cond)
    for b in range(cond.shape[0]):
        for t in range(cond.shape[1]):
            comb = uncond[b, t] + scale * (cond[b, t] - uncond[b, t])
            expect[b, t] = comb * (cond[b, t].pow(2).sum().sqrt() / comb.pow(2).sum().sqrt())
    torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-6)
    # per-token norm equals the conditional norm, and guidance changed the direction
    torch.testing.assert_close(got.norm(dim=-1).double(), cond.norm(dim=-1), rtol=1e-5, atol=1e-6)
    assert (got.double() - cond).abs().max() > 1e-3


def test_cfg_off_and_fail_closed(model):
    pe = model.encode_prompt(PROMPTS)
    neg = model.encode_prompt([NEG, NEG])
    x = model.prepare_noise(32, 32, gens([5, 6]))
    sig = torch.tensor([0.5, 0.5])
    with torch.no_grad():
        plain = model.predict_velocity(x, sig, pe)
        assert torch.equal(model.guided_velocity(x, sig, pe, neg, 1.0), plain)
        assert torch.equal(model.guided_velocity(x, sig, pe, None, 1.0), plain)
        with pytest.raises(ValueError, match="negative"):
            model.guided_velocity(x, sig, pe, None, 4.0)


# ---- schedule --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps,hw", [(3, (64, 64)), (10, (512, 512)), (10, (1024, 768)), (40, (1024, 1024))])
def test_schedule_equals_diffusers_scheduler(model, qwen_dir, steps, hw):
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(qwen_dir, subfolder="scheduler")
    h, w = hw
    seq = (h // 16) * (w // 16)
    c = sched.config
    mu = calculate_shift(seq, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    sigmas = model.schedule(steps, h, w)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (steps + 1,)
    assert torch.equal(sigmas, sched.sigmas.float())
    assert torch.equal(sigmas[:-1] * 1000, sched.timesteps)
    assert abs(float(sigmas[-2]) - 0.02) < 1e-6 and float(sigmas[-1]) == 0.0


# ---- end to end ------------------------------------------------------------------------------------------------


def test_euler_loop_equals_diffusers_pipeline(model, pipe):
    """Our schedule + true-CFG + Euler steps reproduce QwenImagePipeline.__call__ (same per-row noise)."""
    steps, size, scale = 3, 32, 4.0
    pe = model.encode_prompt(PROMPTS)
    neg = model.encode_prompt([NEG, NEG])
    x = model.prepare_noise(size, size, gens([11, 12]))
    sigmas = model.schedule(steps, size, size)
    with torch.no_grad():
        for i in range(steps):
            v = model.guided_velocity(x, sigmas[i].expand(2), pe, neg, scale)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        ours = model.decode(x)
        ref = pipe(prompt=PROMPTS, negative_prompt=[NEG, NEG], true_cfg_scale=scale, height=size, width=size,
                   num_inference_steps=steps, generator=gens([11, 12]), output_type="latent",
                   max_sequence_length=512).images
    torch.testing.assert_close(x, ref.float(), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        ref_img = pipe(prompt=PROMPTS, negative_prompt=[NEG, NEG], true_cfg_scale=scale, height=size, width=size,
                       num_inference_steps=steps, generator=gens([11, 12]), output_type="pt",
                       max_sequence_length=512).images
    ref_u8 = (ref_img.clamp(0, 1) * 255).round().to(torch.uint8)
    assert ours.dtype == torch.uint8 and ours.shape == (2, 3, size, size)
    assert (ours.int() - ref_u8.int()).abs().max() <= 1


# ---- checkpoint ------------------------------------------------------------------------------------------------


def test_transformer_save_load_round_trip(model, qwen_dir, tmp_path):
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import load_file

    on_disk = load_file(os.path.join(qwen_dir, "transformer", "diffusion_pytorch_model.safetensors"))
    assert set(on_disk) == set(model.transformer.state_dict())
    model.transformer.save_pretrained(tmp_path / "t")
    loaded, info = QwenImageTransformer2DModel.from_pretrained(tmp_path / "t", output_loading_info=True)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    sd = model.transformer.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, sd[k]), k


@pytest.mark.parametrize("change", [{"use_karras_sigmas": True}, {"use_dynamic_shifting": False},
                                    {"time_shift_type": "linear"}, {"num_train_timesteps": 500}])
def test_unsupported_scheduler_config_raises(model, change):
    with pytest.raises(ValueError, match="scheduler"):
        QwenImageModel(model.transformer, model.vae, model.text_encoder, model.tokenizer,
                       {**model.scheduler_config, **change})


def test_prompt_embeds_validation():
    with pytest.raises(ValueError):
        PromptEmbeds(torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError):
        PromptEmbeds(torch.zeros(2, 3, 4), torch.ones(2, 4))


def test_bf16_load_casts_inside_and_returns_fp32(qwen_dir):
    m = load_model(qwen_dir, dtype=torch.bfloat16, max_sequence_length=8)
    assert m.max_sequence_length == 8 and m.transformer.dtype == torch.bfloat16
    pe = m.encode_prompt(PROMPTS)
    assert pe.embeds.dtype == torch.bfloat16 and pe.embeds.shape[1] <= 8
    x = m.prepare_noise(32, 32, gens([0, 1]))
    assert x.dtype == torch.float32
    with torch.no_grad():
        v = m.guided_velocity(x, torch.tensor([0.5, 0.5]), pe, m.encode_prompt([NEG, NEG]), 4.0)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    assert m.decode(x).dtype == torch.uint8
