"""Model shapes for planning, from a checkpoint's config.json (local directory) or, offline, from
the config.json copies bundled in models/configs/ for models users plan before downloading."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import LabError
from .bundled import BUNDLED, bundled_name


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    # mixture of experts (models/experts.py; 0: dense): routed experts per layer, how many a token goes to, one
    # expert's intermediate width, a shared expert's width (every token), the family
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    family: str = ""

    @classmethod
    def from_config(cls, hf_config: dict, field: str = "model.name_or_path") -> "ModelShape":
        """`field` is the config field the checkpoint came from, named in every error."""
        from .experts import check_family, expert_sizes, is_moe

        hf_config = hf_config.get("text_config", hf_config)
        if not isinstance(hf_config, dict):
            raise LabError(f"{field}: its config.json's text_config is not an object; repair the checkpoint")
        check_family(hf_config, field)  # why first: an architecture it cannot read is refused, never planned as another
        moe = expert_sizes(hf_config, field) if is_moe(hf_config) else {}
        sizes = ("num_attention_heads", "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
        bad = [k for k in sizes if k in hf_config and (type(hf_config[k]) is not int or hf_config[k] <= 0)]
        if bad:
            raise LabError(
                f"{field}: its config.json has {bad[0]} = {hf_config[bad[0]]!r}, not a positive "
                "integer; repair the checkpoint or point at another one"
            )
        try:
            heads = hf_config["num_attention_heads"]
            return cls(
                hidden=hf_config["hidden_size"],
                intermediate=hf_config.get("intermediate_size", 0) if moe else hf_config["intermediate_size"],
                layers=hf_config["num_hidden_layers"],
                heads=heads,
                kv_heads=hf_config.get("num_key_value_heads") or heads,
                head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // heads,
                vocab=hf_config["vocab_size"],
                tied=bool(hf_config.get("tie_word_embeddings", False)),
                **moe,
            )
        except KeyError as err:
            raise LabError(
                f"{field}: its config.json has no {err.args[0]!r}; the planner knows decoder-only "
                "transformers (Llama/Qwen/Mistral-style)"
            ) from None

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def linear_layers(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of each nn.Linear of one decoder layer (the ones bitsandbytes' 4-bit loading and LoRA's
        all-linear touch): attention, and the MLP (a mixture of experts: its shared expert's, if any; the routed
        experts are 3-D parameters, `expert_params`)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        i = self.shared_intermediate if self.moe else self.intermediate
        mlp = [("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h)] if i else []
        return [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h), *mlp]

    def expert_tensors(self) -> list[tuple[str, int]]:
        """(name, elements) of one layer's fused expert parameters: gate_up_proj [E, 2m, h], down_proj [E, h, m]."""
        if not self.moe:
            return []
        e, m, h = self.experts, self.expert_intermediate, self.hidden
        return [("gate_up_proj", e * 2 * m * h), ("down_proj", e * h * m)]

    @property
    def expert_params(self) -> int:
        """Every layer's routed experts (quantized to nf4 by the lab, models/experts.py)."""
        return self.layers * sum(n for _, n in self.expert_tensors())

    @property
    def router_params(self) -> int:
        """Every layer's router (a [experts, hidden] weight, kept in the model dtype), and a shared expert's gate."""
        return self.layers * (self.experts * self.hidden + (self.hidden if self.shared_intermediate else 0))

    @property
    def linear_params(self) -> int:
        """Every weight the lab holds in 4-bit: the linear layers and the routed experts."""
        return self.layers * sum(a * b for _, a, b in self.linear_layers()) + self.expert_params

    @property
    def quantized_tensors(self) -> int:
        """The 4-bit tensors bitsandbytes makes: every linear layer's weight, each fused experts tensor, and a shared
        expert's gate (an nn.Linear of one output, planned with the routers' bytes)."""
        per_layer = len(self.linear_layers()) + len(self.expert_tensors()) + (1 if self.shared_intermediate else 0)
        return self.layers * per_layer

    @property
    def largest_weight(self) -> int:
        """Elements of the largest weight one read or dequantization makes whole (a fused experts tensor is one)."""
        return max([a * b for _, a, b in self.linear_layers()] + [n for _, n in self.expert_tensors()])

    @property
    def active_params(self) -> int:
        """The parameters one token computes with: all but the experts it is not routed to."""
        per_expert = 3 * self.hidden * self.expert_intermediate
        return self.total_params - self.layers * (self.experts - self.experts_per_token) * per_expert

    @property
    def embedding_params(self) -> int:
        """Input embedding plus an untied LM head (kept at the model dtype, never quantized)."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def total_params(self) -> int:
        norms = (2 * self.layers + 1) * self.hidden
        return self.linear_params + self.embedding_params + norms + self.router_params

    def lora_params(self, r: int, targets, expert_r: int = 0) -> int:
        """LoRA's parameters: rank `r` on `targets`' linear layers, and rank `expert_r` per routed expert (0: none)."""
        chosen = (
            self.linear_layers()
            if targets == "all-linear"
            else [layer for layer in self.linear_layers() if layer[0] in targets]
        )
        return self.layers * sum(r * (a + b) for _, a, b in chosen) + self.expert_lora_params(expert_r)

    def expert_lora_params(self, r: int) -> int:
        """PEFT's adapters on the fused experts (lora.target_experts), rank `r` per expert: per tensor A [r x E, in]
        and B [out, r x E]; gate_up_proj reads h and writes 2m, down_proj reads m and writes h."""
        return self.layers * r * self.experts * (2 * self.hidden + 3 * self.expert_intermediate)


def read_model_config(path: Path, field: str) -> dict:
    """A checkpoint's config.json as a dict; unreadable, not JSON or not an object is one LabError naming `field`."""
    from ..checks.paths import read_text

    try:
        data = json.loads(read_text(path, field))
    except json.JSONDecodeError as err:
        raise LabError(
            f"{field}: {str(path)!r} is not valid JSON ({err.msg}, line {err.lineno}); "
            "repair the checkpoint or point at another one"
        ) from None
    if not isinstance(data, dict):
        raise LabError(
            f"{field}: {str(path)!r} holds a JSON {type(data).__name__}, not a model config object; "
            "repair the checkpoint or point at another one"
        )
    return data


def load_shape(name_or_path: str, field: str = "model.name_or_path") -> ModelShape:
    """Shape from `name_or_path/config.json`, else from the bundled copy of a known hub id; errors name `field`."""
    from .random_shapes import parse_random
    from .source import BUILTIN, resolve_model_path
    from .tiny import builtin_sizes

    random = parse_random(name_or_path)
    if random is not None:  # why here: a real shape is planned from its config.json, nothing built
        return ModelShape.from_config(random.hf_config(), field)
    sizes = builtin_sizes(name_or_path.removeprefix(BUILTIN)) if name_or_path.startswith(BUILTIN) else None
    if sizes is not None:  # a built-in tiny model: planned from its build arguments, nothing built or trained
        return ModelShape.from_config(sizes, field)
    name_or_path = resolve_model_path(name_or_path)
    local = Path(name_or_path) / "config.json"
    bundled = BUNDLED / f"{bundled_name(name_or_path)}.json"
    for path in (local, bundled):
        if path.is_file():
            return ModelShape.from_config(read_model_config(path, field), field)
    known = sorted(p.stem.replace("--", "/") for p in BUNDLED.glob("*.json"))
    raise LabError(
        f"{field}: no config.json at {name_or_path!r} and no bundled shape for it; "
        f"plan offline with one of {known} or point it at a checkpoint directory"
    )
