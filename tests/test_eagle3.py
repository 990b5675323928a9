"""The EAGLE-3 head: its speculators folder, its training loop, and drafting through the hook losslessly."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from speckv_policy.hf import attach
from speckv_policy.hf.eagle3 import Eagle3Config, Eagle3Head, is_eagle3_dir, load_eagle3
from speckv_policy.hf.eagle3_draft import Eagle3Drafter
from speckv_policy.hf.eagle3_train import (
    agreement,
    choose_vocabulary,
    extract_features,
    first_draft_hits,
    fit_head_copy_gate,
    init_head,
    train_head,
    ttt_forward,
)
from speckv_policy.hf.onednn import fused_linear_available, use_onednn_linear
from speckv_policy.runtime import PolicyFallbackWarning
from speckv_policy.testing import tiny_eagle3_head, tiny_llama_pair

pytestmark = pytest.mark.filterwarnings("ignore:.*generation_config.*together.*")

LAYERS = (0, 1, 2)
PROMPTS = [[1, 2, 3, 4], [7, 9], [30, 31, 32]]


@pytest.fixture(scope="module")
def eagle_pair():
    """A near-bigram tiny target (3 layers) and a head trained on it, over 48 of its 64 tokens."""
    target, _ = tiny_llama_pair(vocab_size=64, layers=3, seed=0, layer_scale=0.2)
    head = tiny_eagle3_head(target, LAYERS, draft_vocab_size=48, prompts=PROMPTS)
    return target, head


@pytest.fixture(scope="module")
def copy_pair(eagle_pair):
    """The same pair, the head with a strong context-copy gate (g = sigmoid(1) = 0.73 wherever the context matches)."""
    import copy

    target, head = eagle_pair
    gated = copy.deepcopy(head)
    gated.set_copy_gate([1.0] * 8, [0.0] * 8, 8)
    return target, gated


def _teacher_forced_logits(target, head, seq):
    """The head's first-draft logits at every row of ``seq``, from one full target pass (row j: token j + 2)."""
    with torch.no_grad():
        res = target(seq, output_hidden_states=True)
        aux = torch.cat([res.hidden_states[k][0] for k in head.eagle.aux_layer_ids], -1)
        nxt = torch.zeros_like(seq)
        nxt[:, :-1] = seq[:, 1:]
        emb = target.get_input_embeddings().weight
        out, _, _ = head.layer(F.embedding(nxt, emb), head.fuse(aux[None]), head.rope(torch.arange(seq.shape[1]) + 1))
        return head.logits(out)[0]


# ----------------------------------------------------------------------------- the folder
def test_config_round_trip_and_speculators_fields():
    target, _ = tiny_llama_pair(layers=3)
    cfg = Eagle3Config.for_target(target.config, 32, LAYERS, verifier="tiny")
    raw = cfg.to_speculators(speculative_tokens=4)
    assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3Speculator"]
    assert raw["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and raw["draft_vocab_size"] == 32
    assert raw["target_hidden_size"] == target.config.hidden_size
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 1
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    back = Eagle3Config.from_speculators(json.loads(json.dumps(raw)))
    assert back.to_speculators(4) == raw
    # speculators' default layers for a 30-layer target: [2, 15, 27]
    target.config.num_hidden_layers = 30
    assert Eagle3Config.for_target(target.config, 32).aux_layer_ids == (2, 15, 27)
    assert Eagle3Config.for_target(target.config, 32, [2, 15, 29]).aux_layer_ids == (2, 15, 29)  # chosen layers


@pytest.mark.parametrize("layers", [(), (2, 2, 5), (15, 2, 27), (2, 15, 30), (-1, 2, 3)])
def test_layers_the_target_cannot_give_in_order_are_refused(layers):
    """vLLM concatenates the states in layer order and captures those entering layers 0..L-1: nothing else."""
    target, _ = tiny_llama_pair(layers=3)
    target.config.num_hidden_layers = 30
    with pytest.raises(ValueError, match=r"increasing layer indices in 0\.\.29 of the target's 30 layers"):
        Eagle3Config.for_target(target.config, 32, layers)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.update(speculators_model_type="eagle"), "speculators_model_type must be 'eagle3'"),
        (lambda r: r.pop("transformer_layer_config"), "missing 'transformer_layer_config'"),
        (lambda r: r["transformer_layer_config"].update(model_type="mistral"), "'mistral' is not supported"),
        (lambda r: r["transformer_layer_config"].update(layer_types=["sliding_attention"]), "sliding-window"),
        (lambda r: r["transformer_layer_config"].update(num_hidden_layers=2), "num_hidden_layers must be 1"),
        (lambda r: r.update(eagle_aux_hidden_state_layer_ids=[-1]), "non-negative integers"),
        (lambda r: r.update(eagle_aux_hidden_state_layer_ids=[2, 1, 3]), r"must be increasing \(vLLM concatenates"),
        (lambda r: r.update(draft_vocab_size="32"), "'draft_vocab_size' must be"),
        (lambda r: r["transformer_layer_config"].pop("hidden_size"), "transformer_layer_config.hidden_size"),
        (lambda r: r.update(target_hidden_size=999), "target_hidden_size 999"),
        (lambda r: r.update(norm_output="yes"), "'norm_output' must be true or false"),
        (lambda r: r.update(norm_before_fc=True, fc_norm=True), "'norm_before_fc' and 'fc_norm' exclude each other"),
    ],
)
def test_bad_configs_are_named(tmp_path, edit, message):
    target, _ = tiny_llama_pair(layers=3)
    raw = Eagle3Config.for_target(target.config, 32, LAYERS).to_speculators()
    edit(raw)
    with pytest.raises(ValueError, match=message):
        Eagle3Config.from_speculators(raw, "x/config.json")


