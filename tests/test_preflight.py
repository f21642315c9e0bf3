"""Bad inputs refused before any model loads (training/preflight.py): each through `run_preflight` on the flags a
trainer parses, and two through the real trainer CLI (timed, no model-loading line). Also the collective timeouts
computed from the flags (training.collective_timeout_s), on the main group and the node subgroup."""

from __future__ import annotations

import datetime
import os
import re
import socket
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import train_dppo
import train_nft
import training as T
from training.distributed import COLLECTIVE_TIMEOUT_MARGIN_S, collective_timeout_s
from training.preflight import PreflightError, run_preflight
from test_rewards import FakeJudge
from test_trainers import cli, demo_data, run_trainer  # noqa: F401 (fixture)


def rewrite(src, dst, edit) -> str:
    """Copy the parquet `src` to `dst` with `edit(rows)` applied to its rows (a list of dicts)."""
    rows = pq.read_table(src).to_pylist()
    edit(rows)
    pq.write_table(pa.Table.from_pylist(rows), dst)
    return str(dst)


@pytest.fixture
def flags(demo_data, tiny_models, tmp_path):  # noqa: F811
    data = demo_data["qwen_image"]
    return dict(model_path=os.path.join(tiny_models, "qwen_image"), train_files=data / "train.parquet",
                val_files=data / "test.parquet", output_dir=tmp_path / "run", true_cfg_scale=1.0)


