"""Tests of losses.py against values derived independently: by hand, with float64 element loops, or with
diffusers' scheduler. Each property here is one that silently breaks RL when wrong."""

import math

import numpy as np
import pytest
import torch

import losses

torch.set_num_threads(1)
F64 = torch.float64


def qwen_mu(tokens: int) -> float:
    return losses.time_shift_mu(tokens, base_seq_len=256, max_seq_len=8192, base_shift=0.5, max_shift=0.9)


# ---------------------------------------------------------------------------------------------------------
# schedules
# ---------------------------------------------------------------------------------------------------------


def test_time_shift_mu_by_hand():
    # 512²: (512/16)² = 1024 tokens -> 0.5 + 0.4 * 768/7936; 1024²: 4096 tokens -> 0.5 + 0.4 * 3840/7936
    assert qwen_mu(1024) == pytest.approx(0.5 + 0.4 * 768 / 7936, rel=1e-14)
    assert qwen_mu(1024) == pytest.approx(0.5387097, abs=1e-7)
    assert qwen_mu(4096) == pytest.approx(0.6935484, abs=1e-7)
    assert qwen_mu(256) == pytest.approx(0.5, abs=1e-15)
    assert qwen_mu(8192) == pytest.approx(0.9, abs=1e-15)
    with pytest.raises(ValueError, match="image_seq_len"):
        qwen_mu(0)


def test_qwen_512_schedule_matches_the_spec_table():
    sigmas = losses.flow_sigmas(10, mu=qwen_mu(1024), shift_terminal=0.02)
    timesteps = sigmas[:-1] * 1000
    table = [1000.0, 928.9696, 851.4848, 766.6238, 673.2809, 570.1172, 455.4973, 327.4001, 183.3005, 20.0]
    assert sigmas.dtype == torch.float32 and sigmas.shape == (11,)
    assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
    torch.testing.assert_close(timesteps, torch.tensor(table), rtol=0, atol=1e-4)
    assert sigmas[-2].item() == pytest.approx(0.02, abs=1e-7)  # the terminal stretch ends at shift_terminal


def test_boogu_static_v1_schedule_matches_the_spec_and_the_native_boogu_formula():
    sigmas = losses.flow_sigmas(10, mu=1.15)
    table = [1, 0.966014, 0.926647, 0.880513, 0.825702, 0.759511, 0.677987, 0.575103, 0.441200, 0.259758, 0]
    torch.testing.assert_close(sigmas, torch.tensor(table), rtol=0, atol=1e-6)
    # Boogu's own v1 logistic shift, in its own time t (0 = noise): t' = 1 - e^mu / (e^mu + 1/(1-t) - 1),
    # on t = linspace(0, 1, N+1)[:-1], terminal t = 1 appended; sigma = 1 - t'.
    for n in (4, 10, 40):
        t = np.linspace(0.0, 1.0, n + 1)[:-1]
        shifted = 1 - math.exp(1.15) / (math.exp(1.15) + (1 / (1 - t) - 1))
        native_sigmas = np.concatenate([1 - shifted, [0.0]])
        np.testing.assert_allclose(losses.flow_sigmas(n, mu=1.15).numpy(), native_sigmas, rtol=0, atol=2e-7)


def test_flow_sigmas_float64_formula_and_bit_identity_with_diffusers():
    from diffusers import FlowMatchEulerDiscreteScheduler

    qwen = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, use_dynamic_shifting=True, time_shift_type="exponential", base_shift=0.5,
        max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02,
    )
    boogu = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, use_dynamic_shifting=True,
                                            time_shift_type="exponential")
    for n in (2, 3, 10, 28, 50):
        for tokens in (64, 1024, 4096, 5000):
            mu = qwen_mu(tokens)
            ours = losses.flow_sigmas(n, mu=mu, shift_terminal=0.02)
            qwen.set_timesteps(n, sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
            # replay finds timesteps by exact float equality: bit identity, not closeness
            assert torch.equal(ours, qwen.sigmas), (n, tokens)
            assert torch.equal(ours[:-1] * 1000, qwen.timesteps), (n, tokens)
            # and the float64 formula within float32 rounding
            s = np.linspace(1.0, 1 / n, n)
            shifted = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
            stretched = 1 - (1 - shifted) * 0.98 / (1 - shifted[-1])
            np.testing.assert_allclose(ours[:-1].double().numpy(), stretched, rtol=2e-6, atol=1e-7)
        boogu.set_timesteps(n, sigmas=np.linspace(1.0, 1 / n, n), mu=1.15)
        assert torch.equal(losses.flow_sigmas(n, mu=1.15), boogu.sigmas)


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(num_steps=0, mu=1.0), "num_steps"), (dict(num_steps=2.5, mu=1.0), "num_steps"),
     (dict(num_steps=4, mu=float("nan")), "mu"), (dict(num_steps=4, mu=1.0, shift_terminal=1.5), "shift_terminal"),
     (dict(num_steps=1, mu=1.0, shift_terminal=0.02), "num_steps >= 2")],
)
def test_flow_sigmas_rejects_bad_arguments(kwargs, match):
    n = kwargs.pop("num_steps")
    with pytest.raises(ValueError, match=match):
        losses.flow_sigmas(n, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# SDE step
# ---------------------------------------------------------------------------------------------------------


def reference_sde(x, v, sigma, sigma_next, eta, sigma_max, x_next, sde_type):
    """Element loops in float64 with math: returns (mean, per-sample log-prob, std_dev_t, transition std)."""
    batch = x.shape[0]
    mean = torch.empty_like(x, dtype=F64)
    log_probs, stds, transition = [], [], []
    for b in range(batch):
        s, s1 = float(sigma[b]), float(sigma_next[b])
        dt = s1 - s
        flat_x, flat_v = x[b].reshape(-1).tolist(), v[b].reshape(-1).tolist()
        flat_next = x_next[b].reshape(-1).tolist()
        out, lp = [], 0.0
        if sde_type == "sde":
            denom = sigma_max if s == 1 else s
            std = eta * math.sqrt(s / (1 - denom))
            st = std * math.sqrt(-dt)
            for xi, vi, ni in zip(flat_x, flat_v, flat_next):
                eps_hat = xi + (1 - s) * vi
                m = xi + dt * (vi + std**2 / (2 * s) * eps_hat)
                out.append(m)
                lp += -((ni - m) ** 2) / (2 * st**2) - math.log(st) - 0.5 * math.log(2 * math.pi)
        else:
            std = s1 * math.sin(eta * math.pi / 2)
            st = std
            for xi, vi, ni in zip(flat_x, flat_v, flat_next):
                m = (1 - s1) * (xi - s * vi) + math.sqrt(s1**2 - std**2) * (xi + (1 - s) * vi)
                out.append(m)
                lp += -((ni - m) ** 2)
        mean[b] = torch.tensor(out, dtype=F64).reshape(x[b].shape)
        log_probs.append(lp / len(out))
        stds.append(std)
        transition.append(st)
    return mean, torch.tensor(log_probs, dtype=F64), torch.tensor(stds, dtype=F64), torch.tensor(transition, dtype=F64)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_sde_step_matches_the_formula_in_float64(sde_type):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, generator=g, dtype=F64)
    v = torch.randn(3, 4, 5, generator=g, dtype=F64)
    x_next = torch.randn(3, 4, 5, generator=g, dtype=F64)
    sigma = torch.tensor([1.0, 0.7, 0.3], dtype=F64)  # includes sigma == 1 -> sigma_max
    sigma_next = torch.tensor([0.9, 0.55, 0.1], dtype=F64)
    out = losses.sde_step(x, v, sigma, sigma_next, noise_level=0.8, sde_type=sde_type, sigma_max=0.9,
                          prev_sample=x_next)
    mean, log_prob, std, transition = reference_sde(x, v, sigma, sigma_next, 0.8, 0.9, x_next, sde_type)
    assert out.log_prob.dtype == F64 and out.log_prob.shape == (3,)
    torch.testing.assert_close(out.prev_sample_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.log_prob, log_prob, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.std_dev_t.reshape(3), std, rtol=1e-12, atol=0)
    assert out.std_dev_t.shape == (3, 1, 1)
    torch.testing.assert_close(out.sqrt_neg_dt, (sigma - sigma_next).sqrt(), rtol=1e-14, atol=0)
    assert torch.equal(out.prev_sample, x_next)


