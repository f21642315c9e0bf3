"""rewards.py: OCR score, the three OCR readers, PickScore (open_clip vs transformers), JPEG, multi-reward, inputs."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import rewards as R
from reward_models import genrm as G
from reward_models import pickscore as PS


def to_tensor(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()


def text_image(text: str, size=(320, 128), font_size=36) -> torch.Tensor:
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    draw.text((16, size[1] // 2 - font_size // 2), text, fill="black", font=ImageFont.load_default(size=font_size))
    return to_tensor(img)


def noise_image(seed=0, size=(3, 128, 128)) -> torch.Tensor:
    return torch.randint(0, 256, size, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


# ------------------------------------------------------------------------------------------------------------------
# OCR score
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("transcription,target,expected", [
    ("Grand Opening", "Grand Opening", 1.0),
    ("The sign reads: GRAND OPENING today!", "Grand Opening", 1.0),      # substring (after normalisation) = full
    ("grand\n\topening", "Grand Opening", 1.0),                           # every whitespace removed, lowercase
    ("Grand Openin", "Grand Opening", 1 - 1 / 12),                        # 1 edit over 12 non-space chars
    ("Hallo", "Hello", 0.8),
    ("hello", "hello!", 1 - 1 / 6),                                       # punctuation kept
    ("completely different and much longer text", "abc", 0.0),           # distance capped at len(target)
    ("", "abc", 0.0),
    ("", "", 1.0),                                                        # empty target: only empty matches
    ("   \n", "", 1.0),
    ("x", "", 0.0),
])
def test_ocr_score_cases(transcription, target, expected):
    assert R.ocr_score(transcription, target) == pytest.approx(expected)


def test_ocr_score_is_levenshtein_on_normalised_strings():
    import Levenshtein
    t, g = "Sprng Colection 2O24", "Spring Collection 2024"
    d = Levenshtein.distance("sprngcolection2o24", "springcollection2024")
    assert d == 3
    assert R.ocr_score(t, g) == pytest.approx(1 - d / len("springcollection2024"))


# ------------------------------------------------------------------------------------------------------------------
# RapidOCR backend
# ------------------------------------------------------------------------------------------------------------------

def test_rapidocr_reads_rendered_text_and_not_noise():
    scorer = R.RewardScorer(R.RewardConfig(ocr_backend="rapidocr"))
    two_lines = Image.new("RGB", (256, 160), "white")
    draw = ImageDraw.Draw(two_lines)
    draw.text((20, 20), "GRAND", fill="black", font=ImageFont.load_default(size=40))
    draw.text((20, 90), "OPENING", fill="black", font=ImageFont.load_default(size=40))
    images = [text_image("Hello World 42"), noise_image(), to_tensor(two_lines)]
    t0 = time.time()
    res = scorer.score_batch(images, ["Hello World 42", "Hello World 42", "Grand Opening"], ["ocr"] * 3)
    elapsed = time.time() - t0
    assert res.rewards[0].item() == 1.0, res.texts
    assert res.rewards[1].item() < 0.2, res.texts
    assert res.rewards.dtype == torch.float32 and res.rewards.shape == (3,)
    assert res.texts["ocr/response"][0].replace(" ", "").lower() == "helloworld42"
    # Lines are concatenated in reading order with no separator (flow_grpo), so a two-line target still matches.
    assert res.texts["ocr/response"][2] == "GRANDOPENING" and res.rewards[2].item() == 1.0
    print(f"RapidOCR: {elapsed / 3:.2f}s per image (incl. first-call warm-up)")


@pytest.mark.parametrize("transcription,target,expected", [
    ("Grand Opening", "grand opening", 1.0),                              # normalised as ocr_score: case, spaces
    ("GRAND\nOPENING", "Grand Opening", 1.0),
    ("The sign reads: GRAND OPENING today!", "Grand Opening", 0.0),      # ocr_score's substring credit is 1 here
    ("Grand Openin", "Grand Opening", 0.0),
    ("", "", 1.0),
])
def test_ocr_exact_match_cases(transcription, target, expected):
    assert R.ocr_exact_match(transcription, target) == expected


def test_rapidocr_exact_match_extra_and_process_pool_agree():
    """score_batch returns `ocr/exact_match` beside the Levenshtein reward (1 only for a whole-string match), and a
    two-process RapidOCR pool transcribes exactly what the in-process engine does, in the input order."""
    images = [text_image("Hello World 42"), noise_image(), text_image("Hello World 42 and more"), text_image("Stop")]
    gts = ["Hello World 42", "Hello World 42", "Hello World 42", "Stop"]
    serial = R.RewardScorer(R.RewardConfig(ocr_backend="rapidocr")).score_batch(images, gts, ["ocr"] * 4)
    assert serial.extras["ocr/exact_match"].tolist() == [1.0, 0.0, 0.0, 1.0], serial.texts
    assert serial.rewards[2].item() == 1.0  # the substring still scores 1
    pooled_scorer = R.RewardScorer(R.RewardConfig(ocr_backend="rapidocr", rapidocr_workers=2))
    pooled = pooled_scorer.score_batch(images, gts, ["ocr"] * 4)
    assert pooled_scorer.ocr_reader().pool is not None
    assert pooled.texts == serial.texts
    assert torch.equal(pooled.rewards, serial.rewards)
    assert torch.equal(pooled.extras["ocr/exact_match"], serial.extras["ocr/exact_match"])
    pooled_scorer.ocr_reader().pool.shutdown()


# ------------------------------------------------------------------------------------------------------------------
# GenRM over HTTP: a local OpenAI-compatible test server on loopback
# ------------------------------------------------------------------------------------------------------------------

class LocalServer:
    """A `ThreadingHTTPServer` on a free 127.0.0.1 port serving `handler` from a daemon thread inside a `with`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0):
        ThreadingHTTPServer.allow_reuse_address = True  # a restarted judge binds its old port again at once
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class FakeJudge(LocalServer):
    """Scripted chat-completions server. `behaviours` is consumed one per request (last one repeats):
    "ok" -> reply with `reply` (a list: the k-th request gets reply[k]), an int -> that HTTP status, "sleep" -> stall
    for `stall_s`, "garbage" -> non-JSON, "null_content" / "no_content" -> a chat completion whose message content
    is null / missing. With `reads_probe` an "ok" request whose image is the trainers' start-up probe
    (`rewards.judge_probe_image`) is answered with the probe's word, as a judge that reads would (it still counts
    as the k-th request). `finish_reason` (a list: per request, like `reply`) goes into the "ok" replies when given."""

    def __init__(self, behaviours=("ok",), reply="Grand Opening", stall_s=2.0, delay_s=0.0, port=0,
                 reads_probe=True, finish_reason=None):
        from reward_models.genrm import png_data_url

        self.behaviours = list(behaviours)
        self.reply, self.stall_s, self.delay_s = reply, stall_s, delay_s
        self.probe_url = png_data_url(R.to_pil(R.judge_probe_image())) if reads_probe else None
        self.finish_reason = finish_reason
        self.requests: list[dict] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    k = len(judge.requests)
                    judge.requests.append(body)
                    judge.paths.append(self.path)
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                    behaviour = judge.behaviours[min(k, len(judge.behaviours) - 1)]
                try:
                    time.sleep(judge.delay_s)
                    if behaviour == "sleep":
                        time.sleep(judge.stall_s)
                        behaviour = "ok"
                    if isinstance(behaviour, int):
                        payload, status = b'{"error": "scripted failure"}', behaviour
                    elif behaviour == "garbage":
                        payload, status = b"<html>not json</html>", 200
                    elif behaviour in ("null_content", "no_content"):
                        message = {"role": "assistant", **({"content": None} if behaviour == "null_content" else {})}
                        payload, status = json.dumps({"choices": [{"index": 0, "message": message}]}).encode(), 200
                    else:
                        reply = judge.reply[k] if isinstance(judge.reply, list) else judge.reply
                        if judge.probe_url and body["messages"][1]["content"][0]["image_url"]["url"] == judge.probe_url:
                            reply = R.JUDGE_PROBE_WORD
                        choice = {"index": 0, "message": {"role": "assistant", "content": reply}}
                        finish = judge.finish_reason
                        finish = finish[k] if isinstance(finish, list) else finish
                        if finish:
                            choice["finish_reason"] = finish
                        payload = json.dumps({"choices": [choice]}).encode()
                        status = 200
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    with judge.lock:
                        judge.in_flight -= 1

        super().__init__(Handler, port)


