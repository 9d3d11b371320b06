"""`grpo-lab` command line: thin wrappers over the library. User errors print one line and exit 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import LabError


def _run(args) -> int:
    from .config.loading import load_config
    from .recovery.rundir import CONFIG
    from .runner import run

    if args.resume is not None and args.out is not None:
        raise LabError(f"--out: a resumed run stays in its own directory ({args.resume}); drop --out")
    if args.config is None and args.resume is None:
        raise LabError("grpo-lab run: give a config (a preset name or a YAML file, e.g. tiny-cpu) or --resume DIR")
    config = None
    if args.config is not None:
        config = load_config(args.config, args.set)
    elif args.set and (Path(args.resume) / CONFIG).is_file():  # --set alone: changes to the run's own config
        config = load_config(Path(args.resume) / CONFIG, args.set)
    if not args.verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one line per step: no per-shard loading bars
    run_dir = run(
        config,
        steps=args.steps,
        out=args.out,
        progress=not args.quiet,
        force=args.force,
        verbose=args.verbose,
        resume=args.resume,
    )
    print(f"run directory: {run_dir}")
    print(f"report: open {run_dir / 'report.html'} in a browser (memory timeline, per-phase peaks, rewards)")
    return 0


def _presets(args) -> int:
    from .config.presets import listing

    print(listing())
    return 0


def _plan(args) -> int:
    from .planner import plan

    ranges = {
        "--lengths": args.lengths,
        "--generations": args.generations,
        "--micro-batches": args.micro_batches,
        "--out": args.out,
        "--measured": args.measured,
        "--turns": args.turns,
    }
    given = [flag for flag, value in ranges.items() if value is not None]
    if given and not args.frontier:
        raise LabError(f"{given[0]}: only with --frontier; add --frontier, or drop {given[0]}")
    config, note = _plan_config(args)
    if not args.frontier:
        print(plan(config, prompt_tokens=data_prompt_tokens(config)))
        if note:
            print(note)
        return 0
    from .planner.frontier import frontier
    from .planner.grid import parse_range

    axes = [None if value is None else parse_range(value, flag) for flag, value in list(ranges.items())[:3]]
    if args.turns is not None:
        return _plan_turns(args, config, axes)
    front = frontier(config, *axes)
    if args.measured:
        from .planner.measured import mark, read_records

        front = mark(front, read_records(args.measured))
    path = front.to_html(args.out or "frontier.html", "--out")  # why last: an error above leaves no page behind
    print(front)
    print(f"frontier page: open {path} in a browser (hover a cell for its binding device, peak, phase and headroom)")
    return 0


def _plan_turns(args, config, axes) -> int:
    """`grpo-lab plan --frontier --turns`: one frontier per number of turns, each printed, all on one page."""
    from .planner.grid import parse_range
    from .planner.turn_axis import frontiers_by_turns, write_pages

    if args.measured:
        raise LabError("--measured: not with --turns (bench/gpu/frontier.py's points have one turn); drop one")
    fronts = frontiers_by_turns(config, *axes, turns=parse_range(args.turns, "--turns"))
    path = write_pages(fronts, args.out or "frontier.html")  # why last: an error above leaves no page behind
    print("\n\n".join(map(str, fronts)))
    print(f"frontier page: open {path} in a browser (one frontier per number of turns)")
    return 0


def data_prompt_tokens(config):
    """The data's longest prompt in tokens, as a loaded Lab plans it, where the data and the model's tokenizer are on
    disk (a built-in model already built, or a checkpoint folder); None otherwise (the plan takes max_prompt_length)."""
    from pathlib import Path

    from .data.prompts import prompt_source
    from .models.source import BUILTIN

    name = config.model.name_or_path
    if name.startswith(BUILTIN):
        from .models.tiny import BUILTINS, builtin_path

        if name.removeprefix(BUILTIN) not in BUILTINS or not builtin_path(name.removeprefix(BUILTIN)).exists():
            return None  # why: planning never builds a model; a built-in not yet built is planned from its shape
        name = str(builtin_path(name.removeprefix(BUILTIN)))
    if not (Path(name) / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    from .tools import named_schemas
    from .tools.template import use_chat_template

    tokenizer = AutoTokenizer.from_pretrained(name)
    use_chat_template(tokenizer, config.model.chat_template)
    tools = named_schemas(config)  # why: the tools' schemas lengthen every prompt, as a loaded Lab's plan counts them
    return prompt_source(config, tokenizer, say=None, tools=tools).lengths().longest


def _plan_config(args):
    """The config to plan, and a note: a vLLM generator sharing the learner's GPU with no share set is planned with
    `auto`, so the plan recommends the share it would pick (a run still needs it set)."""
    from .checks.roles import NEEDS_SHARE
    from .config.loading import load_config
    from .errors import ConfigError

    try:
        return load_config(args.config, args.set), None
    except ConfigError as err:
        if NEEDS_SHARE not in str(err):
            raise
    config = load_config(args.config, [*args.set, "generator.gpu_memory_utilization=auto"])
    return config, (
        "recommended: generator.gpu_memory_utilization is unset and the generator shares the learner's GPU; "
        "the plan above uses auto: set it to auto, or to the share the GPU split shows"
    )


def _probe(args) -> int:
    from .config.loading import load_config
    from .lab import Lab

    lab = Lab(load_config(args.config, args.set)).load()
    try:
        print(lab.plan())
        report = lab.probe()
        print(report)
    finally:
        lab.close()
    return 0 if report.fits else 1


def _sweep(args) -> int:
    from .sweep import parse_grid, sweep

    out = sweep(args.notebook, parse_grid(args.grid), args.out)
    print(f"sweep directory: {out} (summary.csv, summary.html)")
    return 0


def _compare(args) -> int:
    from .comparison import compare

    out = compare(args.runs, args.out)
    print(f"compare page: open {out} in a browser (per-phase peaks per device, reward and loss, what differs)")
    return 0


def _tiny(args) -> int:
    from .checks.paths import check_output_dir
    from .models.tiny import BUILTINS, build_tiny_model, builtin_path, ensure_tiny_model

    where = args.path or builtin_path(args.model)
    check_output_dir(where, "grpo-lab tiny PATH" if args.path else "grpo-lab tiny (the user cache; set GRPO_LAB_CACHE)")
    shape = BUILTINS[args.model][1]
    path = (
        build_tiny_model(where, seed=args.seed, **shape)
        if args.force
        else ensure_tiny_model(where, seed=args.seed, **shape)
    )
    print(f"tiny model: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `grpo-lab` parser: one subcommand per adder below, in the order `grpo-lab --help` lists them."""
    parser = argparse.ArgumentParser(prog="grpo-lab", description="Stepwise GRPO on 4-bit LoRA models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_plan, _add_probe, _add_presets, _add_sweep, _add_compare, _add_tiny):
        add(sub)
    return parser


def _add_set(p: argparse.ArgumentParser, text: str = "override a config value") -> None:
    """--set KEY=VALUE (repeatable), the config overrides every config-taking subcommand has."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=text)


def _add_run(sub) -> None:
    """`grpo-lab run`: headless steps from a config, or --resume DIR."""
    p = sub.add_parser("run", help="run GRPO steps headless from a YAML config")
    p.add_argument(
        "config",
        nargs="?",
        help="a preset name (grpo-lab presets) or a YAML file, e.g. tiny-cpu "
        "(with --resume: optional; what it changes must be editable in a loaded Lab)",
    )
    p.add_argument(
        "--steps", type=int, help="the run's number of steps (default: run.steps; with --resume: the new total)"
    )
    p.add_argument(
        "--resume", metavar="DIR", help="continue the run in DIR (killed, failed or finished) from its last checkpoint"
    )
    p.add_argument("--out", help="run directory (default: run.output_dir or runs/<date-time>)")
    _add_set(p, "override a config value, e.g. --set grpo.beta=0.04 (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print the per-phase memory table after every step (default: once, at the end)",
    )
    p.add_argument("--force", action="store_true", help="run even when the memory plan says it does not fit")
    p.set_defaults(func=_run)


def _add_plan(sub) -> None:
    """`grpo-lab plan`: the memory plan, or with --frontier the plan over a grid of lengths and batch shapes."""
    p = sub.add_parser("plan", help="print the per-device memory plan of a config, before loading anything")
    p.add_argument("config", help="a preset name or a YAML file")
    _add_set(p)
    p.add_argument(
        "--frontier",
        action="store_true",
        help="plan every combination of completion length x "
        "num_generations x micro-batch: a table here and an HTML heatmap (--out)",
    )
    for flag, what in (
        ("--lengths", "generator.max_completion_length (default: 64:1024)"),
        ("--generations", "grpo.num_generations (default: 2,4,8,16)"),
        ("--micro-batches", "grpo.micro_batch_size (default: the config's)"),
        ("--turns", "a tool loop's turns, generator.max_tool_calling_iterations + 1 (one frontier each; tools only)"),
    ):
        p.add_argument(
            flag,
            metavar="RANGE",
            help=f"with --frontier: {what}; a comma list (64,128,256) or LO:HI "
            "(powers of two from LO to HI); the config's own value is always added",
        )
    p.add_argument("--out", metavar="FILE", help="with --frontier: the HTML page to write (default: frontier.html)")
    p.add_argument(
        "--measured",
        metavar="FILE",
        help="with --frontier: a frontier.jsonl of bench/gpu/frontier.py; its points of this model and side are "
        "marked (+ ran, ! failed) beside the plan, with the measured and planned edges",
    )
    p.set_defaults(func=_plan)


def _add_probe(sub) -> None:
    """`grpo-lab probe`: one worst-case step on the real devices."""
    p = sub.add_parser(
        "probe",
        help="load a config and run one worst-case step (longest prompt, full-length completions, "
        "full micro-batches) on the real devices; per-phase peaks beside the plan; exit 1 if it does not fit",
    )
    p.add_argument("config", help="a preset name or a YAML file")
    _add_set(p)
    p.set_defaults(func=_probe)


def _add_presets(sub) -> None:
    """`grpo-lab presets`: the shipped configs."""
    p = sub.add_parser("presets", help="list the preset configs shipped with grpo_lab")
    p.set_defaults(func=_presets)


def _add_sweep(sub) -> None:
    """`grpo-lab sweep`: a notebook under papermill per grid point."""
    p = sub.add_parser("sweep", help="run a notebook under papermill for every point of a parameter grid")
    p.add_argument("notebook", help="notebook with a 'parameters' cell, e.g. notebooks/01_quickstart.ipynb")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="a swept parameter (repeatable)")
    p.add_argument("--out", required=True, help="sweep directory")
    p.set_defaults(func=_sweep)


def _add_compare(sub) -> None:
    """`grpo-lab compare`: one page over several run directories."""
    p = sub.add_parser(
        "compare",
        help="one HTML page overlaying runs' per-phase memory peaks and reward/loss curves, "
        "labelled by what differs in their configs",
    )
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories `grpo-lab run` wrote (two or more)")
    p.add_argument("--out", default="compare.html", help="the HTML file to write (default: %(default)s)")
    p.set_defaults(func=_compare)


def _add_tiny(sub) -> None:
    """`grpo-lab tiny`: build a built-in tiny checkpoint."""
    from .models.tiny import BUILTINS, TINY

    p = sub.add_parser(
        "tiny",
        help="build a built-in tiny Qwen2 checkpoint (tiny-qwen2: trained ~1 min on the "
        "arithmetic set; tiny-random: random weights; qwen2-152k, qwen2-32k: large vocabularies on the "
        "random body)",
    )
    p.add_argument("path", nargs="?", help="output directory (default: the built-in model's place in the user cache)")
    p.add_argument("--model", choices=sorted(BUILTINS), default=TINY, help="which built-in model (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if a checkpoint is there")
    p.set_defaults(func=_tiny)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "steps", None) is not None and args.steps < 1:
        print(f"grpo-lab: error: --steps: got {args.steps}; give a positive number of steps", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except LabError as err:
        print(f"grpo-lab: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("grpo-lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
