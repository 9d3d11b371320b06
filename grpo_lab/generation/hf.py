"""`transformers.generate` backend. It samples from the learner module itself: the same
weights, no copy and nothing to sync (a zero-cost generator on CPU or one GPU).
Sampler log-probs are log_softmax(logits / temperature) of the raw logits, the quantity the
learner's log-prob pass computes, so their gap is a true train/inference mismatch.
"""
from __future__ import annotations

import torch

from ..errors import LabError
from .base import GenerationRequest, Generator, Sample


def check_hf_placement(config) -> None:
    """The hf backend samples with the learner itself, so it has no device of its own (checked in preflight too)."""
    devices = config.placement.generator_devices()
    if devices != [config.placement.learner]:
        raise LabError(f"placement.generator: backend 'hf' samples with the learner itself on "
                       f"{config.placement.learner}, not on {devices}; set placement.generator: null "
                       "(a separate generator device needs a backend that holds its own weights)")


class HFGenerator(Generator):
    def __init__(self, learner, config):
        gen = config.generator
        super().__init__(learner.tokenizer)
        check_hf_placement(config)
        self.learner = learner

    def sync(self, learner) -> None:
        """Nothing to do: generation reads the learner's own LoRA weights."""

    @torch.no_grad()  # why: a rollout needs no autograd graph
    def _generate_chunk(self, prompt_ids, request: GenerationRequest) -> list[Sample]:
        from transformers import GenerationConfig, LogitsProcessorList

        model, tok = self.learner.model, self.tokenizer
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        greedy = request.temperature == 0
        # why explicit: a checkpoint's generation_config (e.g. a repetition penalty) would change what is sampled
        settings = GenerationConfig(
            max_new_tokens=request.max_completion_length, do_sample=not greedy,
            temperature=None if greedy else request.temperature, top_p=None if greedy else request.top_p,
            top_k=None if greedy else (request.top_k or None), eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, use_cache=True)
        recorder = SampledLogprobs(1.0 if greedy else request.temperature)
        was_training = model.training
        model.eval()  # why: gradient checkpointing is off in eval mode, so the KV cache is used
        try:
            sequences = model.generate(input_ids=input_ids.to(self.learner.device),
                                       attention_mask=attention.to(self.learner.device), generation_config=settings,
                                       logits_processor=LogitsProcessorList([recorder]))
        except RuntimeError as err:
            if "probability tensor contains" not in str(err):   # torch.multinomial on inf/nan probabilities
                raise
            raise LabError("rollout: the policy's next-token probabilities are inf/nan, so nothing can be sampled; "
                           "the LoRA weights diverged (lower grpo.learning_rate or grpo.max_grad_norm) or the model "
                           "overflows in model.dtype/bnb_4bit_compute_dtype (try float32)") from None
        finally:
            model.train(was_training)
        new_tokens = sequences[:, width:]
        logprobs = recorder.finish(new_tokens).cpu()   # why: a Rollout lives on the CPU; the device keeps nothing of it
        return [self._sample(row, lp, tok.eos_token_id)
                for row, lp in zip(new_tokens.cpu().tolist(), logprobs.tolist())]

    @staticmethod
    def _sample(row: list[int], logprobs: list[float], eos: int) -> Sample:
        end = row.index(eos) + 1 if eos in row else len(row)
        return Sample(completion_ids=row[:end], logprobs=logprobs[:end], truncated=eos not in row[:end])


class SampledLogprobs:
    """A logits processor that records log_softmax(raw logits / T) of each sampled token.

    It runs before the temperature/top-p warpers, so it sees the raw logits, and it keeps one
    step's [n, V] log-softmax only: the token sampled from step t is known at step t+1's call.
    (`output_logits=True` would keep every step's [n, V] logits: O(n x length x vocab).)"""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous = None
        self.columns: list[torch.Tensor] = []   # [n] per generated token

    def __call__(self, input_ids, scores):
        if self.previous is not None:
            self.columns.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, new_tokens) -> torch.Tensor:
        """[n, T] log-probs of `new_tokens` (the last token's comes from the last stored step)."""
        if self.previous is not None and len(self.columns) < new_tokens.shape[1]:
            self.columns.append(self.previous.gather(-1, new_tokens[:, -1:].to(self.previous.device)).squeeze(-1))
        self.previous = None   # why: drop the last [n, V] log-softmax as soon as it is used
        if not self.columns:
            return torch.zeros(new_tokens.shape, dtype=torch.float32)
        return torch.stack(self.columns, dim=1)
