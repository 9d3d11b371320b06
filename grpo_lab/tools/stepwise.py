"""A turn-by-turn rollout's tool side (grpo_lab/turns_api.py drives it; tools/loop.py's ToolLoop keeps its episode
paused between calls): what each row called and each tool answered so far (`TurnsView`), and the live edits the
paused rollout's next turns cannot honour (`check_paused`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..algo.lifecycle import PENDING_HOW as HOW
from ..errors import LabError

PAUSED = f"rollout: this step's rollout has turns pending (lab.rollout(turns=...)); {HOW}, before another rollout"

# what the paused rows were sampled under: the turns already run cannot take a new value back, so the rest of the
# rollout keeps these (the turn cap and generator.chunk_size, the rows in flight, stay live)
FIXED = (
    "generator.max_completion_length",
    "generator.max_prompt_length",
    "generator.temperature",
    "generator.top_p",
    "generator.top_k",
    "grpo.num_generations",
    "grpo.prompts_per_step",
    *(f"data.{name}" for name in ("dataset", "dataset_config", "split", "streaming", "num_prompts", "system_prompt")),
)


def value(config, path: str):
    section, name = path.split(".")
    return getattr(getattr(config, section), name)


def check_paused(rounds: int, old, new) -> None:
    """Refuse, in one line, an edit (`old` config to `new`) that a rollout paused after `rounds` rounds of tool calls
    cannot honour: a field its rows were sampled under (or drawn from), a turn cap below the rounds run."""
    for path in FIXED:
        if value(old, path) != value(new, path):
            raise LabError(
                f"{path}: this step's rollout has turns pending, sampled with {value(old, path)!r}; {HOW}, then edit it"
            )
    cap = new.generator.max_tool_calling_iterations
    if cap < rounds:
        raise LabError(
            f"generator.max_tool_calling_iterations: {cap} is below the {rounds} round(s) of tool calls this step's "
            f"pending rollout has run; set it to at least {rounds} (its rows then stop at turn {rounds + 1}), or drop "
            "the pending turns with lab.rollback()"
        )


@dataclass
class TurnsView:
    """What a pending rollout's rows did so far (lab.rollout(turns=...) returns it; the rollout stays pending)."""

    step: int
    turns: int  # the turns run so far (the most any row has run)
    rows: list[dict]  # per row, in batch order: row, turns, going, calls [{turn, name, arguments}], answers [{turn,
    # name, content}], text (the last assistant message's)
    prefill_tokens: int  # what the next turn prefills again: no KV cache is held between calls

    @property
    def going(self) -> int:
        """The rows whose next turn is still to run."""
        return sum(r["going"] for r in self.rows)

    def __repr__(self) -> str:
        head = (
            f"step {self.step} rollout: {self.turns} turn(s) run, {self.going} of {len(self.rows)} rows going "
            "(lab.rollout(turns=1): one more turn; lab.rollout(): the rest, and the phase ends)"
        )
        lines = [head]
        for r in self.rows:
            said = [
                f"turn {c['turn']} {c['name']}({c['arguments']}) -> {a['content']!r}"
                for c, a in zip(r["calls"], r["answers"] + [{"content": "(not run)"}] * len(r["calls"]))
            ]
            lines.append(f"  row {r['row']}: {'; '.join(said) or 'no call'}{'' if r['going'] else ' (done)'}")
        lines.append(f"  KV cache held between turns: none; the next turn prefills {self.prefill_tokens} tokens again")
        return "\n".join(lines)


def view(episode, step: int) -> TurnsView:
    """The TurnsView of a paused tools.loop.Episode."""
    rows = []
    for r in sorted(episode.rows):
        t, turn, calls, answers = episode.rows[r], 0, [], []
        for m in t.messages:
            if m.get("role") == "assistant":
                turn += 1
                for call in m.get("tool_calls") or []:
                    f = call.get("function", call)
                    calls.append({"turn": turn, "name": f["name"], "arguments": f.get("arguments")})
            elif m.get("role") == "tool":
                answers.append({"turn": turn, "name": m.get("name"), "content": m["content"]})
        text = next((m.get("content") for m in reversed(t.messages) if m.get("role") == "assistant"), "")
        rows.append(dict(row=r, turns=t.turns, going=r in episode.going, calls=calls, answers=answers, text=text))
    prefill = sum(len(episode.rows[r].prompt) + len(episode.rows[r].ids) for r in episode.going)
    return TurnsView(step, max((t.turns for t in episode.rows.values()), default=0), rows, prefill)
