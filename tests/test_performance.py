"""Tests for issue 10's training-side speed work: frozen base weights stored in bf16 (same numbers as an fp32 base
under the bf16 FSDP2 policy), fp32-exact LoRA init on a bf16 base, selective activation checkpointing, the
rollout's transition means (Flow-DPPO bypass), the per-family FLOP models against torch's FlopCounterMode, the
MFU / memory metrics and the DiffusionNFT CFG flags. CPU, tiny models, seconds."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import training as T
from training.flags import resolve_cfg_scale
from training.model import (adapter_params, add_lora_adapters, apply_activation_checkpointing,
                            base_weight_dtype, cast_frozen_base_, checkpointed_block_indices, full_tensor,
                            load_flow_model, prepare_transformer, shard_transformer)
from training.optim import GradStepper, build_optimizer
from training.perf import (PEAK_TFLOPS_ENV, device_peak_flops, phase_perf_metrics, rollout_device_count,
                           transformer_flops)
from models import lora
from models.base import BLOCK_GRAPH_LIMIT, compile_blocks, transformer_blocks
from _tiny_lora import BLOCK_PREFIXES, TARGETS, TinyFlowTransformer

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    created = not torch.distributed.is_initialized()
    info = T.init_distributed("cpu")
    yield info
    if created:
        T.cleanup_distributed()


def bf16_policy():
    """The GPU policy of --precision bf16, made explicit so that FSDP2 applies it on CPU/gloo too."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def tiny(base_dtype: torch.dtype, *, shard: bool = True, checkpoint_blocks=None):
    """The tiny transformer (base weights from seed 0) stored in `base_dtype`, LoRA "default"+"old" from seed 1
    with random non-zero B, sharded under the bf16 policy."""
    torch.manual_seed(0)
    model = TinyFlowTransformer()
    model.requires_grad_(False)
    cast_frozen_base_(model, base_dtype)
    torch.manual_seed(1)
    add_lora_adapters(model, target_modules=TARGETS, rank=3, alpha=6.0, adapter_names=("default", "old"),
                      block_prefixes=BLOCK_PREFIXES)
    with torch.no_grad():
        for name, p in adapter_params(model, "default"):
            if ".lora_B." in name:
                p.normal_(0, 0.2)
    if checkpoint_blocks is not None:
        apply_activation_checkpointing(model, BLOCK_PREFIXES, checkpoint_blocks)
    if shard:
        shard_transformer(model, BLOCK_PREFIXES, mp_policy=bf16_policy())
    return model


# ---------------------------------------------------------------------------------------------------------------
# frozen base weights in bf16
# ---------------------------------------------------------------------------------------------------------------


def test_base_weight_dtype_follows_the_compute_dtype():
    assert base_weight_dtype(torch.device("cuda", 0), "bf16", "compute") == torch.bfloat16
    assert base_weight_dtype(torch.device("cuda", 0), "bf16", "fp32") == torch.float32  # the old path
    assert base_weight_dtype(torch.device("cuda", 0), "fp32", "compute") == torch.float32
    assert base_weight_dtype(torch.device("cpu"), "bf16", "compute") == torch.float32  # CPU computes in fp32
    with pytest.raises(ValueError, match="base_weights_dtype"):
        base_weight_dtype("cpu", "bf16", "bf16")


def test_bf16_stored_base_equals_fp32_base_under_the_bf16_policy():
    """Forward values, LoRA gradients and the weights after two AdamW steps are bit-identical whether the frozen
    base is stored in fp32 (cast by FSDP2 every forward) or in bf16; dtypes: base bf16, LoRA + grads + Adam fp32."""
    from torch.distributed.tensor import DTensor

    ref, new = tiny(torch.float32), tiny(torch.bfloat16)
    base = [p for n, p in new.named_parameters() if ".lora_" not in n]
    assert base and all(p.dtype == torch.bfloat16 and isinstance(p, DTensor) for p in base)
    assert all(p.dtype == torch.float32 for _, p in adapter_params(new, "default") + adapter_params(new, "old"))
    opts = [build_optimizer(m, lr=1e-2) for m in (ref, new)]
    x = torch.randn(2, 5, 4)
    for _ in range(2):  # the second forward runs on the weights after one AdamW step
        outs = []
        for model, opt in zip((ref, new), opts):
            y = model(x)
            y.float().pow(2).mean().backward()
            outs.append(y.detach())
            grads = [full_tensor(p.grad) for _, p in adapter_params(model, "default")]
            assert all(g.dtype == torch.float32 for g in grads)
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert outs[0].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])
    for (n, p), (_, q) in zip(adapter_params(ref, "default"), adapter_params(new, "default")):
        assert torch.equal(full_tensor(p), full_tensor(q)), n
    state = next(iter(opts[1].state.values()))
    assert state["exp_avg"].dtype == torch.float32


def test_lora_init_is_fp32_exact_on_a_bf16_base():
    """peft moves a new adapter to its base layer's dtype; `add_lora_adapters` must still give the fp32 init."""
    ref, new = tiny(torch.float32, shard=False), tiny(torch.bfloat16, shard=False)
    pairs = list(zip(adapter_params(ref, "old"), adapter_params(new, "old")))  # "old": untouched after init
    assert all(torch.equal(p, q) for (_, p), (_, q) in pairs)
    assert all(q.requires_grad is False for n, q in new.named_parameters() if ".lora_" not in n)
    # the same injection through peft alone rounds the initial A through bf16: the guard above is needed
    torch.manual_seed(0)
    plain = TinyFlowTransformer().to(torch.bfloat16)
    torch.manual_seed(1)
    lora.apply_lora(plain, list(TARGETS), rank=3, alpha=6.0, block_prefixes=BLOCK_PREFIXES,
                    adapter_names=("default", "old"), init_lora_weights="gaussian")
    a_ref = [p for n, p in adapter_params(ref, "old") if ".lora_A." in n]
    a_plain = [p for n, p in adapter_params(plain, "old") if ".lora_A." in n]
    assert any(not torch.equal(p, q.float()) for p, q in zip(a_ref, a_plain))


