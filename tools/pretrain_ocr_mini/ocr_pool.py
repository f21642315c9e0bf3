"""The CPU pool, spawned once per call: rendering and the project's rapidocr reward, asynchronous."""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from typing import Any, Sequence

import numpy as np
import torch

from .data import render_batch


_WORKER: dict[str, Any] = {}


def _worker_init(det_limit_side_len: int) -> None:
    torch.set_num_threads(1)
    _WORKER["det_limit_side_len"] = det_limit_side_len


def _render_task(args: tuple[int, list[str], list[int], int]) -> tuple[int, np.ndarray]:
    start, words, seeds, size = args
    return start, render_batch(words, seeds, size)


def _score_task(args: tuple[np.ndarray, list[str]]) -> tuple[list[float], list[str]]:
    """rapidocr rewards of (n, 3, H, W) uint8 images through the project's own RewardScorer."""
    import rewards

    images, targets = args
    if "scorer" not in _WORKER:
        import logging

        scorer = rewards.RewardScorer(rewards.RewardConfig(
            ocr_backend="rapidocr", rapidocr_det_limit_side_len=_WORKER["det_limit_side_len"], rapidocr_threads=1))
        scorer.warmup(["ocr"])
        logging.getLogger("RapidOCR").setLevel(logging.ERROR)  # "text detection result is empty" per blank image
        _WORKER["scorer"] = scorer
    result = _WORKER["scorer"].score_batch(torch.from_numpy(images), targets, ["ocr"] * len(targets))
    return result.rewards.tolist(), list(result.texts["ocr/response"])


class PendingScore:
    """An OCR scoring job running on the pool; `ready()` polls, `get()` waits (worker errors are raised)."""

    def __init__(self, job, n: int, started: float, meta: dict[str, Any]):
        self.job, self.n, self.started, self.meta = job, n, started, meta

    def ready(self) -> bool:
        return self.job.ready()

    def get(self, timeout_s: float = 300.0) -> tuple[np.ndarray, list[str], float]:
        """(scores (n,), transcriptions, seconds since submission); a worker that died or hangs raises
        multiprocessing.TimeoutError after timeout_s instead of blocking the call past its budget."""
        parts = self.job.get(timeout=timeout_s)
        scores = np.array([r for part in parts for r in part[0]], dtype=np.float64)
        texts = [t for part in parts for t in part[1]]
        if scores.shape != (self.n,) or not np.isfinite(scores).all():
            raise RuntimeError(f"OCR scoring returned {scores.shape} scores for {self.n} images (or non-finite)")
        return scores, texts, time.monotonic() - self.started


class CpuPool:
    """`workers` spawned processes: `render()` fills a uint8 (N, 3, H, W) tensor on `device` as chunks arrive;
    `score()` submits rapidocr scoring and returns a `PendingScore` at once."""

    def __init__(self, workers: int, det_limit_side_len: int):
        self.workers = max(1, int(workers))
        self.pool = mp.get_context("spawn").Pool(self.workers, initializer=_worker_init,
                                                 initargs=(det_limit_side_len,))

    def render(self, words: Sequence[str], seeds: Sequence[int], size: int, device: torch.device,
               chunk: int = 512) -> torch.Tensor:
        n = len(seeds)
        out = torch.empty((n, 3, size, size), dtype=torch.uint8, device=device)
        tasks = [(s, [words[i] for i in range(s, min(n, s + chunk))], [seeds[i] for i in range(s, min(n, s + chunk))],
                  size) for s in range(0, n, chunk)]
        for start, arr in self.pool.imap_unordered(_render_task, tasks):
            block = torch.from_numpy(arr).to(device, non_blocking=False)
            out[start:start + arr.shape[0]].copy_(block.permute(0, 3, 1, 2))
        return out

    def score(self, images: torch.Tensor, targets: Sequence[str], meta: dict[str, Any] | None = None) -> PendingScore:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[0] != len(targets):
            raise ValueError(f"score() takes uint8 (B, 3, H, W) images with one target each, got "
                             f"{tuple(images.shape)} {images.dtype} for {len(targets)} targets")
        arr = images.cpu().numpy()
        per = max(1, math.ceil(len(targets) / (2 * self.workers)))
        chunks = [(arr[i:i + per], list(targets[i:i + per])) for i in range(0, len(targets), per)]
        return PendingScore(self.pool.map_async(_score_task, chunks), len(targets), time.monotonic(), meta or {})

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


def ocr_metrics(rewards: np.ndarray) -> dict[str, float]:
    """Summary of a (P prompts, S seeds) reward matrix.

    mean = mean of all rewards; exact = fraction of samples with reward 1 (the target is contained in the
    transcription); within_std = mean over prompts of the population std over seeds (ddof 0); spread = fraction of
    prompts whose seeds do not all score the same.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.size == 0:
        raise ValueError(f"ocr_metrics takes a (prompts, seeds) matrix, got shape {r.shape}")
    return {
        "mean": float(r.mean()),
        "exact": float((r >= 1.0 - 1e-9).mean()),
        "within_std": float(r.std(axis=1).mean()),
        "spread": float((r.max(axis=1) - r.min(axis=1) > 1e-9).mean()),
        "n_prompts": int(r.shape[0]),
        "n_seeds": int(r.shape[1]),
    }
