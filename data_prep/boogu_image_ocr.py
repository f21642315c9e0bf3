"""Flow-GRPO OCR prompts -> verl-omni parquet rows for Boogu-Image T2I (DiffusionNFT / Flow-GRPO / Flow-DPPO).

    python data_prep/boogu_image_ocr.py --input_dir ~/data/ocr --output_dir ~/data/ocr/boogu_image

Input: `<input_dir>/{train,test}.txt`, one Flow-GRPO OCR prompt per line. Output `<output_dir>/{split}.parquet`:
    data_source      "ocr"  (the reward that scores the row)
    prompt           [system: BOOGU_T2I_SYSTEM_PROMPT, user: the prompt line verbatim, quotes kept]
    negative_prompt  [system: BOOGU_TI2I_SYSTEM_PROMPT, user: ""]
    ability          "ocr"
    reward_model     {"style": "model", "ground_truth": the first double-quoted span (bare target text)}
    extra_info       {"split", "index" (line position in the input file)}
The negative uses the TI2I system prompt ON PURPOSE: the released Boogu pipeline encodes every empty instruction,
including the default negative "", with it. Do not "fix" it. Lines without a quoted target are reported and skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.common import chat, convert_ocr_dir, run_cli
from data_prep.prompts import BOOGU_T2I_SYSTEM_PROMPT, BOOGU_TI2I_SYSTEM_PROMPT


def make_row(line: str, target: str, split: str, index: int) -> dict:
    return {
        "data_source": "ocr",
        "prompt": chat(BOOGU_T2I_SYSTEM_PROMPT, line),
        "negative_prompt": chat(BOOGU_TI2I_SYSTEM_PROMPT, ""),
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
