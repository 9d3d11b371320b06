"""A reward model: a sequence classifier that scores prompt + completion as TRL 1.16's GRPOTrainer does (the nn.Module
branch of `_calculate_rewards`): a conversational batch's prompt messages and completion message through the reward
model's own tokenizer's chat template, a standard batch's prompt + completion text; right padding, no special tokens
added, the first logit at the last token that is not padding, in inference mode; its tokenizer from its config's
`_name_or_path`, padding with EOS where it has no pad token; named as TRL names it (the last part of that path).

Departs from TRL: it scores in micro-batches of grpo.micro_batch_size sequences (TRL scores the whole batch in one
forward), so its peak is bounded and planned; it is loaded onto placement.reward_model (optionally in 4-bit nf4, as the
learner is), not wherever accelerate puts it; and a checkpoint that is not a sequence classifier is refused, where
TRL's `AutoModelForSequenceClassification` would give it a randomly initialised score head.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Optional

import torch

from ..errors import LabError

FIELD = "data.reward_models"
CLASSIFIER = "ForSequenceClassification"  # the class-name suffix of every transformers sequence classifier


def is_reward_model(obj) -> bool:
    """Whether `obj` is a model TRL would score with (an nn.Module), rather than a reward function."""
    return isinstance(obj, torch.nn.Module)


class RewardModel:
    """A sequence classifier called as a reward function, with TRL's keyword signature; `micro_batch()` says how many
    sequences go through one forward (None: the whole batch), read at every call."""

    def __init__(self, model, tokenizer, micro_batch: Callable[[], Optional[int]] = lambda: None):
        check_classifier(model, getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self.model, self.tokenizer, self.micro_batch = model, tokenizer, micro_batch
        if tokenizer.pad_token_id is None:  # why: TRL's rule; the score is read at the last non-pad token
            tokenizer.pad_token = tokenizer.eos_token
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.__name__ = (getattr(model.config, "_name_or_path", "") or type(model).__name__).rstrip("/").split("/")[-1]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: str) -> "RewardModel":
        """The model on `device` (a 4-bit model stays where it was loaded: bitsandbytes' weights do not move)."""
        if not getattr(self.model, "is_loaded_in_4bit", False):
            self.model.to(device)
        return self

    def texts(self, prompts: list, completions: list) -> list[str]:
        """What the reward model reads: a conversational prompt (a list of messages) with its completion message
        through the chat template; a standard one as prompt + completion text."""
        if prompts and isinstance(prompts[0], list):
            return [
                self.tokenizer.apply_chat_template(p + as_messages(c), tokenize=False)
                for p, c in zip(prompts, completions, strict=True)
            ]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        texts = self.texts(prompts, completions)
        size = self.micro_batch() or len(texts) or 1
        scores: list[float] = []
        for start in range(0, len(texts), size):  # why micro-batches: the forward's activations are its peak
            inputs = self.tokenizer(
                text=texts[start : start + size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(self.device)
            with torch.inference_mode():  # why: no autograd graph; only one layer's activations live at a time
                scores += self.model(**inputs).logits[:, 0].float().tolist()
            del inputs  # why: the micro-batch's ids and mask go before the next one's
        return scores

    def release(self) -> None:
        """Drop the model (the caller frees the memory: nothing else holds it)."""
        self.model = None


class GivenScores:
    """A reward model's scores computed elsewhere (a sharded learner's driver scores; each rank is handed them), called
    as the reward model would be, under its name."""

    def __init__(self, name: str, scores: list[float]):
        self.__name__, self.scores = name, scores

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        return self.scores


def check_reward_model(name: str) -> str:
    """One of data.reward_models before any weight is read: a checkpoint directory (a built-in one built), or a hub id;
    a checkpoint whose config.json names no sequence classifier is refused. Returns what to load."""
    from .source import check_model_path

    path = check_model_path(name, FIELD)
    check_architectures(path, name)
    return path


def as_messages(completion) -> list[dict]:
    """A completion as TRL passes a conversational one: its messages; plain text as one assistant message."""
    return completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]


def check_classifier(model, name: str) -> None:
    """A model that is not a sequence classifier has no score head to read: refused in one line."""
    kind = type(getattr(model, "_orig_mod", model)).__name__  # (torch.compile wraps the model, as TRL allows)
    if not kind.endswith(CLASSIFIER):
        raise LabError(
            f"{FIELD}: {name!r} is a {kind}, not a sequence classifier; give a reward model saved as "
            f"*{CLASSIFIER} with num_labels=1 (e.g. trained with TRL's RewardTrainer)"
        )


def check_architectures(path: str, name: str, kinds: Optional[list] = None) -> None:
    """The same refusal before any weight is read, from the classes a checkpoint's config.json names (`kinds`, else
    read from a local checkpoint; a hub id's are checked at load, from its config)."""
    from pathlib import Path

    from .shapes import read_model_config

    config = Path(path) / "config.json"
    if kinds is None and not config.is_file():
        return
    kinds = (kinds if kinds is not None else read_model_config(config, FIELD).get("architectures")) or ["no class"]
    if not any(k.endswith(CLASSIFIER) for k in kinds):
        raise LabError(
            f"{FIELD}: {name!r} is a {kinds[0]}, not a sequence classifier; give a reward model saved as "
            f"*{CLASSIFIER} with num_labels=1 (e.g. trained with TRL's RewardTrainer)"
        )


def load_reward_model(name: str, config, device: str) -> RewardModel:
    """`name` (a path, `builtin:NAME` or a hub id) on `device`, in model.dtype or, with placement.reward_model_4bit, in
    4-bit with the learner's bitsandbytes settings; scored in micro-batches of grpo.micro_batch_size."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from .learner import _DTYPES, quantization_config
    from .resident import hold_in_memory

    path = check_reward_model(name)
    kwargs = dict(dtype=_DTYPES[config.model.dtype], device_map={"": device}, num_labels=1)
    if config.placement.reward_model_4bit:
        kwargs["quantization_config"] = quantization_config(
            SimpleNamespace(**{**dict(config.model), "load_in_4bit": 1})
        )
    try:
        check_architectures(path, name, AutoConfig.from_pretrained(path).architectures or [])  # why: before weights
        model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise LabError(
            f"{FIELD}: cannot load {name!r} ({(str(err).strip().splitlines() or [type(err).__name__])[0][:300]}); "
            "give a local checkpoint directory of a sequence classifier"
        ) from None
    model.requires_grad_(False)
    model.eval()
    hold_in_memory(model)  # why: as the learner's, resident from load as the plan counts it
    return RewardModel(model, tokenizer, lambda: config.grpo.micro_batch_size)


def wrap_module(model, config) -> RewardModel:
    """An nn.Module passed in reward_funcs, as TRL takes it: its tokenizer from its config's `_name_or_path`."""
    from transformers import AutoTokenizer

    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    check_classifier(model, name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise LabError(
            f"reward_funcs: cannot load the tokenizer of reward model {name!r} from its config's _name_or_path "
            f"({str(err).strip().splitlines()[0][:200]}); load the model from a checkpoint directory with its tokenizer"
        ) from None
    model.requires_grad_(False)
    model.eval()
    return RewardModel(model, tokenizer, lambda: config.grpo.micro_batch_size)
