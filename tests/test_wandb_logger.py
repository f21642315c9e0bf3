"""`--logger wandb` (training.logs.WandbLogger), offline (WANDB_MODE=offline, every wandb folder inside tmp_path, no
network): what it logged is read back from the offline run files themselves (`<output_dir>/wandb/offline-run-*/
run-<id>.wandb`, wandb's record log of protobuf `Record`s) and compared with the TensorBoard files written next to
them; a resume continues the W&B run named by <output_dir>/wandb_run_id.txt; a trainer run through the real CLI, and
its one-line refusal at start-up without wandb (a stub package that fails to import).

Marked `wandb`: wandb is an optional extra (not in requirements.txt), so these tests are left out of the default run
and run by `python3 -m pytest -m wandb` (the wandb stage of .ci/run, after `pip install wandb`). wandb is imported
inside the tests only, so that collecting this file never needs it. The unit checks that need no wandb (the one-line
error, the no-op of the other ranks) are in the default suite: tests/test_training_logs.py."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest
from PIL import Image

from data_prep.make_demo_data import make_demo_data
from test_trainers import cli
from trainer_runs import error_line, run_trainer, scalars
from training.logs import WANDB_RUN_ID_FILE, TensorBoardLogger, WandbLogger, WandbSetupError

pytestmark = pytest.mark.wandb

# wandb's run file: a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB's log format: 32 KiB blocks of
# chunks, each `<crc32 length type>` + payload; a record is one FULL chunk or FIRST, MIDDLE..., LAST
_HEADER = struct.Struct("<4sHB")
_CHUNK = struct.Struct("<IHB")
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    """What one offline run folder holds: its id, config, history rows {step: {key: value}} and final summary."""

    folder: str
    run_id: str = ""
    started: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    history: dict[int, dict[str, Any]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


def _records(path: str) -> list[Any]:
    """Every protobuf Record of a `.wandb` file, in order."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = _HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path}: not a wandb run file ({data[:7]!r})"
    out, pos, parts = [], _HEADER.size, b""
    while pos + _CHUNK.size <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = _CHUNK.unpack_from(data, pos)
        if kind == 0:  # zero padding: the file ends here
            break
        parts += data[pos + _CHUNK.size:pos + _CHUNK.size + length]
        pos += _CHUNK.size + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def settled_records(path: str, timeout_s: float = 60.0) -> list[Any]:
    """The records of a `.wandb` file once wandb's service has written it out: `finish()` returns before its
    service process has flushed every record on a loaded machine, so read until the run record is there and the
    file stops growing (at most `timeout_s`)."""
    deadline, size = time.monotonic() + timeout_s, -1
    while True:
        records = _records(path)
        has_run = any(r.WhichOneof("record_type") == "run" for r in records)
        if (has_run and os.path.getsize(path) == size) or time.monotonic() > deadline:
            return records
        size = os.path.getsize(path)
        time.sleep(0.5)