def test_save_load_and_bad_folders(tmp_path):
    target, _ = tiny_llama_pair(layers=3)
    cfg = Eagle3Config.for_target(target.config, 32, LAYERS)
    head = init_head(target, cfg, torch.arange(0, 64, 2))
    head.save(tmp_path / "h", meta={"note": 1})
    assert is_eagle3_dir(tmp_path / "h") and not is_eagle3_dir(tmp_path)
    assert json.loads((tmp_path / "h" / "speckv.json").read_text()) == {"note": 1}
    back = load_eagle3(tmp_path / "h")
    assert torch.equal(back.target_ids(), head.target_ids()) and bool(back.t2d[::2].all()) and not back.t2d[1]
    x = torch.randn(1, 5, cfg.hidden_size)
    rope = head.rope(torch.arange(5))
    ref = head.logits(head.layer(x, head.fuse(torch.randn(1, 5, 3 * cfg.hidden_size)), rope)[0])
    assert ref.shape == (1, 5, 32)
    with torch.no_grad():  # bf16 storage: the reloaded weights are the saved ones rounded
        for (k, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
            if a.is_floating_point():
                assert torch.allclose(a.to(torch.bfloat16).float(), b), k
    # a missing file, broken JSON, a weight of the wrong shape, a d2t outside the vocabulary: named errors
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_eagle3(tmp_path / "empty")
    bad = tmp_path / "bad"
    head.save(bad)
    (bad / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_eagle3(bad)
    from safetensors.torch import load_file, save_file

    head.save(bad)
    sd = load_file(str(bad / "model.safetensors"))
    sd["fc.weight"] = sd["fc.weight"][:, :10].contiguous()
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="'fc.weight' has shape"):
        load_eagle3(bad)
    sd = load_file(str(tmp_path / "h" / "model.safetensors"))
    sd["d2t"][-1] = 10_000
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t maps draft ids outside"):
        load_eagle3(bad)
    del sd["norm.weight"]
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        load_eagle3(bad)


def _head_with_options(head, gen, own_embedding=None, **options):
    """``head``'s weights in a head with speculators' ``options`` set, their norms random; ``own_embedding`` carried."""
    cfg = dataclasses.replace(head.eagle, **options)
    other = Eagle3Head(cfg, own_embedding=own_embedding is not None)
    missing, unexpected = other.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and all(k.startswith(("input_norm", "fc_norm", "embed_tokens")) for k in missing)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.startswith(("input_norm", "fc_norm")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        if own_embedding is not None:
            other.embed_tokens.weight.copy_(own_embedding)
    return other.eval()


def test_speculators_head_options_are_read_written_and_computed(tmp_path):
    """norm_before_fc / fc_norm / norm_output and a carried embedding: written only when set, read back, applied
    where speculators applies them (tests/test_vllm.py checks the numbers against speculators' own model)."""
    target, _ = tiny_llama_pair(layers=3)
    cfg = Eagle3Config.for_target(target.config, 32, LAYERS)
    assert not {"norm_before_fc", "fc_norm", "norm_output"} & set(cfg.to_speculators())  # the shipped file's keys
    gen = torch.Generator().manual_seed(0)
    base = init_head(target, cfg, torch.arange(0, 64, 2))
    emb = target.get_input_embeddings().weight.detach()
    aux, out = torch.randn(2, 3 * cfg.hidden_size, generator=gen), torch.randn(2, cfg.hidden_size, generator=gen)
    for options in ({"norm_before_fc": True}, {"fc_norm": True, "norm_output": True}):
        head = _head_with_options(base, gen, **options)
        head.save(tmp_path / "h")
        raw = json.loads((tmp_path / "h" / "config.json").read_text())
        assert all(raw[k] is True for k in options)
        back = load_eagle3(tmp_path / "h")
        assert dataclasses.replace(back.eagle, extra_layer_config={}) == head.eagle
        assert torch.allclose(back.fuse(aux), head.to(torch.bfloat16).float().fuse(aux), atol=1e-4)
        assert not torch.allclose(back.fuse(aux), base.fuse(aux), atol=1e-2)  # the norm is applied
        if options.get("norm_output"):
            assert torch.allclose(back.next_hidden(out), F.rms_norm(out, (cfg.hidden_size,), back.norm.weight, 1e-5))
        else:
            assert back.next_hidden(out) is out
    # a carried embedding: kept by the loader; used where it differs from the target's, dropped where equal
    head = _head_with_options(base, gen, own_embedding=emb + 1.0)
    head.save(tmp_path / "e")
    back = load_eagle3(tmp_path / "e")
    assert torch.equal(back.input_embedding(emb), (emb + 1.0).to(torch.bfloat16).float())
    assert back.embed_tokens is not None
    same = _head_with_options(base, gen, own_embedding=emb)
    assert same.input_embedding(emb) is emb and same.embed_tokens is None


def test_rotary_scaling_is_read_from_the_target_or_the_folder_and_applied():
    """A Llama-3.1-style target's rotary scaling goes into the head's config (as speculators copies the verifier's),
    legacy ``rope_scaling`` / ``rope_theta`` read the same, and types that change with the length are refused."""
    target, _ = tiny_llama_pair(layers=3)
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    target.config.rope_parameters = dict(llama3)
    cfg = Eagle3Config.for_target(target.config, 32, LAYERS)
    assert cfg.rope_parameters == llama3 and cfg.rope_theta == 500000.0
    raw = cfg.to_speculators()
    assert raw["transformer_layer_config"]["rope_parameters"] == llama3
    assert Eagle3Config.from_speculators(raw).rope_parameters == llama3
    legacy = json.loads(json.dumps(raw))
    layer = legacy["transformer_layer_config"]
    del layer["rope_parameters"]
    layer.update(rope_theta=500000.0, rope_scaling={k: v for k, v in llama3.items() if k != "rope_theta"})
    assert Eagle3Config.from_speculators(legacy).rope_parameters == llama3
    head, plain = Eagle3Head(cfg), Eagle3Head(dataclasses.replace(cfg, rope_parameters=None))
    assert not torch.allclose(head.inv_freq, plain.inv_freq) and torch.equal(head.inv_freq[0], plain.inv_freq[0])
    yarn = Eagle3Head(dataclasses.replace(cfg, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))
    assert yarn.rope_scaling > 1.0 and yarn.rope(torch.arange(3))[0].abs().max() > 1.0
    layer["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        Eagle3Config.from_speculators(legacy, "x/config.json")


def test_a_qwen3_target_gets_a_qwen3_head_that_drafts_losslessly(tmp_path):
    """Qwen3's layer (RMSNorms over each head's queries and keys): written and read as speculators' qwen3 layer,
    warm-started from the target's, and drafting through the hook keeps the target's greedy output."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    qcfg = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    target = Qwen3ForCausalLM(qcfg).eval()
    cfg = Eagle3Config.for_target(target.config, 64, LAYERS)
    assert cfg.layer_type == "qwen3"
    head = init_head(target, cfg, torch.arange(64))
    src = target.model.layers[LAYERS[-1]].self_attn
    assert torch.equal(head.layers[0].self_attn.q_norm.weight, src.q_norm.weight.float())
    head.save(tmp_path / "q")
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    assert raw["transformer_layer_config"]["model_type"] == "qwen3"
    back = load_eagle3(tmp_path / "q")
    assert back.eagle.layer_type == "qwen3" and hasattr(back.layers[0].self_attn, "k_norm")
    drafted = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=16, do_sample=False)
        with attach(target, 3, compression="fp32") as h:
            out = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=back)
        assert torch.equal(out, ref)
        drafted += sum(s.gamma for s in h.stats)
    assert drafted > 0


def test_a_full_vocabulary_head_may_ship_no_vocabulary_maps(tmp_path):
    from safetensors.torch import load_file, save_file

    target, _ = tiny_llama_pair(layers=3)
    vocab = target.config.vocab_size
    for size in (vocab, 32):
        head = init_head(target, Eagle3Config.for_target(target.config, size, LAYERS), torch.arange(size))
        head.save(tmp_path / str(size))
        sd = load_file(str(tmp_path / str(size) / "model.safetensors"))
        del sd["d2t"], sd["t2d"]
        save_file(sd, str(tmp_path / str(size) / "model.safetensors"))
    back = load_eagle3(tmp_path / str(vocab))
    assert torch.equal(back.target_ids(), torch.arange(vocab)) and bool(back.t2d.all())
    with pytest.raises(ValueError, match=r"missing \['d2t', 't2d'\]"):
        load_eagle3(tmp_path / "32")


# ----------------------------------------------------------------------------- training
def _random_texts(n: int, length: int, start: int):
    """A near-bigram tiny target, its head config and the features of ``n`` random texts (answers from ``start``)."""
    target, _ = tiny_llama_pair(vocab_size=64, layers=3, seed=1, layer_scale=0.2)
    g = torch.Generator().manual_seed(0)
    corpus = {"ids": [torch.randint(1, 64, (length,), generator=g) for _ in range(n)], "start": [start] * n}
    corpus.update(task_type=["t"] * n, prompt_id=[str(i) for i in range(n)], split=["train"] * n)
    cfg = Eagle3Config.for_target(target.config, 64, LAYERS)
    return target, cfg, extract_features(corpus, list(range(n)), target, LAYERS, progress=False)


def test_training_time_test_learns_and_the_chain_mask_reads_its_own_rows():
    """The TTT loss falls on a batch; step 1 of row j depends on rows <= j at step 0 and row j's chain only."""
    target, cfg, feats = _random_texts(6, 20, 4)
    assert feats[0]["aux"].shape == (20, 3 * cfg.hidden_size) and feats[0]["top_ids"].shape[0] == 20 - 4 + 1
    vocab, coverage = choose_vocabulary(feats, 64)
    assert coverage == 1.0 and vocab.tolist() == sorted(vocab.tolist())
    head = init_head(target, cfg, vocab)
    emb = target.get_input_embeddings().weight.detach()
    from speckv_policy.hf.eagle3_train import _collate, _slots  # noqa: PLC2701 - the loop's own batch format

    batch = _collate(feats, _slots(head))
    before = agreement(head, emb, feats)["overall"]
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    first = None
    for _ in range(80):
        loss, stats = ttt_forward(head, emb, batch, 3)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first - 1.0 and len(stats) == 3  # soft cross-entropy: its floor is the target entropy
    assert agreement(head, emb, feats)["overall"] > before + 0.15  # fitted texts: far more first tokens right
    # step 1's output at row j must not change when a later row's features or tokens change
    b2 = {k: v.clone() for k, v in batch.items()}
    b2["aux"][0, 10:] = torch.randn_like(b2["aux"][0, 10:]).to(b2["aux"].dtype)
    b2["ids"][0, 12:] = 5

    def step1(b):
        rows = torch.arange(b["ids"].shape[1])
        hidden = head.fuse(b["aux"])
        nxt = torch.zeros_like(b["ids"])
        nxt[:, :-1] = b["ids"][:, 1:]
        out, k, v = head.layer(F.embedding(nxt, emb), hidden, head.rope(rows + 1))
        nxt2 = torch.zeros_like(b["ids"])
        nxt2[:, :-2] = b["ids"][:, 2:]
        from speckv_policy.hf.eagle3_train import _chain_mask  # noqa: PLC2701

        out2, _, _ = head.layer(F.embedding(nxt2, emb), out, head.rope(rows + 2), (k, v), _chain_mask(len(rows), 1))
        return out2

    with torch.no_grad():
        assert torch.allclose(step1(batch)[0, :9], step1(b2)[0, :9], atol=1e-5)
        assert not torch.allclose(step1(batch)[0, 10:], step1(b2)[0, 10:], atol=1e-3)


def test_padding_a_training_batch_wider_changes_neither_its_loss_nor_its_hits():
    """Training pads batches to a multiple of 16 (oneDNN's kernels per shape): the padding must be invisible."""
    from speckv_policy.hf.eagle3_train import TRAIN_PAD_MULTIPLE, _collate, _slots  # noqa: PLC2701

    target, cfg, short = _random_texts(3, 13, 4)
    _, _, long = _random_texts(2, 21, 6)
    feats = short + long
    head = init_head(target, cfg, torch.arange(64))
    emb = target.get_input_embeddings().weight.detach()
    plain = _collate(feats, _slots(head))
    padded = _collate(feats, _slots(head), TRAIN_PAD_MULTIPLE)
    assert plain["ids"].shape[1] == 21 and padded["ids"].shape[1] == 32 == 2 * TRAIN_PAD_MULTIPLE
    assert torch.equal(padded["length"], plain["length"])
    for steps in (1, 3):
        loss, stats = ttt_forward(head, emb, plain, steps)
        loss_p, stats_p = ttt_forward(head, emb, padded, steps)
        assert stats_p == stats and sum(n for _, n in stats) > 0
        assert torch.allclose(loss_p, loss, rtol=1e-5, atol=1e-6)


def test_training_resumes_from_its_checkpoint(tmp_path):
    target, cfg, feats = _random_texts(8, 16, 3)
    emb = target.get_input_embeddings().weight.detach()
    head = init_head(target, cfg, torch.arange(64))
    kw = dict(minutes=60.0, checkpoint=tmp_path / "ck.pt", progress=False, tokens_per_batch=64, eval_minutes=60.0)
    info = train_head(head, emb, feats[2:], feats[:2], max_steps=5, **kw)
    assert info["steps"] == 5 and (tmp_path / "ck.pt").exists()
    info = train_head(init_head(target, cfg, torch.arange(64)), emb, feats[2:], feats[:2], max_steps=8, **kw)
    assert info["steps"] == 8  # three more steps on top of the checkpoint's five
    assert [h[0] for h in info["history"]] == [5, 8]


def test_feature_noise_is_relative_to_each_state_and_leaves_padding_alone():
    """``perturb_features``: each of the three states gets noise of ``scale`` times its own RMS, whatever its size."""
    from speckv_policy.hf.eagle3_train import perturb_features

    h = 256
    scales = torch.tensor([0.01, 1.0, 100.0])  # the states a head reads differ in size by orders of magnitude
    aux = (torch.randn(2, 40, 3, h) * scales[:, None]).view(2, 40, 3 * h)
    aux[1, 30:] = 0  # padding
    out = perturb_features(aux, 3, 0.1, torch.Generator().manual_seed(0))
    assert out.shape == aux.shape and out.dtype == aux.dtype
    assert torch.equal(out[1, 30:], aux[1, 30:])
    diff = (out - aux)[0].view(40, 3, h)
    rms = aux[0].view(40, 3, h).pow(2).mean(-1).sqrt()
    ratio = diff.pow(2).mean(-1).sqrt() / rms  # per position and state: the noise's RMS over the state's
    assert torch.allclose(ratio, torch.full_like(ratio, 0.1), rtol=0.15), ratio
    again = perturb_features(aux, 3, 0.1, torch.Generator().manual_seed(0))
    assert torch.equal(again, out)  # seeded


def test_weight_decay_and_feature_noise_change_training_and_resume(tmp_path):
    """``speckv-distill eagle3 --weight-decay/--feature-noise/--freeze-lm-head``: a frozen lm_head stays the
    target's rows while the rest trains; decay shrinks the matrices (not the norms' gains)
    against the same steps without it, noise changes what is fitted, both resume; negative values are refused."""
    target, cfg, feats = _random_texts(8, 16, 3)
    emb = target.get_input_embeddings().weight.detach()
    kw = dict(minutes=60.0, progress=False, tokens_per_batch=64, eval_minutes=60.0, max_steps=6, lr=1e-2)

    def trained(name, **extra):
        torch.manual_seed(0)
        head = init_head(target, cfg, torch.arange(64))
        train_head(head, emb, feats[2:], feats[:2], checkpoint=tmp_path / f"{name}.pt", **kw, **extra)
        return head

    plain, again = trained("plain"), trained("again")
    frozen = trained("frozen", train_lm_head=False)
    start = init_head(target, cfg, torch.arange(64)).lm_head.weight
    assert torch.equal(frozen.lm_head.weight, start) and not torch.equal(plain.lm_head.weight, start)
    assert frozen.lm_head.weight.requires_grad  # the head is left trainable as it came
    assert not torch.equal(frozen.layers[0].mlp.up_proj.weight, plain.layers[0].mlp.up_proj.weight)
    decayed, noisy = trained("decayed", weight_decay=40.0), trained("noisy", feature_noise=0.5)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), again.state_dict().values()))
    w = {n: h.layers[0].mlp.up_proj.weight.norm().item() for n, h in (("plain", plain), ("decayed", decayed))}
    assert w["decayed"] < 0.97 * w["plain"], w  # 0.95: six warm-up steps of lr x decay 0.4
    gain = (plain.layers[0].post_attention_layernorm.weight, decayed.layers[0].post_attention_layernorm.weight)
    assert (gain[1].norm() / gain[0].norm()).item() > 0.97  # the gains move as the gradients take them, no decay
    assert not torch.allclose(noisy.layers[0].mlp.up_proj.weight, plain.layers[0].mlp.up_proj.weight)
    resumed = init_head(target, cfg, torch.arange(64))
    info = train_head(
        resumed,
        emb,
        feats[2:],
        feats[:2],
        checkpoint=tmp_path / "decayed.pt",
        weight_decay=40.0,
        **{**kw, "max_steps": 8},
    )
    assert info["steps"] == 8
    for other in ({}, {"train_lm_head": False}):  # a checkpoint started with decay, resumed otherwise: named
        with pytest.raises(ValueError, match=r"decayed\.pt: was trained with other optimizer settings"):
            train_head(resumed, emb, feats[2:], feats[:2], checkpoint=tmp_path / "decayed.pt", **other, **kw)
    with pytest.raises(ValueError, match="weight_decay and feature_noise must be >= 0"):
        train_head(resumed, emb, feats[2:], feats[:2], checkpoint=tmp_path / "x.pt", feature_noise=-0.1, **kw)


