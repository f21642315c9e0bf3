"""A trained adapter in the two loaders users reach for, on the tiny Qwen-Image transformer: diffusers'
`load_lora_weights` reads a checkpoint's `adapters/<name>/` folder as it is; plain PEFT's
`PeftModel.from_pretrained` reads the `scripts/export_adapter.py` export; both give the trainer's own outputs,
which differ from the base model's. PEFT on the unexported folder loads a zero adapter (the reason for the export).
"""

from __future__ import annotations

import os

import pytest
import torch

import export_adapter
from models import load_model, lora

TARGET = "transformer_blocks.0.attn.to_q"


def forward(transformer) -> torch.Tensor:
    """The transformer's velocity on fixed inputs (batch 1, an 8x8 latent grid, 5 text tokens)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return transformer(hidden_states=torch.randn(1, 16, 64, generator=g),
                           encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
                           encoder_hidden_states_mask=torch.ones(1, 5, dtype=torch.long),
                           timestep=torch.tensor([0.5]), img_shapes=[[(1, 4, 4)]], return_dict=False)[0]


def fresh_transformer(model_path: str):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(os.path.join(model_path, "transformer")).eval()


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory):
    """A rank-4, alpha-8 adapter with random non-zero A and B, written as a checkpoint writes `adapters/<name>/`;
    with the trainer-side model's outputs (adapter on and off)."""
    model_path = os.path.join(tiny_models, "qwen_image")
    model = load_model(model_path, transformer_only=True)
    lora.add_lora(model, rank=4, alpha=8.0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora.lora_layers(model.transformer).values():
            for w in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    folder = str(tmp_path_factory.mktemp("ckpt") / "adapters" / "default")
    lora.export_adapter(model.transformer, folder)
    transformer = model.transformer.eval()
    with lora.lora_disabled(transformer):
        base = forward(transformer)
    return dict(model_path=model_path, folder=folder, output=forward(transformer), base=base,
                modules=len(lora.lora_layers(transformer)))


def load_in_diffusers(model_path: str, folder: str):
    from diffusers.loaders import QwenImageLoraLoaderMixin

    class Pipe(QwenImageLoraLoaderMixin):  # the mixin QwenImagePipeline uses, without text encoder / VAE
        def __init__(self, transformer):
            self.transformer, self.hf_device_map, self.components = transformer, None, {"transformer": transformer}

    pipe = Pipe(fresh_transformer(model_path))
    pipe.load_lora_weights(folder, adapter_name="trained")
    return pipe.transformer


def load_in_peft(model_path: str, folder: str):
    from peft import PeftModel

    return PeftModel.from_pretrained(fresh_transformer(model_path), folder).eval()


def test_diffusers_and_peft_export_give_the_trainers_outputs(trained, tmp_path):
    peft_dir = str(tmp_path / "peft")
    export_adapter.main([trained["folder"], peft_dir])  # --format peft, the default
    assert not torch.allclose(trained["output"], trained["base"])  # the adapter changes the outputs
    diffusers_out = forward(load_in_diffusers(trained["model_path"], trained["folder"]))
    peft_out = forward(load_in_peft(trained["model_path"], peft_dir))
    torch.testing.assert_close(diffusers_out, trained["output"], rtol=0, atol=1e-6)
    torch.testing.assert_close(peft_out, trained["output"], rtol=0, atol=1e-6)
    # the diffusers form exported back from the PEFT one is the checkpoint's folder again, tensor for tensor
    again = str(tmp_path / "diffusers")
    export_adapter.main([peft_dir, again, "--format", "diffusers"])
    (c0, m0), (c1, m1) = lora.read_adapter(trained["folder"]), lora.read_adapter(again)
    assert (c0["r"], c0["lora_alpha"], c0["target_modules"]) == (c1["r"], c1["lora_alpha"], c1["target_modules"])
    assert sorted(m0) == sorted(m1) and len(m0) == trained["modules"]
    assert all(torch.equal(m0[k][ab], m1[k][ab]) for k in m0 for ab in "AB")


def test_plain_peft_on_the_checkpoint_folder_loads_a_zero_adapter(trained):
    """What the export is for: PEFT finds none of the `transformer.`-prefixed keys (it warns), so B stays zero and
    the outputs are the base model's. If PEFT learns to read them, the README's adapter section must change."""
    with pytest.warns(UserWarning):
        model = load_in_peft(trained["model_path"], trained["folder"])
    assert all(float(layer.lora_B["default"].weight.abs().sum()) == 0.0
               for layer in lora.lora_layers(model.base_model.model).values())
    torch.testing.assert_close(forward(model), trained["base"], rtol=0, atol=1e-6)


def test_vllm_omni_form_reads_back_and_bad_sources_are_refused(trained, tmp_path, capsys):
    engine = str(tmp_path / "engine")
    export_adapter.main([trained["folder"], engine, "--format", "vllm_omni"])
    assert f"{trained['modules']} LoRA modules" in capsys.readouterr().out
    config, modules = lora.read_adapter(engine)
    assert all(".to_out.0" not in t for t in config["target_modules"])  # vllm-omni names
    assert sorted(modules) == sorted(lora.read_adapter(trained["folder"])[1])  # the same modules, trainer names
    with pytest.raises(SystemExit):
        export_adapter.main([trained["folder"], trained["folder"]])
    assert "is the source folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_adapter.main([str(tmp_path / "nothing"), str(tmp_path / "out")])
    assert "nothing" in capsys.readouterr().err
