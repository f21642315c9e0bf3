"""vllm-omni 0.30 / vLLM 0.30 types and LoRA name matching, checked against the REAL installed classes on CPU.

Run ONLY with the separate environment's python (it imports vllm_omni at module top, so it cannot run in the
system env, and the repo's pytest.ini `testpaths = tests` keeps a plain `python3 -m pytest` from collecting it):

    bash tools/make_vllm_omni_test_env.sh
    .venv-vllm-omni/bin/python -m pytest -o addopts=-ra -m vllm_omni_env tests/vllm_omni_env -q

What this pins down (the vllm-omni rollout engine relies on it; see the API notes for file/line references):
- the import paths of the types the engine builds or parses;
- the dataclass / TypedDict field names and defaults it sets or reads;
- OmniDiffusionRequest's guidance/seed defaulting, the output formatter's channels (trajectory_* fields, the
  output envelope's metadata groups), and that splitting a batched output per request drops trajectory_* fields;
- DiffusionLoRAManager on a tiny module built from real vLLM linear layers on CPU: PEFT adapter directory ->
  LoRAModel.from_local_checkpoint (leaf-name check) -> layer wrapping by target_modules (incl. packed QKV via
  stacked_params_mapping) -> the fail-closed bind check, with the LoRA output compared to PEFT's own forward.
Not run here: Omni/AsyncOmni engines, worker processes, the stock pipelines' __init__/forward (need real
weights and a GPU platform), fused kernels.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import vllm
import vllm_omni
from vllm.lora.request import LoRARequest
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager
from vllm_omni.diffusion.lora.utils import _expand_expected_modules_for_packed_layers, _match_target_modules
from vllm_omni.diffusion.models.boogu_image.pipeline_boogu_image import (
    BooguImagePipeline,
    get_boogu_image_post_process_func,
)
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import (
    QwenImagePipeline,
    get_qwen_image_post_process_func,
)
from vllm_omni.diffusion.output_formatter import format_diffusion_outputs, normalize_diffusion_postprocess_output
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.sched.request_scheduler import build_request_batch_sampling_params_key
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch, split_diffusion_output_by_request
from vllm_omni.entrypoints.async_omni import AsyncOmni
from vllm_omni.entrypoints.omni import Omni
from vllm_omni.inputs.data import OmniCustomPrompt, OmniDiffusionSamplingParams, OmniTextPrompt
from vllm_omni.lora.utils import stable_lora_int_id
from vllm_omni.outputs import OmniRequestOutput

pytestmark = pytest.mark.vllm_omni_env

torch.set_num_threads(1)


def test_versions_and_import_paths():
    assert vllm.__version__.startswith("0.30.") and vllm_omni.__version__.startswith("0.30.")
    from vllm_omni.lora.request import LoRARequest as OmniLoRARequest

    assert OmniLoRARequest is LoRARequest  # vllm-omni re-exports vLLM's class
    for cls in (QwenImagePipeline, BooguImagePipeline):
        assert issubclass(cls, nn.Module) and cls.supports_request_batch is True
        assert cls._dit_modules == ["transformer"]
    for name in ("generate", "close"):
        assert callable(getattr(Omni, name))
    for name in ("generate", "add_lora", "remove_lora", "list_loras", "pin_lora", "collective_rpc", "sleep", "wake_up"):
        assert callable(getattr(AsyncOmni, name))
    assert not hasattr(Omni, "add_lora")  # sync Omni: go through its engine's collective_rpc


def test_sampling_params_fields_and_defaults():
    fields = {f.name: f for f in dataclasses.fields(OmniDiffusionSamplingParams)}
    used = {
        "height", "width", "num_inference_steps", "sigmas", "timesteps", "max_sequence_length",
        "guidance_scale", "guidance_scale_provided", "guidance_scale_2", "true_cfg_scale", "cfg_normalize",
        "num_outputs_per_prompt", "seed", "generator", "generator_device", "latents", "output_type",
        "lora_request", "lora_scale", "extra_args", "return_trajectory_latents", "return_trajectory_decoded",
    }
    assert used <= set(fields), sorted(used - set(fields))
    sp = OmniDiffusionSamplingParams()
    assert (sp.seed, sp.generator, sp.generator_device, sp.lora_request) == (None, None, None, None)
    assert (sp.guidance_scale, sp.true_cfg_scale, sp.num_inference_steps, sp.output_type) == (None, None, None, None)
    assert sp.num_outputs_per_prompt == 1 and sp.lora_scale == 1.0 and sp.extra_args == {}
    assert sp.return_trajectory_latents is False and sp.guidance_scale_provided is False
    assert OmniDiffusionSamplingParams().extra_args is not sp.extra_args  # default_factory, not shared


def test_prompt_typeddict_keys():
    assert set(OmniCustomPrompt.__annotations__) == {
        "prompt_ids", "negative_prompt_ids", "prompt_mask", "negative_prompt_mask", "extra_args"
    }
    text_keys = set(typing.get_type_hints(OmniTextPrompt))
    assert {"prompt", "negative_prompt", "multi_modal_data", "additional_information",
            "prompt_embeds", "negative_prompt_embeds"} <= text_keys


def test_request_defaulting_rules():
    sp = OmniDiffusionSamplingParams(num_inference_steps=4)
    req = OmniDiffusionRequest(prompt={"prompt": "a cat", "negative_prompt": ""}, sampling_params=sp, request_id="r0")
    assert isinstance(sp.seed, int)  # unset seed becomes a random one (fail-closed engines must always set it)
    assert sp.guidance_scale == 1.0 and sp.guidance_scale_provided is False
    assert sp.guidance_scale_2 == 1.0 and sp.do_classifier_free_guidance is False
    sp2 = OmniDiffusionSamplingParams(guidance_scale=4.0, seed=7)
    OmniDiffusionRequest(prompt={"prompt": "a", "negative_prompt": "bad"}, sampling_params=sp2, request_id="r1")
    assert sp2.seed == 7 and sp2.guidance_scale_provided is True and sp2.do_classifier_free_guidance is True
    sp3 = OmniDiffusionSamplingParams(guidance_scale=4.0)
    OmniDiffusionRequest(prompt={"prompt": "a", "negative_prompt": ""}, sampling_params=sp3, request_id="r2")
    assert sp3.do_classifier_free_guidance is False  # empty negative string is falsy here
    with pytest.raises(ValueError):
        OmniDiffusionRequest(prompt="a", sampling_params=OmniDiffusionSamplingParams(), request_id="")
    assert req.sampling_params is sp


def test_batch_key_ignores_rl_extra_args_but_not_lora():
    def key(extra, lora_id):
        lora = LoRARequest("v", lora_id, "/tmp/x") if lora_id else None
        sp = OmniDiffusionSamplingParams(height=64, width=64, num_inference_steps=4, seed=1,
                                         extra_args=extra, lora_request=lora)
        return build_request_batch_sampling_params_key(
            OmniDiffusionRequest(prompt="a", sampling_params=sp, request_id="r"))

    # SDE knobs in extra_args do NOT separate batches: a custom pipeline must check they agree across the batch.
    assert key({"noise_level": 0.7}, 1) == key({"noise_level": 0.0}, 1)
    assert key({}, 1) != key({}, 2)


def test_diffusion_output_fields_and_to_cpu():
    names = {f.name for f in dataclasses.fields(DiffusionOutput)}
    assert {"output", "trajectory_latents", "trajectory_timesteps", "trajectory_log_probs", "trajectory_decoded",
            "error", "to_cpu", "finished", "post_process_func"} <= names
    out = DiffusionOutput(output={"payload": {"image": torch.zeros(1, 3, 16, 16)}, "metadata": {"rl": {"x": torch.ones(2)}}},
                          trajectory_latents=torch.zeros(1, 3, 4), to_cpu=True)
    assert out.output["metadata"]["rl"]["x"].device.type == "cpu"


def test_split_by_request_drops_trajectories():
    reqs = [OmniDiffusionRequest(prompt="a", sampling_params=OmniDiffusionSamplingParams(seed=i), request_id=f"r{i}")
            for i in range(2)]
    batch = DiffusionRequestBatch(requests=reqs)
    assert batch.num_reqs == 2 and batch.request_ids == ["r0", "r1"]
    full = DiffusionOutput(output=torch.zeros(2, 3, 8, 8), trajectory_latents=torch.zeros(2, 5, 4),
                           trajectory_log_probs=torch.zeros(2, 4))
    parts = split_diffusion_output_by_request(full, batch, num_outputs_per_prompt=1)
    assert [p.output.shape[0] for p in parts] == [1, 1]
    # vllm-omni 0.30's split helper does not carry trajectory_* through: a custom RL pipeline must build its
    # per-request DiffusionOutput list itself (or put trajectories in the output envelope).
    assert all(p.trajectory_latents is None and p.trajectory_log_probs is None for p in parts)


def _write_vae_config(model_dir: Path) -> None:
    (model_dir / "vae").mkdir(parents=True)
    (model_dir / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [8, 8, 8, 8]}))


def test_output_formatter_envelope_and_trajectory_channels(tmp_path):
    _write_vae_config(tmp_path)
    od_config = SimpleNamespace(model=str(tmp_path), model_class_name="QwenImagePipeline")
    post = get_qwen_image_post_process_func(od_config)
    W, L, C = 3, 16, 64
    rl = {"latents_clean": torch.randn(1, L, C), "seed": 5}
    raw = {"payload": {"image": torch.rand(1, 3, 32, 32) * 2 - 1},
           "metadata": {"rl": rl, "prompt_embeddings": {"prompt_embeds": torch.randn(1, 7, 12)},
                        "internal": {"dropped": 1}}}
    diff_out = DiffusionOutput(output=raw, trajectory_latents=torch.randn(1, W + 1, L, C),
                               trajectory_timesteps=torch.tensor([[1000.0, 750.0, 500.0]]),
                               trajectory_log_probs=torch.randn(1, W))
    normalized = normalize_diffusion_postprocess_output(post(diff_out.output))
    req = OmniDiffusionRequest(prompt={"prompt": "x"}, sampling_params=OmniDiffusionSamplingParams(seed=1),
                               request_id="r0")
    (res,) = format_diffusion_outputs(request=req, od_config=od_config, diffusion_output=diff_out,
                                      output_data=diff_out.output, postprocess_output=normalized)
    assert isinstance(res, OmniRequestOutput) and res.request_id == "r0" and res.final_output_type == "image"
    assert len(res.images) == 1 and res.images[0].size == (32, 32)  # PIL from the registered post-process
    torch.testing.assert_close(res.trajectory_log_probs, diff_out.trajectory_log_probs)
    assert res.trajectory_timesteps is diff_out.trajectory_timesteps
    assert res.latents is res.trajectory_latents  # `.latents` is the TRAJECTORY, not the final latent
    meta = res.multimodal_output["metadata"]
    assert set(meta) == {"rl", "prompt_embeddings"}  # `internal` stripped, unknown groups kept
    assert meta["rl"]["latents_clean"] is rl["latents_clean"]


def test_boogu_post_process_rejects_envelope(tmp_path):
    _write_vae_config(tmp_path)
    post = get_boogu_image_post_process_func(SimpleNamespace(model=str(tmp_path)))
    images = post(torch.rand(1, 3, 32, 32) * 2 - 1)
    assert len(images) == 1
    with pytest.raises(Exception):  # stock Boogu post-process only takes a tensor: no envelope channel in 0.30
        post({"payload": {"image": torch.rand(1, 3, 32, 32)}, "metadata": {"rl": {}}})


def test_lora_request_contract():
    req = LoRARequest(lora_name="v3", lora_int_id=4, lora_path="/ckpt/v3")
    assert (req.lora_name, req.lora_int_id, req.lora_path, req.adapter_id) == ("v3", 4, "/ckpt/v3", 4)
    assert req == LoRARequest("v3", 99, "/other")  # equality/hash by NAME only
    with pytest.raises(ValueError):
        LoRARequest("v", 0, "/p")
    with pytest.raises(AssertionError):
        LoRARequest("v", 1, "")
    assert stable_lora_int_id("/a/b") == stable_lora_int_id("/a/b") > 0


def test_target_matching_helpers():
    assert _match_target_modules("transformer.blocks.0.attn.to_q", ["to_q"])
    assert _match_target_modules("transformer.blocks.0.attn.to_out.0", ["to_out.0"])
    assert not _match_target_modules("transformer.blocks.0.attn.to_out.0", ["to_out"])
    assert not _match_target_modules("transformer.blocks.0.attn.to_q_x", ["to_q"])
    assert _expand_expected_modules_for_packed_layers({"to_qkv", "ff"}, {"to_qkv": ["to_q", "to_k", "to_v"]}) == {
        "to_qkv", "ff", "to_q", "to_k", "to_v"}


# --- DiffusionLoRAManager on real vLLM linear layers, CPU ---------------------------------------------------------

D = 8


# `vllm_cpu_layers` (vLLM config + 1-rank gloo TP group on CPU) lives in conftest.py, shared across files.


def _build_pair(linear):
    """A vLLM-layer 'pipeline' (packed to_qkv) and its plain nn.Linear twin (to_q/to_k/to_v) with equal weights."""

    class Transformer(nn.Module):
        stacked_params_mapping = [(".to_qkv", ".to_q", "q"), (".to_qkv", ".to_k", "k"), (".to_qkv", ".to_v", "v")]

        def __init__(self):
            super().__init__()
            block = nn.Module()
            block.attn = nn.Module()
            block.attn.to_qkv = linear.QKVParallelLinear(D, 4, 2, bias=False)
            block.attn.to_out = linear.RowParallelLinear(D, D, bias=False)
            block.ff = linear.ReplicatedLinear(D, D, bias=False)
            self.blocks = nn.ModuleList([block])

        def forward(self, x):
            b = self.blocks[0]
            q, k, v = b.attn.to_qkv(x)[0].split(D, dim=-1)
            return b.ff(b.attn.to_out(q * k + v)[0])[0]

    class Pipeline(nn.Module):
        _dit_modules = ["transformer"]

        def __init__(self):
            super().__init__()
            self.transformer = Transformer()

    class Twin(nn.Module):
        def __init__(self):
            super().__init__()
            block = nn.Module()
            block.attn = nn.Module()
            for name in ("to_q", "to_k", "to_v", "to_out"):
                setattr(block.attn, name, nn.Linear(D, D, bias=False))
            block.ff = nn.Linear(D, D, bias=False)
            self.blocks = nn.ModuleList([block])

        def forward(self, x):
            a = self.blocks[0].attn
            return self.blocks[0].ff(a.to_out(a.to_q(x) * a.to_k(x) + a.to_v(x)))

    torch.manual_seed(0)
    pipe, twin = Pipeline(), Twin()
    with torch.no_grad():
        a, ta = pipe.transformer.blocks[0].attn, twin.blocks[0].attn
        a.to_qkv.weight.copy_(torch.cat([ta.to_q.weight, ta.to_k.weight, ta.to_v.weight]))
        a.to_out.weight.copy_(ta.to_out.weight)
        pipe.transformer.blocks[0].ff.weight.copy_(twin.blocks[0].ff.weight)
    return pipe, twin


def _peft_adapter(twin: nn.Module, out_dir: Path, targets: list[str]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(twin, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # non-zero B: a zero-B adapter hides binding bugs
    model.save_pretrained(str(out_dir))
    return model


def _rewrite_adapter(src: Path, dst: Path, rename) -> None:
    import safetensors.torch

    tensors = safetensors.torch.load_file(str(src / "adapter_model.safetensors"))
    dst.mkdir()
    safetensors.torch.save_file({rename(k): v for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))
    shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")


def test_lora_manager_binds_peft_adapter_on_cpu(vllm_cpu_layers, tmp_path):
    pipe, twin = _build_pair(vllm_cpu_layers)
    x = torch.randn(3, D)
    base = pipe.transformer(x)
    torch.testing.assert_close(base, twin(x), atol=1e-5, rtol=1e-5)
    peft_model = _peft_adapter(twin, tmp_path / "v1", ["to_q", "to_k", "to_v", "to_out", "ff"])
    expected = peft_model(x)

    mgr = DiffusionLoRAManager(pipeline=pipe, device=torch.device("cpu"), dtype=torch.float32, max_cached_adapters=2)
    assert mgr._supported_lora_modules == {"to_qkv", "to_out", "ff"}
    assert mgr._packed_modules_mapping == {"to_qkv": ["to_q", "to_k", "to_v"]}
    assert mgr._expected_lora_modules == {"to_qkv", "to_q", "to_k", "to_v", "to_out", "ff"}

    mgr.set_active_adapter(LoRARequest("v1", 1, str(tmp_path / "v1")), 1.0)
    assert set(mgr._lora_modules) == {"transformer.blocks.0.attn.to_qkv", "transformer.blocks.0.attn.to_out",
                                      "transformer.blocks.0.ff"}
    assert set(mgr._registered_adapters[1].loras) == {f"blocks.0.attn.{n}" for n in ("to_q", "to_k", "to_v", "to_out")} | {"blocks.0.ff"}
    out = pipe.transformer(x)
    assert (out - base).abs().max() > 1e-2  # the adapter really changes the output
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)  # ... exactly as PEFT does (alpha/r folded in)

    mgr.set_active_adapter(LoRARequest("v1", 1, str(tmp_path / "v1")), 0.0)  # scale 0 suspends
    torch.testing.assert_close(pipe.transformer(x), base)
    mgr.set_active_adapter(LoRARequest("v1", 1, str(tmp_path / "v1")), 1.0)  # re-armed without reload
    torch.testing.assert_close(pipe.transformer(x), expected, atol=1e-4, rtol=1e-4)
    assert mgr.list_adapters() == [1]


def test_lora_manager_fails_closed_on_cpu(vllm_cpu_layers, tmp_path):
    pipe, twin = _build_pair(vllm_cpu_layers)
    x = torch.randn(3, D)
    base = pipe.transformer(x)
    _peft_adapter(twin, tmp_path / "good", ["to_q", "to_k", "to_v", "to_out", "ff"])
    mgr = DiffusionLoRAManager(pipeline=pipe, device=torch.device("cpu"), dtype=torch.float32, max_cached_adapters=4)

    # Supported leaf names, but a path that does not exist: loads, wraps, then the bind check raises.
    _rewrite_adapter(tmp_path / "good", tmp_path / "wrong_path", lambda k: k.replace("blocks.0.", "blocks.7."))
    with pytest.raises(ValueError, match=r"binding is incomplete: bound=0/5"):
        mgr.set_active_adapter(LoRARequest("wrong_path", 2, str(tmp_path / "wrong_path")), 1.0)
    torch.testing.assert_close(pipe.transformer(x), base)  # every wrapper left inactive

    # Leaf name not a supported suffix (diffusers' `to_out.0`): LoRAModel.from_local_checkpoint rejects it.
    _rewrite_adapter(tmp_path / "good", tmp_path / "to_out0", lambda k: k.replace(".to_out.", ".to_out.0."))
    with pytest.raises(ValueError, match=r"expected target modules in .* but received \['blocks.0.attn.to_out.0'"):
        mgr.set_active_adapter(LoRARequest("to_out0", 3, str(tmp_path / "to_out0")), 1.0)
