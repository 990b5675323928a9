"""SYNTHETIC step logs with a known acceptance process (for tests and demos).

Nothing here comes from a model: rows are drawn from a stated generative
process so that tests can compare a learned policy with the oracle that knows
the truth. Every generated row carries ``draft_model='synthetic-draft'`` and
``target_model='synthetic-target'`` so synthetic data can never pass for real.

Process, per prompt: a latent difficulty ``u ~ N(0, 1)``; per step, the first
draft token's confidence ``c = sigmoid(mu_task + 0.8 u + 0.8 eps)`` and the
per-token acceptance probability

    alpha = sigmoid(b0 + b1 * logit(c) - b_code * code + b_u * u),

i.i.d. over the step's draft tokens, so ``P(accepted >= k) = alpha**k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..objective import CostModel, analytic_expected_tokens
from ..schema import COMPRESSION_CODES, TASK_TYPES

SYNTHETIC_DRAFT = "synthetic-draft"
SYNTHETIC_TARGET = "synthetic-target"
TASK_MU = {"code": 1.2, "math": 0.9, "chat": -0.2, "summarization": -0.4, "other": 0.2}


@dataclass(frozen=True)
class SyntheticProcess:
    """Coefficients of the synthetic acceptance process (see module docstring)."""

    b0: float = 0.2
    b1: float = 1.1
    b_code: tuple[float, float, float] = (0.0, 0.6, 1.3)
    b_u: float = 0.35

    def alpha(self, conf_first: np.ndarray, code: np.ndarray, u: np.ndarray) -> np.ndarray:
        """True per-token acceptance probability."""
        c = np.clip(conf_first, 1e-6, 1 - 1e-6)
        z = self.b0 + self.b1 * np.log(c / (1 - c)) - np.asarray(self.b_code)[code] + self.b_u * u
        return 1.0 / (1.0 + np.exp(-z))


#: Costs resembling SmolLM2-135M on 2 CPU cores with a 1/11-cost draft (ms).
SYNTHETIC_COSTS = CostModel(
    draft_ms_per_token=(5.5, 5.5, 5.5),
    verify_base_ms=(59.0, 70.0, 66.0),
    verify_ms_per_token=(3.0, 4.0, 4.5),
    device="synthetic",
)


def _entropy_from_conf(conf: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # residual mass spread over a random number of alternatives (2..200 tokens)
    k = rng.integers(2, 200, size=conf.shape)
    rest = np.clip(1.0 - conf, 1e-12, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(conf * np.log(conf)) - rest * np.log(rest / k)
    return np.maximum(h, 0.0)


def generate_synthetic_log(
    n_prompts: int = 60,
    steps_per_prompt: int = 30,
    *,
    gamma_max: int = 8,
    compressions: tuple[str, ...] = ("fp16", "int8", "nf4"),
    calibration_fraction: float = 0.15,
    heldout_fraction: float = 0.25,
    process: SyntheticProcess = SyntheticProcess(),
    costs: CostModel = SYNTHETIC_COSTS,
    timing_noise: float = 0.05,
    seed: int = 0,
) -> tuple[pd.DataFrame, pd.Series]:
    """Draw a SYNTHETIC step log and the true acceptance of each row.

    Most steps draft ``gamma_max`` tokens (as ``speckv-profile`` does); a
    ``calibration_fraction`` draft a uniform gamma in 0..gamma_max so that the
    verify cost can be fitted against gamma.

    Returns
    -------
    log : pandas.DataFrame
        Rows in the step-log schema, labelled synthetic in the model columns.
    alpha : pandas.Series
        True per-token acceptance probability per row (same index).
    """
    rng = np.random.default_rng(seed)
    # the pre-draft signals come from their own stream, so the rest of the log is what it was before they existed
    sig = np.random.default_rng([seed, 1])
    tasks = [t for t in TASK_TYPES if t != "other"]
    records: list[dict] = []
    alphas: list[float] = []
    n_held = int(round(heldout_fraction * n_prompts))
    held = set(rng.choice(n_prompts, size=n_held, replace=False).tolist())
    for p in range(n_prompts):
        task = tasks[p % len(tasks)]
        u = rng.normal()
        split = "heldout" if p in held else "train"
        for comp in compressions:
            code = COMPRESSION_CODES[comp]
            decoding = "greedy" if rng.random() < 0.5 else "sampling"
            temp = 0.7 if decoding == "sampling" else 0.0
            ctx = int(rng.integers(20, 400))
            t_conf, t_ent = 0.0, 0.0  # before the first verification
            for step in range(steps_per_prompt):
                gamma = gamma_max
                if rng.random() < calibration_fraction:
                    gamma = int(rng.integers(0, gamma_max + 1))
                c1 = 1.0 / (1.0 + math.exp(-(TASK_MU[task] + 0.8 * u + 0.8 * rng.normal())))
                a = float(process.alpha(np.array([c1]), np.array([code]), np.array([u]))[0])
                # acceptance: i.i.d. Bernoulli(alpha) until the first rejection
                draws = rng.random(gamma) < a
                accepted = int(np.argmin(draws)) if not draws.all() else gamma
                later = 1.0 / (1.0 + np.exp(-(TASK_MU[task] + 0.8 * u + 0.8 * rng.normal(size=max(gamma - 1, 0)))))
                conf = np.concatenate([[c1], later])[:gamma]
                ent = _entropy_from_conf(conf, rng)
                tok_p = np.where(rng.random(gamma) < 0.8, conf, conf * rng.random(gamma))
                noise = rng.lognormal(0.0, timing_noise, size=2)
                # SYNTHETIC signals: the context match tracks the step's acceptance (noisily), no ground truth role
                match = int(np.clip(round(a * 8 + sig.normal(0, 1.5)), 0, 8))
                records.append(
                    {
                        "run_id": f"synthetic-{seed}-{comp}",
                        "prompt_id": f"p{p:04d}",
                        "split": split,
                        "task_type": task,
                        "compression": comp,
                        "decoding": decoding,
                        "temperature": temp if decoding == "sampling" else 0.0,
                        "top_p": 1.0,
                        "step": step,
                        "context_len": ctx,
                        "gamma": gamma,
                        "accepted": accepted,
                        "draft_confidence": conf.tolist(),
                        "draft_entropy": ent.tolist(),
                        "draft_token_prob": tok_p.tolist(),
                        "draft_ms": float(gamma * costs.draft_ms_per_token[code] * noise[0]),
                        "verify_ms": float(
                            (costs.verify_base_ms[code] + costs.verify_ms_per_token[code] * gamma) * noise[1]
                        ),
                        "device": "synthetic",
                        "draft_model": SYNTHETIC_DRAFT,
                        "target_model": SYNTHETIC_TARGET,
                        "target_confidence": t_conf,
                        "target_entropy": t_ent,
                        "context_match_len": float(match),
                    }
                )
                # the target's confidence at the last verified position, seen by the next step: tracks u
                t_conf = 1.0 / (1.0 + math.exp(-(TASK_MU[task] + 0.8 * u + 0.8 * sig.normal())))
                t_ent = float(_entropy_from_conf(np.array([t_conf]), sig)[0])
                alphas.append(a)
                ctx += accepted + 1
    log = pd.DataFrame.from_records(records)
    return log, pd.Series(alphas, index=log.index, name="alpha")


def true_throughput(
    chosen: np.ndarray, alpha: np.ndarray, codes: np.ndarray, costs: CostModel = SYNTHETIC_COSTS
) -> float:
    """Expected tokens/s of choices under the true process (sum E / sum time)."""
    e = analytic_expected_tokens(alpha, chosen)
    t = costs.step_ms(chosen, codes)
    return float(1000.0 * e.sum() / t.sum())


def oracle_choices(
    alpha: np.ndarray, codes: np.ndarray, candidates: np.ndarray, costs: CostModel = SYNTHETIC_COSTS
) -> np.ndarray:
    """Per row, the candidate with the highest true expected tokens/s."""
    c = np.asarray(candidates)
    e = analytic_expected_tokens(np.asarray(alpha)[:, None], c[None, :])
    t = costs.step_ms(c[None, :], np.asarray(codes)[:, None])
    return c[np.argmax(e / t, axis=1)]