def test_a_checkpoint_resumed_by_a_head_on_other_target_layers_is_refused(tmp_path):
    target, cfg, feats = _random_texts(6, 16, 3)
    emb = target.get_input_embeddings().weight.detach()
    kw = dict(minutes=60.0, progress=False, tokens_per_batch=64, eval_minutes=60.0, max_steps=2)
    train_head(init_head(target, cfg, torch.arange(64)), emb, feats[2:], feats[:2], checkpoint=tmp_path / "c.pt", **kw)
    other = init_head(target, Eagle3Config.for_target(target.config, 64, (0, 2)), torch.arange(64))
    with pytest.raises(
        ValueError, match=re.escape("c.pt: was trained on target layers [0, 1, 2], this head reads [0, 2]")
    ):
        train_head(other, emb, feats[2:], feats[:2], checkpoint=tmp_path / "c.pt", **kw)
    same = init_head(target, cfg, torch.arange(64))  # the layers it was started with: resumes
    assert (
        train_head(same, emb, feats[2:], feats[:2], checkpoint=tmp_path / "c.pt", **{**kw, "max_steps": 3})["steps"]
        == 3
    )


# ----------------------------------------------------------------------------- drafting
def test_drafter_reads_the_same_features_as_training():
    """Catch-up after each verification reproduces the teacher-forced rows exactly (cache kept in step)."""
    target, _ = tiny_llama_pair(vocab_size=64, layers=3, seed=0)
    head = init_head(target, Eagle3Config.for_target(target.config, 64, LAYERS), torch.arange(64)).eval()
    seq = torch.randint(1, 64, (1, 30), generator=torch.Generator().manual_seed(0))
    tf = _teacher_forced_logits(target, head, seq)
    with torch.no_grad():
        res = target(seq, output_hidden_states=True)
    aux = torch.cat([res.hidden_states[k][0] for k in LAYERS], -1)
    d = Eagle3Drafter(head, target.get_input_embeddings().weight.detach(), None, False, None)
    d.add_features(aux[:10], 0, 10)
    for cur, kept in ((11, 2), (14, 5), (20, 0)):
        _, scores = d.draft(seq[:, :cur], 3)
        assert torch.allclose(scores[0, 0], tf[cur - 2], atol=1e-4)
        d.add_features(aux[cur - 1 : cur + 6], cur - 1, cur + kept)  # a gamma-6 verification, n kept
    with pytest.raises(ValueError, match="start at position"):
        d.add_features(aux[25:], 25, 28)


