"""PickScore with open_clip, from a transformers CLIPModel checkpoint: the checkpoint conversion (config and
state dict, cached on disk), CLIP's image preprocessing on uint8 tensors, and the `PickScore` model.

May import the standard library, torch and (lazily) safetensors / open_clip / transformers / torchvision; never
`rewards` (which imports it).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch


PICKSCORE_SCALE = 26.0  # verl-omni / flow_grpo / UniRL divide exp(logit_scale)*cos by 26 ("norm to 0-1")
_CONVERTER_VERSION = "1"


def open_clip_config_from_hf(hf_config: dict) -> dict:
    """open_clip `model_cfg` for a transformers `CLIPConfig` dict (PickScore_v1 gives exactly ViT-H-14's config).

    Text pooling mirrors transformers: a legacy `eos_token_id == 2` pools at argmax(token id) (open_clip's default,
    the end-of-text token has the largest id), otherwise at the first `eos_token_id`.
    """
    vc, tc = hf_config["vision_config"], hf_config["text_config"]
    acts = {vc.get("hidden_act", "quick_gelu"), tc.get("hidden_act", "quick_gelu")}
    if len(acts) != 1 or not acts <= {"gelu", "quick_gelu"}:
        raise ValueError(f"unsupported CLIP activation(s) {sorted(acts)}: open_clip builds 'gelu' or 'quick_gelu'")
    if vc["hidden_size"] % vc["num_attention_heads"]:
        raise ValueError("vision hidden_size must be divisible by num_attention_heads")
    eos = tc.get("eos_token_id", 2)
    text_cfg = {
        "context_length": tc.get("max_position_embeddings", 77),
        "vocab_size": tc["vocab_size"],
        "width": tc["hidden_size"],
        "heads": tc["num_attention_heads"],
        "layers": tc["num_hidden_layers"],
    }
    if tc["intermediate_size"] != 4 * tc["hidden_size"]:
        text_cfg["mlp_ratio"] = tc["intermediate_size"] / tc["hidden_size"]
    if eos != 2:
        text_cfg.update(pool_type="eos", eos_id=eos)
    vision_cfg = {
        "image_size": vc["image_size"],
        "layers": vc["num_hidden_layers"],
        "width": vc["hidden_size"],
        "head_width": vc["hidden_size"] // vc["num_attention_heads"],
        "patch_size": vc["patch_size"],
    }
    if vc["intermediate_size"] != 4 * vc["hidden_size"]:
        vision_cfg["mlp_ratio"] = vc["intermediate_size"] / vc["hidden_size"]
    for cfg, sub in ((vision_cfg, vc), (text_cfg, tc)):
        eps = sub.get("layer_norm_eps", 1e-5)
        if eps != 1e-5:  # open_clip's LayerNorm default
            cfg["norm_kwargs"] = {"eps": eps}
    model_cfg = {"embed_dim": hf_config["projection_dim"], "vision_cfg": vision_cfg, "text_cfg": text_cfg}
    if acts == {"quick_gelu"}:
        model_cfg["quick_gelu"] = True
    return model_cfg


def convert_hf_clip_state_dict(hf_sd: dict[str, torch.Tensor], model_cfg: dict) -> dict[str, torch.Tensor]:
    """Map a transformers CLIPModel state dict onto open_clip CLIP names. Every HF tensor must be used
    (position_ids buffers excepted): a leftover or missing key is an error."""
    sd = {k: v for k, v in hf_sd.items() if not k.endswith("position_ids")}
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"CLIP checkpoint lacks tensor {key!r}")
        return sd.pop(key)

    def layers(hf_prefix: str, oc_prefix: str, n: int) -> None:
        for i in range(n):
            h, o = f"{hf_prefix}.encoder.layers.{i}", f"{oc_prefix}.transformer.resblocks.{i}".lstrip(".")
            for s in ("weight", "bias"):
                out[f"{o}.attn.in_proj_{s}"] = torch.cat(
                    [take(f"{h}.self_attn.{p}_proj.{s}") for p in ("q", "k", "v")], dim=0)
                out[f"{o}.attn.out_proj.{s}"] = take(f"{h}.self_attn.out_proj.{s}")
                out[f"{o}.ln_1.{s}"] = take(f"{h}.layer_norm1.{s}")
                out[f"{o}.ln_2.{s}"] = take(f"{h}.layer_norm2.{s}")
                out[f"{o}.mlp.c_fc.{s}"] = take(f"{h}.mlp.fc1.{s}")
                out[f"{o}.mlp.c_proj.{s}"] = take(f"{h}.mlp.fc2.{s}")

    v = "vision_model"
    out["visual.conv1.weight"] = take(f"{v}.embeddings.patch_embedding.weight")
    out["visual.class_embedding"] = take(f"{v}.embeddings.class_embedding")
    out["visual.positional_embedding"] = take(f"{v}.embeddings.position_embedding.weight")
    for s in ("weight", "bias"):
        out[f"visual.ln_pre.{s}"] = take(f"{v}.pre_layrnorm.{s}")
        out[f"visual.ln_post.{s}"] = take(f"{v}.post_layernorm.{s}")
    out["visual.proj"] = take("visual_projection.weight").t().contiguous()
    layers(v, "visual", model_cfg["vision_cfg"]["layers"])

    t = "text_model"
    out["token_embedding.weight"] = take(f"{t}.embeddings.token_embedding.weight")
    out["positional_embedding"] = take(f"{t}.embeddings.position_embedding.weight")
    for s in ("weight", "bias"):
        out[f"ln_final.{s}"] = take(f"{t}.final_layer_norm.{s}")
    out["text_projection"] = take("text_projection.weight").t().contiguous()
    layers(t, "", model_cfg["text_cfg"]["layers"])

    out["logit_scale"] = take("logit_scale")
    if sd:
        raise KeyError(f"CLIP checkpoint has tensors the open_clip conversion does not map: {sorted(sd)[:10]}")
    return out


def _hf_weights_file(checkpoint: Path) -> Path:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (checkpoint / name).is_file():
            return checkpoint / name
    raise FileNotFoundError(f"{checkpoint}: no model.safetensors or pytorch_model.bin (a transformers CLIPModel "
                            f"checkpoint such as yuvalkirstain/PickScore_v1 is expected)")


def _checkpoint_fingerprint(checkpoint: Path) -> str:
    """Cheap content fingerprint: config bytes, weight-file size and its first/last 4 MiB."""
    weights = _hf_weights_file(checkpoint)
    h = hashlib.sha256(_CONVERTER_VERSION.encode())
    h.update((checkpoint / "config.json").read_bytes())
    size = weights.stat().st_size
    h.update(f"{weights.name}:{size}".encode())
    with open(weights, "rb") as f:
        h.update(f.read(4 << 20))
        f.seek(max(0, size - (4 << 20)))
        h.update(f.read(4 << 20))
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl")) / "pickscore_open_clip"


def convert_clip_checkpoint(checkpoint: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Convert a transformers CLIPModel checkpoint into an open_clip `local-dir:` folder (open_clip_config.json +
    open_clip_model.safetensors), cached under `cache_dir/<fingerprint>/`; reuse it when present. Atomic write."""
    from safetensors.torch import load_file, save_file

    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint}/config.json not found: --pickscore_path must be a CLIPModel folder")
    out_dir = Path(cache_dir or default_cache_dir()) / _checkpoint_fingerprint(checkpoint)
    if (out_dir / "open_clip_model.safetensors").is_file() and (out_dir / "open_clip_config.json").is_file():
        return out_dir
    hf_config = json.loads((checkpoint / "config.json").read_text())
    model_cfg = open_clip_config_from_hf(hf_config)
    weights = _hf_weights_file(checkpoint)
    hf_sd = load_file(weights) if weights.suffix == ".safetensors" else torch.load(weights, map_location="cpu",
                                                                                   weights_only=True)
    oc_sd = {k: v.float().contiguous() for k, v in convert_hf_clip_state_dict(hf_sd, model_cfg).items()}
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(oc_sd, str(tmp / "open_clip_model.safetensors"))
    (tmp / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "source": str(checkpoint)},
                                                          indent=2))
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process won the race; its copy is identical
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


