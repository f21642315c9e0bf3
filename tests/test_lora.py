"""LoRA: target binding, name translation, export/import round trips with non-zero B, diffusers compatibility."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from models import load_model
from models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    apply_lora,
    copy_adapter_,
    export_adapter,
    from_engine_name,
    import_adapter,
    lora_disabled,
    lora_layers,
    set_active_adapter,
    to_engine_name,
    to_engine_targets,
    validate_lora_targets,
)
from models.boogu_image import BooguImageModel
from models.boogu_image_transformer import BooguImageTransformer2DModel
from models.qwen_image import QwenImageModel

# one pytest-xdist worker runs this module (pytest.ini: --dist loadgroup): its module fixtures are costly
pytestmark = pytest.mark.xdist_group("test_lora")

BOOGU_TARGETS = BooguImageModel.default_lora_targets
BOOGU_BLOCKS = BooguImageModel.lora_block_prefixes


def randomize_lora_(module, adapter="default", seed=0):
    """Non-zero A and B (zero-initialised B would hide binding bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(module, adapter).values():
            for w in (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight):
                w.copy_(torch.randn(w.shape, generator=g) * 0.5)


# ---------------------------------------------------------------------------------------------------------------
# Qwen-Image fixtures
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_dir(tiny_models):
    return os.path.join(tiny_models, "qwen_image")


@pytest.fixture(scope="module")
def qwen(qwen_dir) -> QwenImageModel:
    return load_model(qwen_dir)


@pytest.fixture(scope="module")
def qwen_inputs(qwen):
    pe = qwen.encode_prompt(["a red sign", "x"])
    x = qwen.prepare_noise(32, 32, [torch.Generator().manual_seed(s) for s in (1, 2)])
    return x, torch.tensor([0.7, 0.3]), pe


@pytest.fixture(scope="module")
def boogu_dir(tiny_models):
    return os.path.join(tiny_models, "boogu_image_base")


@pytest.fixture(scope="module")
def boogu(boogu_dir) -> BooguImageModel:
    return load_model(boogu_dir)


@pytest.fixture(scope="module")
def boogu_inputs(boogu):
    pe = boogu.encode_prompt(["a red sign", ""])
    x = boogu.prepare_noise(32, 32, [torch.Generator().manual_seed(s) for s in (1, 2)])
    return x, torch.tensor([0.7, 0.3]), pe


def fresh_boogu_transformer(boogu_dir):
    return BooguImageTransformer2DModel.from_pretrained(boogu_dir, subfolder="transformer").eval()


def boogu_velocity(boogu, transformer, inputs):
    """The wrapper's velocity with `transformer` swapped in (the wrapper owns the Boogu conventions)."""
    x, sig, pe = inputs
    saved = boogu.transformer
    boogu.transformer = transformer
    try:
        with torch.no_grad():
            return boogu.predict_velocity(x, sig, pe)
    finally:
        boogu.transformer = saved


def fresh_qwen_transformer(qwen_dir):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(qwen_dir, subfolder="transformer").eval()


def run_transformer(transformer, inputs):
    x, sig, pe = inputs
    with torch.no_grad():
        return transformer(hidden_states=x, encoder_hidden_states=pe.embeds, encoder_hidden_states_mask=pe.mask,
                           timestep=sig, img_shapes=[[(1, 2, 2)]] * x.shape[0], return_dict=False)[0]


# ---------------------------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------------------------


def test_qwen_default_targets_bind_inside_blocks(qwen_dir):
    t = fresh_qwen_transformer(qwen_dir)
    bound = validate_lora_targets(t, QwenImageModel.default_lora_targets, QwenImageModel.lora_block_prefixes)
    n_layers = t.config.num_layers
    assert len(QwenImageModel.default_lora_targets) == 12
    assert len(bound) == 12 * n_layers
    assert all(b.startswith("transformer_blocks.") for b in bound)


def test_boogu_recipe_targets_bind_44_paths(boogu_dir):
    m = fresh_boogu_transformer(boogu_dir)
    assert (m.config.num_layers, m.config.num_double_stream_layers, m.config.num_refiner_layers) == (2, 1, 1)
    bound = validate_lora_targets(m, BOOGU_TARGETS, BOOGU_BLOCKS)
    assert len(BOOGU_TARGETS) == 18
    assert len(bound) == 44  # the full rule binds all 44 module paths of a 1/1/1 tiny model
    # PEFT's "." boundary: feed_forward.linear_1 does not catch img_feed_forward.linear_1, nor the embedder MLP
    assert "double_stream_layers.0.instruct_feed_forward.linear_1" not in bound
    assert not any(b.startswith("time_caption_embed") for b in bound)


def test_unbound_target_raises(qwen_dir):
    t = fresh_qwen_transformer(qwen_dir)
    with pytest.raises(ValueError, match="bind no module"):
        validate_lora_targets(t, ["to_q", "to_qkv"], QwenImageModel.lora_block_prefixes)
    with pytest.raises(ValueError, match="non-Linear"):
        validate_lora_targets(t, ["to_out"], QwenImageModel.lora_block_prefixes)


@pytest.mark.parametrize("target", ["img_in", "proj_out", "linear_1"])
def test_top_level_target_raises_qwen(qwen_dir, target):
    t = fresh_qwen_transformer(qwen_dir)
    with pytest.raises(ValueError, match="outside the transformer blocks"):
        validate_lora_targets(t, ["to_q", target], QwenImageModel.lora_block_prefixes)


@pytest.mark.parametrize("target", ["x_embedder", "linear_1", "caption_embedder.1", "norm_out.linear_2"])
def test_top_level_target_raises_boogu(boogu_dir, target):
    with pytest.raises(ValueError, match="outside the transformer blocks"):
        validate_lora_targets(fresh_boogu_transformer(boogu_dir), [target], BOOGU_BLOCKS)


def test_apply_lora_two_adapters_and_switching(qwen_dir, qwen_inputs):
    t = fresh_qwen_transformer(qwen_dir)
    base = run_transformer(t, qwen_inputs)
    n = apply_lora(t, QwenImageModel.default_lora_targets, rank=4, alpha=8,
                   block_prefixes=QwenImageModel.lora_block_prefixes, adapter_names=("default", "old"))
    assert n == 12 * t.config.num_layers
    trainable = {k for k, p in t.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in k and ".default." in k for k in trainable)
    # zero-init B: no effect yet; randomised B: a measurable change
    torch.testing.assert_close(run_transformer(t, qwen_inputs), base)
    randomize_lora_(t, "default", seed=1)
    with_default = run_transformer(t, qwen_inputs)
    assert (with_default - base).abs().max() > 1e-2
    with lora_disabled(t):
        torch.testing.assert_close(run_transformer(t, qwen_inputs), base)
    set_active_adapter(t, "old")  # old still has B = 0
    torch.testing.assert_close(run_transformer(t, qwen_inputs), base)
    assert {k for k, p in t.named_parameters() if p.requires_grad} == trainable  # switching keeps grad flags
    assert copy_adapter_(t, "default", "old") == n
    torch.testing.assert_close(run_transformer(t, qwen_inputs), with_default)


def test_fast_adapter_switch_leaves_the_state_peft_leaves(qwen_dir, qwen_inputs):
    """`set_active_adapter` sets the cached layers' active adapter directly (no module walk): every layer ends in
    peft's own `set_adapter` state (active adapters) with the requires_grad flags untouched, the outputs follow the
    switch, and LoRA layers injected later (a new adapter) are picked up, not served from a stale cache."""
    t = fresh_qwen_transformer(qwen_dir)
    apply_lora(t, QwenImageModel.default_lora_targets, rank=4, alpha=8,
               block_prefixes=QwenImageModel.lora_block_prefixes, adapter_names=("default", "old"))
    randomize_lora_(t, "default", seed=1)
    randomize_lora_(t, "old", seed=2)
    reference = copy.deepcopy(t)
    flags = {k: p.requires_grad for k, p in t.named_parameters()}
    for name in ("old", "default", "old"):
        set_active_adapter(t, name)
        for layer in lora_layers(reference).values():
            layer.set_adapter(name)  # peft's switch (it also flips requires_grad; only the active list is compared)
        ours, theirs = lora_layers(t), lora_layers(reference)
        assert all(ours[k].active_adapters == theirs[k].active_adapters == [name] for k in ours)
        assert {k: p.requires_grad for k, p in t.named_parameters()} == flags
        torch.testing.assert_close(run_transformer(t, qwen_inputs), run_transformer(reference, qwen_inputs),
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match="adapter 'third' is missing on 24 LoRA layers"):
        set_active_adapter(t, "third")
    apply_lora(t, QwenImageModel.default_lora_targets, rank=4, alpha=8,
               block_prefixes=QwenImageModel.lora_block_prefixes, adapter_names=("third",))
    set_active_adapter(t, "third")  # the cache was cleared by the injection
    assert all(layer.active_adapters == ["third"] for layer in lora_layers(t).values())
    plain = fresh_qwen_transformer(qwen_dir)  # no LoRA: disabling is a no-op (evaluate.py's base), switching is not
    with lora_disabled(plain):
        pass
    with pytest.raises(ValueError, match="no LoRA layers"):
        set_active_adapter(plain, "default")


# ---------------------------------------------------------------------------------------------------------------
# Translation
# ---------------------------------------------------------------------------------------------------------------


def test_translation_examples_and_inverse():
    cases = {
        "double_stream_layers.0.img_instruct_attn.processor.img_to_q.lora_A.weight":
            "double_stream_layers.0.img_instruct_attn.img_to_q.lora_A.weight",
        "double_stream_layers.3.img_instruct_attn.processor.instruct_out":
            "double_stream_layers.3.img_instruct_attn.instruct_out",
        "double_stream_layers.0.img_instruct_attn.to_out.0.lora_B.weight":
            "double_stream_layers.0.img_instruct_attn.to_out.lora_B.weight",
        "single_stream_layers.2.attn.to_out.0": "single_stream_layers.2.attn.to_out",
        "transformer_blocks.1.attn.to_add_out.lora_A.weight": "transformer_blocks.1.attn.to_add_out.lora_A.weight",
        "transformer_blocks.1.img_mlp.net.0.proj": "transformer_blocks.1.img_mlp.net.0.proj",
        "norm_out.linear_1": "norm_out.linear_1",
    }
    for trainer, engine in cases.items():
        assert to_engine_name(trainer) == engine
        assert from_engine_name(engine) == trainer
    assert to_engine_targets(BOOGU_TARGETS) == [("to_out" if t == "to_out.0" else t) for t in BOOGU_TARGETS]


def _engine_module_ok(path: str) -> bool:
    """Whether `path` names a LoRA-wrappable layer of the vllm-omni port (A.10 / B.6): plain layers keep their
    names, q/k/v (and gate/up) bind as packed sub-names, the joint projections sit directly on img_instruct_attn,
    output projections are `to_out` (no `.0`) and nothing carries `.processor.`."""
    if ".processor." in path or path.endswith("to_out.0") or ".to_out.0." in path:
        return False
    parts = path.split(".")
    if parts[-2] == "img_instruct_attn":
        return parts[-1] in ("img_to_q", "img_to_k", "img_to_v", "instruct_to_q", "instruct_to_k",
                             "instruct_to_v", "img_out", "instruct_out", "to_out")
    return parts[-1] in ("to_q", "to_k", "to_v", "to_out", "linear_1", "linear_2", "linear_3", "add_q_proj",
                         "add_k_proj", "add_v_proj", "to_add_out", "proj", "2")


def _exported_keys(d):
    from safetensors import safe_open

    with safe_open(os.path.join(d, ADAPTER_WEIGHTS), "pt") as f:
        return list(f.keys())


def test_boogu_export_engine_names_maps_every_key(boogu_dir, tmp_path):
    m = fresh_boogu_transformer(boogu_dir)
    n = apply_lora(m, BOOGU_TARGETS, rank=2, alpha=4, block_prefixes=BOOGU_BLOCKS)
    assert export_adapter(m, tmp_path / "eng", engine_names=True) == n == 44
    keys = _exported_keys(tmp_path / "eng")
    assert len(keys) == 88
    for k in keys:
        assert k.startswith("transformer.")
        path = k[len("transformer."):].rsplit(".lora_", 1)[0]
        assert _engine_module_ok(path), k
    cfg = json.loads((tmp_path / "eng" / ADAPTER_CONFIG).read_text())
    assert "to_out" in cfg["target_modules"] and "to_out.0" not in cfg["target_modules"]
    assert not any("processor" in t for t in cfg["target_modules"])
    joint = [k for k in keys if ".img_instruct_attn." in k]
    assert len(joint) == 2 * 9  # 8 joint projections + to_out, A and B each


def test_qwen_export_engine_names_maps_every_key(qwen_dir, tmp_path):
    t = fresh_qwen_transformer(qwen_dir)
    apply_lora(t, QwenImageModel.default_lora_targets, rank=2, alpha=2,
               block_prefixes=QwenImageModel.lora_block_prefixes)
    export_adapter(t, tmp_path / "eng", engine_names=True)
    keys = _exported_keys(tmp_path / "eng")
    assert len(keys) == 2 * 12 * t.config.num_layers
    assert all(_engine_module_ok(k[len("transformer."):].rsplit(".lora_", 1)[0]) for k in keys)
    assert sum(".attn.to_out.lora_" in k for k in keys) == 2 * t.config.num_layers


# ---------------------------------------------------------------------------------------------------------------
# Export / import
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_qwen(qwen_dir, qwen_inputs):
    """A Qwen transformer with a non-zero LoRA (rank 4, alpha 8: scaling 2) and its base/LoRA outputs."""
    t = fresh_qwen_transformer(qwen_dir)
    base = run_transformer(t, qwen_inputs)
    apply_lora(t, QwenImageModel.default_lora_targets, rank=4, alpha=8,
               block_prefixes=QwenImageModel.lora_block_prefixes)
    randomize_lora_(t, seed=3)
    out = run_transformer(t, qwen_inputs)
    assert (out - base).abs().max() > 1e-2  # the adapter changes the output measurably
    return t, base, out


@pytest.mark.parametrize("engine_names", [False, True])
@pytest.mark.parametrize("key_prefix", ["transformer.", "base_model.model."])
def test_export_import_round_trip_qwen(qwen_dir, qwen_inputs, trained_qwen, tmp_path, engine_names, key_prefix):
    t, base, out = trained_qwen
    d = tmp_path / "adapter"
    n = export_adapter(t, d, engine_names=engine_names, key_prefix=key_prefix)
    assert sorted(os.listdir(d)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    cfg = json.loads((d / ADAPTER_CONFIG).read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and cfg["peft_type"] == "LORA"
    fresh = fresh_qwen_transformer(qwen_dir)
    assert import_adapter(fresh, d, block_prefixes=QwenImageModel.lora_block_prefixes) == n
    torch.testing.assert_close(run_transformer(fresh, qwen_inputs), out, rtol=1e-5, atol=1e-6)


def test_export_import_round_trip_boogu(boogu, boogu_dir, boogu_inputs, tmp_path):
    m = fresh_boogu_transformer(boogu_dir)
    base = boogu_velocity(boogu, m, boogu_inputs)
    apply_lora(m, BOOGU_TARGETS, rank=2, alpha=4, block_prefixes=BOOGU_BLOCKS)
    randomize_lora_(m, seed=4)
    out = boogu_velocity(boogu, m, boogu_inputs)
    assert (out - base).abs().max() > 1e-2  # the adapter changes the velocity measurably
    for engine_names in (False, True):
        d = tmp_path / f"a{int(engine_names)}"
        export_adapter(m, d, engine_names=engine_names)
        fresh = fresh_boogu_transformer(boogu_dir)
        assert import_adapter(fresh, d, block_prefixes=BOOGU_BLOCKS) == 44
        torch.testing.assert_close(boogu_velocity(boogu, fresh, boogu_inputs), out, rtol=1e-5, atol=1e-6)


def test_export_overwrites_atomically(trained_qwen, tmp_path):
    t, _, _ = trained_qwen
    d = tmp_path / "adapter"
    export_adapter(t, d)
    first = (d / ADAPTER_WEIGHTS).read_bytes()
    export_adapter(t, d, engine_names=True)
    assert (d / ADAPTER_WEIGHTS).read_bytes() != first
    assert sorted(os.listdir(tmp_path)) == ["adapter"]  # no temp dirs left behind


def test_import_unbindable_key_raises(qwen_dir, trained_qwen, tmp_path):
    from safetensors.torch import load_file, save_file

    t, _, _ = trained_qwen
    d = tmp_path / "adapter"
    export_adapter(t, d)
    sd = load_file(d / ADAPTER_WEIGHTS)
    sd["transformer.transformer_blocks.0.attn.to_qkv.lora_A.weight"] = torch.ones(4, 32)
    sd["transformer.transformer_blocks.0.attn.to_qkv.lora_B.weight"] = torch.ones(32, 4)
    save_file(sd, d / ADAPTER_WEIGHTS)
    with pytest.raises(ValueError, match="bind to no LoRA module"):
        import_adapter(fresh_qwen_transformer(qwen_dir), d, block_prefixes=QwenImageModel.lora_block_prefixes)


def test_import_missing_tensor_and_corrupt_files_raise(qwen_dir, trained_qwen, tmp_path):
    from safetensors.torch import load_file, save_file

    t, _, _ = trained_qwen
    d = tmp_path / "adapter"
    export_adapter(t, d)
    sd = load_file(d / ADAPTER_WEIGHTS)
    sd = {k: v for k, v in sd.items() if "transformer_blocks.1.attn.to_q." not in k}
    save_file(sd, d / ADAPTER_WEIGHTS)
    with pytest.raises(ValueError, match="get no tensor"):
        import_adapter(fresh_qwen_transformer(qwen_dir), d)
    (d / ADAPTER_CONFIG).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        import_adapter(fresh_qwen_transformer(qwen_dir), d)


def test_diffusers_load_lora_weights_reads_export(qwen_dir, qwen_inputs, trained_qwen, tmp_path):
    from diffusers import QwenImagePipeline

    t, base, out = trained_qwen
    d = tmp_path / "adapter"
    export_adapter(t, d)
    pipe = QwenImagePipeline.from_pretrained(qwen_dir, local_files_only=True)
    torch.testing.assert_close(run_transformer(pipe.transformer, qwen_inputs), base)
    pipe.load_lora_weights(str(d), weight_name=ADAPTER_WEIGHTS, adapter_name="rl")
    # same output as the trainer's adapter, so diffusers applied every module with the same alpha/r scaling
    torch.testing.assert_close(run_transformer(pipe.transformer, qwen_inputs), out, rtol=1e-5, atol=1e-6)


def test_flow_model_add_and_load_adapter(qwen_dir, trained_qwen, tmp_path):
    """The FlowModel conveniences: add_lora uses the wrapper's targets; load_adapter injects, then updates in place."""
    from models.lora import add_lora, load_adapter

    t, base, out = trained_qwen
    export_adapter(t, tmp_path / "v1", engine_names=True)
    m = load_model(qwen_dir)
    pe = m.encode_prompt(["a red sign", "x"])
    x = m.prepare_noise(32, 32, [torch.Generator().manual_seed(s) for s in (1, 2)])
    inputs = (x, torch.tensor([0.7, 0.3]), pe)
    assert load_adapter(m, str(tmp_path / "v1")) == 12 * t.config.num_layers
    torch.testing.assert_close(run_transformer(m.transformer, inputs), run_transformer(t, inputs), rtol=1e-5,
                               atol=1e-6)
    # a second version overwrites the same adapter in place
    t2 = copy.deepcopy(t)
    randomize_lora_(t2, seed=9)
    export_adapter(t2, tmp_path / "v2")
    load_adapter(m, str(tmp_path / "v2"))
    v2 = run_transformer(t2, inputs)
    assert (v2 - run_transformer(t, inputs)).abs().max() > 1e-2
    torch.testing.assert_close(run_transformer(m.transformer, inputs), v2, rtol=1e-5, atol=1e-6)
    m2 = load_model(qwen_dir)
    assert add_lora(m2, rank=2, alpha=2, adapter_names=("default", "old")) == 12 * t.config.num_layers


def test_peft_reads_base_model_prefix_export(qwen_dir, qwen_inputs, trained_qwen, tmp_path):
    """key_prefix="base_model.model." is PEFT's own saved form: PeftModel.from_pretrained binds it."""
    from peft import PeftModel

    t, _, out = trained_qwen
    export_adapter(t, tmp_path / "peft", key_prefix="base_model.model.")
    pm = PeftModel.from_pretrained(fresh_qwen_transformer(qwen_dir), str(tmp_path / "peft"))
    torch.testing.assert_close(run_transformer(pm.base_model.model, qwen_inputs), out, rtol=1e-5, atol=1e-6)


def test_import_scaling_mismatch_raises(qwen_dir, trained_qwen, tmp_path):
    t, _, _ = trained_qwen
    export_adapter(t, tmp_path / "a")
    other = fresh_qwen_transformer(qwen_dir)
    apply_lora(other, QwenImageModel.default_lora_targets, rank=4, alpha=4,  # alpha differs: scaling 1 vs 2
               block_prefixes=QwenImageModel.lora_block_prefixes)
    with pytest.raises(ValueError, match="scaling"):
        import_adapter(other, tmp_path / "a")


def test_export_gathers_fsdp2_sharded_adapter(tmp_path):
    """Under FSDP2 the LoRA weights are DTensors; export gathers full tensors (1-rank gloo group on CPU)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from models.lora import read_adapter

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.to_q = torch.nn.Linear(8, 8)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])
            self.proj_out = torch.nn.Linear(8, 8)

    assert not dist.is_initialized(), "another test left a default process group behind"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = Net()
        apply_lora(net, ["to_q"], rank=2, alpha=4, block_prefixes=("blocks",))
        randomize_lora_(net, seed=5)
        ref = {p: (l.lora_A["default"].weight.detach().clone(), l.lora_B["default"].weight.detach().clone())
               for p, l in lora_layers(net).items()}
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        w = lora_layers(net)["blocks.0.to_q"].lora_A["default"].weight
        assert type(w).__name__ == "DTensor"
        assert export_adapter(net, tmp_path / "a") == 2
        _, modules = read_adapter(str(tmp_path / "a"))
        assert sorted(modules) == sorted(ref)
        for p, (a, b) in ref.items():
            assert torch.equal(modules[p]["A"], a) and torch.equal(modules[p]["B"], b)
    finally:
        dist.destroy_process_group()


def test_import_half_pair_raises(qwen_dir, trained_qwen, tmp_path):
    from safetensors.torch import load_file, save_file

    t, _, _ = trained_qwen
    d = tmp_path / "adapter"
    export_adapter(t, d)
    sd = load_file(d / ADAPTER_WEIGHTS)
    del sd["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"]
    save_file(sd, d / ADAPTER_WEIGHTS)
    with pytest.raises(ValueError, match="lack lora_A or lora_B"):
        import_adapter(fresh_qwen_transformer(qwen_dir), d)
