"""Text-editing JSONL + images -> verl-omni parquet rows for Boogu-Image-Edit (TI2I).

    python data_prep/boogu_image_edit_ocr.py --input_dir ~/data/ocr_edit \
        --output_dir ~/data/ocr/boogu_image_edit_pickscore --image_size 512 --reward pickscore

Input (e.g. from data_prep/make_text_edit_data.py):
    <input_dir>/{train,test}.jsonl   {"image": "000001.png", "instruction": "Change the text to \"OPEN\"",
                                      "target_text": "OPEN" (optional: default = first double-quoted span)}
    <input_dir>/images/000001.png
Output `<output_dir>/{split}.parquet` rows:
    data_source, reward_model.ground_truth   set together by --reward (reward_fields):
        pickscore -> ("pickscore", the full instruction: PickScore CLIP-encodes it as the prompt)
        ocr       -> ("ocr", the bare target text: the OCR reward transcribes and compares strings)
    prompt           [system: BOOGU_TI2I_SYSTEM_PROMPT, user: "Picture 1: <image>" + instruction]
    negative_prompt  [system: BOOGU_TI2I_SYSTEM_PROMPT, user: ""]  TEXT-ONLY: Boogu's guided TI2I encodes the
                     negative without the reference image (use_input_images_4_neg_instruct=False); an <image>
                     there would be tokenised but never expanded and would silently shift the guidance.
    ability          "image_edit"
    images           [{"bytes": PNG}]  source letterboxed onto a white image_size x image_size canvas, so every
                     row (and every rollout output, which follows the reference size) has one resolution.
    extra_info       {"split", "index", "instruction", "image", "target_text"}
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

from PIL import Image, ImageOps

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.common import EDIT_SCHEMA, first_quoted_span, run_cli, write_parquet
from models.base import chat_messages
from models.boogu_image import BOOGU_TI2I_SYSTEM_PROMPT

REWARD_ARMS = ("pickscore", "ocr")
MAX_IMAGE_SIZE = 2048


def reward_fields(reward: str, instruction: str, target_text: str) -> tuple[str, str]:
    """(data_source, ground_truth) for a reward arm: the single place the two are chosen, so they cannot drift."""
    if reward == "pickscore":
        return "pickscore", instruction
    if reward == "ocr":
        return "ocr", target_text
    raise ValueError(f"--reward must be one of {REWARD_ARMS}, got {reward!r}")


def check_image_size(image_size: int) -> None:
    if image_size <= 0 or image_size > MAX_IMAGE_SIZE or image_size % 16:
        raise ValueError(f"--image_size must be a multiple of 16 in (0, {MAX_IMAGE_SIZE}], got {image_size}")


def letterbox_png(path: Path, image_size: int) -> bytes:
    """Fit the image inside an image_size square (aspect kept, Lanczos), centred on white; PNG bytes."""
    with Image.open(path) as src:
        img = ImageOps.contain(src.convert("RGB"), (image_size, image_size), method=Image.Resampling.LANCZOS)
    canvas = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    canvas.paste(img, ((image_size - img.width) // 2, (image_size - img.height) // 2))
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    return buf.getvalue()


def make_row(example: dict, *, split: str, index: int, png: bytes, reward: str, where: str) -> dict:
    instruction = example.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"{where}: missing or empty 'instruction'")
    target_text = example.get("target_text") or first_quoted_span(instruction)
    if not target_text:
        raise ValueError(f"{where}: no 'target_text' and the instruction has no double-quoted span: {instruction!r}")
    data_source, ground_truth = reward_fields(reward, instruction, target_text)
    return {
        "data_source": data_source,
        "prompt": chat_messages(BOOGU_TI2I_SYSTEM_PROMPT, f"Picture 1: <image>{instruction}"),
        "negative_prompt": chat_messages(BOOGU_TI2I_SYSTEM_PROMPT, ""),
        "ability": "image_edit",
        "images": [{"bytes": png}],
        "reward_model": {"style": "model", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "instruction": instruction, "image": str(example["image"]),
                       "target_text": target_text},
    }


def convert_split(input_dir: Path, split: str, *, image_size: int, reward: str, max_samples: int = -1) -> list[dict]:
    jsonl = input_dir / f"{split}.jsonl"
    rows = []
    with open(jsonl, encoding="utf-8") as f:
        for index, line in enumerate(f):
            if 0 <= max_samples <= len(rows):
                break
            if not line.strip():
                continue
            where = f"{jsonl}:{index + 1}"
            example = json.loads(line)
            if "image" not in example:
                raise ValueError(f"{where}: missing 'image'")
            image_path = input_dir / "images" / str(example["image"])
            if not image_path.is_file():
                raise FileNotFoundError(f"{where}: condition image not found: {image_path}")
            rows.append(make_row(example, split=split, index=index, png=letterbox_png(image_path, image_size),
                                 reward=reward, where=where))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_dir", type=Path, required=True, help="folder with {train,test}.jsonl and images/")
    p.add_argument("--output_dir", type=Path, required=True)
    p.add_argument("--image_size", type=int, default=512,
                   help="square canvas edge = rollout output size; multiple of 16, at most 2048")
    p.add_argument("--reward", choices=REWARD_ARMS, default="pickscore",
                   help="pickscore: ground_truth = instruction; ocr: ground_truth = target text (sets data_source)")
    p.add_argument("--splits", nargs="+", default=["train", "test"])
    p.add_argument("--max_samples", type=int, default=-1, help="per split; -1 = all")
    args = p.parse_args(argv)
    check_image_size(args.image_size)
    input_dir = args.input_dir.expanduser()
    counts = {}
    for split in args.splits:
        if not (input_dir / f"{split}.jsonl").is_file():
            print(f"{input_dir / f'{split}.jsonl'} not found, split {split!r} skipped", file=sys.stderr)
            continue
        rows = convert_split(input_dir, split, image_size=args.image_size, reward=args.reward,
                             max_samples=args.max_samples)
        write_parquet(rows, args.output_dir.expanduser() / f"{split}.parquet", EDIT_SCHEMA)
        counts[split] = len(rows)
    if not counts:
        raise FileNotFoundError(f"no {'/'.join(s + '.jsonl' for s in args.splits)} in {input_dir}")
    print(f"wrote {counts} rows (reward {args.reward}) to {args.output_dir}")


if __name__ == "__main__":
    run_cli(main)
