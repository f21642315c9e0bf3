"""Reward functions for T2I / TI2I RL post-training: OCR (GenRM or OCR engine), PickScore, JPEG size, and sums.

One entry point for the trainers:

    scorer = RewardScorer(RewardConfig.from_args(args))       # once per process; models load lazily, once
    result = scorer.score_batch(images, ground_truths, data_sources, extra_infos)
    result.rewards            # (B,) float32
    result.extras             # {"reward/<name>": (B,) float32, ...}, NaN where a sample was not scored by <name>
    result.texts              # {"ocr/response": [str | None] * B}, the judge's verbatim replies

Conventions (spec rewards_data_anchors.md §1-2):
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
one: 0 against a non-empty target), else 0 - logged as a fraction, `critic/reward/ocr/empty_reply_frac`;
`reward/combined` for multi-reward. Metric keys are built by the trainers (training.validation_metrics); in a batch
that mixes data sources, average extras with NaNs dropped.

Multi-reward (`--reward_weights ocr=1.0,jpeg_compressibility=0.01`): every sample is scored by every listed reward
and gets the weighted sum. A reward that is not the row's own data_source reads its ground truth from extra_info
(`ocr`: "target_text", `pickscore`: "instruction"; the edit converter writes both) and raises if it is absent.

The scorer holds only plain config until a reward is first used, so it can be built in a separate reward process
(e.g. a `multiprocessing` worker or a standalone server script) from a pickled `RewardConfig`.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import hashlib
import http.client
import io
import itertools
import json
import math
import multiprocessing
import os
import queue
import re
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

PIXEL_CONVENTION = "uint8 tensor of shape (3, H, W) with values in [0, 255] (RGB, CHW)"
REWARD_NAMES = ("ocr", "pickscore", "jpeg_compressibility", "jpeg_incompressibility")
OCR_BACKENDS = ("http", "local", "rapidocr")
# The per-sample 0/1 extra marking an empty or whitespace judge reply; its batch mean is logged as
# critic/reward/ocr/empty_reply_frac (training.logs.reward_metrics: an extra named *_frac is a fraction).
OCR_EMPTY_REPLY = "reward/ocr/empty_reply_frac"
# Where a multi-reward finds the ground truth of a reward that is not the row's own data_source (edit rows keep both).
GROUND_TRUTH_EXTRA_KEY = {"ocr": "target_text", "pickscore": "instruction"}


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
# OCR: score, readers (GenRM over HTTP, GenRM in-process with transformers, RapidOCR)
# ----------------------------------------------------------------------------------------------------------------

GENRM_SYSTEM_MESSAGE = "You are a helpful assistant."
GENRM_OCR_PROMPT = (
    "Please output only the text content from the image without any additional descriptions or formatting."
)
_WHITESPACE = re.compile(r"\s+")


def ocr_score(transcription: str, target: str) -> float:
    """verl-omni's GenRM OCR score (spec §1.1), in [0, 1].

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