def test_load_flow_model_reads_bf16_and_keeps_fp32_inputs(tiny_models):
    """The real tiny Qwen-Image loaded as on a bf16 GPU trainer rank (weights read in bf16, wrapper inputs fp32)
    gives the velocities of the fp32-loaded model under the same bf16 policy, bit for bit."""
    from models.base import PromptEmbeds

    path = os.path.join(tiny_models, "qwen_image")
    flags = SimpleNamespace(max_sequence_length=64, cfg_batch=False, precision="bf16", base_weights_dtype="compute")
    new = load_flow_model(path, flags, torch.device("cuda", 0))  # loads on the CPU; no CUDA needed
    ref = load_flow_model(path, SimpleNamespace(**{**vars(flags), "base_weights_dtype": "fp32"}),
                          torch.device("cuda", 0))
    assert {p.dtype for p in new.transformer.parameters()} == {torch.bfloat16} and new.dtype == torch.float32
    assert {p.dtype for p in ref.transformer.parameters()} == {torch.float32} and ref.dtype == torch.float32
    torch.manual_seed(3)
    prompt = PromptEmbeds(torch.randn(2, 7, ref.transformer.config.joint_attention_dim), torch.ones(2, 7))
    x = torch.randn(2, 16, 64)
    outs = []
    for model in (ref, new):
        model.device = torch.device("cpu")
        torch.manual_seed(1)
        add_lora_adapters(model.transformer, target_modules=model.default_lora_targets, rank=4, alpha=8.0,
                          block_prefixes=model.lora_block_prefixes)
        shard_transformer(model.transformer, model.lora_block_prefixes, mp_policy=bf16_policy(), device="cpu")
        outs.append(model.predict_velocity(x, torch.tensor([0.9, 0.4]), prompt, height=64, width=64))
    assert outs[0].dtype == torch.float32 and torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------------------------
# one trainer rank without FSDP2 (--fsdp auto)
# ---------------------------------------------------------------------------------------------------------------


def nft_micro_steps(model, optimizer, inputs, forward=None):
    """DiffusionNFT's update pattern on `model`: per input, the `old` and reference forwards under no_grad, the
    policy forward with grad, a loss using all three, backward; one AdamW step per pair of inputs. Returns every
    output and the gradients before each step (full tensors)."""
    forward = forward or model
    outs, grads = [], []
    for i, x in enumerate(inputs):
        with torch.no_grad():
            with T.use_adapter(_transformer(model), "old"):
                v_old = forward(x)
            with lora.lora_disabled(_transformer(model)):
                v_ref = forward(x)
        v = forward(x)
        ((v.float() - v_old.float()).pow(2).mean() + v.float().pow(2).mean() + 1e-2 * v_ref.float().mean()).backward()
        outs += [v.detach(), v_old, v_ref]
        if i % 2 == 1:
            grads.append([None if p.grad is None else full_tensor(p.grad).clone()
                          for _, p in adapter_params(_transformer(model), "default")])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return outs, grads


def _transformer(model):
    return getattr(model, "transformer", model)


def test_one_rank_placement_equals_fsdp2_bit_for_bit():
    """--fsdp auto on one rank (no FSDP2: bf16 base in place, fp32 LoRA cast to bf16 in forward, the block inputs
    cast as FSDP2 casts them) against FSDP2 at world size 1 under the same bf16 policy, with checkpointing, adapter
    switches and two AdamW steps: every output, gradient and weight equal bit for bit; nothing is a DTensor."""
    from torch.distributed.tensor import DTensor

    models = []
    for mode in ("always", "auto"):
        model = tiny(torch.bfloat16, shard=False, checkpoint_blocks=3)
        shard_transformer(model, BLOCK_PREFIXES, mp_policy=bf16_policy(), device="cpu", fsdp=mode)
        models.append(model)
    fsdp, direct = models
    assert not any(isinstance(p, DTensor) for p in direct.parameters())
    assert all(p.dtype == torch.float32 for _, p in adapter_params(direct, "default"))
    torch.manual_seed(0)
    inputs = [torch.randn(2, 5, 4) for _ in range(4)]
    results = [nft_micro_steps(m, build_optimizer(m, lr=1e-2), inputs) for m in models]
    (outs_a, grads_a), (outs_b, grads_b) = results
    assert all(o.dtype == torch.bfloat16 for o in outs_b)
    assert all(torch.equal(a, b) for a, b in zip(outs_a, outs_b))
    assert all(g.dtype == torch.float32 for step in grads_b for g in step)
    assert all(torch.equal(a, b) for sa, sb in zip(grads_a, grads_b) for a, b in zip(sa, sb))
    for (n, p), (_, q) in zip(adapter_params(fsdp, "default"), adapter_params(direct, "default")):
        assert torch.equal(full_tensor(p), q), n
    # a block called with an fp32 argument: FSDP2 casts it to bf16 before the block's bf16 weights see it; so must
    # the one-rank placement (without its block hook the bf16 base Linear would refuse the fp32 input)
    h = torch.randn(2, 5, 8)
    with torch.no_grad():
        out_fsdp, out_direct = fsdp.blocks[1](h), direct.blocks[1](h)
    assert out_direct.dtype == torch.bfloat16 and torch.equal(out_fsdp, out_direct)


