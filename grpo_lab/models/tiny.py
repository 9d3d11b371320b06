"""A tiny Qwen2-architecture checkpoint and a byte-level BPE tokenizer trained on the fly, written with
`save_pretrained` so it loads through the normal `from_pretrained` path. Shapes are chosen for vLLM's CPU
kernels (head_dim 64). `builtin:tiny-qwen2` is briefly trained on the arithmetic set (models/tiny_train.py), so its
completions read as answers; `builtin:tiny-random` and the large-vocabulary ones keep random weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from ..data.arithmetic import SYSTEM_PROMPT, arithmetic_problems
from ..errors import LabError
from .tiny_train import build_progress

TINY = "tiny-qwen2"
# name -> (builder version, build_tiny_model arguments); why the version is in the cache name: a changed
# builder must not reuse an old checkpoint
BUILTINS: dict[str, tuple[int, dict]] = {
    # trained ~1 min on worked solutions when first built (models/tiny_train.py); 3 layers got more sums right
    # than 2 in it
    TINY: (2, {"vocab_size": 768, "num_layers": 3, "eos_probability": None, "train_steps": 700}),
    # TINY's body trained ~1 min to answer the arithmetic set with and without a calculator tool, through TRL's
    # Qwen2.5 chat template (models/tiny_tools.py): the `tiny-tools` preset's model
    "tiny-tools": (
        1,
        {"vocab_size": 768, "num_layers": 3, "eos_probability": None, "train_steps": 500, "tool_calls": True},
    ),
    # random weights, EOS reachable at ~10% a token: the test suite's model (varied lengths, near-flat logits)
    "tiny-random": (1, {}),
    # Qwen2.5's vocabulary (151,936) on the tiny body: the logits dominate memory as in every real model.
    # No EOS boost: completions run to max_completion_length, the length the planner plans for.
    "qwen2-152k": (1, {"vocab_size": 151936, "eos_probability": None, "max_positions": 4096}),
    # a Llama/Mistral-size vocabulary (32,000) on the tiny body: the planner's grid's other end
    # (bench/plan_accuracy/planner_accuracy.py)
    "qwen2-32k": (1, {"vocab_size": 32000, "eos_probability": None, "max_positions": 4096}),
    # the KV cache dominates generation, as in a long rollout (P2, notebooks/03): 16 KV heads of 64 on 4 layers
    # (32 KiB a token in float32) on a narrow body (hidden 256: 1.4M weights a layer), so a CPU decodes it in seconds
    "kv-heavy": (
        1,
        {
            "hidden_size": 256,
            "num_layers": 4,
            "intermediate_size": 512,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "eos_probability": None,
            "max_positions": 2048,
        },
    ),
    # the decoder layers dominate a 16-bit model (P3, notebooks/06): 16 layers of hidden 1024 (16.8M weights each) on
    # the tiny vocabulary, saved in bfloat16 (513 MB): gathered whole on a CPU rank they cross its budget
    # (placement.rank_memory_gib), one layer at a time they fit; no EOS boost (every rollout runs to its length)
    "layers-heavy": (
        1,
        {
            "hidden_size": 1024,
            "num_layers": 16,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "eos_probability": None,
            "dtype": "bfloat16",
        },
    ),
    # a mixture of experts (Qwen3-MoE, transformers' fused 3-D experts) on the tiny body: 8 experts of width 64, 2 a
    # token, random weights, EOS reachable: the CPU suite's MoE learner (nf4 experts, models/experts.py)
    "tiny-moe": (1, {"experts": 8, "experts_per_token": 2, "expert_intermediate": 64}),
    # the same with a shared expert every token goes through beside the routed ones (Qwen2-MoE: its MLP of width 96
    # and its sigmoid gate): the planner's shared-expert terms under test
    "tiny-qwen2-moe": (
        1,
        {"experts": 8, "experts_per_token": 2, "expert_intermediate": 64, "shared_expert_intermediate": 96},
    ),
    # a reward model (Qwen2ForSequenceClassification, one label) on the tiny body, random weights: the CPU suite's
    # data.reward_models (models/reward_model.py)
    "tiny-reward": (1, {"eos_probability": None, "reward": True}),
    # Qwen2.5-0.5B's shape with random weights (24 layers, hidden 896, 14 heads, 2 KV heads, vocabulary 151,936), saved
    # in bfloat16 (1 GB): the GPU check's model (bench/gpu/gpu_check.py), where memory and speed depend on shape alone
    "qwen2.5-0.5b-random": (
        1,
        {
            "vocab_size": 151936,
            "hidden_size": 896,
            "num_layers": 24,
            "intermediate_size": 4864,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "eos_probability": None,
            "max_positions": 4096,
            "dtype": "bfloat16",
        },
    ),
}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _train_tokenizer(vocab_size: int, seed: int, worked: bool = False, tool_calls: bool = False):
    """A byte-level BPE tokenizer of `vocab_size` trained on the arithmetic set (`worked`: with its worked solutions,
    and Qwen2's split); `tool_calls`: also on its tool-calling conversations, with TRL's Qwen2.5 chat template
    (models/tiny_tools.py)."""
    rows = arithmetic_problems(2000, seed, worked=worked)
    corpus = [f"{r['prompt']} {r.get('solution', '')} <answer>{r['answer']}</answer>" for r in rows]
    corpus += [SYSTEM_PROMPT, "system user assistant"]
    if not tool_calls:
        return _bpe(corpus, vocab_size, worked, CHAT_TEMPLATE)
    from . import tiny_tools

    # why twice: the conversations are rendered by a tokenizer's chat template, here the first one's
    template, added = tiny_tools.chat_template(), tiny_tools.ADDED_TOKENS
    first = _bpe(corpus, vocab_size, worked, template, added)
    return _bpe(corpus + tiny_tools.corpus(first, 2000, seed), vocab_size, worked, template, added)


def _bpe(corpus: list[str], vocab_size: int, worked: bool, chat_template: str, added: tuple = ()):
    """A BPE trained on `corpus`, then `added`'s strings as whole tokens (matched before the split, as Qwen's
    `<tool_call>`)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if worked:  # why: transformers rebuilds a qwen2 checkpoint's tokenizer with Qwen2's own split (digits one by
        # one) at load, so the trained model must learn on the same tokens as it is later given
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(text, normalized=False, special=False) for text in added])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=chat_template,
        padding_side="left",
    )


