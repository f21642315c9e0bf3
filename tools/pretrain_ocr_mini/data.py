"""The closed vocabulary, the prompt templates (pretraining vs held out), the seeds, and the renders of
one word per image (DejaVu Sans Mono Bold)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np


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
