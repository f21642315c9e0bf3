"""The parts of an online RL step both trainers share: flags, rollout requests, the rollout with its rewards
(scored while it samples), global advantages, validation (one code path for in-training validation and
scripts/evaluate.py), the adapter sync to the rollout workers (with its bound-module check), and adapter paths
(`PATH` or `CHECKPOINT:default|old`)."""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import math
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence
import torch
import losses
from models import lora
from models.base import ATTENTION_BACKENDS

from .distributed import all_gather_cat, barrier, get_rank, get_world_size, is_main_process, raise_if_any_rank_failed
from .model import (ADAPTER_DEFAULT, ADAPTER_OLD, _full, _strip_adapter, adapter_config_dict, adapter_params,
                    adapter_state_dict, base_weight_dtype, load_adapter_state_, save_adapter_dir)
from .optim import LR_SCHEDULES
from .checkpoint import MARKER, CheckpointError, find_latest, read_verified_adapter
from .logs import (all_gather_objects, gather_first_images, image_grid, prompt_text, reward_metrics, rollout_grid,
                   sample_caption, timer, validation_metrics)

__all__ = [
    "add_common_args", "resolve_device", "guidance_of", "guidance_for", "rollout_request", "score_samples",
    "global_advantages",
    "sync_rollout_adapter", "parse_lora_init", "load_flow_model", "check_batch_sizes",
    "resolve_adapter_dir", "adapter_arg", "verify_adapter_spec", "init_adapter_mismatch", "load_init_adapter",
    "ValidationOutcome", "run_validation", "validate",
    "prune_rollout_adapters", "clean_rollout_adapters", "score_inputs", "RewardStream", "rollout_and_score",
    "submit_rollout", "peek_batch", "lag_next_rollout", "check_rollout_lag", "publish_adapter_tensors",
    "publish_tensors", "JUDGE_LOG", "judge_records", "log_judge_replies", "nonfinite_rows", "score_finite",
    "JudgeRepliesEmpty", "empty_reply_counts",
]


# =================================================================================================================


