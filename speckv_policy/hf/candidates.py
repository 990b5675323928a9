"""The candidate generator the hook installs: transformers' assisted drafting with the length from a policy.

Only the choice of how many draft tokens to propose changes; verification and
acceptance (greedy match or rejection sampling) and the target's cache stay
transformers' own code, so the output is the target's whatever gamma the
policy picks.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from ..runtime import PolicyFallbackWarning
from . import _compat
from ._compat import AssistedCandidateGenerator
from .controller import Controller
from .eagle3 import Eagle3Head
from .eagle3_draft import Eagle3Drafter, TargetFeatureTap, eagle3_blocker
from .fast_draft import LlamaDecodeStep, decode_step_blocker
from .lean_draft import LeanDraft

__all__ = ["Eagle3CandidateGenerator", "SpeckvCandidateGenerator", "install"]


def _decode_step(draft: Any, how: str) -> tuple[LlamaDecodeStep | None, str]:
    """The decode step the lean loop runs ``draft`` through (None: its forward), and what ran, for the handle."""
    if how == "transformers":
        return None, "transformers (draft_forward='transformers')"
    why = decode_step_blocker(draft)
    if why is not None:
        return None, f"transformers ({why})"
    return LlamaDecodeStep(draft), "fast"


class _PolicyStop(StoppingCriteria):
    """Stopping criterion that lets the controller end the draft early (the ``generate()`` draft loop)."""

    def __init__(self, controller: Controller, start_len: int) -> None:
        self.controller = controller
        self.start_len = start_len

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        k = input_ids.shape[-1] - self.start_len
        stop = self.controller.on_draft_token(k, scores[-1][0], self.start_len + k - 1)
        return torch.full((input_ids.shape[0],), bool(stop), dtype=torch.bool, device=input_ids.device)


class SpeckvCandidateGenerator(AssistedCandidateGenerator):
    """``AssistedCandidateGenerator`` whose draft length comes from a policy.

    Only the choice of how many draft tokens to propose changes; verification
    and acceptance are transformers' own code.
    """

    def __init__(self, *args: Any, controller: Controller, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.controller = controller
        # switch off transformers' own confidence stop (None would mean 0.4)
        self.assistant_confidence_threshold = 0.0
        self.generation_config.assistant_confidence_threshold = 0.0
        self.assistant_generation_config.num_assistant_tokens_schedule = "constant"
        self.num_assistant_tokens = controller.max_gamma
        controller.begin(self.generation_config, self.assistant_model.device)
        self.lean: LeanDraft | None = None
        why = "draft_loop='generate'"
        if controller.draft_loop == "lean":
            why = _compat.lean_draft_blocker(self.assistant_model, self.assistant_kwargs)
            if why is None:
                gc = self.generation_config
                step, controller.draft_forward_used = _decode_step(self.assistant_model, controller.draft_forward)
                self.lean = LeanDraft(
                    self.assistant_model,
                    self.logits_processor,
                    bool(gc.do_sample),
                    gc.eos_token_id,
                    self.main_model_min_length or 0,
                    decode_step=step,
                )
        controller.draft_loop_used = "lean" if self.lean is not None else f"generate ({why})"
        if self.lean is None:
            controller.draft_forward_used = "transformers (draft_loop 'generate')"

    def get_candidates(
        self, input_ids: torch.LongTensor, **kwargs: Any
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        c = self.controller
        input_ids = input_ids.to(self.assistant_model.device)
        cur = input_ids.shape[-1]
        cap = c.start_step(input_ids, self.main_model_max_length - cur - 1)
        if cap <= 0:
            c.start_verification(drafted=False)
            return input_ids, None
        per_token = c.mode.asks_per_token
        if self.lean is not None:
            ids, logits = self.lean.draft(input_ids, cap, c.on_draft_token if per_token else None)
        else:
            self.num_assistant_tokens = cap
            min_new, max_new = _compat.calculate_new_tokens(self, input_ids)
            _compat.sync_draft_inputs(self, input_ids)  # also after steps that skipped the draft
            args = _compat.prepare_generation_args(self, input_ids, min(min_new, max_new), max_new)
            if per_token:
                args["stopping_criteria"] = StoppingCriteriaList([_PolicyStop(c, cur)])
            ids, logits = _compat.generate_candidates(self, args)
        gamma = c.finish_draft(ids, logits, cur)
        c.start_verification()
        if gamma == 0:
            return input_ids, None
        return ids[:, : cur + gamma], logits[:, :gamma]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        step = self.controller.current
        if self.lean is None and step is not None:  # the generate() path: keep only verified draft positions
            _compat.crop_draft_cache(self, step.context_len + min(int(num_matches), step.gamma))
        self.controller.end_step(int(num_matches))
        self.controller.observe_verification(scores, int(num_matches))


class Eagle3CandidateGenerator(CandidateGenerator):
    """Candidate generator drafting with an EAGLE-3 head that reads the target's features; length from a policy.

    The first step of a generation drafts nothing (the target's prefill provides
    the first features). A target the head cannot read, or features that go
    missing, mean plain decoding from then on, with one warning: the output is
    the target's either way.
    """

    def __init__(
        self,
        target: Any,
        head: Eagle3Head,
        generation_config: Any,
        logits_processor: Any,
        controller: Controller,
        taps: list[TargetFeatureTap],
    ) -> None:
        self.controller = controller
        self.assistant_model = head
        self.main_model_max_length = generation_config.max_length
        self.drafter: Eagle3Drafter | None = None
        self.tap: TargetFeatureTap | None = None
        why = eagle3_blocker(target, head)
        if why is None:
            self.tap = TargetFeatureTap(target, head.eagle.aux_layer_ids)
            taps.append(self.tap)
            embed = head.input_embedding(target.get_input_embeddings().weight.detach())
            self.drafter = Eagle3Drafter(
                head,
                embed.to(head.device),
                logits_processor,
                bool(generation_config.do_sample),
                generation_config.eos_token_id,
                generation_config.min_length or 0,
            )
        else:
            self._give_up(why)
        controller.begin(generation_config, head.device)
        controller.draft_loop_used = "eagle3" if self.drafter is not None else f"none ({why})"
        controller.draft_forward_used = "eagle3 head"
        self._cur = 0
        self._gamma = 0

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one step drafts (transformers >= 5.25 sizes recurrent-state recording by it)."""
        return int(self.controller.max_gamma)

    def _give_up(self, why: str) -> None:
        warnings.warn(
            f"speckv-policy: the EAGLE-3 head cannot draft here ({why}); decoding without drafts",
            PolicyFallbackWarning,
            stacklevel=3,
        )
        self.drafter = None
        if self.tap is not None:
            self.tap.remove()

    def get_candidates(
        self, input_ids: torch.LongTensor, **kwargs: Any
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        c = self.controller
        cur = input_ids.shape[-1]
        self._cur, self._gamma = cur, 0
        ready = self.drafter is not None and self.drafter.ready(cur)
        cap = c.start_step(input_ids, self.main_model_max_length - cur - 1 if ready else 0)
        if cap <= 0 or self.drafter is None:
            c.start_verification(drafted=False)
            return input_ids, None
        per_token = c.mode.asks_per_token
        ids, logits = self.drafter.draft(input_ids, cap, c.on_draft_token if per_token else None)
        gamma = c.finish_draft(ids, logits, cur)
        c.start_verification()
        self._gamma = int(gamma)
        if gamma == 0:
            return input_ids, None
        return ids[:, : cur + gamma], logits[:, :gamma]

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int) -> None:
        if self.drafter is not None and self.tap is not None:
            feats = self.tap.take()
            if feats is None:
                self._give_up("the target's forward pass did not reach the layers the head reads")
            else:
                end = self._cur + self._gamma  # the forward covered the last feats.shape[0] positions before end
                try:
                    self.drafter.add_features(feats, end - feats.shape[0], self._cur + int(num_matches))
                except ValueError as exc:
                    self._give_up(str(exc))
        self.controller.end_step(int(num_matches))
        self.controller.observe_verification(scores, int(num_matches))


