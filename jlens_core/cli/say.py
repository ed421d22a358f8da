"""``jlens say``: search the edit along a lens's read directions that makes the model say a chosen word, verified
by replaying the model, with the random-direction and logit-lens controls beside it (docs/method.md §7.1); with
``--set``, say success over a set of items (the fraction with a verified recipe per lens and control)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .main import CLIError, say
from .model_args import add_edit_layers_argument, add_model_command, model_loading_options

if TYPE_CHECKING:  # the CLI imports torch only when a command runs
    from ..interventions.say import SayResult


def _strengths(value: str | None, what: str) -> list[float] | None:
    if not value:
        return None
    try:
        return [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"--{what} {value!r} must be comma-separated numbers, e.g. 0.5,1,2.") from None


def _grids(args: argparse.Namespace) -> dict[str, list[float]]:
    grids = {op: _strengths(getattr(args, f"{op}_grid"), f"{op}-grid") for op in ("steer", "swap", "ablate")}
    return {op: grid for op, grid in grids.items() if grid is not None}


def _layers(args: argparse.Namespace, n_layers: int) -> list[int] | None:
    if not args.layers:
        return None
    from ..layerspec import parse_layer_spec

    return parse_layer_spec(args.layers, n_layers)


def _print_result(result: SayResult) -> None:
    """Every verified recipe, each row labelled by its arm, then each arm's minimal recipe under its own name."""
    target = result.target_text
    print(f"prompt: {result.prompt!r} ({result.n_prompt} tokens); target {target!r} "
          f"({len(result.target_ids)} token{'s' if len(result.target_ids) > 1 else ''})")
    print(f"clean: the model says {result.clean_next!r}; P(target) {result.clean_prob:.3g}")
    width = max((len(name) for name in result.arms), default=0) + 2
    for name, arm in result.arms.items():
        what = "the lens" if arm is result.search else "control"
        print(f"\n{arm.directions} ({what}): ranked {arm.n_ranked}, replayed {arm.n_replayed}, "
              f"{len(arm.recipes)} verified, {arm.seconds:.1f} s")
        for recipe in arm.recipes:
            mark = "*" if recipe is arm.minimal else " "
            print(f"  {mark} {'[' + name + ']':<{width}} {recipe.describe(target):<68} P={recipe.target_prob:.3f}; "
                  f"{recipe.side_effects()}")
    print("\nminimal recipe per arm (the smallest band, then readout before from, then the smallest relative "
          "strength):")
    for name, arm in result.arms.items():
        found = f"{arm.minimal.describe(target)}; {arm.minimal.side_effects()}" if arm.minimal else "none found"
        print(f"  {name + ':':<{width}} {found}")
    if result.clean_continuation is not None:
        print(f"\nclean : {result.clean_continuation!r}")
        print(f"edited: {result.edited_continuation!r} (the {result.search.name} minimal recipe)")
    stages = ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items())
    print(f"\n{result.message}\ntime: {stages}; {result.n_ranked} candidates ranked, {result.n_replayed} replayed")


def _run_one(args: argparse.Namespace, model: Any, lens: Any) -> int:
    from ..interventions.say import DEFAULT_MAX_REPLAYS, make_it_say
    from .common import progress_bar

    bar = progress_bar(1, "say", args.no_progress or args.format == "json", unit="pass")

    def progress(p) -> None:
        if bar is not None:
            bar.total, bar.n = p.total, p.done
            bar.set_postfix_str(p.message[:60])
            bar.refresh()

    try:
        result = make_it_say(model, lens, args.prompt, args.target, layers=_layers(args, model.n_layers),
                             ops=args.ops.split(","), positions=args.positions.split(","),
                             from_position=args.from_position, grids=_grids(args),
                             max_replays=args.max_replays or DEFAULT_MAX_REPLAYS, controls=[] if args.no_controls else ["random", "logit"],
                             continuation_tokens=args.max_new_tokens, seed=args.seed, progress=progress,
                             downstream_tokens=args.downstream_tokens)
    finally:
        if bar is not None:
            bar.close()
    if args.format == "json":
        print(json.dumps(result.to_dict(), indent=1, default=str))
    else:
        _print_result(result)
    return 0


