"""Start-up checks that need no model: `setup_run` runs them before anything loads, so a bad flag, size, dataset
row, output folder or judge stops the run within seconds with one message naming the flag, file or row and the fix.

    run_preflight(args, world, cfg_defaults=...)  # rank 0 (setup_run shares the outcome); raises PreflightError

In order: the flags (`check_flags`: counts, timeouts, batch sizes against the world size, rollout_n >= 2 (the
advantages are group-relative) and the micro-batch size, a negative reward weight without
--allow_negative_reward_weights, CUDA rollout devices on a host without CUDA, the collective timeout); the image
size for the model family (`models.check_size_for`: reads model_index.json and vae/config.json only); the run's
CFG scale (`flags.resolve_cfg_scale`: the other family's CFG flag is refused); every row of
--train_files and --val_files (`check_datasets`: the dataset's own row checks, a prompt with printable text (not
only NULs or other control characters), a data_source that names a reward, the ground truth a multi-reward needs,
enough validation prompts for the ranks, at least --train_batch_size training rows); what each reward needs
(`check_rewards`: each used reward's `check_flags`, e.g. a PickScore folder); --init_adapter (`check_init_adapter`:
this run's rank and alpha; the flag's type verified its manifest and finiteness); the output folder and its
checkpoints/ can be written (`check_output_dir`: a full disk is named as one, not as a permissions problem); the
prompts that Qwen-Image's
--max_sequence_length cuts (`truncated_prompts`: counted, warned once by `setup_run`); one tiny request to the judge
when an OCR reward is scored over HTTP (`probe_judge`). A reward weight of 0, NaN or inf never gets here:
--reward_weights refuses it at parse time (`rewards.reward_weights_arg`).
"""

from __future__ import annotations

import math
import os
import time
import uuid
from typing import Any, Mapping, Sequence

import torch

from .flags import resolve_cfg_scale
from .lifecycle import disk_full_line

__all__ = ["PreflightError", "run_preflight", "check_flags", "check_datasets", "check_rewards", "check_output_dir",
           "probe_judge", "rewards_used", "check_reward_signs", "check_rollout_devices", "check_init_adapter",
           "truncated_prompts"]


class PreflightError(ValueError):
    """A bad input found before any model loads; the message names the flag, file or row and the fix."""


def check_flags(args, world: int) -> None:
    """Counts, timeouts and batch sizes (`check_batch_sizes`) of the run with `world` trainer ranks, and the
    collective timeout (`collective_timeout_s`)."""
    from .distributed import collective_timeout_s
    from .flags import adam_betas, check_batch_sizes, resolve_device
    from .model import base_weight_dtype, mixed_precision_policy
    from .optim import check_lr_schedule

    at_least = {"train_batch_size": 1, "rollout_n": 1, "micro_batch_size": 1, "ppo_epochs": 1,
                "total_training_steps": 1, "save_freq": 1, "log_every": 1, "num_inference_steps": 1,
                "val_num_inference_steps": 1, "lora_rank": 1, "rollout_max_batch_size": 1, "keep_last": 1,
                "genrm_concurrency": 1, "genrm_max_retries": 0, "test_freq": 0, "judge_log_freq": 0,
                "val_max_samples": 0, "num_val_images": 0, "max_consecutive_skips": 0}
    for flag, low in at_least.items():
        value = getattr(args, flag, low)
        if value is not None and value < low:
            raise PreflightError(f"--{flag} {value}: must be >= {low}")
    for flag in ("rollout_timeout_s", "rollout_startup_timeout_s", "genrm_timeout_s", "lr"):
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value > 0 if flag != "lr" else
                                      math.isfinite(value) and value >= 0):
            raise PreflightError(f"--{flag} {value}: must be a finite number {'>= 0' if flag == 'lr' else '> 0'}")
    if args.rollout_n == 1:
        raise PreflightError("--rollout_n 1: both trainers' advantages are group-relative (a reward minus the mean of "
                             "its prompt's group), so one sample per prompt makes every advantage 0 and nothing is "
                             "learned; pass --rollout_n 2 or more")
    retry_total = getattr(args, "genrm_retry_total_s", 0.0)
    if not (math.isfinite(retry_total) and retry_total >= 0):
        raise PreflightError(f"--genrm_retry_total_s {retry_total}: must be a finite number >= 0")
    unusable = getattr(args, "judge_max_unusable_frac", 1.0)
    if not (0.0 <= unusable <= 1.0):
        raise PreflightError(f"--judge_max_unusable_frac {unusable}: must be in [0, 1] (1 = never stop)")
    check_reward_signs(args)
    check_rollout_devices(args)
    device = torch.device(resolve_device(args.device))
    compute = mixed_precision_policy(device, args.precision).param_dtype  # None: no cast (fp32 or CPU)
    if (world == 1 and getattr(args, "fsdp", "always") == "auto" and compute is not None
            and base_weight_dtype(device, args.precision, args.base_weights_dtype) != compute):
        raise PreflightError("--base_weights_dtype fp32 with one trainer rank and --fsdp auto: the one-rank placement "
                             "computes with the frozen weights as stored, so they must be in the compute dtype; pass "
                             "--base_weights_dtype compute (same numbers, half the memory) or --fsdp always")
    if args.ppo_mini_batch_size is not None and args.ppo_mini_batch_size < 1:
        raise PreflightError(f"--ppo_mini_batch_size {args.ppo_mini_batch_size}: must be >= 1 (or unset = "
                             f"--train_batch_size)")
    mini = args.ppo_mini_batch_size or args.train_batch_size
    try:
        check_batch_sizes(args.train_batch_size, mini, args.rollout_n, args.micro_batch_size, world)
    except ValueError as e:
        raise PreflightError(f"{e}; here --train_batch_size {args.train_batch_size}, --ppo_mini_batch_size {mini}, "
                             f"--rollout_n {args.rollout_n}, --micro_batch_size {args.micro_batch_size} on {world} "
                             f"trainer rank(s)") from None
    try:
        collective_timeout_s(args)
        adam_betas(args.adam_betas)
        check_lr_schedule(args.lr_scheduler, args.lr_warmup_steps, args.total_training_steps, args.min_lr_ratio)
    except ValueError as e:
        raise PreflightError(str(e)) from None


