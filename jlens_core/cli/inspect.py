"""Read one prompt through lenses and print the top-1 token of every layer (rows; 'out' is the model's output) at
every position (columns), or the whole grid as JSON or CSV records; --save writes a reading file that reopens
without the model.

``jlens inspect``: read a prompt through lenses and print the layer x position grid, as a table or as data. The
first paragraph above is the command's ``--help`` description (:func:`~jlens_core.cli.main.command_description`).

``--format table`` (default) prints the top-1 token of every layer (rows) at the last positions
(columns); ``--format json|csv`` prints every lens x layer x position record instead
(:mod:`jlens_core.reading.grid_export`), nothing else on stdout; ``--save FILE`` writes the reading
file (docs/method.md §6.1), which reopens without the model; ``--html FILE`` writes one offline HTML page
(:mod:`jlens_core.figures.html_page`).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ..lenses.kinds import is_baseline
from .common import vocab_choices
from .main import CLIError, command_description, say
from .model_args import LENS_HELP, add_model_command, model_loading_options

if TYPE_CHECKING:  # the CLI imports torch only when a command runs
    from ..reading.generation import Generation
    from ..reading.prompt_reading import PromptReading

LAST_DEFAULT = 12  # positions the table shows when --last is not given (with --generate: the continuation)
FORMATS = ("table", "json", "csv")


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..layerspec import check_layer_spec, parse_layer_spec
    from ..models.loading import load_model
    from ..reading.generation import check_generate_args, generate
    from ..reading.reader import read_prompts
    from .common import advance, progress_bar, resolve_lenses

    if not args.prompt:
        raise CLIError("--prompt is empty: give some text to read.")
    if args.layers:
        check_layer_spec(args.layers)
    if args.generate:
        check_generate_args(args.prompt, args.generate, args.temperature, 1)
    if args.top_k < 1:
        raise CLIError(f"--top-k {args.top_k} must be at least 1.")
    if args.stability_k < 1:
        raise CLIError(f"--stability-k {args.stability_k} must be at least 1 (1: top-1 under both halves).")
    if args.last is not None and args.last < 0:
        raise CLIError(f"--last {args.last} must be >= 0 (0 shows every position).")
    specs = [spec.strip() for value in (args.lens or ["logit"]) for spec in value.split(",") if spec.strip()]
    if not specs:
        raise CLIError("--lens is empty: give a lens ('logit', 'default', 'tuned' or a lens file).")
    model = load_model(args.model, **model_loading_options(args), progress=say)
    lenses = resolve_lenses(specs, model)
    origins = dict(zip(lenses, specs)) if len(lenses) == len(specs) else {}  # one name per --lens given
    layers = parse_layer_spec(args.layers, model.n_layers) if args.layers else None
    if layers is not None:  # the model's own output is always the last row
        layers += sorted({lens.target_layer for lens in lenses.values()} - set(layers))
    table = args.format == "table"
    source: Generation | str
    if args.generate:
        bar = progress_bar(args.generate, "generating", args.no_progress, unit="token")
        try:
            source = generate(model, args.prompt, max_new_tokens=args.generate, temperature=args.temperature,
                              seed=args.seed, chat=args.chat,
                              progress=(lambda p: advance(bar, p.step, p.total)) if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        print(f"continuation ({source.n_generated} tokens, {source.stop_reason}): {source.continuation!r}",
              file=sys.stdout if table else sys.stderr)
    else:
        source = model.chat(args.prompt) if args.chat else str(args.prompt)
    readings = read_prompts(model, lenses, source, top_k=args.top_k, layers=layers, max_seq_len=args.max_seq_len,
                            show_whitespace=True, vocab=args.vocab, pinned=args.pin or (), stability=args.stability,
                            stability_k=args.stability_k)
    for name, reading in readings.items():
        if reading.stability_note and (not is_baseline(reading.lens_kind) or len(readings) == 1):
            print(f"{name}: {reading.stability_note}", file=sys.stderr)
    if args.save:
        from ..reading.reading_file import save_readings

        written = save_readings(args.save, readings, model=model, lenses=lenses, origins=origins,
                                generation=None if isinstance(source, str) else source)
        print(f"Wrote {written}", file=sys.stderr)
    if args.html:
        from ..figures.html_page import write_reading_page

        settings = {"lens specs": ", ".join(specs), "max_seq_len": args.max_seq_len or "none",
                    "chat template": "yes" if args.chat else "no"}
        try:
            written = write_reading_page(readings, args.html, settings=settings)
        except ImportError as exc:
            raise CLIError(f"--html needs plotly: {exc}") from None
        print(f"Wrote {written}", file=sys.stderr)
    if args.format == "json":
        from ..reading.grid_export import grid_json

        sys.stdout.write(grid_json(readings))
    elif args.format == "csv":
        from ..reading.grid_export import grid_csv

        sys.stdout.write(grid_csv(readings))
    else:
        for i, (name, reading) in enumerate(readings.items()):
            if i:
                print()
            print_grid(reading, name, args.last, args.width)
    return 0


def print_grid(reading: PromptReading, name: str, last: int | None, width: int) -> None:
    """The top-1 token of every layer (rows; ``out`` the model's output) at the last ``last`` positions."""
    if last is None:
        last = reading.n_generated + 1 if reading.n_generated else LAST_DEFAULT  # the continuation and the prompt's end
    positions = reading.positions[-last:] if last else reading.positions

    def cell(s: str, mark: str = "") -> str:
        s, room = s.replace("\n", "↵"), width - len(mark)
        if len(s) > room:
            s = s[: room - 1] + "…"
        return (s + mark).ljust(width)

    grid = reading.top1_grid()
    cols = [reading.position_index(p) for p in positions]
    halves = reading.stability
    if halves is not None:  # docs/method.md §6.2: '?' after a token the half lenses do not both rank in their top k
        from ..reading.stability import top_rule

        unstable = ~halves.stable
        by_layer = reading.stability_by_layer()["stable_fraction"].tolist()
    fitted = reading.fitted
    lens = f"{reading.lens_kind} lens" if name == reading.lens_kind else f"{name} ({reading.lens_kind} lens)"
    print(f"{reading.model_name} · {lens} · vocab={reading.vocab} · top-1 token per layer (rows) and position "
          "(columns)")
    if not fitted[cols].all():
        print(f"(unfit): positions before the lens's skip_first={reading.skip_first}, where it was never fitted")
    if halves is not None:
        print(f"?: unstable, the token is not {top_rule(halves.stability_k)} under both half lenses; right: the "
              "layer's stable % over its fitted positions")
    print("layer ".rjust(7) + " ".join(cell(reading.tokens[c]) for c in cols))
    if reading.n_generated or not fitted[cols].all():
        marks = ["(gen)" if reading.segments[c] == "generated" else "" if fitted[c] else "(unfit)" for c in cols]
        print("".rjust(7) + " ".join(cell(m) for m in marks))
    print("-" * (7 + (width + 1) * len(cols)))
    for i, layer in enumerate(reading.layers):
        label = "out" if layer == reading.output_layer else str(layer)
        stable = "" if halves is None else f"  {by_layer[i]:4.0%}" if by_layer[i] == by_layer[i] else "     -"
        print(f"{label:>6} " + " ".join(cell(grid[i][c], "?" if halves is not None and unstable[i, c] else "")
                                        for c in cols) + stable)


def register(subparsers) -> None:
    i = add_model_command(subparsers, "inspect", help="print a layer x position grid of top-1 tokens",
                          description=command_description(__doc__))
    i.add_argument("--lens", action="append", default=None,
                   help=f"{LENS_HELP} (default: logit); repeat, or give 'a,b', to read several (one table each; a "
                        "'lens' column in json/csv; side by side in --html)")
    i.add_argument("--prompt", required=True, help="the text to read")
    i.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    i.add_argument("--layers", default=None, help="layers to show: '0,4,8', '0:12', '::2' (default all)")
    i.add_argument("--last", type=int, default=None,
                   help=f"the table shows the last N positions (default {LAST_DEFAULT}, or the continuation with "
                        "--generate; 0 = all); json and csv hold every position")
    i.add_argument("--generate", type=int, default=0, metavar="N",
                   help="let the model write N tokens first (1-4096), print them, and read prompt + continuation")
    i.add_argument("--temperature", type=float, default=0.0, help="with --generate: 0 = greedy (default)")
    i.add_argument("--seed", type=int, default=None, help="with --generate and a temperature: the sampling seed")
    i.add_argument("--no-progress", action="store_true", help="no progress bar while generating")
    i.add_argument("--width", type=int, default=9, help="characters per cell (default 9)")
    i.add_argument("--max-seq-len", type=int, default=None, help="truncate the prompt to this many tokens")
    i.add_argument("--vocab", choices=vocab_choices(), default="all",
                   help="top-1 among every token (default) or among word tokens (a letter or digit in the text)")
    i.add_argument("--top-k", type=int, default=10,
                   help="tokens kept per cell in json, csv and --save (default 10; the table shows the top-1)")
    i.add_argument("--pin", action="append", default=None, metavar="TOKEN",
                   help="track this token's rank (a rank_TOKEN column in json/csv and --save); repeatable")
    i.add_argument("--stability", action="store_true",
                   help="mark unstable cells ('?' in the table; half_rank_even/odd and stable columns in json/csv "
                        "and --save): the shown token is not top-1 (--stability-k) under both of the lens's "
                        "split halves. A lens without halves is read without marks (one sentence says so)")
    i.add_argument("--stability-k", type=int, default=1, metavar="K",
                   help="with --stability: stable = within the top K under both halves (default 1: top-1 under "
                        "both, docs/method.md §6.2)")
    i.add_argument("--format", choices=FORMATS, default="table",
                   help="table (default): the top-1 grid; json: a JSON array of records, one per lens x layer x "
                        "position; csv: the same as CSV (list cells as JSON). Nothing else goes to stdout")
    i.add_argument("--save", default=None, metavar="FILE",
                   help="also write the readings (every lens, every position, the continuation) to a reading file, "
                        "e.g. reading.jlens.json, that reopens without the model")
    i.add_argument("--html", default=None, metavar="FILE",
                   help="also write one self-contained HTML page that works offline: the heatmap (two lenses side "
                        "by side, more stacked) with hover, click for a cell's detail, the settings in a header")
    i.set_defaults(func=cmd_inspect)
