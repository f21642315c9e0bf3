"""data_prep converters: ground truth extraction, schema, the Boogu negative quirk, the two edit --reward arms,
set_data_source.py, and the synthetic edit data."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from data_prep import boogu_image_edit_ocr, make_text_edit_data, ocr, set_data_source
from data_prep.common import first_quoted_span
from models.boogu_image import BOOGU_T2I_SYSTEM_PROMPT, BOOGU_TI2I_SYSTEM_PROMPT
from models.qwen_image import QWEN_IMAGE_SYSTEM_PROMPT

REPO = Path(__file__).resolve().parents[1]
DEMO_PROMPTS = REPO / "data_prep" / "demo_prompts.txt"
SHARED_OCR_TEST = (REPO / ".." / "shared" / "data" / "ocr" / "test.txt").resolve()


def prompt_sets():
    """Our own prompt set always; the Flow-GRPO test split (1,018 real prompts) when the checkout has it."""
    sets = [pytest.param(DEMO_PROMPTS, id="demo_prompts")]
    sets.append(pytest.param(SHARED_OCR_TEST, id="flow_grpo_test", marks=pytest.mark.skipif(
        not SHARED_OCR_TEST.is_file(), reason=f"{SHARED_OCR_TEST} is absent from this checkout")))
    return sets


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def msgs(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@pytest.mark.parametrize("text,expected", [
    ('A sign that reads "Fresh Bread" in gold', "Fresh Bread"),
    ('two "first" and "second"', "first"),
    ('A poster with "  spaced  "', "  spaced  "),   # kept verbatim; the OCR score strips whitespace itself
    ("no quotes at all", None),
    ('only one " quote', None),
    ('an empty "" span', None),
])
def test_first_quoted_span(text, expected):
    assert first_quoted_span(text) == expected


def test_demo_prompts_are_ours_and_usable():
    lines = DEMO_PROMPTS.read_text().splitlines()
    assert len(lines) >= 64
    assert all(first_quoted_span(line) for line in lines)


@pytest.mark.parametrize("prompt_file", prompt_sets())
@pytest.mark.parametrize("family", ["boogu", "qwen"])
def test_t2i_converters_on_real_prompts(prompt_file, family, tmp_path):
    lines = [line.strip() for line in prompt_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "test.txt").write_text("\n".join(lines), encoding="utf-8")
    model = "boogu_image" if family == "boogu" else "qwen_image"
    ocr.main(["--model", model, "--input_dir", str(tmp_path / "in"), "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out" / "train.parquet").exists()  # no train.txt -> split skipped, not invented
    table = pq.read_table(tmp_path / "out" / "test.parquet")
    assert table.column_names == ["data_source", "prompt", "negative_prompt", "ability", "reward_model",
                                  "extra_info"]
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    assert table.schema.field("prompt").type.value_type == message
    assert table.schema.field("negative_prompt").type.value_type == message
    assert table.schema.field("extra_info").type == pa.struct([("split", pa.string()), ("index", pa.int64())])
    rows = table.to_pylist()
    assert len(rows) == len(lines)
    for i, (row, line) in enumerate(zip(rows, lines)):
        assert row["data_source"] == "ocr" and row["ability"] == "ocr"
        assert row["reward_model"] == {"style": "model", "ground_truth": line.split('"')[1]}
        assert row["extra_info"] == {"split": "test", "index": i}
        if family == "boogu":
            assert row["prompt"] == msgs(BOOGU_T2I_SYSTEM_PROMPT, line)  # raw line, quotes kept
            # The quirk, on purpose: the empty negative uses the TI2I system prompt, not the T2I one.
            assert row["negative_prompt"] == msgs(BOOGU_TI2I_SYSTEM_PROMPT, "")
        else:
            assert row["prompt"] == msgs(QWEN_IMAGE_SYSTEM_PROMPT, line)
            assert row["negative_prompt"] == msgs(QWEN_IMAGE_SYSTEM_PROMPT, " ")


# The system prompts spelled out (not read from models/), so that a changed constant fails here: the parquet rows must
# stay what the two per-family converters (data_prep/qwen_image_ocr.py, boogu_image_ocr.py) wrote before ocr.py.
QWEN_SYSTEM = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
               "relationships of the objects and background:")
BOOGU_T2I_SYSTEM = ("You are a helpful assistant that generates high-quality images based on user instructions. "
                    "The instructions are as follows.")
BOOGU_TI2I_SYSTEM = ("Describe the key features of the input image (color, shape, size, texture, objects, background), "
                     "then explain how the user's text instruction should alter or modify the image. Generate a new "
                     "image that meets the user's requirements while maintaining consistency with the original input "
                     "where appropriate.")


@pytest.mark.parametrize("model, system, negative", [
    ("qwen_image", QWEN_SYSTEM, [{"role": "system", "content": QWEN_SYSTEM}, {"role": "user", "content": " "}]),
    # the Boogu quirk: the empty negative takes the TI2I system prompt, not the T2I one
    ("boogu_image", BOOGU_T2I_SYSTEM, [{"role": "system", "content": BOOGU_TI2I_SYSTEM},
                                       {"role": "user", "content": ""}]),
])
def test_ocr_rows_of_each_family_are_exactly_the_old_converters(model, system, negative, tmp_path):
    """data_prep/ocr.py --model writes, per family, exactly the rows of the converter it replaced (make_row and the
    parquet read back), key order included."""
    line = 'A neon sign that reads "Open Late" above a diner door'
    expected = {
        "data_source": "ocr",
        "prompt": [{"role": "system", "content": system}, {"role": "user", "content": line}],
        "negative_prompt": negative,
        "ability": "ocr",
        "reward_model": {"style": "model", "ground_truth": "Open Late"},
        "extra_info": {"split": "train", "index": 1},
    }
    row = ocr.make_row(line, "Open Late", "train", 1, model=model)
    assert row == expected and list(row) == list(expected)
    assert [list(m) for m in row["prompt"] + row["negative_prompt"]] == [["role", "content"]] * 4
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "train.txt").write_text(f"no quoted text here\n{line}\n", encoding="utf-8")
    ocr.main(["--model", model, "--input_dir", str(tmp_path / "in"), "--output_dir", str(tmp_path / "out")])
    assert read_rows(tmp_path / "out" / "train.parquet") == [expected]


def test_ocr_converter_needs_a_known_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ocr.main(["--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "out")])
    assert "--model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ocr.main(["--model", "flux", "--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "out")])


def test_t2i_rows_without_quote_are_reported_and_skipped(tmp_path, capsys):
    lines = DEMO_PROMPTS.read_text().splitlines()[:5]
    lines.insert(1, "A landscape with no text at all")
    lines.insert(4, 'A sign with a dangling " quote')
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "train.txt").write_text("\n".join(lines), encoding="utf-8")
    ocr.main(["--model", "boogu_image", "--input_dir", str(tmp_path / "in"), "--output_dir", str(tmp_path / "out"),
              "--splits", "train"])
    err = capsys.readouterr().err
    assert "prompt 1 has no double-quoted target" in err and "prompt 4 has no double-quoted target" in err
    assert "skipped 2 of 7" in err
    rows = read_rows(tmp_path / "out" / "train.parquet")
    assert [r["extra_info"]["index"] for r in rows] == [0, 2, 3, 5, 6]  # positions in the input file
    assert [r["prompt"][1]["content"] for r in rows] == [lines[i] for i in (0, 2, 3, 5, 6)]


def test_t2i_converter_without_inputs_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="train.txt/test.txt"):
        ocr.main(["--model", "boogu_image", "--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "out")])


# ------------------------------------------------------------------------------------------------------------------
# Edit data
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def edit_source(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("edit_src")
    make_text_edit_data.main(["--output_dir", str(out), "--num_train", "3", "--num_test", "2", "--image_size",
                              "96", "--seed", "1"])
    return out


def test_make_text_edit_data_layout(edit_source, tmp_path):
    lines = [json.loads(line) for line in (edit_source / "train.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    for ex in lines:
        assert ex["instruction"] == f'Change the text to "{ex["target_text"]}"'
        assert ex["source_text"] != ex["target_text"]
        with Image.open(edit_source / "images" / ex["image"]) as img:
            assert img.size == (96, 96)
    again = tmp_path / "again"
    make_text_edit_data.main(["--output_dir", str(again), "--num_train", "3", "--num_test", "2", "--image_size",
                              "96", "--seed", "1"])
    assert (again / "train.jsonl").read_text() == (edit_source / "train.jsonl").read_text()  # deterministic
    assert (again / "images" / "000001.png").read_bytes() == (edit_source / "images" / "000001.png").read_bytes()


@pytest.mark.parametrize("reward", ["pickscore", "ocr"])
def test_edit_converter_reward_arms(edit_source, tmp_path, reward):
    boogu_image_edit_ocr.main(["--input_dir", str(edit_source), "--output_dir", str(tmp_path), "--image_size",
                               "64", "--reward", reward])
    sources = {s: [json.loads(x) for x in (edit_source / f"{s}.jsonl").read_text().splitlines()]
               for s in ("train", "test")}
    for split, examples in sources.items():
        table = pq.read_table(tmp_path / f"{split}.parquet")
        assert table.schema.field("images").type.value_type == pa.struct([("bytes", pa.binary())])
        rows = table.to_pylist()
        assert len(rows) == len(examples)
        for i, (row, ex) in enumerate(zip(rows, examples)):
            if reward == "pickscore":
                assert row["data_source"] == "pickscore"
                assert row["reward_model"]["ground_truth"] == ex["instruction"]
            else:
                assert row["data_source"] == "ocr"
                assert row["reward_model"]["ground_truth"] == ex["target_text"]
            assert row["ability"] == "image_edit"
            assert row["prompt"] == msgs(BOOGU_TI2I_SYSTEM_PROMPT, f"Picture 1: <image>{ex['instruction']}")
            assert row["negative_prompt"] == msgs(BOOGU_TI2I_SYSTEM_PROMPT, "")  # text-only negative
            assert row["extra_info"] == {"split": split, "index": i, "instruction": ex["instruction"],
                                         "image": ex["image"], "target_text": ex["target_text"]}
            (image,) = row["images"]
            img = Image.open(io.BytesIO(image["bytes"]))
            assert img.format == "PNG" and img.size == (64, 64)


def test_reward_fields_is_the_single_switch():
    assert boogu_image_edit_ocr.reward_fields("pickscore", 'Change the text to "A"', "A") == (
        "pickscore", 'Change the text to "A"')
    assert boogu_image_edit_ocr.reward_fields("ocr", 'Change the text to "A"', "A") == ("ocr", "A")
    with pytest.raises(ValueError, match="--reward"):
        boogu_image_edit_ocr.reward_fields("clip", "x", "y")


def test_edit_letterbox_keeps_aspect_on_white(tmp_path):
    src = tmp_path / "wide.png"
    Image.new("RGB", (200, 100), (255, 0, 0)).save(src)
    img = Image.open(io.BytesIO(boogu_image_edit_ocr.letterbox_png(src, 64))).convert("RGB")
    assert img.size == (64, 64)
    assert img.getpixel((32, 32)) == (255, 0, 0) and img.getpixel((32, 2)) == (255, 255, 255)


@pytest.mark.parametrize("size", [0, 100, 2064, -16])
def test_edit_image_size_validated(edit_source, tmp_path, size):
    with pytest.raises(ValueError, match="multiple of 16"):
        boogu_image_edit_ocr.main(["--input_dir", str(edit_source), "--output_dir", str(tmp_path),
                                   "--image_size", str(size)])


def test_edit_converter_errors_name_the_line(tmp_path):
    (tmp_path / "images").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "images" / "a.png")
    (tmp_path / "train.jsonl").write_text(
        json.dumps({"image": "a.png", "instruction": 'Change the text to "OK"'}) + "\n"
        + json.dumps({"image": "a.png", "instruction": "Make it nicer"}) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl:2: no 'target_text'"):
        boogu_image_edit_ocr.main(["--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                                   "--splits", "train"])
    (tmp_path / "train.jsonl").write_text(json.dumps({"image": "missing.png", "instruction": '"X"'}) + "\n")
    with pytest.raises(FileNotFoundError, match=r"train.jsonl:1: condition image not found"):
        boogu_image_edit_ocr.main(["--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                                   "--splits", "train"])
    # An explicit target_text wins over the quoted span.
    (tmp_path / "train.jsonl").write_text(
        json.dumps({"image": "a.png", "instruction": "Make it say hi", "target_text": "hi"}) + "\n")
    boogu_image_edit_ocr.main(["--input_dir", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                               "--splits", "train", "--reward", "ocr", "--image_size", "32"])
    assert read_rows(tmp_path / "o" / "train.parquet")[0]["reward_model"]["ground_truth"] == "hi"


# ------------------------------------------------------------------------------------------------------------------
# set_data_source.py
# ------------------------------------------------------------------------------------------------------------------

def test_set_data_source_relabels_in_place_idempotently(edit_source, tmp_path, capsys):
    boogu_image_edit_ocr.main(["--input_dir", str(edit_source), "--output_dir", str(tmp_path), "--image_size",
                               "32", "--reward", "pickscore"])
    path = tmp_path / "train.parquet"
    before = pq.read_table(path)
    set_data_source.main(["--dataset-dir", str(tmp_path), "--data-source", "ocr", "--dry-run"])
    assert "'pickscore' -> 'ocr' (3 rows)" in capsys.readouterr().out
    assert pq.read_table(path).equals(before)  # dry run writes nothing

    set_data_source.main(["--dataset-dir", str(tmp_path), "--data-source", "ocr"])
    after = pq.read_table(path)
    assert after.column("data_source").to_pylist() == ["ocr"] * 3
    assert after.drop(["data_source"]).equals(before.drop(["data_source"]))  # image bytes etc. untouched
    assert after.schema.equals(before.schema)

    stat = path.stat()
    set_data_source.main(["--dataset-dir", str(tmp_path), "--data-source", "ocr"])
    assert "unchanged" in capsys.readouterr().out
    assert path.stat().st_mtime_ns == stat.st_mtime_ns  # idempotent: not rewritten


@pytest.mark.parametrize("arrow_type", [pa.string(), pa.large_string(), pa.dictionary(pa.int32(), pa.string())])
def test_set_data_source_infer_keeps_arrow_type(tmp_path, arrow_type):
    gts = ['Change the text to "OPEN"', "OPEN", '  change the TEXT to "x"', "Spring Collection 2024"]
    table = pa.table({
        "data_source": pa.array(["flow_grpo/ocr_edit"] * 4, type=pa.string()).cast(arrow_type)
        if not pa.types.is_dictionary(arrow_type) else pa.array(["flow_grpo/ocr_edit"] * 4).dictionary_encode()
        .cast(arrow_type),
        "reward_model": [{"style": "model", "ground_truth": g} for g in gts],
    })
    pq.write_table(table, tmp_path / "test.parquet")
    set_data_source.main(["--dataset-dir", str(tmp_path), "--infer"])  # train.parquet missing: skipped
    out = pq.read_table(tmp_path / "test.parquet")
    assert out.column("data_source").to_pylist() == ["pickscore", "ocr", "pickscore", "ocr"]
    assert out.schema.field("data_source").type == pq.read_schema(tmp_path / "test.parquet").field(
        "data_source").type == table.schema.field("data_source").type


def test_set_data_source_errors(tmp_path):
    pq.write_table(pa.table({"data_source": ["ocr"], "reward_model": [{"ground_truth": "  "}]}),
                   tmp_path / "train.parquet")
    with pytest.raises(ValueError, match="row 0: empty reward_model.ground_truth"):
        set_data_source.main(["--dataset-dir", str(tmp_path), "--infer"])
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "train.parquet")
    with pytest.raises(ValueError, match="no 'data_source' column"):
        set_data_source.main(["--dataset-dir", str(tmp_path), "--data-source", "ocr"])
    with pytest.raises(SystemExit):  # exactly one of --data-source / --infer
        set_data_source.main(["--dataset-dir", str(tmp_path)])


def test_synthetic_edit_scenes_are_legible_to_ocr(tmp_path):
    """The rendered source word must be readable, or the OCR arm of the edit demo has nothing to learn from."""
    import numpy as np
    import torch

    import rewards
    from data_prep.dataset import PromptDataset

    make_text_edit_data.main(["--output_dir", str(tmp_path / "src"), "--num_train", "2", "--num_test", "1",
                              "--image_size", "256", "--seed", "3"])
    boogu_image_edit_ocr.main(["--input_dir", str(tmp_path / "src"), "--output_dir", str(tmp_path / "pq"),
                               "--image_size", "256", "--reward", "ocr", "--splits", "train"])
    ds = PromptDataset(tmp_path / "pq" / "train.parquet", guidance=True)
    sources = [json.loads(x)["source_text"] for x in (tmp_path / "src" / "train.jsonl").read_text().splitlines()]
    images = [torch.from_numpy(np.array(ds[i].images[0])).permute(2, 0, 1) for i in range(len(ds))]
    scorer = rewards.RewardScorer(rewards.RewardConfig(ocr_backend="rapidocr"))
    res = scorer.score_batch(images, sources, ["ocr"] * len(ds))
    assert res.rewards.tolist() == [1.0] * len(ds), res.texts
    # ...and the ground truth of the OCR arm is the new word, which the source image does not show.
    targets = [ds[i].ground_truth for i in range(len(ds))]
    assert all(t != s for t, s in zip(targets, sources))


def test_set_data_source_accepts_exactly_the_reward_names():
    import rewards
    from data_prep import make_demo_data, set_data_source

    assert set_data_source.DATA_SOURCES is rewards.REWARD_NAMES  # the table, not a copy of its names
    assert make_demo_data.DATA_SOURCES is rewards.REWARD_NAMES
    assert rewards.REWARD_NAMES == tuple(rewards.REWARDS)


def test_make_demo_data_offers_every_model_family_from_the_table():
    from data_prep import make_demo_data
    from models import FAMILY_NAMES

    assert set(FAMILY_NAMES) < set(make_demo_data.MODELS)   # plus Boogu-Image Edit's edit rows
    with pytest.raises(SystemExit):
        make_demo_data.main(["--model", "flux", "--output_dir", "unused"])


@pytest.mark.parametrize("script, args, reason", [
    ("ocr.py", ["--model", "qwen_image", "--input_dir", "{tmp}/missing", "--output_dir", "{tmp}/out"],
     "no train.txt/test.txt in {tmp}/missing"),
    ("ocr.py", ["--model", "boogu_image", "--input_dir", "{tmp}/empty", "--output_dir", "{tmp}/out"],
     "refusing to write an empty dataset to {tmp}/out/train.parquet"),
    ("boogu_image_edit_ocr.py", ["--input_dir", "{tmp}/missing", "--output_dir", "{tmp}/out"],
     "no train.jsonl/test.jsonl in {tmp}/missing"),
    ("set_data_source.py", ["--dataset-dir", "{tmp}/missing", "--data-source", "ocr"],
     "--dataset-dir {tmp}/missing holds no train.parquet or test.parquet"),
])
def test_a_converter_given_bad_input_says_why_in_one_line(tmp_path, script, args, reason):
    """Run as a user runs them: a missing or empty input ends in `<script>: error: <reason>` and exit status 2, not a
    traceback (set_data_source.py used to skip a folder it could not find and exit 0)."""
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "train.txt").write_text("\n")
    (tmp_path / "empty" / "test.txt").write_text("\n")
    argv = [a.format(tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, str(REPO / "data_prep" / script), *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"{script}: error: {reason.format(tmp=tmp_path)}"
