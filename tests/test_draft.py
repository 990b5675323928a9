"""Draft distillation mechanics on a few real SmolLM2 answers (a tiny corpus, seconds of training)."""

from __future__ import annotations

import copy

import pytest
import torch

from speckv_policy.prompts import Prompt
from speckv_policy.smollm2.distill import generate_corpus, train_draft
from speckv_policy.smollm2.draft_model import PrunedHead, load_draft, save_draft

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_pruned_head_only_scores_its_tokens():
    w = torch.randn(3, 4)
    head = PrunedHead(w, torch.tensor([2, 5, 7]), vocab_size=10)
    h = torch.randn(2, 4)
    out = head(h)
    assert out.shape == (2, 10)
    assert torch.isinf(out[:, [0, 1, 3, 4, 6, 8, 9]]).all()
    torch.testing.assert_close(out[:, [2, 5, 7]], h @ w.t())


@pytest.fixture(scope="module")
def corpus():
    prompts = [
        Prompt("a", "code", "train", text="Write a Python function that adds two numbers."),
        Prompt("b", "math", "train", text="What is 12 times 12?"),
        Prompt("c", "chat", "heldout", text="Why is the sky blue?"),
    ]
    return generate_corpus(prompts, samples=2, max_new_tokens=12, batch_size=4, progress=False)


def test_corpus_records_the_targets_distribution(corpus):
    assert sorted(set(corpus["split"])) == ["heldout", "train"]
    assert len(corpus["ids"]) == 5  # 2 answers per training prompt, 1 greedy per held-out prompt
    for i in range(len(corpus["ids"])):
        n = len(corpus["topk_ids"][i])
        assert len(corpus["ids"][i]) == corpus["start"][i] + n
        assert (corpus["topk_logp"][i][:, :-1] >= corpus["topk_logp"][i][:, 1:]).all()  # sorted top-k
        if corpus["greedy"][i]:  # a greedy answer takes a top-1 token at every position (bf16 logits can tie)
            answer = corpus["ids"][i][corpus["start"][i] :]
            hit = corpus["topk_ids"][i] == answer[:, None]
            assert hit.any(1).all()
            chosen = corpus["topk_logp"][i][hit]
            assert torch.equal(chosen, corpus["topk_logp"][i][:, 0])


def test_corpus_top_k_is_the_targets_distribution_at_each_answer_position():
    """Recorded during generation (greedy and sampled, left-padded batch), equal to a teacher-forced pass."""
    from speckv_policy.smollm2.models import load_model

    prompts = [
        Prompt("a", "code", "train", text="Write a Python function that adds two numbers."),
        Prompt("b", "chat", "train", text="Name three colours."),
    ]
    corpus = generate_corpus(prompts, samples=2, max_new_tokens=10, batch_size=4, dtype="fp32", progress=False)
    assert len(corpus["ids"]) == 4 and sorted(corpus["greedy"]) == [False, False, True, True]
    model = load_model("smollm2", "fp32")
    for ids, start, top_ids, top_logp in zip(corpus["ids"], corpus["start"], corpus["topk_ids"], corpus["topk_logp"]):
        assert top_ids.shape == top_logp.shape == (len(ids) - start, 32)
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None].long()).logits[0].float(), -1)
        forced = logp[start - 1 : len(ids) - 1]  # the distribution of answer token j is read at position start-1+j
        # the recorded log-probabilities are stored in fp16: rtol 1e-3
        torch.testing.assert_close(forced.gather(1, top_ids.long()), top_logp.float(), atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(top_logp[:, 0].float(), forced.max(-1).values, atol=1e-3, rtol=1e-3)


def test_train_save_load_round_trip(corpus, tmp_path):
    model, meta = train_draft(corpus, head_size=512, minutes=0.05, val_fraction=0.0, progress=False)
    assert meta["steps"] >= 1 and meta["head_size"] == 512 and meta["layers"] == [0, 1]
    assert 0.0 <= meta["heldout_agreement"]["overall"] <= 1.0
    save_draft(model, tmp_path / "d", meta)
    loaded = load_draft(tmp_path / "d")
    # fp16 storage: the loaded draft is the trained one with its own weights (not the target's embedding) rounded
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, w in rounded.state_dict().items():
            if w.is_floating_point() and not name.startswith("model.embed_tokens"):
                w.copy_(w.half().float())
    ids = corpus["ids"][0][None].long()
    with torch.no_grad():
        a, b, r = model(ids).logits, loaded(ids).logits, rounded(ids).logits
    finite = torch.isfinite(a)
    assert torch.equal(finite, torch.isfinite(b)) and int(finite[0, 0].sum()) == 512
    torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-4)
    # and rounding moves no logit by more than 1% of the largest: a time-budgeted run's weights vary in size
    assert (a[finite] - b[finite]).abs().max() <= 0.01 * a[finite].abs().max()
    with pytest.raises(FileNotFoundError, match="a speckv distilled draft"):
        load_draft(tmp_path)