def family_nft_run(path: str, fsdp: str, *, dtype: torch.dtype = torch.bfloat16, compile: str = "off",
                   old_b: bool = False, prompts: tuple[str, ...] = ("a sign that says 'hello'",)):
    """A real tiny model through its wrapper, prepared as a trainer prepares it (LoRA default + old with random
    non-zero B on "default" and, with old_b, on "old"; base in `dtype` under the matching policy; checkpointing of
    every block; --fsdp `fsdp`; --compile `compile`), then the NFT pattern of `nft_micro_steps` on 2 noise batches
    per prompt (one optimizer step per pair; the prompts, of different lengths, taken in turn). Returns (model,
    outputs, gradients)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from models import load_model

    encoder = load_model(path)
    prompt_embeds = [encoder.encode_prompt([p]).index([0, 0]) for p in prompts]
    model = load_model(path, device="cpu", dtype=dtype, transformer_only=True)
    model.dtype = torch.float32
    torch.manual_seed(1)
    add_lora_adapters(model.transformer, target_modules=model.default_lora_targets, rank=4, alpha=8.0,
                      block_prefixes=model.lora_block_prefixes, adapter_names=("default", "old"))
    with torch.no_grad():
        for adapter in ("default", "old") if old_b else ("default",):
            for key, p in adapter_params(model.transformer, adapter):
                if ".lora_B." in key:
                    p.normal_(0, 0.05)
    apply_activation_checkpointing(model.transformer, model.lora_block_prefixes)
    policy = bf16_policy() if dtype == torch.bfloat16 else MixedPrecisionPolicy(reduce_dtype=torch.float32)
    shard_transformer(model.transformer, model.lora_block_prefixes, mp_policy=policy, device="cpu", fsdp=fsdp)
    if compile == "blocks":
        compile_blocks(model.transformer, model.lora_block_prefixes)
    torch.manual_seed(3)
    inputs = [model.prepare_noise(64, 64, [torch.Generator().manual_seed(s + 10 * i) for s in (1, 2)])
              for i in range(2 * len(prompts))]
    calls = iter(range(10 ** 6))

    def forward(x):  # 3 forwards per input (policy, old, reference), 2 inputs per prompt
        prompt = prompt_embeds[next(calls) // 6 % len(prompts)]
        return model.predict_velocity(x, torch.tensor([0.9, 0.4]), prompt, height=64, width=64)

    return (model, *nft_micro_steps(model, build_optimizer(model.transformer, lr=1e-2), inputs, forward))


@pytest.mark.parametrize("name", ["qwen_image", "boogu_image_base"])
def test_one_rank_placement_of_both_families_equals_fsdp2(tiny_models, name):
    """The real tiny models (Qwen-Image: complex RoPE; Boogu-Image: fp32 RoPE tables in a StreamContext, which
    neither cast may touch) through their wrappers, prepared as a trainer prepares them (LoRA default + old, bf16
    base, checkpointing of every block) with --fsdp always / auto: the NFT pattern's velocities equal bit for bit,
    and so do the gradients, but for one documented case: a LoRA layer used twice in one forward (Boogu's shared
    `to_out.0` of the double-stream blocks, applied to each stream). FSDP2 sums its two bf16 weight gradients in
    bf16 and then casts; the one-rank path casts each to fp32 and sums in fp32: equal within bf16 rounding."""
    path = os.path.join(tiny_models, name)
    (model, outs_a, grads_a), (_, outs_b, grads_b) = [family_nft_run(path, mode) for mode in ("always", "auto")]
    assert all(torch.equal(a, b) for a, b in zip(outs_a, outs_b))
    names = [key for key, _ in adapter_params(model.transformer, "default")]
    differ = set()
    for step_a, step_b in zip(grads_a, grads_b):
        for key, a, b in zip(names, step_a, step_b):
            assert (a is None) == (b is None), key
            if a is not None and not torch.equal(a, b):
                differ.add(key)
                torch.testing.assert_close(b, a, rtol=2 ** -7, atol=2 ** -7 * float(a.abs().max()), msg=key)
    shared = {key for key in names if key.startswith("double_stream_layers.") and ".to_out.0." in key}
    assert differ <= shared and (name != "qwen_image" or not differ), sorted(differ)
    assert any(g is not None and g.abs().sum() > 0 for g in grads_b[0])


def relative_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    """max |value - reference| / max |reference|, in fp32."""
    return float((value.float() - reference.float()).abs().max() / reference.float().abs().max())


def run_errors(reference, run) -> tuple[float, float]:
    """The largest `relative_error` of a `family_nft_run`'s outputs and of its gradients against `reference`'s."""
    (_, outs_ref, grads_ref), (_, outs, grads) = reference, run
    out_error = max(relative_error(a, b) for a, b in zip(outs_ref, outs))
    grad_error = max(relative_error(a, b) for sa, sb in zip(grads_ref, grads) for a, b in zip(sa, sb)
                     if a is not None)
    return out_error, grad_error


def test_compile_blocks_wraps_each_block_once_and_fails_closed():
    """Every block's forward is replaced by a compiled one (nothing else: the root keeps its eager forward), a
    second call is refused, torch is told to raise (not to run eagerly) when a block exceeds its graph budget, and
    an unknown mode is refused."""
    import torch._dynamo

    model = tiny(torch.float32, shard=False)
    eager = {id(b): b.forward for b in transformer_blocks(model, BLOCK_PREFIXES)}
    assert compile_blocks(model, BLOCK_PREFIXES) == len(eager) == 3
    for block in transformer_blocks(model, BLOCK_PREFIXES):
        assert block.forward is not eager[id(block)] and block.forward._torchdynamo_orig_callable == eager[id(block)]
    assert "forward" not in vars(model)
    with pytest.raises(RuntimeError, match="compiled already"):
        compile_blocks(model, BLOCK_PREFIXES)
    config = torch._dynamo.config
    assert config.fail_on_recompile_limit_hit and config.recompile_limit >= BLOCK_GRAPH_LIMIT
    with pytest.raises(ValueError, match="compile must be"):
        prepare_transformer(TinyFlowTransformer(), block_prefixes=BLOCK_PREFIXES, target_modules=TARGETS,
                            lora_rank=2, lora_alpha=2.0, compile="yes")


@pytest.mark.parametrize("name", ["qwen_image", "boogu_image_base"])
def test_the_native_engine_and_the_trainer_compile_the_family_blocks_when_asked(tiny_models, name):
    """--compile blocks reaches the rollout and the trainer alike: the native engine and `prepare_transformer` (as
    the trainers call it) wrap exactly the family's `blocks_to_compile` (Qwen-Image: every block; Boogu-Image: the
    double- and single-stream blocks, its refiners stay eager) and nothing else. The first generate compiles them;
    the CPU smoke of bench_step.py runs that path end to end."""
    import rollout
    from models import load_model

    def compiled(model) -> list[bool]:
        blocks = transformer_blocks(model.transformer, model.lora_block_prefixes)
        return [hasattr(b.forward, "_torchdynamo_orig_callable") for b in blocks]

    path = os.path.join(tiny_models, name)
    expected = [any(prefix in key for prefix in load_model(path, transformer_only=True).blocks_to_compile)
                for key in block_keys(path)]
    assert any(expected) and (all(expected) == (name == "qwen_image")), expected
    for flag in (False, True):
        assert compiled(rollout.NativeEngine(path, compile_blocks=flag).model) == [e and flag for e in expected]
    model = load_model(path, transformer_only=True)
    prepare_transformer(model.transformer, block_prefixes=model.lora_block_prefixes,
                        target_modules=model.default_lora_targets, lora_rank=2, lora_alpha=2.0, device="cpu",
                        fsdp="auto", compile="blocks",
                        compile_prefixes=model.blocks_to_compile)
    assert compiled(model) == expected


def block_keys(path: str) -> list[str]:
    """The module names of the family's blocks (in `transformer_blocks` order), read from a fresh load."""
    from models import load_model

    model = load_model(path, transformer_only=True)
    blocks = transformer_blocks(model.transformer, model.lora_block_prefixes)
    names = {id(module): name for name, module in model.transformer.named_modules()}
    return [names[id(b)] for b in blocks]


