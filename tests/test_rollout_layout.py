"""Rollout layouts and the rollout's overlap with the rest of the step, on CPU through real worker subprocesses:
the colocated / reserved device mapping, chunks streamed back while the workers still sample, rewards scored per
chunk equal to scoring after the whole rollout (bit for bit), reward errors propagating, non-blocking
submit / collect with the policy lag it reports, and the adapter sync through memory equal to the disk sync (bit
for bit) with wrong tensor sets refused."""

import argparse
from types import SimpleNamespace
import os

import pytest
import torch

import rewards
import rollout
import training as T
from training.adapters import publish_tensors
from training.data import PromptSampler
from training.scoring import RewardStream
from engines import layout
from models import load_model, lora
from rollout import RolloutError, RolloutRequest, RolloutResult

# one pytest-xdist worker runs this module (pytest.ini: --dist loadgroup): its module fixtures are costly
pytestmark = pytest.mark.xdist_group("test_rollout_layout")

SIZE = 64
PROMPTS = ['A storefront sign that reads "OPEN"', 'A chalkboard menu that says "Soup of the day"']


def ode_request(step: int = 1, n_per_prompt: int = 2) -> RolloutRequest:
    prompts = [p for p in PROMPTS for _ in range(n_per_prompt)]
    return RolloutRequest(prompts=prompts, negative_prompts=[" "] * len(prompts), cfg_scale=4.0,
                          seeds=[rollout.row_seed(3, step, i) for i in range(len(prompts))], num_inference_steps=3,
                          height=SIZE, width=SIZE)


@pytest.fixture(scope="module")
def client(tiny_models):
    """The trainers' client without torch.distributed (a node of one rank): a CPU worker of tiny Qwen-Image,
    chunks of one sample, adapters synced as tensors (a memory file) or from a directory."""
    made = rollout.DistributedRollout(os.path.join(tiny_models, "qwen_image"), ["cpu"], trainer_device="cpu",
                                      sync="tensors", max_batch_size=1, threads_per_worker=1, timeout_s=300,
                                      startup_timeout_s=300)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def actor(tiny_models):
    """A tiny Qwen-Image with a rank-4 LoRA whose B is non-zero (a zero B would hide a binding bug)."""
    model = load_model(os.path.join(tiny_models, "qwen_image"))
    lora.add_lora(model, rank=4, alpha=8)
    g = torch.Generator().manual_seed(0)
    for layer in lora.lora_layers(model.transformer, "default").values():
        weight = layer.lora_B["default"].weight
        weight.data.copy_(torch.randn(weight.shape, generator=g) * 0.5)
    return model


def jpeg_scorer() -> rewards.RewardScorer:
    return rewards.RewardScorer(rewards.RewardConfig())