def png_data_url(image: Image.Image) -> str:
    """PNG-encode a PIL image into a `data:image/png;base64,...` URL."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def genrm_openai_messages(image: Image.Image) -> list[dict]:
    """The verl-omni GenRM OCR request: system message, then user [image_url part, text prompt part]."""
    return [
        {"role": "system", "content": GENRM_SYSTEM_MESSAGE},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(image)}},
            {"type": "text", "text": GENRM_OCR_PROMPT},
        ]},
    ]


@dataclass
class SamplingConfig:
    """GenRM sampling. verl-omni trains with temperature 0.7 / top_p 0.8 / max_tokens 4096; temperature 0 (greedy)
    is the evaluation default here, because a sampled judge gives the same image different rewards."""
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 4096
    seed: int | None = None


class GenRMServerError(RuntimeError):
    """The GenRM server could not produce a transcription after every retry, or replied with something that is not
    a transcription. `image_index`: the image of the `transcribe` call it concerns (None: the whole call)."""

    def __init__(self, message: str, *, image_index: int | None = None, detail: str | None = None):
        super().__init__(message)
        self.image_index = image_index
        self.detail = detail or message  # the message without the image position


_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class DaemonThreadPool:
    """At most `max_workers` daemon threads running submitted calls, each returning a `concurrent.futures.Future`.

    The judge's and the reward stream's pool. Unlike `ThreadPoolExecutor`, whose worker threads the interpreter
    joins at exit, a Ctrl-C or SIGTERM that ends the main thread is never held up by a call still blocked on a
    stalled server: the threads are daemons and die with the process. (Each judge request also ends by its own
    deadline, so no thread outlives a batch for long either.)"""

    def __init__(self, max_workers: int, name: str = "pool"):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers, self.name = max_workers, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} pool is shut down")
            self._queue.put((future, fn, args, kwargs))
            if self._idle == 0 and len(self._threads) < self.max_workers:
                thread = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            else:
                self._idle -= 1  # an idle thread takes this item
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                del item, future, fn, args, kwargs
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more submissions; `cancel_futures` cancels calls not yet started; `wait` joins the threads."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for thread in threads:
                thread.join()


class GenRMHttpReader:
    """Transcribe images with an OpenAI-compatible chat-completions server (e.g. `vllm serve
    Qwen/Qwen3-VL-8B-Instruct`), one request per image, at most `concurrency` in flight (daemon threads,
    `DaemonThreadPool`: Ctrl-C never waits for a stalled judge).

    Each attempt has a wall-clock deadline of `timeout_s` over the WHOLE exchange (connect, send, status line,
    headers, body), so a server that trickles a byte every few seconds cannot hold a request open: the socket
    timeout bounds each read, the body is read in chunks with the deadline checked before each, and a watchdog shuts
    the socket down at the deadline (which also ends a read stuck in the header parsing). Connection errors, missed
    deadlines, HTTP 408/429/5xx and malformed replies are retried `max_retries` times with exponential backoff
    (`backoff_s`, doubling up to GENRM_MAX_BACKOFF_S); a judge that cannot be reached at all (refused, reset: a
    restart) is retried on time instead, for up to `retry_total_s` since the first attempt, so a restart of a
    minute is ridden out. One request takes at most `request_budget_s()`; other HTTP errors (400, 404, ...)
    are not retried. When a request still fails, the whole batch raises `GenRMServerError` naming the URL, the
    image and the last error: a failed judge never becomes a zero reward.

    `url` may list several judge replicas, comma-separated (`--genrm_url` repeated or `URL1,URL2`): requests start
    on the replicas in turn (round-robin), and each retry of a request goes to the next replica, so one replica
    that is down or failing costs a retry, not the batch. An empty or whitespace `content` is a
    reply (an empty transcription); a reply without a string `content` is not, and is an error.
    """

    def __init__(self, url: str, model: str, sampling: SamplingConfig, *, concurrency: int = 32,
                 timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 1.0,
                 api_key: str | None = None, retry_total_s: float = 0.0):
        if concurrency < 1:
            raise ValueError(f"GenRM concurrency must be >= 1, got {concurrency}")
        if not timeout_s > 0:
            raise ValueError(f"GenRM timeout must be > 0 s, got {timeout_s}")
        self.endpoints = [_endpoint(u) for u in split_genrm_urls(url)]
        self.url = ", ".join(e.url for e in self.endpoints)  # what the error messages name
        self._turn = itertools.count()  # round-robin over the replicas (next() is atomic under the GIL)
        self.model = model
        self.sampling = sampling
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.retry_total_s = retry_total_s
        self.api_key = api_key
        self._pool = DaemonThreadPool(concurrency, name="genrm")

    def request_budget_s(self) -> float:
        """The longest one request can take: every attempt's deadline plus the backoff sleeps between them."""
        return genrm_request_budget_s(self.timeout_s, self.max_retries, self.backoff_s, self.retry_total_s)

    def request_body(self, image: Image.Image) -> dict:
        body = {
            "model": self.model,
            "messages": genrm_openai_messages(image),
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "max_tokens": self.sampling.max_tokens,
        }
        if self.sampling.seed is not None:
            body["seed"] = self.sampling.seed
        return body

    def _post_once(self, payload: bytes, endpoint: "_Endpoint") -> str:
        """One attempt to `endpoint`, all of it within `timeout_s` of wall clock; returns the reply's `content`."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        deadline = time.monotonic() + self.timeout_s
        # http.client never reads proxy settings: the judge is a cluster-internal server, reached directly
        connection_class = http.client.HTTPSConnection if endpoint.scheme == "https" else http.client.HTTPConnection
        conn = connection_class(endpoint.host, endpoint.port, timeout=self.timeout_s)
        expired = threading.Event()
        held: list[socket.socket] = []  # the connected socket (http.client forgets it on Connection: close)

        def cut() -> None:  # the watchdog: wake a read blocked anywhere in the exchange
            expired.set()
            for sock in held:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(self.timeout_s, cut)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.connect()  # bounded by the socket timeout
            held.append(conn.sock)
            if expired.is_set():
                cut()
            conn.request("POST", endpoint.path, body=payload, headers=headers)
            resp = conn.getresponse()
            chunks = []
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or expired.is_set():
                    raise _DeadlineExceeded(f"the reply was still incomplete at the {self.timeout_s:g} s deadline "
                                            f"({sum(map(len, chunks))} body bytes received)")
                held[0].settimeout(remaining)
                chunk = resp.read1(65536)
                if not chunk:
                    break
                chunks.append(chunk)
            body = b"".join(chunks)
            if expired.is_set():
                raise _DeadlineExceeded(f"the reply was cut at the {self.timeout_s:g} s deadline")
            if resp.length:  # the server closed before the Content-Length it announced
                raise ConnectionError(f"the reply body was truncated ({resp.length} bytes missing)")
        except _DeadlineExceeded:
            raise
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set() or time.monotonic() >= deadline:
                raise _DeadlineExceeded(f"no complete reply within the {self.timeout_s:g} s deadline "
                                        f"({type(exc).__name__})") from exc
            raise
        finally:
            watchdog.cancel()
            conn.close()
        if resp.status >= 400:
            raise _HttpStatus(resp.status, resp.reason, body[:300])
        return parse_chat_content(body)

    def _transcribe_one(self, image: Image.Image) -> str:
        payload = json.dumps(self.request_body(image)).encode("utf-8")
        last_error: BaseException | None = None
        start = time.monotonic()
        turn = next(self._turn)
        attempts = unreachable = counted = 0
        while True:
            endpoint = self.endpoints[(turn + attempts) % len(self.endpoints)]  # a retry goes to the next replica
            attempts += 1
            try:
                return self._post_once(payload, endpoint)
            except _HttpStatus as exc:
                last_error = exc
                if exc.code not in _RETRY_STATUS:
                    raise GenRMServerError(
                        f"GenRM server {endpoint.url} rejected the request (not retried): {exc}") from exc
            except (OSError, http.client.HTTPException, _DeadlineExceeded, _MalformedReply) as exc:
                last_error = exc
            down = is_unreachable(last_error)
            unreachable += down
            sleep = genrm_backoff(self.backoff_s, attempts - 1)
            left = self.retry_total_s - (time.monotonic() - start)
            if down and left > 0:  # a judge that is down (restarting): retried on time, not counted,
                sleep = min(sleep, left)  # the last attempt at the end of --genrm_retry_total_s
            elif counted < self.max_retries:
                counted += 1
            else:
                break
            time.sleep(sleep)
        what = "its reply is not a transcription: " if isinstance(last_error, _MalformedReply) else ""
        if len(self.endpoints) > 1:
            what = f"(the last from {endpoint.url}) " + what
        raise GenRMServerError(
            f"GenRM server {self.url} failed {attempts} attempt(s) in {time.monotonic() - start:.1f} s (timeout "
            f"{self.timeout_s:g}s each, a deadline over the whole reply; {unreachable} could not connect, retried "
            f"for up to --genrm_retry_total_s {self.retry_total_s:g} s with a backoff from {self.backoff_s:g} s "
            f"doubling up to {GENRM_MAX_BACKOFF_S:g} s; other failures retried --genrm_max_retries "
            f"{self.max_retries} time(s)): {what}{last_error}. Check that the server is up "
            f"(scripts/serve_genrm.sh waits for /health), that --genrm_url points at it and that it serves an "
            f"OpenAI-compatible /v1/chat/completions."
        ) from last_error

    def transcribe(self, images: Sequence[Image.Image]) -> list[str]:
        futures = [self._pool.submit(self._transcribe_one, img) for img in images]
        concurrent.futures.wait(futures)  # no request outlives the batch, even when one has failed
        errors = [(i, f.exception()) for i, f in enumerate(futures) if f.exception() is not None]
        if errors:
            i, first = errors[0]
            if len(errors) == 1:
                raise GenRMServerError(f"image {i} of {len(futures)}: {first}", image_index=i,
                                       detail=str(first)) from first
            detail = f"{len(errors)} of {len(futures)} GenRM requests failed; the first: {first}"
            raise GenRMServerError(f"{detail} (image {i})", image_index=i, detail=detail) from first
        return [f.result() for f in futures]


GENRM_MAX_BACKOFF_S = 10.0  # the longest sleep between two attempts: a judge back up is seen within 10 s


def genrm_backoff(backoff_s: float, retry: int) -> float:
    """The sleep before retry number `retry` + 1 (0-based): backoff_s doubling, capped at GENRM_MAX_BACKOFF_S."""
    return min(backoff_s * 2 ** retry, max(backoff_s, GENRM_MAX_BACKOFF_S))


def is_unreachable(error: BaseException | None) -> bool:
    """Whether a failed attempt never reached a judge: refused, reset or aborted before a reply, no route (what a
    restarting server gives); deadlines, HTTP statuses and malformed replies are not."""
    return isinstance(error, (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError,
                              http.client.RemoteDisconnected)) or (
        isinstance(error, OSError) and getattr(error, "errno", None) in (113, 101))  # EHOSTUNREACH, ENETUNREACH


def genrm_request_budget_s(timeout_s: float, max_retries: int, backoff_s: float, retry_total_s: float = 0.0) -> float:
    """An upper bound of how long a judge request can take: (max_retries + 1) deadlines of timeout_s and the
    backoff sleeps between them, plus, with `retry_total_s` > 0, the time a judge that cannot be reached is
    retried for and one more attempt's deadline."""
    counted = (max_retries + 1) * timeout_s + sum(genrm_backoff(backoff_s, k) for k in range(max_retries))
    return counted + (retry_total_s + timeout_s if retry_total_s > 0 else 0.0)