def test_sde_noise_scales_match_the_spec_table():
    """Qwen 512², N=10, eta=1.2: std_dev_t, transition std and cps std per step."""
    sigmas = losses.flow_sigmas(10, mu=qwen_mu(1024), shift_terminal=0.02)
    std_dev = [4.50256, 4.33970, 2.87332, 2.17492, 1.72263, 1.38194, 1.09755, 0.83723, 0.56850, 0.17143]
    transition = [1.20000, 1.20800, 0.83702, 0.66448, 0.55329, 0.46786, 0.39282, 0.31781, 0.22973, 0.02424]
    cps = [0.88350, 0.80981, 0.72910, 0.64033, 0.54221, 0.43320, 0.31138, 0.17433, 0.01902, 0.0]
    x = torch.zeros(1, 2, 2)
    for i in range(10):
        out = losses.sde_step(x, x, sigmas[i], sigmas[i + 1], noise_level=1.2, sigma_max=sigmas[1],
                              prev_sample=x)
        assert out.std_dev_t.item() == pytest.approx(std_dev[i], abs=2e-5)
        assert (out.std_dev_t.reshape(1) * out.sqrt_neg_dt).item() == pytest.approx(transition[i], abs=2e-5)
        cps_out = losses.sde_step(x, x, sigmas[i], sigmas[i + 1], noise_level=1.2, sde_type="cps", prev_sample=x)
        assert cps_out.std_dev_t.item() == pytest.approx(cps[i], abs=2e-5)
    # at sigma = 1 the transition std is exactly eta: sqrt(1/(1 - s1)) * sqrt(1 - s1) = 1
    first = losses.sde_step(x, x, sigmas[0], sigmas[1], noise_level=1.2, sigma_max=sigmas[1], prev_sample=x)
    assert (first.std_dev_t.reshape(1) * first.sqrt_neg_dt).item() == pytest.approx(1.2, abs=1e-6)


def test_sigma_one_uses_sigma_max_and_fails_closed_without_it():
    x = torch.randn(2, 3, dtype=F64)
    out = losses.sde_step(x, x, torch.tensor([1.0, 1.0]), torch.tensor([0.9, 0.9]), noise_level=1.0,
                          sigma_max=0.93, prev_sample=x)
    assert out.std_dev_t.flatten().tolist() == pytest.approx([math.sqrt(1 / 0.07)] * 2, rel=1e-12)
    # UniRL's kernel default 0.99 or a plain sigma would give a different scale; the second sigma decides
    other = losses.sde_step(x, x, torch.tensor([1.0, 1.0]), torch.tensor([0.9, 0.9]), noise_level=1.0,
                            sigma_max=0.99, prev_sample=x)
    assert not torch.allclose(other.std_dev_t, out.std_dev_t)
    with pytest.raises(ValueError, match="sigma_max"):
        losses.sde_step(x, x, torch.tensor([1.0, 0.5]), torch.tensor([0.9, 0.4]), noise_level=1.0)
    # away from sigma = 1 sigma_max is irrelevant
    a = losses.sde_step(x, x, 0.5, 0.4, noise_level=1.0, prev_sample=x)
    b = losses.sde_step(x, x, 0.5, 0.4, noise_level=1.0, sigma_max=0.9, prev_sample=x)
    assert torch.equal(a.log_prob, b.log_prob)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_noise_level_zero_is_the_plain_euler_step(sde_type):
    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(2, 8, 4, generator=g), torch.randn(2, 8, 4, generator=g)
    sigma, sigma_next = torch.tensor([0.8, 0.5]), torch.tensor([0.6, 0.2])
    rng = torch.Generator().manual_seed(7)
    state = rng.get_state()
    out = losses.sde_step(x, v, sigma, sigma_next, noise_level=0.0, sde_type=sde_type, generator=rng)
    euler = x + (sigma_next - sigma).reshape(2, 1, 1) * v
    torch.testing.assert_close(out.prev_sample, euler, rtol=1e-6, atol=1e-6)
    if sde_type == "sde":
        assert torch.equal(out.prev_sample, euler)  # bit-exact: x*(1+0) + v*(1+0)*dt
    assert out.log_prob is None
    assert torch.equal(rng.get_state(), state)  # a deterministic step draws no noise
    with pytest.raises(ValueError, match="noise_level=0"):
        losses.sde_step(x, v, sigma, sigma_next, noise_level=0.0, sde_type=sde_type, prev_sample=x)


