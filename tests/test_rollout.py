"""The rollout contract through the real worker subprocess group on CPU, step-0 conformance with the trainer-side
replay, seeding, LoRA delivery and failure handling."""

import os
import re
import signal
import threading
import time

import pytest
import torch

import losses
import rollout
from engines import protocol, sampler, worker
from models import load_model
from models.base import PromptEmbeds
from rollout import RolloutError, RolloutGroup, RolloutRequest, RolloutResult

# one pytest-xdist worker runs this module (pytest.ini: --dist loadgroup): its module fixtures are costly
pytestmark = pytest.mark.xdist_group("test_rollout")

SIZE = 64
OCR_PROMPTS = ['A storefront sign that reads "OPEN"', 'A chalkboard menu that says "Soup of the day"']


def request_for(family: str, n_per_prompt: int = 2, **overrides) -> RolloutRequest:
    prompts = [p for p in OCR_PROMPTS for _ in range(n_per_prompt)]
    base = dict(prompts=prompts, seeds=[rollout.row_seed(7, 1, i) for i in range(len(prompts))],
                num_inference_steps=4, height=SIZE, width=SIZE, noise_level=1.0, sde_window_size=2,
                sde_window_range=(0, 3), return_log_probs=True, return_trajectory=True)
    if family == "qwen_image":
        base.update(negative_prompts=[" "] * len(prompts), cfg_scale=4.0)
    else:
        base.update(negative_prompts=[""] * len(prompts), cfg_scale=4.0)
    base.update(overrides)
    return RolloutRequest(**base)


def edit_request(**overrides) -> RolloutRequest:
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, SIZE, SIZE), generator=g, dtype=torch.uint8) for _ in range(2)]
    base = dict(prompts=['Change the text to "SALE"'] * 2 + ['Change the text to "CLOSED"'] * 2,
                images=[images[0], images[0], images[1], images[1]], negative_prompts=[""] * 4,
                seeds=[11, 12, 13, 14], num_inference_steps=4, height=SIZE, width=SIZE, cfg_scale=4.0,
                noise_level=1.0, sde_window_size=2, sde_window_range=(0, 3), return_log_probs=True,
                return_trajectory=True)
    base.update(overrides)
    return RolloutRequest(**base)


@pytest.fixture(scope="module")
def groups(tiny_models):
    """One CPU group per tiny family (two workers for Boogu T2I, to exercise the split), shared by the module."""
    made = {}
    try:
        for name, workers in (("qwen_image", 1), ("boogu_image_base", 2), ("boogu_image_edit", 1)):
            made[name] = RolloutGroup(os.path.join(tiny_models, name), ["cpu"] * workers, threads_per_worker=1,
                                      timeout_s=300, startup_timeout_s=300)
        yield made
    finally:
        for group in made.values():
            group.close()


# ---------------------------------------------------------------------------------------------------------
# pure helpers
# ---------------------------------------------------------------------------------------------------------


def test_row_seed_follows_the_spec_formula():
    assert rollout.row_seed(42, 1, 0) == 42 * 1_000_003
    assert rollout.row_seed(42, 3, 5) == (44 * 1_000_003 + 5)
    assert rollout.row_seed(2**62, 1, 1) == (2**62 * 1_000_003 + 1) % (2**63 - 1)


def test_sde_window_starts():
    gens = [torch.Generator().manual_seed(s) for s in range(200)]
    assert sampler.sde_window_starts(10, None, None, gens[:3]) == [0, 0, 0]
    starts = sampler.sde_window_starts(10, 2, (0, 5), gens)
    assert set(starts) == {0, 1, 2, 3}  # start ~ UniformInt{lo, ..., hi - w}
    again = sampler.sde_window_starts(10, 2, (0, 5), [torch.Generator().manual_seed(s) for s in range(200)])
    assert again == starts
    with pytest.raises(ValueError, match="does not fit"):
        sampler.sde_window_starts(4, 3, (0, 5), gens[:1])
    # cps: the last transition has noise scale sigma_next = 0 (deterministic), so no window may cover it
    assert sampler.sde_window_starts(6, 2, (0, 6), [], sde_type="sde") == []
    with pytest.raises(ValueError, match="cps: the last step is deterministic"):
        sampler.sde_window_starts(6, 2, (0, 6), [], sde_type="cps")
    # a range that ends before the last step is taken, and drawn exactly as for sde
    cps = sampler.sde_window_starts(6, 2, (0, 5), [torch.Generator().manual_seed(s) for s in range(50)],
                                    sde_type="cps")
    assert cps == sampler.sde_window_starts(6, 2, (0, 5), [torch.Generator().manual_seed(s) for s in range(50)])
    assert set(cps) == {0, 1, 2, 3}


