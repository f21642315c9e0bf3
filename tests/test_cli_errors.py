"""Common mistakes through the real trainer CLI under torchrun (2 ranks), counted in lines: a misspelt flag, an
undividable batch and a bad dataset row each print ONE line of the trainer's own (rank 0 only, naming the fix;
"did you mean" for the flag), then scripts/torchrun.py's one line naming the rank that failed first; the
tracebacks of every rank go to <output_dir>/train.log, not to the console. The refused resume is counted the same
way in tests/test_trainers.py::test_exact_resume_and_config_refusal (it needs a checkpoint that test makes). Unit
checks of the helpers (training/cli.py) run in the default suite."""

from __future__ import annotations

import os
import re
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import train_dppo
import training as T
from training.cli import suggest_flags
from training.distributed import RankFailed
from training.console import tee_console
from training.preflight import PreflightError
from test_trainers import cli, demo_data, run_trainer  # noqa: F401 (fixture)
from trainer_runs import error_line, trainer_lines

@pytest.fixture
def flags(demo_data, tiny_models, tmp_path):  # noqa: F811
    data = demo_data["qwen_image"]
    return dict(model_path=os.path.join(tiny_models, "qwen_image"), train_files=data / "train.parquet",
                output_dir=tmp_path / "run", true_cfg_scale=1.0)


def test_misspelt_flag_is_one_line_with_a_suggestion(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train_dppo.py"])  # argparse's prog, as on the command line
    with pytest.raises(SystemExit) as info:
        train_dppo.parse_args(["--model_path", "m", "--train_files", "t", "--lerning_rate", "1e-4", "--rolout_n", "2"])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "train_dppo.py: error: unrecognized arguments: --lerning_rate 1e-4 --rolout_n 2; --lerning_rate: did you mean "
        "--learning_rate?; --rolout_n: did you mean --rollout_n? (see train_dppo.py --help)"]
    assert suggest_flags("unrecognized arguments: --zzz", ["--lr"]) == "unrecognized arguments: --zzz"


