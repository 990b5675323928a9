"""Evaluation: the one offline evaluator, its report, the SYNTHETIC log generator, the race's logic.

* :mod:`~speckv_policy.evaluation.offline`: counterfactual tokens/s of policies on
  a log's held-out steps against the oracle, every fixed gamma and the target
  alone, with paired bootstrap CIs over prompts (``speckv-eval``,
  ``speckv-quickstart`` and ``speckv-export`` all report through it);
* :mod:`~speckv_policy.evaluation.report`: Markdown tables and PNG plots of it;
* :mod:`~speckv_policy.evaluation.synthetic`: SYNTHETIC logs with known truth;
* :mod:`~speckv_policy.evaluation.race`: the end-to-end wall-clock race's arms,
  summaries and report (run by :mod:`speckv_policy.hf.race`).
* :mod:`~speckv_policy.evaluation.dense`: generation (greedy or sampling) replayed at every
  position of the target's own text (``benchmarks/dense_replay.py``).
"""

from .offline import (
    TARGET_ALONE,
    Arm,
    EvalSet,
    evaluate,
    evaluate_log,
    evaluation_set,
    group_masks,
    oracle_choices,
    paired_bootstrap,
    priced_arms,
    reference_arms,
    step_outcomes,
    summarize,
    throughput,
)

__all__ = [
    "TARGET_ALONE",
    "Arm",
    "EvalSet",
    "evaluate",
    "evaluate_log",
    "evaluation_set",
    "group_masks",
    "oracle_choices",
    "paired_bootstrap",
    "priced_arms",
    "reference_arms",
    "step_outcomes",
    "summarize",
    "throughput",
]
