"""tools/build_tiny_models.py: real layouts, real tokenizer, determinism."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

import build_tiny_models as btm


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_qwen_image_layout_and_diffusers_load(tiny_models):
    from diffusers import QwenImagePipeline
    from transformers import Qwen2Tokenizer

    d = os.path.join(tiny_models, "qwen_image")
    for f in ("model_index.json", "scheduler/scheduler_config.json", "transformer/config.json",
              "transformer/diffusion_pytorch_model.safetensors", "vae/config.json", "text_encoder/config.json",
              "tokenizer/vocab.json", "tokenizer/merges.txt", "tokenizer/tokenizer_config.json"):
        assert os.path.isfile(os.path.join(d, f)), f
    sched = json.load(open(os.path.join(d, "scheduler", "scheduler_config.json")))
    assert sched["shift_terminal"] == 0.02 and sched["max_image_seq_len"] == 8192 and sched["max_shift"] == 0.9
    assert sched["time_shift_type"] == "exponential" and sched["use_dynamic_shifting"] is True
    pipe = QwenImagePipeline.from_pretrained(d, local_files_only=True)
    assert isinstance(pipe.tokenizer, Qwen2Tokenizer)
    assert pipe.text_encoder.config.text_config.vocab_size >= len(pipe.tokenizer)
    assert pipe.transformer.config.joint_attention_dim == pipe.text_encoder.config.text_config.hidden_size
    # the real Qwen vocabulary (not a toy BPE): known ids of the Qwen2 tokenizer
    tok = pipe.tokenizer
    assert len(tok) > 151000
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|image_pad|>"]) == [151644, 151645, 151655]
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_genrm_processor_and_generation(tiny_models):
    from PIL import Image
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    d = os.path.join(tiny_models, "qwen3_vl_genrm")
    proc = AutoProcessor.from_pretrained(d)
    assert type(proc).__name__ == "Qwen3VLProcessor"
    assert proc.image_processor.patch_size == 16 and proc.image_processor.merge_size == 2
    model = Qwen3VLForConditionalGeneration.from_pretrained(d).eval()
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What text is shown?"}]}]
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|vision_start|><|image_pad|><|vision_end|>What text is shown?" in text
    image = Image.new("RGB", (256, 384), (200, 30, 30))  # >= 65536 px: no upscaling
    inputs = proc(text=[text], images=[image], return_tensors="pt")
    n_img = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_img == (256 // 32) * (384 // 32)  # patch 16 x merge 2
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3
    gen = json.load(open(os.path.join(d, "generation_config.json")))
    assert 151645 in gen["eos_token_id"]


def test_build_is_deterministic(tiny_models, tmp_path):
    btm.build_one("qwen_image", str(tmp_path), force=False)
    for f in ("transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
              "text_encoder/model.safetensors", "tokenizer/tokenizer_config.json", "model_index.json"):
        assert _sha(os.path.join(tmp_path, "qwen_image", f)) == _sha(os.path.join(tiny_models, "qwen_image", f)), f
    assert btm.is_complete(os.path.join(tmp_path, "qwen_image"))
    assert btm.build_one("qwen_image", str(tmp_path), force=False) == 0.0  # complete: reused


def test_unknown_name_raises(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model"):
        btm.build_all(str(tmp_path), names=["sd3"])
