"""models/__init__.py and models/base.py: family dispatch, clear load errors, shared helpers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from models import load_model, model_family
from models.base import FlowModel, PromptEmbeds, per_row_noise, to_uint8


def test_family_from_model_index(tiny_models, tmp_path):
    assert model_family(os.path.join(tiny_models, "qwen_image")) == "qwen_image"
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "BooguImagePipeline"}))
    assert model_family(str(tmp_path)) == "boogu_image"


def test_each_family_class_carries_what_the_code_asks_a_family(tiny_models):
    """FAMILIES maps model_index.json to the class; the class answers every per-family question (no branch on the
    name elsewhere), with the values the code had in its own tables before."""
    from types import SimpleNamespace

    from models import FAMILIES, check_size_for, family_class

    assert {cls: family for cls, (family, _, _) in FAMILIES.items()} == {"QwenImagePipeline": "qwen_image",
                                                                         "BooguImagePipeline": "boogu_image"}
    qwen, boogu = family_class("qwen_image"), family_class("boogu_image")
    assert (qwen.__name__, boogu.__name__, qwen.family, boogu.family) == (
        "QwenImageModel", "BooguImageModel", "qwen_image", "boogu_image")
    assert (qwen.cfg_argument, boogu.cfg_argument) == ("true_cfg_scale", "guidance_scale")
    assert (qwen.default_negative_prompt, boogu.default_negative_prompt) == (" ", "")
    assert not qwen.supports_reference_images and boogu.supports_reference_images
    assert (qwen.vllm_omni_pipeline, boogu.vllm_omni_pipeline) == (
        "engines.vllm_omni_pipelines.RLQwenImagePipeline", "engines.vllm_omni_pipelines.RLBooguImagePipeline")
    args = SimpleNamespace(max_sequence_length=77)
    assert qwen.load_kwargs(args) == {"max_sequence_length": 77} and boogu.load_kwargs(args) == {}
    assert qwen.vae_scale_factor_of(SimpleNamespace(temperal_downsample=[False, True, True])) == 8
    assert boogu.vae_scale_factor_of(SimpleNamespace(block_out_channels=[1, 2, 3, 4])) == 8
    assert check_size_for(os.path.join(tiny_models, "qwen_image"), 64, 32) == "qwen_image"
    assert boogu.prompt_token_counter(os.path.join(tiny_models, "boogu_image_base")) is None  # never truncates
    count = qwen.prompt_token_counter(os.path.join(tiny_models, "qwen_image"))
    assert count(["a cat", "a cat on a mat"])[0] < count(["a cat", "a cat on a mat"])[1]
    with pytest.raises(ValueError, match="unknown model family"):
        family_class("flux")


def test_released_chat_is_each_pipelines_layout_and_vllm_omni_text_inverts_it():
    """The [system, user] chat each released pipeline encodes for a text: Qwen-Image one system prompt; Boogu the
    T2I prompt for a text and the TI2I prompt for the empty default negative (the upstream quirk, kept)."""
    from models import family_class
    from models.boogu_image import BOOGU_T2I_SYSTEM_PROMPT, BOOGU_TI2I_SYSTEM_PROMPT
    from models.qwen_image import QWEN_IMAGE_SYSTEM_PROMPT

    qwen, boogu = family_class("qwen_image"), family_class("boogu_image")
    assert qwen.released_chat('a sign that says "hi"') == [
        {"role": "system", "content": QWEN_IMAGE_SYSTEM_PROMPT}, {"role": "user", "content": 'a sign that says "hi"'}]
    assert qwen.released_chat(qwen.default_negative_prompt)[0]["content"] == QWEN_IMAGE_SYSTEM_PROMPT
    assert boogu.released_chat("a cat") == [
        {"role": "system", "content": BOOGU_T2I_SYSTEM_PROMPT}, {"role": "user", "content": "a cat"}]
    assert boogu.released_chat(boogu.default_negative_prompt) == [
        {"role": "system", "content": BOOGU_TI2I_SYSTEM_PROMPT}, {"role": "user", "content": ""}]
    for cls in (qwen, boogu):
        for text in ("a cat", 'the word "OPEN"', cls.default_negative_prompt):
            system, user = (m["content"] for m in cls.released_chat(text))
            assert cls.vllm_omni_text(system, user) == text


def test_unknown_class_name_raises(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    with pytest.raises(ValueError, match="StableDiffusion3Pipeline"):
        load_model(str(tmp_path))


def test_missing_and_corrupt_model_index_raise(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_model(str(tmp_path))
    (tmp_path / "model_index.json").write_text('{"_class_name": "QwenImagePipeline", ')
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(str(tmp_path / "nope"))


def test_qwen_dir_missing_component_raises(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    with pytest.raises(FileNotFoundError, match="transformer/"):
        load_model(str(tmp_path))


class _Fake(FlowModel):
    family = "fake"
    max_side = 2048


@pytest.mark.parametrize("h,w", [(512, 520), (500, 512), (0, 512), (512, -16), (2064, 512), (512.0, 512)])
def test_validate_size_raises(h, w):
    with pytest.raises(ValueError):
        _Fake().validate_size(h, w)


def test_validate_size_message_names_fix():
    with pytest.raises(ValueError, match="use 512 or 528"):
        _Fake().validate_size(520, 512)
    _Fake().validate_size(2048, 16)


def test_per_row_noise_independent_of_batch():
    both = per_row_noise((2, 3), [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)], "cpu")
    alone = per_row_noise((2, 3), [torch.Generator().manual_seed(2)], "cpu")
    assert both.shape == (2, 2, 3) and both.dtype == torch.float32
    assert torch.equal(both[1], alone[0]) and not torch.equal(both[0], both[1])


def test_to_uint8_matches_diffusers_postprocess():
    from diffusers.image_processor import VaeImageProcessor

    x = torch.linspace(-1.2, 1.2, 2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    ours = to_uint8(x)
    ref = VaeImageProcessor().postprocess(x, output_type="np")  # (B, H, W, 3) float in [0, 1]
    ref_u8 = torch.from_numpy((ref * 255).round().astype("uint8")).permute(0, 3, 1, 2)
    assert ours.dtype == torch.uint8 and torch.equal(ours, ref_u8)


def test_prompt_embeds_cat_and_index():
    a = PromptEmbeds(torch.ones(1, 2, 4), torch.ones(1, 2))
    b = PromptEmbeds(torch.ones(2, 3, 4) * 2, torch.ones(2, 3, dtype=torch.int64))
    c = PromptEmbeds.cat([a, b])
    assert c.embeds.shape == (3, 3, 4) and c.mask.tolist()[0] == [1, 1, 0] and float(c.embeds[0, 2].abs().sum()) == 0
    assert c.index([2, 0]).embeds[1, 0, 0] == 1


def test_cfg_scale_uses_the_family_knob_and_refuses_the_other():
    from models import cfg_scale
    from models.base import DEFAULT_CFG_SCALE

    assert DEFAULT_CFG_SCALE == 4.0  # both released pipelines' default
    assert cfg_scale("boogu_image", None, None) == 4.0 and cfg_scale("boogu_image", 2.5, None) == 2.5
    assert cfg_scale("qwen_image", None, None) == 4.0 and cfg_scale("qwen_image", None, 1.0) == 1.0
    assert cfg_scale("qwen_image", None, None, default=1.0) == 1.0  # a trainer's own default for the family
    assert cfg_scale("qwen_image", None, 3.0, default=1.0) == 3.0  # an explicit knob wins over it
    with pytest.raises(ValueError, match="guided by guidance_scale; true_cfg_scale"):
        cfg_scale("boogu_image", None, 4.0)
    with pytest.raises(ValueError, match="guided by true_cfg_scale; guidance_scale"):
        cfg_scale("qwen_image", 3.0, None)
    with pytest.raises(ValueError, match="unknown model family"):
        cfg_scale("flux", None, None)


def test_a_cfg_argument_that_no_flag_sets_is_refused_not_read_from_another_flag(monkeypatch):
    """A new family guided by an argument the command line has no flag for must fail, not take --true_cfg_scale."""
    from models import CFG_ARGUMENTS, FAMILY_NAMES, cfg_scale, family_class

    assert {family_class(f).cfg_argument for f in FAMILY_NAMES} <= set(CFG_ARGUMENTS)
    monkeypatch.setattr(family_class("qwen_image"), "cfg_argument", "cfg_weight")
    with pytest.raises(ValueError, match="qwen_image is guided by 'cfg_weight', which no command-line flag sets"):
        cfg_scale("qwen_image", None, 3.0)


def test_pipeline_cfg_kwargs_name_each_familys_argument():
    """The one scale reaches each family's pipeline under that pipeline's own name (what diffusers' and vllm-omni's
    Qwen-Image and Boogu-Image pipelines take)."""
    from models import pipeline_cfg_kwargs

    assert pipeline_cfg_kwargs("qwen_image", 3) == {"true_cfg_scale": 3.0}
    assert pipeline_cfg_kwargs("boogu_image", 1.0) == {"guidance_scale": 1.0}
    with pytest.raises(ValueError, match="unknown model family"):
        pipeline_cfg_kwargs("flux", 4.0)


@pytest.mark.parametrize("name", ["qwen_image", "boogu_image_edit"])
def test_transformer_only_wrapper_matches_full_and_refuses_encoding(tiny_models, name):
    """Trainer ranks load only the transformer: same guided velocity (CFG, edit references), schedule and size
    rules as the full wrapper; prompt encoding, reference encoding and decoding fail with an error naming the
    skipped component instead of an AttributeError deep inside a forward."""
    from PIL import Image

    path = os.path.join(tiny_models, name)
    full = load_model(path)
    slim = load_model(path, transformer_only=True)
    assert type(slim.text_encoder).__name__ == "NotLoaded" and type(slim.vae).__name__ == "NotLoaded"
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    prompt = full.encode_prompt(["a red sign that says OPEN", "two cats"])
    negative = full.encode_prompt(["", ""] if full.family == "boogu_image" else [" ", " "])
    refs = None
    if name == "boogu_image_edit":
        refs = full.encode_reference([Image.new("RGB", (64, 64), "red")] * 2, generators)
    x = full.prepare_noise(64, 64, generators)
    sigmas = torch.tensor([0.9, 0.4])
    expected = full.guided_velocity(x, sigmas, prompt, negative, 4.0, refs, height=64, width=64)
    got = slim.guided_velocity(x, sigmas, prompt, negative, 4.0, refs, height=64, width=64)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(slim.schedule(10, 64, 64), full.schedule(10, 64, 64))
    assert slim.vae_scale_factor == full.vae_scale_factor and slim.size_multiple == full.size_multiple
    with pytest.raises(RuntimeError, match="text encoder.*not loaded.*transformer_only"):
        slim.encode_prompt(["a red sign"])
    with pytest.raises(RuntimeError, match="VAE was not loaded"):
        slim.decode(x, height=64, width=64)
    if name == "boogu_image_edit":
        with pytest.raises(RuntimeError, match="VAE was not loaded"):
            slim.encode_reference([Image.new("RGB", (64, 64), "red")], generators[:1])


def test_conditioning_index_keeps_rows_aligned_and_none_parts():
    from models.base import Conditioning
    from rollout import RolloutResult

    n = 4
    embeds = torch.arange(n, dtype=torch.float32).view(n, 1, 1).expand(n, 3, 2).clone()
    mask = torch.tensor([[1, 1, 0]] * n)
    result = RolloutResult(images=torch.zeros(n, 3, 2, 2, dtype=torch.uint8), latents_clean=torch.zeros(n, 4),
                           prompt_embeds=embeds, prompt_mask=mask, negative_embeds=-embeds, negative_mask=mask,
                           ref_latents=torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1) + 10,
                           seeds=list(range(n)), metadata={})
    cond = result.conditioning("cpu")
    part = cond.index(torch.tensor([3, 1]))
    assert part.prompt.embeds[:, 0, 0].tolist() == [3.0, 1.0]
    assert part.negative.embeds[:, 0, 0].tolist() == [-3.0, -1.0]
    assert part.ref_latents.flatten().tolist() == [13.0, 11.0]
    assert part.prompt.mask.tolist() == [[1, 1, 0], [1, 1, 0]]
    unguided = Conditioning(PromptEmbeds(embeds, mask)).index([0])
    assert unguided.negative is None and unguided.ref_latents is None
