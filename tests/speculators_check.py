"""Run by vLLM's environment (tests/test_vllm.py): an EAGLE-3 head folder read by the speculators library's own classes.

Prints ``RESULT {json}``: the config's fields as speculators parsed them, and how the folder's weights compare with the
state dict of speculators' own ``Eagle3DraftModel`` built from that config (names and shapes). Run from outside the
repository: its ``datasets/`` folder would shadow the ``datasets`` package speculators imports.
"""

from __future__ import annotations

import json
import sys

from safetensors import safe_open
from speculators import SpeculatorModelConfig
from speculators.models.eagle3.core import Eagle3DraftModel


def main(folder: str) -> None:
    cfg = SpeculatorModelConfig.from_pretrained(folder)
    cfg.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001 - speculators' own default needs flex
    theirs = {k: tuple(v.shape) for k, v in Eagle3DraftModel(cfg).state_dict().items() if not k.startswith("verifier_")}
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        ours = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    result = {
        "class": type(cfg).__name__,
        "speculators_model_type": cfg.speculators_model_type,
        "draft_vocab_size": cfg.draft_vocab_size,
        "aux_layer_ids": cfg.eagle_aux_hidden_state_layer_ids,
        "target_hidden_size": cfg.target_hidden_size,
        "layer_config": type(cfg.transformer_layer_config).__name__,
        "verifier": cfg.speculators_config.verifier.name_or_path,
        "algorithm": cfg.speculators_config.algorithm,
        "missing": sorted(set(theirs) - set(ours)),
        "unexpected": sorted(set(ours) - set(theirs)),
        "misshapen": sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k]),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
