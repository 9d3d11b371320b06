"""Brief supervised training of the built-in tiny model on worked solutions of the arithmetic set
("15 * 8 = 120. <answer>120</answer>"), so that its completions read as answers and the demo's correctness
reward can rise.

What GRPO then has to learn in the demo's 25 steps: 85% of the training answers carry their unit
("<answer>120 eggs</answer>"), against the system prompt's "put only the final number". `exact_answer` scores
those 0 and `format` 0.5, so a sampled completion is right about 6% of the time at first, while its arithmetic
is right about 40% of the time. Dropping the unit is one decision shared by every
prompt, which a few LoRA updates can learn; the sums themselves barely improve in 25 steps.

Also the progress bar a built-in model's build shows (build_progress).
"""

from __future__ import annotations

from ..data.arithmetic import SYSTEM_PROMPT, arithmetic_problems
from ..data.formats import format_prompt

STEPS = 700  # ~55 s on 2 CPU cores for the 3-layer built-in; 600 steps left fewer sums right (~0.3 sampled)
BATCH = 32
LEARNING_RATE = 3e-3
WARMUP = 30
WITH_UNIT = 0.85  # the share of answers written with their unit ("<answer>120 eggs</answer>"): see above
DATA_SEED = 1000  # why apart from the run seeds: the training rows are not the demo's prompt order


def worked_examples(tokenizer, n: int, seed: int):
    """(input_ids, attention_mask, labels) for `n` chat-formatted problems, right-padded; the loss is on the
    worked solution and the end-of-turn token only."""
    import random

    import torch

    rows = arithmetic_problems(n, seed, worked=True)
    units = random.Random(seed)
    targets = [
        f"{r['solution']} <answer>{r['answer']} {r['unit']}</answer>"
        if units.random() < WITH_UNIT
        else f"{r['solution']} <answer>{r['answer']}</answer>"
        for r in rows
    ]
    texts = [format_prompt(tokenizer, r["prompt"], SYSTEM_PROMPT) for r in rows]
    prompts = tokenizer(texts, add_special_tokens=False)["input_ids"]
    answers = tokenizer([t + tokenizer.eos_token for t in targets], add_special_tokens=False)["input_ids"]
    width = max(len(p) + len(a) for p, a in zip(prompts, answers))
    ids = torch.full((n, width), tokenizer.pad_token_id)
    mask = torch.zeros((n, width), dtype=torch.long)
    labels = torch.full((n, width), -100)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, : len(p) + len(a)] = 1
        labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
    return ids, mask, labels


def train_on_arithmetic(model, tokenizer, steps: int = STEPS, seed: int = 0, on_step=None) -> float:
    """AdamW with warm-up and cosine decay over `steps` batches of BATCH; returns the last batch's loss. `on_step()`
    is called after each step (the build's progress bar)."""
    examples = worked_examples(tokenizer, steps * BATCH, DATA_SEED + seed)
    return supervised(model, examples, steps, BATCH, LEARNING_RATE, WARMUP, on_step)


def supervised(model, examples, steps: int, batch_size: int, learning_rate: float, warmup: int, on_step=None) -> float:
    """`steps` batches of `batch_size` of `examples` ((input_ids, attention_mask, labels), right-padded) with AdamW,
    warm-up and cosine decay; returns the last batch's loss."""
    import math

    import torch

    ids, mask, labels = examples
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        batch = slice(step * batch_size, (step + 1) * batch_size)
        width = int(mask[batch].sum(1).max())  # why: the batch's own width, not the longest row of all
        hidden = model.model(input_ids=ids[batch, :width], attention_mask=mask[batch, :width]).last_hidden_state
        # why only the answer's positions through the head: the prompt's logits would be computed and thrown away
        scored = labels[batch, 1:width] != -100
        logits = model.lm_head(hidden[:, :-1][scored])
        loss = torch.nn.functional.cross_entropy(logits, labels[batch, 1:width][scored])
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step()
    model.eval()
    return float(loss.detach())


def build_progress(label: str, train_steps: int):
    """A progress bar over the build's stages (tokenizer, weights, each training step, saving), with tqdm's estimate
    of the time left: a widget in a notebook, a line on stderr in a terminal or a log; in a headless run (papermill,
    nbconvert) one printed line, as the saved notebook would keep the widget as a frozen "0%"."""
    from tqdm.auto import tqdm

    from ..runtime import frontend_is_live

    live = frontend_is_live()
    if not live:
        print(f"{label}{f', {train_steps} training steps' if train_steps else ''}", flush=True)
    bar = tqdm(
        total=3 + train_steps, desc=label, unit="stage" if not train_steps else "step", leave=True, disable=not live
    )
    container = getattr(bar, "container", None)  # tqdm.notebook's widget: [label, bar, figures]
    if container is not None:  # why: the label wrapped at its name's hyphen ("building tiny-qwen2- / v2")
        container.children[0].layout.min_width = "max-content"
    return bar
