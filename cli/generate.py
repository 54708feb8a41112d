"""``sinklm generate``: text from any checkpoint through a start+recent cache, without end.

A prompt (or a conversation of ``--turns``) is streamed through the same cache as
``stream-eval`` (``eval/generate.py``); the text is printed as it is produced, then one summary
line. Every setting is checked before the model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sinklm.cli.evaluate import load_model, warn
from sinklm.cli.main import UserError
from sinklm.cli.options import DEVICE_HELP, DTYPE_NAMES, default_device
from sinklm.cli.outputs import guard_outputs, write_atomic

if TYPE_CHECKING:
    from sinklm.eval.cache import Dense, StartRecent
    from sinklm.eval.generate import Sampling
    from sinklm.models.load import Checkpoint

COMMAND = "generate"
# What evicting the sink costs, measured (README, the sink lab).
EVICTED_SINK = "the sink lab's sink-token model streams at ppl 41.11 with 0+64, 5.00 with 1+63"


def define_generate(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Generate text with a KV cache that keeps the first X and the Y most recent tokens, "
        "positions re-assigned inside it (StreamingLLM), so a model writes far past its trained "
        "context in flat memory. The prompt goes through the same cache (a longer one is "
        "streamed, not cut). Text is printed as it comes, then tokens, tokens/s and the cache.")
    parser.epilog = (
        "example: sinklm generate --checkpoint runs/tiny-sink_token/checkpoints/last.ckpt \\\n"
        "           --prompt 'It was a dark and stormy night' --max-new-tokens 200\n"
        "a conversation, one turn per line, the cache carried across turns:\n"
        "  sinklm generate --checkpoint exports/pythia-160m-sink_token --turns chat.txt \\\n"
        "      --turn-template 'USER: {turn}\\n\\nASSISTANT:' --stop 'USER:' \\\n"
        "      --temperature 0.8 --top-p 0.95 --seed 1 --output chat.json\n"
        "default cache: the model's sink ids (4 without) + the rest of its trained context\n"
        "less one, so that the query's position stays inside it (1+2046 for a 2048-token\n"
        "sink-token model).")
    parser.add_argument(
        "--checkpoint", required=True, metavar="P",
        help="a `sinklm fit` checkpoint (.ckpt), an exported or transformers GPTNeoX folder, or "
        "a Hub id")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help="text to continue")
    prompt.add_argument("--prompt-file", type=Path, metavar="FILE",
                        help="a UTF-8 file whose text to continue")
    parser.add_argument("--turns", type=Path, metavar="FILE",
                        help="a conversation: a .jsonl of turns (a JSON string or an object with "
                        "\"text\" per line) or a text file (one turn per non-empty line); each is "
                        "appended to the stream after the prompt and answered until a stop")
    parser.add_argument("--turn-template", default="{turn}", metavar="T",
                        help="how a turn is written into the stream, e.g. 'USER: {turn}\\n\\n"
                        "ASSISTANT:' (default: the turn as it is)")
    parser.add_argument("--cache", metavar="X+Y",
                        help="X+Y or dense (default: sink ids + the rest of the context)")
    parser.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                        help="tokens to generate (per turn with --turns; default 256)")
    parser.add_argument("--greedy", action="store_true",
                        help="take the most likely token (the default without sampling flags)")
    parser.add_argument("--temperature", type=float, help="sample at this temperature (> 0)")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample from the K most likely")
    parser.add_argument("--top-p", type=float, metavar="P",
                        help="sample from the smallest set whose probability reaches P")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--stop", action="append", default=[], metavar="STRING",
                        help="stop when the text contains STRING (repeatable); generation also "
                        "stops at the end-of-document id")
    parser.add_argument("--ignore-eod", action="store_true",
                        help="write on past the end-of-document id (as in a packed stream)")
    parser.add_argument("--output", type=Path, metavar="FILE.json",
                        help="the run as JSON: ids, text, log-probabilities, cache, sampling")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--tokenizer", metavar="FILE",
                        help="tokenizer.json to use instead of the checkpoint's")
    parser.add_argument("--device", help=DEVICE_HELP)
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    parser.set_defaults(func=run_generate)


def read_text(path: Path, flag: str) -> str:
    try:
        return path.expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{flag} {path} is a folder; give a file") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{flag} {path} is not UTF-8 text ({error})") from None


def read_turns(path: Path) -> list[str]:
    """The turns of a .jsonl (a string or {"text": ...} per line) or of a text file (a line
    each); refused when there is none."""
    text = read_text(path, "--turns")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if path.suffix != ".jsonl":
        turns = [line for _, line in lines]
    else:
        turns = []
        for number, line in lines:
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"--turns {path}, line {number}: not JSON ({error.msg})") from None
            if isinstance(item, dict) and isinstance(item.get("text"), str):
                item = item["text"]
            if not isinstance(item, str):
                raise UserError(f"--turns {path}, line {number}: expected a JSON string or an "
                                "object with a \"text\" string")
            turns.append(item)
    if not turns:
        raise UserError(f"--turns {path} holds no turn")
    return turns


def sampling_of(args: argparse.Namespace) -> Sampling:
    """Greedy unless a sampling flag is given (then the temperature defaults to 1)."""
    from sinklm.eval.generate import Sampling

    sampled = [flag for flag, value in (("--temperature", args.temperature),
                                        ("--top-k", args.top_k), ("--top-p", args.top_p))
               if value is not None]
    if args.greedy and sampled:
        raise UserError(f"--greedy and {', '.join(sampled)}: pick greedy or sampling")
    if not sampled:
        return Sampling(seed=args.seed)
    temperature = 1.0 if args.temperature is None else args.temperature
    if temperature <= 0:
        raise UserError(f"--temperature {temperature}: must be > 0 (use --greedy for argmax)")
    return Sampling(temperature, args.top_k, args.top_p, args.seed)


def parse_generation_cache(spec: str) -> StartRecent | Dense:
    """``X+Y`` or ``dense``; recompute re-encodes windows and keeps no cache to generate with."""
    from sinklm.eval.cache import Recompute, parse_cache

    policy = parse_cache(spec)
    if isinstance(policy, Recompute):
        raise UserError(f"--cache {spec}: recompute is an evaluation baseline; generation takes "
                        "X+Y or dense")
    return policy


def default_cache(checkpoint: Checkpoint) -> StartRecent:
    """The model's default stream cache (``ModelConfig.stream_cache``)."""
    from sinklm.eval.cache import StartRecent

    return StartRecent(*checkpoint.model.config.stream_cache())