def http_scorer(url, **kw) -> R.RewardScorer:
    cfg = dict(ocr_backend="http", genrm_url=url, genrm_timeout_s=10.0, genrm_max_retries=2, genrm_backoff_s=0.01,
               genrm_concurrency=4, sampling=R.SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=64, seed=7))
    cfg.update(kw)
    return R.RewardScorer(R.RewardConfig(**cfg))


def test_genrm_http_request_shape_and_score():
    image = noise_image(1, (3, 32, 48))
    with FakeJudge(reply="The text says: grand  OPENING") as judge:
        res = http_scorer(judge.url).score_batch([image], ["Grand Opening"], ["ocr"])
    assert res.rewards.tolist() == [1.0]
    assert res.texts["ocr/response"] == ["The text says: grand  OPENING"]  # verbatim
    assert judge.paths == ["/v1/chat/completions"]
    body = judge.requests[0]
    assert body["model"] == "Qwen/Qwen3-VL-8B-Instruct"
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.0, 1.0, 64, 7)
    system, user = body["messages"]
    assert system == {"role": "system", "content": "You are a helpful assistant."}
    assert user["role"] == "user"
    image_part, text_part = user["content"]
    assert text_part == {"type": "text", "text": "Please output only the text content from the image without any "
                                                 "additional descriptions or formatting."}
    url = image_part["image_url"]["url"]
    assert image_part["type"] == "image_url" and url.startswith("data:image/png;base64,")
    png = base64.b64decode(url.split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    decoded = to_tensor(Image.open(io.BytesIO(png)))
    assert torch.equal(decoded, image)  # lossless, same pixels, CHW order restored


def test_genrm_http_partial_match_and_order_under_concurrency():
    with FakeJudge(reply="Grand Openin", delay_s=0.05) as judge:
        scorer = http_scorer(judge.url, genrm_concurrency=2)
        res = scorer.score_batch([noise_image(i, (3, 16, 16)) for i in range(6)],
                                 ["Grand Opening", "zzz", "Grand Opening", "Grand Openin", "g", "Grand Opening"],
                                 ["ocr"] * 6)
    assert res.rewards.tolist() == pytest.approx([1 - 1 / 12, 0.0, 1 - 1 / 12, 1.0, 1.0, 1 - 1 / 12])
    assert judge.max_in_flight == 2  # bounded, and actually concurrent


def test_genrm_http_retries_then_succeeds():
    with FakeJudge(behaviours=[503, 429, "ok"]) as judge:
        res = http_scorer(judge.url).score_batch([noise_image()], ["Grand Opening"], ["ocr"])
    assert res.rewards.tolist() == [1.0]
    assert len(judge.requests) == 3


def test_genrm_http_timeout_is_retried_then_errors():
    with FakeJudge(behaviours=["sleep"], stall_s=4.0) as judge:
        scorer = http_scorer(judge.url, genrm_timeout_s=0.5, genrm_max_retries=1)
        t0 = time.time()
        with pytest.raises(R.GenRMServerError, match=r"failed 2 attempt\(s\).*timeout 0.5s"):
            scorer.score_batch([noise_image()], ["Grand Opening"], ["ocr"])
        assert time.time() - t0 < 3.0  # gave up on the timeouts, did not wait for the stalled reply
    assert len(judge.requests) == 2


def test_genrm_http_timeout_then_recovery():
    with FakeJudge(behaviours=["sleep", "ok"], stall_s=3.0) as judge:
        res = http_scorer(judge.url, genrm_timeout_s=1.0).score_batch([noise_image()], ["Grand Opening"], ["ocr"])
    assert res.rewards.tolist() == [1.0]


@pytest.mark.parametrize("behaviour", [500, "garbage"])
def test_genrm_http_final_error_never_zero(behaviour):
    with FakeJudge(behaviours=[behaviour]) as judge:
        scorer = http_scorer(judge.url, genrm_max_retries=2)
        with pytest.raises(R.GenRMServerError) as info:
            scorer.score_batch([noise_image(), noise_image(1)], ["a", "b"], ["ocr", "ocr"])
    assert "2 of 2 GenRM requests failed" in str(info.value)
    assert judge.url in str(info.value) and "3 attempt(s)" in str(info.value)
    assert len(judge.requests) == 6  # two images, 1 try + 2 retries each


def test_genrm_http_client_error_not_retried():
    with FakeJudge(behaviours=[400]) as judge:
        with pytest.raises(R.GenRMServerError, match="not retried"):
            http_scorer(judge.url).score_batch([noise_image()], ["a"], ["ocr"])
    assert len(judge.requests) == 1


def test_genrm_http_replicas_share_the_requests_and_a_failing_one_is_retried_on_another():
    images, gts = [noise_image(seed) for seed in range(6)], ["Grand Opening"] * 6
    with FakeJudge() as a, FakeJudge() as b:
        res = http_scorer(f"{a.url},{b.url}", genrm_max_retries=0).score_batch(images, gts, ["ocr"] * 6)
        assert res.rewards.tolist() == [1.0] * 6
        assert (len(a.requests), len(b.requests)) == (3, 3)  # round-robin
    with FakeJudge(behaviours=[500]) as down, FakeJudge() as up:
        res = http_scorer(f"{down.url},{up.url}", genrm_max_retries=1).score_batch(images, gts, ["ocr"] * 6)
        assert res.rewards.tolist() == [1.0] * 6  # each request that met the failing replica went on to the other
        assert len(up.requests) == 6 and len(down.requests) == 3
    with FakeJudge(behaviours=[500]) as down, FakeJudge(behaviours=[503]) as also_down:
        with pytest.raises(R.GenRMServerError, match=r"failed 2 attempt\(s\).*the last from"):
            http_scorer(f"{down.url},{also_down.url}", genrm_max_retries=1).score_batch(images[:1], gts[:1], ["ocr"])


def test_genrm_url_flag_repeats_and_refuses_an_empty_replica():
    import argparse

    parser = argparse.ArgumentParser()
    R.add_reward_args(parser)
    assert parser.parse_args([]).genrm_url == "http://127.0.0.1:8000"
    assert parser.parse_args(["--genrm_url", "http://a:1", "--genrm_url", "http://b:2,http://c:3"]).genrm_url == \
        "http://a:1,http://b:2,http://c:3"
    assert G.split_genrm_urls("http://a:1, http://b:2") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="several separated by commas"):
        http_scorer("http://a:1,,http://b:2").score_batch([noise_image()], ["a"], ["ocr"])


