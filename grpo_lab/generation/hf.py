"""`transformers.generate` backend. It samples from the learner module itself: the same
weights, no copy and nothing to sync (a zero-cost generator on CPU or one GPU).
Sampler log-probs are those of the distribution sampled from: logits / temperature, then top-k, then
top-p, renormalised (greedy: log_softmax of the logits), as vLLM's processed_logprobs and TRL's
importance-sampling correction use. It stops on `eos_token_ids`, the vllm backend's set too.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from functools import partial
from typing import Callable, Optional

import torch

from ..algo.logprobs import precision
from ..errors import LabError
from ..memory.heap import trim_host_heap
from ..models.park import Parking, parked_tensors
from ..models.source import resolve_model_path
from ..runtime import runtime
from .base import GenerationRequest, Generator, Sample, row_seeds
from .compile_counts import CompileCounts
from .leaving import decode_leaving, keep_sampler_rows
from .rollout_copy import RolloutCopy
from .sampling import DecodeStep, InPlace, InverseCdfSampler, SampledLogprobs
from .step_logits import kept_logits
from .step_memory import prefill_chunk
from .turn_cache import TurnCache
from .turn_shapes import TurnShapes

# why every field set: generate() fills each field left None from the checkpoint's generation_config (e.g. a
# repetition penalty), then from transformers' defaults (top_k 50): neither is what the request asked for.
# Temperature, top-k and top-p are applied by `sampling_processors` instead, so that the recorder sees their result.
# decoding steps between heap trims on a CPU learner: every 32 held the rollout's RSS at its start on the qwen2-152k
# preset for ~5% of its time (every step: +15%; glibc's fixed mmap threshold instead: +20%)
TRIM_EVERY = 32
NEUTRAL = dict(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0)
GENERATED_ROWS = [0]  # sequences this process's hf generator sampled (what inspect() reports: a rank's share)


def check_hf_placement(config) -> None:
    """The hf backend samples with the learner itself, so it has no device of its own (checked in preflight too)."""
    devices = config.placement.generator_devices()
    if devices != [config.placement.learner]:
        raise LabError(
            f"placement.generator: backend 'hf' samples with the learner itself on "
            f"{config.placement.learner}, not on {devices}; set placement.generator: null "
            "(a separate generator device needs a backend that holds its own weights)"
        )


class HFGenerator(Generator):
    def __init__(self, learner, config):
        super().__init__(learner.tokenizer, resolve_model_path(config.model.name_or_path))
        check_hf_placement(config)
        self.learner = learner
        model = config.model  # why the compute dtype: the copy's weights are in what the 4-bit matmul computes in
        dtype = getattr(torch, model.bnb_4bit_compute_dtype if model.load_in_4bit else model.dtype)
        self.rollout_copy = RolloutCopy(dtype)  # generator.hf_decode: merged: one copy for the Lab's rollouts
        self.static_cache = None  # a static rollout's one StaticCache, for all its generate() calls
        self.parking = Parking()  # generator.park_learner: what waits in host memory, until it is back
        self.shapes = TurnShapes()  # each generate() call's shape, for a tool loop's turns (Rollout.turn_shapes)

    def sync(self, learner) -> None:
        """Nothing to do: generation reads the learner's own LoRA weights."""

    def generate(self, batch, num_generations, request: GenerationRequest):
        """One seed per row (base.row_seeds) and every chunk left-padded to the whole batch's prompt width, so a row
        samples the same tokens in any chunk (the width alone changes the forward's rounding, enough to flip a bfloat16
        sample). A sharded learner's ranks then sample once for all: each its share of the groups
        (generation/sample_once.py)."""
        seeds = row_seeds(len(batch) * num_generations)
        width = max(map(len, self.encode_prompts(batch.prompts, request.max_prompt_length)))
        if runtime().sharded:
            from .sample_once import replicated, sample_once

            if not replicated():
                return sample_once(self, batch, num_generations, request, seeds, width)
        cuda = self.learner.device.type == "cuda"
        static = "cache_implementation" in DECODES[request.decode](cuda)
        keep, rows_total = request.keeps_copy, len(batch) * num_generations
        kept = self.turns is not None and request.turn_cache == "keep" and not static  # (a growing cache only)
        turns = TurnCache(self.tokenizer.pad_token_id, request) if kept else None  # a tool loop's turns go on from KV
        with self.decoding(request) as model, self.one_cache(keep), CompileCounts() as counted:

            def chunk(prompt_ids, rows, request):
                row_seeds_ = [seeds[i] for i in rows]  # (a later tool turn's rows: the row's own seed again)
                # why at most the rollout's rows: a batch smaller than a chunk is one call of its own size
                per_call = min(request.chunk_size or rows_total, rows_total)
                short = per_call - len(prompt_ids) if static else 0
                if short > 0:  # why: a static cache and its CUDA graphs are per batch size: a smaller last chunk
                    # would compile and record once more per rollout; it is filled with copies of its last row,
                    # whose samples are dropped
                    prompt_ids, row_seeds_ = prompt_ids + prompt_ids[-1:] * short, row_seeds_ + row_seeds_[-1:] * short
                held = turns.for_rows(rows) if turns else None
                samples = self.generate_chunk(prompt_ids, request, row_seeds_, width, model, held)[: len(rows)]
                if self.turns is not None and self.learner.device.type == "cpu":  # why: a turn's freed [rows,
                    trim_host_heap()  # vocab] buffers would stay resident as heap holes through the tool calls
                return samples

            out = self.generate_in_chunks(batch, num_generations, request, chunk)
        out.compiled_graphs, out.cudagraph_recorded_inputs = counted.delta()
        if request.decode == "merged":  # released on a GPU: new weight addresses, so CUDA graphs record again
            out.rollout_copy = "kept" if keep else "released"
            out.cudagraph_recordings_expected = int(cuda and not keep)
        return out

    @contextmanager
    def decoding(self, request: GenerationRequest):
        """The model the rollout decodes with (merged: the Lab's one copy). generator.park_learner: the learner's state
        the copy never reads waits in host memory while the copy decodes: parked after the merge (which reads the base
        and LoRA on the device), put back after a released copy is gone (why: never the learner beside it; a kept copy
        stays, resident as the plan holds it). What could not be put back (out of memory) stays held in
        `self.parking` for the Lab's next command."""
        park = request.park_learner and request.decode == "merged"  # (auto resolved to another path: nothing to park)
        try:
            with self.rollout_copy.model_for(self.learner.model, request.decode, request.keeps_copy) as model:
                if park:
                    tensors = parked_tensors(self.learner.model, self.learner.optimizer)
                    self.parking.park(tensors, request.park_buffer_bytes)  # (the plan's size: one buffer per Lab)
                yield model
        finally:
            self.parking.put_back()

    @contextmanager
    def one_cache(self, keep: bool = False):
        """One StaticCache for every generate() call of a rollout (each call resets it), let go as the rollout ends
        unless `keep` (a kept rollout copy: the cache stays with it, at its addresses, for the next rollout). Why:
        transformers builds a new one per call, so the KV tensors moved at every chunk, and CUDA graphs re-record when
        a static input's address changes; why let go: the learner's phases must not hold the rollout's KV, unless the
        plan holds it beside them (planner/learner_items: resident with a kept copy)."""
        try:
            yield
        finally:
            if not keep:
                self.static_cache = None

    def reused_cache(self, model, settings, cache, max_cache_len: int, rows: int):
        """The cache a generate() call starts from, and its settings: a static decode's first call starts from the
        one StaticCache (made when none of this length and batch size is held, else reset), its settings then naming
        no cache_implementation (transformers refuses both); any other call as given."""
        if cache is not None or settings.cache_implementation != "static":
            return cache, settings
        from transformers import StaticCache

        held = self.static_cache
        layer = held.layers[0] if held is not None else None
        if layer is None or layer.max_cache_len < max_cache_len or getattr(layer, "batch_size", rows) != rows:
            self.static_cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        else:
            self.static_cache.reset()  # (the same tensors: zeroed, its length back to 0)
        settings.cache_implementation = None
        return self.static_cache, settings

    def generate_once(self, model, settings, synced, request, samplers, ids, mask, cache, max_new_tokens, stop):
        """One generate() call of a rollout (generation/leaving.py may make several, going on from `cache`): its
        sequences, its KV cache and the sampler log-probs of its new tokens."""
        from transformers import LogitsProcessorList, StoppingCriteriaList

        recorder = SampledLogprobs(max_new_tokens)  # (its log-prob rows: one buffer, made once)
        step = DecodeStep(recorder, *samplers)
        # why a copy: transformers warns when generation fields come both in a config and as arguments
        settings = copy.deepcopy(settings)
        settings.max_new_tokens, settings.return_dict_in_generate = max_new_tokens, True
        # why the longest prompt a kept cache can meet: its length, and so its tensors, stay the same every rollout
        length = (request.max_prompt_length if request.keeps_copy else ids.shape[1]) + max_new_tokens
        cache, settings = self.reused_cache(model, settings, cache, length, ids.shape[0])
        first = self.shapes.mark in (None, "turn 1")  # (not a tool loop's later turn: generation/step_memory.py)
        settings.prefill_chunk_size = prefill_chunk(self.learner.device.type, cache, first)
        out = model.generate(
            input_ids=ids.to(self.learner.device),
            attention_mask=mask.to(self.learner.device),
            generation_config=settings,
            synced_gpus=synced,
            past_key_values=cache,
            stopping_criteria=StoppingCriteriaList([stop, step.release]),
            logits_processor=LogitsProcessorList([*sampling_processors(request), step, *self._step_hooks()]),
        )
        new = out.sequences[:, ids.shape[1] :]
        return out.sequences, out.past_key_values, recorder.finish(new).cpu()  # why CPU: a Rollout lives there

    @torch.no_grad()  # why: a rollout needs no autograd graph
    def generate_chunk(
        self, prompt_ids, request: GenerationRequest, seeds=None, width: int = 0, model=None, turns=None
    ) -> list[Sample]:
        """Sample `prompt_ids`, row i with `seeds[i]` (None: seeds drawn here), left-padded to at least `width`, with
        `model` (the learner's own by default; generator.hf_decode: merged, its rollout copy); `turns`: a tool loop's
        TurnCache (generation/turn_cache.py), going on from the KV of the rows' turns before."""
        model, tok = self.learner.model if model is None else model, self.tokenizer
        seeds = row_seeds(len(prompt_ids)) if seeds is None else seeds
        GENERATED_ROWS[0] += len(prompt_ids)
        # why synced through the shards: every forward all-gathers each layer, so a rank whose rows are done must go on
        # running forwards until every rank's are (transformers' synced_gpus); gathered whole, a forward gathers nothing
        synced = runtime().sharded and not request.gather_for_generation
        width = max(width, *map(len, prompt_ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        settings = self._settings(request)
        samplers = sampler(request, seeds)  # per-row streams, kept across the calls of a rollout whose rows leave
        call = self.shapes.wrap(partial(self.generate_once, model, settings, synced, request, samplers))
        cache, turns = None, None if synced else turns
        if turns is not None:  # why no row leaves within a turn: a row that stops may call a tool, its KV going on
            input_ids, attention, cache, call = turns.start(prompt_ids, input_ids, attention, call, request)
        leave = request.drop_finished_rows and not synced and settings.cache_implementation is None and turns is None
        # why: the prefill scores hidden[:, -1:, :], a strided view that torch's CPU bfloat16 matmul cannot fold: it
        # would copy the LM head once per sequence ([n, hidden, vocab], 311 MB at 8 x Qwen2.5's vocabulary)
        contiguous = model.get_output_embeddings().register_forward_pre_hook(lambda _, args: (args[0].contiguous(),))
        try:  # eval mode (checkpointing off, so the KV cache is used); a sharded learner gathered or not (P3)
            with (
                self.learner.sharding.generation(model, request.gather_for_generation),
                compiled_decode(model, request.decode),
                # why: a CPU step's [rows, vocab] logits in one kept buffer, not freed and faulted back each step
                kept_logits(model, self.learner.device.type, request.decode == "compiled"),
                precision(self.learner.model),  # why: the rollout samples in the numerics the log-prob passes score in
            ):
                tokens, logprobs = decode_leaving(
                    call,
                    input_ids,
                    attention,
                    request.max_completion_length,
                    self.eos_token_ids,
                    lambda kept: keep_sampler_rows(samplers, kept),
                    leave,
                    cache,
                )
        except RuntimeError as err:
            if "probability tensor contains" not in str(err):  # InverseCdfSampler on inf/nan probabilities
                raise
            raise LabError(
                "rollout: the policy's next-token probabilities are inf/nan, so nothing can be sampled; "
                "the LoRA weights diverged (lower grpo.learning_rate or grpo.max_grad_norm) or the model "
                "overflows in model.dtype/bnb_4bit_compute_dtype (try float32)"
            ) from None
        finally:
            contiguous.remove()
        return [self._sample(row, lp, self.eos_token_ids) for row, lp in zip(tokens, logprobs)]

    def _settings(self, request: GenerationRequest):
        """The GenerationConfig of a rollout: every field set (NEUTRAL), stopping on this generator's EOS set."""
        from transformers import GenerationConfig

        # why generate() picks greedily even when sampling: InverseCdfSampler draws the token and leaves it the only
        # finite score (torch.multinomial's CPU path spent 68% of a rollout at Qwen2.5's vocabulary on exponentials)
        return GenerationConfig(
            max_new_tokens=request.max_completion_length,
            do_sample=False,
            **NEUTRAL,
            min_new_tokens=request.max_completion_length if request.full_length else None,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            use_cache=True,
            **DECODES[request.decode](self.learner.device.type == "cuda"),
        )

    def _step_hooks(self) -> list:
        """Per decoding step: a CPU learner's buffers live in the host heap, so trim its holes as they appear
        (heap.py); and an armed fault's point (recovery/faults.py)."""
        from ..recovery.faults import armed

        trim = [TrimHeapEvery(TRIM_EVERY)] if self.learner.device.type == "cpu" else []
        return trim + ([decode_fault_point] if armed() else [])

    @staticmethod
    def _sample(row: list[int], logprobs: list[float], eos_ids: list[int]) -> Sample:
        """Cut at the first stop token (kept); after it generate() only pads. None within the row = truncated."""
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), None)
        return Sample(completion_ids=row[:end], logprobs=logprobs[:end], truncated=end is None)


