"""The vllm-omni engine's parts that need no vllm_omni (system env): the clear error when it is missing, the
per-sample prompt/sampling-params construction, prompt-form conversion, output assembly from parsed outputs, and the
vllm-omni-named adapter copy. The same functions run against the real vllm-omni 0.30 types in tests/vllm_omni_env/."""

from __future__ import annotations

import importlib.util
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engines import sampler, vllm_omni, worker
from models import lora
from models.boogu_image import BOOGU_T2I_SYSTEM_PROMPT, BOOGU_TI2I_SYSTEM_PROMPT
from models.qwen_image import QWEN_IMAGE_SYSTEM_PROMPT
from rollout import RolloutRequest

torch.set_num_threads(1)


def _request(**kw) -> RolloutRequest:
    base = dict(prompts=["a", "b"], seeds=[5, 6], num_inference_steps=4, height=32, width=48,
                negative_prompts=["", "ugly"], cfg_scale=4.0, noise_level=0.5, sde_window_size=2,
                sde_window_range=(0, 3), return_log_probs=True, return_trajectory=True)
    base.update(kw)
    return RolloutRequest(**base)


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is not None, reason="vllm_omni is installed here")
def test_missing_vllm_omni_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"vllm-omni 0.30 .*--rollout_engine native"):
        worker.build_engine("vllm_omni", str(tmp_path))


def test_cfg_batch_is_refused_by_the_vllm_omni_engine(tmp_path):
    """Its RL pipelines run CFG sequentially; a batched-CFG replay in the trainer would not match the rollout."""
    with pytest.raises(ValueError, match="drop --cfg_batch"):
        worker.build_engine("vllm_omni", str(tmp_path), device="cuda", cfg_batch=True)


def test_sampling_kwargs_per_sample():
    request = _request(cfg_scale=2.5)
    kws = [vllm_omni.vllm_omni_sampling_kwargs("qwen_image", request, b) for b in range(2)]
    assert [k["seed"] for k in kws] == [5, 6]
    for k in kws:
        assert (k["height"], k["width"], k["num_inference_steps"], k["num_outputs_per_prompt"]) == (32, 48, 4, 1)
        assert k["true_cfg_scale"] == 2.5 and "guidance_scale" not in k and k["generator_device"] == "cpu"
        assert k["extra_args"] == {"rl_noise_level": 0.5, "rl_sde_type": "sde", "rl_sde_window_size": 2,
                                   "rl_sde_window_range": [0, 3], "rl_return_log_probs": True,
                                   "rl_return_trajectory": True}
        assert set(k["extra_args"]) == set(sampler.VLLM_OMNI_RL_KEYS)
    boogu = vllm_omni.vllm_omni_sampling_kwargs("boogu_image", _request(), 0)
    assert boogu["guidance_scale"] == 4.0 and "true_cfg_scale" not in boogu  # always explicit
    unguided = _request(negative_prompts=None, cfg_scale=1.0)
    unguided.validate()
    assert vllm_omni.vllm_omni_sampling_kwargs("boogu_image", unguided, 0)["guidance_scale"] == 1.0
    with pytest.raises(ValueError, match="unknown model family"):
        vllm_omni.vllm_omni_sampling_kwargs("flux", request, 0)


def test_prompt_dicts_and_message_lists():
    request = _request(prompts=["a", [{"role": "system", "content": QWEN_IMAGE_SYSTEM_PROMPT},
                                      {"role": "user", "content": "b"}]])
    assert vllm_omni.vllm_omni_prompt("qwen_image", request, 0) == {"prompt": "a", "negative_prompt": ""}
    assert vllm_omni.vllm_omni_prompt("qwen_image", request, 1) == {"prompt": "b", "negative_prompt": "ugly"}
    with pytest.raises(ValueError):
        vllm_omni.vllm_omni_text("qwen_image", [{"role": "system", "content": "other"},
                                                {"role": "user", "content": "b"}])
    t2i = [{"role": "system", "content": BOOGU_T2I_SYSTEM_PROMPT}, {"role": "user", "content": "a sign"}]
    assert vllm_omni.vllm_omni_text("boogu_image", t2i) == "a sign"
    edit = [{"role": "system", "content": BOOGU_TI2I_SYSTEM_PROMPT}, {"role": "user", "content": "<image>make it red"}]
    assert vllm_omni.vllm_omni_text("boogu_image", edit) == "make it red"
    with pytest.raises(ValueError, match="released"):  # T2I text under the TI2I system prompt: not expressible
        vllm_omni.vllm_omni_text("boogu_image", [{"role": "system", "content": BOOGU_TI2I_SYSTEM_PROMPT},
                                                 {"role": "user", "content": "a sign"}])
    with pytest.raises(ValueError, match="released"):  # image placeholder not leading
        vllm_omni.vllm_omni_text("boogu_image", [{"role": "system", "content": BOOGU_TI2I_SYSTEM_PROMPT},
                                                 {"role": "user", "content": "make <image> red"}])
    image = torch.randint(0, 255, (3, 16, 16), dtype=torch.uint8)
    boogu = vllm_omni.vllm_omni_prompt("boogu_image", _request(images=[image, None], height=16, width=16), 0)
    pil = boogu["multi_modal_data"]["image"]
    assert pil.size == (16, 16)
    assert torch.equal(torch.from_numpy(np.array(pil)).permute(2, 0, 1), image)
    with pytest.raises(ValueError, match="align_res"):
        vllm_omni.vllm_omni_prompt("boogu_image", _request(images=[image, None], height=32, width=16), 0)
    with pytest.raises(ValueError, match="only supported for Boogu"):
        vllm_omni.vllm_omni_prompt("qwen_image", _request(images=[image, None]), 0)