@pytest.mark.slow
def test_compiled_blocks_compute_what_eager_blocks_compute(tiny_models):
    """--compile blocks on the tiny Qwen-Image as a trainer prepares it (one-rank placement, checkpointing of every
    block, LoRA default + old both non-zero): the NFT pattern (old / reference forwards without grad, the policy
    forward with grad, two prompt lengths, AdamW steps) in fp32 equals eager within fp32 rounding, and the three
    adapter states still give three different velocities (a compiled graph reused across an adapter switch would
    not). One family only: a CPU compile costs minutes per model (Boogu-Image, FSDP2 and bf16 were checked the same
    way when the flag was written: docs/lab/PERFORMANCE_LOG.md)."""
    path = os.path.join(tiny_models, "qwen_image")
    prompts = ("a sign that says 'hello'", "a long sign that says 'hello world, how are you today'")
    fp32 = {mode: family_nft_run(path, "auto", dtype=torch.float32, compile=mode, old_b=True, prompts=prompts)
            for mode in ("off", "blocks")}
    outs = fp32["blocks"][1]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])  # policy, old, reference
    out_error, grad_error = run_errors(fp32["off"], fp32["blocks"])
    assert out_error < 1e-5 and grad_error < 1e-4, (out_error, grad_error)


@pytest.mark.slow
def test_compiled_replay_with_grad_equals_the_update_forward(tiny_models):
    """Why Flow-DPPO's old-log-prob replay runs with grad under --compile blocks: a compiled block has a no-grad
    graph and a training graph, which may round bf16 differently; the replay (outputs detached) through the training
    graph gives the update's forward bit for bit, so the first update's ratio is exactly 1."""
    from models import load_model

    path = os.path.join(tiny_models, "qwen_image")
    prompt = load_model(path).encode_prompt(["a sign that says 'hello'"]).index([0, 0])
    model = load_model(path, device="cpu", dtype=torch.bfloat16, transformer_only=True)
    model.dtype = torch.float32
    torch.manual_seed(1)
    add_lora_adapters(model.transformer, target_modules=model.default_lora_targets, rank=4, alpha=8.0,
                      block_prefixes=model.lora_block_prefixes)
    with torch.no_grad():
        for key, p in adapter_params(model.transformer, "default"):
            if ".lora_B." in key:
                p.normal_(0, 0.05)
    apply_activation_checkpointing(model.transformer, model.lora_block_prefixes)
    shard_transformer(model.transformer, model.lora_block_prefixes, mp_policy=bf16_policy(), device="cpu",
                      fsdp="auto")
    compile_blocks(model.transformer, model.lora_block_prefixes)
    x = model.prepare_noise(64, 64, [torch.Generator().manual_seed(s) for s in (1, 2)])
    forward = lambda: model.predict_velocity(x, torch.tensor([0.9, 0.4]), prompt, height=64, width=64)  # noqa
    with torch.enable_grad():
        replayed = forward().detach()
    update = forward()
    assert update.requires_grad and torch.equal(replayed, update.detach())