def test_hf_drafts_read_the_verified_features(eagle_pair, monkeypatch):
    """Inside generate(): every step's first draft token is the head's teacher-forced prediction on the output."""
    from speckv_policy.hf import eagle3_draft

    target, head = eagle_pair
    seen = []
    original = eagle3_draft.Eagle3Drafter.draft

    def spy(self, input_ids, max_new, stop=None):
        ids, scores = original(self, input_ids, max_new, stop)
        seen.append((input_ids.shape[1], scores[0, 0].clone()))
        return ids, scores

    monkeypatch.setattr(eagle3_draft.Eagle3Drafter, "draft", spy)
    ids = torch.tensor([PROMPTS[0]])
    with attach(target, 3) as h:
        out = target.generate(ids, assistant_model=head, max_new_tokens=24, do_sample=False)
    assert h.draft_loop == "eagle3" and h.stats[0].gamma == 0  # the prefill step drafts nothing
    tf = _teacher_forced_logits(target, head, out)
    assert len(seen) == len(h.stats) - 1
    for cur, s in seen:
        assert torch.allclose(s[head.target_ids()], tf[cur - 2], atol=1e-4)
        assert bool(torch.isinf(s[~head.t2d]).all())  # tokens outside the head's vocabulary: never proposed


def test_later_draft_tokens_are_the_training_time_test_rows(eagle_pair, monkeypatch):
    """A second draft token after an accepted first one is exactly TTT step 1's row: the head's own output and the
    drafted token, attending to the target rows up to the first and its own chain."""
    from speckv_policy.hf import eagle3_draft
    from speckv_policy.hf.eagle3_train import _chain_mask  # noqa: PLC2701 - the mask training uses

    target, head = eagle_pair
    seen = []
    original = eagle3_draft.Eagle3Drafter.draft

    def spy(self, input_ids, max_new, stop=None):
        ids, scores = original(self, input_ids, max_new, stop)
        seen.append((input_ids.shape[1], ids[0].clone(), scores[0].clone()))
        return ids, scores

    monkeypatch.setattr(eagle3_draft.Eagle3Drafter, "draft", spy)
    with attach(target, 4):
        out = target.generate(torch.tensor([PROMPTS[0]]), assistant_model=head, max_new_tokens=30, do_sample=False)
    seq = out
    width = seq.shape[1]
    with torch.no_grad():
        res = target(seq, output_hidden_states=True)
        aux = torch.cat([res.hidden_states[k][0] for k in LAYERS], -1)[None]
        emb = target.get_input_embeddings().weight
        rows = torch.arange(width)
        nxt = torch.zeros_like(seq)
        nxt[:, :-1] = seq[:, 1:]
        out0, k, v = head.layer(F.embedding(nxt, emb), head.fuse(aux), head.rope(rows + 1))
        nxt2 = torch.zeros_like(seq)
        nxt2[:, :-2] = seq[:, 2:]
        out1, _, _ = head.layer(F.embedding(nxt2, emb), out0, head.rope(rows + 2), (k, v), _chain_mask(width, 1))
        step1 = head.logits(out1)[0]
    checked = 0
    for cur, ids, scores in seen:
        if scores.shape[0] >= 2 and cur < width and int(ids[cur]) == int(seq[0, cur]):
            assert torch.allclose(scores[1][head.target_ids()], step1[cur - 2], atol=1e-4)
            checked += 1
    assert checked > 0


