"""ODE validation on the test split: one code path for in-training validation (`validate`) and
scripts/evaluate.py (`run_validation`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .distributed import get_rank, get_world_size, raise_if_any_rank_failed, run_phase
from .logs import (all_gather_objects, gather_first_images, image_grid, prompt_text, sample_caption, timer,
                   validation_metrics)
from .rollouts import rollout_request
from .scoring import append_judge_log, nonfinite_rows, score_samples

__all__ = ["ValidationOutcome", "run_validation", "validate"]


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


def run_validation(rollout_client, scorer, dataset, args, *, cfg_scale: float,
                   fail: Callable[[BaseException | None, str], None] = raise_if_any_rank_failed) -> ValidationOutcome:
    """ODE validation on the test split: THE code path of in-training validation (`validate`) and of
    scripts/evaluate.py. The first --val_max_samples prompts (0 = all) split over the ranks in contiguous blocks,
    one sample per prompt with seed `rollout.row_seed(--val_seed, 1, prompt index)` (so the numbers do not depend
    on the world size or batching), noise 0, --val_num_inference_steps, --height x --width, CFG `cfg_scale`; rewards
    from `scorer`; `val-core/<data_source>/reward/mean@1` + val-aux extras (`validation_metrics`) over every
    rank's samples that came back finite, `val-aux/nonfinite_samples` (the others: never scored, their records'
    reward NaN and "nonfinite": True), plus `timing_s/testing`. `rollout_client`: anything with `generate(RolloutRequest)` (the
    trainers' DistributedRollout, evaluate.py's NativeEngine). A failure of this rank's sampling or scoring ends
    every rank alike through `run_phase(..., fail)` (a trainer's `Run.raise_fatal` also writes the last finished
    step) instead of leaving the others waiting in the gather below. Collective."""
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
                                  width=args.width, cfg_scale=cfg_scale, noise_level=0.0)
        def sample_and_score():
            result = rollout_client.generate(request)
            bad = nonfinite_rows(result)  # never scored: their images are not a policy's samples
            return result, bad, score_samples(scorer, result.images, rows, 1, bad)
        result, bad, scored = run_phase(sample_and_score, "the validation", fail)
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


def validate(rollout_client, scorer, dataset, args, step: int, cfg_scale: float, logger,
             fail: Callable[[BaseException | None, str], None] = raise_if_any_rank_failed) -> dict[str, float]:
    """In-training validation: `run_validation` (`fail`: its failure policy), then (rank 0) TensorBoard
    `val-core/...`, `val-aux/...` and a captioned grid of the first --num_val_images samples of ALL ranks, and one
    console line. Collective."""
    outcome = run_validation(rollout_client, scorer, dataset, args, cfg_scale=cfg_scale, fail=fail)
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