def test_one_rank_placement_refuses_what_it_cannot_reproduce():
    """An fp32 base under a bf16 policy (FSDP2 would cast it every forward) is refused with the flags to use; a
    bad mode is refused; with no compute dtype (fp32 training) the model is only placed."""
    model = tiny(torch.float32, shard=False)
    with pytest.raises(ValueError, match="base_weights_dtype compute"):
        shard_transformer(model, BLOCK_PREFIXES, mp_policy=bf16_policy(), device="cpu", fsdp="auto")
    with pytest.raises(ValueError, match="--fsdp must be one of"):
        shard_transformer(tiny(torch.bfloat16, shard=False), BLOCK_PREFIXES, fsdp="never")
    plain = tiny(torch.float32, shard=False)
    placed = tiny(torch.float32, shard=False)
    shard_transformer(placed, BLOCK_PREFIXES, device="cpu", fsdp="auto")
    x = torch.randn(2, 5, 4)
    assert torch.equal(plain(x), placed(x)) and type(placed) is TinyFlowTransformer


# ---------------------------------------------------------------------------------------------------------------
# selective activation checkpointing
# ---------------------------------------------------------------------------------------------------------------


def test_selective_checkpointing_chooses_evenly_and_keeps_gradients():
    assert checkpointed_block_indices(4) == [0, 1, 2, 3]
    assert checkpointed_block_indices(46, 0) == []
    assert checkpointed_block_indices(6, 3) == [1, 3, 5]
    assert len(checkpointed_block_indices(46, 23)) == 23 and len(checkpointed_block_indices(60, 7)) == 7
    with pytest.raises(ValueError, match="activation_checkpointing_blocks"):
        checkpointed_block_indices(3, 4)
    plain, partial = tiny(torch.float32, shard=False), tiny(torch.float32, shard=False, checkpoint_blocks=2)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in partial.named_parameters()]
    x = torch.randn(2, 5, 4)
    plain(x).pow(2).mean().backward()
    partial(x).pow(2).mean().backward()
    for (n, p), (_, q) in zip(adapter_params(plain, "default"), adapter_params(partial, "default")):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)


# ---------------------------------------------------------------------------------------------------------------
# the rollout's transition means (Flow-DPPO bypass)
# ---------------------------------------------------------------------------------------------------------------


def test_rollout_returns_the_transition_means_the_replay_computes(tiny_models):
    import losses
    import rollout

    engine = rollout.NativeEngine(os.path.join(tiny_models, "qwen_image"), max_batch_size=4)
    request = rollout.RolloutRequest(
        prompts=["a sign that says 'open'", "a red kite"] * 2, negative_prompts=[" "] * 4,
        seeds=[rollout.row_seed(7, 1, i) for i in range(4)], num_inference_steps=4, height=32, width=32,
        cfg_scale=3.0, noise_level=1.0, sde_window_size=2, sde_window_range=(0, 3), return_log_probs=True,
        return_trajectory=True)
    result = engine.generate(request)
    assert result.all_means.dtype == torch.float32 and result.all_means.shape == result.all_latents[:, 1:].shape
    model, cond = engine.model, result.conditioning("cpu")
    sigmas = result.metadata["sigmas"]
    for j in range(2):
        sigma, sigma_next = losses.sigmas_at_timesteps(result.all_timesteps[:, j], sigmas)
        with torch.no_grad():
            v = model.guided_velocity(result.all_latents[:, j], sigma, cond.prompt, cond.negative, 3.0,
                                      height=32, width=32)
        replay = losses.sde_step(result.all_latents[:, j], v, sigma, sigma_next, noise_level=1.0,
                                 sigma_max=sigmas[1], prev_sample=result.all_latents[:, j + 1])
        torch.testing.assert_close(result.all_means[:, j], replay.prev_sample_mean, rtol=0, atol=1e-6)
        torch.testing.assert_close(result.all_log_probs[:, j], replay.log_prob, rtol=0, atol=1e-5)
    # carried through select / cat like the other per-sample tensors
    joined = rollout.RolloutResult.cat([result.select([2, 3]), result.select([0, 1])])
    assert torch.equal(joined.all_means, result.all_means[[2, 3, 0, 1]])