def _cycle(seq):
    it = iter(seq * 100)
    return lambda features: next(it)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gammas=st.lists(st.integers(0, 8), min_size=1, max_size=10),
    mode=st.sampled_from(["upfront", "per-token", "fixed"]),
    prompt=st.lists(st.integers(1, 63), min_size=1, max_size=10),
    n_new=st.integers(1, 30),
)
def test_greedy_output_is_the_targets_with_the_head(eagle_pair, gammas, mode, prompt, n_new):
    target, head = eagle_pair
    ids = torch.tensor([prompt])
    ref = target.generate(ids, max_new_tokens=n_new, do_sample=False)
    kw = {} if mode == "fixed" else {"feature_set": "online"}
    with attach(target, _cycle(gammas), compression="fp32", mode=mode, **kw, settings={"max_gamma": 8}) as h:
        out = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=head)
    assert torch.equal(out, ref)
    assert sum(s.accepted + 1 for s in h.stats) == out.shape[1] - ids.shape[1]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    gammas=st.lists(st.integers(0, 8), min_size=1, max_size=10),
    prompt=st.lists(st.integers(1, 8), min_size=1, max_size=12),
    n_new=st.integers(1, 30),
)
def test_greedy_output_is_the_targets_with_a_copy_gated_head(copy_pair, gammas, prompt, n_new):
    """Prompts over a few tokens repeat, so the copy candidate (often outside the head's vocabulary) is drafted."""
    target, head = copy_pair
    ids = torch.tensor([prompt])
    ref = target.generate(ids, max_new_tokens=n_new, do_sample=False)
    with attach(target, _cycle(gammas), compression="fp32", feature_set="online", settings={"max_gamma": 8}):
        out = target.generate(ids, max_new_tokens=n_new, do_sample=False, assistant_model=head)
    assert torch.equal(out, ref)


def test_the_copy_gate_mixes_a_proper_distribution_and_travels_in_speckv_json(copy_pair, tmp_path):
    target, head = copy_pair
    full = torch.full((1, 64), float("-inf"))
    full[:, head.target_ids()] = torch.randn(1, head.eagle.draft_vocab_size)
    outside = int((~head.t2d).nonzero()[0])
    history = np.array([outside, 5, 9, outside, 5, 9])  # the context repeats: candidate `outside`
    mixed = head.draft_log_probs(full, history)
    assert torch.isclose(torch.logsumexp(mixed, -1), torch.zeros(1), atol=1e-5).all()
    assert mixed[0, outside].exp() > 0.7  # g = 0.73 at a match, on a token the head alone never drafts
    assert torch.equal(head.draft_log_probs(full, np.array([1, 2, 3])).isinf(), full.isinf())  # no match: q
    head.save(tmp_path / "g", meta={"note": 1})
    meta = json.loads((tmp_path / "g" / "speckv.json").read_text())
    assert meta["note"] == 1 and meta["copy"] == head.copy_gate() and meta["copy"]["max_match"] == 8
    assert load_eagle3(tmp_path / "g").copy_gate() == head.copy_gate()
    for bad, message in (({"max_match": 2, "a": [0.0], "b": [0.0, 0.0]}, "'a' must be 2 finite numbers"), ("x", "")):
        meta["copy"] = bad
        (tmp_path / "g" / "speckv.json").write_text(json.dumps(meta))
        with pytest.raises(ValueError, match=f"speckv.json 'copy'.*{message}"):
            load_eagle3(tmp_path / "g")


def test_a_copy_gate_is_fitted_where_the_context_predicts_the_target():
    """Synthetic ground truth: texts whose target greedy token is, wherever the context matches, the token that
    followed the match. The fitted gate trusts long matches, and agreement with it rises above the head alone."""
    target, cfg, feats = _random_texts(8, 40, 4)
    head = init_head(target, cfg, torch.arange(64))
    for t in feats:  # repeat the first half, then make the target's greedy token the copy candidate wherever one exists
        ids = torch.cat([t["ids"][:20], t["ids"][:20]])
        t["ids"] = ids
        s = t["start"]
        from speckv_policy.hf.copy_gate import copy_candidates

        cand, length = copy_candidates(ids.numpy().astype(np.int64), s - 1, len(ids) - s)
        top = t["top_ids"].clone()
        top[: len(ids) - s, 0] = torch.where(torch.from_numpy(length) > 1, torch.from_numpy(cand).int(), top[:-1, 0])
        t["top_ids"] = top
    emb = target.get_input_embeddings().weight.detach()
    plain = agreement(head, emb, feats)["overall"]
    gate = fit_head_copy_gate(head, emb, feats)
    assert gate["max_match"] == 8 and head.copy_gate() == gate
    assert gate["a"][-1] > gate["a"][0]  # a match of 8 tokens earns more trust than one of 1
    assert agreement(head, emb, feats)["overall"] > plain + 0.2
    assert agreement(head, emb, feats, copy=False)["overall"] == plain


