"""Model wrappers: one module per family plus the shared base.

A family is one module with a `FlowModel` subclass (models/base.py) that carries everything the rest of the code
asks about the family (its CFG argument, VAE factor rule, default negative prompt, vllm-omni pipeline, ...) and one
line of `FAMILIES`. `load_model(path)` reads `<path>/model_index.json` and picks the family from its `_class_name`
through that table (Boogu-Image Base and Edit share one class; edit works when a reference image is given).
"""

from __future__ import annotations

import importlib
import os
import re
from types import SimpleNamespace
from typing import Mapping

import torch

from models.base import DEFAULT_CFG_SCALE, FlowModel, PromptEmbeds, check_image_size, read_json

__all__ = ["FlowModel", "PromptEmbeds", "load_model", "model_family", "resolve_model_path", "check_size_for",
           "SAMPLING_DEFAULTS", "SAMPLING_KEYS", "sampling_defaults", "size_warning", "FAMILIES", "FAMILY_NAMES",
           "CFG_ARGUMENTS", "family_class", "cfg_argument", "cfg_scale", "pipeline_cfg_kwargs"]

# A pipeline folder may say how it samples best (a model trained at another size than its family's 512^2, without
# CFG, ...): `<folder>/sampling_defaults.json`, e.g. {"height": 128, "width": 128, "num_inference_steps": 20,
# "true_cfg_scale": 1.0}; scripts/sample.py and scripts/evaluate.py take these as their defaults.
SAMPLING_DEFAULTS = "sampling_defaults.json"
SAMPLING_KEYS = {"height": int, "width": int, "num_inference_steps": int, "guidance_scale": float,
                 "true_cfg_scale": float}

# The model families: model_index.json's `_class_name` -> (family name, module, its FlowModel subclass). The class is
# imported on first use (`family_class`), so reading this table imports no model code.
FAMILIES = {
    "QwenImagePipeline": ("qwen_image", "models.qwen_image", "QwenImageModel"),
    "BooguImagePipeline": ("boogu_image", "models.boogu_image", "BooguImageModel"),
}
FAMILY_NAMES = tuple(name for name, _, _ in FAMILIES.values())
CFG_ARGUMENTS = ("guidance_scale", "true_cfg_scale")  # the pipelines' CFG arguments the command-line flags set


def family_class(family: str) -> type[FlowModel]:
    """The `FlowModel` subclass of the family named `family` ("qwen_image", ...), imported on first use;
    ValueError for an unknown family."""
    for name, module, cls in FAMILIES.values():
        if name == family:
            return getattr(importlib.import_module(module), cls)
    raise ValueError(f"unknown model family {family!r}; known: {sorted(FAMILY_NAMES)}")


# ---- classifier-free guidance: one scale (`DEFAULT_CFG_SCALE`), each family's pipeline argument -------------------
def cfg_argument(family: str) -> str:
    """The family's CFG argument (its class's `cfg_argument`: Boogu-Image `guidance_scale`, Qwen-Image
    `true_cfg_scale`); ValueError for an unknown family."""
    return family_class(family).cfg_argument


def cfg_scale(family: str, guidance_scale: float | None, true_cfg_scale: float | None, *,
              default: float | None = None) -> float:
    """The one CFG scale s (velocity = uncond + s·(cond - uncond); s <= 1 = no CFG) from the two user-facing knobs:
    the family's own (`cfg_argument`: Boogu-Image `guidance_scale`, Qwen-Image `true_cfg_scale`), else `default`
    (None = `DEFAULT_CFG_SCALE`). Setting the other family's knob is a ValueError: it would otherwise be ignored
    silently."""
    own = cfg_argument(family)
    if own not in CFG_ARGUMENTS:
        raise ValueError(f"{family} is guided by {own!r}, which no command-line flag sets (the flags are "
                         f"{', '.join('--' + a for a in CFG_ARGUMENTS)}); add --{own} beside them in "
                         f"training/flags.py and scripts/sample.py and to CFG_ARGUMENTS")
    value, other_value = (guidance_scale, true_cfg_scale) if own == "guidance_scale" else (true_cfg_scale,
                                                                                           guidance_scale)
    if other_value is not None:
        other = "true_cfg_scale" if own == "guidance_scale" else "guidance_scale"
        raise ValueError(f"{family} is guided by {own}; {other} belongs to the other model family")
    if value is None:
        return float(DEFAULT_CFG_SCALE if default is None else default)
    return float(value)