def test_request_rejects_unknown_keys_and_bad_values():
    good = dict(prompts=["a"], seeds=[1], num_inference_steps=2, height=64, width=64, cfg_scale=1.0)
    assert len(RolloutRequest.from_dict(good)) == 1
    # the contract has one CFG scale: a message with a per-family knob of the old contract is refused, not ignored
    with pytest.raises(ValueError, match=r"unknown rollout request keys \['true_cfg_scale'\]"):
        RolloutRequest.from_dict(dict(good, true_cfg_scale=4.0))
    with pytest.raises(ValueError, match=r"missing rollout request keys \['cfg_scale'\]"):
        RolloutRequest.from_dict({k: v for k, v in good.items() if k != "cfg_scale"})
    with pytest.raises(ValueError, match="sde_window_range needs sde_window_size"):  # was silently ignored
        RolloutRequest.from_dict(dict(good, noise_level=1.0, sde_window_range=[0, 2]))
    for bad in (float("nan"), "4", None, True):
        with pytest.raises(ValueError, match="cfg_scale must be a finite number"):
            RolloutRequest.from_dict(dict(good, cfg_scale=bad))
    with pytest.raises(ValueError, match="cfg_scale 4.0 > 1 needs negative prompts"):
        RolloutRequest.from_dict(dict(good, cfg_scale=4.0))
    with pytest.raises(ValueError, match="unknown rollout request keys.*guidance"):
        RolloutRequest.from_dict(dict(good, guidance=3.0))
    with pytest.raises(ValueError, match="seeds has 2"):
        RolloutRequest.from_dict(dict(good, seeds=[1, 2]))
    with pytest.raises(ValueError, match="noise_level > 0"):
        RolloutRequest.from_dict(dict(good, return_log_probs=True))
    with pytest.raises(ValueError, match="sde_type"):
        RolloutRequest.from_dict(dict(good, sde_type="dance", noise_level=1.0))


def test_send_message_within_gives_up_on_a_peer_that_stopped_reading():
    big = {"op": "x", "payload": torch.arange(1 << 20, dtype=torch.int32)}  # 4 MiB: far past a full pipe (64 KiB)
    read_fd, write_fd = os.pipe()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="within 0.5 s"):
            protocol.send_message_within(write_fd, big, 0.5)
        assert 0.5 <= time.monotonic() - start < 5 and os.get_blocking(write_fd)   # blocking mode restored
    finally:
        os.close(read_fd)
        os.close(write_fd)
    # a peer that reads gets the whole frame (its raw pipe reads come short)
    read_fd, write_fd = os.pipe()
    received = {}

    def reader():
        with os.fdopen(read_fd, "rb", buffering=0) as stream:
            received["message"] = protocol.recv_message(stream)

    thread = threading.Thread(target=reader)
    thread.start()
    protocol.send_message_within(write_fd, big, 60)
    thread.join(60)
    os.close(write_fd)
    assert torch.equal(received["message"]["payload"], big["payload"])
    # a peer that has gone; a message that is not plain data is refused before anything is written
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    with pytest.raises(BrokenPipeError):
        protocol.send_message_within(write_fd, {"op": "y"}, 5)
    with pytest.raises(protocol.ProtocolError):
        protocol.send_message_within(write_fd, {"op": object()}, 5)
    os.close(write_fd)


def test_message_framing_round_trip():
    import io

    buffer = io.BytesIO()
    message = {"op": "x", "t": torch.arange(5.0), "nested": [1, "a"]}
    protocol.send_message(buffer, message)
    protocol.send_message(buffer, {"op": "y"})
    buffer.seek(0)
    first = protocol.recv_message(buffer)
    assert torch.equal(first["t"], message["t"]) and first["nested"] == [1, "a"]
    assert protocol.recv_message(buffer) == {"op": "y"}
    with pytest.raises(EOFError):
        protocol.recv_message(buffer)


