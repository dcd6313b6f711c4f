"""The off-policy correction menu (trainer/off_policy.py) against its equations, written here as
plain loops over samples and tokens (no code shared with the product), on random packed batches;
a hand-worked case for the mismatch metrics; and the identities: a cap of infinity is plain
importance sampling, all ratios 1 is on-policy, "off" is the uncorrected loss bit for bit."""

from __future__ import annotations

import dataclasses
import logging
import math
import random

import pytest
import torch

from torchtitan_rl.trainer.batcher import Batcher
from torchtitan_rl.trainer.loss import MAX_KEYS, SUM_KEYS, PolicyLoss, finalize_loss_metrics
from torchtitan_rl.trainer.off_policy import OffPolicyCorrection, token_tis, turn_indices
from torchtitan_rl.types import TrainingSample

SEQ_LEN = 32
C = OffPolicyCorrection.Config
NO_MASKS = dict(token_mask_low=None, token_mask_high=None)


class _Case:
    """Random samples packed one row per microbatch; the trainer's logprobs drift from the
    generator's by N(0, 0.5) nats, and by +-2.5 more on one token in ten (so masks bite)."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.samples = []
        for i in range(8):
            prompt, completion = rng.randint(1, 4), rng.randint(1, 14)
            n = prompt + completion
            advantage = rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 2.0)
            self.samples.append(TrainingSample(
                sample_id=f"s{i}", group_id=0, token_ids=[rng.randint(1, 50) for _ in range(n)],
                loss_mask=[0] * prompt + [1] * completion,
                generator_logprobs=[0.0] * prompt + [
                    float("nan") if rng.random() < 0.05 else -rng.uniform(0.05, 3.0)
                    for _ in range(completion)],
                advantages=[0.0] * prompt + [advantage] * completion,
                policy_versions=[-1] * prompt + [0] * completion))
        self.batch = Batcher.Config(seq_len=SEQ_LEN).build(dp_size=1).pack(self.samples)
        gen = torch.Generator().manual_seed(seed)
        shape = self.batch.labels.shape
        noise = torch.randn(shape, generator=gen) * 0.5
        jumps = (torch.rand(shape, generator=gen) < 0.1) * torch.where(
            torch.rand(shape, generator=gen) < 0.5, -2.5, 2.5)
        base = torch.nan_to_num(self.batch.generator_logprobs, nan=-1.0)
        self.logp = (base + noise + jumps).detach().requires_grad_(True)

    def tokens(self) -> dict[int, list[tuple[tuple[int, ...], float, float]]]:
        """sample -> [(grid position, log r, A)] over its valid tokens."""
        b, out = self.batch, {}
        valid = b.loss_mask & torch.isfinite(b.generator_logprobs)
        for position in valid.nonzero().tolist():
            p = tuple(position)
            out.setdefault(int(b.document_ids[p]), []).append(
                (p, self.logp[p].item() - b.generator_logprobs[p].item(),
                 b.advantages[p].item()))
        return out

    def loss_and_grad(self, config: PolicyLoss.Config) -> tuple[float, torch.Tensor, dict]:
        loss_fn = config.build()
        b, total = self.batch, torch.zeros(())
        sums = dict.fromkeys(SUM_KEYS, 0.0)
        maxima = dict.fromkeys(MAX_KEYS, 0.0)
        for index in range(b.num_microbatches):
            data = b.microbatch(index, 0)
            loss, mb_sums, mb_max = loss_fn(
                self.logp[index, 0], generator_logprobs=data["generator_logprobs"],
                advantages=data["advantages"], loss_mask=data["loss_mask"],
                num_global_valid_tokens=b.num_valid_tokens,
                num_global_valid_sequences=b.num_valid_sequences,
                document_ids=data["document_ids"],
                sequence_valid_tokens=data["sequence_valid_tokens"],
                policy_versions=data["policy_versions"], policy_version=0,
                positions=data["positions"])
            total = total + loss
            for k in SUM_KEYS:
                sums[k] += float(mb_sums[k])
            for k in MAX_KEYS:
                maxima[k] = max(maxima[k], float(mb_max[k]))
        self.logp.grad = None
        total.backward()
        grad = self.logp.grad.clone()
        self.logp.grad = None
        return total.item(), grad, finalize_loss_metrics(sums, maxima)


def _k(estimator: str, x: float) -> float:
    """Schulman's estimators of KL(generator || trainer) at x = log(pi_trainer / pi_generator)."""
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[estimator]