def test_sampled_step_log_prob_is_the_drawn_noise_density_and_replay_reproduces_it():
    x = torch.randn(3, 16, 4)
    v = torch.randn(3, 16, 4)
    sigma, sigma_next = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.45, 0.2])
    gens = [torch.Generator().manual_seed(s) for s in (11, 12, 13)]
    out = losses.sde_step(x, v, sigma, sigma_next, noise_level=0.7, generator=gens)
    z = torch.cat([torch.randn(1, 16, 4, generator=torch.Generator().manual_seed(s)) for s in (11, 12, 13)])
    st = (out.std_dev_t * out.sqrt_neg_dt.reshape(3, 1, 1)).double()
    torch.testing.assert_close(out.prev_sample.double(), out.prev_sample_mean.double() + st * z.double(),
                               rtol=1e-6, atol=1e-6)
    expected = (-0.5 * z.double() ** 2 - st.log() - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out.log_prob).all()
    replay = losses.sde_step(x, v, sigma, sigma_next, noise_level=0.7, prev_sample=out.prev_sample)
    assert torch.equal(replay.log_prob, out.log_prob)
    assert torch.equal(replay.prev_sample_mean, out.prev_sample_mean)


def test_per_row_generators_make_sampling_batch_independent():
    x, v = torch.randn(4, 6, 3), torch.randn(4, 6, 3)
    sigma, sigma_next = torch.full((4,), 0.7), torch.full((4,), 0.6)
    batched = losses.sde_step(x, v, sigma, sigma_next, noise_level=1.0,
                              generator=[torch.Generator().manual_seed(100 + b) for b in range(4)])
    for b in range(4):
        alone = losses.sde_step(x[b:b + 1], v[b:b + 1], sigma[b:b + 1], sigma_next[b:b + 1], noise_level=1.0,
                                generator=[torch.Generator().manual_seed(100 + b)])
        assert torch.equal(alone.prev_sample[0], batched.prev_sample[b])
    with pytest.raises(ValueError, match="generators"):
        losses.sde_step(x, v, sigma, sigma_next, noise_level=1.0, generator=[torch.Generator()])


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_log_prob_gradient_flows_only_through_the_mean(sde_type):
    x = torch.randn(2, 5, 3, dtype=F64)
    v = torch.randn(2, 5, 3, dtype=F64, requires_grad=True)
    target = torch.randn(2, 5, 3, dtype=F64, requires_grad=True)
    sigma, sigma_next = torch.tensor([0.8, 0.4], dtype=F64), torch.tensor([0.7, 0.2], dtype=F64)
    out = losses.sde_step(x, v, sigma, sigma_next, noise_level=0.9, sde_type=sde_type, prev_sample=target)
    out.log_prob.sum().backward()
    assert target.grad is None  # prev_sample is detached inside the log-prob
    assert v.grad is not None and v.grad.abs().sum() > 0
    # d logp / d mean = (x' - mean) / (s^2 D) for sde, 2 (x' - mean) / D for cps; chain rule through mean(v)
    dmean_dv = (1 + out.std_dev_t**2 * (1 - sigma.reshape(2, 1, 1)) / (2 * sigma.reshape(2, 1, 1))) * (
        sigma_next - sigma).reshape(2, 1, 1) if sde_type == "sde" else (
        -sigma.reshape(2, 1, 1) * (1 - sigma_next.reshape(2, 1, 1))
        + (1 - sigma.reshape(2, 1, 1)) * torch.sqrt(sigma_next.reshape(2, 1, 1) ** 2 - out.std_dev_t**2))
    resid = target.detach() - out.prev_sample_mean.detach()
    dlp_dmean = resid / (out.std_dev_t * out.sqrt_neg_dt.reshape(2, 1, 1)) ** 2 / 15 if sde_type == "sde" \
        else 2 * resid / 15
    torch.testing.assert_close(v.grad, dlp_dmean * dmean_dv, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_sde_step_gradcheck_float64(sde_type):
    x = torch.randn(2, 3, 2, dtype=F64)
    target = torch.randn(2, 3, 2, dtype=F64)
    sigma, sigma_next = torch.tensor([1.0, 0.5], dtype=F64), torch.tensor([0.9, 0.3], dtype=F64)

    def fn(v):
        out = losses.sde_step(x, v, sigma, sigma_next, noise_level=0.8, sde_type=sde_type, sigma_max=0.9,
                              prev_sample=target)
        return out.log_prob, out.prev_sample_mean

    assert torch.autograd.gradcheck(fn, (torch.randn(2, 3, 2, dtype=F64, requires_grad=True),))


def test_sde_step_float32_math_for_low_precision_inputs():
    x = torch.randn(2, 4).bfloat16()
    out = losses.sde_step(x, x, 0.5, 0.4, noise_level=1.0, generator=torch.Generator().manual_seed(0))
    assert out.prev_sample.dtype == torch.float32 and out.log_prob.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(sde_type="dance"), "sde_type"), (dict(noise_level=-1.0), "noise_level"),
     (dict(sigma=0.4, sigma_next=0.5), "sigma_next < sigma"), (dict(sigma=torch.ones(3) * 0.5), "shape")],
)
def test_sde_step_rejects_bad_arguments(kwargs, match):
    args = dict(sigma=0.5, sigma_next=0.4, noise_level=1.0)
    args.update(kwargs)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        losses.sde_step(x, x, args.pop("sigma"), args.pop("sigma_next"), **args)
    with pytest.raises(ValueError, match="same shape"):
        losses.sde_step(x, torch.zeros(2, 4), 0.5, 0.4, noise_level=1.0)


