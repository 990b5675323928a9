"""MLP policy: a torch network trained on censored acceptance labels."""

from __future__ import annotations

from numbers import Integral, Real
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils import check_random_state

from ..objective import survival_observations
from ._sklearn_compat import Interval
from .base import GammaPolicy, shared_parameters_doc


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


@shared_parameters_doc
class MLPPolicy(GammaPolicy, BaseEstimator):
    """Multi-layer perceptron over step features, trained in torch.

    The network outputs one logit per draft position ``k = 1..max_gamma``:
    the conditional acceptance ``P(accepted >= k | accepted >= k-1, x)``.
    Their cumulative product is the survival curve ``P(accepted >= k | x)``,
    monotone by construction. The loss is binary cross-entropy over the
    positions each logged step actually observed (censoring-aware).

    Parameters
    ----------
    {shared_parameters}
    hidden_layer_sizes : tuple of int, default=(32, 32)
        Width of each hidden ReLU layer.
    alpha : float, default=1e-4
        L2 weight decay (AdamW).
    learning_rate : float, default=1e-2
        Adam learning rate (full-batch).
    max_iter : int, default=400
        Full-batch optimisation steps.
    random_state : int, RandomState or None, default=0
        Seed for weight initialisation.

    Attributes
    ----------
    coefs_, intercepts_ : list of ndarray
        Layer weights ``(in, out)`` and biases, numpy (no torch at predict).
    mean_, scale_ : ndarray
        Input standardisation.
    candidates_ : ndarray
        Sorted candidate gammas.
    cost_model_ : CostModel
        The cost model in use.
    training_fingerprint_ : str
        Hash of the training data, written into exported models.
    """

    _parameter_constraints: dict = {
        **GammaPolicy.common_parameter_constraints,
        "hidden_layer_sizes": ["array-like"],
        "alpha": [Interval(Real, 0, None, closed="left")],
        "learning_rate": [Interval(Real, 0, None, closed="neither")],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "random_state": ["random_state"],
    }

    def __init__(
        self,
        *,
        candidates: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8),
        objective: str = "tokens_per_second",
        cost_model: Any = None,
        feature_set: str | None = "online",
        hidden_layer_sizes: tuple[int, ...] = (32, 32),
        alpha: float = 1e-4,
        learning_rate: float = 1e-2,
        max_iter: int = 400,
        random_state: Any = 0,
    ) -> None:
        self._store_shared_params(candidates, objective, cost_model, feature_set)
        self.hidden_layer_sizes = hidden_layer_sizes
        self.alpha = alpha
        self.learning_rate = learning_rate
        self.max_iter = max_iter
        self.random_state = random_state

    def _fit(self, X: np.ndarray, accepted: np.ndarray, drafted: np.ndarray) -> None:
        import torch

        sizes = [int(h) for h in self.hidden_layer_sizes]
        if any(h < 1 for h in sizes):
            raise ValueError(f"hidden_layer_sizes must be positive ints, got {self.hidden_layer_sizes!r}")
        K = self.max_gamma_
        if K < 1:
            raise ValueError("MLPPolicy needs a candidate gamma >= 1 (it models acceptance of draft tokens)")
        self.mean_ = X.mean(axis=0)
        scale = X.std(axis=0)
        self.scale_ = np.where(scale > 1e-12, scale, 1.0)
        events, at_risk = survival_observations(accepted, drafted, K)
        seed = int(check_random_state(self.random_state).randint(0, 2**31 - 1))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            dims = [X.shape[1], *sizes, K]
            layers: list[torch.nn.Module] = []
            for i in range(len(dims) - 1):
                layers.append(torch.nn.Linear(dims[i], dims[i + 1], dtype=torch.float64))
                if i < len(dims) - 2:
                    layers.append(torch.nn.ReLU())
            net = torch.nn.Sequential(*layers)
            xt = torch.from_numpy((X - self.mean_) / self.scale_)
            yt = torch.from_numpy(events)
            mt = torch.from_numpy(at_risk.astype(np.float64))
            denom = mt.sum().clamp_min(1.0)
            opt = torch.optim.AdamW(net.parameters(), lr=float(self.learning_rate), weight_decay=float(self.alpha))
            lossf = torch.nn.BCEWithLogitsLoss(reduction="none")
            self.loss_curve_ = []
            for _ in range(int(self.max_iter)):
                opt.zero_grad()
                loss = (lossf(net(xt), yt) * mt).sum() / denom
                loss.backward()
                opt.step()
                self.loss_curve_.append(float(loss.detach()))
            linears = [m for m in net if isinstance(m, torch.nn.Linear)]
            self.coefs_ = [m.weight.detach().numpy().T.copy() for m in linears]
            self.intercepts_ = [m.bias.detach().numpy().copy() for m in linears]
        self.n_iter_ = int(self.max_iter)

    def _hazard_logits(self, X: np.ndarray) -> np.ndarray:
        a = (X - self.mean_) / self.scale_
        for i, (W, b) in enumerate(zip(self.coefs_, self.intercepts_)):
            a = a @ W + b
            if i < len(self.coefs_) - 1:
                a = np.maximum(a, 0.0)
        return a

    def _survival(self, X: np.ndarray) -> np.ndarray:
        return np.cumprod(_sigmoid(self._hazard_logits(X)), axis=1)