def _reference_factors(case: _Case, cfg: OffPolicyCorrection.Config) -> dict[tuple, float]:
    """w_t m_t of every valid token, by the module docstring's equations."""
    factors, kept = {}, {}
    for tokens in case.tokens().values():
        xs = [x for _, x, _ in tokens]
        T = len(xs)
        if cfg.is_level == "token":
            raw = [math.exp(x) for x in xs]
        elif cfg.is_level == "sequence":
            raw = [math.exp(max(-20.0, min(20.0, sum(xs))))] * T
        elif cfg.is_level == "geometric":
            raw = [math.exp(sum(xs) / T)] * T
        else:
            raw = [1.0] * T
        weights = [min(w, cfg.is_cap) if cfg.is_cap is not None else w for w in raw]
        sequence_ratio = math.exp(sum(xs) / T if cfg.seq_mask_metric == "geometric" else sum(xs))
        sequence_keep = ((cfg.seq_mask_low is None or sequence_ratio >= cfg.seq_mask_low)
                         and (cfg.seq_mask_high is None or sequence_ratio <= cfg.seq_mask_high))
        mean_k1 = sum(_k("k1", x) for x in xs) / T
        for (p, x, A), w in zip(tokens, weights):
            r = math.exp(x)
            keep = sequence_keep
            keep &= cfg.token_mask_low is None or r >= cfg.token_mask_low
            keep &= cfg.token_mask_high is None or r <= cfg.token_mask_high
            for option, tau in cfg.thresholds().items():
                level, estimator = option.rsplit("_", 1)
                values = [_k(estimator, y) for y in xs]
                stat = {"token": _k(estimator, x), "seq_sum": sum(values),
                        "seq_mean": sum(values) / T,
                        "seq_max": max(abs(v) if estimator == "k1" else v for v in values)}[level]
                keep &= (abs(stat) if estimator == "k1" else stat) <= tau
            if cfg.opsm_threshold is not None and A < 0 and mean_k1 > cfg.opsm_threshold:
                keep = False
            factors[p] = w if keep else 0.0
            kept[p] = keep
    if cfg.batch_normalize:  # over each microbatch (a grid row here)
        rows: dict[tuple, list[tuple]] = {}
        for p in factors:
            rows.setdefault(p[:-1], []).append(p)
        for positions in rows.values():
            kept_positions = [p for p in positions if kept[p]]
            if cfg.is_level in ("sequence", "geometric"):
                by_sequence: dict[int, list[float]] = {}
                for p in kept_positions:
                    by_sequence.setdefault(int(case.batch.document_ids[p]), []).append(
                        factors[p])
                means = [sum(v) / len(v) for v in by_sequence.values()]
                mean = sum(means) / len(means) if means else 1.0
            else:
                mean = (sum(factors[p] for p in kept_positions) / len(kept_positions)
                        if kept_positions else 1.0)
            for p in positions:
                factors[p] /= mean
    return factors


REJECT_THRESHOLDS = {"token_k1": 0.5, "token_k2": 0.1, "token_k3": 0.1, "seq_sum_k1": 1.0,
                     "seq_sum_k2": 0.8, "seq_sum_k3": 0.8, "seq_mean_k1": 0.2,
                     "seq_mean_k2": 0.1, "seq_mean_k3": 0.1, "seq_max_k1": 1.5,
                     "seq_max_k2": 0.5, "seq_max_k3": 0.5}
