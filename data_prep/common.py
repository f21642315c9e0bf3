"""Helpers shared by the parquet converters (no torch imports)."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PARQUET_ROW_GROUP_SIZE = 500

# Explicit Arrow types, so field order is the verl-omni one ({"role", "content"}) and every file has one schema.
MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
REWARD_MODEL = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
IMAGES = pa.list_(pa.struct([("bytes", pa.binary())]))
T2I_SCHEMA = pa.schema([
    ("data_source", pa.string()), ("prompt", MESSAGES), ("negative_prompt", MESSAGES), ("ability", pa.string()),
    ("reward_model", REWARD_MODEL), ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
])
EDIT_SCHEMA = pa.schema([
    ("data_source", pa.string()), ("prompt", MESSAGES), ("negative_prompt", MESSAGES), ("ability", pa.string()),
    ("images", IMAGES), ("reward_model", REWARD_MODEL),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("instruction", pa.string()),
                              ("image", pa.string()), ("target_text", pa.string())])),
])


def run_cli(main, argv: list[str] | None = None) -> None:
    """Run a converter's `main(argv)`; a bad input (a missing folder or file, an empty or malformed dataset) ends it
    with one line, `<script>: error: <reason>`, and exit status 2 instead of a traceback."""
    try:
        main(argv)
    except (FileNotFoundError, NotADirectoryError, PermissionError, ValueError, KeyError) as e:
        reason = e.args[0] if isinstance(e, KeyError) and e.args else e
        if isinstance(e, OSError) and e.filename and str(e.filename) not in str(reason):
            reason = f"{e.filename}: {e.strerror}"
        print(f"{Path(sys.argv[0]).name}: error: {reason}", file=sys.stderr)
        sys.exit(2)


def first_quoted_span(text: str) -> str | None:
    """The first double-quoted span of `text` (flow_grpo / verl-omni: `text.split('"')[1]`), or None when the text
    has no complete pair of ASCII double quotes or the span is empty or blank."""
    parts = text.split('"')
    if len(parts) < 3 or not parts[1].strip():
        return None
    return parts[1]


def read_prompt_lines(path: Path) -> list[str]:
    """One prompt per line, stripped (flow_grpo's TextPromptDataset); blank lines are dropped."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def write_parquet(rows: list[dict], path: Path, schema: pa.Schema) -> None:
    """Write rows (nested dicts / lists) with pyarrow under `schema` (atomic: temp file, then rename)."""
    if not rows:
        raise ValueError(f"refusing to write an empty dataset to {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=PARQUET_ROW_GROUP_SIZE)
    tmp.replace(path)


def warn(msg: str) -> None:
    print(msg, file=sys.stderr)


def convert_ocr_prompt_file(path: Path, split: str, make_row) -> tuple[list[dict], list[int]]:
    """Turn a Flow-GRPO OCR prompt file into rows. `make_row(line, target, split, index)` builds one row; lines
    without a quoted target are reported on stderr and skipped. Returns (rows, skipped 0-based line indices).
    `index` is the prompt's position in the file (so skipped lines leave gaps, and every row traces back)."""
    rows, skipped = [], []
    for index, line in enumerate(read_prompt_lines(path)):
        target = first_quoted_span(line)
        if target is None:
            skipped.append(index)
            warn(f"{path}: prompt {index} has no double-quoted target text, skipped: {line[:120]!r}")
            continue
        rows.append(make_row(line, target, split, index))
    if skipped:
        warn(f"{path}: skipped {len(skipped)} of {len(rows) + len(skipped)} prompts without a quoted target")
    return rows, skipped


def convert_ocr_dir(input_dir: Path, output_dir: Path, make_row, splits=("train", "test")) -> dict[str, int]:
    """Convert `<input_dir>/<split>.txt` for each split that exists into `<output_dir>/<split>.parquet`."""
    input_dir, output_dir = Path(input_dir).expanduser(), Path(output_dir).expanduser()
    counts = {}
    for split in splits:
        src = input_dir / f"{split}.txt"
        if not src.is_file():
            warn(f"{src} not found, split {split!r} skipped")
            continue
        rows, _ = convert_ocr_prompt_file(src, split, make_row)
        write_parquet(rows, output_dir / f"{split}.parquet", T2I_SCHEMA)
        counts[split] = len(rows)
    if not counts:
        raise FileNotFoundError(f"no {'/'.join(s + '.txt' for s in splits)} in {input_dir}")
    return counts