# ---------------------------------------------------------------------------------------------------------
# CFG
# ---------------------------------------------------------------------------------------------------------


def test_standard_cfg_by_hand():
    cond, uncond = torch.tensor([[1.0, 2.0]], dtype=F64), torch.tensor([[0.5, -1.0]], dtype=F64)
    torch.testing.assert_close(losses.apply_cfg(cond, uncond, 4.0), torch.tensor([[2.5, 11.0]], dtype=F64))
    torch.testing.assert_close(losses.apply_cfg(cond, uncond, 1.0), cond)


def test_true_cfg_rescales_each_token_to_the_conditional_norm_over_the_last_dim():
    cond = torch.tensor([[[3.0, 4.0], [0.0, 1.0]]], dtype=F64)  # token norms 5 and 1
    uncond = torch.tensor([[[1.0, 0.0], [1.0, 1.0]]], dtype=F64)
    out = losses.apply_cfg(cond, uncond, 2.0, renorm=True)
    comb = torch.tensor([[[5.0, 8.0], [-1.0, 1.0]]], dtype=F64)  # uncond + 2 (cond - uncond)
    expected = torch.stack([comb[0, 0] * 5 / math.hypot(5, 8), comb[0, 1] * 1 / math.hypot(1, 1)])[None]
    torch.testing.assert_close(out, expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(out.norm(dim=-1), cond.norm(dim=-1))
    # a norm over the whole tensor instead of the last dim would not give per-token norms
    assert not torch.allclose(comb * cond.norm() / comb.norm(), out)
    with pytest.raises(ValueError, match="same shape"):
        losses.apply_cfg(cond, uncond[:, :1], 2.0)


# ---------------------------------------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------------------------------------


def test_group_advantages_global_std_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)
    adv = losses.group_advantages(rewards, [0, 0, 1, 1])
    std = math.sqrt(5 / 3)  # unbiased std of 1..4 (SS = 5, N - 1 = 3)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, -0.5, 0.5], dtype=F64) / (std + 1e-4))


def test_group_advantages_std_over_the_reward_repeated_across_stored_steps():
    rewards = torch.tensor([0.1, 0.5, 0.9, 0.2, 0.4, 0.3], dtype=F64)
    ids = ["a", "a", "a", "b", "b", "b"]
    ss = float(((rewards - rewards.mean()) ** 2).sum())
    n = 6
    for w in (1, 2, 5):
        adv = losses.group_advantages(rewards, ids, num_steps=w)
        std = math.sqrt(w * ss / (n * w - 1))  # torch.std over the (N, W) expansion
        means = {"a": (0.1 + 0.5 + 0.9) / 3, "b": (0.2 + 0.4 + 0.3) / 3}
        expected = [(float(r) - means[i]) / (std + 1e-4) for r, i in zip(rewards, ids)]
        torch.testing.assert_close(adv, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-14)
    # W = 2 gives a smaller std than the ddof-1 std over N values, so larger advantages
    assert losses.group_advantages(rewards, ids, num_steps=2)[2] > losses.group_advantages(rewards, ids)[2]


def test_group_advantages_per_group_std_and_singletons():
    rewards = torch.tensor([1.0, 2.0, 5.0, 7.0], dtype=F64)
    adv = losses.group_advantages(rewards, [0, 0, 1, 2], global_std=False)
    s = math.sqrt(0.5)  # unbiased std of [1, 2]
    expected = torch.tensor([-0.5 / (s + 1e-4), 0.5 / (s + 1e-4), 0.0, 0.0], dtype=F64)
    torch.testing.assert_close(adv, expected)
    # per-group std with W steps: unbiased std over the group's (n_g, W) block
    adv2 = losses.group_advantages(rewards[:2], [0, 0], global_std=False, num_steps=3)
    s2 = math.sqrt(3 * 0.5 / 5)
    torch.testing.assert_close(adv2, torch.tensor([-0.5, 0.5], dtype=F64) / (s2 + 1e-4))
    no_norm = losses.group_advantages(rewards, [0, 0, 1, 1], norm_by_std=False)
    torch.testing.assert_close(no_norm, torch.tensor([-0.5, 0.5, -1.0, 1.0], dtype=F64))


def test_zero_std_groups_give_exactly_zero_advantage_and_stay_in_the_batch():
    rewards = torch.tensor([0.3, 0.3, 0.3, 0.1, 0.9, 0.7], dtype=torch.float32)
    adv = losses.group_advantages(rewards, [0, 0, 0, 1, 1, 1])
    assert adv.shape == (6,)
    assert torch.equal(adv[:3], torch.zeros(3))
    assert (adv[3:] != 0).all()
    per_group = losses.group_advantages(rewards, [0, 0, 0, 1, 1, 1], global_std=False)
    assert torch.equal(per_group[:3], torch.zeros(3))