@dataclass
class ClipPreprocess:
    """transformers CLIPImageProcessor semantics on uint8 (3, H, W) tensors: resize the shortest edge (bicubic,
    antialiased), centre crop, rescale, normalise. Built from a `preprocessor_config.json`."""
    shortest_edge: int
    crop_hw: tuple[int, int]
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_config(cls, cfg: dict) -> "ClipPreprocess":
        size = cfg.get("size", 224)
        shortest = size["shortest_edge"] if isinstance(size, dict) else int(size)
        crop = cfg.get("crop_size", shortest)
        crop_hw = (crop["height"], crop["width"]) if isinstance(crop, dict) else (int(crop), int(crop))
        for key, want in (("do_resize", True), ("do_center_crop", True), ("do_rescale", True),
                          ("do_normalize", True)):
            if cfg.get(key, want) is not want:
                raise ValueError(f"preprocessor_config {key}={cfg.get(key)} is not supported (CLIP expects {want})")
        if cfg.get("resample", 3) != 3:
            raise ValueError(f"preprocessor_config resample={cfg.get('resample')}; CLIP uses 3 (bicubic)")
        return cls(shortest, crop_hw, float(cfg.get("rescale_factor", 1 / 255)),
                   tuple(cfg["image_mean"]), tuple(cfg["image_std"]))

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 (3, H, W) -> float32 (3, crop_h, crop_w)."""
        import torchvision.transforms.v2.functional as TF

        h, w = image.shape[-2:]
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        size = [new_long, new_short] if w <= h else [new_short, new_long]
        x = TF.resize(image, size, interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
        x = TF.center_crop(x, list(self.crop_hw))
        x = x.float() * self.rescale_factor
        mean = torch.tensor(self.mean, device=x.device).view(3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(3, 1, 1)
        return (x - mean) / std


def read_image_processor_config(folder: Path) -> dict:
    """The CLIP image-processor config: `preprocessor_config.json` (Hub layout), else the `image_processor` entry
    of a transformers-5 `processor_config.json`."""
    if (folder / "preprocessor_config.json").is_file():
        return json.loads((folder / "preprocessor_config.json").read_text())
    if (folder / "processor_config.json").is_file():
        cfg = json.loads((folder / "processor_config.json").read_text())
        if "image_processor" in cfg:
            return cfg["image_processor"]
    raise FileNotFoundError(f"{folder}: no preprocessor_config.json (CLIP image processor config); pass "
                            f"--pickscore_processor_path pointing at a folder that has one")


class PickScore:
    """PickScore = exp(logit_scale) * cos(text, image) / 26 with open_clip's CLIP, fp32.

    `checkpoint` is a transformers CLIPModel folder (PickScore_v1: ViT-H-14); its weights are converted once to an
    open_clip folder (cached). Tokenizer and preprocessor_config come from `processor_path` (default: the checkpoint
    folder; verl-omni takes them from laion/CLIP-ViT-H-14-laion2B-s32B-b79K, which is the same tokenizer/processor).
    Texts are encoded once per unique prompt; images in batches of `batch_size`.
    """

    def __init__(self, checkpoint: str | Path, *, device: str = "cpu", processor_path: str | Path | None = None,
                 cache_dir: str | Path | None = None, batch_size: int = 16):
        import open_clip
        from transformers import AutoTokenizer

        self.device = torch.device(device)
        self.batch_size = batch_size
        oc_dir = convert_clip_checkpoint(checkpoint, cache_dir)
        self.model = open_clip.create_model(f"local-dir:{oc_dir}", precision="fp32", device=self.device).eval()
        proc = Path(processor_path or checkpoint)
        self.tokenizer = AutoTokenizer.from_pretrained(proc)
        self.context_length = int(self.model.positional_embedding.shape[0])
        self.preprocess = ClipPreprocess.from_config(read_image_processor_config(proc))

    @torch.no_grad()
    def encode_text(self, prompts: Sequence[str]) -> torch.Tensor:
        """(U,) prompts -> (U, D) L2-normalised fp32."""
        tok = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.context_length,
                             return_tensors="pt")
        feats = self.model.encode_text(tok["input_ids"].to(self.device))
        return torch.nn.functional.normalize(feats.float(), dim=-1)

    @torch.no_grad()
    def encode_images(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """uint8 (3, H, W) images -> (B, D) L2-normalised fp32."""
        pixels = torch.stack([self.preprocess(img.to(self.device)) for img in images])
        feats = self.model.encode_image(pixels)
        return torch.nn.functional.normalize(feats.float(), dim=-1)

    @torch.no_grad()
    def __call__(self, images: Sequence[torch.Tensor], prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (score / 26, raw exp(logit_scale)*cos), each (B,) float32 on CPU."""
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        position = {p: k for k, p in enumerate(dict.fromkeys(prompts))}
        unique = list(position)
        index = torch.tensor([position[p] for p in prompts])
        text = torch.cat([self.encode_text(unique[i:i + self.batch_size])
                          for i in range(0, len(unique), self.batch_size)])
        raw = []
        scale = self.model.logit_scale.exp().float()
        for i in range(0, len(images), self.batch_size):
            img = self.encode_images(images[i:i + self.batch_size])
            txt = text[index[i:i + self.batch_size].to(text.device)]
            raw.append(scale * (img * txt).sum(-1))
        raw_t = torch.cat(raw).float().cpu()
        return raw_t / PICKSCORE_SCALE, raw_t