def check_reward_signs(args) -> None:
    """A negative --reward_weights entry turns that reward into a penalty: refused unless
    --allow_negative_reward_weights says it is meant."""
    import rewards

    if not args.reward_weights or getattr(args, "allow_negative_reward_weights", False):
        return
    negative = {k: w for k, w in rewards.parse_reward_weights(args.reward_weights).items() if w < 0}
    if negative:
        listed = ", ".join(f"{k}={w:g}" for k, w in negative.items())
        raise PreflightError(f"--reward_weights {args.reward_weights}: {listed} is negative, so the run maximises "
                             f"minus that reward (a penalty); pass --allow_negative_reward_weights if that is meant, "
                             f"or make the weight positive")


def check_rollout_devices(args) -> None:
    """--rollout_devices cuda:k on a host where torch sees no CUDA device: refused before any worker starts (it
    would fail minutes later, in every worker's model load)."""
    import torch

    devices = [d.strip() for d in args.rollout_devices.split(",")]
    cuda = [d for d in devices if d.startswith("cuda")]
    if cuda and not torch.cuda.is_available():
        raise PreflightError(f"--rollout_devices {args.rollout_devices}: {', '.join(cuda)} but this host has no CUDA "
                             f"device torch can use (torch.cuda.is_available() is False); pass --rollout_devices cpu "
                             f"(or 'cpu,cpu' for two workers) on a CPU host")


def check_init_adapter(args) -> None:
    """--init_adapter: of this run's LoRA rank and alpha, read from its adapter_config.json (no model). The flag's
    type (`adapter_arg`) verified the adapter itself at parse time (manifest, finiteness); it is verified again
    where it is loaded."""
    from models import lora
    from models.base import read_json

    from .adapters import init_adapter_mismatch, resolve_adapter_dir

    spec = getattr(args, "init_adapter", None)
    if not spec:
        return
    try:
        config = read_json(os.path.join(resolve_adapter_dir(spec), lora.ADAPTER_CONFIG), "LoRA adapter config")
    except (ValueError, OSError) as e:
        raise PreflightError(f"--init_adapter {spec}: {e}") from None
    problem = init_adapter_mismatch(spec, config, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha)
    if problem:
        raise PreflightError(problem)