# ---------------------------------------------------------------------------------------------------------
# the contract through the group
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen_image", "boogu_image_base", "boogu_image_edit"])
def test_contract_and_step0_conformance(groups, tiny_models, name):
    """Shapes, dtypes and metadata of the response; then the trainer-side replay of every stored SDE step
    (`losses.sde_step` with `prev_sample`, same schedule looked up by exact timestep equality) reproduces the
    rollout's log-probs: ratio = 1 at step 0."""
    request = edit_request() if name == "boogu_image_edit" else request_for(name)
    result = groups[name].generate(request)
    n = len(request)
    assert result.images.dtype == torch.uint8 and result.images.shape == (n, 3, SIZE, SIZE)
    assert result.latents_clean.dtype == torch.float32
    assert result.all_latents.dtype == torch.float32 and result.all_latents.shape[:2] == (n, 3)
    assert result.all_timesteps.shape == (n, 2) and result.all_log_probs.shape == (n, 2)
    assert torch.isfinite(result.all_log_probs).all()
    assert (result.all_timesteps[:, 0] > result.all_timesteps[:, 1]).all()  # descending 1000·σ
    assert result.seeds == request.seeds
    meta = result.metadata
    assert meta["engine"] == "native" and meta["num_inference_steps"] == 4 and meta["window_size"] == 2
    assert result.prompt_mask.shape == result.prompt_embeds.shape[:2]
    if name == "boogu_image_edit":
        assert result.ref_latents is not None and result.ref_latents.shape[0] == n
    else:
        assert result.ref_latents is None

    model = load_model(os.path.join(tiny_models, name))
    sigmas = model.schedule(4, SIZE, SIZE)
    assert torch.equal(sigmas, meta["sigmas"])  # rollout and replay build the same float32 schedule
    prompt = PromptEmbeds(result.prompt_embeds, result.prompt_mask)
    negative = PromptEmbeds(result.negative_embeds, result.negative_mask)
    for j in range(2):
        x, x_next = result.all_latents[:, j], result.all_latents[:, j + 1]
        sigma, sigma_next = losses.sigmas_at_timesteps(result.all_timesteps[:, j], sigmas)
        with torch.no_grad():
            v = model.guided_velocity(x, sigma, prompt, negative, meta["guidance"], result.ref_latents,
                                      height=SIZE, width=SIZE)
        replay = losses.sde_step(x, v, sigma, sigma_next, noise_level=1.0, sigma_max=sigmas[1], prev_sample=x_next)
        ratio = torch.exp(replay.log_prob - result.all_log_probs[:, j])
        torch.testing.assert_close(ratio, torch.ones(n), rtol=0, atol=1e-4)