def assert_same_rewards(a: rewards.RewardResult, b: rewards.RewardResult) -> None:
    """Bit for bit, NaN where the other has NaN."""
    torch.testing.assert_close(a.rewards, b.rewards, rtol=0, atol=0)
    assert sorted(a.extras) == sorted(b.extras) and a.texts == b.texts
    for key in a.extras:
        torch.testing.assert_close(a.extras[key], b.extras[key], rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------------------
# layouts (pure)
# ---------------------------------------------------------------------------------------------------------


def test_colocated_and_reserved_device_mapping():
    assert layout.node_worker_devices(["colocated"], local_world_size=4, trainer_device="cuda") == [
        "cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert layout.node_worker_devices(["colocated"], local_world_size=2, trainer_device="cpu") == ["cpu", "cpu"]
    assert layout.node_worker_devices(["cuda:3"], local_world_size=3, trainer_device="cuda") == ["cuda:3"]
    with pytest.raises(ValueError, match="stands alone"):
        layout.node_worker_devices(["colocated", "cuda:3"], local_world_size=3, trainer_device="cuda")
    # cuda:k is the trainer's cuda:k: the k-th entry of its CUDA_VISIBLE_DEVICES (numbers, UUIDs, MIG ids)
    assert layout.visible_gpu(1, "4,5,6,7") == "5" and layout.visible_gpu(0, "GPU-ab12,GPU-cd34") == "GPU-ab12"
    with pytest.raises(ValueError, match="not visible"):
        layout.visible_gpu(4, "4,5,6,7")
    # colocated worker r gets rank r's GPU only (tensors from rank r, the same GPU: cuda index 0)
    assert layout.worker_cuda_devices("cuda:1", 1, "4,5,6,7") == ("5", 0)
    # a reserved rollout GPU also sees local rank 0's GPU (its tensor source) as its cuda:1
    assert layout.worker_cuda_devices("cuda:3", 0, "4,5,6,7") == ("7,4", 1)
    assert layout.worker_cuda_devices("cuda:3", None, "4,5,6,7") == ("7", None)
    assert layout.adapter_sources(["cuda:0", "cuda:1", "cuda:2"], local_world_size=3, trainer_device="cuda") == [
        0, 1, 2]
    assert layout.adapter_sources(["cuda:3"], local_world_size=3, trainer_device="cuda") == [0]
    assert layout.adapter_sources(["cpu", "cpu"], local_world_size=2, trainer_device="cpu") == [0, 0]
    with pytest.raises(ValueError, match="for the native engine"):  # refused before any worker starts
        rollout.DistributedRollout("unused", ["colocated"], trainer_device="cuda", engine="vllm_omni")


def test_sync_mode_resolution():
    resolve = layout.resolve_sync
    assert resolve("auto", engine="native", trainer_device="cuda", devices=["cuda:0", "cuda:1"]) == "tensors"
    assert resolve("auto", engine="native", trainer_device="cpu", devices=["cpu"]) == "tensors"
    assert resolve("auto", engine="vllm_omni", trainer_device="cuda", devices=["cuda:3"]) == "disk"
    assert resolve("auto", engine="native", trainer_device="cpu", devices=["cuda:0"]) == "disk"
    assert resolve("disk", engine="native", trainer_device="cuda", devices=["cuda:3"]) == "disk"
    with pytest.raises(ValueError, match="--rollout_sync disk"):
        resolve("tensors", engine="vllm_omni", trainer_device="cuda", devices=["cuda:3"])
    with pytest.raises(ValueError, match="must be one of"):
        resolve("ipc", engine="native", trainer_device="cuda", devices=["cuda:3"])


def test_lagged_rollout_needs_its_own_gpus(monkeypatch):
    def args(**kw):
        base = dict(rollout_policy_lag=1, rollout_devices="colocated", device="cuda")
        return argparse.Namespace(**{**base, **kw})

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert "rollout GPUs of their own" in T.check_rollout_lag(args())
    assert "cuda:1" in T.check_rollout_lag(args(rollout_devices="cuda:1"))
    assert T.check_rollout_lag(args(rollout_devices="cuda:3")) is None
    assert T.check_rollout_lag(args(rollout_policy_lag=0)) is None
    assert T.check_rollout_lag(args(device="cpu", rollout_devices="cpu")) is None
    # the local judge scores the lagged rollout during the update: sampling there would race the update's RNG
    local = dict(rollout_devices="cuda:3", ocr_backend="local")
    assert "--genrm_temperature 0 (greedy)" in T.check_rollout_lag(args(**local, genrm_temperature=0.7))
    assert T.check_rollout_lag(args(**local, genrm_temperature=0.0)) is None
    # no pending rollout at a checkpoint (exact resume) and none after the last step
    def run(lag: int = 1, save_pending: bool = False):
        return SimpleNamespace(args=argparse.Namespace(rollout_policy_lag=lag, total_training_steps=6, save_freq=3),
                               lifeboat=SimpleNamespace(save_pending=save_pending))
    assert [s for s in range(1, 7) if T.lag_next_rollout(run(), s)] == [1, 2, 4, 5]
    assert not T.lag_next_rollout(run(lag=0), 1)
    # a checkpoint deferred from a skipped step is written at the next applied one: no lagged rollout until then
    assert not T.lag_next_rollout(run(save_pending=True), 4)


def test_peek_batch_leaves_the_sampler_where_it_was():
    sampler = PromptSampler(10, 4, seed=1)
    sampler.next_batch()
    state = sampler.state_dict()
    peeked = T.peek_batch(sampler)
    assert sampler.state_dict() == state and sampler.next_batch().indices == peeked.indices


def test_adapter_layout_unpack_refuses_malformed_layouts():
    flat = torch.arange(10.0)
    modules = layout.unpack_adapter(flat, layout.adapter_layout([("a.lora_A.weight", (2, 3)),
                                                                    ("a.lora_B.weight", (4, 1))]))
    assert torch.equal(modules["a"]["A"], flat[:6].view(2, 3)) and torch.equal(modules["a"]["B"], flat[6:].view(4, 1))
    with pytest.raises(ValueError, match="covers 6 of the buffer's 10"):
        layout.unpack_adapter(flat, [["a.lora_A.weight", [2, 3]]])
    with pytest.raises(ValueError, match="needs more than"):
        layout.unpack_adapter(flat, [["a.lora_A.weight", [4, 3]]])
    with pytest.raises(ValueError, match="is not '<module>.lora_A.weight'"):
        layout.unpack_adapter(flat, [["a.weight", [10]]])
    with pytest.raises(ValueError, match="appears twice"):
        layout.unpack_adapter(flat, [["a.lora_A.weight", [5]], ["a.lora_A.weight", [5]]])


def test_reward_result_cat_fills_what_a_slice_did_not_score():
    scorer = jpeg_scorer()
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 32, 32), generator=g, dtype=torch.uint8)
    sources = ["jpeg_compressibility", "jpeg_compressibility", "jpeg_incompressibility", "jpeg_compressibility"]
    whole = scorer.score_batch(images, [""] * 4, sources)
    parts = [scorer.score_batch(images[i:i + 1], [""], sources[i:i + 1]) for i in range(4)]
    assert "reward/jpeg_incompressibility" not in parts[0].extras  # so the join must fill NaN there
    assert_same_rewards(rewards.RewardResult.cat(parts), whole)
    assert scorer.scores_rows_independently(sources)
    assert not rewards.RewardScorer(rewards.RewardConfig(ocr_backend="local")).scores_rows_independently(["ocr"])
    assert not scorer.scores_rows_independently(["pickscore"])


