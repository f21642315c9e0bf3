"""Flow-GRPO OCR prompts -> verl-omni parquet rows for a text-to-image model family.

    python data_prep/ocr.py --model qwen_image --input_dir ~/data/ocr --output_dir ~/data/ocr/qwen_image
    python data_prep/ocr.py --model boogu_image --input_dir ~/data/ocr --output_dir ~/data/ocr/boogu_image

Input: `<input_dir>/{train,test}.txt`, one Flow-GRPO OCR prompt per line. Output `<output_dir>/{split}.parquet`:
    data_source      "ocr"  (the reward that scores the row)
    prompt           [system, user: the prompt line verbatim, quotes kept]
    negative_prompt  [system, user: the family's empty negative]
    ability          "ocr"
    reward_model     {"style": "model", "ground_truth": the first double-quoted span (bare target text)}
    extra_info       {"split", "index" (line position in the input file)}
Both chats are the family's released layout (`FlowModel.released_chat`) of the line and of the family's default
negative prompt:
    qwen_image   prompt [QWEN_IMAGE_SYSTEM_PROMPT, line], negative [QWEN_IMAGE_SYSTEM_PROMPT, " "] (one space), as
                 verl-omni's qwenimage_ocr.py
    boogu_image  prompt [BOOGU_T2I_SYSTEM_PROMPT, line], negative [BOOGU_TI2I_SYSTEM_PROMPT, ""]
The Boogu negative uses the TI2I system prompt ON PURPOSE: the released Boogu pipeline encodes every empty
instruction, including the default negative "", with it. Do not "fix" it. `data_source` is "ocr" (the reward)
instead of verl-omni's "flow_grpo/ocr": our reward scorer and metric keys read data_source as the reward name. Lines
without a quoted target are reported and skipped.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.common import convert_ocr_dir, run_cli
from models import FAMILY_NAMES, family_class


def make_row(line: str, target: str, split: str, index: int, *, model: str) -> dict:
    """The parquet row of one OCR prompt `line` (its quoted `target`) for the model family `model`."""
    cls = family_class(model)
    return {
        "data_source": "ocr",
        "prompt": cls.released_chat(line),
        "negative_prompt": cls.released_chat(cls.default_negative_prompt),
        "ability": "ocr",
        "reward_model": {"style": "model", "ground_truth": target},
        "extra_info": {"split": split, "index": index},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=FAMILY_NAMES, help="the model family the rows are for")
    p.add_argument("--input_dir", type=Path, required=True, help="folder with train.txt / test.txt")
    p.add_argument("--output_dir", type=Path, required=True, help="where train.parquet / test.parquet go")
    p.add_argument("--splits", nargs="+", default=["train", "test"])
    args = p.parse_args(argv)
    counts = convert_ocr_dir(args.input_dir, args.output_dir, functools.partial(make_row, model=args.model),
                             args.splits)
    print(f"wrote {counts} rows to {args.output_dir}")


if __name__ == "__main__":
    run_cli(main)