def truncated_prompts(args, family: str) -> dict[str, Any] | None:
    """A family that cuts prompts to --max_sequence_length tokens (Qwen-Image, after its template prefix:
    `FlowModel.prompt_token_counter`): count the rows of --train_files / --val_files that get cut (the tokenizer
    only, no model). Returns {"count", "total", "rows" (the first few "file:row"), "longest"} when any is cut, else
    None; None too for a family that does not truncate (Boogu-Image)."""
    from models import family_class, resolve_model_path

    prompt_token_lengths = family_class(family).prompt_token_counter(resolve_model_path(args.model_path))
    if prompt_token_lengths is None:
        return None
    from data_prep.dataset import PromptDataset

    cut: list[str] = []
    total, longest = 0, 0
    for flag in ("train_files", "val_files"):
        path = getattr(args, flag)
        if not path:
            continue
        data = PromptDataset(path, guidance=False)
        for first in range(0, len(data), 256):
            rows = range(first, min(first + 256, len(data)))
            lengths = prompt_token_lengths([data[i].prompt for i in rows])
            total += len(lengths)
            for i, n in zip(rows, lengths):
                if n > args.max_sequence_length:
                    cut.append(f"--{flag} row {i}")
                    longest = max(longest, n)
    return {"count": len(cut), "total": total, "rows": cut[:5], "longest": longest} if cut else None


def rewards_used(config, data_sources: Sequence[str]) -> list[str]:
    """The rewards a run scores: every --reward_weights entry, else the data sources of its rows."""
    return list(config.reward_weights) if config.reward_weights else sorted(set(data_sources))


def check_datasets(args, world: int, *, guided: bool) -> list[str]:
    """Read every row of --train_files and --val_files (`PromptDataset` with this run's guidance and the known
    rewards as data sources, plus the ground truth each --reward_weights reward reads from extra_info) and check
    that validation has a prompt per rank. Returns the data sources seen."""
    import rewards
    from data_prep.dataset import DatasetError, PromptDataset
    config = rewards.RewardConfig.from_args(args)
    sources: list[str] = []
    for flag in ("train_files", "val_files"):
        path = getattr(args, flag)
        if not path:
            continue
        try:
            data = PromptDataset(path, guidance=guided, data_sources=tuple(rewards.REWARDS))
        except (DatasetError, FileNotFoundError) as e:
            raise PreflightError(f"--{flag}: {e}") from None
        if flag == "train_files" and len(data) < args.train_batch_size:
            raise PreflightError(f"--train_files {path}: {len(data)} row(s), fewer than --train_batch_size "
                                 f"{args.train_batch_size} prompts per step (a step would repeat prompts within its "
                                 f"batch); add rows or lower --train_batch_size to at most {len(data)}")
        for i in range(len(data)):
            source, info = data.metadata(i)
            sources.append(source)
            for name in config.reward_weights or {}:
                key = rewards.REWARDS[name].ground_truth_key
                if name != source and key is not None and not isinstance(info.get(key), str):
                    raise PreflightError(
                        f"--{flag} {path}: row {i} (data_source {source!r}) has no extra_info[{key!r}], the ground "
                        f"truth --reward_weights {name}=... reads for rows of another data_source; add it (the "
                        f"data_prep converters write it) or drop {name!r} from --reward_weights")
        if flag == "val_files":
            total = len(data) if not args.val_max_samples else min(len(data), args.val_max_samples)
            if total < world:
                raise PreflightError(f"--val_files {path}: validation uses {total} prompt(s) (--val_max_samples "
                                     f"{args.val_max_samples}) but needs one per trainer rank ({world}); add rows "
                                     f"or raise --val_max_samples")
    return sources


def check_rewards(args, names: Sequence[str]) -> None:
    """What each reward in `names` needs that can be checked without loading it: its `check_flags` (`REWARDS`)."""
    import rewards

    for name in names:
        check = rewards.REWARDS[name].check_flags
        if check is not None:
            try:
                check(args)
            except ValueError as e:
                raise PreflightError(str(e)) from None


