"""Gamma policies: scikit-learn estimators that pick a draft length per step."""

from .base import MAX_CANDIDATE_GAMMA, GammaPolicy, check_candidates, objective_scorer, training_data
from .baselines import FixedGammaPolicy, PaperMLP16Policy
from .gated import GatedPolicy
from .gbt import GBTPolicy
from .mlp import MLPPolicy
from .table import TablePolicy

POLICIES = {
    "mlp": MLPPolicy,
    "gbt": GBTPolicy,
    "table": TablePolicy,
    "fixed": FixedGammaPolicy,
    "paper-mlp16": PaperMLP16Policy,
}

__all__ = [
    "GammaPolicy",
    "MLPPolicy",
    "GBTPolicy",
    "GatedPolicy",
    "TablePolicy",
    "FixedGammaPolicy",
    "PaperMLP16Policy",
    "POLICIES",
    "objective_scorer",
    "check_candidates",
    "MAX_CANDIDATE_GAMMA",
    "training_data",
]
