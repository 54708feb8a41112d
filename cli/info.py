"""``sinklm info``: a preset's size and full config, as JSON."""

from __future__ import annotations

import argparse
import json

from sinklm.cli.main import UserError
from sinklm.models.config import PRESETS, SOFTMAX_VARIANTS, VARIANTS, ModelConfig


def count_params(config: ModelConfig) -> int:
    """Parameter count without allocating weights (the model is built on the meta device)."""
    import torch  # here, not at the top: `sinklm --help` must not wait for torch

    from sinklm.models.model import CausalLM

    with torch.device("meta"):
        return CausalLM(config).num_params()


def define_info(parser: argparse.ArgumentParser) -> None:
    parser.description = "Print {name, params, config} for a preset as JSON."
    parser.epilog = ("example: sinklm info pythia-160m --variant sink_token\n"
                     "         sinklm info --list")
    parser.add_argument("preset", nargs="?", help=f"one of {', '.join(PRESETS)}")
    parser.add_argument("--list", action="store_true", help="list every preset with its size")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help="a named variant")
    parser.add_argument("--softmax", choices=SOFTMAX_VARIANTS, help="attention.softmax")
    parser.add_argument("--sink-tokens", type=int, help="number of sink tokens")
    parser.set_defaults(func=run_info)


def run_info(args: argparse.Namespace) -> int:
    if args.list:
        rows = [
            {"name": name, "params": count_params(ModelConfig.from_preset(name))}
            for name in PRESETS
        ]
        print(json.dumps({"presets": rows, "variants": VARIANTS}, indent=2))
        return 0
    if not args.preset:
        raise UserError("name a preset (or pass --list to see them)")
    config = ModelConfig.from_preset(args.preset, variant=args.variant)
    if args.softmax is not None:
        config = config.replace(attention={"softmax": args.softmax})
    if args.sink_tokens is not None:
        config = config.replace(sink_tokens=args.sink_tokens)
    print(json.dumps({"name": config.name, "params": count_params(config),
                      "config": config.to_dict()}, indent=2))
    return 0
