"""Batched CFG (`cfg_batch=True`): the conditional and unconditional branches in ONE transformer forward over the
doubled batch must equal the two sequential forwards (fp32, tiny checkpoints) for T2I, edit and prompts of different
lengths, keep the fail-closed rules, and reach the rollout engine and its worker processes."""

import os

import pytest
import torch

import rollout
from models import load_model
from models.base import PromptEmbeds

# one pytest-xdist worker runs this module (pytest.ini: --dist loadgroup): its module fixtures are costly
pytestmark = pytest.mark.xdist_group("test_cfg_batch")

SIZE = 64
# Prompt and negative of clearly different token lengths, longer on either side, so the common padded width differs
# from both branches' own widths.
PROMPTS = ['A storefront sign that reads "OPEN 24 HOURS" in red neon letters above a glass door, a bicycle leaning '
           'on the wall, wet pavement reflecting the light, a cat sleeping under the window', "a cat"]
NEGATIVES = [" ", "blurry, low quality, distorted letters, watermark, jpeg artifacts, extra limbs, cropped"]
SCALE = 4.0
TOL = 1e-5  # max |batched - sequential| / max |sequential| in fp32 (observed ~1e-6)

FAMILIES = ("qwen_image", "boogu_image_base", "boogu_image_edit")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def models(tiny_models):
    return {name: load_model(os.path.join(tiny_models, name)) for name in FAMILIES}


def inputs(model, name: str):
    """(latents, sigmas, prompt, negative, ref_latents) for 2 rows; edit rows carry a reference image."""
    gens = [torch.Generator().manual_seed(s) for s in (3, 4)]
    latents = model.prepare_noise(SIZE, SIZE, gens)
    refs = None
    if name == "boogu_image_edit":
        g = torch.Generator().manual_seed(0)
        images = [torch.randint(0, 256, (3, SIZE, SIZE), generator=g, dtype=torch.uint8) for _ in range(2)]
        refs = model.encode_reference(images, gens)
    prompt = model.encode_prompt(PROMPTS)
    negative = model.encode_prompt(NEGATIVES)
    return latents, torch.tensor([0.83, 0.41]), prompt, negative, refs


def count_forwards(model):
    """Record the batch size of every transformer forward."""
    sizes = []

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        sizes.append(x.shape[0])

    return sizes, model.transformer.register_forward_pre_hook(hook, with_kwargs=True)


def guided(model, cfg_batch: bool, *args, **kwargs) -> tuple[torch.Tensor, list[int]]:
    model.cfg_batch = cfg_batch
    sizes, handle = count_forwards(model)
    try:
        out = model.guided_velocity(*args, **kwargs)
    finally:
        handle.remove()
        model.cfg_batch = False
    return out, sizes


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_cfg_equals_sequential(models, name):
    model = models[name]
    latents, sigmas, prompt, negative, refs = inputs(model, name)
    lens_p, lens_n = prompt.mask.sum(1).tolist(), negative.mask.sum(1).tolist()
    assert lens_p[0] > lens_n[0] and lens_p[1] < lens_n[1], "the test needs padding on both branches"
    assert prompt.embeds.shape[1] != negative.embeds.shape[1]

    sequential, seq_sizes = guided(model, False, latents, sigmas, prompt, negative, SCALE, refs)
    batched, bat_sizes = guided(model, True, latents, sigmas, prompt, negative, SCALE, refs)
    assert seq_sizes == [2, 2] and bat_sizes == [4]  # one forward over [cond ; uncond]
    assert batched.dtype == torch.float32 and batched.shape == sequential.shape
    assert rel_err(batched, sequential) < TOL
    # the comparison is sharp enough to see guidance at all
    assert rel_err(model.predict_velocity(latents, sigmas, prompt, refs), sequential) > 1e-2


@pytest.mark.parametrize("name", FAMILIES)
def test_batched_cfg_would_catch_unmasked_padding(models, name, monkeypatch):
    """With the pad mask of the doubled batch dropped (padding attended as if it were text), the batched result
    leaves the tolerance: the equality test above really checks the padding handling."""
    model = models[name]
    latents, sigmas, prompt, negative, refs = inputs(model, name)
    sequential, _ = guided(model, False, latents, sigmas, prompt, negative, SCALE, refs)
    original = type(model).cfg_batch_inputs

    def unmasked(self, *args):
        x, s, pair, r = original(self, *args)
        return x, s, PromptEmbeds(pair.embeds, torch.ones_like(pair.mask)), r

    monkeypatch.setattr(type(model), "cfg_batch_inputs", unmasked)
    broken, _ = guided(model, True, latents, sigmas, prompt, negative, SCALE, refs)
    assert rel_err(broken, sequential) > 100 * TOL


