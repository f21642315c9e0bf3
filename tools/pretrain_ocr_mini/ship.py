"""Export the committed parts (`--export_ship`), assemble a loadable pipeline folder from them (`--assemble`),
the RL datasets (`--write_datasets`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch

from .common import FORMAT, SHIP_VAE_FILE
from .data import HELDOUT_TEMPLATES, TRAIN_TEMPLATES, heldout_prompts
from .pictures import read_grid
from .state import (Run, load_transformer, load_vae, load_weights, read_state, save_weights, sha256_file,
                    tiny_qwen_image_dir, write_json_atomic)


def write_datasets(out_dir: Path, words: Sequence[str]) -> dict[str, int]:
    """verl-omni parquet for RL: train.parquet (TRAIN_TEMPLATES x words), test.parquet (HELDOUT_TEMPLATES x
    words), rows from `data_prep.ocr.make_row` for qwen_image (data_source 'ocr', ground truth = the word), plus
    info.json (words, templates)."""
    from data_prep.common import T2I_SCHEMA, first_quoted_span, write_parquet
    from data_prep.ocr import make_row

    out_dir = Path(out_dir)
    splits = {"train": [(t.format(w), w) for t in TRAIN_TEMPLATES for w in words],
              "test": heldout_prompts(words)}
    counts = {}
    for split, items in splits.items():
        rows = []
        for index, (prompt, word) in enumerate(items):
            if first_quoted_span(prompt) != word:
                raise AssertionError(f"template bug: {prompt!r} does not quote {word!r}")
            rows.append(make_row(prompt, word, split, index, model="qwen_image"))
        write_parquet(rows, out_dir / f"{split}.parquet", T2I_SCHEMA)
        counts[split] = len(rows)
    write_json_atomic(out_dir / "info.json", {"words": list(words), "train_templates": list(TRAIN_TEMPLATES),
                                              "heldout_templates": list(HELDOUT_TEMPLATES), "rows": counts})
    return counts


def export_ship(state_dir: Path, ship_dir: Path) -> dict[str, Any]:
    """The committed parts (bf16): model_index.json, scheduler/, transformer/, vae/ (diffusers save_pretrained),
    build_info.json (build commands, measured start point, sha256 of every file), README.md, data/ (the RL parquet).
    The text encoder and tokenizer are not shipped: `assemble_pipeline` rebuilds them with build_tiny_models."""
    import build_tiny_models

    state = read_state(state_dir)
    if "transformer" not in state["files"]:
        raise ValueError(f"{state_dir} has no trained transformer yet (phase {state['phase']!r}); run more calls")
    vae = load_vae(state, state_dir, torch.device("cpu"))
    transformer = load_transformer(state, state_dir, torch.device("cpu"))
    ship_dir = Path(ship_dir)
    tmp = ship_dir.with_name(ship_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # `.to(bf16)` warns about keep-in-fp32 modules; these models have none
    try:
        transformer.to(torch.bfloat16).save_pretrained(tmp / "transformer", safe_serialization=True)
        vae.to(torch.bfloat16).save_pretrained(tmp / "vae", safe_serialization=True)
        (tmp / "vae" / "diffusion_pytorch_model.safetensors").unlink()  # shipped compact; --assemble expands it
        save_weights(vae, tmp / "vae" / SHIP_VAE_FILE)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    build_tiny_models.write_json(str(tmp / "scheduler" / "scheduler_config.json"),
                                 build_tiny_models.QWEN_IMAGE_SCHEDULER_CONFIG)
    build_tiny_models.write_json(str(tmp / "model_index.json"), build_tiny_models.QWEN_IMAGE_MODEL_INDEX)
    words = state["config"]["words"]
    write_datasets(tmp / "data", words)
    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    final = state.get("final_eval") or {}
    info = {
        "format": "ocr_mini/1", "source_state": FORMAT, "phase": state["phase"],
        "resolution": state["config"]["resolution"], "words": words,
        "train_templates": state["config"]["train_templates"],
        "heldout_templates": state["config"]["heldout_templates"],
        "recommended": {"height": state["config"]["resolution"], "width": state["config"]["resolution"],
                        "true_cfg_scale": 1.0, "num_inference_steps": [int(s) for s in final.get("by_steps", {})]},
        "vae": {"config": state["vae"]["config"], "steps": state["vae"]["steps"], "images": state["vae"]["images"],
                "seconds": state["vae"]["seconds"], "final_recon": state["vae"].get("final_recon")},
        "transformer": {k: state["transformer"][k] for k in ("config", "steps", "images", "seconds", "train_seconds")},
        "start_point": {k: {m: v[m] for m in ("mean", "exact", "within_std", "spread", "n_prompts", "n_seeds")}
                        for k, v in final.get("by_steps", {}).items()},
        "start_point_rule": state.get("start_point"), "total_pretraining_s": state["total_s"],
        "calls": [{k: c.get(k) for k in ("argv", "device", "versions", "wall_s", "started")} for c in state["calls"]],
        "curves": {"vae_eval": state["curves"]["vae_eval"], "eval": state["curves"]["eval"]},
        "assemble": f"python3 -m tools.pretrain_ocr_mini --assemble {ship_dir} OUT_DIR",
        "files": files,
    }
    write_json_atomic(tmp / "build_info.json", info)
    (tmp / "README.md").write_text(ship_readme(info, ship_dir), encoding="utf-8")
    if ship_dir.exists():  # replace only an earlier export (never an unrelated folder)
        if any(ship_dir.iterdir()) and not (ship_dir / "build_info.json").is_file():
            shutil.rmtree(tmp)
            raise FileExistsError(f"{ship_dir} exists and is not an earlier --export_ship folder; pick another")
        shutil.rmtree(ship_dir)
    os.replace(tmp, ship_dir)
    return info


def ship_readme(info: dict[str, Any], ship_dir: Path) -> str:
    lines = [f"# {ship_dir.name}: a small pretrained text-to-image model (Qwen-Image layout)", "",
             "Built by `python3 -m tools.pretrain_ocr_mini` (docs/LEARNING.md). Random frozen text encoder and the "
             "real Qwen tokenizer as `tools/build_tiny_models.py` builds them for `qwen_image` (not shipped; "
             "`--assemble` rebuilds them).", "",
             f"- resolution {info['resolution']}x{info['resolution']}, {len(info['words'])} words, true CFG off "
             "(`--true_cfg_scale 1.0`)",
             f"- VAE: {info['vae']['steps']} steps, {info['vae']['seconds']:.0f} s; transformer: "
             f"{info['transformer']['steps']} steps, {info['transformer']['images']} images, "
             f"{info['transformer']['train_seconds']:.0f} s of training; {info['total_pretraining_s']:.0f} s in all",
             "", "Pretraining's own held-out evaluation (held-out templates, its seeds, rapidocr reward; the RL "
             "start point is the learning benchmark's evaluation, docs/LEARNING.md):", ""]
    for steps, m in info["start_point"].items():
        lines.append(f"- {steps} steps: mean {m['mean']:.3f}, exact {m['exact']:.3f}, within-prompt std "
                     f"{m['within_std']:.3f} ({m['n_prompts']} prompts x {m['n_seeds']} seeds)")
    lines += ["", "Build commands (one per call; each call's state folder resumed by the next):", ""]
    lines += [f"    {' '.join(c['argv'] or [])}  # {c.get('device')}, {c.get('wall_s') or 0:.0f} s"
              for c in info["calls"]]
    lines += ["", f"Assemble a loadable pipeline folder: `{info['assemble']}`", "",
              "RL datasets: `data/train.parquet` (training templates), `data/test.parquet` (held-out templates).", ""]
    return "\n".join(lines)


def expand_shipped_vae(ship_vae: Path, out_vae: Path) -> None:
    """The diffusers `vae/` folder (bf16 save_pretrained) from the shipped config.json + compact weights."""
    from diffusers import AutoencoderKLQwenImage

    with open(ship_vae / "config.json", encoding="utf-8") as f:
        vae = AutoencoderKLQwenImage.from_config(json.load(f))
    load_weights(vae, ship_vae / SHIP_VAE_FILE)
    vae.to(torch.bfloat16).save_pretrained(out_vae, safe_serialization=True)


def assemble_pipeline(ship_dir: str | Path, out_dir: str | Path, tiny_models_dir: str | None = None) -> Path:
    """A loadable QwenImagePipeline folder from the shipped parts plus the tiny text encoder and tokenizer.

    Verifies every shipped file against build_info.json's sha256 first. Idempotent: an existing folder assembled
    from the same ship (its `.assembled` marker holds build_info.json's sha256) is kept; any other existing folder
    is an error."""
    import build_tiny_models

    ship_dir, out_dir = Path(ship_dir), Path(out_dir)
    info_path = ship_dir / "build_info.json"
    if not info_path.is_file():
        raise FileNotFoundError(f"{info_path} is missing: {ship_dir} is not a folder written by --export_ship")
    info = json.loads(info_path.read_text(encoding="utf-8"))
    marker_value = sha256_file(info_path)
    marker = out_dir / ".assembled"
    if out_dir.exists():
        if marker.is_file() and marker.read_text(encoding="utf-8").strip() == marker_value:
            from models import SAMPLING_DEFAULTS

            if not (out_dir / SAMPLING_DEFAULTS).is_file():  # assembled before the folder carried them
                write_sampling_defaults(out_dir, info)
            return out_dir
        raise FileExistsError(f"{out_dir} exists and was not assembled from {ship_dir}; remove it or pick another")
    for rel, meta in info["files"].items():
        path = ship_dir / rel
        if not path.is_file() or sha256_file(path) != meta["sha256"]:
            raise ValueError(f"{path} is missing or does not match build_info.json (sha256); re-export or "
                             "re-checkout the shipped checkpoint")
    with open(ship_dir / "transformer" / "config.json", encoding="utf-8") as f:
        text_dim = json.load(f)["joint_attention_dim"]
    if text_dim != build_tiny_models.TINY_TEXT_HIDDEN:
        raise ValueError(f"{ship_dir}: transformer joint_attention_dim {text_dim} != the tiny text encoder's "
                         f"hidden size {build_tiny_models.TINY_TEXT_HIDDEN}")
    tiny = tiny_qwen_image_dir(tiny_models_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for sub in ("text_encoder", "tokenizer"):
        shutil.copytree(tiny / sub, tmp / sub)
    for sub in ("transformer", "scheduler"):
        shutil.copytree(ship_dir / sub, tmp / sub)
    expand_shipped_vae(ship_dir / "vae", tmp / "vae")
    shutil.copyfile(ship_dir / "model_index.json", tmp / "model_index.json")
    write_sampling_defaults(tmp, info)
    (tmp / ".assembled").write_text(marker_value + "\n", encoding="utf-8")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    return out_dir


def write_sampling_defaults(pipeline_dir: Path, info: dict) -> None:
    """The assembled folder's `models.SAMPLING_DEFAULTS`: the size, steps (the most of the recommended ones) and true
    CFG it was pretrained and evaluated with (build_info.json "recommended"), so sample.py draws legible words with
    no size or CFG flags."""
    from models import SAMPLING_DEFAULTS

    rec = info["recommended"]
    steps = rec["num_inference_steps"]
    values = {"height": int(rec["height"]), "width": int(rec["width"]),
              "num_inference_steps": int(max(steps) if isinstance(steps, list) else steps),
              "true_cfg_scale": float(rec["true_cfg_scale"])}
    (pipeline_dir / SAMPLING_DEFAULTS).write_text(json.dumps(values, indent=2) + "\n", encoding="utf-8")


def native_engine_images(pipeline_dir: str | Path, prompts: Sequence[str], seeds: Sequence[int], steps: int,
                         size: int, device: str = "cpu") -> torch.Tensor:
    """uint8 (B, 3, size, size) from `rollout.NativeEngine` on a pipeline folder (loaded by models.load_model),
    with the parquet's chat-message form of each prompt and true CFG off, as the RL runs sample."""
    import rollout
    from models.qwen_image import QwenImageModel

    engine = rollout.NativeEngine(str(pipeline_dir), device=device, dtype=torch.float32, max_batch_size=8)
    request = rollout.RolloutRequest(prompts=[QwenImageModel.released_chat(p) for p in prompts],
                                     seeds=list(seeds), num_inference_steps=steps, height=size, width=size,
                                     cfg_scale=1.0)
    return engine.generate(request).images


def check_assembled(run: Run, pipeline_dir: Path, count: int = 8) -> None:
    """Smoke: the native engine on the assembled folder reproduces the first `count` images the final eval
    scored (samples.png)."""
    samples = run.state["samples"]
    count = min(count, len(samples["seeds"]))
    images = native_engine_images(pipeline_dir, samples["prompts"][:count], samples["seeds"][:count],
                                  samples["steps"], samples["size"], str(run.device))
    expected = read_grid(run.state_dir / samples["file"], count, samples["cols"], samples["size"])
    diff = (images.int() - expected.int()).abs()
    run.log(f"[smoke] NativeEngine on {pipeline_dir}: images {tuple(images.shape)}, max |diff| vs the scored "
            f"samples {int(diff.max())}, mean {float(diff.float().mean()):.4f}")
    # fp32 eval: the same numbers up to rounding; a bf16-autocast eval against the fp32 engine: close on average
    ok = int(diff.max()) <= 2 if run.args.amp == "none" else float(diff.float().mean()) <= 2.0
    if images.shape != expected.shape or not ok:
        raise RuntimeError("the assembled checkpoint does not reproduce the evaluated samples")
