"""Each policy loss, aggregation and KL estimator against its paper's formula, written here as a
plain loop over sequences and tokens (no code shared with the product), on random packed batches:
values and gradients. Plus the identities that must hold between them."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.kl import token_kl
from torchtitan_rl.trainer.loss import PolicyLoss
from torchtitan_rl.types import TrainingSample

SEQ_LEN = 24


def _random_samples(rng: random.Random, *, num: int = 7, one_token: bool = False,
                     nan_rate: float = 0.1) -> list[TrainingSample]:
    samples = []
    for i in range(num):
        prompt = rng.randint(1, 4)
        completion = 1 if one_token else rng.randint(1, 12)
        n = prompt + completion
        mask = [0] * prompt + [1] * completion
        advantage = rng.choice([-1.0, 1.0]) * rng.uniform(0.1, 2.0)
        logprobs = [0.0] * prompt + [
            float("nan") if rng.random() < nan_rate else -rng.uniform(0.05, 3.0)
            for _ in range(completion)]
        samples.append(TrainingSample(
            sample_id=f"s{i}", group_id=0, token_ids=[rng.randint(1, 50) for _ in range(n)],
            loss_mask=mask, generator_logprobs=logprobs,
            advantages=[0.0] * prompt + [advantage] * completion,
            policy_versions=[-1] * prompt + [0] * completion))
    return samples


class _Case:
    """A packed batch, the current policy's logprobs on its grid (a leaf with grad), and the
    reference policy's; ``token(d, j)`` is the grid position that predicts sample d's token j."""

    def __init__(self, seed: int, **sample_kwargs) -> None:
        rng = random.Random(seed)
        self.samples = _random_samples(rng, **sample_kwargs)
        self.batch = Batcher.Config(seq_len=SEQ_LEN).build(dp_size=1).pack(self.samples)
        gen = torch.Generator().manual_seed(seed)
        shape = self.batch.labels.shape
        # Current logprobs within ~0.4 nats of the generator's: some tokens clip, most do not.
        noise = torch.randn(shape, generator=gen, dtype=torch.float32) * 0.4
        base = torch.nan_to_num(self.batch.generator_logprobs, nan=-1.0)
        self.logp = (base + noise).clamp(max=-1e-3).detach().requires_grad_(True)
        self.reference = (base + torch.randn(shape, generator=gen) * 0.3).clamp(max=-1e-3)

    def token(self, document: int, j: int) -> tuple[int, ...]:
        b = self.batch
        hits = ((b.document_ids == document) & (b.positions == j - 1)).nonzero()
        assert len(hits) == 1
        return tuple(hits[0].tolist())

    def product_loss(self, config: PolicyLoss.Config) -> torch.Tensor:
        loss_fn = config.build()
        b, total = self.batch, torch.zeros(())
        for index in range(b.num_microbatches):
            data = b.microbatch(index, 0)
            loss, _, _ = loss_fn(
                self.logp[index, 0], generator_logprobs=data["generator_logprobs"],
                advantages=data["advantages"], loss_mask=data["loss_mask"],
                num_global_valid_tokens=b.num_valid_tokens,
                num_global_valid_sequences=b.num_valid_sequences,
                document_ids=data["document_ids"],
                sequence_valid_tokens=data["sequence_valid_tokens"],
                reference_logprobs=self.reference[index, 0])
            total = total + loss
        return total


def _clip(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return torch.clamp(x, low, high)


def _reference_loss(case: _Case, cfg: PolicyLoss.Config) -> torch.Tensor:
    """The step loss from the papers' formulas, sequence by sequence, token by token."""
    sequences: dict[int, list[tuple[tuple[int, ...], float, float]]] = {}
    for d, sample in enumerate(case.samples):
        for j in range(1, sample.num_tokens):
            gen = sample.generator_logprobs[j]
            if sample.loss_mask[j] and math.isfinite(gen):
                sequences.setdefault(d, []).append((case.token(d, j), gen, sample.advantages[j]))
    n_tokens = sum(len(t) for t in sequences.values())
    n_seqs = len(sequences)
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    correction = cfg.off_policy
    assert correction.enabled != "on" or (correction.is_level == "token"
                                          and correction.token_mask_low is None), (
        "this reference knows token TIS only (test_trainer_off_policy.py has the menu)")
    picked = _covariance_picks(case, sequences, cfg)
    total = torch.zeros(())
    for tokens in sequences.values():
        T = len(tokens)
        if cfg.aggregation == "token-mean":
            c = 1.0 / n_tokens
        elif cfg.aggregation == "seq-mean-token-sum":
            c = 1.0 / n_seqs
        elif cfg.aggregation == "seq-mean-token-mean":
            c = 1.0 / (n_seqs * T)
        else:
            c = 1.0 / (n_seqs * (cfg.norm_length or SEQ_LEN))
        if cfg.policy_loss == "gspo":
            # Zheng et al. 2025, eq. (5)-(7): s_i = (pi/pi_old)^(1/|y_i|), clipped per sequence.
            A = tokens[0][2]
            s = torch.exp(sum(case.logp[p] - g for p, g, _ in tokens) / T)
            seq_loss = -torch.minimum(s * A, _clip(s, lo, hi) * A)
            total = total + c * T * seq_loss  # every token carries the sequence's loss
        if cfg.policy_loss == "gmpo":
            # Zhao et al. 2025 eq. (4) as verl's geo_mean: sign-aware log-space clip per token,
            # the sequence's geometric-mean ratio times its mean advantage.
            clipped_logs = []
            for p, g, A in tokens:
                x = case.logp[p] - g
                sign = 1.0 if A > 0 else (-1.0 if A < 0 else 0.0)
                clipped_logs.append(sign * torch.minimum(
                    sign * x, sign * _clip(x, -cfg.clip_low, cfg.clip_high)))
            ratio = torch.exp(sum(clipped_logs) / T)
            mean_advantage = sum(A for _, _, A in tokens) / T
            total = total + c * T * (-ratio * mean_advantage)
        for p, g, A in tokens:
            logp = case.logp[p]
            if correction.enabled == "on":
                w = min(math.exp(logp.item() - g), correction.is_cap)
                old = logp.detach()
            else:
                w, old = 1.0, (torch.tensor(g) if cfg.ratio_reference == "generator"
                               else logp.detach())
            r = torch.exp(logp - old)
            if cfg.policy_loss in ("ppo_clip", "clip_cov"):
                token_loss = torch.maximum(-r * A, -_clip(r, lo, hi) * A)
                if cfg.clip_ratio_c is not None and A < 0:
                    token_loss = torch.minimum(token_loss, torch.tensor(-cfg.clip_ratio_c * A))
                if p in picked:  # Clip-Cov: a picked token loses its gradient
                    token_loss = token_loss * 0.0
                total = total + c * w * token_loss
            elif cfg.policy_loss == "cispo":
                # MiniMax-M1 eq. (4): sg(clip(r)) * A * log pi; log pi - log pi_old: same gradient.
                weight = _clip(r.detach(), lo, hi)
                total = total + c * w * (-weight * A * (logp - old))
            elif cfg.policy_loss in ("dppo_tv", "dppo_kl"):
                # DPPO (verl's dppo_tv / dppo_kl): a detached truncated ratio on log pi, masked
                # where the probability already left the trust region in A's direction.
                prob, old_prob = math.exp(logp.item()), math.exp(old.item())
                if cfg.policy_loss == "dppo_tv":
                    keep = (prob - old_prob <= cfg.clip_high if A > 0
                            else prob - old_prob >= -cfg.clip_low)
                else:
                    kl = (old_prob * (old.item() - logp.item()) + (1 - old_prob)
                          * math.log((1 - old_prob + 1e-8) / (1 - prob + 1e-8)))
                    keep = ((kl <= cfg.clip_high or prob <= old_prob) if A > 0
                            else (kl <= cfg.clip_low or prob >= old_prob))
                truncation = cfg.clip_ratio_c if cfg.clip_ratio_c is not None else 20.0
                if keep:
                    weight = min(r.item(), truncation)
                    total = total + c * w * (-weight * A * (logp - old))
            elif cfg.policy_loss == "sapo":
                # Gao et al. 2025 (SAPO): f(r) = sigmoid(tau (r - 1)) 4 / tau, l = -f(r) A.
                tau = cfg.sapo_tau_pos if A > 0 else cfg.sapo_tau_neg
                total = total + c * w * (-torch.sigmoid(tau * (r - 1)) * 4 / tau * A)
            elif cfg.policy_loss == "gpg":
                total = total + c * w * (-A * (logp - old))
            elif cfg.policy_loss == "kl_cov":
                token_loss = -r * A
                if p in picked:
                    token_loss = token_loss + cfg.kl_cov_coef * (logp - old).abs()
                total = total + c * w * token_loss
            if cfg.kl_coef > 0:
                ref = case.reference[p]
                if cfg.kl_estimator == "k1":
                    kl = logp - ref
                elif cfg.kl_estimator == "k2":
                    kl = 0.5 * (logp - ref) ** 2
                else:
                    kl = torch.exp(ref - logp) - 1 - (ref - logp)
                total = total + cfg.kl_coef * c * kl
    return total


