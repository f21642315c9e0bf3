"""The vllm-omni rollout engine (engines.vllm_omni.VllmOmniEngine) and its custom RL pipelines
(engines/vllm_omni_pipelines.py), against the REAL vllm-omni 0.30 / vLLM 0.30 classes on CPU. Run with the
separate environment's python:

    bash tools/make_vllm_omni_test_env.sh
    .venv-vllm-omni/bin/python -m pytest -o addopts=-ra -m vllm_omni_env tests/vllm_omni_env -q

What runs here:
- request building: prompt dicts and OmniDiffusionSamplingParams per sample (seeds, generator_device, guidance
  knob, extra_args), through the real OmniDiffusionRequest defaulting and the real batch key;
- the RL pipeline's pieces against the native engine on tiny checkpoints: the schedules, the sampling loop
  (`rl_denoise`, seeded exactly like NativeEngine), Boogu's stock `predict` + `combine_cfg_noise` used with our
  t = 1 - sigma / negation, and the WHOLE `RLQwenImagePipeline.forward` on a real DiffusionRequestBatch with the
  tiny diffusers components standing in for the port's (parity with NativeEngine.generate);
- output parsing of OmniRequestOutputs made by vllm-omni's own post-process + output formatter from the
  pipeline's DiffusionOutputs;
- LoRA: the trainer's exported adapter (trainer names) translated by `load_adapter` into vllm-omni names, loaded by
  a real DiffusionLoRAManager around vLLM layers laid out with the port's module names and Boogu's packed
  mapping, bound through RLWorkerExtension.rl_bind_adapter; new LoRARequest ids per version; the fail-closed
  bind error surfaced.
Not run: AsyncOmni itself (stage processes, GPU workers), the port transformers / text encoders, CUDA kernels.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import engines.vllm_omni_pipelines as vp  # noqa: E402
from engines import sampler  # noqa: E402
from engines.vllm_omni import VllmOmniEngine, assemble_vllm_omni_result, parse_vllm_omni_output  # noqa: E402
from models import load_model, lora  # noqa: E402
from models.base import per_row_noise  # noqa: E402
from models.qwen_image import pack_latents  # noqa: E402
from rollout import NativeEngine, RolloutRequest  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm_omni.diffusion.data import DiffusionOutput  # noqa: E402
from vllm_omni.diffusion.models.boogu_image.pipeline_boogu_image import get_boogu_image_post_process_func  # noqa: E402
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import get_qwen_image_post_process_func  # noqa: E402
from vllm_omni.diffusion.output_formatter import (  # noqa: E402
    format_diffusion_outputs,
    normalize_diffusion_postprocess_output,
)
from vllm_omni.diffusion.request import OmniDiffusionRequest  # noqa: E402
from vllm_omni.diffusion.sched.request_scheduler import build_request_batch_sampling_params_key  # noqa: E402
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch  # noqa: E402
from vllm_omni.inputs.data import OmniDiffusionSamplingParams  # noqa: E402
from vllm_omni.outputs import OmniRequestOutput  # noqa: E402

pytestmark = pytest.mark.vllm_omni_env

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models() -> str:
    import build_tiny_models

    out = os.environ.get("TINY_MODELS_DIR") or str(REPO / ".cache" / "tiny_models")
    os.makedirs(out, exist_ok=True)
    for name in ("qwen_image", "boogu_image_base"):
        build_tiny_models.build_one(name, out, force=False)
    return out


def _engine_stub(family: str, lora_request=None) -> VllmOmniEngine:
    """A VllmOmniEngine without AsyncOmni (cannot start on CPU): only the request-side state."""
    engine = object.__new__(VllmOmniEngine)
    engine.family, engine._lora_request = family, lora_request
    engine.adapter_version, engine.bound_modules = None, 0
    return engine


def _sde_request(**kw) -> RolloutRequest:
    base = dict(prompts=["a red sign", "OPEN 24 HOURS", "a red sign"], seeds=[11, 12, 13], num_inference_steps=4,
                height=32, width=32, negative_prompts=["", "blurry", ""], cfg_scale=4.0, noise_level=0.7,
                sde_window_size=2, sde_window_range=(0, 3), return_log_probs=True, return_trajectory=True)
    base.update(kw)
    return RolloutRequest(**base)


# ---------------------------------------------------------------------------------------------------------------
# Request building
# ---------------------------------------------------------------------------------------------------------------


def test_request_building_per_sample(tmp_path):
    lora_req = LoRARequest("v3#4", 4, str(tmp_path))
    engine = _engine_stub("qwen_image", lora_req)
    request = _sde_request(cfg_scale=3.0, generator_device="cpu")
    pairs = engine.build_requests(request)
    assert len(pairs) == 3
    for b, (prompt, sp) in enumerate(pairs):
        assert isinstance(sp, OmniDiffusionSamplingParams)
        assert prompt == {"prompt": request.prompts[b], "negative_prompt": request.negative_prompts[b]}
        assert (sp.height, sp.width, sp.num_inference_steps) == (32, 32, 4)
        assert sp.seed == request.seeds[b] and sp.generator_device == "cpu" and sp.num_outputs_per_prompt == 1
        assert sp.true_cfg_scale == 3.0 and sp.guidance_scale is None
        assert sp.lora_request is lora_req and sp.lora_request.lora_int_id == 4
        assert sp.extra_args == {"rl_noise_level": 0.7, "rl_sde_type": "sde", "rl_sde_window_size": 2,
                                 "rl_sde_window_range": [0, 3], "rl_return_log_probs": True,
                                 "rl_return_trajectory": True}
        # the real request defaulting keeps our explicit seed
        OmniDiffusionRequest(prompt=prompt, sampling_params=sp, request_id=f"r{b}")
        assert sp.seed == request.seeds[b]
    # one request per sample: distinct seeds, same batch key (the engine may batch them)
    keys = {build_request_batch_sampling_params_key(OmniDiffusionRequest(prompt=p, sampling_params=sp,
                                                                          request_id=f"k{i}"))
            for i, (p, sp) in enumerate(pairs)}
    assert len(keys) == 1
    assert vp.rl_settings([sp for _, sp in pairs])["rl_sde_window_range"] == (0, 3)


def test_request_building_boogu_guidance_and_errors():
    engine = _engine_stub("boogu_image")
    (prompt, sp), *_ = engine.build_requests(_sde_request(cfg_scale=5.0))
    OmniDiffusionRequest(prompt=prompt, sampling_params=sp, request_id="r")
    assert sp.guidance_scale == 5.0 and sp.guidance_scale_provided and sp.true_cfg_scale is None
    (_, sp_default), *_ = engine.build_requests(_sde_request())
    assert sp_default.guidance_scale == 4.0  # always set: vllm-omni's own defaulting would make an unset one 1.0
    with pytest.raises(ValueError, match="needs negative prompts"):
        engine.build_requests(_sde_request(negative_prompts=None))
    (_, sp_qwen), *_ = _engine_stub("qwen_image").build_requests(_sde_request(cfg_scale=5.0))
    assert sp_qwen.true_cfg_scale == 5.0 and sp_qwen.guidance_scale is None  # the same scale, Qwen's argument


def test_rl_settings_must_agree_across_a_batch():
    a = OmniDiffusionSamplingParams(extra_args={"rl_noise_level": 0.7})
    b = OmniDiffusionSamplingParams(extra_args={"rl_noise_level": 0.0})
    assert vp.rl_settings([a, a])["rl_noise_level"] == 0.7
    assert vp.rl_settings([OmniDiffusionSamplingParams()]) == sampler.VLLM_OMNI_RL_KEYS
    with pytest.raises(ValueError, match="disagree on RL extra_args"):
        vp.rl_settings([a, b])
    with pytest.raises(ValueError, match="unknown RL extra_args"):
        vp.rl_settings([OmniDiffusionSamplingParams(extra_args={"rl_noise_levle": 0.7})])


# ---------------------------------------------------------------------------------------------------------------
# The pipeline's step logic against the native engine (tiny checkpoints)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen_image", "boogu_image_base"])
def test_schedules_match_the_wrappers(tiny_models, name):
    path = os.path.join(tiny_models, name)
    model = load_model(path)
    cfg = vp.read_scheduler_config(path)
    fn = vp.qwen_sigmas if name == "qwen_image" else vp.boogu_sigmas
    for steps, h, w in [(4, 32, 32), (10, 64, 32), (28, 1024, 1024)]:
        torch.testing.assert_close(fn(cfg, steps, h, w), model.schedule(steps, h, w), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["qwen_image", "boogu_image_base"])
def test_rl_denoise_reproduces_native_engine(tiny_models, name):
    """Seeding order (noise, then window start, then SDE noise), schedule, window and fp32 sde_step: the pipeline's
    loop with the wrapper's guided velocity gives the native engine's trajectories bit for bit."""
    path = os.path.join(tiny_models, name)
    engine = NativeEngine(path)
    model = engine.model
    request = _sde_request(cfg_scale=3.0)
    native = engine.generate(request)

    gens = [torch.Generator("cpu").manual_seed(s) for s in request.seeds]
    h, w = model.latent_hw(32, 32)
    if name == "qwen_image":
        latents = pack_latents(per_row_noise((1, 16, h, w), gens, "cpu")[:, 0])
        sigmas = vp.qwen_sigmas(vp.read_scheduler_config(path), 4, 32, 32)
    else:
        latents = per_row_noise((16, h, w), gens, "cpu")
        sigmas = vp.boogu_sigmas(vp.read_scheduler_config(path), 4, 32, 32)
    starts = sampler.sde_window_starts(4, 2, (0, 3), gens)
    prompt = model.encode_prompt(request.prompts)
    negative = model.encode_prompt(request.negative_prompts)
    fn = lambda x, s: model.guided_velocity(x, s, prompt, negative, 3.0, height=32, width=32)  # noqa: E731
    final, all_latents, all_timesteps, all_log_probs, all_means = vp.rl_denoise(
        fn, latents, sigmas, gens, starts, 2, noise_level=0.7, sde_type="sde", keep_trajectory=True,
        keep_log_probs=True)
    assert starts == native.window_starts
    torch.testing.assert_close(final, native.latents_clean, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack([torch.stack(r) for r in all_latents]), native.all_latents, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack([torch.stack(r) for r in all_log_probs]), native.all_log_probs,
                               rtol=0, atol=0)
    torch.testing.assert_close(torch.stack([torch.stack(r) for r in all_timesteps]), native.all_timesteps)
    torch.testing.assert_close(torch.stack([torch.stack(r) for r in all_means]), native.all_means, rtol=0, atol=0)
    assert native.all_log_probs.abs().sum() > 0


def test_boogu_stock_predict_with_rl_conventions(tiny_models):
    """The RL Boogu pipeline feeds t = 1 - sigma to the STOCK `predict` and negates; its CFG is the stock
    `combine_cfg_noise`. With our tiny transformer (same call signature as the port) this equals the wrapper's
    predict_velocity / guided_velocity, and differs when the sign or time direction is flipped."""
    model = load_model(os.path.join(tiny_models, "boogu_image_base"))
    pipe = vp.RLBooguImagePipeline.__new__(vp.RLBooguImagePipeline)
    nn.Module.__init__(pipe)
    pipe.transformer = model.transformer
    prompt, negative = model.encode_prompt(["a sign"]), model.encode_prompt([""])
    x = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.8])
    fr = model._freqs_cis
    pos = pipe._rl_prediction(x, sigma, prompt.embeds, prompt.mask, fr, None)
    torch.testing.assert_close(-pos.float(), model.predict_velocity(x, sigma, prompt))
    neg = pipe._rl_prediction(x, sigma, negative.embeds, negative.mask, fr, None)
    guided = -pipe.combine_cfg_noise(pos, neg, 4.0).float()
    torch.testing.assert_close(guided, model.guided_velocity(x, sigma, prompt, negative, 4.0))
    flipped = pipe.predict(t=sigma, latents=x, instruction_embeds=prompt.embeds, freqs_real=fr,
                           instruction_attention_mask=prompt.mask)
    assert (flipped.float() - pos.float()).abs().max() > 1e-4  # t = sigma would be the wrong time direction


class _DiffusersAsPort(nn.Module):
    """The tiny diffusers QwenImageTransformer2DModel behind the vllm-omni port's forward signature (the port also
    takes `txt_seq_lens` = the padded text width per row; diffusers 0.40 derives it from the embeddings)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.seen_txt_seq_lens: list = []

    def forward(self, *, txt_seq_lens, **kwargs):
        width = kwargs["encoder_hidden_states"].shape[1]
        assert txt_seq_lens == [width] * kwargs["encoder_hidden_states"].shape[0]
        self.seen_txt_seq_lens.append(txt_seq_lens)
        return self.inner(**kwargs)


