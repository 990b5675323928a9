"""Experiment: why the head's first draft token is kept less often in a gamma-8 step than teacher-forced agreement says.

The EAGLE-3 profile keeps the first draft token in 0.49 of fp32 greedy gamma-8 steps, while the head agrees with the
target on 0.588 of held-out answer tokens teacher-forced. The drafter is exact (at gamma 1 the hook keeps what the
teacher-forced replay predicts), so the hypothesis is *where* steps start: a gamma-8 step starts right after the
token where the last chain broke, and the head's hits are correlated from one position to the next.

This script generates the held-out answers through the hook at fixed gammas (fp32 target and head, greedy), maps
each step's first draft token to its answer position, and reads the teacher-forced hit at that position
(``eagle3_train.first_draft_hits``, copy gate on, as the hook drafts). It prints, per gamma: the kept share of first
draft tokens, the teacher-forced hit rate at the same positions (equal if the drafter is exact), the share of steps
that start right after a teacher-forced miss, and the hit rates after a miss and after a hit.

    .venv/bin/python benchmarks/eagle3_chain_starts.py --corpus /tmp/speckv-build/corpus-task-fp32.pt

The corpus is the one ``datasets/smollm2/build.sh`` step 2b writes (its held-out greedy answers).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from speckv_policy.hf import attach, load_eagle3
from speckv_policy.hf.eagle3_train import extract_features, first_draft_hits
from speckv_policy.smollm2.models import load_model


def rates(hits: list[torch.Tensor]) -> dict[str, float]:
    """Teacher-forced hit rate overall, after a miss and after a hit at the previous answer position."""
    prev_miss = [int(h[k]) for h in hits for k in range(1, len(h)) if not h[k - 1]]
    prev_hit = [int(h[k]) for h in hits for k in range(1, len(h)) if h[k - 1]]
    every = torch.cat(hits).float()
    return {
        "positions": len(every),
        "hit_rate": round(float(every.mean()), 4),
        "hit_after_miss": round(sum(prev_miss) / len(prev_miss), 4),
        "hit_after_hit": round(sum(prev_hit) / len(prev_hit), 4),
        "share_after_miss": round(len(prev_miss) / (len(prev_miss) + len(prev_hit)), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--head", default="datasets/smollm2/eagle3")
    p.add_argument("--gammas", default="1,2,4,8")
    p.add_argument("--texts", type=int, default=48, help="held-out answers to generate (every n-th, spread)")
    args = p.parse_args()
    torch.set_num_threads(2)
    corpus = torch.load(args.corpus, weights_only=True)
    held = [i for i, s in enumerate(corpus["split"]) if s == "heldout" and corpus["greedy"][i]]
    held = held[:: max(1, len(held) // args.texts)][: args.texts]
    target = load_model("smollm2", "fp32")
    head = load_eagle3(args.head)
    feats = extract_features(corpus, held, target, head.eagle.aux_layer_ids, progress=False)
    embed = target.get_input_embeddings().weight.detach().float()
    hits = first_draft_hits(head, embed, feats)
    out = {"texts": len(held), "teacher_forced": rates(hits), "gammas": {}}
    print(json.dumps(out["teacher_forced"]), flush=True)
    for gamma in (int(g) for g in args.gammas.split(",")):
        t0 = time.time()
        kept = tf_at_start = after_miss = steps = equal = 0
        start_hit_after_miss = [0, 0]
        start_hit_after_hit = [0, 0]
        for t, h in zip(feats, hits):
            ids, s = t["ids"], t["start"]
            answer = ids[s:]
            with attach(target, gamma, compression="fp32") as handle, torch.no_grad():
                got = target.generate(
                    ids[None, :s], assistant_model=head, max_new_tokens=len(answer), do_sample=False, min_new_tokens=0
                )
                stats = list(handle.stats)
            new = got[0, s:]
            n = min(len(new), len(answer))
            same = torch.equal(new[:n], answer[:n])
            equal += int(same)
            for st in stats:
                k = st.context_len - s  # answer position of this step's first draft token
                if st.gamma < 1 or not 0 <= k < min(n, len(h)) or not same:
                    continue
                steps += 1
                kept += int(st.accepted >= 1)
                tf_at_start += int(h[k])
                if k >= 1:
                    bucket = start_hit_after_miss if not h[k - 1] else start_hit_after_hit
                    bucket[0] += int(h[k])
                    bucket[1] += 1
                    after_miss += int(not h[k - 1])
        res = {
            "outputs_equal": f"{equal}/{len(feats)}",
            "steps": steps,
            "first_token_kept": round(kept / steps, 4),
            "teacher_forced_hit_at_step_starts": round(tf_at_start / steps, 4),
            "share_of_starts_after_a_miss": round(after_miss / steps, 4),
            "hit_at_starts_after_a_miss": round(start_hit_after_miss[0] / max(1, start_hit_after_miss[1]), 4),
            "hit_at_starts_after_a_hit": round(start_hit_after_hit[0] / max(1, start_hit_after_hit[1]), 4),
            "minutes": round((time.time() - t0) / 60, 1),
        }
        out["gammas"][gamma] = res
        print(gamma, json.dumps(res), flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