def test_genrm_http_unreachable_server_errors():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed right after: nothing listens there
    scorer = http_scorer(f"127.0.0.1:{port}", genrm_max_retries=1)
    with pytest.raises(R.GenRMServerError, match="failed 2 attempt"):
        scorer.score_batch([noise_image()], ["a"], ["ocr"])


def test_genrm_http_rides_out_a_judge_restart_and_reports_the_real_numbers():
    """A judge that is down (connection refused) is retried on time, for up to --genrm_retry_total_s, beyond
    --genrm_max_retries: a restart of ~3 s is ridden out; one that outlasts the total fails with a message whose
    attempt count and seconds are the ones that happened."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there yet: the judge is restarting
    judges = []

    def come_back():
        time.sleep(3.0)
        judges.append(FakeJudge(port=port).__enter__())

    threading.Thread(target=come_back, daemon=True).start()
    scorer = http_scorer(f"127.0.0.1:{port}", genrm_max_retries=1, genrm_backoff_s=0.2, genrm_retry_total_s=30.0)
    start = time.monotonic()
    try:
        res = scorer.score_batch([noise_image()], ["Grand Opening"], ["ocr"])
        elapsed = time.monotonic() - start
    finally:
        for judge in judges:
            judge.__exit__(None, None, None)
    assert res.rewards.tolist() == [1.0]
    assert 2.5 < elapsed < 15, elapsed  # waited for the restart (backoff capped), not for the whole 30 s

    scorer = http_scorer(f"127.0.0.1:{port}", genrm_max_retries=1, genrm_backoff_s=0.2, genrm_retry_total_s=2.0)
    start = time.monotonic()
    with pytest.raises(R.GenRMServerError) as info:
        scorer.score_batch([noise_image()], ["Grand Opening"], ["ocr"])
    elapsed = time.monotonic() - start
    message = str(info.value)
    found = re.search(r"failed (\d+) attempt\(s\) in ([\d.]+) s \(timeout 10s each.*; (\d+) could not connect, "
                      r"retried for up to --genrm_retry_total_s 2 s with a backoff from 0.2 s doubling up to 10 s; "
                      r"other failures retried --genrm_max_retries 1 time\(s\)\)", message)
    assert found, message
    attempts, seconds, unreachable = int(found.group(1)), float(found.group(2)), int(found.group(3))
    # sleeps 0.2, 0.4, 0.8, then 0.6 (the rest of the 2 s), then one counted retry after 3.2 s: 6 attempts, all refused
    assert (attempts, unreachable) == (6, 6)
    assert abs(seconds - elapsed) < 0.5 and 4.5 < elapsed < 8, (seconds, elapsed)
    # the collective timeouts count this time in (training.collective_timeout_s)
    assert R.genrm_request_budget_s(10.0, 1, 0.2, 2.0) == 2 * 10.0 + 0.2 + 2.0 + 10.0


class TricklingJudge(LocalServer):
    """A chat-completions server that sends its reply one byte every `interval_s` (shorter than the client's
    per-read socket timeout, so only a deadline over the whole reply ends the request): `where` = "body" (status
    and headers at once, then the body byte by byte) or "headers" (the status line and headers byte by byte too)."""

    def __init__(self, where: str = "body", interval_s: float = 0.25):
        self.requests = 0
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                judge.requests += 1
                body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Grand Opening"}}]})
                head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                data = (head + body).encode() if where == "headers" else body.encode()
                try:
                    if where == "body":
                        self.wfile.write(head.encode())
                        self.wfile.flush()
                    for i in range(len(data)):
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                        time.sleep(interval_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        super().__init__(Handler)


@pytest.mark.parametrize("where", ["body", "headers"])
def test_genrm_http_trickling_judge_is_cut_at_the_deadline(where):
    """A server that keeps every read alive (a byte every 0.25 s, the reply would take ~20 s) cannot hold a request
    past --genrm_timeout_s: each attempt ends at its 1 s deadline, the request after 2 attempts + a 0.05 s backoff."""
    with TricklingJudge(where) as judge:
        scorer = http_scorer(judge.url, genrm_timeout_s=1.0, genrm_max_retries=1, genrm_backoff_s=0.05)
        start = time.monotonic()
        with pytest.raises(R.GenRMServerError, match=r"failed 2 attempt\(s\).*deadline") as info:
            scorer.score_batch([noise_image()], ["Grand Opening"], ["ocr"])
        elapsed = time.monotonic() - start
    budget = R.genrm_request_budget_s(1.0, 1, 0.05)
    assert budget == pytest.approx(2.05)
    assert budget - 0.1 <= elapsed < budget + 1.0, elapsed
    assert judge.requests == 2
    assert "sample 0 of the batch (ground truth 'Grand Opening')" in str(info.value)


def test_genrm_http_empty_reply_is_an_empty_transcription_and_counted(tmp_path):
    """"" and whitespace replies score as empty transcriptions (0 against a target, 1 against an empty target), are
    flagged per sample and reach the trainers' metrics as critic/reward/ocr/empty_reply_frac; the replies are kept."""
    from training.logs import reward_metrics
    from training.scoring import JUDGE_LOG, judge_records, log_judge_replies

    with FakeJudge(reply=["", "Grand Opening", " \n\t", ""]) as judge:
        scorer = http_scorer(judge.url, genrm_concurrency=1)
        res = scorer.score_batch([noise_image(i) for i in range(4)], ["Grand Opening", "Grand Opening", "OPEN", ""],
                                 ["ocr"] * 4)
    assert res.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert res.extras[R.OCR_EMPTY_REPLY].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert res.texts["ocr/response"] == ["", "Grand Opening", " \n\t", ""]
    metrics = reward_metrics(res.rewards, [0, 0, 1, 1],
                             extras={k: v.tolist() for k, v in res.extras.items()})
    assert metrics["critic/reward/ocr/empty_reply_frac"] == 0.75
    assert "critic/reward/ocr/empty_reply_frac/mean" not in metrics
    assert metrics["critic/reward/ocr/mean"] == 0.5
    # the raw replies a training step keeps (judge_replies.jsonl), per sample with its row and reward
    from types import SimpleNamespace
    rows = [SimpleNamespace(index=7, data_source="ocr", ground_truth="Grand Opening"),
            SimpleNamespace(index=9, data_source="ocr", ground_truth="OPEN")]
    records = judge_records(rows, 2, res, phase="train", step=3)
    out = tmp_path / "run"
    out.mkdir()
    log_judge_replies(str(out), records)
    lines = [json.loads(line) for line in (out / JUDGE_LOG).read_text().splitlines()]
    assert [(r["row"], r["sample"], r["ocr/response"], r["reward"]) for r in lines] == [
        (7, 0, "", 0.0), (7, 1, "Grand Opening", 1.0), (9, 2, " \n\t", 0.0), (9, 3, "", 1.0)]
    assert all(r["phase"] == "train" and r["step"] == 3 for r in lines)


