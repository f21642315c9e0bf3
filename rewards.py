"""Reward functions for T2I / TI2I RL post-training: OCR (GenRM or OCR engine), PickScore, JPEG size, and sums.

One entry point for the trainers:

    scorer = RewardScorer(RewardConfig.from_args(args))       # once per process; models load lazily, once
    result = scorer.score_batch(images, ground_truths, data_sources, extra_infos)
    result.rewards            # (B,) float32
    result.extras             # {"reward/<name>": (B,) float32, ...}, NaN where a sample was not scored by <name>
    result.texts              # {"ocr/response": [str | None] * B}, the judge's verbatim replies

Conventions:
- Images are uint8 `(3, H, W)` tensors in [0, 255] (verl-omni's convention since PR #373), as a list or one
  uint8 `(B, 3, H, W)` tensor. Anything else (float pixels in [0, 1], HWC, numpy) raises.
- `data_source` names the REWARD that scores the row (`ocr`, `pickscore`, `jpeg_compressibility`,
  `jpeg_incompressibility`), never the task or the algorithm.
- `ocr` ground truth is the bare quoted target text; `pickscore` ground truth is the caption / edit instruction.
- A reward that fails raises; it never turns into a zero.

Extras (numeric, (B,) float32, NaN where a sample was not scored by that reward): `reward/<name>` for every reward
computed; `pickscore/raw` = exp(logit_scale)*cos before the /26 (the published PickScore scale, ~21-24);
`ocr/exact_match` = 1 when the whole normalised transcription equals the normalised target, else 0;
`reward/ocr/empty_reply_frac` = 1 when the judge's reply was empty or whitespace (an empty transcription, scored as
one: 0 against a non-empty target), else 0 - logged as a fraction, `critic/reward/ocr/empty_reply_frac`; for the
generative judges (http, local) also `reward/ocr/overlong_reply_frac`, `reward/ocr/refusal_frac` and
`reward/ocr/unusable_reply_frac` (any of the three), from `judge_reply_kind`, and the text extra `ocr/reply_kind`;
`reward/combined` for multi-reward. Metric keys are built by the trainers (training.validation_metrics); in a batch
that mixes data sources, average extras with NaNs dropped.

Multi-reward (`--reward_weights ocr=1.0,jpeg_compressibility=0.01`): every sample is scored by every listed reward
and gets the weighted sum. A reward that is not the row's own data_source reads its ground truth from extra_info
(`ocr`: "target_text", `pickscore`: "instruction"; the edit converter writes both) and raises if it is absent.

The scorer holds only plain config until a reward is first used, so it can be built in a separate reward process
(e.g. a `multiprocessing` worker or a standalone server script) from a pickled `RewardConfig`.

This module is the reward API: the inputs, the small pure reward functions (OCR score, JPEG size) and the scorer;
the reward models live in `reward_models/` (`genrm.py`: the OCR judge over HTTP or in-process; `rapidocr.py`;
`pickscore.py`: open_clip conversion + PickScore). It imports them; they never import it.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from PIL import Image

from reward_models.genrm import (
    GENRM_MAX_BACKOFF_S, REPLY_TOO_LARGE, DaemonThreadPool, GenRMHttpReader, GenRMLocalReader, GenRMServerError,
    SamplingConfig, JudgeUrls, genrm_request_budget_s,
)
from reward_models.pickscore import PickScore, default_cache_dir
from reward_models.rapidocr import RapidOCRReader

__all__ = [
    # inputs
    "PIXEL_CONVENTION", "as_image_list", "validate_images", "to_pil",
    # the small reward functions
    "ocr_score", "ocr_exact_match", "judge_reply_kind", "judge_probe_image", "jpeg_size_kb", "jpeg_compressibility",
    "jpeg_incompressibility",
    # the scorer and its flags
    "Reward", "REWARDS", "REWARD_NAMES", "OCR_BACKENDS", "OCR_EMPTY_REPLY", "OCR_OVERLONG_REPLY",
    "OCR_REFUSAL_REPLY", "OCR_UNUSABLE_REPLY", "OCR_REPLY_KINDS", "JUDGE_PROBE_WORD", "RewardConfig",
    "parse_reward_weights", "reward_weights_arg", "add_reward_args", "RewardResult", "RewardScorer",
    "check_pickscore_flags",
    # re-exported from reward_models/ (the reward models' names the trainers and the scorer's users meet)
    "SamplingConfig", "GenRMServerError", "DaemonThreadPool", "genrm_request_budget_s", "PickScore",
]

PIXEL_CONVENTION = "uint8 tensor of shape (3, H, W) with values in [0, 255] (RGB, CHW)"
OCR_BACKENDS = ("http", "local", "rapidocr")
# The per-sample 0/1 extra marking an empty or whitespace judge reply; its batch mean is logged as
# critic/reward/ocr/empty_reply_frac (training.logs.reward_metrics: an extra named *_frac is a fraction).
OCR_EMPTY_REPLY = "reward/ocr/empty_reply_frac"
# What a generative judge's reply is (`judge_reply_kind`): a reading, or a kind that is not one; each of those has its
# per-sample 0/1 extra (logged as fractions), and OCR_UNUSABLE_REPLY marks any of them.
OCR_REPLY_KINDS = ("reading", "empty", "overlong", "refusal")
OCR_OVERLONG_REPLY = "reward/ocr/overlong_reply_frac"
OCR_REFUSAL_REPLY = "reward/ocr/refusal_frac"
OCR_UNUSABLE_REPLY = "reward/ocr/unusable_reply_frac"
# A reply longer than this many characters per --genrm_max_tokens token is over-long even when the server did not
# say it stopped at max_tokens (English text averages ~4 characters per token)
CHARS_PER_TOKEN = 4
# The word of the start-up probe image (`judge_probe_image`): the judge must read it before a run starts
JUDGE_PROBE_WORD = "OPEN"


# ----------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------

def as_image_list(images: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    """A list of uint8 (3, H, W) tensors, or a uint8 (B, 3, H, W) batch (the rollout's output) -> validated list.
    Raises ValueError for anything else (float pixels, HWC, grayscale, numpy, ...)."""
    if isinstance(images, torch.Tensor):
        if images.dim() != 4:
            raise ValueError(f"a batched image tensor must be (B, 3, H, W), got shape {tuple(images.shape)}; "
                             f"or pass a list with each item a {PIXEL_CONVENTION}")
        images = list(images.unbind(0))
    images = list(images)
    validate_images(images)
    return images


def validate_images(images: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless every image is a uint8 (3, H, W) tensor."""
    for i, img in enumerate(images):
        if not isinstance(img, torch.Tensor):
            raise ValueError(f"image {i}: expected a torch.Tensor ({PIXEL_CONVENTION}), got {type(img).__name__}")
        if img.dtype != torch.uint8:
            hint = (" Float images in [0, 1] must be converted with (img * 255).round().clamp(0, 255).to(torch.uint8)."
                    if img.is_floating_point() else "")
            raise ValueError(f"image {i}: dtype {img.dtype}; rewards take a {PIXEL_CONVENTION}.{hint}")
        if img.dim() != 3 or img.shape[0] != 3:
            raise ValueError(f"image {i}: shape {tuple(img.shape)}; rewards take a {PIXEL_CONVENTION}")


def to_pil(image: torch.Tensor) -> Image.Image:
    """uint8 (3, H, W) tensor -> RGB PIL image (no value rescaling)."""
    return Image.fromarray(image.detach().cpu().permute(1, 2, 0).contiguous().numpy(), mode="RGB")


# ----------------------------------------------------------------------------------------------------------------
# OCR score (the readers, GenRM over HTTP / in-process and RapidOCR, are in reward_models/)
# ----------------------------------------------------------------------------------------------------------------

_WHITESPACE = re.compile(r"\s+")


def ocr_score(transcription: str, target: str) -> float:
    """verl-omni's GenRM OCR score, in [0, 1].

    Both strings lose every whitespace character and are lowercased. A target contained in the transcription scores
    1; otherwise the Levenshtein distance, capped at len(target), gives 1 - d / len(target). An empty target scores 1
    only against an empty transcription.
    """
    import Levenshtein

    text = _WHITESPACE.sub("", transcription).lower()
    gt = _WHITESPACE.sub("", target).lower()
    if len(gt) == 0:
        return 1.0 if len(text) == 0 else 0.0
    dist = 0 if gt in text else Levenshtein.distance(text, gt)
    dist = min(dist, len(gt))
    return 1.0 - dist / len(gt)


def ocr_exact_match(transcription: str, target: str) -> float:
    """1.0 when the transcription equals the target after `ocr_score`'s normalisation (every whitespace removed,
    lowercase), else 0.0: extra text, which `ocr_score` forgives as a substring, is not an exact match."""
    return float(_WHITESPACE.sub("", transcription).lower() == _WHITESPACE.sub("", target).lower())


# ----------------------------------------------------------------------------------------------------------------
# JPEG size (DDPO)
# ----------------------------------------------------------------------------------------------------------------

_REFUSAL = re.compile(
    r"(?:i'?m|i am) (?:sorry|unable|not able)\b|sorry,? (?:but )?i\b|i (?:can ?not|can't|won't|apologi[sz]e)\b"
    r"|unfortunately,? i\b|as an ai\b", re.IGNORECASE)


def judge_reply_kind(reply: str, target: str, max_tokens: int) -> str:
    """What a generative judge's reply is, one of OCR_REPLY_KINDS:

    - "overlong": the judge stopped at its token limit (`finish_reason` "length"), its body was too large to read
      (REPLY_TOO_LARGE), or it is longer than CHARS_PER_TOKEN * max_tokens characters: a ramble, not a reading;
    - "empty": empty or whitespace;
    - "refusal": it opens as a refusal ("I'm sorry, but I can't ...", "I cannot ...", "As an AI ...") and does not
      contain the target (a sign that reads "Sorry, we're closed" read right is a reading);
    - "reading": anything else, scored by `ocr_score` as the transcription it is.

    Every kind is still scored by `ocr_score` (an over-long or refusing reply scores near 0); the kinds are counted
    so that a judge that does not read stops the run instead of training on zero rewards."""
    cut = getattr(reply, "finish_reason", None) in ("length", REPLY_TOO_LARGE)
    if cut or len(reply) > CHARS_PER_TOKEN * max_tokens:
        return "overlong"
    text = reply.strip().replace("\u2019", "'")
    if not text:
        return "empty"
    if _REFUSAL.match(text) and ocr_score(text, target) < 1.0:
        return "refusal"
    return "reading"


def judge_probe_image(word: str = JUDGE_PROBE_WORD) -> torch.Tensor:
    """The start-up probe: `word` in black capitals on a white 384x160 image, uint8 (3, H, W), the same bytes on
    every machine (Pillow's built-in font at a fixed size)."""
    from PIL import ImageDraw, ImageFont

    image = Image.new("RGB", (384, 160), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=72)
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    draw.text(((384 - (right - left)) // 2 - left, (160 - (bottom - top)) // 2 - top), word, fill="black", font=font)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()  # (3, H, W) uint8


def jpeg_size_kb(image: Image.Image, quality: int = 95) -> float:
    """Size of the image saved as JPEG at `quality`, in kilobytes of 1000 bytes (DDPO: `buffer.tell() / 1000`)."""
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000.0


def jpeg_incompressibility(images: Sequence[Image.Image]) -> torch.Tensor:
    """DDPO's `jpeg_incompressibility`: JPEG size at quality 95 in kB (bytes / 1000), unscaled. (B,) float32."""
    return torch.tensor([jpeg_size_kb(img) for img in images], dtype=torch.float32)


def jpeg_compressibility(images: Sequence[Image.Image]) -> torch.Tensor:
    """DDPO's `jpeg_compressibility`: minus the JPEG size at quality 95 in kB (bytes / 1000), unscaled.
    (flow_grpo divides this by a further 500; we keep DDPO's scale.) (B,) float32."""
    return -jpeg_incompressibility(images)


# ----------------------------------------------------------------------------------------------------------------
# The scorer
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class RewardConfig:
    """Everything needed to build the rewards (plain data, picklable for a reward process)."""
    ocr_backend: str = "http"
    genrm_url: str = "http://127.0.0.1:8000"
    genrm_model: str = "Qwen/Qwen3-VL-8B-Instruct"
    genrm_model_path: str | None = None        # local backend: checkpoint folder (defaults to genrm_model)
    genrm_device: str = "auto"
    genrm_batch_size: int = 8
    genrm_concurrency: int = 32
    genrm_timeout_s: float = 120.0
    genrm_max_retries: int = 3
    genrm_backoff_s: float = 1.0
    genrm_retry_total_s: float = 0.0
    genrm_api_key_env: str = "GENRM_API_KEY"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rapidocr_det_limit_side_len: int = 960
    rapidocr_threads: int = 1
    rapidocr_workers: int = 1
    pickscore_path: str | None = None
    pickscore_processor_path: str | None = None
    pickscore_device: str = "auto"
    pickscore_cache_dir: str | None = None
    pickscore_batch_size: int = 16
    reward_weights: dict[str, float] | None = None   # multi-reward: every sample gets sum_k w_k * r_k

    def __post_init__(self):
        if self.ocr_backend not in OCR_BACKENDS:
            raise ValueError(f"ocr_backend must be one of {OCR_BACKENDS}, got {self.ocr_backend!r}")
        if self.reward_weights is not None:
            if not self.reward_weights:
                raise ValueError("reward_weights is empty; omit it for single rewards chosen by data_source")
            bad = [k for k in self.reward_weights if k not in REWARDS]
            if bad:
                raise ValueError(f"unknown reward(s) {bad} in reward_weights; known: {tuple(REWARDS)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RewardConfig":
        return cls(
            ocr_backend=args.ocr_backend, genrm_url=str(args.genrm_url), genrm_model=args.genrm_model,
            genrm_model_path=args.genrm_model_path, genrm_device=args.genrm_device,
            genrm_batch_size=args.genrm_batch_size, genrm_concurrency=args.genrm_concurrency,
            genrm_timeout_s=args.genrm_timeout_s, genrm_max_retries=args.genrm_max_retries,
            genrm_backoff_s=args.genrm_backoff_s, genrm_retry_total_s=getattr(args, "genrm_retry_total_s", 0.0),
            sampling=SamplingConfig(args.genrm_temperature, args.genrm_top_p, args.genrm_max_tokens, args.genrm_seed),
            rapidocr_det_limit_side_len=args.rapidocr_det_limit_side_len, rapidocr_threads=args.rapidocr_threads,
            rapidocr_workers=args.rapidocr_workers,
            pickscore_path=args.pickscore_path, pickscore_processor_path=args.pickscore_processor_path,
            pickscore_device=args.pickscore_device, pickscore_cache_dir=args.pickscore_cache_dir,
            pickscore_batch_size=args.pickscore_batch_size,
            reward_weights=parse_reward_weights(args.reward_weights) if args.reward_weights else None,
        )


def parse_reward_weights(spec: str) -> dict[str, float]:
    """'pickscore=1.0,jpeg_compressibility=0.1' -> {'pickscore': 1.0, 'jpeg_compressibility': 0.1}."""
    weights = {}
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--reward_weights entry {part!r} is not NAME=WEIGHT")
        if name not in REWARDS:
            raise ValueError(f"--reward_weights names an unknown reward {name!r}; known: {', '.join(REWARDS)}")
        if name in weights:
            raise ValueError(f"--reward_weights lists reward {name!r} twice; give each reward one weight")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"--reward_weights: the weight of reward {name!r} is {value.strip()!r}, not a "
                             f"number") from None
        if not math.isfinite(weight) or weight == 0:
            raise ValueError(f"--reward_weights: reward {name!r} has weight {value.strip()}; a weight must be a finite "
                             f"non-zero number (drop {name!r} from the list to leave it out)")
        weights[name] = weight
    return weights


def reward_weights_arg(spec: str) -> str:
    """argparse `type=` of --reward_weights: checked with `parse_reward_weights` at parse time (a weight of 0, NaN
    or inf is refused naming the reward) and kept as written."""
    try:
        parse_reward_weights(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def add_reward_args(parser: argparse.ArgumentParser) -> None:
    """Reward flags shared by both trainers (and any standalone reward process)."""
    g = parser.add_argument_group("rewards")
    g.add_argument("--ocr_backend", choices=OCR_BACKENDS, default="http",
                   help="reader for data_source 'ocr': http = OpenAI-compatible GenRM server (vllm serve), "
                        "local = Qwen3-VL-Instruct with transformers in this process, rapidocr = CPU OCR engine")
    g.add_argument("--genrm_url", default="http://127.0.0.1:8000", action=JudgeUrls,
                   help="GenRM server base URL (http backend); repeat it (or separate URLs by commas) for judge "
                        "replicas: requests go round-robin, a failing replica's retry goes to the next; a bearer "
                        "key is read from $GENRM_API_KEY if set")
    g.add_argument("--genrm_model", default="Qwen/Qwen3-VL-8B-Instruct",
                   help="'model' field of each request (the name the server serves)")
    g.add_argument("--genrm_model_path", default=None,
                   help="local backend: Qwen3-VL-Instruct checkpoint folder (default: --genrm_model)")
    g.add_argument("--genrm_device", default="auto", help="local backend device; auto = cuda if available else cpu")
    g.add_argument("--genrm_batch_size", type=int, default=8, help="local backend generate() batch size")
    g.add_argument("--genrm_concurrency", type=int, default=32, help="http backend: max requests in flight")
    g.add_argument("--genrm_timeout_s", type=float, default=120.0,
                   help="http backend: deadline of each attempt over the whole reply (connect to last byte); a "
                        "request takes at most (retries + 1) x this + the backoff sleeps")
    g.add_argument("--genrm_max_retries", type=int, default=3, help="http backend: retries after the first try")
    g.add_argument("--genrm_backoff_s", type=float, default=1.0,
                   help=f"http backend: first retry delay (doubles, up to {GENRM_MAX_BACKOFF_S:g} s)")
    g.add_argument("--genrm_retry_total_s", type=float, default=120.0,
                   help="http backend: a judge that cannot be reached (connection refused or reset: a restart) is "
                        "retried for up to this many seconds per request, beyond --genrm_max_retries (0 = only "
                        "those retries)")
    g.add_argument("--genrm_temperature", type=float, default=0.0,
                   help="GenRM sampling temperature (0 = greedy, the evaluation setting; verl-omni trains at 0.7)")
    g.add_argument("--genrm_top_p", type=float, default=1.0, help="GenRM top_p (verl-omni trains at 0.8)")
    g.add_argument("--genrm_max_tokens", type=int, default=4096, help="GenRM max new tokens (verl-omni: 4096)")
    g.add_argument("--genrm_seed", type=int, default=None, help="GenRM sampling seed (sent as 'seed')")
    g.add_argument("--rapidocr_det_limit_side_len", type=int, default=960,
                   help="rapidocr backend: detector resizes so the longer side is at most this")
    g.add_argument("--rapidocr_threads", type=int, default=1, help="rapidocr backend: onnxruntime intra-op threads")
    g.add_argument("--rapidocr_workers", type=int, default=1,
                   help="rapidocr backend: engine processes scoring a batch in parallel (1 = in this process)")
    g.add_argument("--pickscore_path", default=None,
                   help="transformers CLIPModel folder of PickScore_v1 (converted once to open_clip, cached)")
    g.add_argument("--pickscore_processor_path", default=None,
                   help="folder with the CLIP tokenizer + preprocessor_config.json (default: --pickscore_path)")
    g.add_argument("--pickscore_device", default="auto", help="auto = cuda if available else cpu")
    g.add_argument("--pickscore_cache_dir", default=None,
                   help=f"where converted open_clip weights are cached (default {default_cache_dir()})")
    g.add_argument("--pickscore_batch_size", type=int, default=16)
    g.add_argument("--reward_weights", default=None, type=reward_weights_arg,
                   help="multi-reward, e.g. 'pickscore=1.0,jpeg_compressibility=0.01': every sample is scored by "
                        "each listed reward and gets the weighted sum (logged per reward as reward/<name>); a "
                        "negative weight needs --allow_negative_reward_weights")
    g.add_argument("--allow_negative_reward_weights", action="store_true",
                   help="accept a negative --reward_weights entry (that reward becomes a penalty)")


def _resolve_device(device: str) -> str:
    if device == "auto":
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return device


@dataclass
class RewardResult:
    rewards: torch.Tensor                       # (B,) float32
    extras: dict[str, torch.Tensor]             # each (B,) float32; NaN where not applicable
    texts: dict[str, list[str | None]] = field(default_factory=dict)

    @staticmethod
    def cat(parts: Sequence["RewardResult"]) -> "RewardResult":
        """Join the results of consecutive row slices, in order, into what one `score_batch` over all the rows
        returns: an extra (text) that a slice lacks, because none of its rows used that reward, is NaN (None) there."""
        if not parts:
            raise ValueError("RewardResult.cat needs at least one part")
        sizes = [p.rewards.shape[0] for p in parts]
        extras = {key: torch.cat([p.extras.get(key, torch.full((n,), float("nan"))).float()
                                  for p, n in zip(parts, sizes)])
                  for key in dict.fromkeys(k for p in parts for k in p.extras)}
        texts = {key: [t for p, n in zip(parts, sizes) for t in p.texts.get(key, [None] * n)]
                 for key in dict.fromkeys(k for p in parts for k in p.texts)}
        return RewardResult(rewards=torch.cat([p.rewards for p in parts]).float(), extras=extras, texts=texts)


class RewardScorer:
    """Builds each reward on first use (once per process, thread-safe) and scores batches."""

    def __init__(self, config: RewardConfig | None = None):
        self.config = config or RewardConfig()
        self._lock = threading.Lock()
        self._ocr_reader = None
        self._pickscore: PickScore | None = None

    # --- model holders --------------------------------------------------------------------------------------
    def ocr_reader(self):
        with self._lock:
            if self._ocr_reader is None:
                c = self.config
                if c.ocr_backend == "http":
                    self._ocr_reader = GenRMHttpReader(
                        c.genrm_url, c.genrm_model, c.sampling, concurrency=c.genrm_concurrency,
                        timeout_s=c.genrm_timeout_s, max_retries=c.genrm_max_retries, backoff_s=c.genrm_backoff_s,
                        retry_total_s=c.genrm_retry_total_s,
                        api_key=os.environ.get(c.genrm_api_key_env) if c.genrm_api_key_env else None)
                elif c.ocr_backend == "local":
                    self._ocr_reader = GenRMLocalReader(c.genrm_model_path or c.genrm_model, c.sampling,
                                                        device=_resolve_device(c.genrm_device),
                                                        batch_size=c.genrm_batch_size)
                else:
                    self._ocr_reader = RapidOCRReader(det_limit_side_len=c.rapidocr_det_limit_side_len,
                                                      num_threads=c.rapidocr_threads,
                                                      num_workers=c.rapidocr_workers)
            return self._ocr_reader

    def pickscore(self) -> PickScore:
        with self._lock:
            if self._pickscore is None:
                c = self.config
                if not c.pickscore_path:
                    raise ValueError("data_source 'pickscore' needs --pickscore_path (a PickScore_v1 CLIPModel folder)")
                self._pickscore = PickScore(c.pickscore_path, device=_resolve_device(c.pickscore_device),
                                            processor_path=c.pickscore_processor_path,
                                            cache_dir=c.pickscore_cache_dir, batch_size=c.pickscore_batch_size)
            return self._pickscore

    def warmup(self, names: Sequence[str]) -> None:
        """Load the models of `names` now (fail early at startup rather than at the first reward)."""
        for name in names:
            if name not in REWARDS:
                raise ValueError(f"unknown reward {name!r}; known: {tuple(REWARDS)}")
            if REWARDS[name].model is not None:
                getattr(self, REWARDS[name].model)()

    def scores_rows_independently(self, data_sources: Sequence[str]) -> bool:
        """Whether every reward that rows with these data sources use scores each image on its own (jpeg_*, OCR
        through the http judge or rapidocr: one request / one call per image), so that `score_batch` over
        consecutive row slices, joined by `RewardResult.cat`, equals one call over all rows bit for bit. PickScore
        and the local GenRM batch images, and batched kernels may round differently at another batch size."""
        names = list(self.config.reward_weights) if self.config.reward_weights else list(dict.fromkeys(data_sources))
        return all(name in REWARDS and REWARDS[name].per_image(self.config) for name in names)

    # --- single rewards on a subset: (scores (n,), numeric extras {key: (n,)}, text extras) -----------------
    def _score(self, name: str, images: list[torch.Tensor], gts: list[str],
               samples: Sequence[int] | None = None) -> tuple[torch.Tensor, dict, dict]:
        """One reward (its REWARDS entry) on a list of samples. `samples`: their positions in the caller's batch
        (named in errors)."""
        if name not in REWARDS:
            raise ValueError(
                f"data_source {name!r} names no reward; known: {tuple(REWARDS)}. data_source must name the reward "
                f"(rewrite old datasets with data_prep/set_data_source.py)")
        return getattr(self, REWARDS[name].score)(images, gts, samples)

    def score_ocr(self, images: list[torch.Tensor], gts: list[str],
                  samples: Sequence[int] | None = None) -> tuple[torch.Tensor, dict, dict]:
        """The OCR reward: the reader's transcription of each image against its target text (`ocr_score`)."""
        pil = [to_pil(img) for img in images]
        try:
            replies = self.ocr_reader().transcribe(pil)
        except GenRMServerError as exc:
            if exc.image_index is None:
                raise
            k = exc.image_index
            sample = samples[k] if samples is not None else k
            raise GenRMServerError(f"OCR judge, sample {sample} of the batch (ground truth {gts[k]!r}): "
                                   f"{exc.detail}", image_index=k, detail=exc.detail) from exc
        if len(replies) != len(pil):
            raise RuntimeError(f"OCR reader returned {len(replies)} replies for {len(pil)} images")
        for k, reply in enumerate(replies):
            if not isinstance(reply, str):
                sample = samples[k] if samples is not None else k
                raise TypeError(f"OCR reader returned a {type(reply).__name__} for sample {sample}, not a "
                                f"transcription string")
        scores = torch.tensor([ocr_score(r, g) for r, g in zip(replies, gts)], dtype=torch.float32)
        exact = torch.tensor([ocr_exact_match(r, g) for r, g in zip(replies, gts)], dtype=torch.float32)
        # an empty / whitespace reply is an empty transcription, scored by ocr_score's definition (0 unless the
        # target is empty too), and counted: many of them mean a judge that reads nothing, not bad images
        empty = torch.tensor([float(not r.strip()) for r in replies], dtype=torch.float32)
        extras = {"ocr/exact_match": exact, OCR_EMPTY_REPLY: empty}
        texts = {"ocr/response": list(replies)}
        if self.config.ocr_backend != "rapidocr":  # a generative judge: is each reply a reading at all?
            kinds = [judge_reply_kind(r, g, self.config.sampling.max_tokens) for r, g in zip(replies, gts)]
            flags = {kind: torch.tensor([float(k == kind) for k in kinds]) for kind in OCR_REPLY_KINDS}
            extras.update({OCR_EMPTY_REPLY: flags["empty"], OCR_OVERLONG_REPLY: flags["overlong"],
                           OCR_REFUSAL_REPLY: flags["refusal"], OCR_UNUSABLE_REPLY: 1.0 - flags["reading"]})
            texts["ocr/reply_kind"] = kinds
        return scores, extras, texts

    def score_pickscore(self, images: list[torch.Tensor], gts: list[str],
                        samples: Sequence[int] | None = None) -> tuple[torch.Tensor, dict, dict]:
        """PickScore of each image against its caption / edit instruction."""
        scores, raw = self.pickscore()(images, gts)
        return scores, {"pickscore/raw": raw}, {}

    def score_jpeg_compressibility(self, images: list[torch.Tensor], gts: list[str],
                                   samples: Sequence[int] | None = None) -> tuple[torch.Tensor, dict, dict]:
        return jpeg_compressibility([to_pil(img) for img in images]), {}, {}

    def score_jpeg_incompressibility(self, images: list[torch.Tensor], gts: list[str],
                                     samples: Sequence[int] | None = None) -> tuple[torch.Tensor, dict, dict]:
        return jpeg_incompressibility([to_pil(img) for img in images]), {}, {}

    # --- public entry point ---------------------------------------------------------------------------------
    def score_batch(self, images: Sequence[torch.Tensor] | torch.Tensor, ground_truths: Sequence[str],
                    data_sources: Sequence[str], extra_infos: Sequence[dict | None] | None = None) -> RewardResult:
        """Score B samples. images: B uint8 (3, H, W) tensors (a list, or one uint8 (B, 3, H, W) tensor; sizes may
        differ in a list). Returns rewards (B,) float32 plus extras (see the module docstring)."""
        images = as_image_list(images)
        n = len(images)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        if not (len(ground_truths) == len(data_sources) == len(extra_infos) == n):
            raise ValueError(f"batch fields disagree: {n} images, {len(ground_truths)} ground truths, "
                             f"{len(data_sources)} data sources, {len(extra_infos)} extra infos")
        for i, gt in enumerate(ground_truths):
            if not isinstance(gt, str):
                raise ValueError(f"sample {i}: ground_truth must be a str, got {type(gt).__name__}")
        for i, ds in enumerate(data_sources):
            if ds not in REWARDS:
                raise ValueError(
                    f"sample {i}: data_source {ds!r} names no reward; known: {tuple(REWARDS)}. data_source must name "
                    f"the reward (relabel old datasets with data_prep/set_data_source.py)")
        weights = self.config.reward_weights
        names = list(weights) if weights else list(dict.fromkeys(data_sources))

        extras: dict[str, torch.Tensor] = {}
        texts: dict[str, list[str | None]] = {}
        per_reward: dict[str, torch.Tensor] = {}
        for name in names:
            idx = list(range(n)) if weights else [i for i in range(n) if data_sources[i] == name]
            gts = [self._ground_truth(name, i, ground_truths, data_sources, extra_infos) for i in idx]
            scores, num_extras, txt_extras = self._score(name, [images[i] for i in idx], gts, idx)
            if scores.shape != (len(idx),) or not torch.isfinite(scores).all():
                raise RuntimeError(f"reward {name!r} returned non-finite or mis-shaped scores {scores}")
            full = torch.full((n,), float("nan"))
            full[idx] = scores
            per_reward[name] = full
            extras[f"reward/{name}"] = full
            for key, vals in num_extras.items():
                extras[key] = torch.full((n,), float("nan"))
                extras[key][idx] = vals.float()
            for key, vals in txt_extras.items():
                texts[key] = [None] * n
                for j, i in enumerate(idx):
                    texts[key][i] = vals[j]
        if weights:
            rewards = sum(w * per_reward[k] for k, w in weights.items())
            extras["reward/combined"] = rewards
        else:
            rewards = torch.full((n,), float("nan"))
            for name, full in per_reward.items():
                mask = ~torch.isnan(full)
                rewards[mask] = full[mask]
        return RewardResult(rewards=rewards.float(), extras=extras, texts=texts)

    @staticmethod
    def _ground_truth(name: str, i: int, gts: Sequence[str], sources: Sequence[str],
                      infos: Sequence[dict | None]) -> str:
        key = REWARDS[name].ground_truth_key
        if sources[i] == name or key is None:
            return gts[i]
        info = infos[i] or {}
        if not isinstance(info.get(key), str):
            raise ValueError(
                f"sample {i} (data_source {sources[i]!r}) has no ground truth for reward {name!r}: multi-reward "
                f"reads it from extra_info[{key!r}] when the row's data_source names another reward")
        return info[key]


@dataclass(frozen=True)
class Reward:
    """One reward a row's `data_source` (or `--reward_weights`) can name. Adding a reward is one entry of
    `REWARDS` plus its scoring method on `RewardScorer`; the scorer, the preflight and the data tools read the table.

    score: the name of the scorer's method (images, ground truths, sample positions) -> (scores (n,), numeric
        extras, texts).
    model: the name of the scorer's method that builds the reward's model on first use; `warmup` calls it ahead of
        the first score (None: no model).
    ground_truth_key: the `extra_info` key a multi-reward run reads this reward's ground truth from on rows whose
        data_source names another reward (None: the row's own ground truth serves every reward, e.g. jpeg).
    per_image: whether, under a config, it scores each image on its own (one request / call per image), so that row
        slices scored apart equal one call over all rows bit for bit (`RewardScorer.scores_rows_independently`).
    check_flags: what the reward needs from the command line that can be checked before any model loads
        (`training.preflight.check_rewards` calls it for the rewards a run uses): ValueError naming the flag and the
        fix (None: nothing to check).
    """

    score: str
    model: str | None = None
    ground_truth_key: str | None = None
    per_image: Callable[[RewardConfig], bool] = lambda config: True
    check_flags: Callable[[argparse.Namespace], None] | None = None


def check_pickscore_flags(args: argparse.Namespace) -> None:
    """--pickscore_path is set and names a transformers CLIPModel folder (its config.json); ValueError otherwise."""
    path = args.pickscore_path
    if not path:
        raise ValueError("the rows or --reward_weights use the 'pickscore' reward but --pickscore_path is not set; "
                         "pass the PickScore_v1 CLIPModel folder")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--pickscore_path {path}: no config.json there; pass a transformers CLIPModel folder "
                         f"(PickScore_v1)")


REWARDS: dict[str, Reward] = {
    # the http judge and RapidOCR read one image per call; the local GenRM batches images
    "ocr": Reward("score_ocr", model="ocr_reader", ground_truth_key="target_text",
                  per_image=lambda config: config.ocr_backend in ("http", "rapidocr")),
    "pickscore": Reward("score_pickscore", model="pickscore", ground_truth_key="instruction",
                        per_image=lambda config: False, check_flags=check_pickscore_flags),  # batched CLIP kernels
    "jpeg_compressibility": Reward("score_jpeg_compressibility"),
    "jpeg_incompressibility": Reward("score_jpeg_incompressibility"),
}
REWARD_NAMES = tuple(REWARDS)  # the names at import (argparse choices, data tools)


def _main() -> None:
    """Score image files from the command line: python rewards.py --data_source ocr --ground_truth TEXT a.png ..."""
    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("images", nargs="+")
    parser.add_argument("--data_source", required=True, choices=REWARD_NAMES)
    parser.add_argument("--ground_truth", default="")
    add_reward_args(parser)
    args = parser.parse_args()
    scorer = RewardScorer(RewardConfig.from_args(args))
    imgs = [torch.from_numpy(np.array(Image.open(p).convert("RGB"))).permute(2, 0, 1).contiguous()
            for p in args.images]
    res = scorer.score_batch(imgs, [args.ground_truth] * len(imgs), [args.data_source] * len(imgs))
    for i, path in enumerate(args.images):
        line = {"image": path, "reward": float(res.rewards[i])}
        line.update({k: float(v[i]) for k, v in res.extras.items() if not math.isnan(float(v[i]))})
        line.update({k: v[i] for k, v in res.texts.items() if v[i] is not None})
        print(json.dumps(line))


if __name__ == "__main__":
    _main()