def test_group_advantages_fail_closed():
    with pytest.raises(ValueError, match="NaN"):
        losses.group_advantages(torch.tensor([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="group_ids"):
        losses.group_advantages(torch.tensor([1.0, 2.0]), [0])


def test_reward_probability_all_modes_by_hand():
    adv = torch.tensor([-3.0, -1.0, 0.0, 0.5, 3.0], dtype=F64)
    expected = {
        "continuous": [0.0, 0.25, 0.5, 0.625, 1.0],
        "positive_only": [0.5, 0.5, 0.5, 0.625, 1.0],
        "negative_only": [0.0, 0.25, 0.5, 0.5, 0.5],
        "one_only": [0.5, 0.5, 0.5, 0.75, 0.75],
        "binary": [0.25, 0.25, 0.5, 0.75, 0.75],
    }
    for mode, values in expected.items():
        out = losses.reward_probability(adv, adv_clip_max=2.0, adv_mode=mode)
        torch.testing.assert_close(out, torch.tensor(values, dtype=F64), msg=mode)
    # C = 1 saturates any |A| >= 1
    assert losses.reward_probability(adv, adv_clip_max=1.0).tolist() == [0.0, 0.0, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError, match="adv_clip_max"):
        losses.reward_probability(adv, adv_clip_max=0.0)
    with pytest.raises(ValueError, match="adv_mode"):
        losses.reward_probability(adv, adv_clip_max=1.0, adv_mode="all")


# ---------------------------------------------------------------------------------------------------------
# Flow-GRPO
# ---------------------------------------------------------------------------------------------------------


def test_flow_grpo_loss_value_gradient_and_metrics_by_hand():
    eps = 0.1
    logp_old = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0], dtype=F64)
    logp = torch.tensor([0.2, -0.2, 0.05, 0.3, -0.3], dtype=F64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -2.0, -7.0, -1.0], dtype=F64)  # -7 is clamped to -5
    loss, metrics = losses.flow_grpo_loss(logp, logp_old, adv, clip_ratio=eps, adv_clip_max=5.0)
    rho = [math.exp(x) for x in (0.2, -0.2, 0.05, 0.3, -0.3)]
    a = [1.0, 1.0, -2.0, -5.0, -1.0]
    per = [max(-ai * r, -ai * min(max(r, 1 - eps), 1 + eps)) for ai, r in zip(a, rho)]
    assert loss.item() == pytest.approx(sum(per) / 5, rel=1e-14)
    loss.backward()
    # element 0: A>0, rho>1+eps -> clipped, zero grad; 1: A>0, rho<1-eps -> unclipped -A rho;
    # 2: inside the band -> -A rho; 3: A<0, rho>1+eps -> unclipped (max picks it); 4: A<0, rho<1-eps -> clipped
    expected_grad = [0.0, -1.0 * rho[1], 2.0 * rho[2], 5.0 * rho[3], 0.0]
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad, dtype=F64) / 5)
    assert metrics["pg_clipfrac"] == pytest.approx(4 / 5)
    assert metrics["pg_clipfrac_higher"] == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(2 / 5)
    assert metrics["ppo_kl"] == pytest.approx(-sum([0.2, -0.2, 0.05, 0.3, -0.3]) / 5)
    assert metrics["ratio_mean"] == pytest.approx(sum(rho) / 5)
    assert metrics["ratio_std"] == pytest.approx(float(np.std(rho, ddof=1)))
    assert (metrics["ratio_min"], metrics["ratio_max"]) == (pytest.approx(rho[4]), pytest.approx(rho[3]))


def test_flow_grpo_ratio_is_one_when_old_log_probs_are_recomputed():
    logp = torch.randn(8, dtype=F64)
    _, metrics = losses.flow_grpo_loss(logp, logp.clone(), torch.randn(8, dtype=F64), clip_ratio=1e-5)
    assert metrics["ratio_mean"] == 1.0 and metrics["pg_clipfrac"] == 0.0
    assert metrics["ratio_min"] == metrics["ratio_max"] == 1.0


def test_flow_grpo_gradcheck_and_bad_input():
    old = torch.randn(6, dtype=F64)
    adv = torch.randn(6, dtype=F64)

    def fn(lp):
        return losses.flow_grpo_loss(lp, old, adv, clip_ratio=0.5)[0]

    assert torch.autograd.gradcheck(fn, (old.clone().add_(0.01).requires_grad_(),))
    with pytest.raises(ValueError, match="shapes"):
        losses.flow_grpo_loss(old, old[:3], adv, clip_ratio=0.1)
    with pytest.raises(ValueError, match="clip_ratio"):
        losses.flow_grpo_loss(old, old, adv, clip_ratio=0.0)
    # a NaN input is a fact about the numbers, not a bad argument: the NaN loss is returned (GradStepper skips it)
    loss, metrics = losses.flow_grpo_loss(old, torch.full((6,), float("nan"), dtype=F64), adv, clip_ratio=0.1)
    assert torch.isnan(loss) and torch.isnan(metrics["ratio_mean"])


# ---------------------------------------------------------------------------------------------------------
# Flow-DPPO
# ---------------------------------------------------------------------------------------------------------


def dppo_case(log_ratio, adv, shift, std=1.0, sqrt_dt=0.1):
    """Per-sample mean shift `shift` between new and old means of a (B, 2, 2) latent."""
    b = len(log_ratio)
    old_mean = torch.zeros(b, 2, 2, dtype=F64)
    new_mean = old_mean + torch.tensor(shift, dtype=F64).reshape(b, 1, 1)
    logp = torch.tensor(log_ratio, dtype=F64, requires_grad=True)
    return dict(log_prob=logp, old_log_prob=torch.zeros(b, dtype=F64), advantages=torch.tensor(adv, dtype=F64),
                prev_sample_mean=new_mean, old_prev_sample_mean=old_mean,
                std_dev_t=torch.full((b, 1, 1), std, dtype=F64), sqrt_neg_dt=torch.full((b,), sqrt_dt, dtype=F64))


