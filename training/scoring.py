"""Rewards of a rollout and their advantages: the score inputs of each row, scoring that skips non-finite samples,
`RewardStream` (scoring while the rollout still samples), the judge's reply log and the counts of its replies that
are not readings, and the group advantages over the global batch."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

import losses

from .distributed import all_gather_cat, get_rank, get_world_size
from .logs import all_gather_objects, reward_metrics

__all__ = ["score_inputs", "score_samples", "nonfinite_rows", "score_finite", "RewardStream", "JUDGE_LOG",
           "JudgeNotReading", "JudgeReplyCounts", "judge_reply_counts", "judge_records", "log_judge_replies",
           "append_judge_log",
           "global_advantages", "sum_over_ranks"]


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
    a reward. Its reward is NaN (its step's update is skipped, see `rollout_and_score`; the reward statistics leave
    it out), its extras NaN and its texts None. With no bad row this is exactly one `score_batch` call over every
    row."""
    import rewards

    if not bad:
        return scorer.score_batch(images, **inputs)
    n, bad_set = len(images), set(bad)
    good = [i for i in range(n) if i not in bad_set]
    full = rewards.RewardResult(rewards=torch.full((n,), float("nan")), extras={}, texts={})
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


JUDGE_LOG = "judge_replies.jsonl"


class JudgeNotReading(RuntimeError):
    """More than --judge_max_unusable_frac of a step's judge replies were not readings (empty, over-long, refusals);
    the message names the replies' log."""


@dataclass(frozen=True)
class JudgeReplyCounts:
    """How many of the samples an OCR judge read gave each kind of reply that is not a reading
    (`rewards.judge_reply_kind`). `unusable` = empty + overlong + refusal."""

    judged: int = 0
    empty: int = 0
    overlong: int = 0
    refusal: int = 0

    @property
    def unusable(self) -> int:
        return self.empty + self.overlong + self.refusal

    def as_list(self) -> list[int]:
        return [self.judged, self.empty, self.overlong, self.refusal]


def judge_reply_counts(scored) -> JudgeReplyCounts:
    """The `JudgeReplyCounts` of one `RewardResult`, from its per-sample 0/1 extras (NaN where no judge read the
    sample; a RapidOCR result carries only the empty one)."""
    import rewards

    extras = scored.extras if scored is not None else {}
    if rewards.OCR_EMPTY_REPLY not in extras:
        return JudgeReplyCounts()
    read = ~torch.isnan(extras[rewards.OCR_EMPTY_REPLY])

    def count(key: str) -> int:
        return int(extras[key][read].sum().item()) if key in extras else 0

    return JudgeReplyCounts(int(read.sum().item()), count(rewards.OCR_EMPTY_REPLY),
                            count(rewards.OCR_OVERLONG_REPLY), count(rewards.OCR_REFUSAL_REPLY))


def sum_over_ranks(values: Sequence[float]) -> torch.Tensor:
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


def log_judge_replies(output_dir: str, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append every rank's `records` to <output_dir>/judge_replies.jsonl on rank 0 (one JSON object per line) and
    return them all (on every rank). Collective."""
    everyone = [r for part in all_gather_objects(list(records)) for r in part]
    if get_rank() == 0:
        append_judge_log(output_dir, everyone)
    return everyone


def append_judge_log(output_dir: str, records: Sequence[dict[str, Any]]) -> None:
    """Append `records` to <output_dir>/judge_replies.jsonl, one JSON object per line (this process only)."""
    import json

    if records:
        with open(os.path.join(output_dir, JUDGE_LOG), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def global_advantages(scored, n: int, *, global_std: bool, norm_by_std: bool,
                      num_steps: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """Group advantages over the GLOBAL batch (every rank's rewards; a group never spans ranks) plus the
    `critic/*` metrics (reward extras included, NaN where a reward did not score a sample); returns this rank's
    slice of the advantages. A non-finite sample's NaN reward counts as 0 in the advantages (its step's update is
    skipped anyway) and is left out of the reward statistics. Collective."""
    all_rewards = all_gather_cat(scored.rewards.float())
    group_ids = [i // n for i in range(all_rewards.shape[0])]
    advantages = losses.group_advantages(torch.nan_to_num(all_rewards, nan=0.0), group_ids, global_std=global_std,
                                         norm_by_std=norm_by_std, num_steps=num_steps)
    extras = {key: all_gather_cat(values.float()).tolist() for key, values in sorted(scored.extras.items())}
    metrics = reward_metrics(all_rewards, group_ids, advantages, extras=extras)
    start = get_rank() * scored.rewards.shape[0]
    return advantages[start:start + scored.rewards.shape[0]], metrics
