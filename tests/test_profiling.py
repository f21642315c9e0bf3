"""`training.profiling`: the per-phase profile table (`profile_table`) on hand-made trace events with known
answers, and on the trace of a tiny CPU loop recorded by `engines.profiler.step_profiler` (CPU activities only), whose
phases hold a known number of matmuls, `.item()` reads and a sleep; `attention_backend`'s math path."""

from __future__ import annotations

import time

import pytest
import torch

import training as T
from training.profiling import ProfileWindow, format_profile_table
from engines.profiler import load_trace, step_profiler
from training.profiling import profile_table


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1, pid: int = 1) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def test_table_of_hand_made_events():
    """Busy = the union of overlapping kernels on two streams, idle and the longest gap inside each window, host
    reads and syncs counted where they start, kernel totals and shares per phase."""
    events = [
        _x("ProfilerStep#2", "user_annotation", 0, 120), _x("timing_s/update_actor", "user_annotation", 0, 100),
        _x("gemm", "kernel", 10, 20, tid=7, pid=0), _x("attn", "kernel", 25, 15, tid=8, pid=0),
        _x("gemm", "kernel", 60, 10, tid=7, pid=0), _x("Memcpy DtoH", "gpu_memcpy", 110, 5, tid=7, pid=0),
        _x("aten::_local_scalar_dense", "cpu_op", 79, 1), _x("cudaStreamSynchronize", "cuda_runtime", 80, 2),
        {"ph": "i", "name": "marker", "ts": 5},  # not a span: ignored
    ]
    table = profile_table(events, device="cuda", top=5)
    rows = {r.phase: r for r in table.phases}
    assert [r.phase for r in table.phases] == ["step", "update_actor"]
    up = rows["update_actor"]
    assert (up.wall_ms, up.busy_ms, up.idle_ms, up.longest_idle_ms) == (0.1, 0.04, 0.06, 0.03)
    assert (up.device_events, up.host_reads, up.syncs) == (3, 1, 1)
    step = rows["step"]
    assert (step.busy_ms, step.longest_idle_ms, step.device_events) == pytest.approx((0.045, 0.04, 4))
    kernels = [(k.name, k.total_ms, k.count, k.share) for k in table.kernels if k.phase == "update_actor"]
    assert kernels == [("gemm", 0.03, 2, 0.75), ("attn", 0.015, 1, 0.375)]
    with pytest.raises(ValueError, match="no phase annotations"):
        profile_table([e for e in events if e.get("cat") != "user_annotation"])
    with pytest.raises(ValueError, match="no cpu device events"):
        profile_table([e for e in events if e.get("cat") == "user_annotation"], device="cpu")


def test_cpu_self_times_subtract_nested_ops():
    events = [_x("timing_s/x", "user_annotation", 0, 100), _x("A", "cpu_op", 0, 100), _x("B", "cpu_op", 10, 20),
              _x("C", "cpu_op", 40, 10), _x("D", "cpu_op", 42, 3), _x("E", "cpu_op", 42, 3, tid=2)]
    table = profile_table(events, device="cpu")
    assert [(k.name, k.total_ms) for k in table.kernels] == [("A", 0.07), ("B", 0.02), ("C", 0.007), ("D", 0.003),
                                                               ("E", 0.003)]
    assert table.phases[0].busy_ms == 0.1 and table.phases[0].idle_ms == 0.0