def _qwen_pipeline(model) -> vp.RLQwenImagePipeline:
    """RLQwenImagePipeline with the tiny diffusers components in the stock attribute slots (the stock __init__
    would build the vllm-omni port from a full checkpoint)."""
    pipe = vp.RLQwenImagePipeline.__new__(vp.RLQwenImagePipeline)
    nn.Module.__init__(pipe)
    pipe.transformer, pipe.text_encoder, pipe.vae, pipe.tokenizer = (
        _DiffusersAsPort(model.transformer), model.text_encoder, model.vae, model.tokenizer)
    pipe.device = torch.device("cpu")
    pipe.vae_scale_factor, pipe.default_sample_size = 8, 128
    pipe.tokenizer_max_length = 1024
    pipe.prompt_template_encode = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, "
                                   "texture, quantity, text, spatial relationships of the objects and background:"
                                   "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
    pipe.prompt_template_encode_start_idx = 34
    pipe._attention_kwargs = None
    pipe.rl_scheduler_config = model.scheduler_config
    return pipe


def _batch(engine_stub, request, prefix="r") -> DiffusionRequestBatch:
    reqs = []
    for b, (prompt, sp) in enumerate(engine_stub.build_requests(request)):
        sp.generator = torch.Generator(device=sp.generator_device).manual_seed(sp.seed)  # what the runner does
        reqs.append(OmniDiffusionRequest(prompt=prompt, sampling_params=sp, request_id=f"{prefix}{b}"))
    return DiffusionRequestBatch(requests=reqs)