@pytest.mark.parametrize("name", ("qwen_image", "boogu_image_edit"))
def test_batched_cfg_gradients_equal_sequential(models, name):
    """The trainer replays CFG with gradients: the weight gradients of both modes agree too."""
    model = models[name]
    latents, sigmas, prompt, negative, refs = inputs(model, name)
    params = list(model.transformer.parameters())
    grads = {}
    try:
        model.transformer.requires_grad_(True)
        for mode in (False, True):
            model.transformer.zero_grad(set_to_none=True)
            model.cfg_batch = mode
            model.guided_velocity(latents, sigmas, prompt, negative, SCALE, refs).square().mean().backward()
            grads[mode] = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
    finally:
        model.cfg_batch = False
        model.transformer.zero_grad(set_to_none=True)
        model.transformer.requires_grad_(False)
    assert grads[True].numel() == grads[False].numel() > 0
    assert rel_err(grads[True], grads[False]) < 10 * TOL


def test_edit_batched_negative_keeps_reference(models):
    """Edit: the unconditional half of the doubled batch is negative text + reference latents."""
    model = models["boogu_image_edit"]
    latents, sigmas, prompt, negative, refs = inputs(model, "boogu_image_edit")
    batched, _ = guided(model, True, latents, sigmas, prompt, negative, SCALE, refs)
    v_pos = model.predict_velocity(latents, sigmas, prompt, refs)
    with_ref = v_pos + (SCALE - 1) * (v_pos - model.predict_velocity(latents, sigmas, negative, refs))
    without_ref = v_pos + (SCALE - 1) * (v_pos - model.predict_velocity(latents, sigmas, negative, None))
    assert rel_err(batched, with_ref) < TOL
    assert rel_err(batched, without_ref) > 1e-3


@pytest.mark.parametrize("name", FAMILIES)
def test_fail_closed_rules_unchanged(models, name):
    model = models[name]
    latents, sigmas, prompt, negative, refs = inputs(model, name)
    knob = "true_cfg_scale" if name == "qwen_image" else "guidance_scale"
    model.cfg_batch = True
    try:
        with pytest.raises(ValueError, match=knob):
            model.guided_velocity(latents, sigmas, prompt, None, SCALE, refs)
        with pytest.raises(ValueError, match="one prompt and one negative row per latent row"):
            model.guided_velocity(latents, sigmas, prompt, negative.index([0]), SCALE, refs)
    finally:
        model.cfg_batch = False
    # scale <= 1: a single plain forward at batch B, bit-identical to predict_velocity
    plain, sizes = guided(model, True, latents, sigmas, prompt, negative, 1.0, refs)
    assert sizes == [2]
    assert torch.equal(plain, model.predict_velocity(latents, sigmas, prompt, refs))


def _request(name: str) -> rollout.RolloutRequest:
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    return rollout.RolloutRequest(prompts=prompts, negative_prompts=[NEGATIVES[1], NEGATIVES[0], NEGATIVES[1]],
                                  seeds=[5, 6, 7], num_inference_steps=3, height=SIZE, width=SIZE, noise_level=1.0,
                                  sde_window_size=2, sde_window_range=(0, 3), return_log_probs=True,
                                  return_trajectory=True, cfg_scale=SCALE)


@pytest.mark.parametrize("name", ("qwen_image", "boogu_image_base"))
def test_native_engine_batched_cfg_matches_sequential(tiny_models, name):
    """NativeEngine(cfg_batch=...) -> load_model(cfg_batch=...): same trajectories, log-probs and final latents."""
    path = os.path.join(tiny_models, name)
    results = {}
    for cfg_batch in (False, True):
        engine = rollout.NativeEngine(path, cfg_batch=cfg_batch)
        assert engine.model.cfg_batch is cfg_batch
        results[cfg_batch] = engine.generate(_request(name))
        assert results[cfg_batch].metadata["cfg_batch"] is cfg_batch
    seq, bat = results[False], results[True]
    assert rel_err(bat.latents_clean, seq.latents_clean) < 1e-4
    assert rel_err(bat.all_latents, seq.all_latents) < 1e-4
    assert (bat.all_log_probs - seq.all_log_probs).abs().max().item() < 1e-3


def test_worker_cli_flag_reaches_the_engine(tiny_models):
    """RolloutGroup(cfg_batch=True) -> worker `--cfg-batch` -> NativeEngine(cfg_batch=True) -> result metadata."""
    path = os.path.join(tiny_models, "qwen_image")
    request = _request("qwen_image").select([2])
    with rollout.RolloutGroup(path, ["cpu"], threads_per_worker=1, timeout_s=300, startup_timeout_s=300,
                              cfg_batch=True) as group:
        result = group.generate(request)
    assert result.metadata["cfg_batch"] is True
    local = rollout.NativeEngine(path, cfg_batch=False).generate(request)
    assert local.metadata["cfg_batch"] is False
    assert rel_err(result.latents_clean, local.latents_clean) < 1e-4