def test_judge_reply_kind_tells_a_reading_from_what_is_not_one():
    """Independently written expectations: cut at max_tokens / too large / longer than 4 characters per token ->
    overlong; blank -> empty; a refusal's opening without the target -> refusal; everything else is a reading (a
    sign that says "Sorry, we're closed" read right, a partial or wrong reading)."""
    cases = [
        ("Grand Opening", None, "Grand Opening", "reading"),
        ("Grand Openin", None, "Grand Opening", "reading"),
        ("CLOSED", None, "Grand Opening", "reading"),
        ("Sorry, we're closed", None, "Sorry we're closed", "reading"),
        ("I’m sorry, but I can’t help with that.", None, "Grand Opening", "refusal"),
        ("I cannot read the text in this image.", None, "OPEN", "refusal"),
        ("As an AI, I do not transcribe images.", None, "OPEN", "refusal"),
        ("  \n", None, "OPEN", "empty"),
        ("", G.REPLY_TOO_LARGE, "OPEN", "overlong"),
        ("OPEN", "length", "OPEN", "overlong"),
        ("OPEN", "stop", "OPEN", "reading"),
        ("a" * 256, None, "OPEN", "reading"),  # 4 characters x 64 tokens: still within the budget
        ("a" * 257, None, "OPEN", "overlong"),
    ]
    for text, finish, target, kind in cases:
        assert R.judge_reply_kind(G.JudgeReply(text, finish), target, 64) == kind, (text[:40], finish)