def test_a_quiet_rank_waits_for_the_first_rank_to_print_a_bad_flag(monkeypatch, capsys):
    """Only each node's first rank prints a bad flag; the others wait for it before exiting (torchrun stops every
    rank once one exits, which could stop the first rank before its line is out)."""
    import training.cli as cli_module

    waited = []
    monkeypatch.setattr(cli_module.time, "sleep", waited.append)
    monkeypatch.setattr(cli_module.signal, "signal", lambda sig, handler: None)  # pytest's own handlers stay
    monkeypatch.setattr(sys, "argv", ["train_dppo.py"])
    for local_rank, local_world, expect_wait, expect_line in (("1", "2", True, False), ("0", "2", False, True),
                                                              ("1", "1", False, False)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
        waited.clear()
        with pytest.raises(SystemExit) as info:
            train_dppo.parse_args(["--model_path", "m", "--train_files", "t", "--lerning_rate", "1e-4"])
        assert info.value.code == 2
        assert waited == ([cli_module.QUIET_RANK_WAIT_S] if expect_wait else [])
        assert ("did you mean --learning_rate?" in capsys.readouterr().err) == expect_line


@pytest.mark.slow  # two ranks under torchrun, the first one slowed by 8 s at start-up (~30 s)
def test_a_bad_flag_is_printed_when_the_first_rank_starts_last(flags, tmp_path):
    """The first rank reaches argparse 8 s after the second (a loaded machine: a `sitecustomize` that sleeps on local
    rank 0 only, test-side): its line must still be printed, and torchrun must name it as the rank that failed."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os, time\nif os.environ.get('LOCAL_RANK') == '0':\n"
                                           "    time.sleep(8)\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = run_trainer("train_dppo.py", cli(**flags) + ["--lerning_rate", "1e-4"], expect_ok=False,
                       env={"PYTHONPATH": os.pathsep.join([str(site), repo])})
    assert trainer_lines(proc) == ["train_dppo.py: error: unrecognized arguments: --lerning_rate 1e-4; "
                                   "--lerning_rate: did you mean --learning_rate? (see train_dppo.py --help)"], \
        proc.stderr[-3000:]
    torchrun_line = proc.stderr.strip().splitlines()[-1]
    assert torchrun_line.startswith("torchrun: train_dppo.py failed: rank 0 ") and "exit code 2" in torchrun_line


@pytest.mark.parametrize("trainer, flags, line", [
    ("train_dppo.py", ["--sde_window_range", "0,5"], "--sde_window_range needs --sde_window_size (without it every "
                                                     "step but the last is trained; a run started with it alone "
                                                     "resumes with it dropped and --resume_force: it had no effect)"),
    ("train_dppo.py", ["--sde_window_size", "2", "--sde_window_range", "3"],
     "--sde_window_range '3': expected two integers 'lo,hi'"),
    ("train_dppo.py", ["--sde_window_size", "2", "--sde_window_range", "0,12"],
     "--sde_window_size / --sde_window_range / --num_inference_steps: sde_window_size=2 does not fit "
     "sde_window_range=(0, 12) within 10 steps"),
    ("train_dppo.py", ["--loss", "flow_grpo", "--clip_ratio", "0"], "--clip_ratio 0.0: must be > 0"),
    ("train_dppo.py", ["--kl_mask_threshold", "nan"], "--kl_mask_threshold nan: must be > 0"),
    ("train_nft.py", ["--mix_beta", "0"], "--mix_beta 0.0: must be > 0"),
    ("train_nft.py", ["--timestep_fraction", "1.5"], "--timestep_fraction 1.5: must be in (0, 1]"),
    ("train_nft.py", ["--old_policy_update_interval", "0"], "--old_policy_update_interval 0: must be >= 1"),
])
def test_an_algorithm_flag_out_of_range_is_refused_at_parse_time(monkeypatch, capsys, trainer, flags, line):
    """These failed only inside the first step's loss (after the model load and a whole rollout), or ignored the
    flag (--sde_window_range without --sde_window_size); now each is one line naming the flag, before anything."""
    import train_nft

    monkeypatch.setattr(sys, "argv", [trainer])
    parse = {"train_dppo.py": train_dppo.parse_args, "train_nft.py": train_nft.parse_args}[trainer]
    with pytest.raises(SystemExit) as info:
        parse(["--model_path", "m", "--train_files", "t", *flags])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"{trainer}: error: {line} (see {trainer} --help)"]


def test_a_flag_the_chosen_loss_ignores_is_not_checked():
    train_dppo.parse_args(["--model_path", "m", "--train_files", "t", "--clip_ratio", "0"])  # Flow-DPPO: unused
    train_dppo.parse_args(["--model_path", "m", "--train_files", "t", "--loss", "flow_grpo", "--kl_mask_threshold",
                           "0"])


@pytest.mark.parametrize("trainer, flag, value, owner", [("train_dppo.py", "--mix_beta", "0.1", "train_nft.py"),
                                                        ("train_nft.py", "--loss", "flow_grpo", "train_dppo.py")])
def test_the_other_trainers_flag_is_named_as_such_and_never_abbreviated(monkeypatch, capsys, trainer, flag, value,
                                                                        owner):
    """--mix_beta given to train_dppo.py suggested --adam_betas; --loss given to train_nft.py was taken as an
    abbreviation of a longer flag. Now each names the trainer that takes it."""
    import train_nft

    monkeypatch.setattr(sys, "argv", [trainer])
    parse = {"train_dppo.py": train_dppo.parse_args, "train_nft.py": train_nft.parse_args}[trainer]
    with pytest.raises(SystemExit) as info:
        parse(["--model_path", "m", "--train_files", "t", flag, value])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{trainer}: error: unrecognized arguments: {flag} {value}; {flag} is a flag of {owner}, not of this script "
        f"(see {trainer} --help)"]


def test_a_nodes_other_ranks_print_nothing_for_a_mistake_every_rank_sees(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")  # the second rank of a node (a node's first rank prints its own line)
    with pytest.raises(SystemExit):
        train_dppo.parse_args(["--model_path", "m", "--train_files", "t", "--lerning_rate", "1e-4"])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("rank, local_rank, error, shown", [
    (0, 0, PreflightError("--height 500: use 496 or 512"), "error: PreflightError: --height 500: use 496 or 512"),
    (1, 1, PreflightError("--height 500: use 496 or 512"), None),  # every rank raised it: rank 0 said it
    (1, 0, RankFailed("step 2 failed on rank 0"), "[rank 1] error: RankFailed: step 2 failed on rank 0"),  # node 1
    (1, 1, RuntimeError("boom\non two lines"), "[rank 1] error: RuntimeError: boom on two lines"),  # this rank's own
])
def test_run_cli_prints_one_line_and_logs_the_traceback(tmp_path, monkeypatch, capsys, rank, local_rank, error,
                                                        shown):
    from training.console import LOG_FILE

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after the test, whatever tee_console installs
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))

    def main(argv):
        tee_console(str(tmp_path))
        raise error

    with pytest.raises(SystemExit) as info:
        T.run_cli(main)
    assert info.value.code == 1
    console = [line for line in capsys.readouterr().err.splitlines() if line]
    log_path = os.path.join(tmp_path, LOG_FILE)
    assert console == ([] if shown is None else [f"{shown} (traceback in {log_path})"])
    log = open(log_path, encoding="utf-8").read()
    prefix = "" if rank == 0 else f"[rank {rank}] "
    last = f"{type(error).__name__}: {str(error).splitlines()[0]}"  # the traceback's last line, in the log only
    assert f"{prefix}Traceback (most recent call last):" in log, log
    assert re.search(rf"^\S+ {re.escape(prefix)}\S*{re.escape(last)}$", log, re.M), log  # after the time


@pytest.mark.parametrize("local_rank, local_world, error, expect_wait", [
    (1, 2, PreflightError("--height 500: use 496 or 512"), True),   # every rank raised it: the first rank prints
    (1, 2, RankFailed("step 2 failed on rank 0"), True),
    (0, 2, PreflightError("--height 500: use 496 or 512"), False),  # the rank that prints exits at once
    (1, 1, PreflightError("--height 500: use 496 or 512"), False),  # no other rank on the node
    (1, 2, RuntimeError("this rank's own"), False),                 # printed by this rank itself
])
def test_a_quiet_rank_waits_for_the_first_rank_to_print_a_shared_error(monkeypatch, capsys, local_rank, local_world,
                                                                      error, expect_wait):
    """run_cli on a rank that leaves a relayed error's line to its node's first rank waits for it (as for a bad
    flag), with the stop signals back at their default action, so that torchrun's SIGTERM, once the first rank
    has exited, ends the wait at once instead of becoming a stop request (or a second error)."""
    import signal

    import training.cli as cli_module

    waited, handlers = [], []
    monkeypatch.setattr(cli_module.time, "sleep", waited.append)
    monkeypatch.setattr(cli_module.signal, "signal", lambda sig, handler: handlers.append((sig, handler)))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))

    def main(argv):
        raise error

    with pytest.raises(SystemExit) as info:
        T.run_cli(main)
    assert info.value.code == 1
    assert waited == ([cli_module.QUIET_RANK_WAIT_S] if expect_wait else [])
    assert sorted(handlers) == (sorted((s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
                                if expect_wait else [])
    printed = "error: " in capsys.readouterr().err
    assert printed == (local_rank == 0 or not expect_wait and local_world > 1)


def test_run_cli_without_a_log_file_keeps_the_traceback_on_the_console(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")

    def main(argv):
        raise ValueError("no log yet")

    with pytest.raises(SystemExit):
        T.run_cli(main)
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.splitlines()[-1] == "error: ValueError: no log yet"


@pytest.mark.slow
def test_three_mistakes_under_torchrun_print_one_line_each(flags, tmp_path):
    proc = run_trainer("train_dppo.py", cli(**flags) + ["--lerning_rate", "1e-4"], expect_ok=False)
    lines = trainer_lines(proc)
    assert lines == ["train_dppo.py: error: unrecognized arguments: --lerning_rate 1e-4; --lerning_rate: did you "
                     "mean --learning_rate? (see train_dppo.py --help)"], lines
    console = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if line.strip()]
    assert console == lines + [console[-1]], console  # the whole console: the trainer's line, then torchrun's one
    assert console[-1].startswith("torchrun: train_dppo.py failed: rank ") and "exit code 2" in console[-1], console

    line = error_line(run_trainer("train_dppo.py", cli(**{**flags, "train_batch_size": 3}), expect_ok=False),
                      flags["output_dir"])
    assert line.startswith("error: PreflightError: --train_batch_size 3 must be divisible by the 2 trainer ranks: "
                           "use 2 or 4"), line

    rows = pq.read_table(flags["train_files"]).to_pylist()
    rows[0]["data_source"] = "aesthetic"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    line = error_line(run_trainer("train_dppo.py", cli(**{**flags, "train_files": tmp_path / "bad.parquet"}),
                                  expect_ok=False), flags["output_dir"])
    assert "row 0, column 'data_source': 'aesthetic' names no known reward" in line, line


def test_help_states_each_default_once():
    """A flag whose help already says what its None default means ("None = 4.0 ...", "default: --genrm_model") gets
    no second "(default: None)"; every other flag keeps its "(default: X)"."""
    import re
    import subprocess
    import sys

    for trainer in ("train_nft.py", "train_dppo.py"):
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        text = subprocess.run([sys.executable, trainer, "--help"], cwd=repo, capture_output=True, text=True,
                              env={**os.environ, "COLUMNS": "2000"}, check=True).stdout
        helps = [line.strip() for line in text.split("options:", 1)[1].splitlines() if line.startswith("  ")]
        twice = [h for h in helps if re.search(r"(default|None =).*\(default: None\)$", h, re.I)]
        assert not twice, twice
        assert any(h.endswith("(default: 42)") for h in helps)  # the others keep theirs
        assert any("None = 4.0" in h and not h.endswith("(default: None)") for h in helps)