def refused(argv: list[str], match: str, *, world: int = 1, parse=train_dppo.parse_args) -> str:
    with pytest.raises(PreflightError) as info:
        run_preflight(parse(argv), world)
    assert re.search(match, str(info.value)), str(info.value)
    return str(info.value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_good_flags_pass_and_report(flags):
    found = run_preflight(train_dppo.parse_args(cli(**flags)), 1)
    assert found == {"family": "qwen_image", "cfg_scale": 1.0, "rewards": ["jpeg_compressibility"]}


def test_the_cfg_scale_is_resolved_once_with_the_trainers_default(flags):
    """The run's one CFG scale: the family's flag, else the trainer's default (train_nft.py: Qwen-Image 1.0, what
    setup_run passes), else the model's 4.0 (whose guidance then needs every row's negative prompt)."""
    import train_nft

    unset = {**flags, "true_cfg_scale": None}
    nft = run_preflight(train_nft.parse_args(cli(**unset)), 1, cfg_defaults=train_nft.CFG_SCALE_DEFAULTS)
    assert nft["cfg_scale"] == 1.0
    assert run_preflight(train_dppo.parse_args(cli(**flags, lr=1e-3)), 1)["cfg_scale"] == 1.0
    assert run_preflight(train_dppo.parse_args(cli(**{**flags, "true_cfg_scale": 2.5})), 1)["cfg_scale"] == 2.5
    assert run_preflight(train_dppo.parse_args(cli(**unset)), 1)["cfg_scale"] == 4.0
    refused(cli(**unset, guidance_scale=4.0), r"--model_path .*qwen_image is guided by true_cfg_scale; guidance_scale")


def test_bad_flags_and_sizes_are_refused(flags):
    refused(cli(**flags, height=500), r"--height 500 .*height=500 is not a multiple of 16 .*use 496 or 512")
    refused(cli(**flags, width=40), r"width=40 is not a multiple of 16 .*use 32 or 48")
    refused(cli(**flags, train_batch_size=3), r"divisible by the 2 trainer ranks.*--train_batch_size 3", world=2)
    refused(cli(**flags, micro_batch_size=3), r"micro_batch_size \(3\) must divide the per-rank mini-batch of 4")
    refused(cli(**flags, rollout_n=0), r"--rollout_n 0: must be >= 1")
    refused(cli(**flags, genrm_timeout_s=float("nan")), r"--genrm_timeout_s nan: must be a finite number > 0")
    refused(cli(**flags, val_max_samples=1), r"validation uses 1 prompt.* needs one per trainer rank \(2\)", world=2)
    for name in ("judge_max_unusable_frac", "judge_max_empty_frac"):  # the former name sets the same threshold
        refused(cli(**flags, **{name: 1.5}), r"--judge_max_unusable_frac 1.5: must be in \[0, 1\]")
    # the optimizer's flags, before the model loads (a one-number --adam_betas reached AdamW as an IndexError)
    for betas in ("0.9", "0.9,x", "0.9,1.0"):
        refused(cli(**flags, adam_betas=betas), rf"--adam_betas {betas}: expected two numbers 'beta1,beta2', each in")
    refused(cli(**flags, lr_scheduler="cosine", lr_warmup_steps=5, total_training_steps=5),
            r"--lr_scheduler cosine decays after the warm-up, but --lr_warmup_steps \(5\) >= --total_training_steps")
    refused(cli(**flags, lr_scheduler="linear", min_lr_ratio=2.0), r"0 <= --min_lr_ratio <= 1, got 0, 2.0")
    refused(cli(**flags, rollout_timeout_s=1000, rollout_startup_timeout_s=10, collective_timeout_s=900),
            r"--collective_timeout_s 900 is not above --rollout_timeout_s \(1000 s\)")
    # one GPU rank without FSDP2 computes with the stored base weights: an fp32 copy cannot be reproduced there
    refused(cli(**flags, device="cuda", base_weights_dtype="fp32"), r"--base_weights_dtype fp32 with one trainer rank "
            r"and --fsdp auto.*--base_weights_dtype compute .*or --fsdp always")
    for ok in (dict(device="cuda", fsdp="always"), dict(device="cpu")):  # FSDP2 casts it; a CPU computes in fp32
        run_preflight(train_dppo.parse_args(cli(**flags, base_weights_dtype="fp32", **ok)), 1)
    run_preflight(train_dppo.parse_args(cli(**flags, device="cuda", base_weights_dtype="fp32")), 2)  # FSDP2


def test_bad_dataset_rows_are_refused(flags, tmp_path):
    train = flags["train_files"]

    def unknown_source(rows):
        rows[3]["data_source"] = "flow_grpo/ocr"

    def empty_prompt(rows):
        rows[5]["prompt"][-1]["content"] = "  "

    bad = rewrite(train, tmp_path / "source.parquet", unknown_source)
    refused(cli(**{**flags, "train_files": bad}), rf"--train_files: {re.escape(bad)}: row 3, column 'data_source': "
                                                  r"'flow_grpo/ocr' names no known reward.*set_data_source.py")
    bad = rewrite(train, tmp_path / "empty.parquet", empty_prompt)
    refused(cli(**{**flags, "val_files": bad}), rf"--val_files: {re.escape(bad)}: row 5, column 'prompt': the user "
                                                r"message has no text")
    # multi-reward: a jpeg row has no extra_info['target_text'] for the OCR reward
    refused(cli(**flags, reward_weights="jpeg_compressibility=1,ocr=0.5"),
            r"row 0 \(data_source 'jpeg_compressibility'\) has no extra_info\['target_text'\]")
    def pickscore(rows):
        for row in rows:
            row["data_source"] = "pickscore"

    bad = rewrite(train, tmp_path / "pickscore.parquet", pickscore)
    refused(cli(**{**flags, "train_files": bad}), r"'pickscore' reward but --pickscore_path is not set")


def test_each_used_reward_checks_its_own_flags_from_the_table(monkeypatch, tmp_path):
    """check_rewards runs the `check_flags` of the rewards a run uses, and only theirs (a new reward's check is its
    table entry); PickScore's names the flag and the fix for a missing and for a wrong folder."""
    import argparse

    import rewards
    from training.preflight import check_rewards

    seen = []

    def check(args):
        seen.append(args.probe)
        raise ValueError("--probe 3: use 4")

    monkeypatch.setitem(rewards.REWARDS, "probe", rewards.Reward("score_jpeg_compressibility", check_flags=check))
    args = argparse.Namespace(probe=3, pickscore_path=None)
    check_rewards(args, ["jpeg_compressibility", "ocr"])  # neither has flags to check
    assert seen == []
    with pytest.raises(PreflightError, match=r"^--probe 3: use 4$"):
        check_rewards(args, ["ocr", "probe"])
    assert seen == [3]
    with pytest.raises(PreflightError, match=r"--pickscore_path is not set; pass the PickScore_v1 CLIPModel folder"):
        check_rewards(args, ["pickscore"])
    args.pickscore_path = str(tmp_path)
    with pytest.raises(PreflightError, match=rf"--pickscore_path {re.escape(str(tmp_path))}: no config.json there"):
        check_rewards(args, ["pickscore"])
    (tmp_path / "config.json").write_text("{}")
    check_rewards(args, ["pickscore"])


def test_output_folder_must_be_writable(flags, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    refused(cli(**{**flags, "output_dir": not_a_dir}), r"--output_dir .*file exists and is not a folder")
    out = tmp_path / "run2"
    out.mkdir()
    (out / "checkpoints").write_text("x")
    refused(cli(**{**flags, "output_dir": out}), r"checkpoints/ .*checkpoints exists and is not a folder")
    refused(cli(**{**flags, "output_dir": "/proc/flowrl-run"}), r"--output_dir /proc/flowrl-run cannot be created")


def test_the_judge_is_probed_once_when_an_ocr_reward_is_scored(flags, tmp_path):
    def ocr(rows):
        for row in rows:
            row["data_source"] = "ocr"

    train = rewrite(flags["train_files"], tmp_path / "ocr.parquet", ocr)
    argv = cli(**{**flags, "train_files": train, "val_files": None}, genrm_max_retries=0, genrm_timeout_s=2)
    port = free_port()  # nothing listens there
    start = time.monotonic()
    refused(argv + ["--genrm_url", f"127.0.0.1:{port}"],
            rf"judge at --genrm_url 127.0.0.1:{port} did not answer a start-up probe request: GenRM server "
            rf"http://127.0.0.1:{port}/v1/chat/completions failed 1 attempt")
    assert time.monotonic() - start < 5
    with FakeJudge(reply="") as judge:  # reads the probe's word (and nothing else)
        found = run_preflight(train_dppo.parse_args(argv + ["--genrm_url", judge.url]), 1)
    assert found["rewards"] == ["ocr"] and found["judge_probe_s"] < 5 and len(judge.requests) == 1
    with FakeJudge(behaviours=["no_content"]) as judge:
        refused(argv + ["--genrm_url", judge.url], r"did not answer a start-up probe.*not a transcription")


@pytest.mark.parametrize("reply, finish, what", [
    ("I'm sorry, but I can't help with that.", None, "a refusal"),
    ("", None, "an empty reply"),
    ("OPEN OPEN OPEN", "length", "an over-long reply"),
    ("x" * 5000, None, "an over-long reply"),
    ("CLOSED", None, "a reply that is not the word"),
], ids=["refusal", "empty", "cut_at_max_tokens", "ramble", "other_text"])
def test_the_start_up_probe_requires_the_judge_to_read_a_known_word(flags, tmp_path, reply, finish, what):
    """The probe sends an image of rewards.JUDGE_PROBE_WORD; a judge that answers anything but that word (a refusal,
    nothing, a ramble cut at max_tokens or past it, another text) is refused before any model loads, the reply
    quoted. Before, any text passed, and a refusing judge trained on zero rewards."""
    train = rewrite(flags["train_files"], tmp_path / "ocr.parquet",
                    lambda rows: [row.update(data_source="ocr") for row in rows])
    argv = cli(**{**flags, "train_files": train, "val_files": None}, genrm_max_retries=0, genrm_timeout_s=5,
               genrm_max_tokens=1024)
    with FakeJudge(reply=reply, reads_probe=False, finish_reason=finish) as judge:
        message = refused(argv + ["--genrm_url", judge.url],
                          rf"--genrm_url {re.escape(judge.url)} \(model .*\) could not read a start-up probe image of "
                          rf"the word 'OPEN': it gave {what}, ")
    assert repr(reply[:120] + ("..." if len(reply) > 120 else "")) in message


def test_collective_timeouts_outlast_every_phase_timeout(monkeypatch):
    """The main group and the nodes' rollout subgroups time out after the longest per-phase timeout + a margin (the
    issue: rollout 3600 s against torch's defaults of 1800 s for both, so the waiting ranks died first)."""
    import torch
    import torch.distributed as dist

    import rollout

    base = ["--model_path", "m", "--train_files", "t"]
    args = train_nft.parse_args(base)
    assert (args.rollout_timeout_s, args.rollout_startup_timeout_s) == (3600.0, 1800.0)
    seconds = collective_timeout_s(args)
    assert seconds == 3600.0 + COLLECTIVE_TIMEOUT_MARGIN_S
    # a judge request may take (retries + 1) x --genrm_timeout_s + the backoffs 1 + 2 + 4 s, plus the
    # --genrm_retry_total_s (120 s) an unreachable judge is retried for and one more attempt's deadline
    assert collective_timeout_s(train_nft.parse_args(base + ["--genrm_timeout_s", "1200"])) == \
        4 * 1200.0 + 7.0 + 120.0 + 1200.0 + COLLECTIVE_TIMEOUT_MARGIN_S
    assert collective_timeout_s(train_nft.parse_args(base + ["--collective_timeout_s", "4000"])) == 4000.0
    monkeypatch.setattr(rollout, "RolloutGroup", lambda *a, **kw: object())  # the subgroup only, no workers
    T.init_distributed("cpu", timeout_s=seconds)
    try:
        client = rollout.DistributedRollout("m", ["cpu"], collective_timeout_s=seconds)
        for group in (dist.group.WORLD, client.node_group):
            assert group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(seconds=seconds)
    finally:
        T.cleanup_distributed()


@pytest.mark.slow  # the real trainer CLI under torchrun (start-up and imports: tens of seconds on 2 cores)
@pytest.mark.parametrize("script,bad,match", [
    ("train_dppo.py", dict(height=500), r"height=500 is not a multiple of 16"),
    ("train_nft.py", "data_source", r"row 0, column 'data_source': 'aesthetic' names no known reward"),
])
def test_the_trainer_refuses_a_bad_input_before_loading_the_model(script, bad, match, flags, tmp_path):
    if bad == "data_source":
        def relabel(rows):
            rows[0]["data_source"] = "aesthetic"
        flags["train_files"] = rewrite(flags["train_files"], tmp_path / "bad.parquet", relabel)
        bad = {}
    start = time.monotonic()
    proc = run_trainer(script, cli(**flags, **bad), nproc=1, expect_ok=False)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and re.search(match, proc.stderr), proc.stderr[-3000:]
    assert "PreflightError" in proc.stderr
    assert "loading the transformer" not in proc.stdout  # refused before any model was loaded
    assert not os.path.exists(os.path.join(flags["output_dir"], "rollout_logs"))  # and before any rollout worker
    assert elapsed < 60, elapsed  # torchrun + imports; the check itself is instant


def nul_prompt(rows) -> None:
    rows[0]["prompt"][-1]["content"] = "\x00\x00\x00"


def test_a_prompt_of_control_characters_only_is_empty(flags, tmp_path):
    """Three NUL characters passed the empty-prompt check (they are not whitespace) and reached the text encoder."""
    bad = rewrite(flags["train_files"], tmp_path / "nul.parquet", nul_prompt)
    refused(cli(**{**flags, "train_files": bad}), rf"--train_files: {re.escape(bad)}: row 0, column 'prompt': the user "
                                                  r"message has no printable text \('\\x00\\x00\\x00'\)")
    from data_prep.dataset import has_printable_text

    assert has_printable_text("a\x00") and not has_printable_text("\x00\t \u200b\x7f")


@pytest.mark.slow  # the real trainer CLI under torchrun (start-up and imports: tens of seconds on 2 cores)
def test_the_trainer_refuses_a_nul_prompt_in_one_line(flags, tmp_path):
    flags["train_files"] = rewrite(flags["train_files"], tmp_path / "nul.parquet", nul_prompt)
    proc = run_trainer("train_nft.py", cli(**flags), nproc=1, expect_ok=False)
    assert proc.returncode != 0, proc.stdout[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.search(r"row 0, column 'prompt': the user message has no printable text "
                                          r"\('\\x00\\x00\\x00'\); every row needs a prompt", errors[0]), proc.stderr
    assert "loading the transformer" not in proc.stdout


def test_the_collective_timeout_counts_the_judge_only_when_the_run_scores_it(flags, tmp_path):
    """--collective_timeout_s was refused against a judge request's budget (727 s with the defaults) on a run
    whose rewards include no HTTP judge; the budget counts when the rows or --reward_weights score `ocr`."""
    short = dict(rollout_timeout_s=600, rollout_startup_timeout_s=600, collective_timeout_s=700)
    jpeg = train_dppo.parse_args(cli(**flags, **short))
    assert collective_timeout_s(jpeg) == 700.0
    assert collective_timeout_s(train_dppo.parse_args(cli(**flags, **{**short, "collective_timeout_s": 0}))) == \
        600.0 + COLLECTIVE_TIMEOUT_MARGIN_S
    ocr = rewrite(flags["train_files"], tmp_path / "ocr.parquet",
                  lambda rows: [row.update(data_source="ocr") for row in rows])
    for judged in (cli(**{**flags, "train_files": ocr}, **short),
                   cli(**flags, **short, reward_weights="jpeg_compressibility=1,ocr=0.5")):
        with pytest.raises(ValueError, match=r"--collective_timeout_s 700 is not above a judge request .* \(727 s\)"):
            collective_timeout_s(train_dppo.parse_args(judged))
    assert collective_timeout_s(train_dppo.parse_args(cli(**{**flags, "train_files": ocr}, **short,
                                                          ocr_backend="rapidocr"))) == 700.0


@pytest.mark.slow  # one training step through the real trainer CLI (~30 s)
def test_a_run_without_a_judge_takes_a_collective_timeout_below_the_judges_budget(flags, tmp_path):
    argv = cli(**flags, rollout_timeout_s=600, rollout_startup_timeout_s=600, collective_timeout_s=700)
    proc = run_trainer("train_dppo.py", argv, nproc=1)
    assert "step 1/1" in proc.stdout and "saved checkpoint" in proc.stdout, proc.stdout[-3000:]
