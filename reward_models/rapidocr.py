"""The RapidOCR reader: an offline CPU OCR engine (PP-OCR ONNX weights shipped in the wheel), optionally one
engine per process of a spawn pool. Takes PIL images, returns the transcriptions; `rewards.ocr_score` scores them.

May import the standard library, numpy, PIL and (lazily) rapidocr; never `rewards` (which imports it).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from typing import Sequence

import numpy as np
from PIL import Image


class RapidOCRReader:
    """Offline CPU OCR engine (RapidOCR, PP-OCR ONNX weights shipped in the wheel): the Flow-GRPO PaddleOCR-style
    reward. As in flow_grpo, no angle classifier and every detected line is concatenated with no separator, in
    reading order; a line is kept when its confidence exceeds `min_confidence` (flow_grpo: > 0).

    Detection resizes so the LONGER side is at most `det_limit_side_len` (PaddleOCR's 960/"max" default).
    RapidOCR's own default ("min" side 736) upsamples a 256^2 image ~3x and is ~10x slower.
    """

    def __init__(self, *, det_limit_side_len: int = 960, min_confidence: float = 0.0, num_threads: int = 1,
                 num_workers: int = 1):
        from rapidocr import RapidOCR

        self.min_confidence = min_confidence
        params = {
            "Global.use_cls": False,
            "Global.text_score": 0.0,
            "Global.log_level": "warning",
            "Det.limit_type": "max",
            "Det.limit_side_len": det_limit_side_len,
            "EngineConfig.onnxruntime.intra_op_num_threads": num_threads,
            "EngineConfig.onnxruntime.inter_op_num_threads": 1,
        }
        # num_workers > 1: one engine per process of a spawn pool (RapidOCR's pre/post-processing holds the GIL, and
        # small images leave onnxruntime's intra-op threads idle); a worker that dies raises BrokenProcessPool.
        self.pool = None if num_workers <= 1 else concurrent.futures.ProcessPoolExecutor(
            num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_rapidocr_init,
            initargs=(params,))
        self.engine = RapidOCR(params=params) if self.pool is None else None

    def transcribe(self, images: Sequence[Image.Image]) -> list[str]:
        arrays = [np.asarray(img) for img in images]  # RGB HWC uint8; errors propagate
        if self.pool is not None:
            lines = list(self.pool.map(_rapidocr_lines, arrays))
        else:
            lines = [_rapidocr_lines(array, self.engine) for array in arrays]
        return ["".join(t for t, s in found if s > self.min_confidence) for found in lines]


_RAPIDOCR_ENGINE = None  # the engine of a RapidOCRReader pool process


def _rapidocr_init(params: dict) -> None:
    global _RAPIDOCR_ENGINE
    from rapidocr import RapidOCR

    _RAPIDOCR_ENGINE = RapidOCR(params=params)


def _rapidocr_lines(array: np.ndarray, engine=None) -> list[tuple[str, float]]:
    """(text, confidence) of every detected line, in reading order (`engine`: this process's pool engine if None)."""
    out = (engine or _RAPIDOCR_ENGINE)(array)
    return list(zip(out.txts or (), out.scores or ()))