def test_dppo_masks_exactly_the_over_pushing_updates_and_keeps_corrective_ones():
    # KL per sample = shift^2 / (2 (std * sqrt_dt)^2) = shift^2 / 0.02; shift 0.1 -> 0.5 (high), 1e-4 -> 5e-7
    hi, lo = 0.1, 1e-4
    case = dppo_case(
        log_ratio=[0.1, -0.1, -0.1, 0.1, 0.1, -0.1, 0.1, 0.0],
        adv=[1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 0.0, 1.0],
        shift=[hi, hi, hi, hi, lo, lo, hi, hi],
    )
    loss, m = losses.flow_dppo_loss(**case, kl_mask_threshold=1e-3)
    # masked: 0 (high, rho>1, A>0) and 2 (high, rho<1, A<0); kept: corrective 1, 3; low-KL 4, 5; A=0 6; rho=1 7
    keep = [0, 1, 0, 1, 1, 1, 1, 1]
    rho = [math.exp(x) for x in case["log_prob"].tolist()]
    expected = sum(-a * r * k for a, r, k in zip(case["advantages"].tolist(), rho, keep)) / 8
    assert loss.item() == pytest.approx(expected, rel=1e-14)
    assert m["pos_rm_fraction"] == pytest.approx(1 / 8) and m["neg_rm_fraction"] == pytest.approx(1 / 8)
    assert m["masked_fraction"] == pytest.approx(2 / 8) and m["unmasked_fraction"] == pytest.approx(6 / 8)
    assert m["kl_mask_fraction"] == pytest.approx(6 / 8)
    assert m["kl_new_old_max"] == pytest.approx(hi**2 / 0.02, rel=1e-12)
    assert m["ratio_std"] == pytest.approx(float(np.std(rho)), rel=1e-12)  # population std
    assert m["approx_kl"] == pytest.approx(sum(0.5 * x * x for x in case["log_prob"].tolist()) / 8)
    loss.backward()
    expected_grad = [-a * r * k / 8 for a, r, k in zip(case["advantages"].tolist(), rho, keep)]
    torch.testing.assert_close(case["log_prob"].grad, torch.tensor(expected_grad, dtype=F64))


def test_dppo_threshold_is_inclusive_and_kl_coefficient_switch():
    # KL exactly at the threshold counts as high (the code uses >=)
    case = dppo_case(log_ratio=[0.1], adv=[1.0], shift=[0.5], std=1.0, sqrt_dt=1.0)  # KL = 0.25 / 2 = 0.125
    _, m = losses.flow_dppo_loss(**case, kl_mask_threshold=0.125)
    assert m["pos_rm_fraction"] == 1.0
    _, m = losses.flow_dppo_loss(**case, kl_mask_threshold=0.125 * (1 + 1e-9))
    assert m["pos_rm_fraction"] == 0.0
    # add_kl_coefficient=False divides by 2 only: with std*sqrt_dt = 0.1 the KL is 100x smaller than with it
    case = dppo_case(log_ratio=[0.1], adv=[1.0], shift=[0.1])
    _, with_coef = losses.flow_dppo_loss(**case)
    _, without = losses.flow_dppo_loss(**case, add_kl_coefficient=False)
    assert with_coef["kl_new_old_mean"] == pytest.approx(0.5, rel=1e-12)
    assert without["kl_new_old_mean"] == pytest.approx(0.005, rel=1e-12)


def test_dppo_overflowed_masked_ratio_gives_finite_loss_and_gradient():
    case = dppo_case(log_ratio=[1000.0, 0.1], adv=[1.0, 1.0], shift=[0.1, 0.0])
    loss, m = losses.flow_dppo_loss(**case)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(case["log_prob"].grad).all()
    assert case["log_prob"].grad[0].item() == 0.0


def test_dppo_non_finite_divergence_makes_the_loss_nan_so_the_step_is_skipped():
    """A NaN in the old means (or sigma_t = 0 with equal means: 0/0) leaves D without a value: `D >= threshold` is
    False for NaN, which would keep the sample as if inside the trust region; the loss is NaN instead."""
    case = dppo_case(log_ratio=[0.1, 0.1], adv=[1.0, 1.0], shift=[0.1, 0.0])
    case["old_prev_sample_mean"][0, 0, 0] = float("nan")
    loss, _ = losses.flow_dppo_loss(**case)
    assert math.isnan(loss.item())
    zero_sigma = dppo_case(log_ratio=[0.1], adv=[1.0], shift=[0.0], sqrt_dt=0.0)
    assert math.isnan(losses.flow_dppo_loss(**zero_sigma)[0].item())
    finite = dppo_case(log_ratio=[0.1], adv=[1.0], shift=[0.0])  # D = 0: a finite loss, kept
    assert losses.flow_dppo_loss(**finite)[0].item() == pytest.approx(-math.exp(0.1), rel=1e-14)


def test_dppo_gradcheck_float64():
    case = dppo_case(log_ratio=[0.1, -0.2, 0.3], adv=[1.0, -1.0, 0.5], shift=[0.1, 1e-5, 0.1])
    lp = case.pop("log_prob").detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: losses.flow_dppo_loss(x, **case)[0], (lp,))
    with pytest.raises(ValueError, match="kl_mask_threshold"):
        losses.flow_dppo_loss(lp, **case, kl_mask_threshold=0)


# ---------------------------------------------------------------------------------------------------------
# DiffusionNFT
# ---------------------------------------------------------------------------------------------------------


