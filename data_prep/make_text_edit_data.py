"""Synthesize a small text-editing dataset (JSONL + PNG images) with PIL, so the edit path runs end to end
without outside data.

    python data_prep/make_text_edit_data.py --output_dir ~/data/ocr_edit --num_train 64 --num_test 16
    python data_prep/boogu_image_edit_ocr.py --input_dir ~/data/ocr_edit --output_dir ... --reward pickscore

Each sample is a simple scene (sky/ground background, a coloured sign board, a sun or a tree) with a source word
rendered on the board, and the instruction `Change the text to "NEW WORD"`. Writes:
    <output_dir>/{train,test}.jsonl   {"image": "000001.png", "instruction": ..., "target_text": ...,
                                       "source_text": ...}
    <output_dir>/images/*.png
Deterministic for a given --seed.
"""

from __future__ import annotations

import argparse
import sys
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.common import run_cli  # noqa: E402

WORDS = (
    "OPEN", "CLOSED", "SALE", "CAFE", "BAKERY", "HELLO", "WELCOME", "EXIT", "STOP", "HOTEL", "BOOKS", "PIZZA",
    "MUSIC", "GARDEN", "SCHOOL", "MARKET", "TAXI", "BEACH", "PARK", "FRESH", "SUMMER", "WINTER", "RAIN", "SUN",
    "LOVE", "PEACE", "DREAM", "RUN", "JAZZ", "TEA", "SOUP", "FISH",
)
BOARD_COLOURS = ((250, 250, 245), (255, 221, 87), (200, 235, 255), (255, 200, 200), (210, 255, 210))
TEXT_COLOURS = ((20, 20, 20), (150, 20, 20), (20, 40, 140))


def render_scene(word: str, size: int, rng: random.Random) -> Image.Image:
    """A size x size scene with `word` on a sign board."""
    sky = (rng.randint(120, 200), rng.randint(170, 230), 255)
    ground = (rng.randint(60, 120), rng.randint(140, 190), rng.randint(60, 100))
    img = Image.new("RGB", (size, size), sky)
    draw = ImageDraw.Draw(img)
    horizon = int(size * rng.uniform(0.6, 0.75))
    draw.rectangle([0, horizon, size, size], fill=ground)
    if rng.random() < 0.5:  # sun
        r = size // 12
        cx, cy = rng.randint(r, size - r), rng.randint(r, horizon // 3)
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(255, 220, 60))
    else:  # tree
        x = rng.choice([size // 10, size - size // 6])
        draw.rectangle([x, horizon - size // 8, x + size // 30, horizon], fill=(110, 70, 30))
        draw.ellipse([x - size // 14, horizon - size // 4, x + size // 12, horizon - size // 10], fill=(40, 120, 40))
    font = ImageFont.load_default(size=max(12, size // 9))
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    tw, th = right - left, bottom - top
    pad = size // 24
    bx0 = (size - tw) // 2 - pad
    by0 = int(size * 0.35) - th // 2 - pad
    bx1, by1 = bx0 + tw + 2 * pad, by0 + th + 2 * pad
    draw.rectangle([(bx0 + bx1) // 2 - size // 60, by1, (bx0 + bx1) // 2 + size // 60, horizon], fill=(90, 60, 30))
    draw.rectangle([bx0, by0, bx1, by1], fill=rng.choice(BOARD_COLOURS), outline=(60, 40, 20), width=max(1, size // 128))
    draw.text((bx0 + pad - left, by0 + pad - top), word, fill=rng.choice(TEXT_COLOURS), font=font)
    return img


def make_dataset(output_dir: Path, *, num_train: int, num_test: int, image_size: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    (output_dir / "images").mkdir(parents=True, exist_ok=True)
    counter = 0
    counts = {}
    for split, n in (("train", num_train), ("test", num_test)):
        lines = []
        for _ in range(n):
            source, target = rng.sample(WORDS, 2)
            counter += 1
            name = f"{counter:06d}.png"
            render_scene(source, image_size, rng).save(output_dir / "images" / name)
            lines.append(json.dumps({"image": name, "instruction": f'Change the text to "{target}"',
                                     "target_text": target, "source_text": source}))
        (output_dir / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        counts[split] = n
    return counts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--num_train", type=int, default=64)
    p.add_argument("--num_test", type=int, default=16)
    p.add_argument("--image_size", type=int, default=512, help="edge of the square source images")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    counts = make_dataset(args.output_dir.expanduser(), num_train=args.num_train, num_test=args.num_test,
                          image_size=args.image_size, seed=args.seed)
    print(f"wrote {counts} samples to {args.output_dir}")


if __name__ == "__main__":
    run_cli(main)