def parse_chat_content(body: bytes) -> str:
    """The `choices[0].message.content` string of a chat-completions reply body. Empty or whitespace is a valid
    (empty) transcription; anything without a string content (not JSON, no choices, content null or a list) raises
    `_MalformedReply` quoting the body."""
    try:
        reply = json.loads(body)
        content = reply["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise _MalformedReply(f"malformed chat-completions reply ({exc!r}): {body[:200]!r}") from exc
    if not isinstance(content, str):
        raise _MalformedReply(f"reply content is {type(content).__name__}, not a string: {body[:200]!r}")
    return content


class _MalformedReply(RuntimeError):
    pass


class _DeadlineExceeded(RuntimeError):
    pass


class _HttpStatus(RuntimeError):
    def __init__(self, code: int, reason: str, detail: bytes):
        super().__init__(f"HTTP {code} {reason}: {detail!r}")
        self.code = code


@dataclass(frozen=True)
class _Endpoint:
    """One judge replica: its chat-completions URL and the parts http.client needs."""

    url: str
    scheme: str
    host: str
    port: int | None
    path: str


class _GivenUrls(str):
    """A `--genrm_url` value given on the command line (a plain `str` is still the default)."""


class _JudgeUrls(argparse.Action):
    """`--genrm_url URL` repeated (and/or comma-separated) -> one comma-separated string of judge replicas; the
    first use replaces the default."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        urls = [current, values] if isinstance(current, _GivenUrls) else [values]
        setattr(namespace, self.dest, _GivenUrls(",".join(urls)))


def split_genrm_urls(spec: str) -> list[str]:
    """The judge replicas of a `--genrm_url` value: comma-separated URLs (one or more), blanks refused."""
    urls = [u.strip() for u in spec.split(",")]
    if not spec.strip() or any(not u for u in urls):
        raise ValueError(f"--genrm_url {spec!r}: give one URL, or several separated by commas (judge replicas)")
    return urls


def _endpoint(url: str) -> _Endpoint:
    full = chat_completions_url(url)
    parts = urllib.parse.urlsplit(full)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"GenRM URL {url!r} is not http(s)://HOST[:PORT][/v1]")
    return _Endpoint(full, parts.scheme, parts.hostname, parts.port,
                     parts.path + (f"?{parts.query}" if parts.query else ""))


def chat_completions_url(url: str) -> str:
    """Accept `host:port`, `http://host:port`, `.../v1` or the full `.../v1/chat/completions` URL."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("GenRM URL is empty; pass --genrm_url http://HOST:PORT")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


class GenRMLocalReader:
    """Transcribe images with a local Qwen3-VL-Instruct checkpoint through transformers' `generate` (left-padded
    batches, greedy when temperature == 0). Same messages as the HTTP backend; the reply is the decoded new tokens
    with special tokens skipped, taken verbatim."""

    def __init__(self, model_path: str, sampling: SamplingConfig, *, device: str = "cpu",
                 dtype: torch.dtype | None = None, batch_size: int = 8):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.device = torch.device(device)
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.sampling = sampling
        self.batch_size = batch_size
        self.processor = AutoProcessor.from_pretrained(model_path)
        self.processor.tokenizer.padding_side = "left"
        self.model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype).to(self.device).eval()

    @staticmethod
    def messages(image: Image.Image) -> list[dict]:
        return [
            {"role": "system", "content": [{"type": "text", "text": GENRM_SYSTEM_MESSAGE}]},
            {"role": "user", "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": GENRM_OCR_PROMPT},
            ]},
        ]

    @torch.no_grad()
    def transcribe(self, images: Sequence[Image.Image]) -> list[str]:
        replies: list[str] = []
        for start in range(0, len(images), self.batch_size):
            chunk = images[start:start + self.batch_size]
            inputs = self.processor.apply_chat_template(
                [self.messages(img) for img in chunk], tokenize=True, add_generation_prompt=True,
                return_dict=True, return_tensors="pt", processor_kwargs={"padding": True},
            ).to(self.device)
            gen_kwargs: dict[str, Any] = {"max_new_tokens": self.sampling.max_tokens}
            if self.sampling.temperature > 0:
                gen_kwargs.update(do_sample=True, temperature=self.sampling.temperature, top_p=self.sampling.top_p)
            else:
                gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            # Sampling draws from a forked RNG, so the judge never moves the caller's (trainer's) global RNG state.
            cuda = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                if self.sampling.seed is not None:
                    torch.manual_seed(self.sampling.seed + start)
                out = self.model.generate(**inputs, **gen_kwargs)
            new_tokens = out[:, inputs["input_ids"].shape[1]:]
            replies.extend(self.processor.batch_decode(new_tokens, skip_special_tokens=True))
        return replies


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