# ---------------------------------------------------------------------------------------------------------
# streaming and overlapped scoring through real workers
# ---------------------------------------------------------------------------------------------------------


class CallLog:
    """The real scorer, with each score_batch call recorded (rows, when it started)."""

    def __init__(self, scorer, row_independent: bool | None = None):
        self.scorer, self.row_independent, self.calls = scorer, row_independent, []

    def scores_rows_independently(self, sources):
        if self.row_independent is None:
            return self.scorer.scores_rows_independently(sources)
        return self.row_independent

    def score_batch(self, images, ground_truths, data_sources, extra_infos=None):
        import time

        self.calls.append((len(images), time.monotonic()))
        return self.scorer.score_batch(images, ground_truths, data_sources, extra_infos)


def score_payloads(request: RolloutRequest, ranks: int, sources: list[str]) -> list[dict]:
    per = len(request) // ranks
    return [{"ground_truths": [""] * per, "data_sources": sources[r * per:(r + 1) * per], "extra_infos": [{}] * per}
            for r in range(ranks)]


def test_streamed_chunks_scored_while_sampling_equal_scoring_afterwards(client):
    """Two ranks' rows (2 + 2) in chunks of one: every chunk is scored as it arrives, the first
    score starts before the last chunk is in (the overlap), and each rank's rewards equal one score_batch over its
    rows after the whole rollout, bit for bit (two data sources, so some chunks lack the other's extras)."""
    request = ode_request()
    sources = ["jpeg_compressibility", "jpeg_incompressibility", "jpeg_compressibility", "jpeg_compressibility"]
    payloads = score_payloads(request, 2, sources)
    scorer = CallLog(jpeg_scorer())
    stream = RewardStream(scorer, payloads, [2, 2])
    chunks = []
    pending = client.group.submit(request, on_chunk=lambda row, part: (chunks.append((row, len(part))),
                                                                      stream.on_chunk(row, part)))
    result = pending.wait()
    per_rank = stream.finish()
    stream.close()
    assert sorted(chunks) == [(0, 1), (1, 1), (2, 1), (3, 1)] and len(scorer.calls) == 4
    assert min(t for _, t in scorer.calls) < pending.last_chunk_at
    assert stream.busy_s() > 0
    for rank in range(2):
        after = scorer.scorer.score_batch(result.images[2 * rank:2 * rank + 2], **payloads[rank])
        assert_same_rewards(per_rank[rank], after)
    # the streamed result is the plain result
    again = client.group.generate(request)
    assert torch.equal(again.latents_clean, result.latents_clean) and torch.equal(again.images, result.images)