def _format(outputs, batch, od_config, post) -> list[OmniRequestOutput]:
    """What DiffusionEngine.postprocess_output does per request: registered post-process, normalise, format."""
    results = []
    for out, req in zip(outputs, batch.requests):
        normalized = normalize_diffusion_postprocess_output(post(out.output))
        (res,) = format_diffusion_outputs(request=req, od_config=od_config, diffusion_output=out,
                                          output_data=out.output, postprocess_output=normalized)
        results.append(res)
    return results


def test_qwen_rl_pipeline_forward_matches_native_engine(tiny_models):
    """The whole RLQwenImagePipeline.forward on a real DiffusionRequestBatch, through the real Qwen post-process
    and output formatter, parsed by the engine: equals NativeEngine.generate on the same request."""
    path = os.path.join(tiny_models, "qwen_image")
    native_engine = NativeEngine(path)
    request = _sde_request(cfg_scale=3.0)
    native = native_engine.generate(request)

    pipe = _qwen_pipeline(native_engine.model)
    batch = _batch(_engine_stub("qwen_image"), request)
    outputs = pipe.forward(batch)
    assert len(outputs) == 3 and all(isinstance(o, DiffusionOutput) for o in outputs)
    od_config = SimpleNamespace(model=path, model_class_name="QwenImagePipeline")
    formatted = _format(outputs, batch, od_config, get_qwen_image_post_process_func(od_config))
    assert all(isinstance(r, OmniRequestOutput) for r in formatted)
    parts = [parse_vllm_omni_output(r) for r in formatted]
    result = assemble_vllm_omni_result(parts, request, family="qwen_image", adapter_version="v1",
                                       bound_modules=7)

    assert result.images.dtype == torch.uint8 and result.images.shape == (3, 3, 32, 32)
    assert result.window_starts == native.window_starts
    for name in ("latents_clean", "all_latents", "all_timesteps", "all_log_probs", "all_means", "prompt_embeds",
                 "prompt_mask", "negative_embeds", "negative_mask"):
        torch.testing.assert_close(getattr(result, name), getattr(native, name), msg=name)
    # decode order differs slightly (the stock decoder casts before un-normalising): allow 1 grey level
    assert (result.images.int() - native.images.int()).abs().max() <= 1
    torch.testing.assert_close(result.metadata["sigmas"], native.metadata["sigmas"])
    assert (result.metadata["engine"], result.metadata["adapter_version"], result.metadata["bound_modules"]) == (
        "vllm_omni", "v1", 7)
    assert result.metadata["guidance"] == native.metadata["guidance"] == 3.0


