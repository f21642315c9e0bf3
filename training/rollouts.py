"""One training rollout as both trainers run it: the request for this rank's prompts (n samples each, seeded per
global row), its submission (scored while it samples), and its collection with the checks every step needs
(non-finite samples skip the update, a judge that does not read stops the run), plus --rollout_policy_lag's
look-ahead."""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Sequence

from .distributed import get_rank, run_phase
from .logs import rollout_grid
from .scoring import (JUDGE_LOG, JudgeNotReading, JudgeReplyCounts, RewardStream, sum_over_ranks, judge_records,
                      judge_reply_counts, log_judge_replies, nonfinite_rows, score_inputs, score_samples)

__all__ = ["rollout_request", "submit_rollout", "rollout_and_score", "log_rollout_images", "peek_batch",
           "lag_next_rollout"]


def rollout_request(rows: Sequence[Any], *, n: int, first_row: int, seed: int, step: int, num_inference_steps: int,
                    height: int, width: int, cfg_scale: float, **algo: Any):
    """The rollout request for this rank's prompts: each prompt repeated n times (interleaved, a group per prompt),
    per-sample seeds `rollout.row_seed(seed, step, global row)` with global rows numbered from `first_row`, the
    run's one CFG scale (negative prompts sent only when it guides, > 1); `algo`: the SDE knobs."""
    import rollout

    prompts, negatives, images = [], [], []
    edit = any(row.images for row in rows)
    for row in rows:
        for _ in range(n):
            prompts.append(row.prompt)
            negatives.append(row.negative_prompt)
            images.append(row.images[0] if row.images else None)
    guided = cfg_scale > 1.0
    if guided and any(neg is None for neg in negatives):
        raise ValueError("guidance is on but a prompt has no negative prompt (the dataset loader should have refused it)")
    return rollout.RolloutRequest(
        prompts=prompts, negative_prompts=negatives if guided else None, images=images if edit else None,
        seeds=[rollout.row_seed(seed, step, first_row + i) for i in range(len(prompts))],
        num_inference_steps=num_inference_steps, height=height, width=width, cfg_scale=cfg_scale, **algo)


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
    def collect_and_score():
        lagged = run.rollout.has_pending
        if not lagged:
            submit_rollout(run, request, rows)
        result, scored, stats = run.rollout.collect(request, lagged=lagged)
        bad = nonfinite_rows(result)  # never scored (RewardStream / score_samples skip them)
        if scored is None:  # --no_reward_overlap: each rank scores its own samples now
            start = time.perf_counter()
            scored = score_samples(run.scorer, result.images, rows, run.args.rollout_n, bad)
            stats["timing_s/reward"] = stats["timing_s/reward_total"] = time.perf_counter() - start
        return result, scored, stats, bad

    phase = f"the rollout{f' of step {step}' if step is not None else ''}"
    # every rank raises alike, after the last finished step was written
    result, scored, stats, bad = run_phase(collect_and_score, phase, run.raise_fatal)
    counts = [int(c) for c in sum_over_ranks([len(bad), *judge_reply_counts(scored).as_list()])]
    nonfinite, replies = counts[0], JudgeReplyCounts(*counts[1:])
    stats["rollout/nonfinite_samples"] = float(nonfinite)
    # like a non-finite loss: every update of this step is skipped (and counted towards --max_consecutive_skips)
    run.stepper.reject_batch(f"{nonfinite} non-finite rollout sample(s) (NaN/inf latents; not scored)"
                             if nonfinite else "")
    if nonfinite and get_rank() == 0:
        print(f"step {step}: {nonfinite} rollout sample(s) came back non-finite (NaN/inf latents): not scored, and "
              f"the step's update is skipped like a non-finite loss", flush=True)
    if step is not None:
        check_judge_replies(run, rows, scored, replies, step, phase)
    image_freq = getattr(run.args, "rollout_image_freq", 0)
    if step is not None and image_freq and step % image_freq == 0 and get_rank() == 0:
        log_rollout_images(run.logger, result, scored, rows, bad, run.args, step)
    version = result.metadata.get("adapter_version")  # as the workers report it: "v<step>" (sync_rollout_adapter)
    if isinstance(version, str) and version[1:].isdigit():
        stats["rollout/adapter_version"] = float(version[1:])
    timings.update(stats)
    return result, scored