def _covariance_picks(case: _Case, sequences: dict, cfg: PolicyLoss.Config) -> set:
    """Clip-Cov / KL-Cov's picked tokens (Cui et al. 2025, as verl): per microbatch (a grid row
    here), cov_t = (A_t - mean A)(logp_t - mean logp) over its valid tokens; the
    max(1, int(fraction * n)) largest (Clip-Cov: among unclipped tokens inside the band)."""
    if cfg.policy_loss not in ("clip_cov", "kl_cov"):
        return set()
    rows: dict[tuple[int, ...], list[tuple[tuple[int, ...], float, float]]] = {}
    for tokens in sequences.values():
        for p, g, A in tokens:
            rows.setdefault(p[:-1], []).append((p, g, A))
    picked = set()
    for tokens in rows.values():
        n = len(tokens)
        mean_a = sum(A for _, _, A in tokens) / n
        mean_logp = sum(case.logp[p].item() for p, _, _ in tokens) / n
        candidates = []
        for p, g, A in tokens:
            cov = (A - mean_a) * (case.logp[p].item() - mean_logp)
            if cfg.policy_loss == "clip_cov":
                r = math.exp(case.logp[p].item() - g)
                clipped = -A * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high) > -A * r
                if clipped or not cfg.clip_cov_low < cov < cfg.clip_cov_high:
                    continue
            candidates.append((cov, p))
        k = min(max(int(cfg.cov_fraction * n), 1), len(candidates))
        picked |= {p for _, p in sorted(candidates, reverse=True)[:k]}
    return picked


