"""training/optim.py: the AdamW over the "default" adapter, grad-norm clipping on DTensor grads, the skipped and
undone steps (non-finite loss, gradient or update), the `old` adapter copy / EMA refresh and `adapters_equal`."""

from __future__ import annotations

import json
import math

import pytest
import torch

import training as T
from training.model import adapter_params, full_tensor
from training.optim import GradStepper, build_optimizer, ema_adapter_
from models import lora
from _training_helpers import full_params, make_model

pytestmark = pytest.mark.usefixtures("one_process_group")  # a 1-process gloo group (tests/conftest.py)


# ---------------------------------------------------------------------------------------------------------------
# optimizer, grad clipping, non-finite skip, old adapter
# ---------------------------------------------------------------------------------------------------------------


def test_optimizer_covers_default_adapter_only():
    model, _ = make_model()
    opt = build_optimizer(model, lr=1e-3, weight_decay=1e-4)
    opt_params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert opt_params == {id(p) for _, p in adapter_params(model, "default")}
    assert opt.param_groups[0]["weight_decay"] == 1e-4 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    assert not opt.defaults["fused"]  # CPU; fused=True is chosen for CUDA params



def test_non_finite_grad_norm_skips_step():
    model, _ = make_model()
    opt = build_optimizer(model, lr=1e-2)
    stepper = GradStepper(max_grad_norm=1.0)
    before = full_params(model, "default")
    x = torch.randn(2, 5, 4)
    x[0, 0, 0] = float("nan")
    model(x).pow(2).mean().backward()
    m = stepper.step(opt)
    assert m["actor/step_skipped"] == 1.0 and math.isnan(m["actor/grad_norm"])
    assert stepper.counters() == {"actor/skipped_steps": 1.0, "actor/consecutive_skips": 1.0}
    after = full_params(model, "default")
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update
    assert not opt.state  # the optimizer never stepped
    assert all(p.grad is None for _, p in adapter_params(model, "default"))  # grads dropped
    model(torch.randn(2, 5, 4)).pow(2).mean().backward()
    m = stepper.step(opt)
    assert m["actor/step_skipped"] == 0.0 and math.isfinite(m["actor/grad_norm"])
    assert stepper.counters() == {"actor/skipped_steps": 1.0, "actor/consecutive_skips": 0.0}
    assert any(not torch.equal(before[k], v) for k, v in full_params(model, "default").items())
    assert stepper.state_dict()["skipped_steps"] == 1



def test_grad_norm_clipping_with_dtensor_grads():
    model, _ = make_model()
    params = [p for _, p in adapter_params(model, "default")]
    opt = torch.optim.SGD(params, lr=1.0)  # SGD with lr 1: the update IS the clipped gradient
    model(torch.randn(2, 5, 4)).pow(2).mean().backward()
    expected_norm = math.sqrt(sum(float(full_tensor(p.grad).double().pow(2).sum()) for p in params))
    before = {n: full_tensor(p.detach()).clone() for n, p in adapter_params(model, "default")}
    m = GradStepper(max_grad_norm=1e-3).step(opt)
    assert m["actor/grad_norm"] == pytest.approx(expected_norm, rel=1e-6) and expected_norm > 1e-3
    update = math.sqrt(sum(float((full_tensor(p.detach()) - before[n]).double().pow(2).sum())
                           for n, p in adapter_params(model, "default")))
    assert update == pytest.approx(1e-3, rel=1e-4)



@pytest.mark.parametrize("shard", [False, True])
def test_old_adapter_copy_and_ema(shard):
    model, _ = make_model(shard=shard)
    d0, o0 = full_params(model, "default"), full_params(model, "old")
    assert any(not torch.equal(d0[k], o0[k]) for k in d0)
    ema_adapter_(model, 0.25)
    o1 = full_params(model, "old")
    for k in d0:
        torch.testing.assert_close(o1[k], 0.25 * o0[k] + 0.75 * d0[k], rtol=0, atol=1e-7)
    assert all(torch.equal(d0[k], v) for k, v in full_params(model, "default").items())  # source untouched
    lora.copy_adapter_(model, "default", "old")
    o2 = full_params(model, "old")
    assert all(torch.equal(d0[k], o2[k]) for k in d0)



def test_adapters_equal_is_exact_and_names_a_missing_adapter():
    """`adapters_equal` (NFT's --old_from_update test): True only when every LoRA tensor of both adapters is bit
    for bit the same; one element one ulp away, or a NaN in both, is unequal."""
    model, _ = make_model()
    assert not T.adapters_equal(model)  # make_model gives `old` its own random values
    lora.copy_adapter_(model, "default", "old")
    assert T.adapters_equal(model) and T.adapters_equal(model, "old", "default")
    layer = next(iter(lora.lora_layers(model, "old").values()))
    weight = layer.lora_B["old"].weight
    with torch.no_grad():
        weight.view(-1)[-1] = torch.nextafter(weight.view(-1)[-1], torch.tensor(math.inf))
    assert not T.adapters_equal(model)
    lora.copy_adapter_(model, "default", "old")
    with torch.no_grad():
        layer.lora_A["old"].weight.view(-1)[0] = math.nan
        layer.lora_A["default"].weight.view(-1)[0] = math.nan
    assert not T.adapters_equal(model)
    with pytest.raises(ValueError, match="'missing' is missing"):
        T.adapters_equal(model, "default", "missing")