# ---------------------------------------------------------------------------------------------------------------
# FLOP models, MFU and memory metrics
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen_image", "boogu_image_base", "boogu_image_edit"])
def test_forward_flops_equal_torch_flop_counter(tiny_models, name):
    """The config-derived FLOP model equals torch.utils.flop_counter's count of a real forward (SDPA on the math
    kernel so that attention matmuls are counted too), for T2I and edit (reference tokens)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from models import load_model

    model = load_model(os.path.join(tiny_models, name))
    prompt = model.encode_prompt(["a sign that says 'hello'"]).index([0, 0])  # equal lengths: no padding
    x = model.prepare_noise(64, 64, [torch.Generator().manual_seed(s) for s in (1, 2)])
    kw, refs = {}, None
    if name == "boogu_image_edit":
        image = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        kw["ref_latents"] = model.encode_reference([image, image], [torch.Generator().manual_seed(s) for s in (5, 6)])
        h, w = kw["ref_latents"].shape[-2:]
        refs = [[(h // 2) * (w // 2)]] * 2
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.predict_velocity(x, torch.tensor([0.7, 0.3]), prompt, height=64, width=64, **kw)
    text = prompt.mask.sum(dim=1).tolist()
    assert model.forward_flops(16, text, refs) == counter.get_total_flops()


def test_qwen_flops_reproduce_the_published_worked_numbers():
    """rewards_data_anchors.md §4.3 (released Qwen-Image, per image and timestep, forward + backward = 3x): 47.0
    TFLOP at 512² with 64 text tokens, 55.9 with 256, 207.9 at 1024² with 64."""
    from models.qwen_image import qwen_image_forward_flops

    config = SimpleNamespace(num_layers=60, num_attention_heads=24, attention_head_dim=128, in_channels=64,
                             out_channels=16, patch_size=2, joint_attention_dim=3584)
    for image_tokens, text_tokens, tflop in ((1024, 64, 47.0), (1024, 256, 55.9), (4096, 64, 207.9)):
        got = 3 * qwen_image_forward_flops(config, image_tokens, [text_tokens]) / 1e12
        assert got == pytest.approx(tflop, abs=0.06)


def test_transformer_flops_mfu_and_device_counts(monkeypatch):
    from models.base import Conditioning, PromptEmbeds

    calls = []
    model = SimpleNamespace(forward_flops=lambda n_img, text, refs: calls.append((n_img, text, refs)) or 1e12)
    cond = Conditioning(PromptEmbeds(torch.zeros(2, 5, 3), torch.tensor([[1, 1, 1, 0, 0], [1] * 5])),
                        PromptEmbeds(torch.zeros(2, 2, 3), torch.ones(2, 2)), torch.zeros(2, 16, 8, 6))
    assert transformer_flops(model, cond, height=512, width=256, guided=True) == 2e12
    assert calls == [(512, [3, 5], [[12], [12]]), (512, [2, 2], [[12], [12]])]
    assert transformer_flops(model, cond, height=512, width=256, guided=False) == 1e12
    timings = {"timing_s/gen": 2.0, "timing_s/update_actor": 4.0}
    phases = {"gen": (8e12, 2), "old_log_prob": (1e12, 1), "update_actor": (6e12, 1)}
    monkeypatch.delenv(PEAK_TFLOPS_ENV, raising=False)
    assert phase_perf_metrics(timings, phases, "cpu") == {"perf/tflop/gen": 8.0, "perf/tflop/update_actor": 6.0}
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "1")  # 1 TFLOP/s
    metrics = phase_perf_metrics(timings, phases, "cpu")
    assert metrics["perf/mfu/gen"] == pytest.approx(8 / (2 * 2)) and metrics["perf/mfu/update_actor"] == 1.5
    assert "perf/mfu/old_log_prob" not in metrics  # no timing: the phase did not run (bypass)
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "fast")
    with pytest.raises(ValueError, match=PEAK_TFLOPS_ENV):
        device_peak_flops("cpu")
    assert rollout_device_count("colocated") == 1 and rollout_device_count("cuda:2,cuda:3") == 2


def test_each_trainers_perf_call_counts_its_forwards(monkeypatch):
    """The one perf call of each trainer, against hand-counted phase FLOPs: 2 local rows of 1 TFLOP per (conditional)
    forward, so a guided call is 2; 10 rollout steps on 2 rollout devices; NFT K=3 timesteps x (policy fwd+bwd 3 +
    old 1 + reference 1) x 2 epochs at its training CFG; DPPO W=2 stored steps: one replay each, then fwd+bwd x 2."""
    from models.base import Conditioning, PromptEmbeds

    calls = []
    model = SimpleNamespace(forward_flops=lambda n_img, text, refs: calls.append(n_img) or 1e12)
    cond = Conditioning(PromptEmbeds(torch.zeros(2, 5, 3), torch.ones(2, 5)),
                        PromptEmbeds(torch.zeros(2, 2, 3), torch.ones(2, 2)), None)
    args = SimpleNamespace(height=64, width=64, num_inference_steps=10, rollout_devices="cuda:2,cuda:3",
                           ppo_epochs=2, ref_kl_coef=0.1)
    run = SimpleNamespace(model=model, args=args, cfg_scale=4.0, device="cpu")
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "1")
    timings = {"timing_s/gen": 10.0, "timing_s/old_log_prob": 1.0, "timing_s/update_actor": 6.0}
    nft = T.nft_perf_metrics(run, cond, timings, num_k=3, train_scale=1.0)
    assert nft["perf/tflop/gen"] == 2 * 10 and nft["perf/mfu/gen"] == pytest.approx(20 / (10 * 2))
    assert nft["perf/tflop/update_actor"] == 1 * 3 * (3 + 1 + 1) * 2  # CFG-free training forwards: 1 per call
    assert "perf/tflop/old_log_prob" not in nft
    args.ref_kl_coef = 0.0
    assert T.nft_perf_metrics(run, cond, timings, num_k=3, train_scale=4.0)["perf/tflop/update_actor"] == \
        2 * 3 * (3 + 1) * 2  # guided training forwards, no reference
    calls.clear()
    dppo = T.dppo_perf_metrics(run, cond, timings, num_w=2)
    assert len(calls) == 2  # one guided velocity call's FLOP model (cond + uncond) for every phase of the step
    assert dppo["perf/tflop/gen"] == 20 and dppo["perf/tflop/old_log_prob"] == 2 * 2
    assert dppo["perf/tflop/update_actor"] == 2 * 2 * 3 * 2 and dppo["perf/mfu/update_actor"] == pytest.approx(4.0)
    assert T.dppo_perf_metrics(run, cond, timings, num_w=2, old_fraction=0.5)["perf/tflop/old_log_prob"] == 2
    args.ref_kl_coef = 0.1  # NFT with the old forward left out in a quarter of the sample passes
    assert T.nft_perf_metrics(run, cond, timings, num_k=3, train_scale=1.0, old_fraction=0.75)[
        "perf/tflop/update_actor"] == 1 * 3 * (3 + 0.75 + 1) * 2
    run.cfg_scale = 1.0  # an unguided run: one forward per call everywhere
    assert T.dppo_perf_metrics(run, cond, timings, num_w=2)["perf/tflop/gen"] == 10


# ---------------------------------------------------------------------------------------------------------------
# DiffusionNFT: CFG of the training forwards, verl-omni's Qwen default; DPPO bypass flag
# ---------------------------------------------------------------------------------------------------------------


def test_nft_training_cfg_flag_and_qwen_default():
    import train_dppo
    import train_nft

    base = ["--model_path", "m", "--train_files", "t.parquet"]
    nft, defaults = train_nft.parse_args(base), train_nft.CFG_SCALE_DEFAULTS
    assert nft.train_cfg == "rollout"  # default: today's behaviour (training forwards guided like the rollout)
    assert train_nft.parse_args(base + ["--train_cfg", "off"]).train_cfg == "off"
    assert not hasattr(nft, "cfg_scale")  # resolved once, by setup_run (preflight), never at parse time
    nft_scale = lambda family, args: resolve_cfg_scale(family, args, defaults.get(family))  # noqa: E731
    assert nft_scale("qwen_image", nft) == 1.0  # verl-omni's Qwen-Image NFT recipe: true_cfg_scale = 1.0
    assert nft_scale("boogu_image", nft) == 4.0  # Boogu keeps its released guidance_scale
    assert nft_scale("qwen_image", train_nft.parse_args(base + ["--true_cfg_scale", "3"])) == 3.0
    dppo = train_dppo.parse_args(base)
    assert resolve_cfg_scale("qwen_image", dppo) == 4.0 and dppo.old_log_probs == "recompute"
    with pytest.raises(ValueError, match="guided by true_cfg_scale"):  # the other family's flag is refused
        resolve_cfg_scale("qwen_image", train_dppo.parse_args(base + ["--guidance_scale", "3"]))
    with pytest.raises(SystemExit):
        train_nft.parse_args(base + ["--train_cfg", "half"])


# ---------------------------------------------------------------------------------------------------------------
# loss metrics kept on the device: no host sync per loss call, the non-finite check read once per optimizer step
# ---------------------------------------------------------------------------------------------------------------


def _loss_calls(nan: bool = False):
    """(name, loss function, args, kwargs) of the three objectives on random inputs (one NaN input with `nan`)."""
    import losses

    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    v, v_old, x0, xt = r(3, 4, 5).requires_grad_(), r(3, 4, 5), r(3, 4, 5), r(3, 4, 5)
    logp, old_logp, adv = (r(3) * 0.01).requires_grad_(), r(3) * 0.01, r(3)
    mean, old_mean = r(3, 4, 5).requires_grad_(), r(3, 4, 5)
    if nan:
        v_old[1, 2, 3], old_logp[0], old_mean[2, 0, 0] = float("nan"), float("nan"), float("nan")
    return [
        ("nft", losses.diffusion_nft_loss, (v, v_old, x0, xt, torch.rand(3, generator=g), torch.rand(3, generator=g)),
         dict(mix_beta=0.1, adv_clip_max=1.0, ref_prediction=r(3, 4, 5), ref_kl_coef=0.5)),
        ("dppo", losses.flow_dppo_loss, (logp, old_logp, adv, mean, old_mean, torch.rand(3, generator=g) + 0.5,
                                         torch.rand(3, generator=g) + 0.1), dict(kl_mask_threshold=1e-3)),
        ("grpo", losses.flow_grpo_loss, (logp, old_logp, adv), dict(clip_ratio=1e-2)),
    ]


@pytest.mark.parametrize("script", ["train_nft", "train_dppo"])
def test_each_trainer_hands_its_cfg_defaults_to_setup_run(monkeypatch, script):
    """What the preflight resolves the CFG scale with: train_nft.py's visible Qwen-Image default (verl-omni's NFT
    recipe: no CFG), none for train_dppo.py (the model's 4.0)."""
    import importlib

    trainer, seen = importlib.import_module(script), {}

    class Stop(Exception):
        pass

    def setup_run(args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(T, "setup_run", setup_run)
    with pytest.raises(Stop):
        trainer.main(["--model_path", "m", "--train_files", "t.parquet"])
    assert seen.get("cfg_defaults") == ({"qwen_image": 1.0} if script == "train_nft" else None)


def test_loss_metrics_are_detached_device_tensors_that_log_as_their_values():
    """Each loss returns its metrics as 0-dim detached tensors on the inputs' device; summed over calls by
    MetricAccumulator (float64) the logged means equal those of the same values read to floats, bit for bit."""
    for name, fn, args, kwargs in _loss_calls():
        tensor_acc, float_acc = T.MetricAccumulator(), T.MetricAccumulator()
        for scale in (1.0, 0.5, 2.0):  # three calls, as over micro-batches x timesteps
            scaled = [a * scale if a.dtype.is_floating_point and a.ndim == 3 else a for a in args]
            loss, metrics = fn(*scaled, **kwargs)
            assert loss.ndim == 0 and loss.requires_grad, name
            assert all(isinstance(x, torch.Tensor) and x.ndim == 0 and not x.requires_grad
                       and x.device == args[0].device for x in metrics.values()), name
            tensor_acc.add(metrics)
            float_acc.add({k: float(x) for k, x in metrics.items()})
        assert tensor_acc.reduce() == float_acc.reduce(), name


def test_losses_and_the_backward_read_nothing_on_the_host(monkeypatch):
    """No loss and no `GradStepper.backward` reads a tensor on the host (`.item()`, bool(), float(), .tolist() all
    raise here; the last line shows the guard trips on a read); `step` reads its checks at once: one read for a
    skipped step."""
    calls = _loss_calls(nan=True)
    reads = []

    def forbidden(self, *a, **k):
        reads.append(1)
        raise AssertionError("host read of a tensor")

    for method in ("item", "__bool__", "__float__", "tolist"):
        monkeypatch.setattr(torch.Tensor, method, forbidden)
    stepper = GradStepper()
    for name, fn, args, kwargs in calls:
        loss, _ = fn(*args, **kwargs)
        stepper.backward(loss)
    assert not reads
    with pytest.raises(AssertionError, match="host read"):
        float(loss)
    monkeypatch.undo()
    counted = []
    for method in ("item", "__bool__", "__float__", "tolist"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, _f=original, _m=method, **k: (
            counted.append(_m), _f(self, *a, **k))[1])
    leaves = {id(a): a for _, _, args, _ in calls for a in args if a.requires_grad}
    m = stepper.step(torch.optim.AdamW(list(leaves.values())))
    assert m["actor/step_skipped"] == 1.0 and stepper.last_skip_reason == "non-finite loss" and counted == ["tolist"]


def test_a_nonfinite_loss_skips_the_step_once_read_by_the_stepper():
    """A NaN input makes each loss NaN, which is returned (not raised); `GradStepper.backward` flags it and `step`
    skips the step ("non-finite loss", the weight unchanged). The flag is cleared by the step: a finite loss after
    it is applied."""
    for name, fn, args, kwargs in _loss_calls(nan=True):
        weight = torch.nn.Parameter(torch.ones(()))
        opt = torch.optim.AdamW([weight], lr=0.1)
        stepper = GradStepper()
        loss, _ = fn(*args, **kwargs)
        assert not torch.isfinite(loss), name
        stepper.backward(loss * weight)
        m = stepper.step(opt)
        assert m["actor/step_skipped"] == 1.0 and weight.item() == 1.0, name
        assert stepper.last_skip_reason == "non-finite loss", name
        ok_args = [torch.nan_to_num(a.detach()).requires_grad_(a.requires_grad) for a in args]
        loss, _ = fn(*ok_args, **kwargs)
        stepper.backward(loss * weight)
        assert stepper.step(opt)["actor/step_skipped"] == 0.0 and weight.item() != 1.0, name


@pytest.mark.slow  # two whole trainer runs under torchrun
@pytest.mark.parametrize("script", ["train_nft.py", "train_dppo.py"])
def test_trainers_log_the_same_metrics_on_the_old_and_the_fast_update_paths(tiny_models, tmp_path, script):
    """A tiny CPU run (one rank, 2 steps, two micro-batches; DPPO: two mini-batches and two epochs so the ratio
    leaves 1; NFT: `old` equal to the policy in step 1 only, an EMA of it in step 2) on the old path
    (--old_from_update off: a separate old forward / old log-prob pass for every sample) and on the default (the
    first mini-batch's old outputs from its own update forward): every logged actor/*, critic/* and rollout_corr/*
    value is bit-identical."""
    from data_prep.make_demo_data import make_demo_data
    from trainer_runs import run_trainer, scalars

    family = "boogu_image" if script == "train_nft.py" else "qwen_image"
    data = tmp_path / "data"
    make_demo_data(data, model=family)
    model = os.path.join(tiny_models, "boogu_image_base" if family == "boogu_image" else "qwen_image")
    common = ["--model_path", model, "--train_files", data / "train.parquet", "--device", "cpu", "--rollout_devices",
              "cpu", "--rollout_threads", "1", "--height", "64", "--width", "64", "--num_inference_steps", "4",
              "--lora_rank", "4", "--lora_alpha", "8", "--resume", "never", "--save_freq", "100",
              "--train_batch_size", "2", "--rollout_n", "2", "--micro_batch_size", "2", "--total_training_steps", "2",
              "--lr", "1e-2"]
    common += (["--ref_kl_coef", "0.1", "--old_policy_decay_schedule", "linear_to_0_5"] if script == "train_nft.py"
               else ["--ppo_epochs", "2", "--ppo_mini_batch_size", "1", "--sde_window_size", "2",
                     "--sde_window_range", "0,3"])
    logged, timed = {}, {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        run_trainer(script, common + ["--old_from_update", mode, "--output_dir", out], nproc=1)
        m = scalars(out)
        logged[mode] = {k: v for k, v in m.items() if k.startswith(("actor/", "critic/", "rollout_corr/"))}
        timed[mode] = m.get("perf/tflop/old_log_prob" if script == "train_dppo.py" else "perf/tflop/update_actor")
    assert "actor/grad_norm" in logged["on"] and len(logged["on"]) > 8
    assert logged["off"] == logged["on"]
    # the forwards left out are not counted: DPPO replays 1 of its 2 mini-batches; NFT skips the old forward in
    # step 1 (a third of its 1 + 3 + 1 forwards per sample pass, `old` = the policy) and runs it in step 2
    (_, old_all), (_, old_fast) = timed["off"][0], timed["on"][0]
    if script == "train_dppo.py":
        assert old_fast == pytest.approx(old_all / 2)
    else:
        assert old_fast == pytest.approx(old_all * 4 / 5) and timed["on"][1][1] == timed["off"][1][1]