def test_table_of_a_tiny_cpu_run(tmp_path):
    """Three iterations of a loop, the third profiled (the second is the profiler's warm-up): its phases hold 5
    matmuls, 7 `.item()` reads and a 40 ms sleep, and the table must say exactly that of one iteration."""
    path = str(tmp_path / "trace.json.gz")
    a, b = torch.randn(192, 192), torch.randn(192, 192)
    profiler = step_profiler(path, step=3, first_step=1, cuda=False)
    with profiler:
        for _ in range(3):
            timings: dict[str, float] = {}
            with T.timer("matmuls", timings):
                c = a
                for _ in range(5):
                    c = torch.mm(c, b) / 192
            with T.timer("reads", timings):
                total = sum(float(c[i, 0].item()) for i in range(7))
            with T.timer("sleep", timings):
                time.sleep(0.04)
            profiler.step()
    assert total == total
    table = profile_table(load_trace(path), device="cpu")
    rows = {r.phase: r for r in table.phases}
    assert [r.phase for r in table.phases] == ["step", "matmuls", "reads", "sleep"]
    assert rows["reads"].host_reads == 7 and rows["matmuls"].host_reads == 0 and rows["step"].host_reads == 7
    assert rows["sleep"].idle_ms >= 36 and rows["sleep"].busy_ms < 2 and rows["sleep"].longest_idle_ms >= 36
    assert rows["step"].wall_ms >= sum(rows[p].wall_ms for p in ("matmuls", "reads", "sleep"))
    top = [k for k in table.kernels if k.phase == "matmuls"][0]
    assert (top.name, top.count) == ("aten::mm", 5) and top.share > 0.5
    assert all(0 <= r.idle_ms <= r.wall_ms for r in table.phases)
    text = format_profile_table(table)
    assert "top CPU op (self time)s in matmuls:" in text and "aten::mm" in text


def test_memory_copies_counted_per_phase_with_what_issued_them():
    """Each copy is linked to its runtime call by `correlation`, and the call to the innermost annotation and CPU op
    of its thread: block numbers fold to N, so the same code in every block is one source; copies are counted per
    phase; a copy whose call lies in no op is attributed to '-'."""
    def runtime(ts, corr, tid=1):
        return {**_x("cudaMemcpyAsync", "cuda_runtime", ts, 1, tid=tid), "args": {"correlation": corr}}

    def copy(ts, corr):
        return {**_x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", ts, 2, tid=7, pid=0),
                "args": {"correlation": corr}}

    events = [
        _x("timing_s/profiled_step", "user_annotation", 0, 200),
        _x("timing_s/update_window", "user_annotation", 50, 150),
        _x("FSDP::pre_forward (transformer_blocks.3)", "user_annotation", 60, 30), _x("aten::copy_", "cpu_op", 62, 5),
        runtime(63, 1), _x("aten::copy_", "cpu_op", 70, 5), runtime(71, 2),
        _x("FSDP::pre_forward (transformer_blocks.12)", "user_annotation", 100, 30),
        _x("aten::copy_", "cpu_op", 101, 5),
        runtime(102, 3), runtime(140, 4),
        _x("aten::mm", "cpu_op", 10, 5), runtime(12, 5),
        copy(64, 1), copy(72, 2), copy(103, 3), copy(141, 4), copy(20, 5), _x("gemm", "kernel", 30, 10, tid=7, pid=0),
    ]
    table = profile_table(events, device="cuda")
    rows = {r.phase: r for r in table.phases}
    assert [r.phase for r in table.phases] == ["step", "update_window"]
    assert (rows["step"].memcpys, rows["update_window"].memcpys) == (5, 4)
    cut = profile_table(events + [_x("timing_s/update_actor", "user_annotation", 40, 400)], device="cuda")
    assert {r.phase: r.wall_ms for r in cut.phases}["update_actor (cut)"] == 0.16  # open when the window stopped
    assert (rows["step"].device_events, rows["update_window"].device_events) == (6, 4)
    window = [(r.annotation, r.op, r.count) for r in table.memcpy_launchers if r.phase == "update_window"]
    assert window == [("FSDP::pre_forward (transformer_blocks.N)", "aten::copy_", 3),
                      ("timing_s/update_window", "-", 1)]
    step = [(r.annotation, r.op, r.count) for r in table.memcpy_launchers if r.phase == "step"]
    assert ("timing_s/profiled_step", "aten::mm", 1) in step
    text = format_profile_table(table)
    assert "memory copies in update_window issued by" in text and "3x  FSDP::pre_forward (transformer_blocks.N)" in text


