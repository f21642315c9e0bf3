"""Logging: TensorBoard on rank 0 (also mirrored to Weights & Biases with --logger wandb), metric accumulation over
micro-batches + one all_reduce over ranks, the `critic/*` reward/advantage stats (over the scored samples only: NaN,
never 0.0, for a step that scored none), validation keys, image grids (over every rank's samples), a progress line
with ETA, timers, run metadata (and reading it back for the after-training scripts), and the `--help` formatter
that shows defaults. The console log file is `console.py`."""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import hashlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any, Iterator, Mapping, Sequence
import numpy as np
import torch
import torch.distributed as dist

from .distributed import get_rank, get_world_size, is_main_process, on_rank0
from .checkpoint import library_versions
from .console import LOG_FILE

__all__ = [
    "TensorBoardLogger", "WandbLogger", "WandbSetupError", "WANDB_RUN_ID_FILE", "MetricAccumulator",
    "reward_metrics", "validation_metrics", "timer", "image_grid", "sample_caption", "rollout_grid", "prompt_text",
    "all_gather_objects", "gather_first_images", "Progress", "git_commit", "write_run_metadata", "run_summary",
    "HelpFormatter",
]


class TensorBoardLogger:
    """TensorBoard writer that only writes on rank 0 (other ranks get a no-op object with the same methods)."""

    def __init__(self, log_dir: str, *, enabled: bool | None = None, purge_step: int | None = None) -> None:
        """purge_step: TensorBoard drops earlier events at steps >= this (a resumed run replays them)."""
        self.enabled = is_main_process() if enabled is None else enabled
        self.writer = None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def log_scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """Every metric as a scalar at `step` (the reward stats of a step that scored no sample are NaN: a gap in the
        chart, `reward_metrics`)."""
        if self.writer is None:
            return
        for key, value in metrics.items():
            value = float(value)
            self.writer.add_scalar(key, value, global_step=step)

    def log_image(self, tag: str, image, step: int) -> None:
        """image: a PIL image (e.g. from `image_grid`)."""
        if self.writer is not None:
            self.writer.add_image(tag, np.asarray(image.convert("RGB")), global_step=step, dataformats="HWC")

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


WANDB_RUN_ID_FILE = "wandb_run_id.txt"  # <output_dir>/wandb_run_id.txt: the W&B run a resume continues
_WANDB_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class WandbSetupError(RuntimeError):
    """--logger wandb cannot start (no wandb, an unreadable run id file, `wandb.init` refused); the message names
    the fix. `setup_run` reports it as a start-up refusal (`PreflightError`)."""


