"""Flow-GRPO OCR prompts -> verl-omni parquet rows for Qwen-Image T2I.

    python data_prep/qwen_image_ocr.py --input_dir ~/data/ocr --output_dir ~/data/ocr/qwen_image

Same layout as verl-omni's qwenimage_ocr.py:
    prompt           [system: QWEN_IMAGE_SYSTEM_PROMPT, user: the prompt line verbatim]
    negative_prompt  [system: QWEN_IMAGE_SYSTEM_PROMPT, user: " "]  (one space)
    ability "ocr", reward_model {"style": "model", "ground_truth": first double-quoted span},
    extra_info {"split", "index"}
except `data_source`, which is "ocr" (the reward) instead of verl-omni's "flow_grpo/ocr": our reward scorer and
metric keys read data_source as the reward name. Lines without a quoted target are reported and skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.common import chat, convert_ocr_dir, run_cli
from data_prep.prompts import QWEN_IMAGE_SYSTEM_PROMPT


def make_row(line: str, target: str, split: str, index: int) -> dict:
    return {
        "data_source": "ocr",
        "prompt": chat(QWEN_IMAGE_SYSTEM_PROMPT, line),
        "negative_prompt": chat(QWEN_IMAGE_SYSTEM_PROMPT, " "),
        "ability": "ocr",
        "reward_model": {"style": "model", "ground_truth": target},
        "extra_info": {"split": split, "index": index},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_dir", type=Path, required=True, help="folder with train.txt / test.txt")
    p.add_argument("--output_dir", type=Path, required=True, help="where train.parquet / test.parquet go")
    p.add_argument("--splits", nargs="+", default=["train", "test"])
    args = p.parse_args(argv)
    counts = convert_ocr_dir(args.input_dir, args.output_dir, make_row, args.splits)
    print(f"wrote {counts} rows to {args.output_dir}")


if __name__ == "__main__":
    run_cli(main)
