"""The state on disk (compact bf16 weights, state.json with sha256) and the run context of one call."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .common import FORMAT, REPO, STATE_FILE, TRANSFORMER_FILE, VAE_FILE
from .data import HELDOUT_TEMPLATES, RENDER_VERSION, TRAIN_TEMPLATES
from .nets import (adaln_zero_init, build_vae, causal_convs, is_frame_conv, params_finite, transformer_config,
                   vae_config)
from .ocr_pool import CpuPool
from training.resume_policy import sha256_file  # noqa: E402  (the repo root is on sys.path: .common)




def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def frame_tap_keys(module: torch.nn.Module) -> set[str]:
    """State-dict keys of the VAE's frame-conv weights (B, C, k_t > 1, kh, kw) whose taps before the last are
    zero by construction (`build_vae`); empty for any other module."""
    convs = {id(m) for m in causal_convs(module)}
    return {f"{name}.weight" for name, m in module.named_modules()
            if id(m) in convs and is_frame_conv(m) and m.kernel_size[0] > 1}


def compact_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The bf16 CPU state dict with each frame-conv weight cut to its last temporal tap (k_t -> 1): the only tap
    a single frame sees. Refuses a weight whose other taps are not zero (it would not round-trip)."""
    out, keys = {}, frame_tap_keys(module)
    for key, value in module.state_dict().items():
        value = value.detach().to("cpu", torch.bfloat16)
        if key in keys:
            if value[:, :, :-1].any():
                raise ValueError(f"{key}: non-zero temporal taps before the last; cannot store it compactly")
            value = value[:, :, -1:]
        out[key] = value.contiguous()
    return out


def expand_state(tensors: dict[str, torch.Tensor], own: dict[str, torch.Tensor], keys: set[str],
                 source: Path) -> dict[str, torch.Tensor]:
    """Inverse of `compact_state` against the module's own state dict `own`: a (O, I, 1, kh, kw) tensor under a
    frame-conv key becomes (O, I, k_t, kh, kw) with zeros before the last tap; other shapes must match."""
    out = {}
    for key, value in tensors.items():
        want = own[key].shape
        if key in keys and value.shape != want and value.shape == (*want[:2], 1, *want[3:]):
            full = torch.zeros(want, dtype=value.dtype)
            full[:, :, -1:] = value
            value = full
        if value.shape != want:
            raise ValueError(f"{source}: {key} has shape {tuple(value.shape)}, the model expects {tuple(want)}")
        out[key] = value.to(own[key].dtype)
    return out


def save_weights(module: torch.nn.Module, path: Path) -> dict[str, Any]:
    """bf16 safetensors of the state dict (atomic; the VAE's frame convs compact, see `compact_state`: 3x
    smaller, so a base_dim 32 VAE stays under the 16 MiB a device call returns per file); returns
    {file, bytes, sha256}."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(compact_state(module), tmp)
    os.replace(tmp, path)
    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def load_weights(module: torch.nn.Module, path: Path, expected_sha256: str | None = None) -> None:
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the state is incomplete (carry every file of the state dir)")
    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise ValueError(f"{path} does not match the sha256 recorded in {STATE_FILE}: the state is corrupt or "
                         "mixed from two runs; keep the files of one call's state folder together")
    tensors = load_file(str(path))
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise ValueError(f"{path}: keys do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
    module.load_state_dict(expand_state(tensors, own, frame_tap_keys(module), path))


def read_state(state_dir: Path) -> dict[str, Any]:
    path = state_dir / STATE_FILE
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the state is corrupt") from e
    if state.get("format") != FORMAT:
        raise ValueError(f"{path} has format {state.get('format')!r}, expected {FORMAT!r}")
    return state


# ---------------------------------------------------------------------------------------------------------------
# Run context
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    args: argparse.Namespace
    state: dict[str, Any]
    state_dir: Path
    device: torch.device
    t_start: float
    total_s_before: float
    words: list[str]
    base: Any                     # the tiny qwen_image wrapper: text encoder, tokenizer, scheduler config
    pool: CpuPool | None = None
    log_path: Path | None = None
    ema: Any = None               # the transformer's EMA copy once the transformer phase runs
    ocr_rate: float | None = None  # images/s of the last asynchronous OCR job (submission to result)
    ocr_jobs: int = 0              # asynchronous OCR jobs collected (the first one also starts the OCR engines)

    def record_ocr_rate(self, images: int, seconds: float) -> None:
        self.ocr_jobs += 1
        if self.ocr_jobs > 1:
            self.ocr_rate = images / max(seconds, 1e-3)

    def now(self) -> float:
        return time.monotonic() - self.t_start

    def time_left(self) -> float:
        return self.args.time_budget_s - self.now()

    def reserve(self) -> float:
        """Seconds kept for the end of the call: --reserve_s, or more when the measured OCR rate says the last
        periodic eval plus the final eval take longer (1.3x margin + 15 s for sampling and saving)."""
        a = self.args
        if not self.ocr_rate:
            return a.reserve_s
        images = len(self.words) * (a.eval_seeds + len(HELDOUT_TEMPLATES) * a.final_seeds * len(a.final_eval_steps))
        return max(a.reserve_s, 15.0 + 1.3 * images / self.ocr_rate)

    def total_s(self) -> float:
        return self.total_s_before + self.now()

    def amp(self):
        if self.args.amp == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def log(self, msg: str) -> None:
        line = f"[{self.now():7.1f}s] {msg}"
        print(line, flush=True)
        if self.log_path is not None:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def wrapper(self, transformer: torch.nn.Module, vae: torch.nn.Module):
        """A QwenImageModel around our transformer and VAE with the tiny pipeline's text encoder and tokenizer."""
        from models.qwen_image import QwenImageModel

        b = self.base
        return QwenImageModel(transformer, vae, b.text_encoder, b.tokenizer, b.scheduler_config, device=self.device,
                              dtype=torch.float32)