def test_first_draft_hits_are_per_answer_position_and_add_up_to_the_agreement():
    """One flag per answer token, in order: a target token no head can draft (id -1) at answer position k of text j
    turns exactly that flag off; the flags' mean is the agreement."""
    target, cfg, feats = _random_texts(4, 24, 5)
    head = init_head(target, cfg, torch.arange(64))
    emb = target.get_input_embeddings().weight.detach()
    hits = first_draft_hits(head, emb, feats, copy=False)
    assert [len(h) for h in hits] == [len(t["ids"]) - t["start"] for t in feats] and hits[0].dtype == torch.bool
    total = sum(int(h.sum()) for h in hits) / sum(len(h) for h in hits)
    assert agreement(head, emb, feats, copy=False)["overall"] == pytest.approx(total, abs=1e-4)
    j, k = 2, int(hits[2].nonzero()[0])  # a hit, so the change shows
    feats[j]["top_ids"] = feats[j]["top_ids"].clone()
    feats[j]["top_ids"][k, 0] = -1
    after = first_draft_hits(head, emb, feats, copy=False)
    changed = [(a, b) for a in range(len(hits)) for b in range(len(hits[a])) if bool(hits[a][b]) != bool(after[a][b])]
    assert changed == [(j, k)]


@pytest.mark.parametrize(
    "options", [{"norm_before_fc": True}, {"fc_norm": True, "norm_output": True, "norm_before_residual": True}]
)
def test_heads_with_speculators_options_and_their_own_embedding_keep_the_targets_output(eagle_pair, options):
    """A third-party head's options change what it drafts, never what generate returns (greedy and sampled)."""
    target, trained = eagle_pair
    gen = torch.Generator().manual_seed(1)
    emb = target.get_input_embeddings().weight.detach()
    head = _head_with_options(trained, gen, own_embedding=emb + 0.1 * torch.randn(emb.shape, generator=gen), **options)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=20, do_sample=False)
        with attach(target, 4, compression="fp32") as h:
            out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=head)
        assert torch.equal(out, ref)
        assert any(s.gamma > 0 for s in h.stats) and head.embed_tokens is not None  # drafted, with its own embedding


@pytest.mark.skipif(not fused_linear_available(), reason="no oneDNN fused linear in this torch build")
def test_a_head_on_onednn_layers_drafts_as_before(eagle_pair):
    """``--draft-linear onednn`` on a head (its linear layers swapped): same drafts, the target's output."""
    import copy

    target, head = eagle_pair
    converted = copy.deepcopy(head)
    assert use_onednn_linear(converted) == 9  # fc, q/k/v/o, gate/up/down, lm_head: every linear layer
    assert (converted.device, converted.dtype) == (head.device, head.dtype)
    ids = torch.tensor([PROMPTS[0]])
    runs = []
    for h_model in (head, converted):
        with attach(target, 4) as h:
            out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=h_model)
        runs.append((out, [(s.gamma, s.drafted, s.accepted) for s in h.stats]))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert torch.equal(runs[0][0], target.generate(ids, max_new_tokens=24, do_sample=False))


def _greedy_runs_with_head(target, head, gamma, max_new_tokens):
    """One hook per prompt of PROMPTS, drafting ``gamma`` with ``head``; each output checked equal to the target's."""
    hooks = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        with attach(target, gamma) as h:
            out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=head)
        assert torch.equal(out, ref), prompt
        hooks.append(h)
    return hooks


def test_the_head_is_accepted_on_what_it_learned(eagle_pair):
    target, head = eagle_pair
    for prompt, h in zip(PROMPTS, _greedy_runs_with_head(target, head, 4, 30)):
        assert h.summary()["acceptance"] > 0.15, prompt


@pytest.mark.parametrize("copy", [False, True])
def test_sampling_with_the_head_keeps_the_target_distribution(copy):
    """Chi-square over the next two tokens: assisted sampling with a reduced-vocabulary head vs the exact joint;
    with a copy gate, from a prompt that repeats (its candidates reach tokens outside the head's vocabulary)."""
    from scipy.stats import chisquare

    target, _ = tiny_llama_pair(vocab_size=12, hidden_size=32, layers=3, seed=3, init_range=0.15, layer_scale=0.3)
    head = tiny_eagle3_head(target, LAYERS, draft_vocab_size=10, steps=100)
    ids = torch.tensor([[1, 2, 3]])
    if copy:
        head.set_copy_gate([1.0] * 8, [0.0] * 8, 8)
        ids = torch.tensor([[1, 2, 3, 11, 1, 2, 3, 11, 1, 2]])
    with torch.no_grad():
        p1 = torch.softmax(target(ids).logits[0, -1].double(), -1)
        joint = np.stack(
            [
                (
                    p1[a] * torch.softmax(target(torch.cat([ids, torch.tensor([[a]])], 1)).logits[0, -1].double(), -1)
                ).numpy()
                for a in range(12)
            ]
        )
    counts = np.zeros((12, 12))
    rng = np.random.default_rng(0)
    with attach(target, lambda f: int(rng.integers(1, 4)), compression="fp32", feature_set="online") as h:
        for i in range(1000):
            torch.manual_seed(i)
            out = target.generate(
                ids, max_new_tokens=3, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, assistant_model=head
            )
            counts[out[0, ids.shape[1]], out[0, ids.shape[1] + 1]] += 1
    drafted = [s for s in h.stats if s.gamma > 0]
    assert drafted and sum(s.accepted for s in drafted) / sum(s.gamma for s in drafted) > 0.2
    exp = joint.ravel() * counts.sum()
    obs = counts.ravel()
    small = exp < 5
    p = chisquare(np.append(obs[~small], obs[small].sum()), np.append(exp[~small], exp[small].sum())).pvalue
    assert p > 0.001


