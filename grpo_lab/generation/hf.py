"""`transformers.generate` backend. It samples from the learner module itself: the same
weights, no copy and nothing to sync (a zero-cost generator on CPU or one GPU).
Sampler log-probs are log_softmax(logits / temperature) of the raw logits, the quantity the
learner's log-prob pass computes, so their gap is a true train/inference mismatch.
"""
from __future__ import annotations

import torch

from ..errors import LabError
from .base import GenerationRequest, Generator, Sample


class HFGenerator(Generator):
    def __init__(self, learner, config):
        gen = config.generator
        super().__init__(learner.tokenizer, gen.max_prompt_length, gen.chunk_size)
        devices = config.placement.generator_devices()
        if devices != [config.placement.learner]:
            raise LabError(f"placement.generator: backend 'hf' samples with the learner itself on "
                           f"{config.placement.learner}, not on {devices}; set placement.generator: null "
                           "(a separate generator device needs a backend that holds its own weights)")
        self.learner = learner

    def sync(self, learner) -> None:
        """Nothing to do: generation reads the learner's own LoRA weights."""

    @torch.no_grad()  # why: a rollout needs no autograd graph
    def _generate_chunk(self, prompt_ids, request: GenerationRequest) -> list[Sample]:
        model, tok = self.learner.model, self.tokenizer
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        greedy = request.temperature == 0
        was_training = model.training
        model.eval()  # why: gradient checkpointing is off in eval mode, so the KV cache is used
        try:
            out = model.generate(
                input_ids=input_ids.to(self.learner.device), attention_mask=attention.to(self.learner.device),
                max_new_tokens=request.max_completion_length, do_sample=not greedy,
                temperature=None if greedy else request.temperature, top_p=None if greedy else request.top_p,
                top_k=None if greedy else (request.top_k or None),
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                return_dict_in_generate=True, output_logits=True, use_cache=True,
            )
        finally:
            model.train(was_training)
        new_tokens = out.sequences[:, width:].cpu()                      # [n, T]
        temperature = 1.0 if greedy else request.temperature
        # why: one [n, V] step at a time, so log-softmax never holds all T steps in float32 together
        logprobs = torch.stack([
            torch.log_softmax(step.float() / temperature, dim=-1).gather(-1, new_tokens[:, t:t + 1].to(step.device)).squeeze(-1).cpu()
            for t, step in enumerate(out.logits)
        ], dim=1) if out.logits else torch.zeros_like(new_tokens, dtype=torch.float32)
        del out  # why: drop the per-step logits of this chunk before the next chunk runs
        return [self._sample(row, lp, tok.eos_token_id, request.max_completion_length)
                for row, lp in zip(new_tokens.tolist(), logprobs.tolist())]

    @staticmethod
    def _sample(row: list[int], logprobs: list[float], eos: int, max_len: int) -> Sample:
        end = row.index(eos) + 1 if eos in row else len(row)
        return Sample(completion_ids=row[:end], logprobs=logprobs[:end], truncated=eos not in row[:end])