def _compile_config() -> dict:
    from transformers.generation.configuration_utils import CompileConfig

    # why not fullgraph: bitsandbytes' 4-bit matmul and PEFT's LoRA wrappers may break the graph; CUDA graphs still
    # capture each piece (cudagraph trees)
    return {"cache_implementation": "static", "compile_config": CompileConfig(fullgraph=False, mode="reduce-overhead")}


# generator.hf_decode (auto resolved: planner/plan.rollout_decode) -> the GenerationConfig settings of that decode path,
# given whether the learner is on a GPU
DECODES: dict[str, Callable[[bool], dict]] = {
    "dynamic": lambda cuda: {},
    # why disable_compile: a static cache alone, measured apart from CUDA graphs
    "static": lambda cuda: {"cache_implementation": "static", "disable_compile": True},
    "compiled": lambda cuda: _compile_config(),
    # the rollout copy (generation/rollout_copy.py): CUDA graphs over its decode step on a GPU; on the CPU, where a
    # step's cost is its kernels, not their launches, the growing cache
    "merged": lambda cuda: _compile_config() if cuda else {},
    "auto": lambda cuda: {},  # unresolved (a request not built by an executor): dynamic
}


@contextmanager
def compiled_decode(model, decode: str):
    """transformers compiles the decode step only for models whose quantizer says it can (bitsandbytes' says no): for
    `compiled`, the base model is let through for this generate() call alone (its compiled forward is cached)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if decode != "compiled":
        yield
        return
    base._valid_auto_compile_criteria = lambda *args, **kwargs: True  # an instance attribute, removed below
    try:
        yield
    finally:
        del base._valid_auto_compile_criteria


def sampling_processors(request: GenerationRequest) -> list:
    """Temperature, then top-k, then top-p (vLLM's and transformers' order) as logits processors of our own:
    transformers runs a caller's processors before its own warpers, so the recorder placed after these sees
    the distribution sampled from. Each writes its result over the step's scores (InPlace), so the scores generate()
    holds are its logits' copy, let go by DecodeStep.release. Greedy: none (the argmax of the raw logits)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if request.temperature == 0:
        return []
    processors = [TemperatureLogitsWarper(request.temperature)] if request.temperature != 1 else []
    if request.top_k:
        processors.append(TopKLogitsWarper(request.top_k))
    if request.top_p < 1:
        processors.append(TopPLogitsWarper(request.top_p))
    return [InPlace(p) for p in processors]


def sampler(request: GenerationRequest, seeds: Optional[list[int]] = None) -> list:
    """The token choice: InverseCdfSampler when sampling (one stream per row); greedy needs none (the argmax)."""
    return [InverseCdfSampler(seeds)] if request.temperature > 0 else []


class TrimHeapEvery:
    """A logits processor that returns the C heap's free pages to the OS every `every` decoding steps."""

    def __init__(self, every: int):
        self.every, self.calls = every, 0

    def __call__(self, input_ids, scores):
        if self.calls % self.every == 0:
            trim_host_heap()
        self.calls += 1
        return scores


def decode_fault_point(input_ids, scores):
    """lab.arm_fault's rollout point (recovery/faults.py): the third decoding step, on any device."""
    from ..recovery.faults import fire

    fire("decode", nth=3)
    return scores