def check_output_dir(output_dir: str) -> None:
    """--output_dir and its checkpoints/ can be created and written (a probe file is written and removed)."""
    checkpoints = os.path.join(output_dir, "checkpoints")
    for folder, flag in ((output_dir, "--output_dir"), (checkpoints, "--output_dir's checkpoints/")):
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise PreflightError(f"{flag} {folder} exists and is not a folder; move it away or pass another "
                                 f"--output_dir")
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as e:
        raise PreflightError(f"--output_dir {output_dir} cannot be created ({e.strerror or e}); pass a writable "
                             f"folder") from None
    for folder in (output_dir, checkpoints):
        if not os.path.isdir(folder):
            continue  # checkpoints/ is made at the first save, in the folder just probed
        probe = os.path.join(folder, f".write-probe-{uuid.uuid4().hex[:8]}")
        try:
            with open(probe, "wb") as f:
                f.write(b"probe")
            os.remove(probe)
        except OSError as e:
            _remove_quietly(probe)
            full = disk_full_line(e, folder)
            if full:  # not a permissions problem: say so, and how to continue
                raise PreflightError(f"--output_dir {output_dir}: {full}") from None
            raise PreflightError(f"{folder} is not writable ({e.strerror or e}); checkpoints and logs go there: fix "
                                 f"its permissions or pass another --output_dir") from None


def _remove_quietly(path: str) -> None:
    """Remove the write probe `path` if a failed write left it (a full disk creates the file, then fails)."""
    try:
        os.remove(path)
    except OSError:
        pass


def probe_judge(args) -> float:
    """One OCR request through the run's own judge client (deadline and retries included): an image of the word
    `rewards.JUDGE_PROBE_WORD` (`rewards.judge_probe_image`), which the judge must read. Returns the request's
    duration in seconds. A judge that is down, slow past its deadline, replies with something that is not a chat
    completion, or answers with anything but that word (nothing, a refusal, a ramble, another text) raises
    PreflightError naming --genrm_url and quoting the reply."""
    import dataclasses

    import rewards

    # a judge that is down at start-up is reported in seconds: the long --genrm_retry_total_s is for a restart mid-run
    scorer = rewards.RewardScorer(dataclasses.replace(rewards.RewardConfig.from_args(args), genrm_retry_total_s=0.0))
    word = rewards.JUDGE_PROBE_WORD
    start = time.monotonic()
    try:
        result = scorer.score_batch([rewards.judge_probe_image(word)], [word], ["ocr"])
    except rewards.GenRMServerError as e:
        raise PreflightError(f"the OCR judge at --genrm_url {args.genrm_url} did not answer a start-up probe "
                             f"request: {e.detail}") from None
    seconds = time.monotonic() - start
    reply = result.texts["ocr/response"][0]
    kind = result.texts["ocr/reply_kind"][0]
    if kind != "reading" or float(result.rewards[0]) < 0.5:
        what = {"empty": "an empty reply", "overlong": "an over-long reply", "refusal": "a refusal"}.get(
            kind, "a reply that is not the word")
        shown = reply[:120] + ("..." if len(reply) > 120 else "")
        raise PreflightError(
            f"the OCR judge at --genrm_url {args.genrm_url} (model {args.genrm_model}) could not read a start-up "
            f"probe image of the word {word!r}: it gave {what}, {shown!r}. A judge that does not read trains on "
            f"zero rewards; check that the server serves a vision-language model (--genrm_model) that reads text, "
            f"with image inputs enabled")
    return seconds


def run_preflight(args, world: int, *, cfg_defaults: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Every model-free check, in the order of the module docstring; raises PreflightError at the first bad input.
    Returns what it found (family, the run's CFG scale from `flags.resolve_cfg_scale` with the trainer's
    `cfg_defaults`, rewards, judge probe seconds)."""
    from models import check_size_for, resolve_model_path

    import rewards

    check_flags(args, world)
    try:
        family = check_size_for(resolve_model_path(args.model_path), args.height, args.width)
    except (ValueError, FileNotFoundError) as e:
        raise PreflightError(f"--model_path {args.model_path} with --height {args.height} --width {args.width}: "
                             f"{e}") from None
    try:
        cfg_scale = resolve_cfg_scale(family, args, (cfg_defaults or {}).get(family))
    except ValueError as e:
        raise PreflightError(f"--model_path {args.model_path}: {e}") from None
    sources = check_datasets(args, world, guided=cfg_scale > 1.0)
    names = rewards_used(rewards.RewardConfig.from_args(args), sources)
    check_rewards(args, names)
    check_init_adapter(args)
    check_output_dir(args.output_dir)
    found: dict[str, Any] = {"family": family, "cfg_scale": cfg_scale, "rewards": names}
    cut = truncated_prompts(args, family)
    if cut:
        found["truncated_prompts"] = cut
    if "ocr" in names and args.ocr_backend == "http":
        found["judge_probe_s"] = probe_judge(args)
    return found