def test_rollouts_are_reproducible_and_batch_independent(groups, tiny_models):
    request = request_for("boogu_image_base")
    split = groups["boogu_image_base"].generate(request)  # rows split across two workers
    engine = rollout.NativeEngine(os.path.join(tiny_models, "boogu_image_base"), max_batch_size=1)
    one_by_one = engine.generate(request)
    torch.testing.assert_close(split.latents_clean, one_by_one.latents_clean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(split.all_log_probs, one_by_one.all_log_probs, rtol=1e-4, atol=1e-4)
    assert split.window_starts == one_by_one.window_starts and len(split.window_starts) == 4
    # reordering the rows reorders the samples and nothing else
    order = [3, 1, 2, 0]
    shuffled = engine.generate(request.select(order))
    torch.testing.assert_close(shuffled.latents_clean, one_by_one.latents_clean[order], rtol=1e-4, atol=1e-4)
    # different seeds give different samples
    other = engine.generate(request_for("boogu_image_base", seeds=[1, 2, 3, 4]))
    assert not torch.allclose(other.latents_clean, one_by_one.latents_clean)


def test_ode_rollout_and_guidance_rules(groups):
    ode = groups["qwen_image"].generate(request_for("qwen_image", noise_level=0.0, return_log_probs=False,
                                                    sde_window_size=None, sde_window_range=None))
    assert ode.all_latents is None and ode.all_log_probs is None and ode.window_starts is None
    with pytest.raises(ValueError, match="needs negative prompts"):  # refused by the contract, before any worker
        groups["boogu_image_base"].generate(request_for("boogu_image_base", negative_prompts=None))


# ---------------------------------------------------------------------------------------------------------
# failures: a dead or hung worker stops the run with its stderr, and leaves no process behind
# ---------------------------------------------------------------------------------------------------------


def _generate_in_thread(group: RolloutGroup, request: RolloutRequest):
    outcome = {}

    def run():
        try:
            outcome["result"] = group.generate(request)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcome["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_killed_worker_gives_a_clear_error_and_no_orphan(tiny_models):
    group = RolloutGroup(os.path.join(tiny_models, "boogu_image_base"), ["cpu"], threads_per_worker=1, timeout_s=120)
    process = group.workers[0].process
    # Freeze the worker first so that it cannot answer before the kill, however fast the machine is
    # (a timed kill alone raced a fast CI machine, which finished the request within the sleep).
    os.kill(process.pid, signal.SIGSTOP)
    thread, outcome = _generate_in_thread(group, request_for("boogu_image_base"))
    time.sleep(1.0)  # the request is in the pipe (or the send is blocked on it): either way it is in flight
    os.kill(process.pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive() and "result" not in outcome
    assert isinstance(outcome.get("error"), RolloutError)
    assert re.search(r"died during generate|is gone", str(outcome["error"])), outcome["error"]
    assert "stderr tail" in str(outcome["error"])
    assert process.poll() is not None and group.workers == []


def test_hung_worker_times_out_and_is_killed(tiny_models):
    group = RolloutGroup(os.path.join(tiny_models, "boogu_image_base"), ["cpu"], threads_per_worker=1, timeout_s=3)
    process = group.workers[0].process
    os.kill(process.pid, signal.SIGSTOP)  # a hang: alive but silent
    with pytest.raises(RolloutError, match="did not answer within 3 s"):
        group.generate(request_for("boogu_image_base"))
    process.wait(timeout=30)  # close() killed it
    assert process.poll() is not None


def test_a_worker_that_stops_reading_fails_the_send_at_the_timeout(tiny_models):
    group = RolloutGroup(os.path.join(tiny_models, "boogu_image_base"), ["cpu"], threads_per_worker=1, timeout_s=3)
    process = group.workers[0].process
    os.kill(process.pid, signal.SIGSTOP)  # alive, but it reads nothing: a large request fills the pipe
    prompts = ["a sign that says " + "x" * (1 << 20)] * 2                 # 2 MiB of request
    start = time.monotonic()
    with pytest.raises(RolloutError, match="did not read generate within 3 s"):
        group.submit(request_for("boogu_image_base", n_per_prompt=1, prompts=prompts,
                                 seeds=[1, 2], negative_prompts=["", ""]))
    assert time.monotonic() - start < 30
    process.wait(timeout=30)  # close() killed it
    assert group.workers == []


def test_worker_that_cannot_load_reports_why(tmp_path):
    with pytest.raises(RolloutError, match="failed to start.*not a directory"):
        RolloutGroup(str(tmp_path / "missing"), ["cpu"], threads_per_worker=1, startup_timeout_s=120)


def test_result_cat_pads_prompt_embeddings():
    def part(length, n):
        return RolloutResult(images=torch.zeros(n, 3, 2, 2, dtype=torch.uint8), latents_clean=torch.zeros(n, 4),
                             prompt_embeds=torch.ones(n, length, 3), prompt_mask=torch.ones(n, length, dtype=torch.long),
                             seeds=list(range(n)), metadata={"family": "f"})

    joined = RolloutResult.cat([part(2, 1), part(5, 2)])
    assert joined.prompt_embeds.shape == (3, 5, 3)
    assert joined.prompt_mask.tolist()[0] == [1, 1, 0, 0, 0]
    assert joined.prompt_embeds[0, 2:].abs().sum() == 0


# ---------------------------------------------------------------------------------------------------------
# LoRA delivery (kept last: it leaves an adapter loaded in the shared Qwen-Image group)
# ---------------------------------------------------------------------------------------------------------


def test_nonzero_lora_reaches_the_workers_and_unbindable_adapters_fail(groups, tiny_models, tmp_path):
    """An adapter with non-zero B (zero-init B would hide a binding bug) exported under vllm-omni names reaches the
    worker, binds exactly as many modules as the actor has, and changes the samples measurably; the rollout then
    equals the in-process actor with the same adapter. A file with an unbindable tensor is refused loudly."""
    from safetensors.torch import load_file, save_file

    from models import lora

    path = os.path.join(tiny_models, "qwen_image")
    group = groups["qwen_image"]
    actor = load_model(path)
    n_modules = lora.add_lora(actor, rank=4, alpha=8)
    g = torch.Generator().manual_seed(0)
    for layer in lora.lora_layers(actor.transformer, "default").values():
        weight = layer.lora_B["default"].weight
        weight.data.copy_(torch.randn(weight.shape, generator=g) * 0.5)
    adapter_dir = str(tmp_path / "adapter-v1")
    lora.export_adapter(actor.transformer, adapter_dir, engine_names=True)

    request = request_for("qwen_image", noise_level=0.0, return_log_probs=False, return_trajectory=False,
                          sde_window_size=None, sde_window_range=None)
    base = group.generate(request)
    assert group.load_adapter(adapter_dir, "v1") == [n_modules] * group.num_workers
    tuned = group.generate(request)
    assert tuned.metadata["adapter_version"] == "v1" and tuned.metadata["bound_modules"] == n_modules
    assert (tuned.images.float() - base.images.float()).abs().mean() > 1.0
    local = rollout.NativeEngine.__new__(rollout.NativeEngine)  # the actor itself as an engine, no reload
    local.model, local.device, local.max_batch_size = actor, torch.device("cpu"), 8
    local.adapter_version, local.bound_modules = "v1", n_modules
    torch.testing.assert_close(local.generate(request).latents_clean, tuned.latents_clean, rtol=1e-4, atol=1e-4)

    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    key = next(iter(tensors))
    tensors[key.replace("transformer_blocks.0.", "transformer_blocks.99.")] = tensors[key].clone()
    save_file(tensors, os.path.join(adapter_dir, "adapter_model.safetensors"))
    with pytest.raises(RolloutError, match="bind to no LoRA module"):
        group.load_adapter(adapter_dir, "v2")


# ---------------------------------------------------------------------------------------------------------
# the wire protocol: plain data only, the handshake, --rollout_python
# ---------------------------------------------------------------------------------------------------------


def _raw_frame(message) -> bytes:
    """A frame as a peer that skipped `check_plain` would write it (plain torch.save, any pickle)."""
    import io

    buffer = io.BytesIO()
    torch.save(message, buffer)
    payload = buffer.getvalue()
    return protocol._HEADER.pack(protocol._MAGIC, len(payload)) + payload


def _not_plain_values():
    import collections

    import numpy as np

    return {  # name -> value; the first three are refused by weights_only itself, the rest by check_plain
        "numpy array": np.zeros(3), "numpy scalar": np.float64(1.0), "dataclass": request_for("qwen_image", 1),
        "OrderedDict": collections.OrderedDict(a=1), "torch.Size": torch.Size([2]), "dtype": torch.float32,
        "Parameter": torch.nn.Parameter(torch.zeros(2)), "int key": {1: 2}, "device": torch.device("cpu"),
    }


@pytest.mark.parametrize("name", list(_not_plain_values()))
def test_a_message_that_is_not_plain_data_is_refused_on_receive_and_on_send(name):
    import io

    value = _not_plain_values()[name]
    stream = io.BytesIO(_raw_frame({"op": "generate", "request": {"seeds": [1], "bad": value}})
                        + _raw_frame({"op": "next"}))
    with pytest.raises(protocol.ProtocolError, match="refused a message|cannot cross|keys must be str"):
        protocol.recv_message(stream)
    assert protocol.recv_message(stream) == {"op": "next"}  # the refused frame was consumed whole: still in step
    out = io.BytesIO()
    with pytest.raises(protocol.ProtocolError):
        protocol.send_message(out, {"op": "x", "payload": [value]})
    assert out.getvalue() == b""  # refused before a byte was written


def test_plain_message_kinds_round_trip_and_bad_frames_break_the_channel():
    import io

    message = {"none": None, "flag": True, "n": 3, "x": 0.5, "s": "é", "pair": (1, 2), "rows": [[1], []],
               "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "u8": torch.zeros(3, 2, 2, dtype=torch.uint8)}
    buffer = io.BytesIO()
    protocol.send_message(buffer, message)
    got = protocol.recv_message(io.BytesIO(buffer.getvalue()))
    assert got.keys() == message.keys() and got["pair"] == (1, 2) and got["t"].dtype == torch.bfloat16
    assert torch.equal(got["t"], message["t"]) and type(got["n"]) is int and type(got["flag"]) is bool
    with pytest.raises(protocol.ChannelBroken, match="not a rollout-channel frame"):
        protocol.recv_message(io.BytesIO(b"INFO vllm says hello\n" + buffer.getvalue()))


def test_request_and_result_dicts_are_plain():
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    array = torch.randint(0, 256, (SIZE, SIZE, 3), generator=g, dtype=torch.uint8)
    pil = Image.fromarray(array.numpy())
    request = edit_request(images=[pil, pil.convert("RGBA"), None, array.permute(2, 0, 1)])
    data = request.to_dict()
    protocol.check_plain(data)
    assert all(torch.equal(im, array.permute(2, 0, 1)) for im in data["images"][:2] + data["images"][3:])
    assert data["images"][2] is None and request.images[0] is pil  # the request itself is unchanged
    assert RolloutRequest.from_dict(data).prompts == request.prompts
    result = RolloutResult(images=torch.zeros(1, 3, 2, 2, dtype=torch.uint8), latents_clean=torch.zeros(1, 4),
                           prompt_embeds=torch.zeros(1, 2, 3), prompt_mask=torch.ones(1, 2, dtype=torch.long),
                           seeds=[5], metadata={"sigmas": torch.ones(3), "family": "qwen_image"})
    protocol.check_plain(result.to_dict())
    assert RolloutResult.from_dict(result.to_dict()).seeds == [5]
    with pytest.raises(ValueError, match="unknown rollout result keys"):
        RolloutResult.from_dict(dict(result.to_dict(), extra=1))


def test_handshake_error_names_both_sides():
    ours = protocol.peer_info()
    assert ours["protocol"] == protocol.PROTOCOL_VERSION and type(ours["torch"]) is str
    assert protocol.handshake_error(ours, dict(ours, op="hello"), peer="the worker") is None
    theirs = dict(ours, op="hello", protocol=ours["protocol"] + 1, torch="2.13.0", executable="/envs/omni/bin/python")
    problem = protocol.handshake_error(ours, theirs, peer="the worker")
    assert f"rollout protocol {ours['protocol'] + 1} (python {ours['python']}, torch 2.13.0, /envs/omni/bin/python)" \
        in problem and f"rollout protocol {ours['protocol']} (python {ours['python']}, torch {ours['torch']}" in problem
    assert "older or foreign" in protocol.handshake_error(ours, {"ok": True, "ready": True}, peer="the worker")


def _python_wrapper(tmp_path, body: str) -> str:
    """An executable standing in for --rollout_python: it runs `body` (Python) with this interpreter, argv intact."""
    import sys

    script = tmp_path / "fake_worker.py"
    script.write_text(body)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_trainer_refuses_a_worker_that_speaks_another_protocol(tmp_path):
    python = _python_wrapper(tmp_path, "import sys\nfrom engines import protocol, worker\n"
                                       "protocol.PROTOCOL_VERSION = 99\nworker.worker_main(sys.argv[2:])\n")
    start = time.monotonic()
    with pytest.raises(RolloutError, match=rf"speaks rollout protocol 99 .*this side speaks rollout protocol "
                                           rf"{protocol.PROTOCOL_VERSION} .*--rollout_python {re.escape(python)}"):
        RolloutGroup(str(tmp_path / "never-loaded"), ["cpu"], threads_per_worker=1, startup_timeout_s=120,
                     python=python)
    assert time.monotonic() - start < 60  # refused at the handshake, before any model load


def test_worker_refuses_a_trainer_that_speaks_another_protocol(tmp_path):
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, rollout.__file__, "--worker", "--model-path", str(tmp_path)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               env=worker.worker_process_env())
    try:
        hello = protocol.recv_message(process.stdout)
        assert hello["op"] == "hello" and hello["protocol"] == protocol.PROTOCOL_VERSION
        protocol.send_message(process.stdin, dict(protocol.peer_info(), op="hello", protocol=0, torch="1.0"))
        reply = protocol.recv_message(process.stdout)
        assert reply["ok"] is False
        assert "the trainer speaks rollout protocol 0 (python" in reply["error"] and "torch 1.0" in reply["error"]
        assert process.wait(timeout=60) == 0  # exits without loading the model
    finally:
        process.kill()


def test_a_worker_reply_that_is_not_plain_is_refused(tmp_path):
    body = ("import io, sys, numpy, torch\nfrom engines import protocol, worker\n"
            "out = worker._private_stdout()\n"
            "protocol.send_message(out, dict(protocol.peer_info(), op='hello'))\n"
            "protocol.recv_message(sys.stdin.buffer)\n"
            "buffer = io.BytesIO(); torch.save({'ok': True, 'ready': numpy.ones(2)}, buffer)\n"
            "out.write(protocol._HEADER.pack(protocol._MAGIC, len(buffer.getvalue())) + buffer.getvalue())\n"
            "out.flush()\n"
            "sys.stdin.buffer.read()\n")
    with pytest.raises(RolloutError, match="refused during start-up: refused a message .*numpy"):
        RolloutGroup(str(tmp_path), ["cpu"], startup_timeout_s=120, python=_python_wrapper(tmp_path, body))


def test_check_rollout_python_errors_name_the_flag_and_the_fix(tmp_path):
    import subprocess
    import sys

    with pytest.raises(rollout.RolloutEnvError, match=r"--rollout_python /no/such/python: no such file; pass the "
                                                      r"bin/python of an environment"):
        rollout.check_rollout_python("/no/such/python", "native")
    text = tmp_path / "not-executable"
    text.write_text("")
    with pytest.raises(rollout.RolloutEnvError, match="is not executable"):
        rollout.check_rollout_python(str(text), "native")
    # an interpreter without torch: a bare venv of this Python
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    with pytest.raises(rollout.RolloutEnvError, match=r"(?s)--rollout_python .*bare/bin/python cannot run the native "
                                                      r"rollout engine.*No module named 'torch'.*requirements.txt"):
        rollout.check_rollout_python(str(tmp_path / "bare" / "bin" / "python"), "native")
    # this environment has no vllm-omni: the engine's import fails in the probe, named
    with pytest.raises(rollout.RolloutEnvError, match=r"(?s)cannot run the vllm_omni rollout engine.*vllm-omni 0\.30"):
        rollout.check_rollout_python(_python_wrapper(tmp_path, "import runpy, sys\nsys.argv = sys.argv[1:]\n"
                                                               "runpy.run_path(sys.argv[0], run_name='__main__')\n"),
                                     "vllm_omni")


def test_check_rollout_python_reports_the_interpreter_and_its_versions(tmp_path):
    python = _python_wrapper(tmp_path, "import runpy, sys\nsys.argv = sys.argv[1:]\n"
                                       "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    probed = rollout.check_rollout_python(python, "native")  # through the subprocess probe
    in_process = rollout.check_rollout_python(None, "native")
    for info in (probed, in_process):
        assert info == dict(protocol.peer_info(), engine="native")
        assert info["torch"] == torch.__version__ and info["diffusers"] != "not installed"


@pytest.mark.slow  # the real trainer CLI (start-up and imports, ~20 s on 2 cores)
def test_trainer_stops_on_a_bad_rollout_python_before_loading_the_model(tiny_models, tmp_path):
    """train_dppo.py with --rollout_python pointing nowhere fails at start-up naming the flag. The model folder keeps
    its configs but has no weights, so a run that reached the model load would fail with another error."""
    import shutil
    import subprocess
    import sys

    from data_prep.make_demo_data import make_demo_data

    model = tmp_path / "qwen_image"
    shutil.copytree(os.path.join(tiny_models, "qwen_image"), model, ignore=shutil.ignore_patterns("*.safetensors"))
    make_demo_data(tmp_path / "data", model="qwen_image")
    repo = os.path.dirname(os.path.abspath(rollout.__file__))
    command = [sys.executable, os.path.join(repo, "train_dppo.py"), "--device", "cpu", "--rollout_devices", "cpu",
               "--model_path", str(model), "--train_files", str(tmp_path / "data" / "train.parquet"),
               "--resume", "never", "--output_dir", str(tmp_path / "out"), "--rollout_python", "/no/such/python"]
    proc = subprocess.run(command, cwd=repo, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "RolloutEnvError: --rollout_python /no/such/python: no such file" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "out" / "run_metadata.json").exists()  # checked before anything of the run is written