class WandbLogger:
    """`--logger wandb`: the TensorBoard writer it wraps (always written: the repository's tools, a resume's purge
    and the tests read it) plus the same scalars, images and texts to Weights & Biases, on rank 0 only (other ranks
    get a no-op object with the same methods).

    `import wandb` happens here (wandb is an optional extra); the W&B run is `<output_dir>/wandb/` (`dir=`, so
    WANDB_MODE=offline keeps its files in the run folder), named --wandb_name (default: the basename of the output
    folder), with the run's flags as its config. Its id is kept in `<output_dir>/wandb_run_id.txt`: written when a
    run starts at step 0 (a new W&B run, as TensorBoard hides an earlier attempt), read when it resumes from a
    checkpoint (`wandb.init(id=..., resume="allow")`: the same W&B run). W&B cannot purge steps as TensorBoard's
    `purge_step` does: online, a resumed W&B run continues after its last logged step and ignores, with a warning
    ("Steps must be monotonically increasing"), what is logged at an earlier step, so the steps a resume replays
    keep the first attempt's values there, while offline each attempt is its own folder under <output_dir>/wandb
    (same run id) holding everything it logged. Collective while the process group is up (every rank constructs
    it, as `setup_run` does): an error of rank 0 (no wandb, `wandb.init` refused) is raised on every rank as a
    `WandbSetupError` naming the fix."""

    def __init__(self, tensorboard: TensorBoardLogger, output_dir: str, *, config: Mapping[str, Any],
                 project: str, name: str | None = None, entity: str | None = None, resume: bool = False) -> None:
        """tensorboard: the run's TensorBoardLogger (its `enabled` decides this rank's W&B run too); config: the
        run's flags (`vars(args)`; values wandb cannot store as JSON become strings); resume: the run continues
        from a checkpoint (reuse the id in wandb_run_id.txt; a fresh id otherwise)."""
        self.tensorboard = tensorboard
        self.enabled = tensorboard.enabled
        self.run: Any = None
        self._wandb: Any = None

        def start() -> None:
            if self.enabled:
                self._wandb, self.run = _start_wandb(output_dir, config=config, project=project, name=name,
                                                     entity=entity, resume=resume)

        try:
            on_rank0(start, catch=(WandbSetupError, OSError), exc_type=WandbSetupError)
        except BaseException:
            tensorboard.close()
            raise

    def log_scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """TensorBoard, then one W&B history row at `step`. A non-finite value (the NaN reward stats of a step that
        scored nothing) goes to W&B as the float it is: wandb stores NaN / inf and leaves a gap in the chart."""
        self.tensorboard.log_scalars(metrics, step)
        if self.run is not None:
            self.run.log({key: float(value) for key, value in metrics.items()}, step=step)

    def log_image(self, tag: str, image, step: int) -> None:
        """image: a PIL image (e.g. from `image_grid`), a `wandb.Image` in the history row of `step`."""
        self.tensorboard.log_image(tag, image, step)
        if self.run is not None:
            self.run.log({tag: self._wandb.Image(image.convert("RGB"))}, step=step)

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        self.tensorboard.log_text(tag, text, step)
        if self.run is not None:
            # a summary string, not a history row: the one text the trainers log (run_metadata) comes at step 0 on
            # every start, and a resumed W&B run ignores rows below its last step; the summary is not tied to a step
            # and shows the latest attempt's text in the run's Overview
            self.run.summary[tag] = text

    def flush(self) -> None:
        """TensorBoard's flush; W&B has no flush of its own: it writes a step's row once a later step (or `close`)
        follows, so that what is logged later at the same step (validation) joins it."""
        self.tensorboard.flush()

    def close(self) -> None:
        """Finish the W&B run (idempotent), then close TensorBoard."""
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()
        self.tensorboard.close()


def _start_wandb(output_dir: str, *, config: Mapping[str, Any], project: str, name: str | None,
                 entity: str | None, resume: bool) -> tuple[Any, Any]:
    """Import wandb and start (or, with `resume`, continue) the run of `output_dir`; returns (wandb, the run).
    Raises WandbSetupError with the fix when wandb is missing, the id file is unreadable or wandb.init fails."""
    try:
        import wandb
    except ImportError as e:
        raise WandbSetupError(f"--logger wandb: wandb cannot be imported ({e}); install it with `pip install wandb`, "
                             f"or drop --logger wandb") from None
    id_path = os.path.join(output_dir, WANDB_RUN_ID_FILE)
    run_id = None
    if resume and os.path.exists(id_path):
        with open(id_path, encoding="utf-8") as f:
            run_id = f.read().strip()
        if not _WANDB_RUN_ID.fullmatch(run_id):
            raise WandbSetupError(f"--logger wandb: {id_path} holds no W&B run id ({run_id[:40]!r}); delete it to "
                                 f"log this resumed run to a new W&B run")
    run_id = run_id or uuid.uuid4().hex[:16]
    try:
        run = wandb.init(project=project, entity=entity, name=name or os.path.basename(os.path.abspath(output_dir)),
                         id=run_id, resume="allow", dir=output_dir,
                         config=json.loads(json.dumps(dict(config), default=str)),
                         # the console already goes to <output_dir>/train.log (`tee_console`): wandb leaves it
                         # alone, and prints where the run is, not its history and summary at the end
                         settings=wandb.Settings(console="off", quiet=True))
    except Exception as e:  # noqa: BLE001 (not logged in, no network, a bad entity: one line with the ways out)
        text = " ".join(str(e).split())
        raise WandbSetupError(f"--logger wandb: wandb.init failed ({type(e).__name__}: {text}); log in with `wandb "
                             f"login` (or set WANDB_API_KEY), log offline with WANDB_MODE=offline, or drop --logger "
                             f"wandb") from None
    tmp = f"{id_path}.{uuid.uuid4().hex[:8]}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(run.id + "\n")
    os.replace(tmp, id_path)
    return wandb, run


