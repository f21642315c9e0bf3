"""The OCR judge (GenRM): a vision-language model asked to transcribe an image, over HTTP or in-process.

`GenRMHttpReader` sends verl-omni's OCR request to an OpenAI-compatible chat-completions server (judge replicas
round-robin, a deadline over each whole reply, retries with backoff, a judge restart ridden out), on the threads of
a `DaemonThreadPool`; `GenRMLocalReader` runs a Qwen3-VL-Instruct checkpoint with transformers' `generate`. Both
take PIL images and return the verbatim replies (`JudgeReply`: the text and how it ended); `rewards.ocr_score`
turns a reply into a reward and `rewards.judge_reply_kind` says whether it is a reading at all.

May import the standard library, numpy / torch / PIL and (lazily) transformers; never `rewards` (which imports it).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import http.client
import io
import itertools
import json
import queue
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from PIL import Image

GENRM_SYSTEM_MESSAGE = "You are a helpful assistant."
GENRM_OCR_PROMPT = (
    "Please output only the text content from the image without any additional descriptions or formatting."
)


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


class JudgeReply(str):
    """A judge's reply: its text (a `str`, taken verbatim) and `finish_reason`, how it ended: the server's
    `choices[0].finish_reason` ("stop", "length": cut at max_tokens, ...; None when it gave none) or
    REPLY_TOO_LARGE when the reply's body was larger than the reader's limit (`max_reply_bytes`) and was not read
    (the text is then empty: a cut JSON body holds no content to take)."""

    finish_reason: str | None

    def __new__(cls, text: str, finish_reason: str | None = None) -> "JudgeReply":
        reply = super().__new__(cls, text)
        reply.finish_reason = finish_reason
        return reply

    def __reduce__(self):
        return JudgeReply, (str(self), self.finish_reason)


REPLY_TOO_LARGE = "too_large"  # JudgeReply.finish_reason of a body over `max_reply_bytes`
MAX_REPLY_BYTES_PER_TOKEN = 64  # JSON-escaped UTF-8 of one token is far below this (a CJK character: 6 bytes)


def max_reply_bytes(max_tokens: int) -> int:
    """The largest reply body a judge asked for at most `max_tokens` new tokens can honestly send: 64 bytes per
    token plus 64 KiB for the JSON around them (4096 tokens: 320 KiB). A body past it is not read further."""
    return (64 << 10) + MAX_REPLY_BYTES_PER_TOKEN * max(int(max_tokens), 1)


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
    minute is ridden out. One request takes at most `genrm_request_budget_s(timeout_s, max_retries, backoff_s,
    retry_total_s)`; other HTTP errors (400, 404, ...) are not retried. When a request still fails, the whole
    batch raises `GenRMServerError` naming the URL, the image and the last error: a failed judge never becomes a
    zero reward.

    `url` may list several judge replicas, comma-separated (`--genrm_url` repeated or `URL1,URL2`): requests start
    on the replicas in turn (round-robin), and each retry of a request goes to the next replica, so one replica
    that is down or failing costs a retry, not the batch. An empty or whitespace `content` is a
    reply (an empty transcription); a reply without a string `content` is not, and is an error. A reply body
    larger than `max_reply_bytes(max_tokens)` is not buffered: reading stops there and the reply comes back empty
    with finish_reason REPLY_TOO_LARGE (counted as an over-long reply, `rewards.judge_reply_kind`), so a server that
    ignores max_tokens costs neither the deadline nor the memory.
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

    def _post_once(self, payload: bytes, endpoint: "_Endpoint") -> JudgeReply:
        """One attempt to `endpoint`, all of it within `timeout_s` of wall clock; returns the reply's `content` and
        finish reason (an empty REPLY_TOO_LARGE reply once the body passes `max_reply_bytes`)."""
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
            received, limit = 0, max_reply_bytes(self.sampling.max_tokens)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or expired.is_set():
                    raise _DeadlineExceeded(f"the reply was still incomplete at the {self.timeout_s:g} s deadline "
                                            f"({sum(map(len, chunks))} body bytes received)")
                held[0].settimeout(remaining)
                chunk = resp.read1(65536)
                if not chunk:
                    break
                received += len(chunk)
                chunks.append(chunk)
                if received > limit:  # the rest is never read (the connection closes)
                    if resp.status >= 400:
                        raise _HttpStatus(resp.status, resp.reason, b"".join(chunks)[:300])
                    return JudgeReply("", REPLY_TOO_LARGE)
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

    def _transcribe_one(self, image: Image.Image) -> JudgeReply:
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

    def transcribe(self, images: Sequence[Image.Image]) -> list[JudgeReply]:
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


def parse_chat_content(body: bytes) -> JudgeReply:
    """The `choices[0].message.content` string of a chat-completions reply body, with `choices[0].finish_reason`
    (None when absent or not a string). Empty or whitespace is a valid (empty) transcription; anything without a
    string content (not JSON, no choices, content null or a list) raises `_MalformedReply` quoting the body."""
    try:
        reply = json.loads(body)
        choice = reply["choices"][0]
        content = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise _MalformedReply(f"malformed chat-completions reply ({exc!r}): {body[:200]!r}") from exc
    if not isinstance(content, str):
        raise _MalformedReply(f"reply content is {type(content).__name__}, not a string: {body[:200]!r}")
    finish = choice.get("finish_reason") if isinstance(choice, dict) else None
    return JudgeReply(content, finish if isinstance(finish, str) else None)


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


class JudgeUrls(argparse.Action):
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
    with special tokens skipped, taken verbatim, with finish_reason "length" when it used all max_tokens without
    an end token, else "stop"."""

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

    def end_token_ids(self) -> list[int]:
        """The tokens that end a generation: the generation config's eos ids and the tokenizer's pad id."""
        eos = self.model.generation_config.eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        pad = self.processor.tokenizer.pad_token_id
        return [i for i in ids + [pad] if i is not None] or [-1]

    @staticmethod
    def messages(image: Image.Image) -> list[dict]:
        return [
            {"role": "system", "content": [{"type": "text", "text": GENRM_SYSTEM_MESSAGE}]},
            {"role": "user", "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": GENRM_OCR_PROMPT},
            ]},
        ]

    def sample(self, inputs: Any, gen_kwargs: dict[str, Any], start: int) -> torch.Tensor:
        """`generate` with sampling, from a forked RNG (the CPU's and the judge device's, the only ones seeded), so
        the caller's RNG state is as before. On the caller's thread only: a fork restores the state it saved, so
        it would rewind another thread's draws (`training.flags.check_rollout_lag` refuses that layout)."""
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            if self.sampling.seed is not None:
                torch.random.default_generator.manual_seed(self.sampling.seed + start)
                if cuda:
                    with torch.cuda.device(self.device):
                        torch.cuda.manual_seed(self.sampling.seed + start)  # this device only
            return self.model.generate(**inputs, **gen_kwargs)

    @torch.no_grad()
    def transcribe(self, images: Sequence[Image.Image]) -> list[JudgeReply]:
        replies: list[JudgeReply] = []
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
            if self.sampling.temperature > 0:
                out = self.sample(inputs, gen_kwargs, start)
            else:  # greedy draws nothing: no RNG is touched (the scorer may run beside the trainer's update)
                out = self.model.generate(**inputs, **gen_kwargs)
            new_tokens = out[:, inputs["input_ids"].shape[1]:]  # (B, T), padded after each row's end token
            texts = self.processor.batch_decode(new_tokens, skip_special_tokens=True)
            ended = torch.isin(new_tokens, torch.tensor(self.end_token_ids(), device=new_tokens.device)).any(dim=1)
            full = new_tokens.shape[1] >= self.sampling.max_tokens
            replies.extend(JudgeReply(t, "length" if full and not e else "stop") for t, e in zip(texts, ended.tolist()))
        return replies