def _part(b: int, length: int, window_start: int) -> dict:
    g = torch.Generator().manual_seed(b)
    return {"image": torch.randint(0, 255, (3, 32, 48), dtype=torch.uint8, generator=g),
            "latents_clean": torch.randn(24, 64, generator=g), "all_latents": torch.randn(3, 24, 64, generator=g),
            "all_means": torch.randn(2, 24, 64, generator=g),
            "ref_latents": None, "all_timesteps": torch.tensor([900.0, 800.0]), "all_log_probs": torch.randn(2, generator=g),
            "prompt_embeds": torch.randn(length, 8, generator=g), "prompt_mask": torch.ones(length, dtype=torch.int64),
            "negative_embeds": torch.randn(3, 8, generator=g), "negative_mask": torch.ones(3, dtype=torch.int64),
            "sigmas": torch.linspace(1, 0, 5), "window_start": window_start, "guidance": 4.0}


def test_assemble_result_pads_embeddings_and_checks_fields():
    request = _request(cfg_scale=4.0)
    parts = [_part(0, 4, 1), _part(1, 6, 0)]
    result = vllm_omni.assemble_vllm_omni_result(parts, request, family="qwen_image", adapter_version="v3",
                                                 bound_modules=12)
    assert result.images.shape == (2, 3, 32, 48) and result.latents_clean.shape == (2, 24, 64)
    assert result.all_latents.shape == (2, 3, 24, 64) and result.all_log_probs.shape == (2, 2)
    assert torch.equal(result.all_means, torch.stack([p["all_means"] for p in parts]))
    assert result.prompt_embeds.shape == (2, 6, 8) and result.prompt_mask.tolist()[0] == [1, 1, 1, 1, 0, 0]
    assert result.window_starts == [1, 0] and result.seeds == [5, 6]
    assert result.metadata["engine"] == "vllm_omni" and result.metadata["bound_modules"] == 12
    assert result.metadata["window_size"] == 2 and result.ref_latents is None
    missing = [dict(p, all_log_probs=None) for p in parts]
    with pytest.raises(RuntimeError, match="lack all_log_probs"):
        vllm_omni.assemble_vllm_omni_result(missing, request, family="qwen_image", adapter_version=None,
                                            bound_modules=0)
    with pytest.raises(RuntimeError, match="1 vllm-omni outputs for 2"):
        vllm_omni.assemble_vllm_omni_result(parts[:1], request, family="qwen_image", adapter_version=None,
                                            bound_modules=0)


def test_parse_output_reads_the_rl_channels_not_latents():
    lat = {"latents_clean": torch.randn(16, 4, 4)}
    extra = {"prompt_embeds": torch.randn(3, 8), "prompt_mask": torch.ones(3), "sigmas": torch.linspace(1, 0, 3),
             "window_start": torch.tensor(2), "guidance": torch.tensor(1.0)}
    out = SimpleNamespace(error=None, images=[torch.full((1, 3, 8, 8), 0.5)], trajectory_latents=lat,
                          trajectory_log_probs=extra, trajectory_timesteps=None, latents="never read")
    part = vllm_omni.parse_vllm_omni_output(out)
    assert part["image"].dtype == torch.uint8 and part["image"].shape == (3, 8, 8) and int(part["image"][0, 0, 0]) == 128
    assert part["latents_clean"] is not None and part["all_latents"] is None and part["window_start"] == 2
    assert part["all_means"] is None
    assert part["prompt_mask"].dtype == torch.int64


def test_engine_adapter_copy_has_vllm_omni_names(tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"transformer.double_stream_layers.0.img_instruct_attn.processor.img_to_q.lora_A.weight": torch.ones(2, 4),
               "transformer.double_stream_layers.0.img_instruct_attn.processor.img_to_q.lora_B.weight": torch.ones(4, 2),
               "transformer.noise_refiner.0.attn.to_out.0.lora_A.weight": torch.ones(2, 4),
               "transformer.noise_refiner.0.attn.to_out.0.lora_B.weight": torch.ones(4, 2)},
              str(src / lora.ADAPTER_WEIGHTS))
    (src / lora.ADAPTER_CONFIG).write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["img_to_q", "to_out.0"]}))
    n = vllm_omni.write_engine_adapter(str(src), str(tmp_path / "out"))
    assert n == 2
    keys = set(load_file(str(tmp_path / "out" / lora.ADAPTER_WEIGHTS)))
    assert keys == {"base_model.model.double_stream_layers.0.img_instruct_attn.img_to_q.lora_A.weight",
                    "base_model.model.double_stream_layers.0.img_instruct_attn.img_to_q.lora_B.weight",
                    "base_model.model.noise_refiner.0.attn.to_out.lora_A.weight",
                    "base_model.model.noise_refiner.0.attn.to_out.lora_B.weight"}
    config = json.loads((tmp_path / "out" / lora.ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["img_to_q", "to_out"] and config["r"] == 2
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".")]  # no temp dirs left
    # half a module is refused
    save_file({"transformer.a.to_q.lora_A.weight": torch.ones(2, 4)}, str(src / lora.ADAPTER_WEIGHTS))
    with pytest.raises(ValueError, match="lack lora_A or lora_B"):
        vllm_omni.write_engine_adapter(str(src), str(tmp_path / "out2"))


def test_rpc_bound_counts_flattens_and_fails_closed():
    assert vllm_omni.rpc_bound_counts([[12], [12]]) == [12, 12]
    assert vllm_omni.rpc_bound_counts([12]) == [12]
    with pytest.raises(RuntimeError, match="failed on a replica"):
        vllm_omni.rpc_bound_counts([{"todo": True}])
    with pytest.raises(RuntimeError, match="expected a module count"):
        vllm_omni.rpc_bound_counts([True])