def test_qwen_rl_pipeline_dummy_run_and_batch_independence(tiny_models):
    path = os.path.join(tiny_models, "qwen_image")
    model = load_model(path)
    pipe = _qwen_pipeline(model)
    request = _sde_request(cfg_scale=3.0)
    full = pipe.forward(_batch(_engine_stub("qwen_image"), request))
    single = pipe.forward(_batch(_engine_stub("qwen_image"), request.select([1])))
    torch.testing.assert_close(single[0].trajectory_latents["latents_clean"],
                               full[1].trajectory_latents["latents_clean"], rtol=1e-5, atol=1e-5)
    # the engine's warm-up request: no negative, no RL knobs, guidance forced off
    sp = OmniDiffusionSamplingParams(height=32, width=32, num_inference_steps=2, seed=0, generator_device="cpu")
    sp.generator = torch.Generator("cpu").manual_seed(0)
    dummy = DiffusionRequestBatch(requests=[OmniDiffusionRequest(prompt="warm up", sampling_params=sp,
                                                                 request_id="dummy_req_id")])
    (out,) = pipe.forward(dummy)
    assert out.trajectory_timesteps is None and "all_log_probs" not in out.trajectory_log_probs


def test_boogu_outputs_survive_stock_post_process_and_formatter(tiny_models):
    """Boogu's registered post-process takes only a tensor: the RL data must ride in trajectory_* dicts."""
    path = os.path.join(tiny_models, "boogu_image_base")
    od_config = SimpleNamespace(model=path, model_class_name="BooguImagePipeline")
    traj = ([[torch.randn(16, 4, 4), torch.randn(16, 4, 4)]], [[torch.tensor(900.0)]], [[torch.tensor(-1.5)]],
            [[torch.randn(16, 4, 4)]])
    outs = vp.request_outputs(
        torch.rand(1, 3, 32, 32) * 2 - 1, torch.randn(1, 16, 4, 4), traj, prompt_embeds=torch.randn(1, 5, 8),
        prompt_mask=torch.ones(1, 5, dtype=torch.int64), negative_embeds=torch.randn(1, 5, 8),
        negative_mask=torch.ones(1, 5, dtype=torch.int64), ref_latents=None,
        sigmas=torch.linspace(1, 0, 5), window_starts=[1], guidance=4.0)
    req = OmniDiffusionRequest(prompt={"prompt": "x"}, sampling_params=OmniDiffusionSamplingParams(seed=1),
                               request_id="r0")
    batch = DiffusionRequestBatch(requests=[req])
    (res,) = _format(outs, batch, od_config, get_boogu_image_post_process_func(od_config))
    part = parse_vllm_omni_output(res)
    assert part["image"].shape == (3, 32, 32) and part["image"].dtype == torch.uint8
    torch.testing.assert_close(part["all_latents"], torch.stack(traj[0][0]))
    torch.testing.assert_close(part["all_log_probs"], torch.tensor([-1.5]))
    torch.testing.assert_close(part["all_means"], torch.stack(traj[3][0]))
    torch.testing.assert_close(part["all_timesteps"], torch.tensor([900.0]))
    assert part["window_start"] == 1 and part["guidance"] == 4.0
    # `.latents` is vllm-omni's trajectory slot, never read as the clean latent
    assert res.latents is res.trajectory_latents