# ----------------------------------------------------------------------------------------------------------------
# JPEG size (DDPO)
# ----------------------------------------------------------------------------------------------------------------

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
# PickScore with open_clip, from a transformers CLIPModel checkpoint
# ----------------------------------------------------------------------------------------------------------------

PICKSCORE_SCALE = 26.0  # verl-omni / flow_grpo / UniRL divide exp(logit_scale)*cos by 26 ("norm to 0-1")
_CONVERTER_VERSION = "1"


def open_clip_config_from_hf(hf_config: dict) -> dict:
    """open_clip `model_cfg` for a transformers `CLIPConfig` dict (PickScore_v1 gives exactly ViT-H-14's config).

    Text pooling mirrors transformers: a legacy `eos_token_id == 2` pools at argmax(token id) (open_clip's default,
    the end-of-text token has the largest id), otherwise at the first `eos_token_id`.
    """
    vc, tc = hf_config["vision_config"], hf_config["text_config"]
    acts = {vc.get("hidden_act", "quick_gelu"), tc.get("hidden_act", "quick_gelu")}
    if len(acts) != 1 or not acts <= {"gelu", "quick_gelu"}:
        raise ValueError(f"unsupported CLIP activation(s) {sorted(acts)}: open_clip builds 'gelu' or 'quick_gelu'")
    if vc["hidden_size"] % vc["num_attention_heads"]:
        raise ValueError("vision hidden_size must be divisible by num_attention_heads")
    eos = tc.get("eos_token_id", 2)
    text_cfg = {
        "context_length": tc.get("max_position_embeddings", 77),
        "vocab_size": tc["vocab_size"],
        "width": tc["hidden_size"],
        "heads": tc["num_attention_heads"],
        "layers": tc["num_hidden_layers"],
    }
    if tc["intermediate_size"] != 4 * tc["hidden_size"]:
        text_cfg["mlp_ratio"] = tc["intermediate_size"] / tc["hidden_size"]
    if eos != 2:
        text_cfg.update(pool_type="eos", eos_id=eos)
    vision_cfg = {
        "image_size": vc["image_size"],
        "layers": vc["num_hidden_layers"],
        "width": vc["hidden_size"],
        "head_width": vc["hidden_size"] // vc["num_attention_heads"],
        "patch_size": vc["patch_size"],
    }
    if vc["intermediate_size"] != 4 * vc["hidden_size"]:
        vision_cfg["mlp_ratio"] = vc["intermediate_size"] / vc["hidden_size"]
    for cfg, sub in ((vision_cfg, vc), (text_cfg, tc)):
        eps = sub.get("layer_norm_eps", 1e-5)
        if eps != 1e-5:  # open_clip's LayerNorm default
            cfg["norm_kwargs"] = {"eps": eps}
    model_cfg = {"embed_dim": hf_config["projection_dim"], "vision_cfg": vision_cfg, "text_cfg": text_cfg}
    if acts == {"quick_gelu"}:
        model_cfg["quick_gelu"] = True
    return model_cfg