MENU = [
    C(enabled="on"),  # the default when tokens can be off-policy: token TIS + IcePop mask
    C(enabled="on", is_level="sequence", is_cap=3.0, **NO_MASKS),
    C(enabled="on", is_level="geometric", is_cap=1.2, **NO_MASKS),
    C(enabled="on", is_level="geometric", is_cap=None, seq_mask_low=0.8, seq_mask_high=1.25,
      **NO_MASKS),  # seq-mask-tis
    C(enabled="on", is_level="sequence", is_cap=None, seq_mask_high=3.0, seq_mask_metric="product",
      **NO_MASKS),  # TRL's sequence_mask
    C(enabled="on", is_cap=None, token_mask_low=0.5, token_mask_high=2.0),  # IcePop, untruncated
    *(C(enabled="on", is_level="none", reject=[o], reject_threshold=[t], **NO_MASKS)
      for o, t in REJECT_THRESHOLDS.items()),
    C(enabled="on", reject=["token_k3", "seq_mean_k1"], reject_threshold=[0.3, 0.2]),
    C(enabled="on", reject=["token_k2", "seq_max_k3"], reject_threshold=[0.2]),
    C(enabled="on", is_level="none", opsm_threshold=0.05, **NO_MASKS),
    C(enabled="on", batch_normalize=True),
    C(enabled="on", is_level="sequence", is_cap=5.0, batch_normalize=True, **NO_MASKS),
]


def _name(cfg: OffPolicyCorrection.Config) -> str:
    fields = dataclasses.asdict(cfg)
    default = dataclasses.asdict(C(enabled="on"))
    return "-".join(f"{k}={v}" for k, v in fields.items() if v != default[k]) or "default"


@pytest.mark.parametrize("correction", MENU, ids=_name)
def test_each_option_weighs_and_masks_as_its_equation(correction) -> None:
    """With the correction on the PPO ratio is 1 (one update per batch), so the gradient of
    token t is -w_t m_t A_t / N: the factor, token by token."""
    masked_somewhere = unmasked_somewhere = False
    for seed in range(3):
        case = _Case(seed)
        _, grad, metrics = case.loss_and_grad(PolicyLoss.Config(off_policy=correction))
        factors = _reference_factors(case, correction)
        expected = torch.zeros_like(grad)
        n = case.batch.num_valid_tokens
        for p, f in factors.items():
            expected[p] = -f * case.batch.advantages[p].item() / n
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
        masked = sum(f == 0.0 for f in factors.values())
        masked_somewhere |= masked > 0
        unmasked_somewhere |= masked < len(factors)
        assert metrics["mismatch/masked_token_frac"] == pytest.approx(masked / n)
        if not correction.batch_normalize:
            assert metrics["mismatch/weight_mean"] == pytest.approx(sum(factors.values()) / n,
                                                                    rel=1e-5)
    assert unmasked_somewhere
    has_mask = (correction.reject or correction.opsm_threshold is not None
                or correction.token_mask_low is not None or correction.seq_mask_low is not None
                or correction.seq_mask_high is not None)
    assert masked_somewhere == bool(has_mask), "the random cases must exercise the mask"


def test_a_cap_of_infinity_is_plain_importance_sampling() -> None:
    """Uncorrected PPO against the generator, its clip out of reach, has gradient
    -r_t A_t / N: the same as the correction's untruncated token weight r_t."""
    wide = dict(clip_low=0.999999, clip_high=1e9)
    for seed in range(3):
        case = _Case(seed)
        _, uncorrected, _ = case.loss_and_grad(PolicyLoss.Config(**wide))
        _, corrected, _ = case.loss_and_grad(PolicyLoss.Config(
            off_policy=C(enabled="on", is_cap=None, **NO_MASKS), **wide))
        torch.testing.assert_close(corrected, uncorrected, rtol=1e-5, atol=1e-7)


def test_all_ratios_one_is_on_policy_bit_for_bit() -> None:
    case = _Case(0)
    with torch.no_grad():
        case.logp.copy_(torch.nan_to_num(case.batch.generator_logprobs, nan=-1.0))
    off_loss, off_grad, _ = case.loss_and_grad(PolicyLoss.Config())
    for correction in MENU:
        on_loss, on_grad, metrics = case.loss_and_grad(PolicyLoss.Config(off_policy=correction))
        assert on_loss == off_loss
        assert torch.equal(on_grad, off_grad)
        assert metrics["mismatch/k3_token_mean"] == 0.0
        assert metrics["mismatch/masked_token_frac"] == 0.0