def test_parse_rejects_stock_and_error_outputs():
    with pytest.raises(RuntimeError, match="failed: boom"):
        parse_vllm_omni_output(SimpleNamespace(error="boom", request_id="r"))
    stock = SimpleNamespace(error=None, images=[torch.rand(3, 8, 8)], trajectory_latents=None,
                            trajectory_log_probs=None, trajectory_timesteps=None, request_id="r")
    with pytest.raises(RuntimeError, match="lacks the RL fields"):
        parse_vllm_omni_output(stock)


# ---------------------------------------------------------------------------------------------------------------
# LoRA: translated adapter files, new ids per version, the fail-closed bind check
# ---------------------------------------------------------------------------------------------------------------


def _port_like_boogu(trainer_transformer: nn.Module, linear) -> nn.Module:
    """vLLM layers at the vllm-omni port's module paths for every LoRA'd trainer module: the trainer path
    translated by `models.lora.to_engine_name`, QKV and SwiGLU gate/up packed as in the port's
    `_BOOGU_STACKED_PARAMS_MAPPING`."""
    from vllm_omni.diffusion.models.boogu_image.boogu_image_transformer import _BOOGU_STACKED_PARAMS_MAPPING

    packed = {}  # sub leaf -> (packed leaf, shard)
    for packed_suffix, sub_suffix, shard in _BOOGU_STACKED_PARAMS_MAPPING:
        packed[sub_suffix.strip(".")] = (packed_suffix.strip("."), shard)
    layers = lora.lora_layers(trainer_transformer, "default")
    groups: dict[str, dict] = {}
    for path, layer in layers.items():
        engine = lora.to_engine_name(path)
        key = next((k for k in packed if engine == k or engine.endswith("." + k)), None)
        base = layer.base_layer
        if key is None:
            groups[engine] = {"kind": "plain", "in": base.in_features, "out": base.out_features}
        else:
            parent = engine[: -len(key)]
            packed_leaf, shard = packed[key]
            g = groups.setdefault(parent + packed_leaf, {"kind": "packed", "in": base.in_features, "shards": {}})
            g["shards"][shard] = base.out_features

    class Transformer(nn.Module):
        stacked_params_mapping = list(_BOOGU_STACKED_PARAMS_MAPPING)

    root = Transformer()
    for path, g in groups.items():
        *parents, leaf = path.split(".")
        node = root
        for p in parents:
            if not hasattr(node, p):
                node.add_module(p, nn.Module())
            node = getattr(node, p)
        if g["kind"] == "plain":
            layer = linear.ReplicatedLinear(g["in"], g["out"], bias=False)
        elif set(g["shards"]) == {"q", "k", "v"}:
            q, k = g["shards"]["q"], g["shards"]["k"]
            head = torch.gcd(torch.tensor(q), torch.tensor(k)).item()
            layer = linear.QKVParallelLinear(g["in"], head, q // head, k // head, bias=False)
        else:
            layer = linear.MergedColumnParallelLinear(g["in"], [g["shards"][0], g["shards"][1]], bias=False)
        node.add_module(leaf, layer)
    with torch.no_grad():  # vLLM layers allocate uninitialised weights
        gen = torch.Generator().manual_seed(0)
        for param in root.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.05)

    class Pipeline(nn.Module):
        _dit_modules = ["transformer"]

        def __init__(self):
            super().__init__()
            self.transformer = root

    return Pipeline()


class _Worker(vp.RLWorkerExtension):
    def __init__(self, manager):
        self.lora_manager = manager