def convert_hf_clip_state_dict(hf_sd: dict[str, torch.Tensor], model_cfg: dict) -> dict[str, torch.Tensor]:
    """Map a transformers CLIPModel state dict onto open_clip CLIP names (spec §2.2). Every HF tensor must be used
    (position_ids buffers excepted): a leftover or missing key is an error."""
    sd = {k: v for k, v in hf_sd.items() if not k.endswith("position_ids")}
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise KeyError(f"CLIP checkpoint lacks tensor {key!r}")
        return sd.pop(key)

    def layers(hf_prefix: str, oc_prefix: str, n: int) -> None:
        for i in range(n):
            h, o = f"{hf_prefix}.encoder.layers.{i}", f"{oc_prefix}.transformer.resblocks.{i}".lstrip(".")
            for s in ("weight", "bias"):
                out[f"{o}.attn.in_proj_{s}"] = torch.cat(
                    [take(f"{h}.self_attn.{p}_proj.{s}") for p in ("q", "k", "v")], dim=0)
                out[f"{o}.attn.out_proj.{s}"] = take(f"{h}.self_attn.out_proj.{s}")
                out[f"{o}.ln_1.{s}"] = take(f"{h}.layer_norm1.{s}")
                out[f"{o}.ln_2.{s}"] = take(f"{h}.layer_norm2.{s}")
                out[f"{o}.mlp.c_fc.{s}"] = take(f"{h}.mlp.fc1.{s}")
                out[f"{o}.mlp.c_proj.{s}"] = take(f"{h}.mlp.fc2.{s}")

    v = "vision_model"
    out["visual.conv1.weight"] = take(f"{v}.embeddings.patch_embedding.weight")
    out["visual.class_embedding"] = take(f"{v}.embeddings.class_embedding")
    out["visual.positional_embedding"] = take(f"{v}.embeddings.position_embedding.weight")
    for s in ("weight", "bias"):
        out[f"visual.ln_pre.{s}"] = take(f"{v}.pre_layrnorm.{s}")
        out[f"visual.ln_post.{s}"] = take(f"{v}.post_layernorm.{s}")
    out["visual.proj"] = take("visual_projection.weight").t().contiguous()
    layers(v, "visual", model_cfg["vision_cfg"]["layers"])

    t = "text_model"
    out["token_embedding.weight"] = take(f"{t}.embeddings.token_embedding.weight")
    out["positional_embedding"] = take(f"{t}.embeddings.position_embedding.weight")
    for s in ("weight", "bias"):
        out[f"ln_final.{s}"] = take(f"{t}.final_layer_norm.{s}")
    out["text_projection"] = take("text_projection.weight").t().contiguous()
    layers(t, "", model_cfg["text_cfg"]["layers"])

    out["logit_scale"] = take("logit_scale")
    if sd:
        raise KeyError(f"CLIP checkpoint has tensors the open_clip conversion does not map: {sorted(sd)[:10]}")
    return out