def test_old_policy_refresh_follows_schedule():
    model, _ = make_model()
    d0, o0 = full_params(model, "default"), full_params(model, "old")
    zeros = {"old_policy/update_applied": 0.0, "old_policy/copy_update": 0.0, "old_policy/ema_update": 0.0,
             "old_policy/decay": 0.0}
    # not due (interval 2, step 1): nothing changes, all metrics 0
    assert T.old_policy_refresh(model, 1, interval=2, schedule="delayed_linear_to_0_999") == zeros
    assert all(torch.equal(o0[k], v) for k, v in full_params(model, "old").items())
    # step 76 of delayed_linear_to_0_999: EMA with d = 0.0075
    m = T.old_policy_refresh(model, 76, interval=2, schedule="delayed_linear_to_0_999")
    assert m == {"old_policy/update_applied": 1.0, "old_policy/copy_update": 0.0, "old_policy/ema_update": 1.0,
                 "old_policy/decay": pytest.approx(0.0075)}
    o1 = full_params(model, "old")
    for k in d0:
        torch.testing.assert_close(o1[k], 0.0075 * o0[k] + 0.9925 * d0[k], rtol=0, atol=1e-7)
    # step 74 (still warm-up): hard copy
    m = T.old_policy_refresh(model, 74, interval=2, schedule="delayed_linear_to_0_999")
    assert m["old_policy/copy_update"] == 1.0 and m["old_policy/decay"] == 0.0
    assert all(torch.equal(d0[k], v) for k, v in full_params(model, "old").items())
    # an explicit decay overrides the schedule
    assert T.old_policy_refresh(model, 3, decay=0.25)["old_policy/decay"] == 0.25
    with pytest.raises(ValueError, match="interval"):
        T.old_policy_refresh(model, 3, interval=0)


# ---------------------------------------------------------------------------------------------------------------
# reliability: a non-finite loss, gradient or update skips the step on every rank and undoes it
# ---------------------------------------------------------------------------------------------------------------


def test_nonfinite_loss_gradient_or_update_skips_the_step_and_undoes_it():
    import losses

    model, _ = make_model()
    opt = build_optimizer(model, lr=1e-2)
    stepper = GradStepper(max_grad_norm=1.0)
    x = torch.randn(2, 5, 4)
    model(x).pow(2).mean().backward()
    assert stepper.step(opt)["actor/step_skipped"] == 0.0  # AdamW state exists from here on

    def snapshot():
        state = {n: {k: full_tensor(v).clone() for k, v in opt.state[p].items()} for n, p in adapter_params(model)}
        return full_params(model, "default"), state

    def unchanged(before):
        params, state = snapshot()
        return (all(torch.equal(params[k], before[0][k]) for k in params)
                and all(torch.equal(state[n][k], before[1][n][k]) for n in state for k in state[n]))

    before = snapshot()
    # 1. a non-finite loss: returned as is with its metrics, back-propagated, the step skipped
    v = model(x)
    finite_keys = set(losses.diffusion_nft_loss(v, v.detach(), x, x, torch.full((2,), 0.5), torch.full((2,), 0.5),
                                                mix_beta=0.1, adv_clip_max=1.0)[1])
    loss, metrics = losses.diffusion_nft_loss(v, v.detach() * float("nan"), x, x, torch.full((2,), 0.5),
                                              torch.full((2,), 0.5), mix_beta=0.1, adv_clip_max=1.0)
    assert not math.isfinite(loss.item()) and set(metrics) == finite_keys
    stepper.backward(loss)
    m = stepper.step(opt)
    assert m["actor/step_skipped"] == 1.0 and stepper.counters()["actor/consecutive_skips"] == 1.0
    assert stepper.last_skip_reason == "non-finite loss"
    assert unchanged(before)
    # a NaN loss whose gradient is finite (a NaN constant term) is caught too: by the loss, not the grad norm
    other = GradStepper(max_grad_norm=1.0)
    other.backward(model(x).pow(2).mean() + float("nan"))
    m = other.step(opt)
    assert m["actor/step_skipped"] == 1.0 and math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
    assert other.last_skip_reason == "non-finite loss" and unchanged(before)
    # a bad argument is still an error (never taken for a non-finite loss)
    with pytest.raises(ValueError, match="mix_beta"):
        losses.diffusion_nft_loss(v, v, x, x, torch.full((2,), 0.5), torch.full((2,), 0.5), mix_beta=0.0,
                                  adv_clip_max=1.0)
    # 2. finite loss and gradient, but the update makes the weights non-finite (lr = inf): undone exactly
    opt.param_groups[0]["lr"] = float("inf")
    model(x).pow(2).mean().backward()
    m = stepper.step(opt)
    assert m["actor/step_skipped"] == 1.0 and "undone" in stepper.last_skip_reason
    assert unchanged(before) and stepper.consecutive_skips == 2
    # 3. an applied step ends the streak; the counters ride in the checkpoint's trainer state
    opt.param_groups[0]["lr"] = 1e-2
    model(x).pow(2).mean().backward()
    assert stepper.step(opt)["actor/step_skipped"] == 0.0 and not unchanged(before)
    restored = GradStepper()
    restored.load_state_dict(json.loads(json.dumps(stepper.state_dict())))
    assert (restored.skipped_steps, restored.consecutive_skips, restored.applied_steps) == (2, 0, 2)
    # 4. the very first update undone: the optimizer is back to "never stepped"
    fresh_opt = build_optimizer(model, lr=float("inf"))
    model(x).pow(2).mean().backward()
    assert GradStepper().step(fresh_opt)["actor/step_skipped"] == 1.0 and not fresh_opt.state