def test_off_and_unresolved_auto_are_the_uncorrected_loss_bit_for_bit() -> None:
    """At S = 0 the job resolves the correction to "off" (a bare loss reads "auto" as off):
    whatever the menu says, the loss is the one without it; its metrics still come, saying
    what the menu would do."""
    case = _Case(1)
    base = case.loss_and_grad(PolicyLoss.Config(off_policy=C(enabled="off")))
    everything = C(enabled="off", is_cap=1.0, reject=["token_k3"], reject_threshold=[1e-9])
    for correction in (C(), everything):
        loss, grad, metrics = case.loss_and_grad(PolicyLoss.Config(off_policy=correction))
        assert loss == base[0] and torch.equal(grad, base[1])
        assert metrics["mismatch/k3_token_mean"] > 0
        assert metrics["loss/tis_weight_mean"] == 1.0  # nothing weighted in the loss
    assert metrics["mismatch/masked_token_frac"] == 1.0  # what the menu would have masked


def test_the_deprecated_tis_cap_is_token_tis_with_one_warning(caplog) -> None:
    case = _Case(2)
    with caplog.at_level(logging.WARNING):
        old = PolicyLoss.Config(tis_cap=1.5)
        again = dataclasses.replace(old, clip_high=0.2)
    assert [r.getMessage() for r in caplog.records].count(
        "trainer.loss.tis_cap is deprecated: read as trainer.loss.off_policy.enabled = 'on', "
        "is_level = 'token', is_cap = 1.5, no masks") == 1
    assert old.off_policy == again.off_policy == token_tis(1.5) and old.tis_cap is None
    new = PolicyLoss.Config(off_policy=token_tis(1.5))
    a, b = case.loss_and_grad(old), case.loss_and_grad(new)
    assert a[0] == b[0] and torch.equal(a[1], b[1])


# One packed row, two samples: sample 0 (positions 0-4) samples the tokens after positions 1, 2
# (turn 0) and 4 (turn 1); sample 1 (positions 0-2) the one after position 1 (turn 0).
# The trainer gives every token 0.5; the generator gave them 0.25, 1.0, 0.5, 0.5 / 16:
# log r = ln 2, ln 0.5, 0, ln 16, sampled at versions 5, 4, 4, 3 (ages 0, 1, 1, 2 at version 5).
LN2 = math.log(2)
HAND = dict(
    mask=[0, 1, 1, 0, 1, 0, 1, 0], positions=[0, 1, 2, 3, 4, 0, 1, 2],
    documents=[0, 0, 0, 0, 0, 1, 1, 1],
    gen=[0.0, math.log(0.25), 0.0, 0.0, math.log(0.5), 0.0, math.log(0.5 / 16), 0.0],
    advantages=[0.0, 1.0, -1.0, 0.0, -1.0, 0.0, 2.0, 0.0],
    versions=[-1, 5, 4, -1, 4, -1, 3, -1])


def _hand_run(correction: OffPolicyCorrection.Config) -> tuple[torch.Tensor, dict[str, float]]:
    logp = torch.full((1, 8), math.log(0.5), requires_grad=True)
    t = {k: torch.tensor([v]) for k, v in HAND.items()}
    loss, sums, maxima = PolicyLoss.Config(off_policy=correction).build()(
        logp, generator_logprobs=t["gen"].float(), advantages=t["advantages"].float(),
        loss_mask=t["mask"].bool(), num_global_valid_tokens=4, num_global_valid_sequences=2,
        document_ids=t["documents"], sequence_valid_tokens=torch.tensor([[3] * 5 + [1] * 3]),
        policy_versions=t["versions"], policy_version=5, positions=t["positions"])
    loss.backward()
    metrics = finalize_loss_metrics({k: float(sums[k]) for k in SUM_KEYS},
                                    {k: float(maxima[k]) for k in MAX_KEYS})
    return logp.grad[0], metrics