@pytest.mark.parametrize("kind", ["nf4", "int8-no-outliers"])
def test_quantized_targets_with_the_head(eagle_pair, tmp_path, kind):
    """A head trained on the fp32 target's features drafts for its bitsandbytes-quantized copy, losslessly."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    target, head = eagle_pair
    target.save_pretrained(tmp_path / "t")
    q = (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        if kind == "nf4"
        else BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=1e9)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quant = AutoModelForCausalLM.from_pretrained(tmp_path / "t", quantization_config=q, device_map="cpu").eval()
    rng = np.random.default_rng(1)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = quant.generate(ids, max_new_tokens=24, do_sample=False)
        with attach(quant, lambda f: int(rng.integers(0, 6)), feature_set="online") as h:
            out = quant.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=head)
        assert h.compression == kind.split("-")[0] and h.draft_loop == "eagle3"
        assert torch.equal(out, ref), (kind, prompt)


def test_a_target_the_head_cannot_read_decodes_plainly_with_one_warning():
    target, _ = tiny_llama_pair(vocab_size=64, layers=2, seed=0)
    other, _ = tiny_llama_pair(vocab_size=64, layers=3, seed=0)
    head = init_head(other, Eagle3Config.for_target(other.config, 64, LAYERS), torch.arange(64)).eval()
    ids = torch.tensor([[1, 2, 3]])
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    with attach(target, 3) as h, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=head)
    assert torch.equal(out, ref)
    ours = [w for w in caught if issubclass(w.category, PolicyFallbackWarning)]
    assert len(ours) == 1 and "reads target layers [0, 1, 2] but the target has 2" in str(ours[0].message)
    assert all(s.gamma == 0 for s in h.stats) and h.draft_loop.startswith("none (")
    # the hooks are gone once generate returns: a plain forward runs no capture
    assert all(not layer._forward_pre_hooks for layer in target.model.layers)  # noqa: SLF001 - torch's hook table


def test_hooks_are_removed_after_generate(eagle_pair):
    target, head = eagle_pair
    with attach(target, 2):
        target.generate(torch.tensor([[1, 2]]), max_new_tokens=5, do_sample=False, assistant_model=head)
    assert all(not layer._forward_pre_hooks for layer in target.model.layers)  # noqa: SLF001 - torch's hook table


def test_a_policy_trained_on_another_draft_kind_warns_once(eagle_pair, tmp_path):
    """An export records what drafted its training steps; the hook warns when it runs with another kind."""
    from speckv_policy.evaluation.synthetic import generate_synthetic_log
    from speckv_policy.export import export_onnx
    from speckv_policy.policies import TablePolicy
    from speckv_policy.training import fit_from_log

    log, _ = generate_synthetic_log(n_prompts=8, steps_per_prompt=20, seed=0)
    policy = fit_from_log(TablePolicy(), log)
    assert policy.draft_kind_ == "model"
    path = tmp_path / "p.onnx"
    export_onnx(policy, path)
    target, head = eagle_pair
    with attach(target, str(path)), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            target.generate(torch.tensor([[1, 2]]), max_new_tokens=6, do_sample=False, assistant_model=head)
    msgs = [str(w.message) for w in caught if issubclass(w.category, PolicyFallbackWarning)]
    assert len(msgs) == 1 and "trained on steps drafted by a draft model" in msgs[0]
    log["draft_model"] = "eagle3:head"
    assert fit_from_log(TablePolicy(), log).draft_kind_ == "eagle3"


def test_model_loading_and_race_arms_know_heads(tmp_path):
    """``load_model`` on a head folder gives the head (full precision only); a head's race runs HF's rule via the hook."""
    from pathlib import Path

    from speckv_policy.evaluation.race import HFHeuristicSchedule, make_arms
    from speckv_policy.hf.models import load_model, model_id

    target, _ = tiny_llama_pair(layers=3)
    init_head(target, Eagle3Config.for_target(target.config, 32, LAYERS), torch.arange(32)).save(tmp_path / "head")
    head = load_model(tmp_path / "head", "bf16")
    assert head.dtype == torch.bfloat16 and model_id(tmp_path / "head") == "eagle3:head"
    with pytest.raises(ValueError, match="full precision"):
        load_model(tmp_path / "head", "nf4")
    arms = {a.name: a for a in make_arms(Path("exported"), "smollm2-", ["hf-heuristic", "fixed-2"], eagle3=True)}
    assert set(arms) == {"target", "hf-heuristic", "fixed-2"} and not arms["hf-heuristic"].hf
    assert isinstance(arms["hf-heuristic"].rule("fp32"), HFHeuristicSchedule)
    with pytest.raises(SystemExit, match="unknown arm"):
        make_arms(Path("exported"), "smollm2-", ["hf-default"], eagle3=True)


def test_a_corrupt_features_cache_is_named(tmp_path):
    from speckv_policy.smollm2.eagle3 import _cached_features  # noqa: PLC2701 - the build's cache reader

    legacy = tmp_path / "features-fp32.pt"  # the single file of builds before shards
    legacy.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="features-fp32.pt: not a features file of this build .* delete it to"):
        _cached_features(tmp_path / "features-fp32", {}, [], None, LAYERS, "x", False)
    assert legacy.read_bytes() == b"not a torch file"  # left for the user to inspect, nothing overwritten
    shard = tmp_path / "features-int8-heldout" / "part-00000.pt"
    shard.parent.mkdir()
    shard.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="part-00000.pt: not a features file of this build .* delete the folder to"):
        _cached_features(shard.parent, {"ids": [torch.tensor([1, 2])]}, [0], None, LAYERS, "x", False)
    assert shard.read_bytes() == b"not a torch file"


def test_a_features_cache_read_from_other_target_layers_is_refused(tmp_path):
    """Each features folder records its layers before its first shard; folders of builds before the record were read
    at speculators' default layers, so they serve that default only."""
    from speckv_policy.smollm2.eagle3 import _cached_features  # noqa: PLC2701 - the build's cache reader

    ids = [torch.tensor([1, 2, 3], dtype=torch.int32)]
    folder = tmp_path / "features-fp32"
    _cached_features(folder, {"ids": ids}, [], None, LAYERS, "x", False)  # nothing to extract: the record alone
    assert json.loads((folder / "layers.json").read_text()) == {"aux_layer_ids": [0, 1, 2]}
    with pytest.raises(ValueError, match=re.escape("read from target layers [0, 1, 2], the head asks for [0, 2]")):
        _cached_features(folder, {"ids": ids}, [], None, (0, 2), "x", False)
    assert json.loads((folder / "layers.json").read_text()) == {"aux_layer_ids": [0, 1, 2]}  # left as it was
    old = tmp_path / "features-old"  # a folder of a build before the record
    old.mkdir()
    torch.save([{"ids": ids[0].long()}], old / "part-00000.pt")
    with pytest.raises(ValueError, match=re.escape("read from target layers [2, 15, 27], the head asks for [0, 1, 2]")):
        _cached_features(old, {"ids": ids}, [0], None, LAYERS, "x", False, (2, 15, 27))
    assert not (old / "layers.json").exists()
    feats, extracted = _cached_features(old, {"ids": ids}, [0], None, (2, 15, 27), "x", False, (2, 15, 27))
    assert len(feats) == 1 and extracted == 0
    assert json.loads((old / "layers.json").read_text()) == {"aux_layer_ids": [2, 15, 27]}
    legacy = tmp_path / "features-single.pt"  # the single file of builds before shards: the default only, no folder
    torch.save([{"ids": ids[0].long()}], legacy)
    with pytest.raises(ValueError, match="features-single: its features were read from target layers"):
        _cached_features(tmp_path / "features-single", {"ids": ids}, [0], None, LAYERS, "x", False, (2, 15, 27))
    assert not (tmp_path / "features-single").exists()
    (folder / "layers.json").write_text("[0, 1, 2]")
    with pytest.raises(ValueError, match="layers.json: not a layer record of this build"):
        _cached_features(folder, {"ids": ids}, [], None, LAYERS, "x", False)
    (folder / "layers.json").unlink()
    (folder / "layers.json").mkdir()  # not a regular file: named, left alone
    with pytest.raises(ValueError, match="layers.json: not a regular file"):
        _cached_features(folder, {"ids": ids}, [], None, LAYERS, "x", False)
    assert (folder / "layers.json").is_dir()


