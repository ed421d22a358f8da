"""``jlens intervene``: steer, ablate or swap along a lens's read directions and compare the model's
next token and continuation with and without the edit (docs/method.md §7)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .main import CLIError, say
from .model_args import LENS_HELP, add_edit_layers_argument, add_model_command, model_loading_options

if TYPE_CHECKING:  # the CLI imports torch only when a command runs
    from ..interventions import Ablate, Steer, Swap
    from ..lenses.protocol import Lens
    from ..models.model import LensModel


def _split(value: str, what: str) -> tuple[str, str]:
    if ":" not in value:
        raise CLIError(f"--{what} {value!r} needs the form {'A:B' if what == 'swap' else 'TOKEN:STRENGTH'}.")
    left, right = value.rsplit(":", 1) if what == "steer" else value.split(":", 1)
    if not left or not right:
        raise CLIError(f"--{what} {value!r} needs two non-empty parts around ':'.")
    return left, right


def build_edits(args: argparse.Namespace, model: LensModel, lens: Lens) -> list[Swap | Steer | Ablate]:
    """The edits the options ask for (one sentence on bad input)."""
    from ..interventions import Ablate, Steer, Swap
    from ..layerspec import parse_layer_spec

    layers = parse_layer_spec(args.layers, model.n_layers) if args.layers else None
    positions = None
    if args.positions:
        n_prompt = int(model.encode(args.prompt).shape[1])
        positions = parse_layer_spec(args.positions, n_prompt)
    common = {"layers": layers, "positions": positions, "on_generated": args.on_generated,
              "centred": args.centred}
    edits: list[Swap | Steer | Ablate] = []
    for value in args.swap or []:
        a, b = _split(value, "swap")
        edits.append(Swap(model, lens, a, b, args.alpha, **common))
    for value in args.steer or []:
        token, strength = _split(value, "steer")
        try:
            s = float(strength)
        except ValueError:
            raise CLIError(f"--steer {value!r}: the strength {strength!r} is not a number.") from None
        edits.append(Steer(model, lens, token, s, **common))
    for token in args.ablate or []:
        edits.append(Ablate(model, lens, token, **common))
    if not edits:
        raise CLIError("No edit given: use --swap A:B, --steer TOKEN:S or --ablate TOKEN.")
    return edits


def cmd_intervene(args: argparse.Namespace) -> int:
    from ..interventions import Swap
    from ..interventions.compare import compare_runs
    from ..models.loading import load_model
    from .common import resolve_lenses

    if not args.prompt or not args.prompt.strip():
        raise CLIError("--prompt is empty: give some text for the model to continue.")
    if args.layers:
        from ..layerspec import check_layer_spec

        check_layer_spec(args.layers)
    model = load_model(args.model, **model_loading_options(args), progress=say)
    lens = next(iter(resolve_lenses([args.lens], model).values()))
    edits = build_edits(args, model, lens)
    result = compare_runs(model, args.prompt, edits, max_new_tokens=args.max_new_tokens, chat=args.chat,
                          top_k=10, target=args.target)
    for edit in edits:
        skipped = edit.skipped_layers if isinstance(edit, Swap) else []  # a swap skips near-parallel layers
        print(f"edit: {edit!r}" + (f"; skipped layers {skipped} (|cos| > 0.999)" if skipped else ""))
    print(f"{'':>3} {'clean next token':<28} {'edited next token':<28}")
    for i, row in result.next_tokens.iterrows():
        print(f"{i + 1:>3} {row['clean_token']!r:<20} {row['clean_prob']:6.1%}  "
              f"{row['edited_token']!r:<20} {row['edited_prob']:6.1%}")
    print(f"clean : {result.clean.continuation!r}")
    print(f"edited: {result.edited.continuation!r}")
    if result.first_difference is None:
        print("The continuations are the same.")
    else:
        print(f"They part at generated token {result.first_difference}.")
    print(f"side effects: {result.side_effects()}")
    return 0


def register(subparsers) -> None:
    p = add_model_command(subparsers,
        "intervene", help="steer / ablate / swap along a lens's read directions; compare next token and continuation",
        description="Edit the residual stream along the directions a lens reads as tokens and compare the "
                    "model's next-token top-10 and greedy continuation with and without the edit.")
    p.add_argument("--lens", default="default", help=f"{LENS_HELP} (default: default)")
    p.add_argument("--prompt", required=True, help="the text the model continues")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--swap", action="append", metavar="A:B", help="swap the read coordinates of A and B")
    p.add_argument("--steer", action="append", metavar="TOKEN:S", help="steer toward TOKEN with strength S in [-4, 4]")
    p.add_argument("--ablate", action="append", metavar="TOKEN", help="remove the read direction of TOKEN")
    add_edit_layers_argument(p, verb="edit", example="10:24")
    p.add_argument("--positions", default=None,
                   help="prompt positions to edit, e.g. '5:' or '3,4' (default: all but the first)")
    p.add_argument("--on-generated", action="store_true", help="also edit the tokens the model generates")
    p.add_argument("--centred", action="store_true",
                   help="edit along centred read directions (each minus the mean over the vocabulary at its layer)")
    p.add_argument("--alpha", type=float, default=1.0, help="swap scale (1 exchanges the coordinates; 0..16)")
    p.add_argument("--max-new-tokens", type=int, default=20, help="tokens to generate (default 20)")
    p.add_argument("--target", default=None,
                   help="the word the edit aims at, left out of the readout side effect (default: the token the "
                        "edited model writes first)")
    p.set_defaults(func=cmd_intervene)