def _value_and_grad(case: _Case, loss: torch.Tensor) -> tuple[float, torch.Tensor]:
    case.logp.grad = None
    loss.backward()
    grad = case.logp.grad.clone()
    case.logp.grad = None
    return loss.item(), grad


AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                "seq-mean-token-sum-norm")
CONFIGS = [
    *(dict(policy_loss="ppo_clip", aggregation=a) for a in AGGREGATIONS),
    dict(policy_loss="ppo_clip", clip_high=0.28, clip_ratio_c=1.5),
    dict(policy_loss="ppo_clip", tis_cap=1.3),
    dict(policy_loss="ppo_clip", ratio_reference="trainer", aggregation="seq-mean-token-mean"),
    dict(policy_loss="gspo", aggregation="seq-mean-token-mean", clip_low=0.05, clip_high=0.08),
    dict(policy_loss="gspo", aggregation="token-mean", clip_low=0.05, clip_high=0.08),
    dict(policy_loss="cispo", clip_low=0.5, clip_high=0.3),
    dict(policy_loss="cispo", aggregation="seq-mean-token-sum-norm", norm_length=40),
    *(dict(policy_loss="ppo_clip", kl_coef=0.3, kl_estimator=k) for k in ("k1", "k2", "k3")),
    dict(policy_loss="gspo", aggregation="seq-mean-token-mean", kl_coef=0.1, kl_estimator="k3"),
    dict(policy_loss="dppo_tv", clip_low=0.05, clip_high=0.08),
    dict(policy_loss="dppo_tv", clip_low=0.05, clip_high=0.08, clip_ratio_c=1.2,
         aggregation="seq-mean-token-mean"),
    dict(policy_loss="dppo_kl", clip_low=0.01, clip_high=0.02),
    dict(policy_loss="sapo", aggregation="seq-mean-token-mean"),
    dict(policy_loss="sapo", sapo_tau_pos=3.0, sapo_tau_neg=0.5),
    dict(policy_loss="gmpo", aggregation="seq-mean-token-mean", clip_low=0.4, clip_high=0.4),
    dict(policy_loss="gmpo", aggregation="token-mean", clip_low=0.1, clip_high=0.2),
    dict(policy_loss="clip_cov", cov_fraction=0.4, clip_cov_low=0.01, clip_cov_high=5.0),
    dict(policy_loss="kl_cov", cov_fraction=0.3, kl_cov_coef=2.0),
    dict(policy_loss="gpg"),
    dict(policy_loss="gpg", aggregation="seq-mean-token-sum"),
]


@pytest.mark.parametrize("overrides", CONFIGS, ids=lambda o: "-".join(
    f"{k}={v}" for k, v in o.items()))
