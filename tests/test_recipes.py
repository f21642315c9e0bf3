"""The recipes' launch path on CPU, with torchrun and vLLM replaced by recording stand-ins: scripts/launch.sh builds
the torchrun line from NPROC_PER_NODE / NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT / TORCHRUN_ARGS; a recipe
derives its global batch from the per-GPU sizes (an undividable one stops it with a value that works), passes judge
replicas (started per GENRM_TP GPUs, or given by GENRM_URLS) to --genrm_url, and stops its judges at exit;
scripts/slurm_train.sbatch runs the recipe once per node with that node's NODE_RANK. The real two-node run of the
launch line is tests/test_trainers.py::test_two_nodes_each_drive_their_own_rollout_workers (slow)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from test_serve_genrm import FAKE_VLLM, alive, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# stands in for the interpreter that runs torchrun: records its arguments, one JSON line per call
RECORDER = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps({{"argv": sys.argv[1:], "node_rank": os.environ.get("NODE_RANK"),
                            "shutdown": os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")}}) + "\\n")
    """)


@pytest.fixture
def recorder(tmp_path):
    """The recording interpreter, and data files and an output folder in tmp_path for the recipes (which check that
    their data exists before anything starts, and would otherwise write under the checkout's outputs/)."""
    path = tmp_path / "python"
    path.write_text(RECORDER.format(python=sys.executable))
    path.chmod(0o755)
    data = tmp_path / "data.parquet"
    data.write_bytes(b"")
    return dict(PYTHON=str(path), RECORD=str(tmp_path / "record.jsonl"), TRAIN_FILES=str(data), VAL_FILES=str(data),
                OUTPUT_DIR=str(tmp_path / "outputs"))


