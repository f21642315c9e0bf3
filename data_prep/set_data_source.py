"""Rewrite the `data_source` column of existing train/test parquet files in place (images untouched).

    python data_prep/set_data_source.py --dataset-dir ~/data/ocr/boogu_image_edit --data-source pickscore
    python data_prep/set_data_source.py --dataset-dir DIR1 --dataset-dir DIR2 --infer --dry-run

`data_source` names the reward that scores a row (trainers select the reward by it and put it in metric keys), so
datasets written with task or algorithm names (`flow_grpo/ocr`, `flow_grpo/ocr_edit`) must be relabelled.
--infer: a row whose stripped, lowercased reward_model.ground_truth starts with "change the text to" holds an
instruction -> "pickscore"; otherwise it holds a bare target word -> "ocr". An empty ground truth is an error.
Idempotent (a file whose values do not change is not rewritten); the column keeps its Arrow type; missing split
files are skipped; a file without a data_source column is an error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.common import run_cli  # noqa: E402
from rewards import REWARD_NAMES  # noqa: E402

DATA_SOURCES = REWARD_NAMES  # a row's data_source names the reward that scores it (rewards.REWARDS)
SPLITS = ("train", "test")
INSTRUCTION_PREFIX = "change the text to"


def infer_data_source(ground_truth: str | None, where: str) -> str:
    gt = (ground_truth or "").strip()
    if not gt:
        raise ValueError(f"{where}: empty reward_model.ground_truth, cannot infer the reward")
    return "pickscore" if gt.lower().startswith(INSTRUCTION_PREFIX) else "ocr"


def relabel_file(path: Path, *, data_source: str | None, infer: bool, dry_run: bool) -> bool:
    """Relabel one parquet file. Returns True when the file changed (or would change, with dry_run)."""
    table = pq.read_table(path)
    if "data_source" not in table.column_names:
        raise ValueError(f"{path}: no 'data_source' column")
    old = table.column("data_source").to_pylist()
    if infer:
        if "reward_model" not in table.column_names:
            raise ValueError(f"{path}: --infer needs a 'reward_model' column")
        gts = [(rm or {}).get("ground_truth") for rm in table.column("reward_model").to_pylist()]
        new = [infer_data_source(gt, f"{path} row {i}") for i, gt in enumerate(gts)]
    else:
        new = [data_source] * len(old)
    transitions: dict[tuple, int] = {}
    for o, n in zip(old, new):
        if o != n:
            transitions[(o, n)] = transitions.get((o, n), 0) + 1
    for (o, n), count in sorted(transitions.items(), key=str):
        print(f"{path}: {o!r} -> {n!r} ({count} rows)")
    if not transitions:
        print(f"{path}: unchanged")
        return False
    if dry_run:
        return True
    idx = table.column_names.index("data_source")
    field = table.schema.field(idx)
    column = pa.array(new, type=pa.string())
    if column.type != field.type:
        column = column.cast(field.type) if not pa.types.is_dictionary(field.type) else \
            column.dictionary_encode().cast(field.type)
    table = table.set_column(idx, field, column)
    meta = pq.ParquetFile(path).metadata
    row_group_size = meta.row_group(0).num_rows if meta.num_row_groups else None
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=row_group_size or None)
    tmp.replace(path)
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset-dir", type=Path, action="append", required=True,
                   help="folder with train.parquet / test.parquet (repeatable)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--data-source", choices=DATA_SOURCES, help="set every row to this reward")
    mode.add_argument("--infer", action="store_true", help="derive the reward per row from its ground truth")
    p.add_argument("--dry-run", action="store_true", help="print old -> new transitions, write nothing")
    args = p.parse_args(argv)
    for d in args.dataset_dir:
        d = d.expanduser()
        if not any((d / f"{split}.parquet").is_file() for split in SPLITS):
            raise FileNotFoundError(f"--dataset-dir {d} holds no {' or '.join(s + '.parquet' for s in SPLITS)}")
        for split in SPLITS:
            path = d / f"{split}.parquet"
            if not path.is_file():
                print(f"{path}: not found, skipped", file=sys.stderr)
                continue
            relabel_file(path, data_source=args.data_source, infer=args.infer, dry_run=args.dry_run)


if __name__ == "__main__":
    run_cli(main)