def test_loss_matches_its_equation_in_value_and_gradient(overrides: dict) -> None:
    cfg = PolicyLoss.Config(**overrides)
    for seed in range(3):
        case = _Case(seed)
        value, grad = _value_and_grad(case, case.product_loss(cfg))
        ref_value, ref_grad = _value_and_grad(case, _reference_loss(case, cfg))
        assert math.isfinite(value)
        assert grad.abs().sum() > 0
        if cfg.policy_loss != "cispo":
            assert value == pytest.approx(ref_value, rel=1e-5, abs=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_some_tokens_clip_in_the_random_cases() -> None:
    """The cases above would not test the clip if no ratio left [0.8, 1.2]."""
    case = _Case(0)
    valid = case.batch.loss_mask & torch.isfinite(case.batch.generator_logprobs)
    ratio = torch.exp(case.logp.detach() - case.batch.generator_logprobs)[valid]
    assert ((ratio < 0.8) | (ratio > 1.2)).any() and ((ratio > 0.8) & (ratio < 1.2)).any()


@pytest.mark.parametrize("overrides", [c for c in CONFIGS if c["policy_loss"] in (
    "dppo_tv", "dppo_kl", "gmpo", "clip_cov", "kl_cov")], ids=lambda o: o["policy_loss"])
def test_the_new_losses_mask_some_tokens_and_not_all_in_the_random_cases(overrides) -> None:
    """Their equations above would not test the masks and picks if none (or all) were taken."""
    cfg = PolicyLoss.Config(**overrides)
    taken = valid = 0.0
    for seed in range(3):
        case = _Case(seed)
        b = case.batch
        for index in range(b.num_microbatches):
            data = b.microbatch(index, 0)
            _, sums, _ = cfg.build()(
                case.logp[index, 0].detach(), generator_logprobs=data["generator_logprobs"],
                advantages=data["advantages"], loss_mask=data["loss_mask"],
                num_global_valid_tokens=b.num_valid_tokens,
                num_global_valid_sequences=b.num_valid_sequences,
                document_ids=data["document_ids"],
                sequence_valid_tokens=data["sequence_valid_tokens"])
            taken += float(sums["clipped"])
            valid += float(sums["num_valid_tokens"])
    assert 0 < taken < valid


def test_cispo_value_is_the_formula_on_log_pi_up_to_the_old_logprobs() -> None:
    cfg = PolicyLoss.Config(policy_loss="cispo")
    case = _Case(1)
    value = case.product_loss(cfg).item()
    # l_t on log pi_t itself: - clip(r) A log pi; the product's log(pi / pi_old) adds
    # + clip(r) A log pi_old per token.
    b = case.batch
    valid = b.loss_mask & torch.isfinite(b.generator_logprobs)
    r = torch.exp(case.logp.detach() - b.generator_logprobs).clamp(0.8, 1.2)
    on_log_pi = (-(r * b.advantages * case.logp.detach())[valid]).sum() / b.num_valid_tokens
    constant = ((r * b.advantages * b.generator_logprobs)[valid]).sum() / b.num_valid_tokens
    assert value == pytest.approx((on_log_pi + constant).item(), rel=1e-5)


def test_gspo_equals_token_ppo_when_every_sequence_has_one_token() -> None:
    for seed, aggregation in itertools.product(range(3), AGGREGATIONS):
        case = _Case(seed, one_token=True, nan_rate=0.0)
        common = dict(aggregation=aggregation, clip_low=0.1, clip_high=0.15)
        gspo = _value_and_grad(case, case.product_loss(PolicyLoss.Config(policy_loss="gspo",
                                                                         **common)))
        ppo = _value_and_grad(case, case.product_loss(PolicyLoss.Config(policy_loss="ppo_clip",
                                                                        **common)))
        assert gspo[0] == pytest.approx(ppo[0], rel=1e-6)
        torch.testing.assert_close(gspo[1], ppo[1])


def test_dr_grpo_aggregation_is_a_constant_per_token() -> None:
    """seq-mean-token-sum-norm: every unclipped token's gradient is -A / (N_seqs * L), whatever its
    sequence's length (token-mean-per-sequence would give -A / (N_seqs * T_i))."""
    case = _Case(2, nan_rate=0.0)
    cfg = PolicyLoss.Config(aggregation="seq-mean-token-sum-norm", norm_length=100,
                            ratio_reference="trainer")
    _, grad = _value_and_grad(case, case.product_loss(cfg))
    b = case.batch
    expected = torch.where(b.loss_mask, -b.advantages / (b.num_valid_sequences * 100), 0.0)
    torch.testing.assert_close(grad, expected)
    assert len({len(s.token_ids) for s in case.samples}) > 1


def test_step_loss_is_the_same_however_the_batch_is_split() -> None:
    """Global counts: one row per microbatch or all rows in one microbatch, same loss."""
    rng = random.Random(5)
    samples = _random_samples(rng, num=9)
    for aggregation in AGGREGATIONS:
        cfg = PolicyLoss.Config(aggregation=aggregation)
        values = []
        for rows in (1, 8):
            batch = Batcher.Config(seq_len=SEQ_LEN, rows_per_microbatch=rows).build().pack(samples)
            logp = torch.nan_to_num(batch.generator_logprobs, nan=-1.0) * 1.1
            total = 0.0
            for index in range(batch.num_microbatches):
                data = batch.microbatch(index, 0)
                loss, _, _ = cfg.build()(
                    logp[index, 0], generator_logprobs=data["generator_logprobs"],
                    advantages=data["advantages"], loss_mask=data["loss_mask"],
                    num_global_valid_tokens=batch.num_valid_tokens,
                    num_global_valid_sequences=batch.num_valid_sequences,
                    document_ids=data["document_ids"],
                    sequence_valid_tokens=data["sequence_valid_tokens"])
                total += loss.item()
            values.append(total)
        assert batch.num_microbatches == 1
        assert values[0] == pytest.approx(values[1], rel=1e-5), aggregation


def test_kl_estimators_k2_k3_are_nonnegative_and_k1_k3_unbiased() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(10_000, generator=gen) * 2
    ref = torch.randn(10_000, generator=gen) * 2
    assert (token_kl(logp, ref, "k2") >= 0).all()
    assert (token_kl(logp, ref, "k3") >= 0).all()
    assert (token_kl(logp, ref, "k1") < 0).any()
    # Sampling x ~ p = N(0, 1) over 3 outcomes' logits: E_p[k1] = E_p[k3] = KL(p || q).
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    exact = float((p * (p / q).log()).sum())
    for estimator in ("k1", "k3"):
        expectation = float((p * token_kl(p.log(), q.log(), estimator)).sum())
        assert expectation == pytest.approx(exact, rel=1e-6)


def test_loss_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="policy_loss must be one of"):
        PolicyLoss.Config(policy_loss="ppo")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        PolicyLoss.Config(aggregation="seq-mean")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLoss.Config(clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLoss.Config(policy_loss="gspo", clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        PolicyLoss.Config(kl_coef=-1.0)
    with pytest.raises(ValueError, match="kl_estimator"):
        PolicyLoss.Config(kl_estimator="k4")


def test_clip_cov_takes_a_few_unclipped_tokens_out_of_ppo_clip() -> None:
    """Clip-Cov is PPO-clip except on its picked tokens, whose gradient it zeroes."""
    case = _Case(0, nan_rate=0.0)
    common = dict(clip_low=0.2, clip_high=0.2)
    _, ppo = _value_and_grad(case, case.product_loss(PolicyLoss.Config(**common)))
    _, cov = _value_and_grad(case, case.product_loss(PolicyLoss.Config(
        policy_loss="clip_cov", cov_fraction=0.4, clip_cov_low=0.01, **common)))
    changed = (ppo != cov)
    assert changed.any() and (cov[changed] == 0).all()
    assert int(changed.sum()) < int((ppo != 0).sum())


def test_k3_is_capped_in_value_and_gradient() -> None:
    """k3 = exp(x) - 1 - x at x = ref - logp; verl clamps it at 10: above, value 10 and no
    gradient; below, untouched."""
    logp = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    ref = torch.tensor([0.5, 3.0, -12.0])  # k3: 0.1487, 16.09, 11.0
    kl = token_kl(logp, ref, "k3", k3_cap=10.0)
    kl.sum().backward()
    assert kl.tolist() == pytest.approx([math.exp(0.5) - 1.5, 10.0, 10.0], rel=1e-6)
    # d k3 / d logp = 1 - exp(x) below the cap, 0 above it.
    assert logp.grad.tolist() == pytest.approx([1 - math.exp(0.5), 0.0, 0.0], rel=1e-6)
    uncapped = token_kl(logp.detach(), ref, "k3")
    assert uncapped[1].item() == pytest.approx(math.exp(3.0) - 4.0, rel=1e-6)
    assert PolicyLoss.Config().kl_k3_cap == 10.0