def build_tiny_model(
    path: Union[str, Path],
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 384,
    eos_probability: Optional[float] = 0.1,
    max_positions: int = 1024,
    train_steps: int = 0,
    intermediate_size: Optional[int] = None,
    num_attention_heads: Optional[int] = None,
    num_key_value_heads: int = 1,
    dtype: str = "float32",
    label: Optional[str] = None,
    experts: int = 0,
    experts_per_token: int = 0,
    expert_intermediate: int = 0,
    shared_expert_intermediate: int = 0,
    reward: bool = False,
    tool_calls: bool = False,
) -> Path:
    """Write a tiny Qwen2 checkpoint + tokenizer to `path`; the same seed gives the same files (training: on the
    same machine and thread count). A `vocab_size` beyond what the tokenizer learns from its small corpus gives a
    model vocabulary larger than the tokenizer's (as Qwen2.5's 151,936 rows for 151,665 tokens): the extra ids
    decode to nothing. `train_steps` > 0 trains it on the arithmetic set's worked solutions (models/tiny_train.py).
    `experts` > 0: a Qwen3-MoE body of that many experts per layer instead (each layer routes every token to
    `experts_per_token` of them, each of width `expert_intermediate`); with `shared_expert_intermediate` a Qwen2-MoE
    body, whose every layer also has a shared expert of that width. `reward`: a sequence classifier with one label
    (a reward model) instead of a causal LM. `tool_calls`: TRL's Qwen2.5 chat template, and the training teaches it to
    call a calculator (models/tiny_tools.py)."""
    from ..checks.installed import check_torchvision

    check_torchvision()  # why first: transformers' model classes import it
    path = Path(path)
    bar = build_progress(label or f"building {path.name}", train_steps)
    bar.set_postfix_str("training the tokenizer")
    # why 384 untrained: all the tiny corpus has merges for; a trained model's corpus adds the worked solutions
    tokenizer = _train_tokenizer(min(vocab_size, 768 if train_steps else 384), seed, bool(train_steps), tool_calls)
    bar.update()
    bar.set_postfix_str("initialising the weights")
    sizes = qwen2_sizes(max(vocab_size, len(tokenizer)), hidden_size, num_layers, intermediate_size,
                        num_attention_heads, num_key_value_heads, max_positions, experts, experts_per_token,
                        expert_intermediate, shared_expert_intermediate)  # fmt: skip
    model = _random_qwen2(tokenizer, seed, sizes, dtype, reward)
    if eos_probability is not None:
        _make_eos_reachable(model, tokenizer, eos_probability)
    bar.update()
    if train_steps:
        from .tiny_tools import train_with_tools
        from .tiny_train import train_on_arithmetic

        bar.set_postfix_str(f"training on the arithmetic set{' with a calculator' * tool_calls} ({train_steps} steps)")
        train = train_with_tools if tool_calls else train_on_arithmetic
        train(model, tokenizer, train_steps, seed, on_step=bar.update)
    bar.set_postfix_str("saving")
    _save(model, tokenizer, path)
    bar.update()
    bar.set_postfix_str("done")
    bar.close()
    return path


def _random_qwen2(tokenizer, seed: int, sizes: dict, dtype: str, reward: bool = False):
    """A Qwen2 model (Qwen3-MoE: `sizes` has experts) of `sizes` (qwen2_sizes) with random weights from `seed`,
    stopping and padding as `tokenizer` does; `reward`: a one-label sequence classifier."""
    import torch
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    sizes = dict(sizes)
    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForSequenceClassification if reward else Qwen2ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
    }[sizes.pop("model_type")]
    if reward:
        sizes["num_labels"] = 1
    config = config_class(
        **sizes,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=dtype,
    )
    torch.manual_seed(seed)
    return model_class(config).to(getattr(torch, dtype))