def calls(env) -> list[dict]:
    with open(env["RECORD"]) as f:
        return [json.loads(line) for line in f]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def two_free_ports() -> int:
    """A port P such that P and P + 1 are both free on 127.0.0.1 now (the two judge replicas' ports)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports found")


def run(script: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "TORCHRUN_ARGS", "GENRM_URLS",
                                                              "SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")}
    return subprocess.run(["bash", os.path.join(REPO, script), *args], env={**base, **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_launch_builds_the_torchrun_line_and_passes_torchrun_args(recorder):
    env = dict(recorder, NPROC_PER_NODE="4", NNODES="2", NODE_RANK="1", MASTER_ADDR="node0", MASTER_PORT="29555",
               TORCHRUN_ARGS="--max-restarts 0 --shutdown-timeout 900")
    proc = run("scripts/launch.sh", env, "train_dppo.py", "--lr", "1e-4")
    assert proc.returncode == 0, proc.stderr
    (call,) = calls(recorder)
    assert call["argv"] == ["scripts/torchrun.py", "--nnodes", "2", "--node_rank", "1", "--nproc_per_node",
                            "4", "--master_addr", "node0", "--master_port", "29555", "--max-restarts", "0",
                            "--shutdown-timeout", "900", "train_dppo.py", "--lr", "1e-4"]
    assert "node 1 of 2, 4 trainer process(es)" in proc.stderr
    # torchrun's shutdown timeout (its default 30 s kills a rank mid-save): 300 s unless SHUTDOWN_TIMEOUT says
    assert call["shutdown"] == "300"
    assert run("scripts/launch.sh", dict(recorder, SHUTDOWN_TIMEOUT="45"), "train_dppo.py").returncode == 0
    assert calls(recorder)[-1]["shutdown"] == "45"
    bad = run("scripts/launch.sh", dict(recorder, NNODES="2", NODE_RANK="2"), "train_dppo.py")
    assert bad.returncode == 2 and "0 <= NODE_RANK < NNODES" in bad.stderr


def test_recipe_derives_the_global_batch_for_n_gpus_and_m_nodes(recorder):
    env = dict(recorder, NPROC_PER_NODE="7", NNODES="2", NODE_RANK="0", MASTER_ADDR="node0",
               GENRM_URLS="http://judge-a:8000,http://judge-b:8000")
    proc = run("scripts/run_qwen_image_ocr_lora.sh", env, "--total_training_steps", "5")
    assert proc.returncode == 0, proc.stderr
    argv = calls(recorder)[0]["argv"]
    assert flag(argv, "--nproc_per_node") == "7" and flag(argv, "--nnodes") == "2"
    assert flag(argv, "--train_batch_size") == str(10 * 14) and flag(argv, "--ppo_mini_batch_size") == str(5 * 14)
    assert flag(argv, "--genrm_url") == "http://judge-a:8000,http://judge-b:8000"
    assert argv[-2:] == ["--total_training_steps", "5"]  # extra flags go to the trainer
    boogu = run("scripts/run_boogu_image_ocr_lora.sh", dict(env, NPROC_PER_NODE="3", NNODES="1"))
    assert boogu.returncode == 0, boogu.stderr
    argv = calls(recorder)[1]["argv"]
    assert flag(argv, "--train_batch_size") == "24" and flag(argv, "--ppo_mini_batch_size") == "12"


def test_an_undividable_global_batch_stops_the_recipe_with_a_value_that_works(recorder):
    env = dict(recorder, NPROC_PER_NODE="3", NNODES="2", TRAIN_BATCH="25", GENRM_URLS="http://judge:8000")
    proc = run("scripts/run_qwen_image_ocr_lora.sh", env)
    assert proc.returncode == 2 and not os.path.exists(recorder["RECORD"])
    assert proc.stderr.strip().splitlines()[-1] == (
        "recipe: TRAIN_BATCH=25 is not divisible by the 6 trainer GPUs (NPROC_PER_NODE=3 x NNODES=2): use "
        "TRAIN_BATCH=24 or TRAIN_BATCH=30")


def test_the_recipes_check_their_data_models_and_judge_before_anything_starts(recorder, tmp_path):
    """Each check ends the recipe in one line naming the variable and the fix, before a judge or a trainer starts:
    a missing data file; a reward model that is neither a folder nor in the Hub cache offline (before: a 96-line
    traceback); no vLLM to serve the judge (before: a hint at --ocr_backend, which the recipe does not take)."""
    missing = str(tmp_path / "nope.parquet")
    proc = run("scripts/run_qwen_image_ocr_lora.sh", dict(recorder, TRAIN_FILES=missing, GENRM_URLS="http://j:8000"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"recipe: TRAIN_FILES={missing} does not exist: write the data first (the data_prep/ command in this "
        f"recipe's header) or set TRAIN_FILES to your file"]
    offline = run("scripts/run_boogu_image_edit_lora.sh", dict(recorder, HF_HUB_OFFLINE="1",
                                                               HF_HOME=str(tmp_path / "hf"),
                                                               REWARD_MODEL_PATH="someone/NotCached"))
    assert offline.returncode != 0 and offline.stderr.strip().splitlines() == [
        "recipe: REWARD_MODEL_PATH=someone/NotCached: could not get 'someone/NotCached' from the Hugging Face Hub; "
        "download it (huggingface-cli download someone/NotCached) on a machine that is online and set "
        "REWARD_MODEL_PATH to the local folder"]
    no_vllm = run("scripts/run_qwen_image_ocr_lora.sh", dict(recorder, VLLM_BIN=str(tmp_path / "no-vllm")))
    assert no_vllm.returncode == 2 and "pip install vllm, or point the recipe at judge servers that run elsewhere " \
        "with GENRM_URLS=" in no_vllm.stderr and len(no_vllm.stderr.strip().splitlines()) == 1
    assert not os.path.exists(recorder["RECORD"])  # no trainer was started


def test_a_dry_run_prints_the_layout_and_starts_nothing(recorder, tmp_path):
    """DRY_RUN=1: the judge replicas the recipe would start, the torchrun line with the global batch sizes; no judge,
    no trainer and no output folder (vLLM need not be installed for it)."""
    env = dict(recorder, DRY_RUN="1", NPROC_PER_NODE="3", GENRM_GPUS="4,5", VLLM_BIN=str(tmp_path / "no-vllm"))
    proc = run("scripts/run_qwen_image_ocr_lora.sh", env, "--total_training_steps", "5")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[:2] == [f"recipe: dry run: would start judge replica {k} (Qwen/Qwen3-VL-8B-Instruct) on GPUs {gpu}, "
                         f"port {port}" for k, gpu, port in ((0, 4, 8000), (1, 5, 8001))]
    assert lines[2] == "launch.sh: dry run, node 0 of 1, 3 trainer process(es) (3 in all); would run:"
    argv = lines[3].split()
    assert flag(argv, "--nproc_per_node") == "3" and flag(argv, "--train_batch_size") == "30"
    assert flag(argv, "--genrm_url") == "http://127.0.0.1:8000\\,http://127.0.0.1:8001"  # as printed, shell-quoted
    assert argv[-2:] == ["--total_training_steps", "5"]
    assert not os.path.exists(recorder["RECORD"]) and not os.path.exists(recorder["OUTPUT_DIR"])


def test_the_old_nproc_variable_is_refused_not_ignored(recorder):
    proc = run("scripts/run_qwen_image_ocr_lora.sh", dict(recorder, NPROC="2", GENRM_URLS="http://judge:8000"))
    assert proc.returncode == 2 and "NPROC is now NPROC_PER_NODE" in proc.stderr
    assert not os.path.exists(recorder["RECORD"])


def test_judge_replicas_one_per_tp_gpus_reach_the_trainer_and_stop_at_exit(recorder, tmp_path):
    fake = tmp_path / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    port = two_free_ports()
    out = tmp_path / "run"
    env = dict(recorder, VLLM_BIN=str(fake), FAKE_MODE="ok", NPROC_PER_NODE="2", GENRM_GPUS="4,5,6,7", GENRM_TP="2",
               GENRM_PORT=str(port), OUTPUT_DIR=str(out))
    proc = run("scripts/run_qwen_image_ocr_lora.sh", env)
    assert proc.returncode == 0, proc.stderr
    argv = calls(recorder)[0]["argv"]
    assert flag(argv, "--genrm_url") == f"http://127.0.0.1:{port},http://127.0.0.1:{port + 1}"
    logs = [(out / f"genrm_server_node0_{k}.log").read_text() for k in (0, 1)]
    assert "CUDA_VISIBLE_DEVICES=4,5" in logs[0] and "CUDA_VISIBLE_DEVICES=6,7" in logs[1]
    assert all("'--tensor-parallel-size', '2'" in log for log in logs)
    pids = [int(log.split("pid=", 1)[1].split()[0]) for log in logs]
    assert not any(alive(pid) for pid in pids)  # the recipe's exit stopped both
    uneven = run("scripts/run_qwen_image_ocr_lora.sh", dict(env, GENRM_GPUS="4,5,6"))
    assert uneven.returncode == 2 and "GENRM_TP=2 must divide the 3 judge GPUs" in uneven.stderr


def test_slurm_example_runs_the_recipe_once_per_node(recorder, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'gpu-a\\ngpu-b\\n'\n")
    # srun: run the command once per node, as SLURM would on each (sequentially here), with its SLURM_NODEID
    (bin_dir / "srun").write_text("#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
                                  "for id in 0 1; do SLURM_NODEID=$id \"$@\" || exit $?; done\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = dict(recorder, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="gpu-[a-b]",
               SLURM_SUBMIT_DIR=REPO, NPROC_PER_NODE="4", GENRM_URLS="http://judge:8000")
    proc = run("scripts/slurm_train.sbatch", env, "scripts/run_qwen_image_ocr_lora.sh", "--lr", "1e-4")
    assert proc.returncode == 0, proc.stderr
    recorded = calls(recorder)
    assert [c["node_rank"] for c in recorded] == ["0", "1"]
    for k, call in enumerate(recorded):
        argv = call["argv"]
        assert (flag(argv, "--nnodes"), flag(argv, "--node_rank"), flag(argv, "--master_addr")) == ("2", str(k),
                                                                                                      "gpu-a")
        assert flag(argv, "--train_batch_size") == "80" and argv[-2:] == ["--lr", "1e-4"]
    outside = run("scripts/slurm_train.sbatch", dict(recorder, SLURM_SUBMIT_DIR=REPO),
                  "scripts/run_qwen_image_ocr_lora.sh")
    assert outside.returncode != 0 and "not inside a SLURM allocation" in outside.stderr

