"""tools/pretrain_ocr_mini (`python3 -m tools.pretrain_ocr_mini`), module by module: the math and data pieces on
their own, then two real CPU smoke calls (the second resumes the first) through render -> VAE -> latents ->
transformer -> rapidocr eval -> export -> assemble -> models.load_model -> NativeEngine."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tools.pretrain_ocr_mini.cli as pom_cli
import tools.pretrain_ocr_mini.common as pom_common
import tools.pretrain_ocr_mini.data as pom_data
import tools.pretrain_ocr_mini.nets as pom_nets
import tools.pretrain_ocr_mini.ocr_pool as pom_pool
import tools.pretrain_ocr_mini.pictures as pom_pictures
import tools.pretrain_ocr_mini.ship as pom_ship
import tools.pretrain_ocr_mini.state as pom_state
import tools.pretrain_ocr_mini.transformer_phase as pom_transformer
import tools.pretrain_ocr_mini.vae_phase as pom_vae

# one pytest-xdist worker runs this module (pytest.ini: --dist loadgroup): its module fixtures are costly
pytestmark = pytest.mark.xdist_group("test_pretrain_ocr_mini")


# ---------------------------------------------------------------------------------------------------------------
# Data: vocabulary, templates, seeds, renders
# ---------------------------------------------------------------------------------------------------------------


def test_vocabulary_templates_and_quoted_targets():
    from data_prep.common import first_quoted_span

    words = pom_data.vocabulary(pom_data.DEFAULT_NUM_WORDS)
    assert len(words) == len(set(words)) == pom_data.DEFAULT_NUM_WORDS
    assert all(3 <= len(w) <= 5 and w.isalpha() and w.islower() for w in pom_data.WORDS)
    assert not set(pom_data.TRAIN_TEMPLATES) & set(pom_data.HELDOUT_TEMPLATES)
    train = set(pom_data.train_prompts(words))
    held = [p for p, _ in pom_data.heldout_prompts(words)]
    assert len(train) == len(words) * len(pom_data.TRAIN_TEMPLATES) and not train & set(held)
    for prompt, word in (pom_data.heldout_prompts(words)
                         + [(t.format(w), w) for t in pom_data.TRAIN_TEMPLATES for w in words]):
        assert first_quoted_span(prompt) == word
    # prompt id convention of build_latent_data: word_index * T + template_index
    table = pom_data.train_prompts(words)
    assert table[5 * len(pom_data.TRAIN_TEMPLATES) + 3] == pom_data.TRAIN_TEMPLATES[3].format(words[5])
    with pytest.raises(ValueError, match="num_words"):
        pom_data.vocabulary(len(pom_data.WORDS) + 1)


def test_heldout_seeds_are_disjoint_from_every_training_seed():
    train = [pom_data.train_render_seeds(call, 10**6) for call in range(3)]
    held = [s for i in range(len(pom_data.WORDS) * len(pom_data.HELDOUT_TEMPLATES)) for s in pom_data.eval_seeds(i, 8)]
    vae_held = pom_data.vae_eval_seeds(4096)
    assert len(set(held)) == len(held) and not set(held) & set(vae_held)
    for r in train:
        assert r.stop <= min(held) and r.stop <= vae_held.start
    assert train[0].stop <= train[1].start and train[1].stop <= train[2].start


def test_render_word_is_deterministic_and_blends_its_parts():
    a = pom_data.render_word("house", 7, 128)
    assert a.shape == (128, 128, 3) and a.dtype == np.uint8
    assert np.array_equal(a, pom_data.render_word("house", 7, 128))
    assert not np.array_equal(a, pom_data.render_word("house", 8, 128))
    bg, text, coverage = pom_data.render_parts("house", 7, 128)
    blended = bg * (1 - coverage[..., None]) + text * coverage[..., None]
    assert np.abs(a / 255.0 - blended).max() <= 0.5 / 255 + 1e-9


def test_renders_are_bold_large_inside_the_margin_and_keep_the_luma_gap():
    margin = round(0.06 * 128)
    kinds, text_lumas, ink = [], [], []
    for seed in range(120):
        word = pom_data.vocabulary(64)[seed % 64]
        bg, text, coverage = pom_data.render_parts(word, seed, 128)
        ys, xs = np.nonzero(coverage > 0)
        assert ys.min() >= margin - 1 and ys.max() <= 128 - margin and xs.min() >= margin - 1
        assert xs.max() <= 128 - margin
        gap = np.abs(bg @ pom_data.LUMA - text @ pom_data.LUMA)
        assert gap.min() >= pom_data.MIN_LUMA_GAP, (seed, gap.min())   # every background pixel, gradients included
        ink.append((coverage > 0.5).mean())
        kinds.append("solid" if np.ptp(bg.reshape(-1, 3), axis=0).max() < 1e-9 else "two-colour")
        text_lumas.append(float(text @ pom_data.LUMA))
        assert max(xs.max() - xs.min(), ys.max() - ys.min()) >= 0.35 * 128   # large: >= 35% of the side
    assert np.mean(ink) > 0.06            # bold glyphs: the thin built-in font covered ~4% of the pixels
    assert 0.35 <= kinds.count("two-colour") / len(kinds) <= 0.65
    lumas = np.array(text_lumas)          # text colour over the whole range, not only dark-on-light
    assert (lumas < 0.25).any() and (lumas > 0.75).any() and ((lumas > 0.4) & (lumas < 0.6)).any()


def test_fitting_font_size_is_the_largest_that_fits():
    box = 128 - 2 * round(0.06 * 128)
    for word in ("cat", "house", "pizza"):
        size = pom_data.fitting_font_size(word, 128)
        assert size <= 64
        left, top, right, bottom = pom_data._font(size).getbbox(word)
        assert right - left <= box and bottom - top <= box
        if size < 64:
            left, top, right, bottom = pom_data._font(size + 1).getbbox(word)
            assert right - left > box or bottom - top > box


def test_colour_with_luma_hits_the_target_inside_the_cube():
    rng = np.random.default_rng(0)
    for _ in range(200):
        rgb, target = rng.uniform(0, 1, 3), float(rng.uniform(0, 1))
        out = pom_data.colour_with_luma(rgb, target)
        assert abs(out @ pom_data.LUMA - target) < 1e-9
        assert out.min() >= -1e-12 and out.max() <= 1 + 1e-12


def test_flat_colour_l1_is_the_two_colour_predictor():
    light = torch.full((1, 3, 4, 4), 200, dtype=torch.uint8)
    light[:, :, :1] = 100                      # a quarter of the pixels at 100: median stays 200
    dark = torch.zeros((1, 3, 4, 4), dtype=torch.uint8)
    # light image: 0.25 x |100 - 200| / 127.5; dark image: 0 -> mean over the two images
    expected = 0.5 * (0.25 * 100 / 127.5)
    assert abs(pom_vae.flat_colour_l1(torch.cat([light, dark])) - expected) < 1e-6
    # three light images of flat 200, 180, 160: one colour for the group (the median, 180)
    flats = torch.stack([torch.full((3, 4, 4), v, dtype=torch.uint8) for v in (200, 180, 160)])
    assert abs(pom_vae.flat_colour_l1(flats) - (20 + 0 + 20) / 127.5 / 3) < 1e-6


@pytest.mark.parametrize("l1,step,expected", [(0.23, 1000, True), (0.23, 999, False), (0.20, 1500, False),
                                              (0.25, 5000, True)])
def test_vae_collapse_check(l1, step, expected):
    assert pom_vae.vae_collapsed(l1, 0.238, step, check_step=1000, ratio=0.9) is expected
    assert pom_vae.vae_collapsed(l1, 0.238, step, check_step=0, ratio=0.9) is False  # 0 = no check


def test_warmup_factor_zero_means_none():
    assert pom_vae.warmup_factor(0, 0) == 1.0
    assert pom_vae.warmup_factor(0, 10) == pytest.approx(0.1)
    assert pom_vae.warmup_factor(9, 10) == 1.0 and pom_vae.warmup_factor(50, 10) == 1.0
    with pytest.raises(ValueError):
        pom_vae.warmup_factor(0, -1)


def test_parse_sweep():
    assert pom_transformer.parse_sweep(["4x160", "6x128:1e-3"], 3e-4) == [
        {"layers": 4, "width": 160, "lr": 3e-4, "name": "4x160"},
        {"layers": 6, "width": 128, "lr": 1e-3, "name": "6x128:1e-3"}]
    with pytest.raises(SystemExit, match="LAYERSxWIDTH"):
        pom_transformer.parse_sweep(["4by160"], 3e-4)


# ---------------------------------------------------------------------------------------------------------------
# The VAE's 2D fast path, losses, schedule
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vae():
    torch.manual_seed(0)
    return pom_nets.build_vae(pom_nets.vae_config(4, 1)).eval()


def test_build_vae_zeroes_only_the_unused_taps(tiny_vae):
    frame = [c for c in pom_nets.causal_convs(tiny_vae) if pom_nets.is_frame_conv(c) and c.kernel_size[0] == 3]
    temporal = [c for c in pom_nets.causal_convs(tiny_vae) if not pom_nets.is_frame_conv(c)]
    assert frame and temporal  # resample time_convs are left alone
    for c in frame:
        assert c.weight[:, :, :-1].abs().max() == 0 and c.weight[:, :, -1].abs().max() > 0
    assert all(c.weight.abs().max() > 0 for c in temporal)


def test_fast_2d_convs_equal_the_video_vae_even_with_nonzero_early_taps(tiny_vae):
    vae = pom_nets.build_vae(pom_nets.vae_config(4, 1)).eval()
    vae.load_state_dict(tiny_vae.state_dict())
    with torch.no_grad():  # the claim is about causal padding, not about the zeroing
        for c in pom_nets.causal_convs(vae):
            if c.kernel_size[0] > 1:
                c.weight[:, :, :-1].normal_(0, 0.3)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    x = (images.float() / 127.5 - 1)[:, :, None]
    with torch.no_grad():
        ref = vae.encode(x).latent_dist
        ref_dec = vae.decode(ref.mean).sample
        with pom_nets.Fast2dConvs(vae):
            with pom_nets.Fast2dConvs(vae):  # nested: a no-op that must not undo the outer patch on exit
                pass
            assert all("forward" in c.__dict__ for c in pom_nets.causal_convs(vae) if pom_nets.is_frame_conv(c))
            mean, logvar = pom_nets.vae_posterior(vae, images)
            dec = pom_nets.vae_decode_train(vae, mean).clamp(-1, 1)
    assert not any("forward" in c.__dict__ for c in pom_nets.causal_convs(vae))
    torch.testing.assert_close(mean, ref.mean, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logvar, ref.logvar, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(dec, ref_dec, atol=1e-5, rtol=1e-4)
    recon = pom_nets.vae_reconstruct(vae, images, lambda: torch.no_grad())
    assert recon.dtype == torch.uint8 and recon.shape == images.shape


def test_vae_loss_is_l1_plus_weighted_kl(tiny_vae):
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    g = torch.Generator().manual_seed(3)
    total, l1, kl = pom_nets.vae_loss(tiny_vae, images, 0.5, g)
    mean, logvar = pom_nets.vae_posterior(tiny_vae, images)
    expected_kl = 0.5 * (mean ** 2 + logvar.exp() - 1 - logvar).mean()
    torch.testing.assert_close(kl, expected_kl.detach())
    torch.testing.assert_close(total.detach(), l1 + 0.5 * kl)
    assert 0 < float(l1) < 2


def test_latent_normalisation_inverts_the_wrapper_decode(tiny_vae):
    """encode_latents normalises with the config's mean/std and packs; unpack * std + mean is the raw mean."""
    from models.qwen_image import unpack_latents

    vae = pom_nets.build_vae(pom_nets.vae_config(4, 1)).eval()
    vae.load_state_dict(tiny_vae.state_dict())
    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8)
    mean, std = pom_nets.latent_stats(vae, images, 2, torch.no_grad)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    packed = pom_nets.encode_latents(vae, images, 2, torch.no_grad)
    assert packed.shape == (3, 4, 64) and packed.dtype == torch.bfloat16
    z = unpack_latents(packed.float(), 4, 4) * torch.tensor(std).view(1, -1, 1, 1)
    z = z + torch.tensor(mean).view(1, -1, 1, 1)
    with torch.no_grad():
        raw = vae.encode((images.float() / 127.5 - 1)[:, :, None]).latent_dist.mean[:, :, 0]
    torch.testing.assert_close(z, raw, atol=0.02, rtol=0.02)  # bf16 storage
    all_z = raw.permute(1, 0, 2, 3).reshape(16, -1)
    torch.testing.assert_close(torch.tensor(mean), all_z.mean(1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(std), all_z.std(1, unbiased=False), atol=1e-5, rtol=1e-4)


def test_train_sigmas_are_the_shifted_logit_normal():
    g = torch.Generator().manual_seed(0)
    mu = 0.49
    s = pom_nets.train_sigmas(200_000, mu, g, torch.device("cpu"))
    assert s.dtype == torch.float32 and float(s.min()) > 0 and float(s.max()) < 1
    logit = torch.log(s / (1 - s))
    assert abs(float(logit.mean()) - mu) < 0.01 and abs(float(logit.std()) - 1.0) < 0.01
    assert abs(float(s.median()) - 1 / (1 + math.exp(-mu))) < 0.005


def test_schedule_mu_is_the_wrappers(tiny_models):
    import losses
    from models import load_model

    model = load_model(f"{tiny_models}/qwen_image")
    for size in (64, 128, 512):
        seq = model.image_seq_len(size, size)
        mu = pom_nets.schedule_mu(model.scheduler_config, seq)
        ours = losses.flow_sigmas(10, mu=mu, shift_terminal=model.scheduler_config["shift_terminal"])
        assert torch.equal(ours, model.schedule(10, size, size))


class _StubModel:
    def __init__(self, fn):
        self.fn, self.seen = fn, None

    def predict_velocity(self, x, sigmas, prompt):
        self.seen = (x, sigmas, prompt)
        return self.fn(x, sigmas)


def test_flow_matching_loss_interpolates_and_targets_eps_minus_x0():
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(4, 16, 64, generator=g), torch.randn(4, 16, 64, generator=g)
    sigmas = torch.tensor([0.1, 0.4, 0.7, 1.0])
    perfect = _StubModel(lambda x, s: noise - x0)
    assert float(pom_nets.flow_matching_loss(perfect, x0, "p", sigmas, noise)) == 0.0
    expected_x = (1 - sigmas.view(-1, 1, 1)) * x0 + sigmas.view(-1, 1, 1) * noise
    torch.testing.assert_close(perfect.seen[0], expected_x)
    zero = _StubModel(lambda x, s: torch.zeros_like(x))
    torch.testing.assert_close(pom_nets.flow_matching_loss(zero, x0, "p", sigmas, noise), ((noise - x0) ** 2).mean())


def test_flow_matching_training_and_the_ode_sampler_agree(tiny_models):
    """A tiny transformer trained with flow_matching_loss on two prompts, each with ONE fixed latent (+R / -R),
    generates that prompt's latent through the RL sampler; a wrong velocity sign, time direction or timestep
    convention would not."""
    from models.base import PromptEmbeds
    from models.qwen_image import QwenImageModel

    base = QwenImageModel.from_pretrained(f"{tiny_models}/qwen_image")
    torch.manual_seed(0)
    transformer = __import__("diffusers").QwenImageTransformer2DModel(**pom_nets.transformer_config(2, 64, 32, 32))
    pom_nets.adaln_zero_init(transformer)
    model = QwenImageModel(transformer, base.vae, base.text_encoder, base.tokenizer, base.scheduler_config)
    prompts = ['A sign that says "cat"', 'A sign that says "dog"']
    table = pom_nets.encode_prompts(base, prompts)
    target = torch.randn(1, 4, 64)  # 32x32 images: 4 packed tokens
    x0_of = torch.cat([target, -target])
    mu = pom_nets.schedule_mu(base.scheduler_config, 4)
    opt = torch.optim.AdamW(transformer.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):  # measured: cos 0.93-0.96 after 150 steps; -0.2 with the velocity sign flipped
        rows = torch.randint(0, 2, (16,), generator=g)
        x0, noise = x0_of[rows], torch.randn(16, 4, 64, generator=g)
        sigmas = pom_nets.train_sigmas(16, mu, g, torch.device("cpu"))
        loss = pom_nets.flow_matching_loss(model, x0, PromptEmbeds(table.embeds[rows], table.mask[rows]), sigmas, noise)
        loss.backward()
        opt.step()
        opt.zero_grad()
    transformer.eval()
    out = pom_nets.sample_latents(model, prompts * 2, [5, 6, 7, 8], 10, 32, torch.no_grad)
    cos = torch.nn.functional.cosine_similarity(out.flatten(1), x0_of.repeat(2, 1, 1).flatten(1), dim=1)
    assert float(loss.detach()) < 0.5 and bool((cos > 0.9).all()), (float(loss.detach()), cos)


def test_adaln_zero_init_starts_at_zero_velocity():
    from diffusers import QwenImageTransformer2DModel

    t = QwenImageTransformer2DModel(**pom_nets.transformer_config(1, 32, 16, 32))
    pom_nets.adaln_zero_init(t)
    with torch.no_grad():
        out = t(hidden_states=torch.randn(2, 4, 64), encoder_hidden_states=torch.randn(2, 5, 32),
                encoder_hidden_states_mask=torch.ones(2, 5, dtype=torch.long), timestep=torch.tensor([0.3, 0.9]),
                img_shapes=[[(1, 2, 2)]] * 2, return_dict=False)[0]
    assert out.shape == (2, 4, 64) and float(out.abs().max()) == 0.0
    assert pom_nets.rope_axes(128) == (16, 56, 56) and pom_nets.rope_axes(64) == (8, 28, 28)
    assert sum(pom_nets.rope_axes(16)) == 16


# ---------------------------------------------------------------------------------------------------------------
# Decisions, metrics, state files, datasets
# ---------------------------------------------------------------------------------------------------------------


def test_reserve_grows_with_a_slow_measured_ocr_rate():
    args = pom_cli.parse_args(["--state_dir", "x", "--device", "cpu"])  # GPU defaults: 64 words, 4+4x4x2 images each
    run = pom_state.Run(args, {}, Path("x"), torch.device("cpu"), 0.0, 0.0, pom_data.vocabulary(64), None)
    assert run.reserve() == args.reserve_s == 45.0
    run.record_ocr_rate(10, 100.0)  # the first job also starts the OCR engines: not a rate
    assert run.ocr_rate is None and run.reserve() == 45.0
    run.record_ocr_rate(1000, 1.0)
    assert run.reserve() == 45.0
    run.record_ocr_rate(500, 10.0)  # 50 images/s; 64 words * (4 + 4 x 4 x 2) = 2304 images -> 46 s, x1.3 + 15
    assert run.reserve() == pytest.approx(15 + 1.3 * 2304 / 50)


def test_compile_auto_only_pays_off_over_a_long_call():
    should_compile = pom_transformer.should_compile
    assert should_compile("auto", 300.0, 150.0) and not should_compile("auto", 100.0, 150.0)
    assert should_compile("blocks", 1.0, 150.0) and not should_compile("none", 1e9, 150.0)
    with pytest.raises(ValueError, match="--compile"):
        pom_transformer.should_compile("yes", 1.0, 1.0)


@pytest.mark.parametrize("mean, previous, action", [
    (0.10, None, "continue"), (0.25, 0.1, "continue"), (0.36, 0.25, "stop"), (0.60, 0.3, "stop"),
    (0.70, 0.30, "revert"), (0.70, 0.15, "stop"), (0.70, None, "stop"), (0.19, 0.1, "continue"),
])
def test_start_point_action(mean, previous, action):
    assert pom_nets.start_point_action(mean, previous, window=(0.2, 0.6), stop_reward=0.35) == action


def test_ocr_metrics_values():
    m = pom_pool.ocr_metrics(np.array([[1.0, 1.0], [0.0, 0.5]]))
    assert m["mean"] == pytest.approx(0.625) and m["exact"] == pytest.approx(0.5)
    assert m["within_std"] == pytest.approx(0.125) and m["spread"] == pytest.approx(0.5)
    assert (m["n_prompts"], m["n_seeds"]) == (2, 2)


def test_weights_round_trip_in_bf16_and_detect_corruption(tmp_path, tiny_vae):
    meta = pom_state.save_weights(tiny_vae, tmp_path / "vae.safetensors")
    numel = sum(v.numel() for v in tiny_vae.state_dict().values())
    keys = pom_state.frame_tap_keys(tiny_vae)
    live = numel - sum(tiny_vae.state_dict()[k][:, :, :-1].numel() for k in keys)  # frame convs: the last tap only
    assert keys and 2 * live < meta["bytes"] < 2 * live + 65536 < 2 * numel
    other = pom_nets.build_vae(pom_nets.vae_config(4, 1))
    pom_state.load_weights(other, tmp_path / "vae.safetensors", meta["sha256"])
    for k, v in tiny_vae.state_dict().items():
        assert torch.equal(other.state_dict()[k], v.to(torch.bfloat16).float())
    data = bytearray((tmp_path / "vae.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (tmp_path / "vae.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        pom_state.load_weights(other, tmp_path / "vae.safetensors", meta["sha256"])


def test_resume_with_other_architecture_fails_naming_the_flag():
    args = pom_cli.parse_args(["--smoke", "--state_dir", "x"])
    saved = pom_state.run_config(args, pom_data.vocabulary(4), 32)
    args.width = 64
    with pytest.raises(ValueError, match="--layers/--width/--head_dim"):
        pom_state.check_resume_config(saved, pom_state.run_config(args, pom_data.vocabulary(4), 32), Path("state"))
    with pytest.raises(ValueError, match="--num_words"):
        pom_state.check_resume_config(saved, {**saved, "words": pom_data.vocabulary(5)}, Path("state"))
    # before any transformer has trained (e.g. after a --sweep call) its architecture may change; nothing else
    pom_state.check_resume_config(saved, pom_state.run_config(args, pom_data.vocabulary(4), 32), Path("state"),
                            trained_transformer=False)
    with pytest.raises(ValueError, match="RENDER_VERSION"):
        pom_state.check_resume_config(saved, {**saved, "render": "thin-font"}, Path("state"), trained_transformer=False)


def test_compact_state_refuses_live_early_taps(tiny_vae):
    vae = pom_nets.build_vae(pom_nets.vae_config(4, 1))
    key = sorted(pom_state.frame_tap_keys(vae))[0]
    with torch.no_grad():
        vae.state_dict()[key][:, :, 0] += 1.0
    with pytest.raises(ValueError, match="non-zero temporal taps"):
        pom_state.compact_state(vae)
    assert pom_state.frame_tap_keys(torch.nn.Linear(2, 2)) == set()


def test_write_datasets_in_the_project_schema(tmp_path):
    import pyarrow.parquet as pq

    from data_prep.common import T2I_SCHEMA
    from data_prep.dataset import PromptDataset
    from models.qwen_image import QWEN_IMAGE_SYSTEM_PROMPT

    words = pom_data.vocabulary(6)
    counts = pom_ship.write_datasets(tmp_path, words)
    assert counts == {"train": 6 * len(pom_data.TRAIN_TEMPLATES), "test": 6 * len(pom_data.HELDOUT_TEMPLATES)}
    for split, templates in (("train", pom_data.TRAIN_TEMPLATES), ("test", pom_data.HELDOUT_TEMPLATES)):
        assert pq.read_schema(tmp_path / f"{split}.parquet").equals(T2I_SCHEMA)
        ds = PromptDataset(tmp_path / f"{split}.parquet", guidance=True, data_sources=["ocr"])
        rows = [ds[i] for i in range(len(ds))]
        assert {r.ground_truth for r in rows} == set(words) and {r.data_source for r in rows} == {"ocr"}
        assert all(r.prompt[0] == {"role": "system", "content": QWEN_IMAGE_SYSTEM_PROMPT} for r in rows)
        assert {r.prompt[1]["content"] for r in rows} == {t.format(w) for t in templates for w in words}
        assert [r.extra_info["index"] for r in rows] == list(range(len(rows)))
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["words"] == words and info["heldout_templates"] == list(pom_data.HELDOUT_TEMPLATES)


# ---------------------------------------------------------------------------------------------------------------
# Two real smoke calls: the second resumes the first
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("pretrain_smoke")
    first, second = root / "call1", root / "call2"
    common = ["--smoke", "--tiny_models_dir", str(Path(tiny_models))]
    assert pom_cli.main([*common, "--state_dir", str(first), "--transformer_max_s", "3"]) == 0
    assert pom_cli.main([*common, "--state_dir", str(second), "--resume_from", str(first),
                     "--transformer_max_s", "6"]) == 0
    load = lambda d: json.loads((d / pom_common.STATE_FILE).read_text())  # noqa: E731
    return first, second, load(first), load(second)


def test_smoke_state_files_are_compact_bf16_and_verified(smoke):
    first, second, s1, s2 = smoke
    for d, s in ((first, s1), (second, s2)):
        for name in ("vae", "transformer"):
            meta = s["files"][name]
            path = d / meta["file"]
            assert path.stat().st_size == meta["bytes"] < 16 * 2**20 and pom_state.sha256_file(path) == meta["sha256"]
        for name in ("log.txt", "samples.png", "curve.png"):
            assert (d / name).is_file()
        files = [p for p in d.iterdir() if p.is_file()]
        assert len(files) <= 8 and sum(p.stat().st_size for p in files) < 64 * 2**20
    assert (first / "vae_recon.png").is_file() and not (second / "vae_recon.png").exists()
    tr_cfg = s2["transformer"]["config"]
    from diffusers import QwenImageTransformer2DModel

    numel = sum(p.numel() for p in QwenImageTransformer2DModel(**tr_cfg).parameters())
    assert 2 * numel < s2["files"]["transformer"]["bytes"] < 2 * numel + 65536


def test_smoke_resume_continues_counters_curves_and_weights(smoke):
    _, _, s1, s2 = smoke
    assert [c["index"] for c in s2["calls"]] == [0, 1] and s2["calls"][0] == s1["calls"][0]
    assert s1["calls"][0]["phase_at_start"] == "vae" and s2["calls"][1]["phase_at_start"] == "transformer"
    # call 2 started from call 1's saved weights (not a fresh init) and did not retrain the VAE
    assert s2["calls"][1]["loaded_files"] == {k: v["sha256"] for k, v in s1["files"].items()}
    assert s2["files"]["vae"]["sha256"] == s1["files"]["vae"]["sha256"]
    assert s2["vae"]["steps"] == s1["vae"]["steps"] > 0
    t1, t2 = s1["transformer"], s2["transformer"]
    assert t2["steps"] > t1["steps"] > 0 and t2["images"] > t1["images"] and t2["train_seconds"] > t1["train_seconds"]
    for key in ("loss", "eval", "vae_eval", "vae_loss"):
        assert s2["curves"][key][:len(s1["curves"][key])] == s1["curves"][key], key
    new_loss = s2["curves"]["loss"][len(s1["curves"]["loss"]):]
    assert new_loss and new_loss[0]["step"] > s1["curves"]["loss"][-1]["step"]
    assert new_loss[0]["total_s"] > s1["total_s"] and s2["total_s"] > s1["total_s"]
    new_eval = s2["curves"]["eval"][len(s1["curves"]["eval"]):]
    assert new_eval and new_eval[0]["images"] > s1["curves"]["eval"][-1]["images"]


def test_smoke_evals_report_the_ocr_metrics(smoke):
    _, _, _, s2 = smoke
    for e in s2["curves"]["eval"]:
        assert {"mean", "exact", "within_std", "spread", "train_s", "images"} <= set(e)
        assert 0 <= e["mean"] <= 1 and e["n_seeds"] == 2
    final = s2["final_eval"]["by_steps"]["4"]
    assert final["n_prompts"] == 4 * len(pom_data.HELDOUT_TEMPLATES) and final["n_seeds"] == 2
    assert np.array(final["rewards"]).shape == (final["n_prompts"], 2)
    assert s2["vae"]["final_recon"]["clean_render_mean"] > 0.9  # rapidocr reads the clean 64^2 renders


def test_smoke_heldout_split_shares_no_template_or_seed_with_training(smoke):
    _, _, _, s2 = smoke
    words = s2["config"]["words"]
    from data_prep.common import first_quoted_span

    train = set(pom_data.train_prompts(words))
    assert not train & set(s2["final_eval"]["prompts"])
    templates = {p.replace(f'"{first_quoted_span(p)}"', '"{}"') for p in s2["final_eval"]["prompts"]}
    assert templates == set(s2["config"]["heldout_templates"])
    assert not templates & set(s2["config"]["train_templates"])
    used = [pom_data.train_render_seeds(c["index"], 64) for c in s2["calls"]]
    assert all(s >= max(r.stop for r in used) for s in s2["samples"]["seeds"])


def test_smoke_export_assemble_load_and_generate(smoke, tmp_path):
    from models import load_model

    _, second, _, s2 = smoke
    ship, assembled = second / "ship", second / "assembled"
    info = json.loads((ship / "build_info.json").read_text())
    for rel, meta in info["files"].items():
        assert pom_state.sha256_file(ship / rel) == meta["sha256"]
    for rel in ("model_index.json", "scheduler/scheduler_config.json", "transformer/config.json",
                "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
                "vae/compact_bf16.safetensors", "README.md", "data/train.parquet", "data/test.parquet"):
        assert (ship / rel).is_file(), rel
    assert not (ship / "text_encoder").exists() and (assembled / "text_encoder").is_dir()
    assert info["start_point"]["4"]["n_prompts"] == 16
    model = load_model(str(assembled))
    assert model.transformer.config.num_layers == s2["transformer"]["config"]["num_layers"]
    assert model.vae.config.latents_mean == s2["vae"]["config"]["latents_mean"]
    samples = s2["samples"]
    images = pom_ship.native_engine_images(assembled, samples["prompts"][:2], samples["seeds"][:2], samples["steps"],
                                      samples["size"])
    assert images.shape == (2, 3, 64, 64) and images.dtype == torch.uint8
    expected = pom_pictures.read_grid(second / samples["file"], 2, samples["cols"], samples["size"])
    assert int((images.int() - expected.int()).abs().max()) <= 2
    # assembling again is a no-op; a corrupted shipped file is refused
    assert pom_ship.assemble_pipeline(ship, assembled) == assembled
    bad = tmp_path / "ship"
    shutil.copytree(ship, bad)
    weights = bad / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        pom_ship.assemble_pipeline(bad, tmp_path / "out")


# ---------------------------------------------------------------------------------------------------------------
# The transformer loop's decisions, with the OCR pool replaced by scripted rewards
# ---------------------------------------------------------------------------------------------------------------


class _ScriptedPool:
    """Stands in for CpuPool.score: eval k scores every image `rewards[k]`, and records the EMA weights it was
    sampled with (the loop calls score right after sampling)."""

    workers = 1

    def __init__(self, run_ref: list, rewards: list[float]):
        self.run_ref, self.rewards, self.seen = run_ref, list(rewards), []

    def score(self, images, targets, meta=None):
        self.seen.append({k: v.clone() for k, v in self.run_ref[0].ema.state_dict().items()})
        value = self.rewards[len(self.seen) - 1]
        job = type("Job", (), {"ready": lambda self: True,
                               "get": lambda self, timeout=None: [([value] * len(targets), [""] * len(targets))]})()
        return pom_pool.PendingScore(job, len(targets), __import__("time").monotonic(), meta or {})


def test_transformer_loop_reverts_an_overshoot_and_survives_a_compile_failure(tmp_path, tiny_models, monkeypatch):
    from models.qwen_image import QwenImageModel

    args = pom_cli.parse_args(["--smoke", "--state_dir", str(tmp_path), "--eval_every_s", "0.2",
                           "--compile", "blocks", "--log_every_s", "0.1"])
    words = pom_data.vocabulary(args.num_words)
    base = QwenImageModel.from_pretrained(f"{tiny_models}/qwen_image")
    state = pom_state.new_state(pom_state.run_config(args, words, 32))
    state["calls"].append({"index": 0, "wall_s": 0.0})
    state["phase"] = "transformer"
    ref: list = []
    pool = _ScriptedPool(ref, [0.1, 0.3, 0.7])  # continue, continue (in the window, < 0.35), overshoot -> revert
    run = pom_state.Run(args, state, tmp_path, torch.device("cpu"), __import__("time").monotonic(), 0.0, words, base,
                  pool, tmp_path / "log.txt")
    ref.append(run)
    torch.manual_seed(0)
    vae = pom_nets.build_vae(pom_nets.vae_config(4, 1)).eval()
    transformer = pom_state.load_transformer(state, tmp_path, torch.device("cpu"))
    table = pom_nets.encode_prompts(base, pom_data.train_prompts(words))
    data = pom_transformer.LatentData(torch.randn(64, 16, 64).to(torch.bfloat16), torch.arange(64) % len(table),
                          table.embeds.float(), table.mask)

    def failing_compile(module):  # what a broken torch.compile looks like at the first forward
        def boom(*a, **k):
            raise RuntimeError("simulated inductor failure")
        for block in module.transformer_blocks:
            block._compiled_call_impl = boom

    monkeypatch.setattr(pom_transformer, "compile_blocks", failing_compile)  # where train_transformer looks it up
    pom_transformer.train_transformer(run, vae, transformer, data)
    log = (tmp_path / "log.txt").read_text()
    assert "torch.compile failed (RuntimeError: simulated inductor failure)" in log and "EAGER" in log
    assert all(b._compiled_call_impl is None for b in transformer.transformer_blocks)
    curve = state["curves"]["eval"]
    assert [round(e["mean"], 3) for e in curve] == [0.1, 0.3, 0.7]
    assert curve[2]["step"] > curve[1]["step"] > curve[0]["step"] >= 0 and state["transformer"]["steps"] > 0
    assert state["phase"] == "done" and state["start_point"]["action"] == "revert"
    assert state["start_point"]["eval"]["index"] == 1
    for k, v in run.ema.state_dict().items():  # the EMA holds exactly the weights eval 1 sampled with
        assert torch.equal(v, pool.seen[1][k]), k
    assert any(not torch.equal(pool.seen[1][k], pool.seen[2][k]) for k in pool.seen[1])
    saved = json.loads((tmp_path / pom_common.STATE_FILE).read_text())  # saved after each recorded eval
    assert len(saved["curves"]["eval"]) >= 2 and saved["files"]["transformer"]["sha256"]


# ---------------------------------------------------------------------------------------------------------------
# The shipped checkpoint (assets/ocr_mini)
# ---------------------------------------------------------------------------------------------------------------

SHIP = Path(pom_common.REPO) / "assets" / "ocr_mini"


def test_the_shipped_checkpoint_is_small_bf16_and_verified():
    info = json.loads((SHIP / "build_info.json").read_text())
    total = sum(p.stat().st_size for p in SHIP.rglob("*") if p.is_file())
    assert total <= 16 * 2**20, total
    for rel, meta in info["files"].items():
        assert pom_state.sha256_file(SHIP / rel) == meta["sha256"], rel
    from safetensors import safe_open

    for rel in ("transformer/diffusion_pytorch_model.safetensors", f"vae/{pom_common.SHIP_VAE_FILE}"):
        with safe_open(str(SHIP / rel), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}, rel
    lo, hi = 0.2, 0.6
    assert all(lo <= m["mean"] <= hi and 0.05 <= m["exact"] <= 0.4 and m["within_std"] > 0
               for m in info["start_point"].values()), info["start_point"]


@pytest.mark.slow
def test_the_shipped_checkpoint_loads_unchanged_and_reproduces_its_start_point(tmp_path):
    """Assemble, load through models.load_model and sample with the native engine on CPU (fp32) the first seed of
    32 held-out prompts at 10 steps, as the H200's final eval did (bf16 autocast): the rapidocr rewards match the
    recorded ones sample by sample on most images and in the mean."""
    import rewards

    pipeline = pom_ship.assemble_pipeline(SHIP, tmp_path / "ocr_mini")
    state = json.loads((Path(pom_common.REPO) / "assets" / "ocr_mini_state" / "state.json").read_text())
    final = state["final_eval"]
    recorded = np.array(final["by_steps"]["10"]["rewards"])[:32, 0]
    items = pom_data.heldout_prompts(state["config"]["words"])[:32]
    assert [p for p, _ in items] == final["prompts"][:32]
    seeds = [pom_data.eval_seeds(i, final["seeds_per_prompt"])[0] for i in range(32)]
    images = pom_ship.native_engine_images(pipeline, [p for p, _ in items], seeds, 10, state["config"]["resolution"])
    scorer = rewards.RewardScorer(rewards.RewardConfig(ocr_backend="rapidocr", rapidocr_det_limit_side_len=256))
    got = scorer.score_batch(images, [w for _, w in items], ["ocr"] * 32).rewards.numpy()
    assert np.mean(np.abs(got - recorded) < 1e-6) >= 0.6, (got.round(3), recorded.round(3))
    assert abs(got.mean() - recorded.mean()) <= 0.1 and got.mean() >= 0.2, (got.mean(), recorded.mean())