def _save(model, tokenizer, path: Path) -> None:
    """Write the model, with a generation config that stops and pads as the tokenizer does, and the tokenizer."""
    if getattr(model, "generation_config", None) is not None:  # (a sequence classifier generates nothing)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def _make_eos_reachable(model, tokenizer, probability: float) -> None:
    """Point the (tied) EOS row along the mean final hidden state, so EOS gets about `probability`
    per token: random weights then end completions at varied lengths, as a real model does."""
    import math

    import torch

    text = [r["prompt"] for r in arithmetic_problems(32, 1)]
    ids = tokenizer(text, return_tensors="pt", padding=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # why: a fixed reduction order, so the same seed writes the same bytes
    try:
        with torch.no_grad():
            hidden = model.model(**ids).last_hidden_state[ids["attention_mask"].bool()].double()  # [T, H]
            target = math.log(probability * model.config.vocab_size / (1 - probability))  # other logits are ~0
            # least squares: the EOS row whose logit is `target` at every observed position
            row = torch.linalg.lstsq(hidden, torch.full((hidden.shape[0], 1), target, dtype=torch.float64)).solution[
                :, 0
            ]
            model.lm_head.weight[tokenizer.eos_token_id] = row.float()
    finally:
        torch.set_num_threads(threads)


def qwen2_sizes(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    intermediate_size: Optional[int],
    num_attention_heads: Optional[int],
    num_key_value_heads: int,
    max_positions: int,
    experts: int = 0,
    experts_per_token: int = 0,
    expert_intermediate: int = 0,
    shared_expert_intermediate: int = 0,
) -> dict:
    """The config.json sizes of a tiny Qwen2 (with `experts`: Qwen3-MoE; and a shared expert: Qwen2-MoE) of these build
    arguments: the built model's, and the planner's before it is built."""
    moe = {
        "num_experts": experts,
        "num_experts_per_tok": experts_per_token,
        "moe_intermediate_size": expert_intermediate,
        **({"shared_expert_intermediate_size": shared_expert_intermediate} if shared_expert_intermediate else {}),
    }
    family = ("qwen2_moe" if shared_expert_intermediate else "qwen3_moe") if experts else "qwen2"
    return {
        "model_type": family,
        **(moe if experts else {}),
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads or hidden_size // 64,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": 64,  # why: vLLM's CPU kernels
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True,
    }


def builtin_sizes(name: str) -> Optional[dict]:
    """The config.json sizes of built-in `name` (BUILTINS) without building it (why: planning `tiny-cpu` on a new
    machine must not train a model first); None for another name. The vocabulary is the one asked for: the tokenizer
    learns at most that many tokens."""
    if name not in BUILTINS:
        return None
    import inspect

    args = {k: p.default for k, p in inspect.signature(build_tiny_model).parameters.items() if p.default is not p.empty}
    args.update(BUILTINS[name][1])
    return qwen2_sizes(*(args[k] for k in inspect.signature(qwen2_sizes).parameters))


def ensure_tiny_model(path: Union[str, Path], seed: int = 0, **shape) -> Path:
    """Build the tiny model (`shape`: build_tiny_model's arguments) at `path` unless a checkpoint is already
    there (atomically, one builder at a time)."""
    import fcntl

    from ..files import atomic_write_dir, recover_dir

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    # why: the atomic swap below replaces whatever is at `path`; never a user's file or directory
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise LabError(
            f"tiny model: {str(path)!r} is {'a file' if not path.is_dir() else 'a directory with other files'} "
            "and no checkpoint; give a new or empty directory"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / f".{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # why: a notebook kernel and a CLI run may both build it first
            recover_dir(path)  # a build or swap a crash interrupted
            if not (path / "config.json").is_file():
                label = f"building {path.name} (once; later loads read it)"
                atomic_write_dir(path, lambda tmp: build_tiny_model(tmp, seed, label=label, **shape))
    except OSError as err:
        raise LabError(
            f"tiny model: cannot write {str(path)!r} ({err.strerror}); choose a writable directory"
            + (" or set GRPO_LAB_CACHE" if path.parent == cache_dir() else "")
        ) from None
    return path


def cache_dir() -> Path:
    """Per-user cache: $GRPO_LAB_CACHE, else $XDG_CACHE_HOME/grpo_lab, else ~/.cache/grpo_lab."""
    if os.environ.get("GRPO_LAB_CACHE"):
        return Path(os.environ["GRPO_LAB_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "grpo_lab"


def builtin_path(name: str = TINY) -> Path:
    """Where the built-in model `name` lives in the user cache."""
    return cache_dir() / f"{name}-v{BUILTINS[name][0]}"