def test_batch_dependent_rewards_score_each_rank_in_one_call(client):
    """Where a reward batches its images (PickScore, local GenRM), each rank's rows are scored in ONE call once they
    all arrived: the call scoring after the rollout makes."""
    request = ode_request()
    payloads = score_payloads(request, 2, ["jpeg_compressibility"] * 4)
    scorer = CallLog(jpeg_scorer(), row_independent=False)
    stream = RewardStream(scorer, payloads, [2, 2])
    result = client.group.submit(request, on_chunk=stream.on_chunk).wait()
    per_rank = stream.finish()
    stream.close()
    assert sorted(n for n, _ in scorer.calls) == [2, 2]
    for rank in range(2):
        assert_same_rewards(per_rank[rank], scorer.scorer.score_batch(result.images[2 * rank:2 * rank + 2],
                                                                      **payloads[rank]))


def test_a_failing_reward_is_an_error_not_a_zero():
    """The judge is down: the stream re-raises the reader's error at finish(), after every call ended."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    scorer = rewards.RewardScorer(rewards.RewardConfig(genrm_url=f"http://127.0.0.1:{port}", genrm_max_retries=0,
                                                       genrm_timeout_s=5))
    payloads = [{"ground_truths": ["OPEN", "OPEN"], "data_sources": ["ocr", "ocr"], "extra_infos": [{}, {}]}]
    stream = RewardStream(scorer, payloads, [2])
    part = RolloutResult(images=torch.zeros(1, 3, 32, 32, dtype=torch.uint8), latents_clean=torch.zeros(1, 4),
                         prompt_embeds=torch.zeros(1, 1, 2), prompt_mask=torch.ones(1, 1, dtype=torch.long),
                         seeds=[0], metadata={"family": "f"})
    stream.on_chunk(0, part)
    stream.on_chunk(1, part)
    with pytest.raises(rewards.GenRMServerError, match="GenRM"):
        stream.finish()
    stream.close()


def test_submit_collect_scores_and_reports_the_policy_lag(client, actor, tmp_path):
    """`submit` returns before sampling ends; an adapter version loaded meanwhile reaches the workers only after
    the pending rollout, which keeps the version it started with, and `collect` reports that one version was
    published since the submit (`rollout/policy_lag` 1). The consumer's per-rank value comes back with the rows."""
    tensors, config = lora.adapter_tensors(actor.transformer)
    layout = [(key, tuple(t.shape)) for key, t in tensors.items()]
    adapter_dir = str(tmp_path / "adapter")
    lora.write_adapter_dir(tensors, config, adapter_dir)
    request = ode_request(step=2)
    payload = {"ground_truths": [""] * 4, "data_sources": ["jpeg_compressibility"] * 4, "extra_infos": [{}] * 4}
    consumer = lambda payloads, sizes: RewardStream(jpeg_scorer(), payloads, sizes)  # noqa: E731

    first = [t * 3 if ".lora_B." in key else t for key, t in tensors.items()]
    publish_tensors(client, layout, first, config, "first")
    with_first = client.generate(request)
    client.submit(request, payload=payload, consumer=consumer)
    assert client.has_pending
    assert client.load_adapter(adapter_dir, "second") == [len(tensors) // 2]  # after the pending rollout
    with pytest.raises(RolloutError, match="other rows"):
        client.collect(ode_request(step=3))
    lagged, scored, stats = client.collect(request, lagged=True)
    assert not client.has_pending
    assert stats["rollout/policy_lag"] == 1.0 and stats["timing_s/gen_sampling"] > 0
    assert stats["timing_s/reward"] >= 0 and stats["timing_s/reward_total"] > 0
    assert torch.equal(lagged.latents_clean, with_first.latents_clean)  # sampled with the version it started with
    assert_same_rewards(scored, jpeg_scorer().score_batch(lagged.images, **payload))

    with_second = client.generate(request)
    assert not torch.equal(with_second.latents_clean, with_first.latents_clean)
    client.submit(request)
    result, value, stats = client.collect(request)
    assert value is None and stats["rollout/policy_lag"] == 0.0
    assert torch.equal(result.latents_clean, with_second.latents_clean)


def test_tensor_sync_equals_disk_sync_and_refuses_wrong_tensor_sets(client, actor, tmp_path):
    """The same adapter through a PEFT directory and through memory (`publish_tensors`, a memfd buffer the workers
    map) gives bit-identical rollouts; a different adapter through memory changes them; wrong tensor sets are
    refused before anything is copied (the workers keep sampling the last good version)."""
    tensors, config = lora.adapter_tensors(actor.transformer)
    n_modules = len(tensors) // 2
    layout = [(key, tuple(t.shape)) for key, t in tensors.items()]
    request = ode_request(step=4)

    disk_dir = str(tmp_path / "disk")
    lora.write_adapter_dir(tensors, config, disk_dir)
    assert client.load_adapter(disk_dir, "disk") == [n_modules]
    from_disk = client.generate(request)

    other = [t * 2 if ".lora_B." in key else t for key, t in tensors.items()]
    assert publish_tensors(client, layout, other, config, "other") == [n_modules]
    from_other = client.generate(request)
    assert not torch.equal(from_other.latents_clean, from_disk.latents_clean)

    assert publish_tensors(client, layout, list(tensors.values()), config, "tensors") == [n_modules]
    from_tensors = client.generate(request)
    assert from_tensors.metadata["adapter_version"] == "tensors"
    assert torch.equal(from_tensors.latents_clean, from_disk.latents_clean)
    assert torch.equal(from_tensors.images, from_disk.images)

    key = next(iter(tensors))
    extra = layout + [(key.replace("transformer_blocks.0.", "transformer_blocks.99."), tuple(tensors[key].shape))]
    with pytest.raises(RolloutError, match="bind to no LoRA module"):
        publish_tensors(client, extra, list(tensors.values()) + [tensors[key]], config, "bad")
    missing = [(k, s) for k, s in layout if not k.startswith(key.rsplit(".lora_", 1)[0] + ".")]
    with pytest.raises(RolloutError, match="get no tensor"):
        publish_tensors(client, missing, [tensors[k] for k, _ in missing], config, "bad")
    wide = {k: torch.cat([t, t], dim=0 if ".lora_A." in k else 1) for k, t in tensors.items()}  # rank 8, not 4
    with pytest.raises(RolloutError, match="do not match the model's"):
        publish_tensors(client, [(k, tuple(t.shape)) for k, t in wide.items()], list(wide.values()), config, "bad")
    with pytest.raises(RolloutError, match="cannot be opened by this worker's torch"):
        client.group._call_all([{"op": "load_adapter_tensors", "version": "bad", "config": config, "layout": [],
                                 "source": {"kind": "cuda_ipc", "numel": 0, "device": 0},
                                 "torch_version": "0.0.0"}], "load_adapter_tensors")
    still = client.generate(request)
    assert still.metadata["adapter_version"] == "tensors" and torch.equal(still.latents_clean, from_disk.latents_clean)


def test_bench_sync_smoke(client, tiny_models, tmp_path):
    """tools/bench_sync.py's CPU mode on the tiny Qwen-Image (on this module's worker, whose LoRA has alpha 8):
    both sync paths timed, counts checked, the rollout after either path bit-identical."""
    import json

    import bench_sync

    out = tmp_path / "sync.json"
    assert bench_sync.main(["--device", "cpu", "--quick", "--repeats", "1", "--json", str(out), "--lora_alpha", "8",
                            "--model_path", os.path.join(tiny_models, "qwen_image")], client=client) == 0
    data = json.loads(out.read_text())
    assert data["bound_counts_ok"] and data["identical_rollout"] and data["modules"] == 24
    assert data["disk"]["median_s"] > 0 and data["tensors"]["median_s"] > 0 and data["ratio"] > 0


# ---------------------------------------------------------------------------------------------------------
# the lagged DiffusionNFT rollout end to end (slow: two short trainer runs)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lagged_nft_samples_one_version_behind_and_resumes_exactly(tiny_models, tmp_path):
    """--rollout_policy_lag 1 on one trainer rank, tiny Qwen-Image, 3 steps, a checkpoint at step 2: step 2 is
    sampled while step 1 trains, so the workers report that they sampled it with version v0 (the adapter of before
    step 1's refresh; policy_lag 1); step 3 follows the checkpoint and samples unlagged with v2. A run resumed from
    the step-2 checkpoint reproduces step 3 bit for bit."""
    from test_trainers import cli, run_trainer, scalars, values

    from data_prep.make_demo_data import make_demo_data

    data = tmp_path / "data"
    make_demo_data(data, model="qwen_image")
    base = dict(model_path=os.path.join(tiny_models, "qwen_image"), train_files=data / "train.parquet",
                true_cfg_scale=1.0, save_freq=2, lr=1e-2, rollout_policy_lag=1, total_training_steps=3)

    def run(name, **flags):
        out = tmp_path / name
        run_trainer("train_nft.py", cli(**{**base, "output_dir": out, **flags}), nproc=1)
        return scalars(out)

    straight = run("straight")
    assert values(straight, "rollout/policy_lag") == [0.0, 1.0, 0.0]
    assert values(straight, "rollout/adapter_version") == [0.0, 0.0, 2.0]
    resumed = run("resumed", resume=str(tmp_path / "straight" / "checkpoints" / "step_00000002"))
    assert [s for s, _ in resumed["actor/policy_loss"]] == [3]  # it really resumed
    keys = [k for k in straight if k.startswith(("actor/", "critic/", "rollout/"))]
    assert len(keys) > 10
    for key in keys:
        assert [v for s, v in straight[key] if s == 3] == [v for s, v in resumed[key] if s == 3], key


# ---------------------------------------------------------------------------------------------------------
# two ranks under torchrun: a rollout longer than the collective timeout ends no rank
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # two ranks under torchrun, a worker frozen twice for 10 s, a stuck scorer (~1 min, 2 cores)
def test_a_rollout_longer_than_the_collective_timeout_ends_no_rank(tiny_models, tmp_path):
    import json
    import socket
    import subprocess
    import sys

    from _training_helpers import DIST_ENV

    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={port}", os.path.join(here, "_rollout_keepalive_worker.py"),
           os.path.join(tiny_models, "qwen_image"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=os.path.dirname(here), capture_output=True, text=True, timeout=400)
    seen = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    assert proc.returncode == 0 and not any("error" in s for s in seen), (seen, proc.stderr[-4000:])
    for s in seen:  # every rank waited past the node group's 4 s timeout and got its two rows
        assert s["generate"]["rows"] == 2 and s["generate"]["waited_s"] > 8  # the freeze's clock starts just before
        assert s["collect"]["rows"] == 2 and s["collect"]["waited_s"] > 8
        for phase in ("generate", "collect"):  # in rounds (0.4 s: a tenth of the timeout), none near the timeout
            rounds = s[phase]["rounds"]
            assert len(rounds) >= 10 and max(rounds) < 2.0, rounds
        # a scorer that never finishes ends both ranks alike, the scoring limit (4 s) after the last sample
        assert "RolloutError" in s["stuck"]["error"] and "still running 4 s after its last sample" in s["stuck"]["error"]
        assert s["stuck"]["waited_s"] < 30
    assert seen[0]["collect"]["gen_s"] > 10  # the driver's own clock: sampling took past the timeout