def test_fit_prefix_fits_some_prompts_and_validates_on_the_others(corpus):
    renamed = dict(corpus, prompt_id=["gen-a" if p == "a" else p for p in corpus["prompt_id"]])
    _, meta = train_draft(renamed, head_size=256, minutes=0.05, fit_prefix="gen-", eval_every=1, progress=False)
    assert meta["fit_prefix"] == "gen-"
    assert meta["validation_prompts"] == 1  # prompt "b": a training prompt the draft never fits
    assert meta["train_sequences"] == 2  # the two answers of gen-a
    assert 0.0 <= meta["validation_agreement"] <= 1.0
    with pytest.raises(ValueError, match="no training prompt id starts with 'zzz-'"):
        train_draft(corpus, head_size=256, minutes=0.05, fit_prefix="zzz-", progress=False)


def test_cli_names_a_missing_corpus(tmp_path, capsys):
    from speckv_policy.cli.distill import main

    assert main(["train", "--corpus", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "d")]) == 2
    assert "corpus not found" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_copy_gate_is_fitted_on_validation_answers_and_shipped(corpus, tmp_path, capsys):
    import json

    from speckv_policy.cli.distill import main
    from speckv_policy.smollm2.distill import agreement
    from speckv_policy.smollm2.draft_model import head_slots

    renamed = dict(corpus, prompt_id=["gen-a" if p == "a" else p for p in corpus["prompt_id"]])
    model, meta = train_draft(renamed, head_size=256, minutes=0.05, fit_prefix="gen-", progress=False)
    save_draft(model, tmp_path / "d", meta)
    torch.save(renamed, tmp_path / "c.pt")
    assert main(["copy", "--corpus", str(tmp_path / "c.pt"), "--draft", str(tmp_path / "d"), "--max-match", "4"]) == 0
    shipped = json.loads((tmp_path / "d" / "draft.json").read_text())
    assert len(shipped["copy"]["a"]) == len(shipped["copy"]["b"]) == 4
    assert shipped["copy_fit"]["answers"] == 1  # the greedy answer of "b", a prompt the draft never fitted
    assert set(shipped["heldout_agreement"]) == set(shipped["heldout_agreement_without_copy"]) == {"chat", "overall"}
    loaded = load_draft(tmp_path / "d")
    assert loaded.copy_gate() == shipped["copy"]
    # the measured agreement is that of the model HF runs: argmax of its forward, copy included
    held = [i for i, s in enumerate(renamed["split"]) if s == "heldout"]
    i = held[0]
    with torch.no_grad():
        logits = loaded(renamed["ids"][i][None].long()).logits[0]
    start, n = renamed["start"][i], len(renamed["topk_ids"][i])
    hits = (logits[start - 1 : start - 1 + n].argmax(-1) == renamed["topk_ids"][i][:, 0].long()).float().mean()
    assert agreement(loaded, renamed, [i], head_slots(loaded))["overall"] == pytest.approx(float(hits))
    # without fit_prefix every training prompt was fitted: no unseen answers to fit the gate on
    model, meta = train_draft(corpus, head_size=256, minutes=0.05, val_fraction=0.0, progress=False)
    save_draft(model, tmp_path / "e", meta)
    for args, msg in (
        (["--draft", str(tmp_path / "e")], "has no fit_prefix"),
        (["--draft", str(tmp_path / "nowhere")], "nowhere has no draft.json"),
        (["--draft", str(tmp_path / "d"), "--max-match", "0"], "--max-match must be >= 1, got 0"),
    ):
        assert main(["copy", "--corpus", str(tmp_path / "c.pt"), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("speckv-distill: error:") and msg in err[0]
    assert json.loads((tmp_path / "d" / "draft.json").read_text()) == shipped  # refused runs change nothing
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["draft.json", "draft.safetensors"]  # no temp file