def test_the_mismatch_metrics_on_a_hand_worked_row() -> None:
    grad, m = _hand_run(C(enabled="on"))
    # Default menu: weights min(r, 2) = 2, 0.5, 1, 2; r = 16 > 8 is masked (IcePop).
    # d loss / d logp = -w m A / N, N = 4.
    torch.testing.assert_close(grad, torch.tensor([0, -0.5, 0.125, 0, 0.25, 0, 0, 0]))
    k3 = [2 - 1 - LN2, 0.5 - 1 + LN2, 0.0, 16 - 1 - 4 * LN2]
    expected = {
        "mismatch/k1_token_mean": (-LN2 + LN2 + 0 - 4 * LN2) / 4,
        "mismatch/k3_token_mean": sum(k3) / 4,
        "mismatch/k3_token_max": k3[3],
        "mismatch/k1_seq_max": 4 * LN2,  # |mean k1|: sample 0: 0, sample 1: ln 16
        "mismatch/k3_seq_max": k3[3],  # mean k3: sample 0: (k3_0 + k3_1 + 0) / 3, sample 1: k3_3
        "mismatch/masked_token_frac": 1 / 4,
        "mismatch/masked_seq_frac": 1 / 2,
        "mismatch/token_mask_frac": 1 / 4,
        "mismatch/rejected_token_frac": 0.0,
        "mismatch/capped_token_frac": 1 / 4,  # r = 2 is at the cap, not above it
        "mismatch/weight_mean": (2 + 0.5 + 1 + 0) / 4,
        "mismatch/weight_max": 2.0,
        "mismatch/ratio_max": 16.0,
        "mismatch/age_0/num_tokens": 1.0,
        "mismatch/age_0/k1_token_mean": -LN2,
        "mismatch/age_0/weight_mean": 2.0,
        "mismatch/age_1/num_tokens": 2.0,
        "mismatch/age_1/k3_token_mean": k3[1] / 2,
        "mismatch/age_1/weight_mean": 0.75,
        "mismatch/age_2/masked_token_frac": 1.0,
        "mismatch/turn_0/num_tokens": 3.0,
        "mismatch/turn_0/masked_token_frac": 1 / 3,
        "mismatch/turn_1/num_tokens": 1.0,
        "mismatch/turn_1/k3_token_mean": 0.0,
        "loss/tis_weight_mean": 3.5 / 4,
        "loss/tis_capped_frac": 1 / 4,
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert "mismatch/age_3/num_tokens" not in m and "mismatch/turn_2/num_tokens" not in m
    # OPSM: sample 0 has mean k1 0 (kept), sample 1 has A > 0 (kept): nothing masked at 0.5.
    _, m = _hand_run(C(enabled="on", is_level="none", opsm_threshold=0.5, **NO_MASKS))
    assert m["mismatch/opsm_token_frac"] == 0.0
    # seq_max_k3 at 1: sample 1 (k3 12.2) is rejected whole, sample 0 (max 0.31) kept.
    grad, m = _hand_run(C(enabled="on", is_level="none", reject=["seq_max_k3"],
                          reject_threshold=[1.0], **NO_MASKS))
    assert m["mismatch/rejected_token_frac"] == 1 / 4 and m["mismatch/masked_seq_frac"] == 0.5
    torch.testing.assert_close(grad, torch.tensor([0, -0.25, 0.25, 0, 0.25, 0, 0, 0]))


def test_turns_are_the_sampled_spans_of_each_sample() -> None:
    turns = turn_indices(torch.tensor([HAND["mask"]]), torch.tensor([HAND["positions"]]))
    mask = torch.tensor(HAND["mask"]).bool()
    assert turns[0][mask].tolist() == [0, 0, 1, 0]
    # Two samples back to back, each with three spans.
    mask = torch.tensor([[1, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1]])
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])
    assert turn_indices(mask, positions)[mask.bool()].tolist() == [0, 1, 1, 2, 0, 1, 2]


def test_correction_config_errors_name_the_key() -> None:
    for kwargs, message in [
        (dict(enabled="yes"), "loss.off_policy.enabled must be"),
        (dict(is_level="seq"), "loss.off_policy.is_level must be"),
        (dict(is_cap=0.5), "loss.off_policy.is_cap must be >= 1"),
        (dict(token_mask_low=2.0, token_mask_high=1.0), "token_mask_high must be > "),
        (dict(seq_mask_low=0.0), "seq_mask_low must be > 0"),
        (dict(reject=["token_k4"]), "reject: unknown option 'token_k4'"),
        (dict(reject=["token_k1", "seq_max_k2"], reject_threshold=[1.0, 2.0, 3.0]),
         "reject_threshold needs 1 or 2 values"),
        (dict(reject_threshold=[1.0]), "reject is empty"),
        (dict(reject=["token_k1"], reject_threshold=[0.0]), "reject_threshold must be > 0"),
        (dict(opsm_threshold=-1.0), "opsm_threshold must be > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            C(**kwargs)