class _FakeAsyncOmni:
    """The three AsyncOmni control calls VllmOmniEngine.load_adapter makes, answered by one in-process worker
    holding a REAL DiffusionLoRAManager (what DiffusionWorker.add_lora / collective_rpc reach in the engine)."""

    def __init__(self, worker):
        self.worker, self.calls = worker, []

    async def add_lora(self, req):
        self.calls.append(("add_lora", req.lora_int_id, req.lora_path))
        return self.worker.lora_manager.add_adapter(req)

    async def collective_rpc(self, method, args=(), kwargs=None, timeout=None, stage_ids=None):
        self.calls.append((method, args[0].lora_int_id))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    async def remove_lora(self, adapter_id):
        self.calls.append(("remove_lora", adapter_id))
        return self.worker.lora_manager.remove_adapter(adapter_id)


def _loop_engine(family: str, omni) -> VllmOmniEngine:
    import tempfile
    import threading

    engine = _engine_stub(family)
    engine._next_lora_id = 1
    engine._adapter_root = tempfile.mkdtemp(prefix="test-vomni-adapters-")
    engine._loop = asyncio.new_event_loop()
    threading.Thread(target=engine._loop.run_forever, daemon=True).start()
    engine.omni = omni
    return engine


def test_trainer_adapter_binds_in_lora_manager_with_new_ids(tiny_models, vllm_cpu_layers, tmp_path):
    from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager

    model = load_model(os.path.join(tiny_models, "boogu_image_base"))
    n = lora.add_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))  # non-zero B
    lora.export_adapter(model.transformer, str(tmp_path / "v1"))  # trainer names
    from safetensors.torch import load_file

    raw = json.loads((tmp_path / "v1" / "adapter_config.json").read_text())
    assert "to_out.0" in raw["target_modules"]  # trainer names: the engine must translate them
    assert any(".processor.img_to_q." in k for k in load_file(str(tmp_path / "v1" / "adapter_model.safetensors")))

    pipe = _port_like_boogu(model.transformer, vllm_cpu_layers)
    manager = DiffusionLoRAManager(pipeline=pipe, device=torch.device("cpu"), dtype=torch.float32,
                                   max_cached_adapters=2)
    omni = _FakeAsyncOmni(_Worker(manager))
    engine = _loop_engine("boogu_image", omni)

    assert engine.load_adapter(str(tmp_path / "v1"), "v1") == n
    first = engine._lora_request
    assert first.lora_int_id == 1 and engine.bound_modules == n and engine.adapter_version == "v1"
    written = engine._adapter_root
    (adapter_dir,) = [d for d in os.listdir(written) if not d.startswith(".")]
    keys = json.loads((Path(written) / adapter_dir / "adapter_config.json").read_text())["target_modules"]
    assert "to_out" in keys and "to_out.0" not in keys
    # packed port layers received the right trainer tensors in the right slices: the LoRA delta of the port's
    # img_to_qkv / gate_up_proj equals the trainer's PEFT deltas of (img_to_q, img_to_k, img_to_v) / (linear_1,
    # linear_3), concatenated in that order
    port = dict(pipe.transformer.named_modules())
    trainer = lora.lora_layers(model.transformer, "default")

    def peft_delta(path, x):
        layer = trainer[path]
        return layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]

    cases = [("double_stream_layers.0.img_instruct_attn.img_to_qkv",
              [f"double_stream_layers.0.img_instruct_attn.processor.img_to_{c}" for c in "qkv"]),
             ("single_stream_layers.0.feed_forward.gate_up_proj",
              [f"single_stream_layers.0.feed_forward.linear_{i}" for i in (1, 3)])]
    for port_path, trainer_paths in cases:
        wrapper = port[port_path]
        assert type(wrapper).__name__.startswith("Diffusion"), type(wrapper)
        x = torch.randn(2, trainer[trainer_paths[0]].in_features, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            with_lora = wrapper(x)[0]
            manager.set_active_adapter(first, 0.0)
            base = wrapper(x)[0]
            manager.set_active_adapter(first, 1.0)
            expected = torch.cat([peft_delta(p, x) for p in trainer_paths], dim=-1)
        assert expected.abs().max() > 1e-3
        torch.testing.assert_close(with_lora - base, expected, atol=1e-4, rtol=1e-4)

    # the next version gets a NEW id (the manager never reloads a known id) and the old one is removed
    lora.export_adapter(model.transformer, str(tmp_path / "v2"), engine_names=True)
    assert engine.load_adapter(str(tmp_path / "v2"), "v2") == n
    assert engine._lora_request.lora_int_id == 2 and ("remove_lora", 1) in omni.calls
    (_, sp), = engine.build_requests(RolloutRequest(prompts=["x"], seeds=[1], num_inference_steps=2, height=32,
                                                    width=32, cfg_scale=1.0))
    assert sp.lora_request.lora_int_id == 2 and sp.lora_request.lora_path.endswith("v2")


def test_unbindable_adapter_fails_closed_with_a_clear_error(tiny_models, vllm_cpu_layers, tmp_path):
    from safetensors.torch import load_file, save_file
    from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager

    model = load_model(os.path.join(tiny_models, "boogu_image_base"))
    lora.add_lora(model, rank=4, alpha=8)
    lora.export_adapter(model.transformer, str(tmp_path / "good"))
    pipe = _port_like_boogu(model.transformer, vllm_cpu_layers)
    manager = DiffusionLoRAManager(pipeline=pipe, device=torch.device("cpu"), dtype=torch.float32,
                                   max_cached_adapters=2)
    engine = _loop_engine("boogu_image", _FakeAsyncOmni(_Worker(manager)))
    # a block index the port does not have: every leaf name is valid, the paths bind to nothing
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(str(tmp_path / "good" / "adapter_model.safetensors"))
    save_file({k.replace("double_stream_layers.0.", "double_stream_layers.9."): v for k, v in tensors.items()},
              str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text((tmp_path / "good" / "adapter_config.json").read_text())
    with pytest.raises(RuntimeError, match=r"vllm-omni rejected adapter .*binding is incomplete"):
        engine.load_adapter(str(bad), "v1")
    assert engine._lora_request is None and engine.bound_modules == 0
    assert manager.list_adapters() == []  # the rejected adapter was removed again
    # the good one still loads afterwards, under a new id
    assert engine.load_adapter(str(tmp_path / "good"), "v2") > 0 and engine._lora_request.lora_int_id == 2


def _boogu_pipeline(model, monkeypatch) -> vp.RLBooguImagePipeline:
    """RLBooguImagePipeline with the tiny components in the stock attribute slots (`mllm`, `processor`, `vae`,
    `transformer`); the port's RoPE table is replaced by the tiny model's (its transformer is ours, not the port)."""
    from models.boogu_image import BOOGU_T2I_SYSTEM_PROMPT, BOOGU_TI2I_SYSTEM_PROMPT

    pipe = vp.RLBooguImagePipeline.__new__(vp.RLBooguImagePipeline)
    nn.Module.__init__(pipe)
    pipe.transformer, pipe.mllm, pipe.vae = model.transformer, model.text_encoder, model.vae
    pipe.processor = model.processor
    pipe._execution_device = torch.device("cpu")
    pipe.vae_scale_factor, pipe.default_sample_size, pipe._is_turbo = 8, 128, False
    pipe.SYSTEM_PROMPT_4_T2I = BOOGU_T2I_SYSTEM_PROMPT
    pipe.SYSTEM_PROMPT_DROP = pipe.SYSTEM_PROMPT_4_TI2I = pipe.SYSTEM_PROMPT_4_I2I = BOOGU_TI2I_SYSTEM_PROMPT
    pipe.rl_scheduler_config = model.scheduler_config
    monkeypatch.setattr(vp.RLBooguImagePipeline, "rope_freqs", staticmethod(lambda transformer: model._freqs_cis))
    return pipe


def test_boogu_rl_pipeline_forward_matches_native_engine(tiny_models, monkeypatch):
    """The whole RLBooguImagePipeline.forward (stock encode_prompt / predict / combine_cfg_noise / _decode_output)
    on a real DiffusionRequestBatch, through the stock Boogu post-process and the formatter: equals
    NativeEngine.generate (T2I with text CFG and an SDE window)."""
    path = os.path.join(tiny_models, "boogu_image_base")
    native_engine = NativeEngine(path)
    request = _sde_request(cfg_scale=3.0)
    native = native_engine.generate(request)

    pipe = _boogu_pipeline(native_engine.model, monkeypatch)
    batch = _batch(_engine_stub("boogu_image"), request)
    outputs = pipe.forward(batch)
    od_config = SimpleNamespace(model=path, model_class_name="BooguImagePipeline")
    formatted = _format(outputs, batch, od_config, get_boogu_image_post_process_func(od_config))
    parts = [parse_vllm_omni_output(r) for r in formatted]
    result = assemble_vllm_omni_result(parts, request, family="boogu_image", adapter_version=None,
                                       bound_modules=0)
    assert result.window_starts == native.window_starts
    for name in ("prompt_mask", "negative_mask", "prompt_embeds", "negative_embeds", "latents_clean", "all_latents",
                 "all_timesteps", "all_log_probs"):
        torch.testing.assert_close(getattr(result, name), getattr(native, name), msg=name)
    assert (result.images.int() - native.images.int()).abs().max() <= 1


def test_boogu_edit_rl_pipeline_forward_matches_native_engine(tiny_models, monkeypatch):
    """Boogu edit (TI2I): the engine's prompt dict through vllm-omni's REAL Boogu pre-process (VLM copy + VAE
    copy of the reference, align_res), then the RL forward (reference latents drawn from the request generator
    after the noise, text-only negative keeping the reference): equals NativeEngine.generate."""
    import build_tiny_models
    from vllm_omni.diffusion.models.boogu_image.pipeline_boogu_image import get_boogu_image_pre_process_func

    build_tiny_models.build_one("boogu_image_edit", tiny_models, force=False)
    path = os.path.join(tiny_models, "boogu_image_edit")
    native_engine = NativeEngine(path)
    g = torch.Generator().manual_seed(7)
    image = torch.randint(0, 255, (3, 32, 32), dtype=torch.uint8, generator=g)
    request = _sde_request(cfg_scale=3.0, prompts=["make it red"], seeds=[21], negative_prompts=[""],
                           images=[image])
    native = native_engine.generate(request)

    pipe = _boogu_pipeline(native_engine.model, monkeypatch)
    od_config = SimpleNamespace(model=path, model_class_name="BooguImagePipeline")
    pre = get_boogu_image_pre_process_func(od_config)
    (prompt, sp), = _engine_stub("boogu_image").build_requests(request)
    sp.generator = torch.Generator(device=sp.generator_device).manual_seed(sp.seed)
    req = pre(OmniDiffusionRequest(prompt=prompt, sampling_params=sp, request_id="e0"))
    assert (req.sampling_params.height, req.sampling_params.width) == (32, 32)
    batch = DiffusionRequestBatch(requests=[req])
    outputs = pipe.forward(batch)
    formatted = _format(outputs, batch, od_config, get_boogu_image_post_process_func(od_config))
    result = assemble_vllm_omni_result([parse_vllm_omni_output(r) for r in formatted], request,
                                       family="boogu_image", adapter_version=None, bound_modules=0)
    for name in ("prompt_mask", "prompt_embeds", "negative_embeds", "ref_latents", "latents_clean", "all_latents",
                 "all_log_probs"):
        torch.testing.assert_close(getattr(result, name), getattr(native, name), msg=name)


class _FakeGeneratingOmni:
    """AsyncOmni.generate for one request, done the way the engine does it in-process: OmniDiffusionRequest
    (the runner's seeded generator on `generator_device`), the custom pipeline's forward, the registered
    post-process and the output formatter. Records the calls."""

    def __init__(self, pipe, od_config, post):
        self.pipe, self.od_config, self.post, self.calls = pipe, od_config, post, []

    async def generate(self, prompt, sampling_params=None, request_id="", *, sampling_params_list=None, **kw):
        (sp,) = sampling_params_list
        self.calls.append((request_id, prompt, sp))
        sp.generator = torch.Generator(device=sp.generator_device).manual_seed(sp.seed)
        batch = DiffusionRequestBatch(requests=[OmniDiffusionRequest(prompt=prompt, sampling_params=sp,
                                                                     request_id=request_id)])
        await asyncio.sleep(0)  # let the other samples' coroutines interleave
        (out,) = _format(self.pipe.forward(batch), batch, self.od_config, self.post)
        yield out


def test_engine_generate_end_to_end_with_in_process_pipeline(tiny_models):
    """VllmOmniEngine.generate (per-sample requests gathered concurrently, parsing, assembly) with AsyncOmni's
    generate replaced by the in-process pipeline + formatter: equals NativeEngine.generate."""
    path = os.path.join(tiny_models, "qwen_image")
    native_engine = NativeEngine(path)
    request = _sde_request(cfg_scale=3.0)
    native = native_engine.generate(request)
    od_config = SimpleNamespace(model=path, model_class_name="QwenImagePipeline")
    omni = _FakeGeneratingOmni(_qwen_pipeline(native_engine.model), od_config,
                               get_qwen_image_post_process_func(od_config))
    engine = _loop_engine("qwen_image", omni)
    result = engine.generate(request)
    assert len({c[0] for c in omni.calls}) == 3 and sorted(c[2].seed for c in omni.calls) == [11, 12, 13]
    for name in ("latents_clean", "all_latents", "all_timesteps", "all_log_probs", "prompt_embeds", "negative_embeds"):
        torch.testing.assert_close(getattr(result, name), getattr(native, name), msg=name)
    assert result.window_starts == native.window_starts and result.seeds == native.seeds
    assert result.metadata["engine"] == "vllm_omni" and result.metadata["family"] == "qwen_image"
    # rows come back in request order even though the requests ran concurrently (the assert_close above is
    # row-wise; one request per sample also means batch-size-1 forwards, hence tolerance rather than bit equality)
    assert [c[1]["prompt"] for c in omni.calls] == request.prompts


def test_engine_close_is_idempotent():
    class _Omni:
        shutdowns = 0

        def shutdown(self):
            _Omni.shutdowns += 1

    engine = _loop_engine("qwen_image", _Omni())
    engine.close()
    engine.close()
    assert _Omni.shutdowns == 1 and engine.omni is None
