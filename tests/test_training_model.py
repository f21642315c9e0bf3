"""training/model.py: LoRA adapters (layout, binding, switching), activation checkpointing, FSDP2 sharding, the
mixed-precision policy, and `prepare_transformer` on the real tiny checkpoints."""

from __future__ import annotations

import math
import os

import pytest
import torch

import training as T
from training.model import (adapter_params, add_lora_adapters, apply_activation_checkpointing,
                            full_tensor, mixed_precision_policy, prepare_transformer, shard_transformer)
from training.optim import GradStepper, build_optimizer
from models import lora
from models.base import transformer_blocks
from _tiny_lora import BLOCK_PREFIXES, TinyFlowTransformer
from _training_helpers import full_params, make_model

pytestmark = pytest.mark.usefixtures("one_process_group")  # a 1-process gloo group (tests/conftest.py)


# ---------------------------------------------------------------------------------------------------------------
# LoRA, adapters, activation checkpointing, FSDP2
# ---------------------------------------------------------------------------------------------------------------


def test_lora_layout_and_trainable_set():
    model, cfg = make_model(shard=False)
    default = [n for n, _ in adapter_params(model, "default")]
    old = [n for n, _ in adapter_params(model, "old")]
    # 3 blocks x 2 targets x (A, B)
    assert len(default) == len(old) == 12
    assert "blocks.0.to_q.lora_A.default.weight" in default and "blocks.2.ff.lora_B.old.weight" in old
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(default)
    assert all(p.dtype == torch.float32 for _, p in adapter_params(model, "old"))
    assert cfg.r == 3 and cfg.lora_alpha == 6.0
    assert sorted(full_params(model, "default"))[0] == "blocks.0.ff.lora_A.weight"



def test_lora_binding_fails_closed():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="bind no module"):
        add_lora_adapters(TinyFlowTransformer(), target_modules=("to_q", "to_qq"), rank=2, alpha=2,
                          block_prefixes=BLOCK_PREFIXES)
    with pytest.raises(ValueError, match="outside the transformer blocks"):
        add_lora_adapters(TinyFlowTransformer(), target_modules=("to_q", "proj_in"), rank=2, alpha=2,
                          block_prefixes=BLOCK_PREFIXES)
    with pytest.raises(ValueError, match="not a child"):
        transformer_blocks(TinyFlowTransformer(), ("transformer_blocks",))



@pytest.mark.parametrize("shard", [False, True])
def test_adapter_switching_and_disabling(shard):
    model, _ = make_model(shard=shard)
    torch.manual_seed(0)
    base = TinyFlowTransformer()
    x = torch.randn(2, 5, 4)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.no_grad():
        y_default = model(x)
        with T.use_adapter(model, "old"):
            y_old = model(x)
            assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
        with lora.lora_disabled(model):
            y_ref = model(x)
            assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
        y_default_again = model(x)
    assert not torch.allclose(y_default, y_old) and not torch.allclose(y_default, y_ref)
    torch.testing.assert_close(y_ref, base(x).detach(), rtol=0, atol=1e-6)  # disabled = the frozen base model
    assert torch.equal(y_default, y_default_again)  # "default" active again after the contexts
    with T.use_adapter(model, "old"):
        y_old2 = model(x).detach()
    assert torch.equal(y_old, y_old2)
    with pytest.raises(ValueError, match="adapter 'nope' is missing"):
        with T.use_adapter(model, "nope"):
            pass



def test_nft_forward_pattern_with_checkpointing_and_fsdp():
    """DiffusionNFT's pattern: policy forward with grad, old and reference forwards under no_grad inside the adapter
    contexts, then backward (with "default" active again). With activation checkpointing + FSDP2 the gradients must
    equal those of a plain model that only ran the policy forward."""
    plain, _ = make_model(shard=False)
    ck, _ = make_model(shard=False)
    apply_activation_checkpointing(ck, BLOCK_PREFIXES)
    shard_transformer(ck, BLOCK_PREFIXES)
    x = torch.randn(2, 5, 4)
    plain(x).pow(2).mean().backward()
    loss = ck(x).pow(2).mean()
    with torch.no_grad():
        with T.use_adapter(ck, "old"):
            ck(x)
        with lora.lora_disabled(ck):
            ck(x)
    loss.backward()
    for (n, p), (_, q) in zip(adapter_params(plain, "default"), adapter_params(ck, "default")):
        torch.testing.assert_close(full_tensor(q.grad), p.grad, rtol=1e-6, atol=1e-7, msg=n)
    assert all(q.grad is None for _, q in adapter_params(ck, "old"))