def test_profile_window_records_its_micro_steps_and_stops(tmp_path):
    """The window records from `start` to the (K + 1)-th tick: its `update_window` phase holds exactly the K
    micro-steps after the first tick (one matmul each), work after it is not recorded, and ticks after the stop or
    outside a recording do nothing; K = 0 records until `stop`."""
    a = torch.randn(64, 64)
    path = str(tmp_path / "trainer.json.gz")
    window = ProfileWindow(path, micro_steps=3, cuda=False)
    window.tick()  # not recording: ignored
    assert not window.recording
    window.start()
    torch.mm(a, a)  # before the first loss (the rollout wait, the first forwards)
    for _ in range(6):
        window.tick()
        torch.mm(a, a)
    assert not window.recording and window.ticks == 4
    window.stop()  # idempotent
    table = profile_table(load_trace(path), device="cpu")
    rows = {r.phase: r for r in table.phases}
    assert set(rows) == {"step", "update_window"}
    counts = {(k.phase, k.name): k.count for k in table.kernels}
    assert counts[("update_window", "aten::mm")] == 3 and counts[("step", "aten::mm")] == 4
    whole = ProfileWindow(str(tmp_path / "whole.json.gz"), micro_steps=0, cuda=False)
    whole.start()
    for _ in range(5):
        whole.tick()
        torch.mm(a, a)
    assert whole.recording
    whole.stop()
    table = profile_table(load_trace(str(tmp_path / "whole.json.gz")), device="cpu")
    assert [(k.phase, k.name, k.count) for k in table.kernels if k.name == "aten::mm"] == [("step", "aten::mm", 5)]
    with pytest.raises(ValueError, match="profile_micro_steps"):
        ProfileWindow(path, micro_steps=-1, cuda=False)


def test_attention_backend_math_keeps_the_numbers():
    """'auto' is no context at all (the path without the flag); 'math' gives exactly the math kernel's result,
    which differs from the CPU flash kernel auto picks by rounding only; a backend the device lacks raises."""
    import torch.nn.functional as F

    from models.base import attention_backend

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16) for _ in range(3))
    plain = F.scaled_dot_product_attention(q, k, v)
    with attention_backend("auto"):
        assert torch.equal(F.scaled_dot_product_attention(q, k, v), plain)
    with attention_backend("math"):
        math_out = F.scaled_dot_product_attention(q, k, v)
    reference = torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0]
    assert torch.equal(math_out, reference)
    torch.testing.assert_close(math_out, plain, rtol=1e-5, atol=1e-6)
    with attention_backend("cudnn"), pytest.raises(RuntimeError, match="(?i)no (available kernel|viable backend)"):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="attention backend"):
        attention_backend("fastest")


@pytest.mark.parametrize("name", ["qwen_image", "boogu_image_base"])
def test_attention_backend_governs_both_families(tiny_models, name):
    """Both families' attention goes through SDPA, so the flag reaches it: under 'math' a velocity equals the one
    with the flag unset within float rounding (CPU's 'auto' picks its flash kernel), and under a backend the CPU
    lacks the forward raises instead of falling back."""
    import os

    from models import load_model
    from models.base import attention_backend

    model = load_model(os.path.join(tiny_models, name))
    torch.manual_seed(0)
    prompt = model.encode_prompt(["a red square"])
    x = model.prepare_noise(32, 32, [torch.Generator().manual_seed(1)])
    sigma = torch.tensor([0.7])
    with torch.no_grad():
        plain = model.predict_velocity(x, sigma, prompt)
        with attention_backend("math"):
            math_v = model.predict_velocity(x, sigma, prompt)
        torch.testing.assert_close(math_v, plain, rtol=1e-4, atol=1e-5)
        with attention_backend("cudnn"), pytest.raises(RuntimeError, match="(?i)no (available kernel|viable backend)"):
            model.predict_velocity(x, sigma, prompt)
