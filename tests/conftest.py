"""Shared fixtures: a SYNTHETIC log with known truth, and policies fitted on it."""

from __future__ import annotations

import numpy as np
import pytest

from speckv_policy.evaluation.synthetic import generate_synthetic_log
from speckv_policy.logs import validate_log
from speckv_policy.objective import CostModel
from speckv_policy.policies import (
    FixedGammaPolicy,
    GBTPolicy,
    MLPPolicy,
    PaperMLP16Policy,
    TablePolicy,
    training_data,
)


@pytest.fixture(scope="session")
def synthetic():
    """(log, true alpha per row): 80 prompts x 3 compressions x 30 steps = 7,200 rows."""
    log, alpha = generate_synthetic_log(n_prompts=80, steps_per_prompt=30, seed=1)
    return validate_log(log), alpha


@pytest.fixture(scope="session")
def cost_model(synthetic):
    return CostModel.fit(synthetic[0])


@pytest.fixture(scope="session")
def online_data(synthetic):
    log, _ = synthetic
    return training_data(log, "online", "train"), training_data(log, "online", "heldout")


@pytest.fixture(scope="session")
def paper_data(synthetic):
    log, _ = synthetic
    return training_data(log, "paper", "train"), training_data(log, "paper", "heldout")


POLICY_FACTORIES = {
    "mlp": lambda cm: MLPPolicy(cost_model=cm),
    "gbt": lambda cm: GBTPolicy(cost_model=cm),
    "table": lambda cm: TablePolicy(cost_model=cm),
    "fixed": lambda cm: FixedGammaPolicy(gamma=4, cost_model=cm),
    "paper-mlp16": lambda cm: PaperMLP16Policy(cost_model=cm),
}


@pytest.fixture(scope="session")
def fitted(online_data, paper_data, cost_model):
    """Every policy kind fitted on the synthetic training split."""
    out = {}
    for name, make in POLICY_FACTORIES.items():
        (Xtr, ytr), _ = paper_data if name == "paper-mlp16" else online_data
        out[name] = make(cost_model).fit(Xtr, ytr)
    return out


@pytest.fixture(scope="session")
def heldout(online_data, paper_data):
    return {"online": online_data[1], "paper": paper_data[1]}


def edge_rows(feature_set_names: tuple[str, ...], rng: np.random.Generator) -> np.ndarray:
    """Rows at and beyond the edges of every feature's range, at every known compression code (the runtime refuses
    any other code: tests/test_hardening.py)."""
    rows = []
    for code in (0.0, 1.0, 2.0):
        for lo in (True, False):
            r = {}
            for n in feature_set_names:
                if n == "compression_code":
                    r[n] = code
                elif "conf" in n or "rate" in n:
                    r[n] = 0.0 if lo else 1.0
                elif "entropy" in n:
                    r[n] = 0.0 if lo else 15.0
                elif n == "log_context_len":
                    r[n] = 0.0 if lo else 12.0
                elif n == "temperature":
                    r[n] = 0.0 if lo else 2.0
                else:
                    r[n] = 0.0 if lo else 1.0
            rows.append([r[n] for n in feature_set_names])
    wild = rng.normal(0, 50, size=(20, len(feature_set_names)))
    if "compression_code" in feature_set_names:
        wild[:, feature_set_names.index("compression_code")] = rng.integers(0, 3, size=20)
    rows += wild.tolist()
    return np.asarray(rows, dtype=np.float32)


@pytest.fixture(scope="session")
def draft_samples():
    """The draft's own two-token counts on tests/test_hf_hook.py's SAMPLING_PAIR and SAMPLING_PROMPT: the same draft
    and seeds in every chi-square test on that pair (each mode of the hook, oneDNN's converted target), so drawn once."""
    import torch

    from speckv_policy.testing import tiny_llama_pair

    from .test_hf_hook import SAMPLING_DRAWS, SAMPLING_PAIR, SAMPLING_PROMPT, _two_token_counts

    _, draft = tiny_llama_pair(**SAMPLING_PAIR)
    return _two_token_counts(draft, torch.tensor(SAMPLING_PROMPT), SAMPLING_PAIR["vocab_size"], SAMPLING_DRAWS)


def load_benchmark(script: str):
    """``benchmarks/<script>`` imported as a module (its helpers are tested directly)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(f"benchmark_{Path(script).stem}", root / "benchmarks" / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_benchmark(script: str, *args: str, timeout: int = 900) -> str:
    """``python benchmarks/SCRIPT ARGS`` from the repository root as a user runs it; asserts it succeeds, returns stdout."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def table_rows(text: str, *firsts: str) -> list[list[str]]:
    """The cells (stripped) of the Markdown table rows in ``text`` whose first cell starts with one of ``firsts``."""
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| ")]
    return [r for r in rows if r and r[0].startswith(firsts)]


def teacher_forced_text(target, draft, ids, n: int, branch: int = 7):
    """The target's greedy text after ``ids`` (``n`` new tokens) as a dense-replay ``DenseText``: the draft's
    teacher-forced proposals, their confidences and entropies, and its own greedy branch (``branch`` tokens) after
    every wrong proposal. Returns ``(text, ref)``, ``ref`` the target's output ids."""
    import torch

    from speckv_policy.evaluation.dense import DenseText, match_runs
    from speckv_policy.features import draft_token_stats_from_logits

    with torch.inference_mode():
        ref = target.generate(ids, max_new_tokens=n, do_sample=False)
        own = draft(ref).logits[0][ids.shape[1] - 1 : -1]
        conf, ent = draft_token_stats_from_logits(own)
        plen, seq = ids.shape[1], ref[0].tolist()
        proposals = own.argmax(-1).tolist()
        branches = {}
        for j, (mine, true) in enumerate(zip(proposals, seq[plen:])):
            if mine != true:
                g = draft.generate(
                    torch.tensor([seq[: plen + j] + [mine]]),
                    max_new_tokens=branch,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                )
                c, e = draft_token_stats_from_logits(torch.stack(g.scores, 1)[0])
                branches[j] = (c.tolist(), e.tolist())
    runs = match_runs(proposals, seq[plen:], branch + 1)
    return DenseText(seq, plen, runs, conf.tolist(), ent.tolist(), branches), ref


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    """A tiny random target and its draft saved to a folder (the vLLM proposer loads drafts from disk)."""
    from speckv_policy.testing import tiny_llama_pair

    target, draft = tiny_llama_pair(noise=0.05, seed=3)
    d = tmp_path_factory.mktemp("pair")
    draft.save_pretrained(d / "draft")
    return target, str(d / "draft")