def install(target: Any, controller: Controller) -> None:
    """Route ``target``'s plain assisted generation through a :class:`SpeckvCandidateGenerator`."""
    original = _compat.default_candidate_generator(target)
    taps: list[TargetFeatureTap] = []  # an EAGLE-3 head's hooks on the target, removed when generate returns

    def _get_candidate_generator(
        generation_config: Any,
        input_ids: torch.LongTensor,
        inputs_tensor: Any,
        logits_processor: Any,
        model_kwargs: dict,
        assistant_model: Any = None,
        target_tokenizer: Any = None,
        assistant_tokenizer: Any = None,
    ) -> Any:
        plain_assisted = (
            assistant_model is not None
            and target_tokenizer is None
            and generation_config.prompt_lookup_num_tokens is None
            and getattr(generation_config, "assistant_early_exit", None) is None
        )
        if not plain_assisted:
            return original(
                generation_config,
                input_ids,
                inputs_tensor,
                logits_processor,
                model_kwargs,
                assistant_model,
                target_tokenizer,
                assistant_tokenizer,
            )
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"speckv-policy: Hugging Face assisted decoding runs one sequence at a time; got batch size "
                f"{input_ids.shape[0]}. Call generate once per prompt."
            )
        if (generation_config.num_beams or 1) > 1:
            raise ValueError("speckv-policy: assisted decoding does not support beam search (num_beams > 1)")
        controller.check_draft_kind("eagle3" if isinstance(assistant_model, Eagle3Head) else "model")
        if isinstance(assistant_model, Eagle3Head):
            return Eagle3CandidateGenerator(
                target, assistant_model, generation_config, logits_processor, controller, taps
            )
        return SpeckvCandidateGenerator(
            input_ids=input_ids,
            assistant_model=assistant_model,
            generation_config=generation_config,
            model_kwargs=model_kwargs,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            controller=controller,
        )

    original_generate = target.generate

    @functools.wraps(original_generate)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("assistant_model") is not None:
            gc = kwargs.get("generation_config") or target.generation_config
            beams = kwargs.get("num_beams", getattr(gc, "num_beams", 1)) or 1
            if beams > 1:
                # transformers would silently run beam search without the assistant
                raise ValueError("speckv-policy: assisted decoding does not support beam search (num_beams > 1)")
        try:
            return original_generate(*args, **kwargs)
        finally:
            while taps:
                taps.pop().remove()

    _compat.install_candidate_generator(target, _get_candidate_generator)
    target.generate = generate
