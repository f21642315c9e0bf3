"""The demo / test datasets: our own OCR-style prompts (data_prep/demo_prompts.txt) converted with the model's
real converter, relabelled to a cheap CPU reward.

    python data_prep/make_demo_data.py --model boogu_image --output_dir outputs/demo_data
    python data_prep/make_demo_data.py --model boogu_image_edit --output_dir outputs/demo_edit_data

Writes `<output_dir>/{train,test}.parquet`; the first `--num_test` prompts go to test, the rest to train.
`--data_source` (default jpeg_compressibility, DDPO's reward) replaces the converter's "ocr" label, since
data_source names the reward that scores the rows; use `ocr` with an OCR reward backend.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep import boogu_image_edit_ocr, make_text_edit_data, ocr  # noqa: E402
from data_prep.common import EDIT_SCHEMA, convert_ocr_dir, read_prompt_lines, run_cli, write_parquet  # noqa: E402
from data_prep.set_data_source import DATA_SOURCES, relabel_file  # noqa: E402
from models import FAMILY_NAMES  # noqa: E402

DEMO_PROMPTS = Path(__file__).resolve().parent / "demo_prompts.txt"
MODELS = (*FAMILY_NAMES, "boogu_image_edit")  # every family's text-to-image rows, and Boogu-Image Edit's edit rows


def make_demo_data(output_dir: Path, *, model: str, data_source: str = "jpeg_compressibility", num_test: int = 8,
                   image_size: int = 64, num_edit: int = 32) -> dict[str, int]:
    """Write train/test parquet files for `model` and return their row counts."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if data_source not in DATA_SOURCES:
        raise ValueError(f"data_source must be one of {DATA_SOURCES}, got {data_source!r}")
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if model == "boogu_image_edit":
            make_text_edit_data.make_dataset(tmp, num_train=num_edit, num_test=num_test, image_size=image_size,
                                             seed=0)
            counts = {}
            for split in ("train", "test"):
                rows = boogu_image_edit_ocr.convert_split(tmp, split, image_size=image_size, reward="pickscore")
                write_parquet(rows, output_dir / f"{split}.parquet", EDIT_SCHEMA)
                counts[split] = len(rows)
        else:
            lines = read_prompt_lines(DEMO_PROMPTS)
            (tmp / "test.txt").write_text("\n".join(lines[:num_test]) + "\n", encoding="utf-8")
            (tmp / "train.txt").write_text("\n".join(lines[num_test:]) + "\n", encoding="utf-8")
            counts = convert_ocr_dir(tmp, output_dir, functools.partial(ocr.make_row, model=model))
    for split in ("train", "test"):
        relabel_file(output_dir / f"{split}.parquet", data_source=data_source, infer=False, dry_run=False)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="boogu_image", choices=MODELS)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--data_source", default="jpeg_compressibility", choices=DATA_SOURCES)
    parser.add_argument("--num_test", type=int, default=8, help="prompts held out for validation")
    parser.add_argument("--image_size", type=int, default=64, help="edit reference images (multiple of 16)")
    args = parser.parse_args(argv)
    counts = make_demo_data(Path(args.output_dir), model=args.model, data_source=args.data_source,
                            num_test=args.num_test, image_size=args.image_size)
    print(f"wrote {counts} rows to {args.output_dir} (data_source={args.data_source})")


if __name__ == "__main__":
    run_cli(main)