def test_a_features_cache_of_another_corpus_is_refused(tmp_path, monkeypatch):
    from speckv_policy.smollm2 import eagle3 as build
    from speckv_policy.smollm2.eagle3 import _cached_features  # noqa: PLC2701 - the build's cache reader

    monkeypatch.setattr(build, "SHARD_TEXTS", 2)
    ids = [torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32)]
    folder = tmp_path / "features-fp32"
    folder.mkdir()
    path = folder / "part-00000.pt"
    torch.save([{"ids": ids[0].long()}, {"ids": ids[1].long()}], path)
    feats, extracted = _cached_features(folder, {"ids": ids}, [0, 1], None, LAYERS, "x", False)
    assert len(feats) == 2 and extracted == 0
    cases = (
        ({"ids": ids}, [0], "it holds 2 texts where the corpus asks for 1"),
        ({"ids": [ids[0], torch.tensor([4, 6])]}, [0, 1], "its text 1 has other token ids than the corpus' text 1"),
    )
    for corpus, idx, why in cases:
        with pytest.raises(ValueError, match=re.escape(why) + r" \(the corpus changed since they were extracted\)"):
            _cached_features(folder, corpus, idx, None, LAYERS, "x", False)
    torch.save([{"ids": ids[1].long()}], folder / "part-00001.pt")  # a shard the corpus does not ask for
    with pytest.raises(ValueError, match="holds part-00001.pt where the corpus asks for 1 shards of 2 texts"):
        _cached_features(folder, {"ids": ids}, [0, 1], None, LAYERS, "x", False)
    (folder / "part-00001.pt").unlink()
    for other in ({"ids": ids}, [{"aux": ids[0]}], [{"ids": [1, 2, 3]}]):  # loads, but is not this build's list
        torch.save(other, path)
        with pytest.raises(ValueError, match="not a features file of this build .expected a list of texts"):
            _cached_features(folder, {"ids": ids}, [0, 1], None, LAYERS, "x", False)
    legacy = tmp_path / "features-old.pt"  # a single file of builds before shards is still read
    torch.save([{"ids": ids[1].long()}], legacy)
    feats, extracted = _cached_features(tmp_path / "features-old", {"ids": ids}, [1], None, LAYERS, "x", False)
    assert len(feats) == 1 and extracted == 0


def test_features_are_extracted_in_shards_read_back_mapped_and_resumed(tmp_path, monkeypatch):
    """Each shard is saved once extracted and read memory-mapped; a lost shard alone is extracted again."""
    from speckv_policy.smollm2 import eagle3 as build
    from speckv_policy.smollm2.eagle3 import _cached_features  # noqa: PLC2701 - the build's cache reader

    monkeypatch.setattr(build, "SHARD_TEXTS", 2)
    target, _ = tiny_llama_pair(vocab_size=64, layers=3, seed=1, layer_scale=0.2)
    g = torch.Generator().manual_seed(3)
    n = 5
    corpus = {"ids": [torch.randint(1, 64, (8 + 3 * i,), generator=g) for i in range(n)], "start": [4] * n}
    corpus.update(task_type=["t"] * n, prompt_id=[str(i) for i in range(n)], split=["train"] * n)
    idx = [4, 0, 3, 1, 2]
    direct = extract_features(corpus, idx, target, LAYERS, progress=False)
    folder = tmp_path / "features-fp32"
    feats, extracted = _cached_features(folder, corpus, idx, target, LAYERS, "x", False)
    assert extracted == 5 and sorted(p.name for p in folder.glob("part-*")) == [f"part-0000{k}.pt" for k in range(3)]
    for f, d in zip(feats, direct):
        assert torch.equal(f["ids"], d["ids"]) and torch.equal(f["aux"], d["aux"])
        assert torch.equal(f["top_ids"], d["top_ids"]) and f["prompt_id"] == d["prompt_id"]
    if Path("/proc/self/maps").exists():  # mapped from its shard, not copied into the heap
        ptr = feats[4]["aux"].data_ptr()
        for line in Path("/proc/self/maps").read_text().splitlines():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                assert line.endswith("part-00002.pt")
                break
        else:
            raise AssertionError("the shard's features are in no mapping")
    (folder / "part-00001.pt").unlink()
    calls = []
    target.register_forward_hook(lambda *a: calls.append(1))
    feats2, extracted = _cached_features(folder, corpus, idx, target, LAYERS, "x", False)
    assert extracted == 2 and len(calls) == 1 and all(torch.equal(f["aux"], d["aux"]) for f, d in zip(feats2, direct))
    (folder / "part-00002.pt").unlink()

    def fail(*_):
        raise RuntimeError("interrupted")

    target.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        _cached_features(folder, corpus, idx, target, LAYERS, "x", False)
    # an interrupted extraction leaves only the complete shards, and no temporary file
    assert sorted(p.name for p in folder.iterdir()) == ["layers.json", "part-00000.pt", "part-00001.pt"]


def test_feature_extraction_finds_glibc_malloc_trim_where_it_runs_on_glibc():
    import platform

    from speckv_policy.hf.eagle3_train import _malloc_trim  # noqa: PLC2701 - the build's memory release

    trim = _malloc_trim()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert trim is not None  # without it the SmolLM2 build peaked at 18.7 GB instead of 5.7 GB
        assert trim(0) in (0, 1)
    else:  # macOS, Windows, musl: nothing to call, and extraction must not try
        assert trim is None


def test_a_head_trained_under_bf16_autocast_keeps_fp32_weights_and_drafts_as_well(eagle_pair):
    """``precision="bf16"`` (``speckv-distill eagle3 --train-precision bf16``): the same steps on the same texts give
    other fp32 weights (autocast ran), a head whose drafts are kept about as often as the fp32-trained one's, and
    output equal to the target's; an unknown precision is refused by name."""
    target, head32 = eagle_pair
    head16 = tiny_eagle3_head(target, LAYERS, draft_vocab_size=48, prompts=PROMPTS, precision="bf16")
    assert all(p.dtype == torch.float32 for p in head16.parameters())
    assert not torch.equal(head16.layers[0].mlp.up_proj.weight, head32.layers[0].mlp.up_proj.weight)
    kept = {
        name: sum(s.accepted for h in _greedy_runs_with_head(target, head, 3, 24) for s in h.stats)
        for name, head in (("fp32", head32), ("bf16", head16))
    }
    assert kept["bf16"] >= 0.8 * kept["fp32"] > 0, kept
    with pytest.raises(ValueError, match="precision must be 'fp32' or 'bf16', got 'fp16'"):
        tiny_eagle3_head(target, LAYERS, draft_vocab_size=48, steps=1, precision="fp16")