def test_activation_checkpointing_keeps_names_and_grads():
    ref, _ = make_model(shard=False)
    ck, _ = make_model(shard=False)
    names = [n for n, _ in ck.named_parameters()]
    assert apply_activation_checkpointing(ck, BLOCK_PREFIXES) == 3
    assert [n for n, _ in ck.named_parameters()] == names
    x = torch.randn(2, 5, 4)
    ref(x).pow(2).mean().backward()
    ck(x).pow(2).mean().backward()
    for (n, p), (_, q) in zip(adapter_params(ref, "default"), adapter_params(ck, "default")):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)



def test_fsdp2_sharded_matches_unsharded():
    from torch.distributed.tensor import DTensor

    ref, _ = make_model(shard=False)
    sharded, _ = make_model(shard=True)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    x = torch.randn(2, 5, 4)
    torch.testing.assert_close(sharded(x), ref(x), rtol=0, atol=1e-6)



def test_mixed_precision_policy():
    cpu = mixed_precision_policy(torch.device("cpu"), "bf16")
    assert cpu.param_dtype is None and cpu.reduce_dtype is None  # CPU always computes in fp32
    gpu = mixed_precision_policy(torch.device("cuda", 0), "bf16")
    assert gpu.param_dtype == torch.bfloat16 and gpu.reduce_dtype == torch.float32
    assert mixed_precision_policy(torch.device("cuda", 0), "fp32").param_dtype is None
    with pytest.raises(ValueError, match="precision"):
        mixed_precision_policy(torch.device("cpu"), "fp16")


# ---------------------------------------------------------------------------------------------------------------
# the real tiny checkpoints: what the trainers do, through the model wrappers
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen_image", "boogu_image_edit"])
def test_prepare_real_tiny_transformer(tiny_models, name):
    """prepare_transformer (LoRA default+old, activation checkpointing, FSDP2) on the wrapper's transformer with its
    default targets and block prefixes; predict_velocity backpropagates into "default" only; "old" and the disabled
    (reference) pass go through the same wrapper, and the disabled pass equals an untouched model exactly."""
    from models import load_model

    path = os.path.join(tiny_models, name)
    model, untouched = load_model(path), load_model(path)
    prepare_transformer(model.transformer, block_prefixes=model.lora_block_prefixes,
                        target_modules=model.default_lora_targets, lora_rank=4, lora_alpha=8.0,
                        adapter_names=("default", "old"), device="cpu", activation_checkpointing=True)
    with torch.no_grad():
        for n, p in adapter_params(model.transformer, "default"):
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    prompt = model.encode_prompt(["a red bicycle", "a sign that says 'hi'"])
    x = model.prepare_noise(64, 64, [torch.Generator().manual_seed(s) for s in (1, 2)])
    kw = {"height": 64, "width": 64}
    if name == "boogu_image_edit":
        img = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        kw["ref_latents"] = model.encode_reference([img, img], [torch.Generator().manual_seed(s) for s in (5, 6)])
    sigmas = torch.tensor([0.7, 0.3])
    v = model.predict_velocity(x, sigmas, prompt, **kw)
    with torch.no_grad():
        with T.use_adapter(model.transformer, "old"):
            v_old = model.predict_velocity(x, sigmas, prompt, **kw)
        with lora.lora_disabled(model.transformer):
            v_base = model.predict_velocity(x, sigmas, prompt, **kw)
        v_untouched = untouched.predict_velocity(x, sigmas, prompt, **kw)
    assert torch.equal(v_base, v_untouched)
    assert torch.equal(v_old, v_base)  # "old" has B = 0 (not yet copied), so it equals the base model
    assert (v.detach() - v_base).abs().max() > 1e-3  # "default" has non-zero B
    v.pow(2).mean().backward()
    no_grad = {n for n, p in adapter_params(model.transformer, "default") if p.grad is None}
    if name == "qwen_image":  # the last dual-stream block's text outputs never reach the image: no gradient
        last = f"transformer_blocks.{len(model.transformer.transformer_blocks) - 1}"
        assert no_grad == {f"{last}.{m}.lora_{ab}.default.weight" for ab in "AB"
                           for m in ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")}
    else:
        assert not no_grad
    assert all(p.grad is None for _, p in adapter_params(model.transformer, "old"))
    assert all(p.grad is None for n, p in model.transformer.named_parameters() if ".lora_" not in n)
    m = GradStepper(max_grad_norm=1.0).step(build_optimizer(model.transformer, lr=1e-3))
    assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