def tiny_qwen_image_dir(tiny_models_dir: str | None) -> Path:
    """The tiny qwen_image pipeline of build_tiny_models (text encoder + tokenizer source), built if missing."""
    import build_tiny_models

    root = Path(tiny_models_dir or os.environ.get("TINY_MODELS_DIR") or REPO / ".cache" / "tiny_models")
    root.mkdir(parents=True, exist_ok=True)
    build_tiny_models.build_one("qwen_image", str(root), force=False)
    return root / "qwen_image"


def run_config(args: argparse.Namespace, words: list[str], text_dim: int) -> dict[str, Any]:
    """What a resumed call must agree on (architecture, data, seeds)."""
    return {
        "resolution": args.resolution, "render": RENDER_VERSION, "words": words,
        "train_templates": list(TRAIN_TEMPLATES),
        "heldout_templates": list(HELDOUT_TEMPLATES), "seed": args.seed,
        "vae": vae_config(args.vae_base_dim, args.vae_res_blocks),
        "transformer": transformer_config(args.layers, args.width, args.head_dim, text_dim),
    }


def check_resume_config(saved: dict[str, Any], current: dict[str, Any], source: Path, *,
                        trained_transformer: bool = True) -> None:
    flags = {"resolution": "--resolution", "render": "RENDER_VERSION (script)", "words": "--num_words",
             "seed": "--seed",
             "vae": "--vae_base_dim/--vae_res_blocks", "transformer": "--layers/--width/--head_dim",
             "train_templates": "TRAIN_TEMPLATES (script)", "heldout_templates": "HELDOUT_TEMPLATES (script)"}
    for key, flag in flags.items():
        if key == "transformer" and not trained_transformer:
            continue  # nothing trained yet (e.g. after a --sweep call): this call's architecture is used
        if saved.get(key) != current.get(key):
            raise ValueError(f"{source}/{STATE_FILE} was built with {key}={saved.get(key)!r} but this call has "
                             f"{current.get(key)!r}; pass the same {flag} as the first call (or a fresh --state_dir)")


def new_state(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT, "config": config, "phase": "vae", "total_s": 0.0, "calls": [],
        "vae": {"config": dict(config["vae"]), "steps": 0, "images": 0, "seconds": 0.0},
        "transformer": {"config": dict(config["transformer"]), "steps": 0, "images": 0, "seconds": 0.0,
                        "train_seconds": 0.0},
        "curves": {"vae_loss": [], "vae_eval": [], "loss": [], "eval": []},
        "final_eval": None, "start_point": None, "files": {}, "samples": None,
    }


def save_state(run: Run, vae: torch.nn.Module | None, transformer: torch.nn.Module | None) -> None:
    """Weights first (atomic, bf16), then state.json naming their sha256. Refuses non-finite weights."""
    for name, module in (("vae", vae), ("transformer", transformer)):
        if module is not None and not params_finite(module):
            raise RuntimeError(f"refusing to save non-finite {name} weights; the previous state is kept")
    if vae is not None:
        run.state["files"]["vae"] = save_weights(vae, run.state_dir / VAE_FILE)
        run.state["vae"]["config"] = {k: v for k, v in dict(vae.config).items() if not k.startswith("_")}
    if transformer is not None:
        run.state["files"]["transformer"] = save_weights(transformer, run.state_dir / TRANSFORMER_FILE)
    run.state["total_s"] = run.total_s()
    run.state["calls"][-1]["wall_s"] = run.now()
    write_json_atomic(run.state_dir / STATE_FILE, run.state)


def load_vae(state: dict[str, Any], state_dir: Path, device: torch.device) -> torch.nn.Module:
    vae = build_vae(state["vae"]["config"])
    if "vae" in state["files"]:
        load_weights(vae, state_dir / VAE_FILE, state["files"]["vae"]["sha256"])
    return vae.to(device)


def load_transformer(state: dict[str, Any], state_dir: Path, device: torch.device) -> torch.nn.Module:
    from diffusers import QwenImageTransformer2DModel

    transformer = QwenImageTransformer2DModel(**state["transformer"]["config"])
    if "transformer" in state["files"]:
        load_weights(transformer, state_dir / TRANSFORMER_FILE, state["files"]["transformer"]["sha256"])
    else:
        adaln_zero_init(transformer)
    return transformer.to(device)