def reference_nft(v, v_old, x0, xt, t, r, beta, c, v_ref=None, kappa=0.0, w_min=1e-5):
    """Per-sample float64 loops; returns (loss, L+ per sample, L- per sample, ref term)."""
    batch = x0.shape[0]
    total, lp, ln, ref = 0.0, [], [], 0.0
    for b in range(batch):
        xs, x0s, vs, vos = (a[b].reshape(-1).tolist() for a in (xt, x0, v, v_old))
        tb = float(t[b])
        pos = [xi - tb * (beta * vi + (1 - beta) * oi) for xi, vi, oi in zip(xs, vs, vos)]
        neg = [xi - tb * ((1 + beta) * oi - beta * vi) for xi, vi, oi in zip(xs, vs, vos)]
        d = len(xs)
        w_pos = max(w_min, sum(abs(p - a) for p, a in zip(pos, x0s)) / d)
        w_neg = max(w_min, sum(abs(p - a) for p, a in zip(neg, x0s)) / d)
        l_pos = sum((p - a) ** 2 for p, a in zip(pos, x0s)) / d / w_pos
        l_neg = sum((p - a) ** 2 for p, a in zip(neg, x0s)) / d / w_neg
        lp.append(l_pos)
        ln.append(l_neg)
        total += c * (float(r[b]) * l_pos + (1 - float(r[b])) * l_neg) / beta
        if v_ref is not None:
            ref += sum((vi - ri) ** 2 for vi, ri in zip(vs, v_ref[b].reshape(-1).tolist())) / d
    return total / batch + kappa * ref / batch, lp, ln, ref / batch


def nft_inputs(seed=0, batch=3):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(batch, 2, 3, 3, generator=g, dtype=F64)
    eps = torch.randn(batch, 2, 3, 3, generator=g, dtype=F64)
    t = torch.tensor([0.9, 0.5, 0.1][:batch], dtype=F64)
    xt = (1 - t.reshape(-1, 1, 1, 1)) * x0 + t.reshape(-1, 1, 1, 1) * eps
    v = torch.randn(batch, 2, 3, 3, generator=g, dtype=F64)
    v_old = v + 0.1 * torch.randn(batch, 2, 3, 3, generator=g, dtype=F64)
    v_ref = torch.randn(batch, 2, 3, 3, generator=g, dtype=F64)
    r = torch.tensor([0.9, 0.2, 0.5][:batch], dtype=F64)
    return v, v_old, x0, xt, t, r, v_ref


def test_nft_loss_matches_an_independent_float64_implementation():
    v, v_old, x0, xt, t, r, v_ref = nft_inputs()
    loss, m = losses.diffusion_nft_loss(v, v_old, x0, xt, t, r, mix_beta=0.1, adv_clip_max=1.0,
                                        ref_prediction=v_ref, ref_kl_coef=10.0)
    ref_loss, lp, ln, ref = reference_nft(v, v_old, x0, xt, t, r, 0.1, 1.0, v_ref, 10.0)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-10)
    assert m["positive_loss"] == pytest.approx(sum(lp) / 3, rel=1e-10)
    assert m["negative_loss"] == pytest.approx(sum(ln) / 3, rel=1e-10)
    assert m["ref_kl_loss"] == pytest.approx(ref, rel=1e-10)
    assert m["policy_loss"] == pytest.approx(ref_loss - 10.0 * ref, rel=1e-10)
    assert m["total_loss"] == pytest.approx(ref_loss, rel=1e-10)
    assert m["reward_prob_mean"] == pytest.approx(1.6 / 3)
    assert m["old_deviate"] == pytest.approx(float(((v - v_old) ** 2).mean()), rel=1e-12)
    # defaults (beta 0.5, C 5, no reference)
    loss2, m2 = losses.diffusion_nft_loss(v, v_old, x0, xt, t, r, mix_beta=0.5, adv_clip_max=5.0)
    assert loss2.item() == pytest.approx(reference_nft(v, v_old, x0, xt, t, r, 0.5, 5.0)[0], rel=1e-10)
    assert m2["ref_kl_loss"] == 0.0


def test_nft_with_forward_equal_old_gives_the_documented_value():
    """v_theta == v_old: both implicit branches are v_old, so L+ = L- = mean(e^2)/max(w_min, mean|e|)
    with e = xt - t v_old - x0, and policy_loss = C/beta * mean_i L_i, whatever the reward."""
    _, v_old, x0, xt, t, _, _ = nft_inputs(seed=1)
    e = xt - t.reshape(-1, 1, 1, 1) * v_old - x0
    per = (e**2).mean(dim=(1, 2, 3)) / e.abs().mean(dim=(1, 2, 3)).clamp(min=1e-5)
    for r in (torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64), torch.tensor([0.3, 0.6, 0.9], dtype=F64)):
        loss, m = losses.diffusion_nft_loss(v_old.clone(), v_old, x0, xt, t, r, mix_beta=0.1, adv_clip_max=1.0)
        assert loss.item() == pytest.approx(float(per.mean()) * 1.0 / 0.1, rel=1e-12)
        assert m["positive_loss"] == pytest.approx(m["negative_loss"], rel=1e-14)
        assert m["old_deviate"] == 0.0


def test_nft_gradient_treats_adaptive_weights_as_constants():
    v, v_old, x0, xt, t, r, _ = nft_inputs(seed=2)
    v = v.clone().requires_grad_()
    beta, c = 0.3, 2.0
    loss, _ = losses.diffusion_nft_loss(v, v_old, x0, xt, t, r, mix_beta=beta, adv_clip_max=c)
    loss.backward()
    tt = t.reshape(-1, 1, 1, 1)
    pos = xt - tt * (beta * v.detach() + (1 - beta) * v_old) - x0
    neg = xt - tt * ((1 + beta) * v_old - beta * v.detach()) - x0
    w_pos = pos.abs().mean(dim=(1, 2, 3), keepdim=True)
    w_neg = neg.abs().mean(dim=(1, 2, 3), keepdim=True)
    d, b, rr = 18, 3, r.reshape(-1, 1, 1, 1)
    grad = c / beta / b * (rr * 2 * pos * (-tt * beta) / (w_pos * d) + (1 - rr) * 2 * neg * (tt * beta) / (w_neg * d))
    torch.testing.assert_close(v.grad, grad, rtol=1e-10, atol=1e-14)