def test_genrm_http_replies_that_are_not_readings_are_counted_and_a_huge_body_is_not_read():
    """A refusal, a reply cut at max_tokens (finish_reason "length") and a 50 MB body (a server that ignores
    max_tokens) are scored like any reply but counted per sample (over-long, refusal, unusable), and the huge body
    is dropped after max_reply_bytes instead of being buffered to the deadline. Before: all three were readings,
    and the reader held the whole body."""
    refusal = "I'm sorry, but I can't help with that."
    with FakeJudge(reply=["Grand Opening", refusal, "Grand Grand Grand"]) as judge:
        scorer = http_scorer(judge.url, genrm_concurrency=1)
        res = scorer.score_batch([noise_image(i) for i in range(3)], ["Grand Opening"] * 3, ["ocr"] * 3)
    assert res.texts["ocr/reply_kind"] == ["reading", "refusal", "reading"]
    assert res.extras[R.OCR_REFUSAL_REPLY].tolist() == [0.0, 1.0, 0.0]
    assert res.extras[R.OCR_UNUSABLE_REPLY].tolist() == [0.0, 1.0, 0.0]
    with FakeJudge(reply="Grand Grand Grand", finish_reason="length") as judge:
        res = http_scorer(judge.url).score_batch([noise_image(0)], ["Grand Opening"], ["ocr"])
    assert res.texts["ocr/reply_kind"] == ["overlong"] and res.extras[R.OCR_OVERLONG_REPLY].tolist() == [1.0]
    huge = "Grand Opening " * (50 * 2 ** 20 // 14)
    with FakeJudge(reply=huge) as judge:
        reader = http_scorer(judge.url).ocr_reader()
        start = time.monotonic()
        [reply] = reader.transcribe([R.to_pil(noise_image(0))])
    assert reply == "" and reply.finish_reason == G.REPLY_TOO_LARGE and time.monotonic() - start < 5
    assert G.max_reply_bytes(64) == 64 * 1024 + 64 * 64
    assert R.judge_reply_kind(reply, "Grand Opening", 64) == "overlong"


@pytest.mark.parametrize("shape", ["null_content", "no_content"])
def test_genrm_http_reply_that_is_not_a_transcription_names_the_sample(shape):
    with FakeJudge(behaviours=["ok", shape]) as judge:
        scorer = http_scorer(judge.url, genrm_concurrency=1, genrm_max_retries=0)
        with pytest.raises(R.GenRMServerError) as info:
            scorer.score_batch([noise_image(0), noise_image(1)], ["a", "b"], ["ocr", "ocr"])
    message = str(info.value)
    assert "sample 1 of the batch (ground truth 'b')" in message
    assert "not a transcription" in message and ("NoneType" in message or "KeyError" in message)


def test_genrm_http_ctrl_c_does_not_wait_for_a_stalled_judge(tmp_path):
    """SIGINT while a judge request stalls (server silent 90 s, --genrm_timeout_s 120): the process exits at once,
    its request thread does not hold the interpreter's exit (a ThreadPoolExecutor's would, until the reply). The
    signal is sent once the request is in flight and the time is counted from it, so a slow start under load
    (importing torch) cannot fail the test. The child installs Python's SIGINT handler itself, as a terminal's
    process has it: Python leaves an inherited SIG_IGN alone, and a shell's background job (`bash script &`, as CI
    may start pytest) has SIGINT ignored."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "score.py"
    script.write_text(
        "import signal, sys, torch\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import rewards as R\n"
        "scorer = R.RewardScorer(R.RewardConfig(ocr_backend='http', genrm_url=sys.argv[1], genrm_timeout_s=120.0,\n"
        "                                       genrm_max_retries=0))\n"
        "scorer.score_batch([torch.zeros(3, 16, 16, dtype=torch.uint8)], ['a'], ['ocr'])\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with FakeJudge(behaviours=["sleep"], stall_s=90.0) as judge:
        proc = subprocess.Popen([sys.executable, str(script), judge.url], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=repo,
                                                                            OMP_NUM_THREADS="1",
                                                                            PYTHONFAULTHANDLER="1"))
        try:
            deadline = time.monotonic() + 120
            while not judge.requests and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(judge.requests) == 1, "the request never reached the judge"
            start = time.monotonic()
            proc.send_signal(signal.SIGINT)
            try:
                _, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # say why: the child's signal masks and every thread's stack
                with open(f"/proc/{proc.pid}/status") as f:
                    masks = [line.strip() for line in f if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
                proc.send_signal(signal.SIGABRT)  # faulthandler prints all threads
                _, stderr = proc.communicate(timeout=30)
                pytest.fail(f"still running 60 s after SIGINT; {masks}; its stderr:\n{stderr[-6000:]}")
            elapsed = time.monotonic() - start
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in stderr, stderr[-2000:]
    assert elapsed < 20, elapsed


@pytest.mark.parametrize("spec,match", [
    ("ocr=0", r"reward 'ocr' has weight 0"),
    ("ocr=1,jpeg_compressibility=nan", r"reward 'jpeg_compressibility' has weight nan"),
    ("pickscore=inf", r"reward 'pickscore' has weight inf"),
    ("ocr=1,ocr=2", r"reward 'ocr' twice"),
    ("ocr=x", r"weight of reward 'ocr' is 'x'"),
    ("aesthetic=1", r"unknown reward 'aesthetic'"),
])
def test_bad_reward_weights_are_refused_at_parse_time(spec, match, capsys):
    import argparse
    parser = argparse.ArgumentParser()
    R.add_reward_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--reward_weights", spec])
    assert re.search(match, capsys.readouterr().err)
    assert parser.parse_args(["--reward_weights", "ocr=1,jpeg_compressibility=-0.01"]).reward_weights == \
        "ocr=1,jpeg_compressibility=-0.01"  # kept as written (a negative weight is a penalty, allowed)


@pytest.mark.parametrize("url,expected", [
    ("127.0.0.1:8000", "http://127.0.0.1:8000/v1/chat/completions"),
    ("http://h:1/", "http://h:1/v1/chat/completions"),
    ("http://h:1/v1", "http://h:1/v1/chat/completions"),
    ("https://h/v1/chat/completions", "https://h/v1/chat/completions"),
])
def test_chat_completions_url(url, expected):
    assert G.chat_completions_url(url) == expected


# ------------------------------------------------------------------------------------------------------------------
# GenRM in-process (transformers) on the tiny Qwen3-VL
# ------------------------------------------------------------------------------------------------------------------

def test_genrm_local_backend_tiny_qwen3_vl(tiny_models):
    path = f"{tiny_models}/qwen3_vl_genrm"
    scorer = R.RewardScorer(R.RewardConfig(ocr_backend="local", genrm_model_path=path, genrm_device="cpu",
                                           genrm_batch_size=3, sampling=R.SamplingConfig(max_tokens=6)))
    images = [noise_image(0, (3, 64, 64)), noise_image(1, (3, 64, 96)), noise_image(2, (3, 64, 64))]
    gts = ["Grand Opening", "a", "xyz"]
    res = scorer.score_batch(images, gts, ["ocr"] * 3)
    replies = res.texts["ocr/response"]
    assert all(isinstance(r, str) for r in replies)
    # 6 new tokens of a random model never reach its end token: every reply stops at max_tokens, an over-long one
    assert [r.finish_reason for r in replies] == ["length"] * 3 and res.texts["ocr/reply_kind"] == ["overlong"] * 3
    assert res.rewards.tolist() == pytest.approx([R.ocr_score(r, g) for r, g in zip(replies, gts)])
    # Left-padded batched greedy decoding equals one-at-a-time decoding.
    reader = scorer.ocr_reader()
    assert reader.transcribe([R.to_pil(images[1])]) == [replies[1]]
    # Greedy decoding draws no random numbers, so it touches no RNG: a fork there (in the scorer's thread) would
    # rewind the draws the trainer's update makes meanwhile.
    def no_fork(*a, **k):
        raise AssertionError("greedy decoding forked the RNG")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.random, "fork_rng", no_fork)
        assert reader.transcribe([R.to_pil(images[1])]) == [replies[1]]
    # Sampling with a seed: reproducible, and the caller's RNG state is as before
    sampling = R.RewardScorer(R.RewardConfig(ocr_backend="local", genrm_model_path=path, genrm_device="cpu",
                                             sampling=R.SamplingConfig(temperature=1.0, max_tokens=6, seed=3)))
    before = torch.get_rng_state()
    first = sampling.ocr_reader().transcribe([R.to_pil(images[0])])
    assert torch.equal(torch.get_rng_state(), before)
    assert sampling.ocr_reader().transcribe([R.to_pil(images[0])]) == first
    # The prompt the model sees: system message, then the image, then the transcription instruction.
    ids = reader.processor.apply_chat_template([reader.messages(R.to_pil(images[0]))], tokenize=True,
                                               add_generation_prompt=True)
    text = reader.processor.tokenizer.decode(ids[0] if isinstance(ids[0], list) else ids)
    assert "<|im_start|>system\nYou are a helpful assistant.<|im_end|>" in text
    assert text.index("<|image_pad|>") < text.index(G.GENRM_OCR_PROMPT)
    assert text.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------------------------------
# PickScore
# ------------------------------------------------------------------------------------------------------------------

PICKSCORE_V1_HF_CONFIG = {  # the architecture fields of yuvalkirstain/PickScore_v1's config.json (ViT-H/14)
    "projection_dim": 1024,
    "text_config": {"vocab_size": 49408, "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                    "num_hidden_layers": 24, "max_position_embeddings": 77, "hidden_act": "gelu",
                    "layer_norm_eps": 1e-5, "eos_token_id": 2},
    "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 16,
                      "num_hidden_layers": 32, "image_size": 224, "patch_size": 14, "hidden_act": "gelu",
                      "layer_norm_eps": 1e-5},
}


def test_open_clip_config_of_pickscore_v1_is_vit_h_14():
    import open_clip
    assert PS.open_clip_config_from_hf(PICKSCORE_V1_HF_CONFIG) == open_clip.get_model_config("ViT-H-14")


@pytest.fixture(scope="module")
def pickscore(tiny_models, tmp_path_factory):
    cache = tmp_path_factory.mktemp("open_clip_cache")
    return R.PickScore(f"{tiny_models}/pickscore", device="cpu", cache_dir=cache, batch_size=2), cache


def test_pickscore_open_clip_matches_transformers(pickscore, tiny_models):
    from transformers import AutoProcessor, CLIPModel
    ps, _ = pickscore
    images = [noise_image(0, (3, 96, 128)), noise_image(1, (3, 80, 64)), noise_image(2, (3, 64, 64))]
    prompts = ['a wooden sign that reads "Fresh Bread"', "a blue circle", 'a wooden sign that reads "Fresh Bread"']
    scores, raw = ps(images, prompts)
    hf = CLIPModel.from_pretrained(f"{tiny_models}/pickscore").eval()
    proc = AutoProcessor.from_pretrained(f"{tiny_models}/pickscore")
    inputs = proc(text=prompts, images=[R.to_pil(i) for i in images], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = hf(**inputs)
        img = torch.nn.functional.normalize(out.image_embeds, dim=-1)
        txt = torch.nn.functional.normalize(out.text_embeds, dim=-1)
        ref_raw = hf.logit_scale.exp() * (img * txt).sum(-1)
    assert torch.allclose(raw, out.logits_per_image.diag(), atol=1e-4)
    assert torch.allclose(raw, ref_raw, atol=1e-4)
    assert torch.allclose(scores, ref_raw / 26.0, atol=1e-5)
    assert hf.logit_scale.exp().item() == pytest.approx(math.exp(4.0))  # the /26 is not a no-op here
    assert raw.abs().max() > 0.5  # non-trivial similarities, so the comparison can fail


def test_pickscore_text_encoded_once_per_unique_prompt(pickscore):
    ps, _ = pickscore
    seen: list[list[str]] = []
    orig = ps.encode_text

    def counting(prompts):
        seen.append(list(prompts))
        return orig(prompts)

    ps.encode_text = counting
    try:
        prompts = ["b", "a", "b", "c", "a"]
        scores, _ = ps([noise_image(i, (3, 64, 64)) for i in range(5)], prompts)
    finally:
        del ps.encode_text
    assert sorted(p for chunk in seen for p in chunk) == ["a", "b", "c"]
    alone, _ = ps([noise_image(3, (3, 64, 64))], ["c"])
    assert scores[3].item() == pytest.approx(alone.item(), abs=1e-5)  # gathered back to the right sample


def test_pickscore_conversion_is_cached(pickscore, tiny_models, monkeypatch):
    _, cache = pickscore
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    assert {"open_clip_config.json", "open_clip_model.safetensors"} <= {p.name for p in folder.iterdir()}

    def boom(*a, **k):
        raise AssertionError("conversion re-run despite a cached copy")

    monkeypatch.setattr(PS, "convert_hf_clip_state_dict", boom)
    assert PS.convert_clip_checkpoint(f"{tiny_models}/pickscore", cache) == folder


def test_pickscore_conversion_rejects_unmapped_tensors(tiny_models):
    from safetensors.torch import load_file
    cfg = PS.open_clip_config_from_hf(json.load(open(f"{tiny_models}/pickscore/config.json")))
    sd = load_file(f"{tiny_models}/pickscore/model.safetensors")
    sd["vision_model.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="does not map"):
        PS.convert_hf_clip_state_dict(sd, cfg)
    sd.pop("vision_model.extra.weight")
    sd.pop("text_model.final_layer_norm.bias")
    with pytest.raises(KeyError, match="final_layer_norm.bias"):
        PS.convert_hf_clip_state_dict(sd, cfg)


def test_pickscore_through_scorer(tiny_models, tmp_path):
    scorer = R.RewardScorer(R.RewardConfig(pickscore_path=f"{tiny_models}/pickscore", pickscore_device="cpu",
                                           pickscore_cache_dir=str(tmp_path)))
    images = [noise_image(0, (3, 64, 64)), noise_image(1, (3, 64, 64))]
    res = scorer.score_batch(images, ['Change the text to "OPEN"', "a cat"], ["pickscore", "pickscore"])
    assert torch.allclose(res.rewards, res.extras["pickscore/raw"] / 26.0)
    assert torch.equal(res.rewards, res.extras["reward/pickscore"])


def test_pickscore_needs_a_path():
    with pytest.raises(ValueError, match="--pickscore_path"):
        R.RewardScorer().score_batch([noise_image()], ["a cat"], ["pickscore"])


# ------------------------------------------------------------------------------------------------------------------
# JPEG (DDPO)
# ------------------------------------------------------------------------------------------------------------------

def test_jpeg_rewards_ddpo_definition():
    flat = torch.full((3, 128, 128), 128, dtype=torch.uint8)
    noisy = noise_image(0)
    scorer = R.RewardScorer()
    inc = scorer.score_batch([flat, noisy], ["", ""], ["jpeg_incompressibility"] * 2).rewards
    comp = scorer.score_batch([flat, noisy], ["", ""], ["jpeg_compressibility"] * 2).rewards
    buf = io.BytesIO()
    R.to_pil(noisy).save(buf, format="JPEG", quality=95)
    assert inc[1].item() == pytest.approx(len(buf.getvalue()) / 1000)  # kB of 1000 bytes, quality 95
    assert torch.equal(comp, -inc)
    assert inc[0] < 5 < inc[1]  # a flat image compresses far better than noise
    assert comp[0] > comp[1]


# ------------------------------------------------------------------------------------------------------------------
# Mixed batches, multi-reward, inputs
# ------------------------------------------------------------------------------------------------------------------

def test_mixed_data_sources_pick_their_own_reward():
    with FakeJudge(reply="OPEN") as judge:
        res = http_scorer(judge.url).score_batch(
            [noise_image(0), noise_image(1), noise_image(2)], ["OPEN", "", "OPEX"],
            ["ocr", "jpeg_incompressibility", "ocr"])
    assert len(judge.requests) == 2  # only the ocr rows went to the judge
    jpeg = R.jpeg_incompressibility([R.to_pil(noise_image(1))]).item()
    assert res.rewards.tolist() == pytest.approx([1.0, jpeg, 0.75])
    assert math.isnan(res.extras["reward/ocr"][1]) and math.isnan(res.extras["reward/jpeg_incompressibility"][0])
    assert res.texts["ocr/response"] == ["OPEN", None, "OPEN"]


def test_multi_reward_weighted_sum_and_logging():
    weights = {"ocr": 2.0, "jpeg_compressibility": 0.01}
    images = [noise_image(0), torch.full((3, 64, 64), 200, dtype=torch.uint8)]
    with FakeJudge(reply="OPEN") as judge:
        res = http_scorer(judge.url, reward_weights=weights).score_batch(
            images, ['Change the text to "OPEN"', "OPEX"], ["pickscore", "ocr"],
            [{"target_text": "OPEN", "instruction": 'Change the text to "OPEN"'}, {}])
    ocr = torch.tensor([1.0, 0.75])
    jpeg = R.jpeg_compressibility([R.to_pil(i) for i in images])
    assert torch.allclose(res.extras["reward/ocr"], ocr)
    assert torch.allclose(res.extras["reward/jpeg_compressibility"], jpeg)
    assert torch.allclose(res.rewards, 2.0 * ocr + 0.01 * jpeg)
    assert torch.equal(res.extras["reward/combined"], res.rewards)


def test_multi_reward_missing_ground_truth_raises():
    scorer = http_scorer("http://127.0.0.1:9", reward_weights={"ocr": 1.0})
    with pytest.raises(ValueError, match=r"extra_info\['target_text'\]"):
        scorer.score_batch([noise_image()], ["a cat"], ["pickscore"], [{}])


def test_multi_reward_failing_reward_raises():
    with FakeJudge(behaviours=[503]) as judge:
        scorer = http_scorer(judge.url, genrm_max_retries=0,
                             reward_weights={"ocr": 1.0, "jpeg_incompressibility": 1.0})
        with pytest.raises(R.GenRMServerError):
            scorer.score_batch([noise_image()], ["OPEN"], ["ocr"])


def test_parse_reward_weights_and_args():
    import argparse
    assert R.parse_reward_weights("pickscore=1.0, jpeg_compressibility=0.1") == {
        "pickscore": 1.0, "jpeg_compressibility": 0.1}
    with pytest.raises(ValueError, match="NAME=WEIGHT"):
        R.parse_reward_weights("pickscore")
    with pytest.raises(ValueError, match="unknown reward"):
        R.RewardConfig(reward_weights={"aesthetic": 1.0})
    p = argparse.ArgumentParser()
    R.add_reward_args(p)
    cfg = R.RewardConfig.from_args(p.parse_args(["--ocr_backend", "rapidocr", "--genrm_temperature", "0.7",
                                                 "--reward_weights", "ocr=1,pickscore=0.5"]))
    assert cfg.ocr_backend == "rapidocr" and cfg.sampling.temperature == 0.7
    assert cfg.reward_weights == {"ocr": 1.0, "pickscore": 0.5}
    assert R.RewardConfig().sampling.temperature == 0.0  # evaluation default: greedy judge


@pytest.mark.parametrize("image,match", [
    (torch.rand(3, 32, 32), r"float32.*uint8 tensor of shape \(3, H, W\).*\* 255"),
    (torch.zeros(32, 32, 3, dtype=torch.uint8), r"shape \(32, 32, 3\)"),
    (torch.zeros(1, 32, 32, dtype=torch.uint8), r"shape \(1, 32, 32\)"),
    (np.zeros((3, 8, 8), dtype=np.uint8), "ndarray"),
])
def test_bad_pixels_raise(image, match):
    with pytest.raises(ValueError, match=match):
        R.RewardScorer().score_batch([image], [""], ["jpeg_compressibility"])


def test_batched_tensor_and_bad_batches_raise():
    scorer = R.RewardScorer()
    batch = torch.stack([noise_image(0, (3, 16, 16)), noise_image(1, (3, 16, 16))])
    as_batch = scorer.score_batch(batch, ["", ""], ["jpeg_compressibility"] * 2).rewards  # rollout's (B, 3, H, W)
    assert torch.equal(as_batch, scorer.score_batch(list(batch), ["", ""], ["jpeg_compressibility"] * 2).rewards)
    with pytest.raises(ValueError, match=r"float32.*uint8"):
        scorer.score_batch(batch.float() / 255, ["", ""], ["jpeg_compressibility"] * 2)
    with pytest.raises(ValueError, match=r"must be \(B, 3, H, W\)"):
        scorer.score_batch(noise_image(), [""], ["jpeg_compressibility"])
    with pytest.raises(ValueError, match="batch fields disagree"):
        scorer.score_batch([noise_image()], ["", ""], ["jpeg_compressibility"])
    with pytest.raises(ValueError, match="set_data_source.py"):
        scorer.score_batch([noise_image()], ["OPEN"], ["flow_grpo/ocr"])
    with pytest.raises(ValueError, match="ground_truth must be a str"):
        scorer.score_batch([noise_image()], [None], ["jpeg_compressibility"])


def _score_in_child(config_bytes, images, queue):
    import pickle
    scorer = R.RewardScorer(pickle.loads(config_bytes))
    rewards = scorer.score_batch(images, ["", ""], ["jpeg_incompressibility", "jpeg_compressibility"]).rewards
    queue.put(rewards.tolist())  # plain floats: a shared-memory tensor would die with the child


def test_scorer_builds_from_a_pickled_config_in_another_process():
    import multiprocessing as mp
    import pickle
    config = R.RewardConfig(ocr_backend="rapidocr", reward_weights=None)
    scorer = R.RewardScorer(config)
    assert scorer._ocr_reader is None and scorer._pickscore is None  # nothing loaded until first use
    images = [noise_image(0, (3, 32, 32)), noise_image(1, (3, 32, 32))]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_score_in_child, args=(pickle.dumps(config), images, queue))
    child.start()
    rewards = queue.get(timeout=60)
    child.join(timeout=30)
    assert child.exitcode == 0
    assert rewards == pytest.approx(scorer.score_batch(images, ["", ""], ["jpeg_incompressibility",
                                                                       "jpeg_compressibility"]).rewards.tolist())


def test_a_new_reward_is_one_table_entry_the_scorer_reads_everywhere(monkeypatch):
    """An entry added to REWARDS (here a constant reward that reads its ground truth from extra_info['caption'] on
    rows of another data_source) is scored, warmed up, checked for per-image scoring and found for multi-reward,
    with no other change to the scorer."""
    built = []

    def score_const(scorer, images, gts, samples=None):
        return torch.tensor([float(len(g)) for g in gts]), {"const/len": torch.ones(len(gts))}, {}

    monkeypatch.setattr(R.RewardScorer, "score_const", score_const, raising=False)
    monkeypatch.setattr(R.RewardScorer, "const_model", lambda scorer: built.append(scorer), raising=False)
    entry = R.Reward("score_const", model="const_model", ground_truth_key="caption", per_image=lambda config: False)
    monkeypatch.setitem(R.REWARDS, "const", entry)
    scorer = R.RewardScorer()
    images = [torch.zeros(3, 8, 8, dtype=torch.uint8)] * 2
    res = scorer.score_batch(images, ["abc", "de"], ["const", "const"])
    assert res.rewards.tolist() == [3.0, 2.0]
    assert res.extras["reward/const"].tolist() == [3.0, 2.0] and res.extras["const/len"].tolist() == [1.0, 1.0]
    scorer.warmup(["const", "jpeg_compressibility"])
    assert built == [scorer]
    assert not scorer.scores_rows_independently(["const"])
    assert scorer.scores_rows_independently(["jpeg_compressibility"])
    # multi-reward: a jpeg row reads the new reward's ground truth from extra_info["caption"]
    weighted = R.RewardScorer(R.RewardConfig(reward_weights={"const": 1.0}))
    res = weighted.score_batch(images[:1], ["ignored"], ["jpeg_compressibility"], [{"caption": "four"}])
    assert res.rewards.tolist() == [4.0]
    with pytest.raises(ValueError, match=r"extra_info\['caption'\]"):
        weighted.score_batch(images[:1], ["ignored"], ["jpeg_compressibility"], [{}])
    with pytest.raises(ValueError, match="names no reward; known: .*'const'"):
        scorer.score_batch(images[:1], ["x"], ["unknown_reward"])


def test_every_reward_entry_names_methods_the_scorer_has_and_a_subclass_can_override():
    """REWARDS holds method names (resolved on the scorer, so a subclass's override is the one called): a typo in
    an entry fails here, not at a run's first score."""
    for name, entry in R.REWARDS.items():
        assert callable(getattr(R.RewardScorer, entry.score, None)), (name, entry.score)
        assert entry.model is None or callable(getattr(R.RewardScorer, entry.model, None)), (name, entry.model)

    class HalfJpeg(R.RewardScorer):
        def score_jpeg_compressibility(self, images, gts, samples=None):
            scores, extras, texts = super().score_jpeg_compressibility(images, gts, samples)
            return scores / 2, extras, texts

    images = [torch.zeros(3, 8, 8, dtype=torch.uint8)]
    plain = R.RewardScorer().score_batch(images, [""], ["jpeg_compressibility"]).rewards
    halved = HalfJpeg().score_batch(images, [""], ["jpeg_compressibility"]).rewards
    torch.testing.assert_close(halved, plain / 2)