def add_common_args(parser) -> None:
    """Flags shared by train_nft.py and train_dppo.py (defaults: verl-omni's where it has one)."""
    import rewards

    g = parser.add_argument_group("model")
    g.add_argument("--model_path", default=os.environ.get("MODEL_PATH"),
                   help="pipeline folder (Boogu-Image or Qwen-Image; model_index.json decides) or a Hub id; "
                        "default $MODEL_PATH")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="trainer device")
    g.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="FSDP2 compute dtype on GPU (master LoRA weights stay fp32); CPU always computes in fp32")
    g.add_argument("--max_sequence_length", type=int, default=512, help="Qwen-Image prompt token budget")
    g.add_argument("--attention_backend", default="auto", choices=sorted(ATTENTION_BACKENDS),
                   help="SDPA kernel of the trainer's and the rollout workers' attention (torch.nn.attention."
                        "sdpa_kernel): 'auto' = torch's choice (unchanged), or only flash / cudnn / efficient / math "
                        "(an input that backend cannot take raises instead of falling back)")
    g = parser.add_argument_group("data")
    g.add_argument("--train_files", default=os.environ.get("TRAIN_FILES"), help="train.parquet (data_prep/)")
    g.add_argument("--val_files", default=os.environ.get("VAL_FILES"), help="test.parquet for validation")
    g.add_argument("--train_batch_size", type=int, default=32, help="prompts per rollout step (global)")
    g.add_argument("--rollout_n", type=int, default=16, help="samples per prompt (one group per prompt)")
    g.add_argument("--ppo_mini_batch_size", type=int, default=None,
                   help="prompts per optimizer step (global); default = train_batch_size (one step per rollout)")
    g.add_argument("--micro_batch_size", type=int, default=4, help="samples per GPU per forward/backward")
    g.add_argument("--ppo_epochs", type=int, default=1, help="passes over each rollout batch")
    g.add_argument("--val_max_samples", type=int, default=256, help="validation prompts (0 = all)")
    g = parser.add_argument_group("LoRA and optimizer")
    g.add_argument("--lora_rank", type=int, default=64)
    g.add_argument("--lora_alpha", type=float, default=64.0)
    g.add_argument("--lora_target_modules", default=None,
                   help="comma-separated; default = the model's validated list (Boogu: 18 names, Qwen: 12)")
    g.add_argument("--lora_init_weights", default="gaussian", help="peft init for A ('gaussian' or 'true'); B = 0")
    g.add_argument("--init_adapter", type=adapter_arg, default=None,
                   help="start 'default' from this LoRA (PEFT folder, or CHECKPOINT:default|old) instead of B = 0; "
                        "its rank/alpha/modules must equal the run's (DiffusionNFT's 'old' starts as a copy)")
    g.add_argument("--lr", "--learning_rate", type=float, default=1e-6,
                   help="AdamW peak learning rate (see --lr_scheduler)")
    g.add_argument("--lr_scheduler", default="constant", choices=LR_SCHEDULES,
                   help="lr after the warm-up: constant (verl-omni's default), or linear / cosine decay to "
                        "--min_lr_ratio x lr at --total_training_steps")
    g.add_argument("--lr_warmup_steps", type=int, default=0,
                   help="linear warm-up from 0 over this many steps (step 1 runs at lr 0, as in verl)")
    g.add_argument("--min_lr_ratio", type=float, default=0.0, help="floor of the linear / cosine decay (x lr)")
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--adam_betas", default="0.9,0.999")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="grad-norm clip; a non-finite norm skips the step")
    g.add_argument("--activation_checkpointing", action="store_true", help="recompute block activations in backward")
    g.add_argument("--activation_checkpointing_blocks", type=int, default=None,
                   help="selective checkpointing: checkpoint only N of the transformer's blocks, evenly spaced "
                        "(implies --activation_checkpointing; default: all blocks when it is set)")
    g.add_argument("--base_weights_dtype", default="compute", choices=["compute", "fp32"],
                   help="storage of the frozen base weights on trainer ranks: 'compute' = the --precision compute "
                        "dtype (bf16 on GPU: same numbers, half the memory), 'fp32' = an fp32 copy re-cast every "
                        "forward (the old path, for benchmarks); LoRA weights, grads and AdamW state stay fp32")
    g = parser.add_argument_group("rollout")
    g.add_argument("--rollout_engine", default="native", choices=["native", "vllm_omni"])
    g.add_argument("--rollout_devices", default="cuda:3",
                   help="rollout workers of EACH node: 'colocated' = one worker per trainer GPU, on that GPU (every "
                        "GPU trains and samples; native engine), or reserved devices, comma-separated: e.g. 'cuda:3' "
                        "(4-GPU node: 3 trainer GPUs), 'cuda:2,cuda:3', or 'cpu,cpu' for CPU runs (cuda:k = the "
                        "trainer's cuda:k, i.e. within its CUDA_VISIBLE_DEVICES)")
    g.add_argument("--rollout_sync", default="auto", choices=["auto", "tensors", "disk"],
                   help="adapter sync to the rollout workers: 'tensors' = in memory from a trainer rank of the same "
                        "node (CUDA IPC, or a memory file on CPU), 'disk' = a versioned PEFT directory; auto = "
                        "tensors for the native engine, disk for vllm-omni")
    g.add_argument("--no_reward_overlap", dest="reward_overlap", action="store_false",
                   help="score the rewards on each rank after the whole rollout, instead of on the node's driver as "
                        "each chunk finishes while the next chunk samples (same rewards either way)")
    g.add_argument("--rollout_dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    g.add_argument("--rollout_max_batch_size", type=int, default=16, help="samples per rollout forward")
    g.add_argument("--rollout_timeout_s", type=float, default=3600.0, help="a rollout worker silent longer fails")
    g.add_argument("--rollout_startup_timeout_s", type=float, default=1800.0,
                   help="a rollout worker that has not loaded its model (and answered) after this long fails")
    g.add_argument("--rollout_threads", type=int, default=0, help="CPU threads per rollout worker (0 = default)")
    g.add_argument("--rollout_python", default=None,
                   help="Python interpreter of the rollout workers (default: the trainer's own), e.g. the bin/python "
                        "of a separate vllm-omni environment for --rollout_engine vllm_omni; checked at start-up "
                        "before any model loads, its versions go into run_metadata.json")
    g.add_argument("--cfg_batch", action="store_true",
                   help="run the conditional and unconditional CFG branches as ONE batched forward, in rollout and in "
                        "training alike (same result within float tolerance; faster when the GPU is not saturated)")
    g.add_argument("--height", type=int, default=512)
    g.add_argument("--width", type=int, default=512)
    g.add_argument("--num_inference_steps", type=int, default=10, help="rollout steps (training)")
    g.add_argument("--guidance_scale", type=float, default=None,
                   help="Boogu-Image text CFG (None = 4.0, the released default; 1.0 disables CFG)")
    g.add_argument("--true_cfg_scale", type=float, default=None,
                   help="Qwen-Image true CFG (None = 4.0 for train_dppo.py, 1.0 for train_nft.py as verl-omni's "
                        "recipes; needs negative prompts when > 1)")
    g.add_argument("--seed", type=int, default=42, help="seeds rollouts (per-row streams), sampling and re-noising")
    g = parser.add_argument_group("validation, logging, checkpoints")
    g.add_argument("--val_num_inference_steps", type=int, default=50)
    g.add_argument("--val_seed", type=int, default=42)
    g.add_argument("--test_freq", type=int, default=0, help="validate every N steps (0 = only at the end)")
    g.add_argument("--val_before_train", action="store_true")
    g.add_argument("--num_val_images", type=int, default=8, help="validation samples shown in the image grid")
    g.add_argument("--rollout_image_freq", type=int, default=10,
                   help="every N training steps, rank 0's first --num_rollout_images training samples (whole groups, "
                        "one prompt per row, with their rewards and judge replies) go to TensorBoard as "
                        "rollout/samples (0 = never)")
    g.add_argument("--num_rollout_images", type=int, default=8,
                   help="training samples in the rollout/samples grid (rounded to whole groups of --rollout_n)")
    g.add_argument("--total_training_steps", type=int, default=300)
    g.add_argument("--save_freq", type=int, default=30, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep_last", type=int, default=3, help="complete checkpoints to keep")
    g.add_argument("--resume", default="auto",
                   help="'auto' = latest complete checkpoint under <output_dir>/checkpoints if any; 'never' = start at "
                        "step 0 (existing checkpoints and logs are moved to <output_dir>/previous/, not deleted); or a "
                        "checkpoint directory")
    g.add_argument("--resume_force", action="store_true",
                   help="resume even if flags that change the objective or the data order differ (warns, naming them)")
    g.add_argument("--max_consecutive_skips", type=int, default=3,
                   help="stop when this many optimizer steps in a row were skipped as non-finite (0 = never stop)")
    g.add_argument("--max_wall_time_s", type=float, default=0.0,
                   help="stop cleanly (checkpoint, exit 0) at the first step boundary after this many seconds since "
                        "start-up (0 = no limit)")
    g.add_argument("--stop_save_budget_s", type=float, default=0.0,
                   help="after SIGTERM/SIGINT the run finishes its step and saves there; with a budget > 0 it skips "
                        "that save when the step ended later than this many seconds after the signal (0 = always save)")
    g.add_argument("--save_on_exit", default="last_step", choices=["last_step", "off"],
                   help="last_step: rank 0 holds the last finished step's state in host memory (one gather of the "
                        "LoRA-sized state per step) and writes it at once on SIGTERM/SIGINT (within the launcher's "
                        "shutdown window, whatever the step is doing), on a fatal judge or rollout-worker error, and "
                        "when the torchrun agent dies; off: only --save_freq checkpoints and the stop at a step end")
    g.add_argument("--output_dir", default="outputs/run",
                   help="TensorBoard logs, checkpoints, adapters; one live run per folder (<output_dir>/RUN_LOCK)")
    g.add_argument("--log_every", type=int, default=1)
    g.add_argument("--judge_log_freq", type=int, default=10,
                   help="every N training steps, append every judge reply of the step (verbatim, with the row, "
                        "ground truth and reward) to <output_dir>/judge_replies.jsonl; validation's are always "
                        "appended (0 = training steps never)")
    g.add_argument("--loss_metrics", default="device", choices=["device", "host"],
                   help="the update's loss metrics: 'device' = kept on the device and read once per optimizer step "
                        "(the non-finite check too), 'host' = read after every loss call (one host sync each; the "
                        "old path: same numbers, and a non-finite loss names its inputs)")
    g.add_argument("--profile_step", type=int, default=0,
                   help="record a torch.profiler trace of this training step (CPU + CUDA) into "
                        "<output_dir>/profile/ (each trainer rank) and <output_dir>/rollout_logs/ (each rollout "
                        "worker's N-th generate request, N = this step - the start step: the step's rollout unless "
                        "a validation or --rollout_policy_lag 1 sent requests in between); 0 = off. "
                        "scripts/bench_step.py --profile reads them")
    g.add_argument("--judge_max_empty_frac", type=float, default=0.9,
                   help="stop the run when more than this fraction of a step's OCR judge replies are empty (a judge "
                        "that reads nothing trains on zeros); the message names <output_dir>/judge_replies.jsonl "
                        "(1 = never stop). Applies to the generative judges (--ocr_backend http / local); rapidocr "
                        "reading no text in an illegible image is a correct reading")
    g.add_argument("--collective_timeout_s", type=float, default=0.0,
                   help="timeout of the process groups (main and per node); 0 = the longest per-phase timeout "
                        "(--rollout_timeout_s, --rollout_startup_timeout_s, a judge request with its retries) + "
                        "600 s, so that a phase's error reaches every rank before a collective times out; a whole "
                        "rollout or validation must finish within it")
    rewards.add_reward_args(parser)


def resolve_device(flag: str) -> str:
    if flag == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return flag


def guidance_of(model, args) -> float:
    """The CFG scale of the run for the loaded `model` (see `guidance_for`)."""
    return guidance_for(model.family, args)


def guidance_for(family: str, args) -> float:
    """The CFG scale of the run from --guidance_scale (Boogu-Image) / --true_cfg_scale (Qwen-Image), model-free. An
    unset --true_cfg_scale takes the trainer's Qwen-Image default `args.qwen_true_cfg_default` when it sets one
    (train_nft.py: 1.0, verl-omni's DiffusionNFT recipe), else the model's (4.0)."""
    from models.base import resolve_guidance

    true_cfg = args.true_cfg_scale
    if true_cfg is None and family == "qwen_image":
        true_cfg = getattr(args, "qwen_true_cfg_default", None)
    return resolve_guidance(family, args.guidance_scale, true_cfg)


def rollout_request(rows: Sequence[Any], *, n: int, first_row: int, seed: int, step: int, num_inference_steps: int,
                    height: int, width: int, family: str, scale: float, **algo: Any):
    """The rollout request for this rank's prompts: each prompt repeated n times (interleaved, a group per prompt),
    per-sample seeds `rollout.row_seed(seed, step, global row)` with global rows numbered from `first_row`."""
    import rollout

    prompts, negatives, images = [], [], []
    edit = any(row.images for row in rows)
    for row in rows:
        for _ in range(n):
            prompts.append(row.prompt)
            negatives.append(row.negative_prompt)
            images.append(row.images[0] if row.images else None)
    guided = scale > 1.0
    if guided and any(neg is None for neg in negatives):
        raise ValueError("guidance is on but a prompt has no negative prompt (the dataset loader should have refused it)")
    knob = {"guidance_scale": scale} if family == "boogu_image" else {"true_cfg_scale": scale}
    return rollout.RolloutRequest(
        prompts=prompts, negative_prompts=negatives if guided else None, images=images if edit else None,
        seeds=[rollout.row_seed(seed, step, first_row + i) for i in range(len(prompts))],
        num_inference_steps=num_inference_steps, height=height, width=width, **knob, **algo)


def score_inputs(rows: Sequence[Any], n: int) -> dict[str, list]:
    """What `RewardScorer.score_batch` needs besides the images, per sample (each row's fields repeated n times,
    prompt-major): ground_truths, data_sources, extra_infos. Plain data, so it can travel to the node's driver."""
    return {"ground_truths": [row.ground_truth for row in rows for _ in range(n)],
            "data_sources": [row.data_source for row in rows for _ in range(n)],
            "extra_infos": [row.extra_info for row in rows for _ in range(n)]}


def score_samples(scorer, images: torch.Tensor, rows: Sequence[Any], n: int, bad: Sequence[int] = ()):
    """Rewards (B,) for this rank's samples (prompt-major, n per prompt), chosen by each row's data_source; the
    samples `bad` (non-finite, `nonfinite_rows`) are not scored (`score_finite`)."""
    return score_finite(scorer, images, score_inputs(rows, n), bad)


def nonfinite_rows(result) -> list[int]:
    """The rows of a `RolloutResult` whose sampled latents (and, where returned, trajectory, log-probs and
    transition means) hold NaN/inf: their uint8 images are garbage (NaN casts to black), never a policy's sample."""
    bad = torch.zeros(len(result.images), dtype=torch.bool)  # one image per row
    for name in ("latents_clean", "all_latents", "all_log_probs", "all_means"):
        t = getattr(result, name, None)
        if torch.is_tensor(t) and t.is_floating_point():
            bad |= ~torch.isfinite(t.reshape(t.shape[0], -1)).all(dim=1)
    return [int(i) for i in torch.nonzero(bad).flatten()]


def score_finite(scorer, images: torch.Tensor, inputs: dict[str, list], bad: Sequence[int] = ()):
    """`scorer.score_batch(images, **inputs)` over the rows not in `bad` only: a non-finite sample is never sent to
    a reward. Its reward is a 0.0 placeholder (its step's update is skipped, see `rollout_and_score`), its extras
    NaN and its texts None. With no bad row this is exactly one `score_batch` call over every row."""
    import rewards

    if not bad:
        return scorer.score_batch(images, **inputs)
    n, bad_set = len(images), set(bad)
    good = [i for i in range(n) if i not in bad_set]
    full = rewards.RewardResult(rewards=torch.zeros(n), extras={}, texts={})
    if not good:
        return full
    part = scorer.score_batch(images[good], **{key: [values[i] for i in good] for key, values in inputs.items()})
    full.rewards[good] = part.rewards.float()
    for key, values in part.extras.items():
        full.extras[key] = torch.full((n,), float("nan"))
        full.extras[key][good] = values.float()
    for key, texts in part.texts.items():
        full.texts[key] = [None] * n
        for j, i in enumerate(good):
            full.texts[key][i] = texts[j]
    return full


class RewardStream:
    """Scores one node's rollout on the node's driver while it is still sampling (the consumer of
    `DistributedRollout.submit`): each chunk the workers stream back is scored in a background thread as soon as it
    arrives, so only the last chunk's scoring is left when sampling ends.

    payloads: each rank's `score_inputs`; sizes: each rank's sample count (the node's combined request is the ranks'
    rows in order). Where every reward involved scores each image on its own (`scores_rows_independently`: jpeg, the
    http judge, rapidocr) a chunk is scored at once, in slices cut at rank boundaries, on up to `max_workers` threads
    (so judge requests of several chunks are in flight together, up to the judge's own concurrency); otherwise
    (PickScore, the local GenRM batch their images) a rank's rows are scored in ONE call as soon as all of them
    arrived, exactly the call scoring after the rollout makes. Either way `finish()` returns, per rank, what
    `score_samples` after the whole rollout returns, bit for bit (tested), and re-raises any reward error (after
    every call ended): a failing reward is an error, never a zero."""

    def __init__(self, scorer, payloads: Sequence[dict[str, list]], sizes: Sequence[int], *, max_workers: int = 4):
        self.scorer, self.payloads, self.sizes = scorer, list(payloads), list(sizes)
        self.offsets = [sum(self.sizes[:r]) for r in range(len(self.sizes))]
        for payload, size in zip(self.payloads, self.sizes):
            if any(len(v) != size for v in payload.values()):
                raise ValueError(f"score inputs of {[len(v) for v in payload.values()]} rows for {size} samples")
        self.by_chunk = scorer.scores_rows_independently([s for p in self.payloads for s in p["data_sources"]])
        import rewards  # daemon threads: a Ctrl-C never waits for a scoring call blocked on a stalled judge

        self.pool = rewards.DaemonThreadPool(max_workers if self.by_chunk else 1, name="reward")
        self.futures: list[list[tuple[int, concurrent.futures.Future]]] = [[] for _ in self.sizes]
        self.waiting: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.sizes]  # whole-rank path
        self.spans: list[tuple[float, float]] = []
        self.lock = threading.Lock()

    def on_chunk(self, first_row: int, part) -> None:
        """A finished chunk (rows [first_row, first_row + len(part)) of the node's request): submit its scoring."""
        with self.lock:
            for rank, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
                lo, hi = max(first_row, offset), min(first_row + len(part), offset + size)
                if lo >= hi:
                    continue
                images = part.images[lo - first_row:hi - first_row]
                bad = [r - (lo - first_row) for r in nonfinite_rows(part) if lo - first_row <= r < hi - first_row]
                if self.by_chunk:
                    self._submit(rank, lo - offset, hi - offset, images, bad)
                    continue
                self.waiting[rank].append((lo - offset, images, bad))
                if sum(len(im) for _, im, _ in self.waiting[rank]) == size:
                    parts = sorted(self.waiting[rank], key=lambda item: item[0])
                    ordered = torch.cat([im for _, im, _ in parts])
                    self.waiting[rank] = []
                    self._submit(rank, 0, size, ordered, [start + b for start, _, bads in parts for b in bads])

    def _submit(self, rank: int, lo: int, hi: int, images: torch.Tensor, bad: Sequence[int] = ()) -> None:
        inputs = {key: values[lo:hi] for key, values in self.payloads[rank].items()}
        self.futures[rank].append((lo, self.pool.submit(self._score, images, inputs, bad)))

    def _score(self, images: torch.Tensor, inputs: dict[str, list], bad: Sequence[int] = ()):
        start = time.monotonic()
        try:
            return score_finite(self.scorer, images, inputs, bad)
        finally:
            with self.lock:
                self.spans.append((start, time.monotonic()))

    def finish(self) -> list[Any]:
        """Each rank's `RewardResult` (its rows in order), once every scoring call ended; the first error raises."""
        import rewards

        concurrent.futures.wait([f for futures in self.futures for _, f in futures])
        for futures in self.futures:
            for _, future in futures:
                if future.exception() is not None:
                    raise future.exception()
        out = []
        for rank, futures in enumerate(self.futures):
            futures = sorted(futures, key=lambda item: item[0])
            scored = [f.result() for _, f in futures]
            if sum(r.rewards.shape[0] for r in scored) != self.sizes[rank]:
                raise RuntimeError(f"rank {rank}: {sum(r.rewards.shape[0] for r in scored)} of its {self.sizes[rank]} "
                                   "samples were scored (the rollout did not return all of them)")
            out.append(rewards.RewardResult.cat(scored))
        return out

    def busy_s(self) -> float:
        """Wall time from the first scoring call's start to the last one's end (0 before any)."""
        with self.lock:
            return max(e for _, e in self.spans) - min(b for b, _ in self.spans) if self.spans else 0.0

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def submit_rollout(run, request, rows: Sequence[Any]) -> None:
    """Start the rollout of `request` (this rank's `rows` x rollout_n) without waiting for it; with reward overlap
    (the default) its chunks are scored on the node's driver as they finish (`RewardStream`). Collective."""
    overlap = run.args.reward_overlap
    scorer = run.scorer
    run.rollout.submit(request, payload=score_inputs(rows, run.args.rollout_n) if overlap else None,
                       consumer=(lambda payloads, sizes: RewardStream(scorer, payloads, sizes)) if overlap else None)


def rollout_and_score(run, request, rows: Sequence[Any], timings: dict[str, float], step: int | None = None):
    """This step's samples and their rewards: (RolloutResult, RewardResult) for this rank's `rows` x rollout_n, the
    same whether the rewards are scored while later chunks still sample (default) or after the whole rollout
    (--no_reward_overlap). Collects the rollout `submit_rollout` started one step earlier for this request
    (`--rollout_policy_lag 1`), else submits it now. Adds `timing_s/{gen,gen_sampling,reward,reward_total}`,
    `rollout/policy_lag`, the workers' memory (see `DistributedRollout.collect`) and `rollout/adapter_version` (the
    step whose adapter the workers sampled with, as they report it) to `timings`. A failure on any rank (a frozen
    worker seen by a node's driver, a failed judge) ends every rank with that error (`raise_if_any_rank_failed`).
    Every --judge_log_freq-th `step` the judge's raw replies go to <output_dir>/judge_replies.jsonl. Collective."""
    error: BaseException | None = None
    result = scored = None
    stats: dict[str, float] = {}
    bad: list[int] = []
    try:
        lagged = run.rollout.has_pending
        if not lagged:
            submit_rollout(run, request, rows)
        result, scored, stats = run.rollout.collect(request, lagged=lagged)
        bad = nonfinite_rows(result)  # never scored (RewardStream / score_samples skip them)
        if scored is None:  # --no_reward_overlap: each rank scores its own samples now
            start = time.perf_counter()
            scored = score_samples(run.scorer, result.images, rows, run.args.rollout_n, bad)
            stats["timing_s/reward"] = stats["timing_s/reward_total"] = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - re-raised on this rank, and its message on every other one
        error = e
    phase = f"the rollout{f' of step {step}' if step is not None else ''}"
    run.raise_fatal(error, phase)  # every rank raises alike, after the last finished step was written
    counts = _sum_over_ranks([len(bad), *empty_reply_counts(scored)])
    nonfinite, empty, judged = int(counts[0]), int(counts[1]), int(counts[2])
    stats["rollout/nonfinite_samples"] = float(nonfinite)
    # like a non-finite loss: every update of this step is skipped (and counted towards --max_consecutive_skips)
    run.stepper.reject_batch(f"{nonfinite} non-finite rollout sample(s) (NaN/inf latents; not scored)"
                             if nonfinite else "")
    if nonfinite and get_rank() == 0:
        print(f"step {step}: {nonfinite} rollout sample(s) came back non-finite (NaN/inf latents): not scored, and "
              f"the step's update is skipped like a non-finite loss", flush=True)
    freq = getattr(run.args, "judge_log_freq", 0)
    limit = getattr(run.args, "judge_max_empty_frac", 1.0)
    # a generative judge (served or local) that replies with nothing is broken; rapidocr finding no text in an
    # illegible image has read it correctly (its empty transcription scores 0 and teaches legibility)
    too_empty = (step is not None and run.args.ocr_backend != "rapidocr" and judged > 0 and empty / judged > limit)
    if step is not None and ((freq and step % freq == 0) or too_empty):
        log_judge_replies(run.args.output_dir, judge_records(rows, run.args.rollout_n, scored, phase="train",
                                                             step=step))
    if too_empty:
        backend = run.args.ocr_backend
        which = f"--genrm_url {run.args.genrm_url}" if backend == "http" else f"--ocr_backend {backend}"
        error = JudgeRepliesEmpty(
            f"the OCR judge ({which}) returned empty replies for {empty} of the {judged} "
            f"samples it read in step {step} ({empty / judged:.0%} > --judge_max_empty_frac {limit:g}): a judge that "
            f"reads nothing trains on zero rewards. Its replies are in {os.path.join(run.args.output_dir, JUDGE_LOG)}; "
            f"check the served model and its prompt, then --resume auto")
        run.fail_with_checkpoint(error, phase)
        raise error
    image_freq = getattr(run.args, "rollout_image_freq", 0)
    if step is not None and image_freq and step % image_freq == 0 and get_rank() == 0:
        log_rollout_images(run.logger, result, scored, rows, bad, run.args, step)
    version = result.metadata.get("adapter_version")  # as the workers report it: "v<step>" (sync_rollout_adapter)
    if isinstance(version, str) and version[1:].isdigit():
        stats["rollout/adapter_version"] = float(version[1:])
    timings.update(stats)
    return result, scored


def log_rollout_images(logger, result, scored, rows: Sequence[Any], bad: Sequence[int], args, step: int) -> None:
    """TensorBoard `rollout/samples`: this rank's first --num_rollout_images training samples of `step` in whole
    groups (`rollout_grid`), each captioned with its reward (NaN, "not scored", for a non-finite sample in `bad`)
    and the OCR judge's reply when there is one. Not collective (call it on rank 0)."""
    rewards = scored.rewards.detach().float().cpu().clone()
    rewards[list(bad)] = float("nan")
    grid = rollout_grid(result.images, [row.prompt for row in rows], args.rollout_n, rewards,
                        scored.texts.get("ocr/response"), max_images=args.num_rollout_images)
    logger.log_image("rollout/samples", grid, step)


JUDGE_LOG = "judge_replies.jsonl"


class JudgeRepliesEmpty(RuntimeError):
    """More than --judge_max_empty_frac of a step's judge replies were empty; the message names the replies' log."""


def empty_reply_counts(scored) -> tuple[int, int]:
    """(empty replies, samples the OCR judge read) of one `RewardResult` (`rewards.OCR_EMPTY_REPLY`: 1 / 0 per
    judged sample, NaN where no judge read it)."""
    import rewards

    flags = scored.extras.get(rewards.OCR_EMPTY_REPLY) if scored is not None else None
    if flags is None:
        return 0, 0
    read = ~torch.isnan(flags)
    return int(flags[read].sum().item()), int(read.sum().item())


def _sum_over_ranks(values: Sequence[float]) -> torch.Tensor:
    """`values` summed over every rank (one all_reduce of a float64 CPU tensor; as is without a process group)."""
    import torch.distributed as dist

    total = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.is_initialized() and get_world_size() > 1:
        dist.all_reduce(total)
    return total


def judge_records(rows: Sequence[Any], n: int, scored, *, phase: str, step: int,
                  first_sample: int = 0) -> list[dict[str, Any]]:
    """One record per sample that a judge replied to (`scored.texts`, e.g. "ocr/response"), verbatim: phase
    ("train" | "val"), step, rank, sample (this rank's position + `first_sample`), row (dataset row index),
    data_source, ground_truth, reward and the reply. `rows` x `n` are the samples, prompt-major."""
    records = []
    for j in range(scored.rewards.shape[0]):
        replies = {key: texts[j] for key, texts in scored.texts.items() if texts[j] is not None}
        if not replies:
            continue
        row = rows[j // n]
        records.append({"phase": phase, "step": step, "rank": get_rank(), "sample": first_sample + j,
                        "row": row.index, "data_source": row.data_source, "ground_truth": row.ground_truth,
                        "reward": float(scored.rewards[j]), **replies})
    return records


def log_judge_replies(output_dir: str, records: Sequence[dict[str, Any]]) -> None:
    """Append every rank's `records` to <output_dir>/judge_replies.jsonl on rank 0 (one JSON object per line).
    Collective."""
    everyone = [r for part in all_gather_objects(list(records)) for r in part]
    if get_rank() == 0:
        append_judge_log(output_dir, everyone)


def append_judge_log(output_dir: str, records: Sequence[dict[str, Any]]) -> None:
    """Append `records` to <output_dir>/judge_replies.jsonl, one JSON object per line (this process only)."""
    import json

    if records:
        with open(os.path.join(output_dir, JUDGE_LOG), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def peek_batch(sampler):
    """The batch `sampler.next_batch()` will return next, without moving the sampler (its checkpointed cursor
    keeps counting completed steps only)."""
    return copy.copy(sampler).next_batch()


def lag_next_rollout(step: int, args) -> bool:
    """--rollout_policy_lag 1: submit step + 1's rollout now, to sample while this step trains? Not after the last
    step, and not on a step that writes a checkpoint, so that no rollout is pending at any checkpoint and --resume
    continues exactly (the step after a checkpoint samples unlagged, in the resumed run as in the uninterrupted
    one)."""
    return bool(getattr(args, "rollout_policy_lag", 0)) and step < args.total_training_steps \
        and step % args.save_freq != 0


def check_rollout_lag(args) -> str | None:
    """Why --rollout_policy_lag 1 cannot run with these flags (None when it can): sampling step k+1 while step k
    trains needs rollout GPUs that no trainer rank uses; on a shared GPU both would run at once, in one GPU's memory."""
    if not getattr(args, "rollout_policy_lag", 0):
        return None
    devices = [d.strip() for d in args.rollout_devices.split(",")]
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    import rollout

    shared = [d for d in devices if d == rollout.COLOCATED or (rollout.gpu_index(d) is not None
                                                                 and rollout.gpu_index(d) < local_world)]
    if shared and resolve_device(args.device) == "cuda":
        return (f"--rollout_policy_lag 1 needs rollout GPUs of their own: --rollout_devices {args.rollout_devices} "
                f"puts workers on trainer GPUs ({', '.join(shared)}; this node trains on "
                f"cuda:0..cuda:{local_world - 1}), where the lagged rollout would sample during the update on the same "
                "GPU; reserve rollout GPUs "
                "(e.g. --rollout_devices cuda:3 with 3 trainer ranks) or drop the lag")
    return None


def global_advantages(scored, n: int, *, global_std: bool, norm_by_std: bool,
                      num_steps: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """Group advantages over the GLOBAL batch (every rank's rewards; a group never spans ranks) plus the
    `critic/*` metrics (reward extras included, NaN where a reward did not score a sample); returns this rank's
    slice of the advantages. Collective."""
    all_rewards = all_gather_cat(scored.rewards.float())
    group_ids = [i // n for i in range(all_rewards.shape[0])]
    advantages = losses.group_advantages(all_rewards, group_ids, global_std=global_std, norm_by_std=norm_by_std,
                                         num_steps=num_steps)
    extras = {key: all_gather_cat(values.float()).tolist() for key, values in sorted(scored.extras.items())}
    metrics = reward_metrics(all_rewards, group_ids, advantages, extras=extras)
    start = get_rank() * scored.rewards.shape[0]
    return advantages[start:start + scored.rewards.shape[0]], metrics


def sync_rollout_adapter(rollout_client, transformer, adapter: str, lora_config, root: str, version: int,
                         expected_modules: int, *, engine_names: bool, keep: int = 2,
                         label: str | None = None) -> dict[str, float]:
    """Publish `adapter` (the rollout policy: "old" for DiffusionNFT, "default" for DPPO/GRPO) to the rollout
    workers: every rank gathers the full tensors, rank 0 writes a versioned PEFT directory atomically, every node's
    workers load it, and the bound-module count must equal the actor's number of LoRA modules (a dropped sync would
    otherwise leave the rollout sampling an old policy while the run looks healthy). `label`: the workers' adapter
    version name (default "v<version>"). Collective."""
    timings: dict[str, float] = {}
    if rollout_client.has_pending:  # a lagged rollout still samples with the last version: this one comes after it
        with timer("gen_lag_wait", timings):
            rollout_client.finish_pending()
    with timer("update_weights", timings):
        if rollout_client.sync_mode == "tensors":  # no disk round trip: each node's workers get them in memory
            path = f"(tensors of {label or f'v{version}'})"
            counts = publish_adapter_tensors(rollout_client, transformer, adapter, lora_config,
                                             label or f"v{version}")
        else:
            state = adapter_state_dict(transformer, adapter, all_ranks=False)  # only rank 0 writes
            path = os.path.join(root, f"v{version:08d}")
            if is_main_process():  # an atomic write: workers never see a half-written version
                save_adapter_dir(state, lora_config, path, engine_names=engine_names)
                prune_rollout_adapters(root, version, keep)
            barrier()
            counts = rollout_client.load_adapter(path, label or f"v{version}")
    bad = [c for c in counts if c != expected_modules]
    if bad:
        raise RuntimeError(
            f"the rollout workers bound {counts} LoRA modules of adapter {path}, the actor has {expected_modules}: the "
            "weight sync is incomplete (name translation or target_modules mismatch); refusing to continue")
    return {**timings, "rollout/bound_modules": float(counts[0]) if counts else 0.0}


_VERSION_DIR = re.compile(r"^v(\d{8})$")


def prune_rollout_adapters(root: str, current: int, keep: int = 2) -> list[str]:
    """Rank 0, right after writing version `current`: delete the versions this run no longer needs; return them.

    Kept: `current` and the `keep - 1` newest versions below it (the workers still hold the previous one until they
    load `current`). Everything else goes, including versions ABOVE `current`: within one run versions only grow,
    so a higher one is a leftover of an earlier run (a resume from an earlier step), never in use.
    """
    versions = sorted(int(m.group(1)) for d in os.listdir(root) if (m := _VERSION_DIR.match(d)))
    below = [v for v in versions if v < current]
    kept = {current, *below[len(below) - max(keep - 1, 0):]} if keep > 1 else {current}
    removed = [f"v{v:08d}" for v in versions if v not in kept]
    for name in removed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed


def clean_rollout_adapters(root: str) -> str | None:
    """Rank 0, at start-up before any rollout worker runs: remove every adapter version and temp folder left under
    `root` by earlier runs (this run publishes its own first version before the first rollout). Returns the line to
    log, or None when there was nothing to remove."""
    if not os.path.isdir(root):
        return None
    names = sorted(os.listdir(root))
    for name in names:
        full = os.path.join(root, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            os.remove(full)
    if not names:
        return None
    versions = [n for n in names if _VERSION_DIR.match(n)]
    return (f"removed {len(names)} entries left by an earlier run from {root} (rollout adapter versions "
            f"{versions[0] + '..' + versions[-1] if versions else 'none'}; they are re-published from the weights)")


def publish_adapter_tensors(rollout_client, transformer, adapter: str, lora_config, version: str) -> list[int]:
    """The tensor sync of `adapter`: every rank gathers each LoRA tensor (FSDP2 `full_tensor`, collective); the
    ranks that feed a worker (`rollout_client.feeds_workers`) copy it into their `AdapterBuffer`, and every node's
    workers bind the buffer of their source rank. Returns this node's per-worker bound-module counts. Collective."""
    params = adapter_params(transformer, adapter)
    layout = [(_strip_adapter(name, adapter), tuple(p.shape)) for name, p in params]
    return publish_tensors(rollout_client, layout, (_full(p.detach()) for _, p in params),
                           adapter_config_dict(lora_config), version)


def publish_tensors(rollout_client, layout: Sequence[tuple[str, Sequence[int]]], tensors: Iterable[torch.Tensor],
                    config: dict, version: str) -> list[int]:
    """Hand the adapter tensors `tensors` (one per `layout` entry, (key, shape), in order; consumed on every rank,
    as gathering them may be collective) to the rollout workers through one flat float32 buffer per source rank
    (`rollout.AdapterBuffer` on `rollout_client.device`), freed after every worker bound it. Collective."""
    import rollout

    plain = rollout.adapter_layout(layout)
    buffer = rollout.AdapterBuffer(rollout.layout_numel(plain), rollout_client.device) \
        if rollout_client.feeds_workers else None
    try:
        offset = 0
        for (key, shape), full in zip(plain, tensors, strict=True):
            n = math.prod(shape)
            if tuple(full.shape) != tuple(shape):
                raise ValueError(f"adapter tensor {key}: shape {tuple(full.shape)}, the layout says {tuple(shape)}")
            if buffer is not None:
                buffer.tensor[offset:offset + n].copy_(full.reshape(-1))
            offset += n
        return rollout_client.load_adapter_tensors(buffer, plain, config, version)
    finally:
        if buffer is not None:
            buffer.close()


def parse_lora_init(value: str) -> bool | str:
    """--lora_init_weights: 'gaussian' (verl-omni's default) or 'true'/'false' (peft's kaiming / zero A)."""
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return value


def load_flow_model(path: str, args, device: torch.device):
    """The trainer's model wrapper: the transformer only. Prompt embeddings, reference latents and images come from
    the rollout workers, so trainer ranks skip the text encoder and the VAE (`models.base.NotLoaded`).

    The transformer is read from disk directly in `base_weight_dtype(device, --precision, --base_weights_dtype)`
    (bf16 for --precision bf16 on GPU: half the host RAM and read time of an fp32 load, and no fp32 master copy of
    the frozen weights on the GPU; fp32 on CPU or with --base_weights_dtype fp32). The wrapper still hands the
    transformer fp32 inputs (`model.dtype = float32`), so timesteps, latents and embeddings are rounded exactly as
    before: FSDP2's policy casts them to the compute dtype at the root, as it did with fp32 weights."""
    from models import load_model, model_family

    kwargs = {"max_sequence_length": args.max_sequence_length} if model_family(path) == "qwen_image" else {}
    storage = base_weight_dtype(device, args.precision, args.base_weights_dtype)
    # Loaded on the CPU: `prepare_transformer`'s fully_shard moves one block at a time to `device` and shards it,
    # so no GPU ever holds the whole transformer. The wrapper's inputs go to `device`.
    model = load_model(path, device="cpu", dtype=storage, cfg_batch=args.cfg_batch, transformer_only=True, **kwargs)
    model.device, model.dtype = torch.device(device), torch.float32
    return model


def check_batch_sizes(train_batch_size: int, mini_batch_prompts: int, n: int, micro_batch_size: int,
                      world: int) -> None:
    """verl-omni batching: prompts x n per step, mini-batches in prompts, micro-batches in samples per GPU. Raises
    ValueError naming the flag and a value that would work."""
    from models.base import nearest_multiples

    for flag, value in (("train_batch_size", train_batch_size), ("ppo_mini_batch_size", mini_batch_prompts)):
        if value % world:
            lo, hi = nearest_multiples(value, world)
            raise ValueError(f"--{flag} {value} must be divisible by the {world} trainer ranks: use {lo} or {hi} "
                             f"(a multiple of {world})")
    if train_batch_size % mini_batch_prompts:
        fits = max(d for d in range(world, mini_batch_prompts + 1, world) if train_batch_size % d == 0)
        raise ValueError(f"--ppo_mini_batch_size {mini_batch_prompts} must divide --train_batch_size "
                         f"{train_batch_size}: use {fits}, or leave it unset (= --train_batch_size)")
    per_rank = (mini_batch_prompts // world) * n
    if per_rank % micro_batch_size:
        fits = max(d for d in range(1, micro_batch_size + 1) if per_rank % d == 0)
        raise ValueError(f"micro_batch_size ({micro_batch_size}) must divide the per-rank mini-batch of {per_rank} "
                         f"samples (ppo_mini_batch_size / world x rollout_n): use --micro_batch_size {fits}")


def resolve_adapter_dir(spec: str) -> str:
    """The PEFT adapter folder named by `spec`: a PEFT folder (adapter_config.json + adapter_model.safetensors),
    or a checkpoint folder (`<output_dir>/checkpoints/step_XXXXXXXX`) with `:default` / `:old` choosing its adapter
    (optional when it holds only one). Model-free; raises ValueError naming the path and the fix."""
    path, name = spec, None
    for candidate in (ADAPTER_DEFAULT, ADAPTER_OLD):
        if spec.endswith(":" + candidate):
            path, name = spec[: -len(candidate) - 1], candidate
    is_peft = lambda d: all(  # noqa: E731
        os.path.isfile(os.path.join(d, f)) for f in (lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS))
    if is_peft(path):
        if name is not None:
            raise ValueError(f"{path} is a PEFT adapter folder, not a checkpoint: drop ':{name}'")
        return path
    adapters = os.path.join(path, "adapters")
    if os.path.isdir(adapters):
        if not os.path.isfile(os.path.join(path, MARKER)):
            raise ValueError(f"checkpoint {path} is partial (no {MARKER} marker); use a complete checkpoint")
        present = sorted(d for d in os.listdir(adapters) if is_peft(os.path.join(adapters, d)))
        if name is None and len(present) != 1:
            raise ValueError(f"checkpoint {path} holds the adapters {present}: name one, e.g. {path}:old (what "
                             f"verl-omni validates for DiffusionNFT) or {path}:default (the trained one)")
        name = name or present[0]
        if name not in present:
            raise ValueError(f"checkpoint {path} has no adapter {name!r} (it holds {present})")
        return os.path.join(adapters, name)
    hint = ""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        latest = find_latest(os.path.join(path, "checkpoints"))
        hint = f"; {path} looks like a run directory: pass one of its checkpoints"
        hint += f", e.g. {latest}" if latest else ""
    raise ValueError(f"{path} is neither a PEFT adapter folder ({lora.ADAPTER_CONFIG} + {lora.ADAPTER_WEIGHTS}) nor a "
                     f"checkpoint folder (adapters/<name>/){hint}")


def verify_adapter_spec(spec: str) -> tuple[str, dict, dict]:
    """(folder, adapter_config, modules) of the adapter `spec` names (`resolve_adapter_dir`), verified as
    `read_verified_adapter` does (its checkpoint's sha256 manifest when it has one, finiteness always). Model-free;
    raises ValueError / CheckpointError naming the adapter and the fix."""
    path = resolve_adapter_dir(spec)
    config, modules = read_verified_adapter(path)
    return path, config, modules


def adapter_arg(spec: str) -> str:
    """argparse `type=` for adapter flags: checks `spec` with `verify_adapter_spec` at parse time (before any
    model loads: where it is, its manifest, its finiteness) and keeps it as written."""
    try:
        verify_adapter_spec(spec)
    except (ValueError, CheckpointError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def init_adapter_mismatch(spec: str, config: dict, *, lora_rank: int, lora_alpha: float) -> str | None:
    """Why the --init_adapter whose adapter_config is `config` cannot start this run's LoRA (None when it can):
    its rank and alpha must be the run's, and it must not be rsLoRA."""
    if int(config.get("r", -1)) != lora_rank or float(config.get("lora_alpha", -1)) != float(lora_alpha) \
            or config.get("use_rslora"):
        return (f"--init_adapter {spec}: r={config.get('r')}, lora_alpha={config.get('lora_alpha')}, "
                f"use_rslora={config.get('use_rslora', False)}; this run has --lora_rank {lora_rank} "
                f"--lora_alpha {lora_alpha} (no rsLoRA): pass the adapter's values")
    return None


def load_init_adapter(transformer, spec: str | None, *, lora_rank: int, lora_alpha: float, expected_modules: int,
                      adapter: str = ADAPTER_DEFAULT) -> int:
    """--init_adapter: copy the LoRA of `spec` (see `resolve_adapter_dir`) into `adapter` of the (sharded)
    transformer. Its rank and alpha must be the run's and its tensors must bind exactly the run's LoRA modules
    (`load_adapter_state_` is strict), else ValueError. Logs one line on rank 0; returns the module count (0 when
    `spec` is None). Every rank calls it (each reads the full tensors and keeps its shard; no communication)."""
    if not spec:
        return 0
    path, config, modules = verify_adapter_spec(spec)
    problem = init_adapter_mismatch(spec, config, lora_rank=lora_rank, lora_alpha=lora_alpha)
    if problem:
        raise ValueError(problem)
    load_adapter_state_(transformer, adapter, {f"{module}.lora_{ab}.weight": t for module, pair in modules.items()
                                               for ab, t in pair.items()})
    if len(modules) != expected_modules:  # load_adapter_state_ is strict, so this only guards its contract
        raise RuntimeError(f"--init_adapter {spec} bound {len(modules)} LoRA modules, the actor has {expected_modules}")
    if is_main_process():
        print(f"init adapter: '{adapter}' starts from {path} ({len(modules)} modules, r={lora_rank}, "
              f"alpha={lora_alpha})", flush=True)
    return len(modules)


@dataclass
class ValidationOutcome:
    """`run_validation`'s result on every rank: the metrics, one record per validated prompt (every rank's, in
    prompt order: index, data_source, ground_truth, prompt, seed, reward, reward extras), the uint8 images
    (k, 3, H, W) of the first k = --num_val_images of them, and this rank's own images with the position of its
    first sample in `samples`."""

    metrics: dict[str, float]
    samples: list[dict[str, Any]]
    images: torch.Tensor
    local_images: torch.Tensor
    first: int


def run_validation(rollout_client, scorer, dataset, args, *, family: str, scale: float) -> ValidationOutcome:
    """ODE validation on the test split: THE code path of in-training validation (`validate`) and of
    scripts/evaluate.py. The first --val_max_samples prompts (0 = all) split over the ranks in contiguous blocks,
    one sample per prompt with seed `rollout.row_seed(--val_seed, 1, prompt index)` (so the numbers do not depend
    on the world size or batching), noise 0, --val_num_inference_steps, --height x --width, CFG `scale`; rewards
    from `scorer`; `val-core/<data_source>/reward/mean@1` + val-aux extras (`validation_metrics`) over every
    rank's samples that came back finite, `val-aux/nonfinite_samples` (the others: never scored, their records'
    reward NaN and "nonfinite": True), plus `timing_s/testing`. `rollout_client`: anything with `generate(RolloutRequest)` (the
    trainers' DistributedRollout, evaluate.py's NativeEngine). Collective."""
    world, rank = get_world_size(), get_rank()
    total = len(dataset) if not args.val_max_samples else min(len(dataset), args.val_max_samples)
    if total < world:
        raise ValueError(f"validation needs at least {world} prompts (one per rank), the test split has {total}")
    start, stop = rank * total // world, (rank + 1) * total // world
    rows = [dataset[i] for i in range(start, stop)]
    timings: dict[str, float] = {}
    with timer("testing", timings):
        request = rollout_request(rows, n=1, first_row=start, seed=args.val_seed, step=1,
                                  num_inference_steps=args.val_num_inference_steps, height=args.height,
                                  width=args.width, family=family, scale=scale, noise_level=0.0)
        result = rollout_client.generate(request)
        bad = nonfinite_rows(result)  # never scored: their images are not a policy's samples
        scored = score_samples(scorer, result.images, rows, 1, bad)
    local = []
    for j, row in enumerate(rows):
        record = {"index": row.index, "data_source": row.data_source, "ground_truth": row.ground_truth,
                  "prompt": prompt_text(row.prompt), "seed": request.seeds[j], "reward": float(scored.rewards[j])}
        record.update({key: float(values[j]) for key, values in sorted(scored.extras.items())})
        record.update({key: texts[j] for key, texts in sorted(scored.texts.items()) if texts[j] is not None})
        if j in bad:
            record.update(reward=float("nan"), nonfinite=True)
        local.append(record)
    samples = [record for part in all_gather_objects(local) for record in part]
    finite = [r for r in samples if not r.get("nonfinite")]  # the metrics are over the samples that were scored
    variables = sorted({k for r in finite for k, v in r.items() if isinstance(v, float)}  # texts are not scores
                       - {"index", "data_source", "ground_truth", "prompt", "seed"})
    scores = {k: [r.get(k, float("nan")) for r in finite] for k in variables}  # "reward" + the reward extras
    metrics = validation_metrics([r["data_source"] for r in finite], scores) if finite else {}
    metrics = {k: v for k, v in metrics.items() if v == v}  # extras absent for a data source give NaN: drop them
    metrics["val-aux/nonfinite_samples"] = float(len(samples) - len(finite))
    metrics.update(timings)
    images = gather_first_images(result.images, start, args.num_val_images)
    return ValidationOutcome(metrics, samples, images, result.images, start)


def validate(model, rollout_client, scorer, dataset, args, step: int, scale: float, logger) -> dict[str, float]:
    """In-training validation: `run_validation`, then (rank 0) TensorBoard `val-core/...`, `val-aux/...` and a
    captioned grid of the first --num_val_images samples of ALL ranks, and one console line. Collective."""
    outcome = run_validation(rollout_client, scorer, dataset, args, family=model.family, scale=scale)
    if get_rank() == 0:
        logger.log_scalars(outcome.metrics, step)
        replies = [{"phase": "val", "step": step, "sample": k, "row": s["index"], "data_source": s["data_source"],
                    "ground_truth": s["ground_truth"], "reward": s["reward"], "ocr/response": s["ocr/response"]}
                   for k, s in enumerate(outcome.samples) if "ocr/response" in s]
        append_judge_log(args.output_dir, replies)  # every validated reply, verbatim (the grid shows the first)
        if len(outcome.images):
            captions = [sample_caption(s["reward"], s["prompt"], s.get("ocr/response"))
                        for s in outcome.samples[:len(outcome.images)]]
            logger.log_image("val/samples", image_grid(outcome.images, captions), step)
        core = {key: v for key, v in outcome.metrics.items() if key.startswith("val-core/")}
        print(f"validation @ step {step}: " + ", ".join(f"{key} {v:.4f}" for key, v in core.items()), flush=True)
        bad = int(outcome.metrics["val-aux/nonfinite_samples"])
        if bad:
            print(f"WARNING: validation @ step {step}: {bad} of {len(outcome.samples)} samples came back non-finite "
                  f"(NaN/inf latents): not scored, left out of the val-core means", flush=True)
    return outcome.metrics