def test_nft_ref_term_gradcheck_and_errors():
    v, v_old, x0, xt, t, r, v_ref = nft_inputs(seed=3)

    def ref_only(x):  # the velocity-MSE regulariser alone is smooth; gradcheck it exactly
        full, _ = losses.diffusion_nft_loss(x, v_old, x0, xt, t, r, mix_beta=0.1, adv_clip_max=1.0,
                                            ref_prediction=v_ref, ref_kl_coef=1.0)
        policy, _ = losses.diffusion_nft_loss(x, v_old, x0, xt, t, r, mix_beta=0.1, adv_clip_max=1.0)
        return full - policy

    assert torch.autograd.gradcheck(ref_only, (v.clone().requires_grad_(),))
    bad = dict(mix_beta=0.0, adv_clip_max=1.0), dict(mix_beta=0.1, adv_clip_max=0.0), \
        dict(mix_beta=0.1, adv_clip_max=1.0, ref_kl_coef=1.0)
    for kwargs, match in zip(bad, ("mix_beta", "adv_clip_max", "ref_prediction")):
        with pytest.raises(ValueError, match=match):
            losses.diffusion_nft_loss(v, v_old, x0, xt, t, r, **kwargs)
    with pytest.raises(ValueError, match="reward_prob"):
        losses.diffusion_nft_loss(v, v_old, x0, xt, t, r[:2], mix_beta=0.1, adv_clip_max=1.0)
    loss, metrics = losses.diffusion_nft_loss(v, v_old * float("nan"), x0, xt, t, r, mix_beta=0.1, adv_clip_max=1.0)
    assert torch.isnan(loss) and torch.isnan(metrics["old_deviate"])  # returned, not raised (GradStepper skips it)
    with pytest.raises(ValueError, match="shapes"):
        losses.diffusion_nft_loss(v, v_old[:2], x0, xt, t, r, mix_beta=0.1, adv_clip_max=1.0)


# ---------------------------------------------------------------------------------------------------------
# old-policy decay and EMA
# ---------------------------------------------------------------------------------------------------------


def test_old_policy_decay_schedules_match_the_table():
    table = {
        "copy": {0: 0, 1: 0, 10: 0, 100: 0, 1000: 0},
        "linear_to_0_5": {0: 0, 1: 0.001, 10: 0.01, 100: 0.1, 1000: 0.5},
        "delayed_linear_to_0_999": {0: 0, 1: 0, 10: 0, 75: 0, 76: 0.0075, 100: 0.1875, 208: 0.9975, 209: 0.999,
                                    1000: 0.999},
    }
    for schedule, values in table.items():
        for step, d in values.items():
            assert losses.old_policy_decay(step, schedule) == pytest.approx(d, abs=1e-12), (schedule, step)
    with pytest.raises(ValueError, match="schedule"):
        losses.old_policy_decay(3, "cosine")


def test_ema_update_copy_and_decay():
    old = [torch.tensor([1.0, 2.0], dtype=F64), torch.tensor([[4.0]], dtype=F64)]
    new = [torch.tensor([3.0, -2.0], dtype=F64), torch.tensor([[0.0]], dtype=F64)]
    losses.ema_update_(old, new, 0.75)
    torch.testing.assert_close(old[0], torch.tensor([1.5, 1.0], dtype=F64))  # 0.75*old + 0.25*new
    torch.testing.assert_close(old[1], torch.tensor([[3.0]], dtype=F64))
    losses.ema_update_(old, new, 0.0)
    assert all(torch.equal(o, n) for o, n in zip(old, new))
    with pytest.raises(ValueError, match="decay"):
        losses.ema_update_(old, new, 1.5)
    with pytest.raises(ValueError, match="parameter 0"):
        losses.ema_update_([torch.zeros(2)], [torch.zeros(3)], 0.5)


def test_sigmas_at_timesteps_is_an_exact_lookup():
    sigmas = losses.flow_sigmas(10, mu=qwen_mu(1024), shift_terminal=0.02)
    idx = torch.tensor([[0, 3], [8, 9]])
    stored = (sigmas[:-1] * 1000)[idx]
    sigma, sigma_next = losses.sigmas_at_timesteps(stored, sigmas)
    assert torch.equal(sigma, sigmas[idx])
    assert torch.equal(sigma_next, sigmas[idx + 1])
    # a timestep off by one float32 ulp is a different schedule: fail, never round to the nearest
    off = torch.nextafter(stored[0, 1:], torch.tensor(0.0))
    with pytest.raises(ValueError, match="different schedules"):
        losses.sigmas_at_timesteps(off, sigmas)
    other = losses.flow_sigmas(10, mu=qwen_mu(4096), shift_terminal=0.02)
    with pytest.raises(ValueError, match="different schedules"):
        losses.sigmas_at_timesteps(other[1:3] * 1000, sigmas)


def test_select_train_timesteps_permutes_rows_and_truncates_to_integers():
    timesteps = (losses.flow_sigmas(10, mu=qwen_mu(1024), shift_terminal=0.02)[:-1] * 1000).expand(3, 10)
    chosen = losses.select_train_timesteps(timesteps, timestep_fraction=0.95, seed=42)
    assert chosen.dtype == torch.int64 and chosen.shape == (3, 9)  # K = int(10 * 0.95) = 9
    for row in chosen.tolist():
        assert len(set(row)) == 9 and set(row) <= {int(t) for t in timesteps[0].tolist()}
    # re-seeded every call: the same pattern every step; rows are permuted independently
    again = losses.select_train_timesteps(timesteps, timestep_fraction=0.95, seed=42)
    assert torch.equal(chosen, again) and not torch.equal(chosen[0], chosen[1])
    g = torch.Generator().manual_seed(42)
    expected = torch.stack([timesteps[b][torch.randperm(10, generator=g)[:9]] for b in range(3)]).long()
    assert torch.equal(chosen, expected)
    assert losses.select_train_timesteps(timesteps[:, :1], timestep_fraction=0.1).shape == (3, 1)  # K >= 1
    with pytest.raises(ValueError, match="timestep_fraction"):
        losses.select_train_timesteps(timesteps, timestep_fraction=0.0)
