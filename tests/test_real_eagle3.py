"""The shipped EAGLE-3 head for SmolLM2-135M-Instruct: its folder, its profile, its policies, lossless drafting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speckv_policy.logs import read_log
from speckv_policy.prompts import read_prompts
from speckv_policy.runtime import RuntimePolicy

ROOT = Path(__file__).resolve().parents[1]
HEAD = ROOT / "datasets" / "smollm2" / "eagle3"
PROFILE = ROOT / "datasets" / "smollm2" / "steps-eagle3.parquet"
PROMPTS = ROOT / "datasets" / "prompts" / "prompts.jsonl"
EXPORTS = ["smollm2-eagle3-gbt", "smollm2-eagle3-gbt-gated", "smollm2-eagle3-table-gated", "smollm2-eagle3-gbt-pre"]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def head():
    from speckv_policy.hf import load_eagle3

    return load_eagle3(HEAD)


def test_shipped_head_records_its_build(head):
    meta = json.loads((HEAD / "speckv.json").read_text())
    assert meta["aux_layer_ids"] == [2, 15, 27] and head.eagle.aux_layer_ids == (2, 15, 27)
    assert meta["draft_vocab_size"] == head.eagle.draft_vocab_size == 8192
    assert set(meta["heldout_agreement"]) == {"fp32", "int8", "nf4"}
    for comp in ("fp32", "int8", "nf4"):
        assert {"code", "math", "chat", "summarization", "overall"} <= set(meta["heldout_agreement"][comp])
    assert (HEAD / "model.safetensors").stat().st_size < 30e6  # bf16, no input embedding
    # the context-copy gate the build fitted, loaded with the head, and the held-out measure with it and without
    assert head.copy_gate() == meta["copy"] and meta["copy"]["max_match"] == 8
    assert set(meta["heldout_agreement_without_copy"]) == {"fp32", "int8", "nf4"}
    assert meta["texts"]["heldout"] == sum(p.split == "heldout" for p in read_prompts(PROMPTS))


@pytest.mark.parametrize("compression", ["fp32", "nf4"])
def test_real_head_greedy_equality(compression, head):
    """Drafting with the head through the hook reproduces the target's own greedy output, and drafts are kept."""
    from speckv_policy.hf import attach
    from speckv_policy.prompts import encode_prompt
    from speckv_policy.smollm2.models import load_model, load_tokenizer

    tok = load_tokenizer("smollm2")
    target = load_model("smollm2", compression)
    held = [p for p in read_prompts(PROMPTS) if p.split == "heldout"][::16][:3]
    kept = 0
    for p in held:
        ids = torch.tensor([encode_prompt(p, tok)])
        ref = target.generate(ids, max_new_tokens=24, do_sample=False)
        policy = str(ROOT / "exported" / "smollm2-eagle3-gbt-gated.onnx")
        with attach(target, policy, compression=compression, mode="gated") as h:
            out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=head)
        assert torch.equal(out, ref), (compression, p.id)
        assert h.summary()["fallbacks"] == 0 and h.draft_loop == "eagle3"
        kept += sum(s.accepted for s in h.stats)
    assert kept > 0


def test_head_profile():
    log = read_log(PROFILE)
    assert set(log["compression"]) == {"fp32", "int8", "nf4"} and set(log["decoding"]) == {"greedy", "sampling"}
    assert set(log["draft_model"]) == {"eagle3:eagle3"} and set(log["target_model"]) == {"SmolLM2-135M-Instruct"}
    held_ids = {p.id for p in read_prompts(PROMPTS) if p.split == "heldout"}
    assert not set(log.loc[log["split"] == "train", "prompt_id"]) & held_ids


@pytest.mark.parametrize("name", EXPORTS)
def test_head_exports_say_they_were_trained_on_the_head(name):
    from speckv_policy.policies import training_data
    from speckv_policy.policies.base import data_fingerprint

    rt = RuntimePolicy(ROOT / "exported" / f"{name}.onnx")
    assert rt.metadata["speckv.draft_kind"] == "eagle3"
    if rt.metadata["speckv.history_rounds"] == "0":  # trained on the logged rows as they are
        X, y = training_data(read_log(PROFILE), rt.feature_set.name, split="train")
        assert rt.metadata["speckv.training_fingerprint"] == data_fingerprint(X, y[:, 0], y[:, 1])