class MetricAccumulator:
    """Collect scalar metrics over micro-batches; `reduce()` = mean over micro-batches, then mean over ranks, except
    for a key ending in `_max` (`_min`): the largest (smallest) value over micro-batches and ranks, so an outlier
    sample is not averaged away (e.g. `actor/ratio_max`, the trust region's alarm).

    Tensor values stay on their device until `reduce()` (no host sync per micro-batch for callers that pass
    tensors, e.g. the losses' metrics; float and tensor values give the same bits: both are summed in float64 in
    the same order). The rank reduction is ONE all_reduce (SUM) of a float64 vector [a slot per key..., key count,
    key hash], plus one (MAX) of the extremes when there are any (`reduce`); every rank must have added the same
    keys (a different key set is detected and raised, never silently averaged).
    """

    def __init__(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    @staticmethod
    def extreme_sign(key: str) -> int:
        """+1 for a `_max` key, -1 for a `_min` key (reduced as the max of its negation), 0 for a mean."""
        return 1 if key.endswith("_max") else -1 if key.endswith("_min") else 0

    def add(self, metrics: Mapping[str, float | torch.Tensor]) -> None:
        for key, value in metrics.items():
            value = value.detach().double().mean() if isinstance(value, torch.Tensor) else float(value)
            sign = self.extreme_sign(key)
            if sign and key in self.sums:
                old = torch.as_tensor(self.sums[key], dtype=torch.float64)
                new = torch.as_tensor(value, dtype=torch.float64)
                device = old.device if old.device.type != "cpu" else new.device  # no host read of a GPU value
                self.sums[key] = sign * torch.maximum(sign * old.to(device), sign * new.to(device))
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value
            self.counts[key] = self.counts.get(key, 0) + 1

    def reduce(self) -> dict[str, float]:
        """Over this rank's adds, then over ranks (one or two collectives); clears the accumulator. Both vectors
        have one slot per key: the SUM one holds a mean key's mean and an extreme key's NaN flag (so a NaN on any
        rank is NaN everywhere: MAX does not propagate NaN across ranks), the MAX one an extreme key's signed value
        (NaN read as -inf) and -inf elsewhere."""
        keys = sorted(self.sums)
        signs = [self.extreme_sign(k) for k in keys]
        tensors = [v for v in self.sums.values() if isinstance(v, torch.Tensor)]
        device = next((v.device for v in tensors if v.device.type != "cpu"), torch.device("cpu"))  # a GPU one first
        world = get_world_size()
        key_hash = float(int(hashlib.sha1("\n".join(keys).encode()).hexdigest(), 16) % (2**40))
        values = [torch.as_tensor(self.sums[k], dtype=torch.float64, device=device).reshape(1) for k in keys]
        sums = [v.isnan().double() if sign else v / self.counts[k] for k, v, sign in zip(keys, values, signs)]
        tail = torch.tensor([float(len(keys)), key_hash], dtype=torch.float64, device=device)
        vec = torch.cat(sums + [tail])
        ext = torch.cat([(sign * v).nan_to_num(nan=-math.inf) if sign else torch.full_like(v, -math.inf)
                         for v, sign in zip(values, signs)] + [tail[:0]])
        self.sums, self.counts = {}, {}
        if world > 1 and dist.is_initialized():
            dist.all_reduce(vec)  # vectors of different lengths make this collective itself fail
        reduced = vec.tolist()
        if reduced[-1] != key_hash * world or reduced[-2] != len(keys) * world:
            raise RuntimeError(
                f"MetricAccumulator.reduce: ranks logged different metric keys (rank {get_rank()} has {keys}); "
                f"log the same keys on every rank"
            )
        if any(signs) and world > 1 and dist.is_initialized():
            dist.all_reduce(ext, op=dist.ReduceOp.MAX)
        extremes = ext.tolist()
        return {k: (reduced[i] / world if not sign else math.nan if reduced[i] > 0 else sign * extremes[i])
                for i, (k, sign) in enumerate(zip(keys, signs))}


def reward_metrics(
    rewards: torch.Tensor,
    uids: Sequence[Any],
    advantages: torch.Tensor | None = None,
    extras: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, float]:
    """`critic/rewards/*`, `critic/advantages/*` and `critic/<extra>/mean` over the global batch (verl-omni names
    and definitions).

    rewards: (B,) or (B, T) (averaged over T first); uids: (B,) prompt ids, equal within a group; advantages:
    any shape, stats over all elements. zero_std_ratio / std_mean use the population std per uid. extras: numeric
    per-sample reward extras (e.g. {"pickscore_raw": [...], "reward/ocr": [...]}) -> `critic/<key>/mean`; an extra
    named `*_frac` holds a 0/1 flag per sample and is logged as the fraction `critic/<key>` (e.g.
    `critic/reward/ocr/empty_reply_frac`, the judge's empty replies). The reward stats are over the samples with a
    finite reward (a non-finite rollout sample's reward is NaN: never scored), and NaN (a gap in TensorBoard, `n/a`
    on the console) when there is none, e.g. a step whose samples all came back non-finite.
    """
    r = rewards.detach().float().cpu()
    if r.ndim == 2:
        r = r.mean(dim=1)
    if r.ndim != 1 or len(uids) != r.shape[0]:
        raise ValueError(f"rewards must be (B,) or (B, T) with B = len(uids) = {len(uids)}, got {tuple(rewards.shape)}")
    keep = torch.isfinite(r)
    out = _reward_stats(r[keep].numpy().astype(np.float64), np.asarray([str(u) for u in uids])[keep.numpy()])
    out["critic/rewards/group_size"] = float(len(uids) / len(set(str(u) for u in uids)))
    if advantages is not None:
        a = advantages.detach().float()
        out.update({"critic/advantages/mean": float(a.mean()), "critic/advantages/max": float(a.max()),
                    "critic/advantages/min": float(a.min())})
    for key, values in (extras or {}).items():
        if len(values) != len(uids):
            raise ValueError(f"reward extra {key!r} has {len(values)} values for {len(uids)} samples")
        values = np.asarray(values, dtype=np.float64)
        if np.isfinite(values).any():  # NaN marks samples another reward scored (mixed data sources)
            # an extra named *_frac is a 0/1 flag per sample: its mean is the fraction itself
            out[f"critic/{key}" if key.endswith("_frac") else f"critic/{key}/mean"] = float(np.nanmean(values))
    return out


UNSCORED_KEYS = ("critic/rewards/mean", "critic/rewards/max", "critic/rewards/min", "critic/rewards/zero_std_ratio",
                 "critic/rewards/std_mean")


def _reward_stats(r_np: np.ndarray, uid_arr: np.ndarray) -> dict[str, float]:
    """mean / max / min / zero_std_ratio / std_mean of the scored rewards `r_np` (their prompt ids `uid_arr`);
    NaN for every one when no sample was scored."""
    if not len(r_np):
        return {key: float("nan") for key in UNSCORED_KEYS}
    groups = np.unique(uid_arr)
    stds = np.array([np.std(r_np[uid_arr == u]) for u in groups])
    return {"critic/rewards/mean": float(r_np.mean()), "critic/rewards/max": float(r_np.max()),
            "critic/rewards/min": float(r_np.min()), "critic/rewards/zero_std_ratio": float(np.mean(stds == 0)),
            "critic/rewards/std_mean": float(np.mean(stds))}


def validation_metrics(
    data_sources: Sequence[str],
    scores: Mapping[str, Sequence[float]],
    uids: Sequence[Any] | None = None,
) -> dict[str, float]:
    """`val-core/<data_source>/<var>/mean@N` and `val-aux/...` (verl-omni `process_validation_metrics` naming).

    scores: {"reward": per-sample scores, plus numeric extras such as "pickscore_raw" or "acc"}; every list has one
    value per sample, aligned with data_sources (and uids; default = one sample per prompt, N = 1). Per data source
    and variable, mean@N (and std@N for N > 1) is computed per uid, then averaged over uids. The core variable is
    "acc" when present, else "reward"; only its mean@N goes to val-core, everything else to val-aux. verl's
    bootstrap best@k / worst@k / maj@k (only defined for N > 1; validation runs N = 1) are not computed.
    """
    n = len(data_sources)
    if "reward" not in scores:
        raise ValueError("validation scores need a 'reward' entry")
    for var, vals in scores.items():
        if len(vals) != n:
            raise ValueError(f"validation scores[{var!r}] has {len(vals)} values for {n} samples")
    uids = list(range(n)) if uids is None else list(uids)
    core_var = "acc" if "acc" in scores else "reward"
    out: dict[str, float] = {}
    sources = np.asarray(list(data_sources))
    uid_arr = np.asarray([str(u) for u in uids])
    for ds in sorted(set(data_sources)):
        in_ds = sources == ds
        groups = sorted(set(uid_arr[in_ds]))
        sizes = {int((uid_arr[in_ds] == g).sum()) for g in groups}
        n_per = max(sizes)
        for var in sorted(scores):
            vals = np.asarray(scores[var], dtype=np.float64)
            per_uid = [vals[in_ds & (uid_arr == g)] for g in groups]
            prefix = "val-core" if var == core_var else "val-aux"
            out[f"{prefix}/{ds}/{var}/mean@{n_per}"] = float(np.mean([v.mean() for v in per_uid]))
            if n_per > 1:
                out[f"val-aux/{ds}/{var}/std@{n_per}"] = float(np.mean([v.std() for v in per_uid]))
    return out


@contextlib.contextmanager
def timer(name: str, timings: dict[str, float], *, cuda_sync: bool = True, skip: bool = False) -> Iterator[None]:
    """Add the wall time of the block to `timings["timing_s/<name>"]` (synchronising CUDA first when in use). The
    block is also a `torch.profiler.record_function("timing_s/<name>")` range: the phases of a profile's table.
    `skip`: the phase has no work this step; nothing is timed or recorded (its timing and MFU stay absent)."""
    if skip:
        yield
        return
    sync = cuda_sync and torch.cuda.is_available() and torch.cuda.is_initialized()
    key = f"timing_s/{name}"
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        with torch.profiler.record_function(key):
            yield
            if sync:  # inside the range: the phase's kernels end inside its window
                torch.cuda.synchronize()
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def _wrap(text: str, width_px: int, max_lines: int, char_px: int = 6) -> list[str]:
    """`text` wrapped at word boundaries into at most `max_lines` lines of the pixel width; a longer text ends
    its last line with " ..." (never cut mid-word, unless a single word is longer than a line)."""
    return textwrap.wrap(text, width=max(8, width_px // char_px), max_lines=max_lines, placeholder=" ...") or [""]


def image_grid(images: torch.Tensor | Sequence[Any], captions: Sequence[str], *, ncols: int = 4,
               caption_lines: int = 4):
    """A PIL grid of images with a caption (prompt, reward) under each; images: uint8 (B, 3, H, W) or PIL list."""
    from PIL import Image, ImageDraw, ImageFont

    if isinstance(images, torch.Tensor):
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be uint8 (B, 3, H, W), got {images.dtype} {tuple(images.shape)}")
        pil = [Image.fromarray(im.permute(1, 2, 0).cpu().numpy()) for im in images]
    else:
        pil = [im.convert("RGB") for im in images]
    if len(pil) != len(captions):
        raise ValueError(f"{len(pil)} images but {len(captions)} captions")
    if not pil:
        raise ValueError("image_grid needs at least one image")
    w, h = max(im.width for im in pil), max(im.height for im in pil)
    font = ImageFont.load_default()
    line_h = 12
    cap_h = caption_lines * line_h + 4
    ncols = min(ncols, len(pil))
    nrows = (len(pil) + ncols - 1) // ncols
    grid = Image.new("RGB", (ncols * w, nrows * (h + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (im, cap) in enumerate(zip(pil, captions)):
        x, y = (i % ncols) * w, (i // ncols) * (h + cap_h)
        grid.paste(im, (x, y))
        lines = _wrap(cap, w, caption_lines)
        for j, line in enumerate(lines):
            draw.text((x + 2, y + h + 2 + j * line_h), line, fill="black", font=font)
    return grid


def prompt_text(prompt: Any) -> str:
    """The user text of a prompt (a str, or the user message of a chat-message list), for captions and records."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in prompt if m.get("role") == "user"), "")


def sample_caption(reward: float, prompt: Any, judge_reply: str | None = None) -> str:
    """The caption of one sample in a grid: "r=0.731 | judge: 'TEXT' | the prompt" (`image_grid` wraps it at
    words); a NaN reward (a non-finite sample, never scored) reads "not scored (non-finite)"."""
    head = "not scored (non-finite)" if reward != reward else f"r={reward:.3f}"
    judge = f" | judge: {judge_reply!r}" if judge_reply is not None else ""
    return f"{head}{judge} | {prompt_text(prompt)}"


def rollout_grid(images: torch.Tensor, prompts: Sequence[Any], n: int, rewards: torch.Tensor,
                 judge_replies: Sequence[str | None] | None = None, *, max_images: int = 8):
    """A grid of this rank's first training samples in whole groups: one row per prompt, its `n` samples side by
    side with their rewards (what the group advantage compares), max(1, max_images // n) prompts. images: uint8
    (P*n, 3, H, W) in prompt-major order (sample j of prompt i at i*n + j), prompts: the P prompts, rewards (P*n,)
    with NaN for a sample that was not scored; judge_replies: the OCR judge's reply per sample (or None)."""
    if images.shape[0] != len(prompts) * n or rewards.shape[0] != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images and {rewards.shape[0]} rewards for {len(prompts)} prompts x "
                         f"n={n}")
    count = min(len(prompts), max(1, max_images // n)) * n
    replies = list(judge_replies) if judge_replies is not None else [None] * images.shape[0]
    captions = [sample_caption(float(rewards[k]), prompts[k // n], replies[k]) for k in range(count)]
    return image_grid(images[:count], captions, ncols=min(n, 8))


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` in rank order (`dist.all_gather_object`; [obj] without a process group). Collective."""
    if get_world_size() == 1 or not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_first_images(images: torch.Tensor, first_row: int, k: int) -> torch.Tensor:
    """The first k samples of the global order, on every rank, from the ranks' contiguous blocks: this rank holds
    samples first_row .. first_row + len(images) - 1 (uint8 (B, 3, H, W)). Collective (one object all_gather);
    returns (min(k, total), 3, H, W)."""
    mine = images[: max(0, min(len(images), k - first_row))].cpu()
    if k <= 0 or get_world_size() == 1 or not dist.is_initialized():  # k is the same on every rank
        return mine
    parts = all_gather_objects((first_row, mine))
    return torch.cat([t for _, t in sorted(parts, key=lambda p: p[0]) if len(t)])[:k]


class Progress:
    """A one-line progress report per step with the ETA from the mean step time (the first step, which carries
    compilation / warm-up, is excluded once later steps exist)."""

    def __init__(self, total_steps: int, start_step: int = 0) -> None:
        self.total_steps, self.start_step = int(total_steps), int(start_step)
        self.step_times: list[float] = []

    def line(self, step: int, step_time_s: float, metrics: Mapping[str, float] | None = None,
             keys: Sequence[str] = ("critic/rewards/mean", "actor/grad_norm")) -> str:
        self.step_times.append(float(step_time_s))
        times = self.step_times[1:] if len(self.step_times) > 1 else self.step_times
        remaining = max(self.total_steps - step, 0)
        eta = datetime.timedelta(seconds=int(round(remaining * sum(times) / len(times))))
        parts = [f"step {step}/{self.total_steps}", f"{step_time_s:.2f}s/step", f"ETA {eta}"]
        shown = metrics or {}
        for k in keys:
            if k in shown:
                value = shown[k]
                text = "n/a" if k in UNSCORED_KEYS and value != value else f"{value:.4g}"  # n/a: nothing scored
                parts.append(f"{k.split('/', 1)[-1]} {text}")
        return " | ".join(parts)


def run_summary(first_step: int, last_step: int, seconds: float, val_metrics: Mapping[str, float],
                checkpoint: str | None, output_dir: str) -> str:
    """The line a trainer prints when its last step is done: the steps this process ran and their time, the last
    validation's `val-core/*` values, the last checkpoint and where the logs are."""
    steps = last_step - first_step + 1
    parts = [f"done: steps {first_step}-{last_step} in {datetime.timedelta(seconds=int(round(seconds)))} "
             f"({seconds / max(steps, 1):.2f} s/step)"]
    core = {k: v for k, v in val_metrics.items() if k.startswith("val-core/")}
    if core:
        parts.append("last validation " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(core.items())))
    if checkpoint:
        parts.append(f"checkpoint {checkpoint}")
    parts.append(f"logs {os.path.join(output_dir, 'tensorboard')} and {os.path.join(output_dir, LOG_FILE)}")
    return " | ".join(parts)


def git_commit(repo_dir: str | None = None) -> str:
    """`git rev-parse HEAD` of the code (suffix "-dirty" with uncommitted changes); "unknown" outside git."""
    repo_dir = repo_dir or os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_dir,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_run_metadata(out_dir: str, config: Mapping[str, Any], *, seeds: Mapping[str, int] | None = None,
                       logger: TensorBoardLogger | WandbLogger | None = None,
                       rollout_env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Rank 0: write `<out_dir>/run_metadata.json` (full config, versions, git commit, seeds, world size, argv,
    host, time; with `rollout_env`, the rollout workers' interpreter and library versions from
    `rollout.check_rollout_python`) and, with a logger, the same JSON as TensorBoard text. Returns the metadata on
    every rank."""
    meta = {
        "config": json.loads(json.dumps(dict(config), default=str)),
        "versions": library_versions(),
        "git_commit": git_commit(),
        "seeds": dict(seeds or {}),
        "world_size": get_world_size(),
        "argv": list(sys.argv),
        "host": socket.gethostname(),
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }
    if rollout_env is not None:
        meta["rollout_env"] = dict(rollout_env)
    if is_main_process():
        os.makedirs(out_dir, exist_ok=True)
        tmp = os.path.join(out_dir, f".run_metadata.json.{uuid.uuid4().hex[:8]}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(out_dir, "run_metadata.json"))
        if logger is not None:
            logger.log_text("run_metadata", "```\n" + json.dumps(meta, indent=2, sort_keys=True) + "\n```")
    return meta


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with the module docstring as written and every flag's default, also for flags without help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # a None default whose help already says what it means ("None = 4.0 ...", "default: --genrm_model") would
        # print the default twice, once as a useless "(default: None)"
        if action.default is None and action.help and ("default" in action.help.lower() or "None =" in action.help):
            return action.help
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings and action.default is not argparse.SUPPRESS:
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)