def _run_set(args: argparse.Namespace, model: Any, lenses: dict) -> int:
    from ..interventions.say_success import DEFAULT_MAX_REPLAYS, load_say_set, say_success

    items = load_say_set(args.set)
    if args.n_items:
        items = items[: args.n_items]
    from .common import advance, progress_bar

    bar = progress_bar(1, f"say {Path(args.set).stem}", args.no_progress or args.format == "json", unit="item")

    def progress(done: int, total: int) -> None:
        if bar is not None:
            advance(bar, done, total)

    try:
        report = say_success(model, lenses, items, layers=_layers(args, model.n_layers), ops=args.ops.split(","),
                             positions=args.positions.split(","), from_position=args.from_position,
                             grids=_grids(args), max_replays=args.max_replays or DEFAULT_MAX_REPLAYS, random_control=not args.no_controls,
                             seed=args.seed, progress=progress, downstream_tokens=args.downstream_tokens)
    finally:
        if bar is not None:
            bar.close()
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report.summary.to_csv(out / "say_success.csv", index=False)
        report.items.to_csv(out / "say_items.csv", index=False)
    if args.format == "json":
        print(json.dumps({"summary": report.summary.to_dict(orient="records"), "n_items": report.n_items,
                          "n_scored": report.n_scored, "layers": report.layers, "seconds": report.seconds,
                          "settings": report.settings}, indent=1, default=str))
    else:
        print(report.summary.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
        print(f"{report.n_items} items, {report.n_scored} scored, {report.seconds:.0f} s "
              f"({report.seconds_per_item:.1f} s per item)")
    return 0


def cmd_say(args: argparse.Namespace) -> int:
    from ..models.loading import load_model
    from .common import resolve_lenses

    if args.set is None:
        if args.prompt is None or not args.prompt.strip():
            raise CLIError("--prompt is empty: give the text the model should continue (or --set for a set of items).")
        if args.target is None or not args.target.strip():
            raise CLIError("--target is empty: give the word the model should say.")
    elif args.prompt is not None or args.target is not None:
        raise CLIError("--set runs a set of items: leave out --prompt and --target (or leave out --set).")
    if args.max_replays is not None and args.max_replays < 1:
        raise CLIError(f"--max-replays {args.max_replays} must be at least 1.")
    if not 0 <= args.downstream_tokens <= 256:
        raise CLIError(f"--downstream-tokens {args.downstream_tokens} must be from 0 (no downstream figure) to 256.")
    if args.layers:
        from ..layerspec import check_layer_spec

        check_layer_spec(args.layers)
    _grids(args)  # bad numbers stop here, before the model loads
    model = load_model(args.model, **model_loading_options(args), progress=say)
    lenses = resolve_lenses(args.lens or ["default"], model)
    if args.set is None:
        if len(lenses) > 1:
            raise CLIError("One search reads one lens: give --lens once (--set compares several).")
        return _run_one(args, model, next(iter(lenses.values())))
    return _run_set(args, model, lenses)


def register(subparsers) -> None:
    p = add_model_command(subparsers,
        "say", help="search the edit along a lens's read directions that makes the model say a word",
        description="Make it say X: rank steer / swap / ablate edits along a lens's read directions by their "
                    "first-order effect, replay the best with the real forward pass, bisect the smallest band and "
                    "strength, and run the same search with random directions and the logit lens's (controls). "
                    "With --set: say success over a set of items.")
    p.add_argument("--lens", action="append", default=None,
                   help="a lens file, 'default' (the shipped lens), 'logit' or '<model>:<variant>' "
                        "(e.g. smollm2-135m:relevance); repeat with --set to compare lenses")
    p.add_argument("--prompt", default=None, help="the text the model continues")
    p.add_argument("--target", default=None, help="the word the model should say next (e.g. Berlin)")
    p.add_argument("--set", default=None, metavar="NAME|FILE",
                   help="say success over a set: 'say' (shipped) or a .jsonl file of {prompt, answer, target}")
    p.add_argument("--n-items", type=int, default=0, help="with --set: only the first N items (0: all)")
    p.add_argument("--out", default=None, help="with --set: a folder for say_success.csv and say_items.csv")
    add_edit_layers_argument(p, verb="search", example="10:29")
    p.add_argument("--ops", default="steer,swap,ablate", help="edits to try (comma-separated; default all three)")
    p.add_argument("--positions", default="readout,from",
                   help="readout (the last prompt position), from (every position from --from-position), or both")
    p.add_argument("--from-position", type=int, default=1, help="first position of 'from' edits (default 1)")
    p.add_argument("--steer-grid", default=None, help="steering strengths, e.g. 0.25,0.5,1,2,4 (the default)")
    p.add_argument("--swap-grid", default=None, help="swap scales, e.g. 1,2,4,8,16 (the default)")
    p.add_argument("--ablate-grid", default=None, help="competitors to ablate, e.g. 1,2,4,8 (the default)")
    p.add_argument("--max-replays", type=int, default=None,
                   help="replays of ranked candidates per arm (default 12; 8 per item with --set)")
    p.add_argument("--no-controls", action="store_true", help="skip the random-direction and logit-lens controls")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-direction control")
    p.add_argument("--max-new-tokens", type=int, default=12,
                   help="continuation written with and without the minimal recipe (0: none; default 12)")
    p.add_argument("--downstream-tokens", type=int, default=12,
                   help="clean continuation teacher-forced with each verified recipe for its downstream side effect "
                        "(KL in bits; 0: none; default 12)")
    p.add_argument("--format", choices=["text", "json"], default="text", help="text (default) or json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_say)