def run_generate(args: argparse.Namespace) -> int:
    if args.output is not None:
        guard_outputs([args.output], args.overwrite)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if "{turn}" not in args.turn_template:
        raise UserError(f"--turn-template {args.turn_template!r} has no {{turn}}")
    prompt = read_text(args.prompt_file, "--prompt-file") if args.prompt_file else args.prompt
    turns = read_turns(args.turns) if args.turns else []
    sampling = sampling_of(args)
    policy = parse_generation_cache(args.cache) if args.cache else None
    args.device = args.device or default_device()

    from sinklm.data.sinks import SinkPrefix
    from sinklm.data.tokenizer import eod_token_id
    from sinklm.eval.cache import StartRecent, check_policies
    from sinklm.eval.generate import Detokenizer, Session, answer

    checkpoint = load_model(args)
    tokenizer, config = checkpoint.tokenizer, checkpoint.model.config
    sinks = SinkPrefix(checkpoint.sink_token_ids)
    prompt_ids = tokenizer.encode(prompt or "", add_special_tokens=False).ids
    if not prompt_ids and not turns and not sinks.ids:
        raise UserError("an empty prompt: the model has no sink ids to start from; give "
                        "--prompt, --prompt-file or --turns")
    policy = policy or default_cache(checkpoint)
    turn_ids = [tokenizer.encode(args.turn_template.format(turn=turn),
                                 add_special_tokens=False).ids for turn in turns]
    longest = (len(sinks) + len(prompt_ids) + sum(map(len, turn_ids))
               + args.max_new_tokens * max(1, len(turns)))
    for warning in check_policies([policy], longest, config.max_seq_len, len(sinks),
                                  learned_positions=config.learned_positions):
        warn(COMMAND, warning)
    if isinstance(policy, StartRecent) and policy.start < len(sinks):
        warn(COMMAND, f"cache {policy.label} keeps {policy.start} of the model's {len(sinks)} "
             f"sink ids: once it fills, the sink is evicted ({EVICTED_SINK})")
    if isinstance(policy, StartRecent) and len(sinks) + len(prompt_ids) > policy.size + 1:
        warn(COMMAND, f"the prompt ({len(prompt_ids)} tokens) is longer than the {policy.label} "
             "cache: it is streamed through it, not cut (the model keeps its start and end)")

    end_id = None if args.ignore_eod else eod_token_id(tokenizer)
    session = Session(checkpoint.model, policy, sampling)
    detokenizer = Detokenizer(tokenizer)

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    began = time.perf_counter()
    first = sinks.prepend(prompt_ids)  # the sink ids go in once, at the start of the stream
    feeds = [first + turn_ids[0], *turn_ids[1:]] if turns else [first]
    done = []
    for i, ids in enumerate(feeds):
        if turns:  # a transcript: each turn as written into the stream, then its answer
            show(("" if i == 0 else "\n") + args.turn_template.format(turn=turns[i]))
        done.append(answer(session, ids, detokenizer, args.max_new_tokens, args.stop, end_id,
                           on_text=show))
    seconds = time.perf_counter() - began
    show("\n")
    generated = sum(len(turn.generated_ids) for turn in done)
    held = "" if policy.label == "dense" else f" (at most {session.most_held} held per layer)"
    print(f"sinklm generate: {generated} tokens in {seconds:.1f} s "
          f"({generated / seconds:,.0f} tokens/s), cache {policy.label}{held}, stream "
          f"{session.tokens + (session.pending is not None)} tokens", file=sys.stderr)
    if args.output is not None:
        document = {
            "checkpoint": args.checkpoint,
            "model": checkpoint.describe(),
            "sink_token_ids": list(sinks.ids),
            "cache": policy.label,
            "start": policy.start if isinstance(policy, StartRecent) else None,
            "recent": policy.recent if isinstance(policy, StartRecent) else None,
            "sampling": sampling.to_json(),
            "seed": sampling.seed,
            "max_new_tokens": args.max_new_tokens,
            "stop_strings": args.stop,
            "end_of_document_id": end_id,
            "turn_template": args.turn_template if turns else None,
            "prompt_ids": done[0].prompt_ids,
            "generated_ids": [i for turn in done for i in turn.generated_ids],
            "text": "".join(turn.text for turn in done),
            "stream_ids": [i for turn in done for i in (*turn.prompt_ids, *turn.generated_ids)],
            "turns": [turn.to_json() for turn in done],
            "tokens": generated,
            "seconds": seconds,
            "tokens_per_second": generated / seconds,
            "cache_entries_max": session.most_held,
            "max_position": session.max_position,
            "device": str(args.device),
            "dtype": args.dtype,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.output, json.dumps(document, indent=2) + "\n")
        print(f"sinklm generate: wrote {args.output}", file=sys.stderr)
    return 0