def offline_runs(output_dir: str) -> list[OfflineRun]:
    """The offline runs under `<output_dir>/wandb`, oldest start first, read from their `.wandb` files."""
    runs = []
    for folder in sorted(glob.glob(os.path.join(output_dir, "wandb", "offline-run-*"))):
        (path,) = glob.glob(os.path.join(folder, "run-*.wandb"))
        run = OfflineRun(folder)
        for record in settled_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.run_id = record.run.run_id
                run.started = record.run.start_time.seconds + record.run.start_time.nanos / 1e9
                run.config.update({_key(u): json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "history":
                run.history[record.history.step.num] = {_key(i): json.loads(i.value_json)
                                                        for i in record.history.item}
            elif kind == "summary":
                run.summary.update({_key(u): json.loads(u.value_json) for u in record.summary.update})
        runs.append(run)
    return sorted(runs, key=lambda run: run.started)  # folder names sort by the second, then by run id


@pytest.fixture
def offline(monkeypatch, tmp_path) -> Iterator[dict[str, str]]:
    """WANDB_MODE=offline and wandb's own folders inside tmp_path (nothing written to ~, no network); yields the
    variables, for a subprocess's environment. wandb's session (its settings, its service process) ends with the
    test: the next one starts its own with its own variables."""
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb_dir"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb_data")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield env
    import wandb

    wandb.teardown()


def _logger(out: str, *, resume: bool = False, purge_step: int | None = None) -> WandbLogger:
    tensorboard = TensorBoardLogger(os.path.join(out, "tensorboard"), enabled=True, purge_step=purge_step)
    return WandbLogger(tensorboard, out, config={"lr": 1e-3, "seed": 7, "output_dir": out, "odd": {1, 2}},
                       project="flow-rl-test", resume=resume)


def test_scalars_images_and_text_reach_wandb_and_tensorboard(offline, tmp_path):
    out = str(tmp_path / "run")
    os.makedirs(out)
    logger = _logger(out)
    grid = Image.new("RGB", (48, 20), (200, 30, 10))
    for step in (1, 2):
        nan_or_value = float("nan") if step == 1 else 0.25  # a step that scored nothing: NaN reward stats
        logger.log_scalars({"critic/rewards/mean": nan_or_value, "actor/policy_loss": 0.5 * step}, step)
        logger.log_image("val/samples", grid, step)
        logger.log_text("run_metadata", f"text of step {step}", step)
        logger.flush()
    logger.close()
    logger.close()  # idempotent, like TensorBoardLogger's

    (run,) = offline_runs(out)
    with open(os.path.join(out, WANDB_RUN_ID_FILE), encoding="utf-8") as f:
        assert f.read().strip() == run.run_id
    assert run.config["lr"] == 1e-3 and run.config["seed"] == 7 and run.config["output_dir"] == out
    assert run.config["odd"] == "{1, 2}"  # not JSON: stored as its string
    assert sorted(run.history) == [1, 2]
    assert math.isnan(run.history[1]["critic/rewards/mean"]) and run.history[2]["critic/rewards/mean"] == 0.25
    assert [run.history[s]["actor/policy_loss"] for s in (1, 2)] == [0.5, 1.0]
    for step in (1, 2):  # the image: a wandb.Image in the step's row, its PNG in the run's media folder
        image = run.history[step]
        assert image["val/samples/_type"] == "image-file", image
        with Image.open(os.path.join(run.folder, "files", image["val/samples/path"])) as png:
            assert png.size == (48, 20) and png.convert("RGB").getpixel((5, 5)) == (200, 30, 10)
    assert run.summary["run_metadata"] == "text of step 2"  # the text: the summary, the latest value
    assert not any("run_metadata" in key for row in run.history.values() for key in row)
    # TensorBoard got the same scalars at the same steps (and keeps the NaN: a gap in its chart)
    tb = scalars(out)
    assert [s for s, _ in tb["critic/rewards/mean"]] == [1, 2] and math.isnan(tb["critic/rewards/mean"][0][1])
    assert tb["critic/rewards/mean"][1][1] == 0.25 and tb["actor/policy_loss"] == [(1, 0.5), (2, 1.0)]


def test_a_resume_continues_the_wandb_run_and_a_fresh_start_begins_a_new_one(offline, tmp_path):
    out = str(tmp_path / "run")
    os.makedirs(out)
    first = _logger(out)
    first.log_scalars({"x": 1.0}, 1)
    first.log_scalars({"x": 2.0}, 2)
    first.close()
    id_path = os.path.join(out, WANDB_RUN_ID_FILE)
    with open(id_path, encoding="utf-8") as f:
        run_id = f.read().strip()
    resumed = _logger(out, resume=True, purge_step=2)  # resumed from the checkpoint of step 1: step 2 is replayed
    resumed.log_scalars({"x": 20.0}, 2)
    resumed.log_scalars({"x": 30.0}, 3)
    resumed.close()
    with open(id_path, encoding="utf-8") as f:
        assert f.read().strip() == run_id
    runs = offline_runs(out)
    assert [r.run_id for r in runs] == [run_id, run_id]  # offline: one folder per attempt, the same W&B run
    assert [{s: row["x"] for s, row in r.history.items()} for r in runs] == [{1: 1.0, 2: 2.0}, {2: 20.0, 3: 30.0}]
    assert [v for _, v in scalars(out)["x"]] == [1.0, 20.0, 30.0]  # TensorBoard purged the replayed step 2

    fresh = _logger(out, resume=False)  # a start at step 0 (e.g. --resume never): a new W&B run
    fresh.close()
    with open(id_path, encoding="utf-8") as f:
        new_id = f.read().strip()
    assert new_id != run_id and offline_runs(out)[-1].run_id == new_id

    with open(id_path, "w", encoding="utf-8") as f:
        f.write("not a run id!\n")
    with pytest.raises(WandbSetupError, match=r"holds no W&B run id .*delete it") as info:
        _logger(out, resume=True)
    assert "\n" not in str(info.value)


def test_nft_run_through_the_cli_logs_to_wandb_offline(offline, tiny_models, tmp_path):
    """One DiffusionNFT step with --logger wandb under torchrun (2 ranks): rank 0's offline W&B run holds the step's
    scalars (the same values as TensorBoard), the validation grid and the run's flags; rank 1 starts no W&B run."""
    data = tmp_path / "data"
    make_demo_data(data, model="qwen_image")
    out = tmp_path / "run"
    run_trainer("train_nft.py", cli(
        model_path=os.path.join(tiny_models, "qwen_image"), train_files=data / "train.parquet",
        val_files=data / "test.parquet", true_cfg_scale=1.0, output_dir=out, logger="wandb",
        wandb_project="flow-rl-test", wandb_name="nft-wandb-test", rollout_devices="colocated"),
        env=offline, timeout_s=300)
    (run,) = offline_runs(str(out))  # one W&B run: rank 0's
    with open(out / WANDB_RUN_ID_FILE, encoding="utf-8") as f:
        assert f.read().strip() == run.run_id
    assert run.config["logger"] == "wandb" and run.config["total_training_steps"] == 1
    assert run.config["output_dir"] == str(out)
    row = run.history[1]
    tb = scalars(str(out))
    for key in ("critic/rewards/mean", "actor/policy_loss", "val-core/jpeg_compressibility/reward/mean@1"):
        assert tb[key] == [(1, pytest.approx(row[key], rel=1e-6))], (key, tb[key], row.get(key))
    assert row["val/samples/_type"] == "image-file"
    assert json.loads(run.summary["run_metadata"].strip("`\n"))["config"]["logger"] == "wandb"


def test_without_wandb_the_trainer_stops_at_start_up_in_one_line(offline, tiny_models, tmp_path):
    """Both ranks refuse --logger wandb without wandb (a stub package that fails to import, first on PYTHONPATH) in
    one console line naming the fix, before any model loads: rank 0's error reaches rank 1, which never waits."""
    stub = tmp_path / "no_wandb" / "wandb"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("No module named \'wandb\' (test stub)")\n')
    data = tmp_path / "data"
    make_demo_data(data, model="qwen_image")
    out = tmp_path / "run"
    path = os.pathsep.join([str(stub.parent), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])
    proc = run_trainer("train_nft.py", cli(
        model_path=os.path.join(tiny_models, "qwen_image"), train_files=data / "train.parquet", true_cfg_scale=1.0,
        output_dir=out, logger="wandb"), env={**offline, "PYTHONPATH": path}, expect_ok=False, timeout_s=120)
    assert error_line(proc, str(out)) == (
        "error: PreflightError: --logger wandb: wandb cannot be imported (No module named 'wandb' (test stub)); "
        f"install it with `pip install wandb`, or drop --logger wandb (traceback in {out / 'train.log'})")
    assert "loading the transformer" not in proc.stdout and not os.path.exists(out / WANDB_RUN_ID_FILE)
