"""The shipped EAGLE-3 head for SmolLM2-135M-Instruct: its folder, its profile, its policies, lossless drafting."""

from __future__ import annotations

import json
import shutil
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


def test_the_build_fits_the_copy_gate_and_measures_with_and_without_it(tmp_path, monkeypatch):
    """``build_eagle3`` end to end on a few real answers (seconds of training): the head folder it writes loads with
    its fitted gate, and a resumed build with the same work folder writes the same weights and records the first
    run's extraction time (none where it extracted a lost shard again)."""
    from speckv_policy.hf import load_eagle3
    from speckv_policy.prompts import Prompt
    from speckv_policy.smollm2 import eagle3 as build
    from speckv_policy.smollm2 import models
    from speckv_policy.smollm2.distill import generate_corpus
    from speckv_policy.smollm2.eagle3 import build_eagle3

    monkeypatch.setattr(build, "SHARD_TEXTS", 2)

    prompts = [
        Prompt("gen-a", "code", "train", text="Write a Python function that adds two numbers."),
        Prompt("b", "math", "train", text="What is 12 times 12? Repeat the question, then answer it."),
        Prompt("c", "summarization", "heldout", text="Summarize: the cat sat on the mat. The cat sat on the mat."),
    ]
    corpus = generate_corpus(prompts, samples=2, max_new_tokens=16, batch_size=4, progress=False)
    kw = {"minutes": 0.05, "draft_vocab_size": 256, "compressions": ("fp32", "nf4"), "progress": False}
    meta = build_eagle3(corpus, tmp_path / "head", tmp_path / "work", **kw)
    assert set(meta["heldout_agreement"]) == set(meta["heldout_agreement_without_copy"]) == {"fp32", "nf4"}
    assert meta["aux_layer_ids"] == [2, 15, 27]
    assert meta["copy_fit_texts"] == 1 and meta["texts"] == {"fit": 2, "validation": 1, "heldout": 1}
    head = load_eagle3(tmp_path / "head")
    assert head.copy_gate() == meta["copy"] and len(meta["copy"]["a"]) == 8
    weights = (tmp_path / "head" / "model.safetensors").read_bytes()
    again = build_eagle3(corpus, tmp_path / "head", tmp_path / "work", **kw)
    assert (tmp_path / "head" / "model.safetensors").read_bytes() == weights
    assert again["feature_minutes"] == meta["feature_minutes"] and again["history"] == meta["history"]
    assert again["copy"] == meta["copy"] and again["heldout_agreement"] == meta["heldout_agreement"]
    shards = tmp_path / "work" / "features-fp32"
    assert sorted(p.name for p in shards.glob("part-*")) == ["part-00000.pt", "part-00001.pt"]  # 4 texts, 2 a shard
    assert json.loads((shards / "layers.json").read_text()) == {"aux_layer_ids": [2, 15, 27]}  # speculators' default
    (shards / "part-00001.pt").unlink()
    part = build_eagle3(corpus, tmp_path / "head", tmp_path / "work", **kw)
    assert part["feature_minutes"] is None and part["heldout_agreement"] == meta["heldout_agreement"]
    none = build_eagle3(corpus, tmp_path / "plain", tmp_path / "work", **kw, copy_max_match=0)
    assert "copy" not in none and load_eagle3(tmp_path / "plain").copy_gate() is None
    assert none["heldout_agreement"] == none["heldout_agreement_without_copy"]
    # other target layers (speckv-distill eagle3 --layers): not from this work folder's features, in one of its own;
    # nor layers the target does not have: both refused before the target's weights load
    with monkeypatch.context() as m:
        m.setattr(models, "load_model", lambda *a, **k: pytest.fail("the target loaded for a head it cannot build"))
        with pytest.raises(ValueError, match=r"read from target layers \[2, 15, 27\], the head asks for \[2, 15, 29\]"):
            build_eagle3(corpus, tmp_path / "top", tmp_path / "work", **kw, layer_ids=(2, 15, 29))
        with pytest.raises(ValueError, match=r"increasing layer indices in 0\.\.29"):
            build_eagle3(corpus, tmp_path / "deep", tmp_path / "work-deep", **kw, layer_ids=(2, 15, 30))
        # a quantized target's held-out features at other layers: refused up front, not after the training budget
        shutil.copytree(tmp_path / "work" / "features-nf4-heldout", tmp_path / "work-mixed" / "features-nf4-heldout")
        with pytest.raises(ValueError, match=r"features-nf4-heldout.*\[2, 15, 27\], the head asks for \[2, 15, 29\]"):
            build_eagle3(corpus, tmp_path / "mixed", tmp_path / "work-mixed", **kw, layer_ids=(2, 15, 29))
    assert not (tmp_path / "deep").exists() and not (tmp_path / "work-deep" / "features-fp32").exists()
    top = build_eagle3(corpus, tmp_path / "top", tmp_path / "work-top", **kw, layer_ids=(2, 15, 29))
    assert top["aux_layer_ids"] == [2, 15, 29] and load_eagle3(tmp_path / "top").eagle.aux_layer_ids == (2, 15, 29)