def pipeline_cfg_kwargs(family: str, scale: float) -> dict[str, float]:
    """{the family's pipeline argument: `scale`} (`cfg_argument`), e.g. {"true_cfg_scale": 4.0} for Qwen-Image."""
    return {cfg_argument(family): float(scale)}


def resolve_model_path(path: str) -> str:
    """A local pipeline folder as is; a Hugging Face Hub id ("Boogu/Boogu-Image-0.1-Base") is fetched into the Hub
    cache (or found there with HF_HUB_OFFLINE=1) and its snapshot folder returned."""
    if os.path.isdir(path):
        return path
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path or "") and not os.path.exists(path):
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(path)
        except Exception as e:  # network, auth or offline-cache miss: say which and how to fix it
            raise FileNotFoundError(
                f"could not get {path!r} from the Hugging Face Hub ({type(e).__name__}: {e}); download it first "
                f"(huggingface-cli download {path}) and pass the local folder"
            ) from e
    raise FileNotFoundError(f"model path {path!r} is not a directory; pass a diffusers-style pipeline folder")


def sampling_defaults(path: str) -> dict[str, int | float]:
    """The sampling defaults a local pipeline folder declares in its SAMPLING_DEFAULTS file ({} when it has none or
    `path` is not a local folder). A key outside SAMPLING_KEYS or a value of the wrong type is a ValueError naming the
    file."""
    file = os.path.join(path, SAMPLING_DEFAULTS) if path and os.path.isdir(path) else None
    if not file or not os.path.isfile(file):
        return {}
    values = read_json(file, SAMPLING_DEFAULTS)
    if not isinstance(values, dict):
        raise ValueError(f"{file}: expected a JSON object of {sorted(SAMPLING_KEYS)}")
    out: dict[str, int | float] = {}
    for key, value in values.items():
        kind = SAMPLING_KEYS.get(key)
        if kind is None or isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (kind is int and value != int(value)) or not value > 0:
            raise ValueError(f"{file}: {key!r}: {value!r} is not a positive {kind.__name__ if kind else 'known key'}"
                             f" (keys: {sorted(SAMPLING_KEYS)})")
        out[key] = kind(value)
    return out


def size_warning(trained: Mapping[str, int | float], height: int | None, width: int | None) -> str | None:
    """A warning when the requested size is more than 2x away (per side) from the size a model folder says it samples
    at (`trained`: its `sampling_defaults`), else None."""
    if not trained.get("height") or not trained.get("width") or height is None or width is None:
        return None
    ratios = (height / trained["height"], width / trained["width"])
    if all(0.5 <= r <= 2.0 for r in ratios):
        return None
    return (f"warning: {height}x{width} is far from the {int(trained['height'])}x{int(trained['width'])} this model "
            f"samples at ({SAMPLING_DEFAULTS} of its folder): expect images it was not trained to draw")


def model_family(path: str) -> str:
    """The family name (a `FAMILY_NAMES` entry, through `FAMILIES`) of the pipeline directory `path`."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory; pass a diffusers-style pipeline folder")
    index = read_json(os.path.join(path, "model_index.json"), "model_index.json")
    class_name = index.get("_class_name")
    if class_name not in FAMILIES:
        raise ValueError(
            f"{path}/model_index.json has _class_name={class_name!r}; supported pipelines are "
            f"{sorted(FAMILIES)} (model families {', '.join(FAMILY_NAMES)})"
        )
    return FAMILIES[class_name][0]


def check_size_for(path: str, height: int, width: int) -> str:
    """Model-free (reads model_index.json and vae/config.json only): raise ValueError naming the fix unless
    height x width suits the pipeline at `path` (`check_image_size`, with the VAE factor its wrapper will use);
    returns the family."""
    family = model_family(path)
    vae = read_json(os.path.join(path, "vae", "config.json"), "VAE config")
    check_image_size(family, height, width, family_class(family).vae_scale_factor_of(SimpleNamespace(**vae)))
    return family


def load_model(path: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, **kw) -> FlowModel:
    """Load the pipeline directory `path` as a FlowModel wrapper; the family comes from model_index.json."""
    return family_class(model_family(path)).from_pretrained(path, device=device, dtype=dtype, **kw)
