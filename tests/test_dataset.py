"""data_prep/dataset.py: the shared prompt dataset and its fail-closed validation."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from data_prep import boogu_image_edit_ocr, make_text_edit_data, ocr
from data_prep.dataset import DatasetError, PromptDataset

REPO = Path(__file__).resolve().parents[1]
SYS = "system prompt"


def png(color=(255, 0, 0), size=(16, 16)) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return {"bytes": buf.getvalue()}


def row(user="A sign that says \"OPEN\"", negative=(SYS, ""), images=None, gt="OPEN", ds="ocr", extra=None):
    r = {
        "data_source": ds,
        "prompt": [{"role": "system", "content": SYS}, {"role": "user", "content": user}],
        "negative_prompt": None if negative is None else [{"role": "system", "content": negative[0]},
                                                          {"role": "user", "content": negative[1]}],
        "reward_model": {"style": "model", "ground_truth": gt},
        "extra_info": extra if extra is not None else {"split": "test", "index": 0},
    }
    if images is not None:
        r["images"] = images
    return r


def write(tmp_path: Path, rows: list[dict], name="test.parquet") -> Path:
    path = tmp_path / name
    keys = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist would take the first row's keys only
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), path)
    return path


# ------------------------------------------------------------------------------------------------------------------
# Good files (from the converters)
# ------------------------------------------------------------------------------------------------------------------

def test_t2i_dataset_from_converter(tmp_path):
    (tmp_path / "in").mkdir()
    lines = (REPO / "data_prep" / "demo_prompts.txt").read_text().splitlines()
    (tmp_path / "in" / "train.txt").write_text("\n".join(lines))
    ocr.main(["--model", "boogu_image", "--input_dir", str(tmp_path / "in"), "--output_dir", str(tmp_path), "--splits",
              "train"])
    ds = PromptDataset(tmp_path / "train.parquet", guidance=True, data_sources=("ocr", "pickscore"))
    assert len(ds) == len(lines)
    r = ds[10]
    assert r.index == 10 and r.prompt[1]["content"] == lines[10]
    assert r.negative_prompt[1] == {"role": "user", "content": ""}
    assert r.ground_truth == lines[10].split('"')[1] and r.data_source == "ocr"
    assert r.images == [] and r.extra_info == {"split": "train", "index": 10}
    assert ds[-1].index == len(lines) - 1
    with pytest.raises(IndexError, match="out of range"):
        ds[len(lines)]


def test_edit_dataset_from_converter(tmp_path):
    make_text_edit_data.main(["--output_dir", str(tmp_path / "src"), "--num_train", "2", "--num_test", "1",
                              "--image_size", "64"])
    boogu_image_edit_ocr.main(["--input_dir", str(tmp_path / "src"), "--output_dir", str(tmp_path / "pq"),
                               "--image_size", "48", "--reward", "pickscore"])
    ds = PromptDataset(tmp_path / "pq" / "train.parquet", guidance=True)
    r = ds[1]
    assert len(r.images) == 1 and r.images[0].size == (48, 48) and r.images[0].mode == "RGB"
    assert "<image>" in r.prompt[1]["content"] and "<image>" not in r.negative_prompt[1]["content"]
    assert r.ground_truth == r.extra_info["instruction"] and r.data_source == "pickscore"


def test_negative_may_consume_all_images(tmp_path):
    ds = PromptDataset(write(tmp_path, [row(user="Picture 1: <image>edit", negative=(SYS, "Picture 1: <image> "),
                                            images=[png()])]), guidance=True)
    assert len(ds[0].images) == 1


def test_no_guidance_allows_missing_negative(tmp_path):
    path = write(tmp_path, [row(negative=None), row()])
    ds = PromptDataset(path, guidance=False)
    assert ds[0].negative_prompt is None and ds[1].negative_prompt is not None
    no_col = tmp_path / "nocol.parquet"
    pq.write_table(pq.read_table(path).drop(["negative_prompt"]), no_col)
    assert PromptDataset(no_col, guidance=False)[0].negative_prompt is None


# ------------------------------------------------------------------------------------------------------------------
# Bad inputs: each names the file, the row and the column
# ------------------------------------------------------------------------------------------------------------------

def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        PromptDataset(tmp_path / "nope.parquet", guidance=False)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not a parquet file")
    with pytest.raises(DatasetError, match="bad.parquet: not a readable parquet"):
        PromptDataset(bad, guidance=False)


def test_missing_columns(tmp_path):
    path = write(tmp_path, [row()])
    for col in ("prompt", "reward_model", "data_source"):
        p = tmp_path / f"no_{col}.parquet"
        pq.write_table(pq.read_table(path).drop([col]), p)
        with pytest.raises(DatasetError, match=rf"no_{col}.parquet: column '{col}' is missing"):
            PromptDataset(p, guidance=False)
    p = tmp_path / "no_neg.parquet"
    pq.write_table(pq.read_table(path).drop(["negative_prompt"]), p)
    with pytest.raises(DatasetError, match="'negative_prompt' is missing but guidance is on"):
        PromptDataset(p, guidance=True)


@pytest.mark.parametrize("negative", [None, "empty"])
def test_guidance_without_negative_fails_closed(tmp_path, negative):
    rows = [row(), row(), row(), row(negative=None)]
    if negative == "empty":
        rows[3]["negative_prompt"] = []
    path = write(tmp_path, rows)
    with pytest.raises(DatasetError, match=rf"{path}: row 3, column 'negative_prompt': no negative prompt but "
                                           r"guidance is on"):
        PromptDataset(path, guidance=True)


@pytest.mark.parametrize("kwargs,col,match", [
    (dict(user="Picture 1: <image>edit"), "prompt", r"1 <image> placeholder\(s\) but the row carries 0 image"),
    (dict(user="edit without placeholder", images=[png()]), "prompt", r"0 <image> placeholder\(s\) but .* 1 image"),
    (dict(user="<image><image>two", images=[png()]), "prompt", r"2 <image> placeholder\(s\)"),
    (dict(user="<image><image>two", negative=(SYS, "<image>"), images=[png(), png()]), "negative_prompt",
     r"1 <image> placeholder\(s\) for 2 image\(s\)"),
    (dict(user="<video>clip"), "prompt", "<video> placeholders are not supported"),
    (dict(negative=(SYS, "<audio>")), "negative_prompt", "<audio> placeholders are not supported"),
    (dict(gt=None), "reward_model", "expected a struct with a string 'ground_truth'"),
    (dict(ds=""), "data_source", "expected a non-empty string"),
])
def test_row_errors(tmp_path, kwargs, col, match):
    path = write(tmp_path, [row(), row(**kwargs)])  # row 0 is valid (no images column value = no images)
    with pytest.raises(DatasetError, match=rf"row 1, column '{col}': {match}"):
        PromptDataset(path, guidance=True)


def test_message_structure_errors(tmp_path):
    bad_role = row()
    bad_role["prompt"][0]["role"] = "narrator"
    with pytest.raises(DatasetError, match=r"row 0, column 'prompt': bad message"):
        PromptDataset(write(tmp_path, [bad_role], "a.parquet"), guidance=False)
    no_user = row()
    no_user["prompt"] = no_user["prompt"][:1]
    with pytest.raises(DatasetError, match=r"row 0, column 'prompt': no user message"):
        PromptDataset(write(tmp_path, [no_user], "b.parquet"), guidance=False)
    empty = row()
    empty["prompt"] = []
    with pytest.raises(DatasetError, match=r"row 0, column 'prompt': expected a non-empty list"):
        PromptDataset(write(tmp_path, [empty], "c.parquet"), guidance=False)


def test_unknown_data_source(tmp_path):
    path = write(tmp_path, [row(), row(ds="flow_grpo/ocr")])
    with pytest.raises(DatasetError, match=r"row 1, column 'data_source': 'flow_grpo/ocr' names no known reward"
                                           r".*set_data_source.py"):
        PromptDataset(path, guidance=True, data_sources=("ocr", "pickscore"))
    assert PromptDataset(path, guidance=True)[1].data_source == "flow_grpo/ocr"  # no check unless asked


def test_corrupt_image_fails_on_access(tmp_path):
    path = write(tmp_path, [row(user="<image>x", images=[png()]), row(user="<image>x", images=[{"bytes": b"junk"}])])
    ds = PromptDataset(path, guidance=True)
    assert ds[0].images[0].getpixel((0, 0)) == (255, 0, 0)
    with pytest.raises(DatasetError, match=rf"{path}: row 1, column 'images': image 0 cannot be decoded"):
        ds[1]


def test_empty_dataset(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([row()]).slice(0, 0), path)
    with pytest.raises(DatasetError, match="no rows"):
        PromptDataset(path, guidance=False)