def _hf_weights_file(checkpoint: Path) -> Path:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (checkpoint / name).is_file():
            return checkpoint / name
    raise FileNotFoundError(f"{checkpoint}: no model.safetensors or pytorch_model.bin (a transformers CLIPModel "
                            f"checkpoint such as yuvalkirstain/PickScore_v1 is expected)")


def _checkpoint_fingerprint(checkpoint: Path) -> str:
    """Cheap content fingerprint: config bytes, weight-file size and its first/last 4 MiB."""
    weights = _hf_weights_file(checkpoint)
    h = hashlib.sha256(_CONVERTER_VERSION.encode())
    h.update((checkpoint / "config.json").read_bytes())
    size = weights.stat().st_size
    h.update(f"{weights.name}:{size}".encode())
    with open(weights, "rb") as f:
        h.update(f.read(4 << 20))
        f.seek(max(0, size - (4 << 20)))
        h.update(f.read(4 << 20))
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl")) / "pickscore_open_clip"


def convert_clip_checkpoint(checkpoint: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Convert a transformers CLIPModel checkpoint into an open_clip `local-dir:` folder (open_clip_config.json +
    open_clip_model.safetensors), cached under `cache_dir/<fingerprint>/`; reuse it when present. Atomic write."""
    from safetensors.torch import load_file, save_file

    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint}/config.json not found: --pickscore_path must be a CLIPModel folder")
    out_dir = Path(cache_dir or default_cache_dir()) / _checkpoint_fingerprint(checkpoint)
    if (out_dir / "open_clip_model.safetensors").is_file() and (out_dir / "open_clip_config.json").is_file():
        return out_dir
    hf_config = json.loads((checkpoint / "config.json").read_text())
    model_cfg = open_clip_config_from_hf(hf_config)
    weights = _hf_weights_file(checkpoint)
    hf_sd = load_file(weights) if weights.suffix == ".safetensors" else torch.load(weights, map_location="cpu",
                                                                                   weights_only=True)
    oc_sd = {k: v.float().contiguous() for k, v in convert_hf_clip_state_dict(hf_sd, model_cfg).items()}
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(oc_sd, str(tmp / "open_clip_model.safetensors"))
    (tmp / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg, "source": str(checkpoint)},
                                                          indent=2))
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process won the race; its copy is identical
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


@dataclass
class ClipPreprocess:
    """transformers CLIPImageProcessor semantics on uint8 (3, H, W) tensors: resize the shortest edge (bicubic,
    antialiased), centre crop, rescale, normalise. Built from a `preprocessor_config.json`."""
    shortest_edge: int
    crop_hw: tuple[int, int]
    rescale_factor: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_config(cls, cfg: dict) -> "ClipPreprocess":
        size = cfg.get("size", 224)
        shortest = size["shortest_edge"] if isinstance(size, dict) else int(size)
        crop = cfg.get("crop_size", shortest)
        crop_hw = (crop["height"], crop["width"]) if isinstance(crop, dict) else (int(crop), int(crop))
        for key, want in (("do_resize", True), ("do_center_crop", True), ("do_rescale", True),
                          ("do_normalize", True)):
            if cfg.get(key, want) is not want:
                raise ValueError(f"preprocessor_config {key}={cfg.get(key)} is not supported (CLIP expects {want})")
        if cfg.get("resample", 3) != 3:
            raise ValueError(f"preprocessor_config resample={cfg.get('resample')}; CLIP uses 3 (bicubic)")
        return cls(shortest, crop_hw, float(cfg.get("rescale_factor", 1 / 255)),
                   tuple(cfg["image_mean"]), tuple(cfg["image_std"]))

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 (3, H, W) -> float32 (3, crop_h, crop_w)."""
        import torchvision.transforms.v2.functional as TF

        h, w = image.shape[-2:]
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        size = [new_long, new_short] if w <= h else [new_short, new_long]
        x = TF.resize(image, size, interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
        x = TF.center_crop(x, list(self.crop_hw))
        x = x.float() * self.rescale_factor
        mean = torch.tensor(self.mean, device=x.device).view(3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(3, 1, 1)
        return (x - mean) / std


def read_image_processor_config(folder: Path) -> dict:
    """The CLIP image-processor config: `preprocessor_config.json` (Hub layout), else the `image_processor` entry
    of a transformers-5 `processor_config.json`."""
    if (folder / "preprocessor_config.json").is_file():
        return json.loads((folder / "preprocessor_config.json").read_text())
    if (folder / "processor_config.json").is_file():
        cfg = json.loads((folder / "processor_config.json").read_text())
        if "image_processor" in cfg:
            return cfg["image_processor"]
    raise FileNotFoundError(f"{folder}: no preprocessor_config.json (CLIP image processor config); pass "
                            f"--pickscore_processor_path pointing at a folder that has one")


class PickScore:
    """PickScore = exp(logit_scale) * cos(text, image) / 26 with open_clip's CLIP, fp32.

    `checkpoint` is a transformers CLIPModel folder (PickScore_v1: ViT-H-14); its weights are converted once to an
    open_clip folder (cached). Tokenizer and preprocessor_config come from `processor_path` (default: the checkpoint
    folder; verl-omni takes them from laion/CLIP-ViT-H-14-laion2B-s32B-b79K, which is the same tokenizer/processor).
    Texts are encoded once per unique prompt; images in batches of `batch_size`.
    """

    def __init__(self, checkpoint: str | Path, *, device: str = "cpu", processor_path: str | Path | None = None,
                 cache_dir: str | Path | None = None, batch_size: int = 16):
        import open_clip
        from transformers import AutoTokenizer

        self.device = torch.device(device)
        self.batch_size = batch_size
        oc_dir = convert_clip_checkpoint(checkpoint, cache_dir)
        self.model = open_clip.create_model(f"local-dir:{oc_dir}", precision="fp32", device=self.device).eval()
        proc = Path(processor_path or checkpoint)
        self.tokenizer = AutoTokenizer.from_pretrained(proc)
        self.context_length = int(self.model.positional_embedding.shape[0])
        self.preprocess = ClipPreprocess.from_config(read_image_processor_config(proc))

    @torch.no_grad()
    def encode_text(self, prompts: Sequence[str]) -> torch.Tensor:
        """(U,) prompts -> (U, D) L2-normalised fp32."""
        tok = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.context_length,
                             return_tensors="pt")
        feats = self.model.encode_text(tok["input_ids"].to(self.device))
        return torch.nn.functional.normalize(feats.float(), dim=-1)

    @torch.no_grad()
    def encode_images(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """uint8 (3, H, W) images -> (B, D) L2-normalised fp32."""
        pixels = torch.stack([self.preprocess(img.to(self.device)) for img in images])
        feats = self.model.encode_image(pixels)
        return torch.nn.functional.normalize(feats.float(), dim=-1)

    @torch.no_grad()
    def __call__(self, images: Sequence[torch.Tensor], prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (score / 26, raw exp(logit_scale)*cos), each (B,) float32 on CPU."""
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        position = {p: k for k, p in enumerate(dict.fromkeys(prompts))}
        unique = list(position)
        index = torch.tensor([position[p] for p in prompts])
        text = torch.cat([self.encode_text(unique[i:i + self.batch_size])
                          for i in range(0, len(unique), self.batch_size)])
        raw = []
        scale = self.model.logit_scale.exp().float()
        for i in range(0, len(images), self.batch_size):
            img = self.encode_images(images[i:i + self.batch_size])
            txt = text[index[i:i + self.batch_size].to(text.device)]
            raw.append(scale * (img * txt).sum(-1))
        raw_t = torch.cat(raw).float().cpu()
        return raw_t / PICKSCORE_SCALE, raw_t


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
            bad = [k for k in self.reward_weights if k not in REWARD_NAMES]
            if bad:
                raise ValueError(f"unknown reward(s) {bad} in reward_weights; known: {REWARD_NAMES}")

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
        if name not in REWARD_NAMES:
            raise ValueError(f"--reward_weights names an unknown reward {name!r}; known: {', '.join(REWARD_NAMES)}")
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
    g.add_argument("--genrm_url", default="http://127.0.0.1:8000", action=_JudgeUrls,
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
            if name == "ocr":
                self.ocr_reader()
            elif name == "pickscore":
                self.pickscore()
            elif name not in REWARD_NAMES:
                raise ValueError(f"unknown reward {name!r}; known: {REWARD_NAMES}")

    def scores_rows_independently(self, data_sources: Sequence[str]) -> bool:
        """Whether every reward that rows with these data sources use scores each image on its own (jpeg_*, OCR
        through the http judge or rapidocr: one request / one call per image), so that `score_batch` over
        consecutive row slices, joined by `RewardResult.cat`, equals one call over all rows bit for bit. PickScore
        and the local GenRM batch images, and batched kernels may round differently at another batch size."""
        names = list(self.config.reward_weights) if self.config.reward_weights else list(dict.fromkeys(data_sources))
        return all(name.startswith("jpeg_") or (name == "ocr" and self.config.ocr_backend in ("http", "rapidocr"))
                   for name in names)

    # --- single rewards on a subset -------------------------------------------------------------------------
    def _score(self, name: str, images: list[torch.Tensor], gts: list[str],
               samples: Sequence[int] | None = None) -> tuple[torch.Tensor, dict, dict]:
        """One reward on a list of samples -> (scores (n,), numeric extras {key: (n,)}, text extras). `samples`:
        their positions in the caller's batch (named in errors)."""
        if name == "ocr":
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
            return scores, {"ocr/exact_match": exact, OCR_EMPTY_REPLY: empty}, {"ocr/response": replies}
        if name == "pickscore":
            scores, raw = self.pickscore()(images, gts)
            return scores, {"pickscore/raw": raw}, {}
        if name == "jpeg_compressibility":
            return jpeg_compressibility([to_pil(img) for img in images]), {}, {}
        if name == "jpeg_incompressibility":
            return jpeg_incompressibility([to_pil(img) for img in images]), {}, {}
        raise ValueError(
            f"data_source {name!r} names no reward; known: {REWARD_NAMES}. data_source must name the reward "
            f"(rewrite old datasets with data_prep/set_data_source.py)")

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
            if ds not in REWARD_NAMES:
                raise ValueError(
                    f"sample {i}: data_source {ds!r} names no reward; known: {REWARD_NAMES}. data_source must name "
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
        if sources[i] == name or name.startswith("jpeg_"):
            return gts[i]
        key = GROUND_TRUTH_EXTRA_KEY[name]
        info = infos[i] or {}
        if not isinstance(info.get(key), str):
            raise ValueError(
                f"sample {i} (data_source {sources[i]!r}) has no ground truth for reward {name!r}: multi-reward "
                f"reads it from extra_info[{key!r}] when the row's data_source names another reward")
        return info[key]


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