def check_judge_replies(run, rows: Sequence[Any], scored, replies: JudgeReplyCounts, step: int, phase: str) -> None:
    """The judge's replies of training step `step` (`replies`: counted over every rank): every --judge_log_freq-th
    step all of them go to <output_dir>/judge_replies.jsonl; a step with over-long or refusing replies logs those
    and prints one line with examples; more than --judge_max_unusable_frac of them not readings (empty, over-long,
    refusals) stops the run with the last finished step saved (`JudgeNotReading`). A generative judge (served or
    local) that answers with nothing, a ramble or a refusal is broken; RapidOCR finding no text in an illegible
    image has read it correctly (its empty transcription scores 0 and teaches legibility), so it is never stopped.
    Collective (every rank sees the same counts)."""
    args = run.args
    generative = args.ocr_backend != "rapidocr"
    limit = getattr(args, "judge_max_unusable_frac", 1.0)
    stop = generative and replies.judged > 0 and replies.unusable / replies.judged > limit
    odd = generative and replies.overlong + replies.refusal > 0
    log_all = bool(args.judge_log_freq) and step % args.judge_log_freq == 0
    if not (log_all or stop or odd):
        return
    records = judge_records(rows, args.rollout_n, scored, phase="train", step=step)
    if not (log_all or stop):
        records = [r for r in records if r.get("ocr/reply_kind") in ("overlong", "refusal")]
    logged = log_judge_replies(args.output_dir, records)
    log_path = os.path.join(args.output_dir, JUDGE_LOG)
    what = (f"{replies.unusable} of the {replies.judged} samples it read in step {step} were not readings "
            f"({replies.empty} empty, {replies.overlong} over-long, {replies.refusal} refusals)")
    if odd and get_rank() == 0:
        examples = [r["ocr/response"] for r in logged if r.get("ocr/reply_kind") in ("overlong", "refusal")][:2]
        shown = "; ".join(repr(e[:80] + ("..." if len(e) > 80 else "")) for e in examples)
        print(f"step {step}: the OCR judge's replies to {what}, e.g. {shown or '(a reply too large to read)'}; "
              f"they are in {log_path}", flush=True)
    if stop:
        which = f"--genrm_url {args.genrm_url}" if args.ocr_backend == "http" else f"--ocr_backend {args.ocr_backend}"
        error = JudgeNotReading(
            f"the OCR judge ({which}): {what}, {replies.unusable / replies.judged:.0%} > --judge_max_unusable_frac "
            f"{limit:g}: a judge that does not read trains on zero rewards. Its replies are in {log_path}; check the "
            f"served model and its prompt, then --resume auto")
        run.lifeboat.fail_with_checkpoint(error, phase)
        raise error


def log_rollout_images(logger, result, scored, rows: Sequence[Any], bad: Sequence[int], args, step: int) -> None:
    """TensorBoard `rollout/samples`: this rank's first --num_rollout_images training samples of `step` in whole
    groups (`rollout_grid`), each captioned with its reward (NaN, "not scored", for a non-finite sample in `bad`)
    and the OCR judge's reply when there is one. Not collective (call it on rank 0)."""
    rewards = scored.rewards.detach().float().cpu().clone()
    rewards[list(bad)] = float("nan")
    grid = rollout_grid(result.images, [row.prompt for row in rows], args.rollout_n, rewards,
                        scored.texts.get("ocr/response"), max_images=args.num_rollout_images)
    logger.log_image("rollout/samples", grid, step)


def peek_batch(sampler):
    """The batch `sampler.next_batch()` will return next, without moving the sampler (its checkpointed cursor
    keeps counting completed steps only)."""
    return copy.copy(sampler).next_batch()


def lag_next_rollout(run, step: int) -> bool:
    """--rollout_policy_lag 1: submit step + 1's rollout now, to sample while this step trains? Not after the last
    step, and not on a step that may write a checkpoint (every --save_freq steps, and while one deferred from a
    skipped step is pending: `Lifeboat.save_pending`), so that no rollout is pending at a scheduled checkpoint and
    --resume continues exactly (the step after a checkpoint samples unlagged, in the resumed run as in the
    uninterrupted one). The checkpoints of a stop (a signal, --max_wall_time_s, a fatal error) fall anywhere: a
    resume from one samples the next step unlagged, so it is not bit-identical to the uninterrupted run."""
    args = run.args
    return bool(getattr(args, "rollout_policy_lag", 0)) and step < args.total_training_steps \
        and step % args.save_freq != 0 and not run.lifeboat.save_pending
