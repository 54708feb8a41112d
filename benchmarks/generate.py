"""`sinklm generate` against transformers' ``generate`` on the same exported model.

tiny-5m sink_token (random weights: the speed does not depend on them) with a byte-level BPE of
4,095 ids trained on a book of ../shared/data, plus its sink id, exported by ``export_model``
and loaded twice from that folder: by ``load_checkpoint`` (as ``sinklm generate --checkpoint``
loads it) and as a plain ``GPTNeoXForCausalLM``. Ours is the command's loop, ``answer``
(``Session.draw`` and the detokenizer), under its default cache (1+510 for a 512-token context);
theirs is ``model.generate``, greedy, with its default dynamic cache, which keeps every token.
Same prompt, same threads. Parts:

- step: our per-token cost once the cache is full (x + y held) against one cached decode step
  of transformers' forward with a ``DynamicCache`` of x + y entries, cropped back after each;
- generate: tokens/s of N greedy tokens, the sides alternating in rounds (medians). The two
  streams must agree until our cache fills (greedy on the same weights);
- long (``--long``): ours once; transformers' time estimated (a 100k-token run would take
  hours: its step grows with the cache, which it copies and attends whole): its generate at the
  longest ``--tokens`` length, then its decode step, timed on caches of random entries at five
  lengths up to ``--long``, for every further token (see :func:`bench_long`);
- memory (``--memory``): each side in a subprocess of its own, peak RSS growth during the run
  above the resident memory after load and warm-up (the peak is reset through
  /proc/self/clear_refs), and the MiB its cache holds. Transformers' generate runs at the
  ``--tokens`` lengths; at ``--long``, its cache is filled with that many random entries and
  one step taken (what its generate holds there).

The machine may be shared: the load average before and after is recorded.

    python benchmarks/generate.py --threads 1 --memory     # ~11 min on 2 quiet CPU cores
    python benchmarks/generate.py --threads 2               # ~6 min; --long 0 skips 100k
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, GPTNeoXForCausalLM

from sinklm.cli.generate import default_cache
from sinklm.data.sinks import SinkPrefix
from sinklm.data.tokenizer import sink_token_ids, train_tokenizer
from sinklm.eval.cache import StartRecent
from sinklm.eval.generate import Detokenizer, Sampling, Session, answer
from sinklm.eval.start_recent import StartRecentCache
from sinklm.models import CausalLM, ModelConfig
from sinklm.models.hub import export_model
from sinklm.models.load import Checkpoint, load_checkpoint

SHARED = Path(os.environ.get("SINKLM_SHARED_DATA",
                             Path(__file__).resolve().parents[2] / "shared" / "data"))
PROMPT = "It is a truth universally acknowledged, that a single man in possession of"


def build(folder: Path, book: Path, preset: str, seed: int) -> Path:
    """The exported model both sides load: ``preset`` with one sink token, random weights."""
    config = ModelConfig.from_preset(preset, variant="sink_token")
    lines = [line for line in book.read_text(encoding="utf-8").splitlines() if line.strip()]
    tokenizer = train_tokenizer(lines, vocab_size=config.vocab_size - config.sink_tokens)
    sinks = sink_token_ids(tokenizer, config.sink_tokens, config.vocab_size)
    torch.manual_seed(seed)
    model = CausalLM(config).eval()
    return export_model(Checkpoint(model, tokenizer, sinks, preset, "memory"), folder)


def load_theirs(folder: Path) -> GPTNeoXForCausalLM:
    model = GPTNeoXForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # N tokens, whatever they are
    return model


def prompt_ids(checkpoint: Checkpoint) -> list[int]:
    """The stream's start as ``sinklm generate`` feeds it: the sink ids, then the prompt."""
    ids = checkpoint.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    return SinkPrefix(checkpoint.sink_token_ids).prepend(ids)


def ours(checkpoint: Checkpoint, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """``sinklm generate``'s loop for ``n`` greedy tokens: the ids, the seconds, the MiB its
    cache holds at the end."""
    start = time.perf_counter()
    session = Session(checkpoint.model, default_cache(checkpoint), Sampling())
    turn = answer(session, prompt, Detokenizer(checkpoint.tokenizer), n)
    seconds = time.perf_counter() - start
    cache = session.cache
    assert isinstance(cache, StartRecentCache)
    return turn.generated_ids, seconds, cache_mib([*cache.layers, *(cache.rings or [])])


def theirs(model: GPTNeoXForCausalLM, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """transformers' greedy ``generate`` of ``n`` tokens: the ids, the seconds, the MiB its
    cache holds at the end."""
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    return out.sequences[0, len(prompt) :].tolist(), seconds, cache_mib(out.past_key_values.layers)


def cache_mib(layers: list[object]) -> float:
    """MiB of the distinct tensor storages the layers of a cache hold."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes()
                for layer in layers for t in vars(layer).values() if isinstance(t, torch.Tensor)}
    return sum(storages.values()) / 2**20


def filled_cache(model: GPTNeoXForCausalLM, n: int) -> DynamicCache:
    """A dynamic cache holding ``n`` random entries per layer: a step's cost (and memory)
    depends on the length only."""
    config = model.config
    cache = DynamicCache(config=config)
    shape = (1, config.num_attention_heads, n, config.hidden_size // config.num_attention_heads)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape), torch.randn(shape), layer)
    return cache


@torch.inference_mode()
def their_step(model: GPTNeoXForCausalLM, cache: DynamicCache, steps: int) -> float:
    """Median seconds of one decode step on ``cache``, cropped back after each (same length)."""
    token, position = torch.tensor([[7]]), torch.tensor([[cache.get_seq_length()]])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(token, cache=cache, use_cache=True, position_ids=position)
        times.append(time.perf_counter() - start)
        cache.crop(-1)
    return statistics.median(times)


def our_step(session: Session, steps: int) -> float:
    """Median seconds of one ``Session.draw`` (the drawn token fed first, then the argmax)."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.draw()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_step(checkpoint: Checkpoint, model: GPTNeoXForCausalLM, prompt: list[int],
               rounds: int, steps: int) -> dict[str, object]:
    """Per-token cost at the same cache length x + y, the sides alternating in rounds."""
    policy = default_cache(checkpoint)
    assert isinstance(policy, StartRecent)
    session = Session(checkpoint.model, policy, Sampling())
    session.feed(prompt)
    while len(session.cache) < policy.size:  # full: every further step is the steady one
        session.draw()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([(prompt * policy.size)[: policy.size]]), cache=cache, use_cache=True)
    mine, yours = [], []
    for _ in range(rounds):
        mine.append(our_step(session, steps))
        yours.append(their_step(model, cache, steps))
    ratios = [a / b for a, b in zip(mine, yours, strict=True)]
    return {
        "cache_length": policy.size, "steps_per_round": steps, "rounds": rounds,
        "ours_ms": 1e3 * statistics.median(mine), "transformers_ms": 1e3 * statistics.median(yours),
        "ratio_per_round": ratios, "ratio": statistics.median(ratios),
    }


@dataclass
class Generated:
    """Both sides' seconds for ``tokens`` tokens, round by round, and their streams' common
    start (greedy on the same weights: equal until our cache fills)."""

    tokens: int
    ours_seconds: list[float]
    transformers_seconds: list[float]
    identical_tokens: int
    identical_until_cache_full: bool

    def to_json(self) -> dict[str, object]:
        mine, yours = (statistics.median(self.ours_seconds),
                       statistics.median(self.transformers_seconds))
        return asdict(self) | {
            "ours_tokens_per_second": self.tokens / mine,
            "transformers_tokens_per_second": self.tokens / yours, "speedup": yours / mine,
        }


def bench_generate(checkpoint: Checkpoint, model: GPTNeoXForCausalLM, prompt: list[int],
                   n: int, rounds: int) -> Generated:
    """``n`` tokens on each side, alternating in rounds."""
    mine, yours = [], []
    for _ in range(rounds):
        ids, seconds, _ = ours(checkpoint, prompt, n)
        mine.append(seconds)
        their_ids, seconds, _ = theirs(model, prompt, n)
        yours.append(seconds)
    same = next((i for i, (a, b) in enumerate(zip(ids, their_ids, strict=True)) if a != b), n)
    full = checkpoint.model.config.max_seq_len - len(prompt)  # tokens before our cache fills
    return Generated(n, mine, yours, same, same >= min(full, n))


def bench_long(checkpoint: Checkpoint, model: GPTNeoXForCausalLM, prompt: list[int], n: int,
               longest: Generated) -> dict[str, object]:
    """Ours at ``n`` tokens, measured. Transformers' time estimated: its measured generate at
    the longest ``--tokens`` length n0, then its decode step for each further token, timed on
    caches of five lengths from n0 to n (geometric) of random entries, linear between. The step
    grows with the length, so each interval's first step gives a lower bound as well."""
    _, seconds, _ = ours(checkpoint, prompt, n)
    n0 = longest.tokens
    lengths = [round(n0 * (n / n0) ** (i / 4)) for i in range(5)]
    steps = [their_step(model, filled_cache(model, length), steps=5) for length in lengths]
    intervals = list(zip(lengths, lengths[1:], steps, steps[1:], strict=False))
    measured = statistics.median(longest.transformers_seconds)
    estimated = measured + sum((b - a) * (s + t) / 2 for a, b, s, t in intervals)
    at_least = measured + sum((b - a) * s for a, b, s, _ in intervals)
    return {
        "tokens": n, "ours_tokens_per_second": n / seconds, "ours_seconds": seconds,
        "transformers_step_ms": dict(zip(lengths, [1e3 * s for s in steps], strict=True)),
        "transformers_seconds_estimated": estimated,
        "transformers_seconds_at_least": at_least,
        "transformers_tokens_per_second_estimated": n / estimated,
        "transformers_tokens_per_second_at_most": n / at_least,
        "speedup_estimated": estimated / seconds, "speedup_at_least": at_least / seconds,
    }


def status_mib(field: str) -> float:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text())[1]) / 1024


def worker(side: str, folder: Path, n: int) -> dict[str, object]:
    """One side's peak RSS growth over ``n`` tokens above its resident memory after a warm-up."""
    checkpoint = load_checkpoint(folder)
    prompt = prompt_ids(checkpoint)
    model = None if side == "ours" else load_theirs(folder)
    if model is None:
        ours(checkpoint, prompt, 64)
    else:
        theirs(model, prompt, 64)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_mib("VmRSS")
    result: dict[str, object] = {"side": side, "tokens": n}
    if model is None:
        _, result["seconds"], result["cache_mib"] = ours(checkpoint, prompt, n)
    elif side == "transformers":
        _, result["seconds"], result["cache_mib"] = theirs(model, prompt, n)
    else:  # transformers-step: its cache at n entries, and one step
        cache = filled_cache(model, n)
        result["step_ms"] = 1e3 * their_step(model, cache, steps=1)
        result["cache_mib"] = cache_mib(cache.layers)
    return result | {"rss_before_mib": before, "peak_growth_mib": status_mib("VmHWM") - before}


def memory(folder: Path, lengths: list[int], long: int, threads: int) -> list[dict[str, object]]:
    """Every worker in a fresh process, one after the other."""
    runs = [("ours", n) for n in [*lengths, long] if n] + [("transformers", n) for n in lengths]
    runs += [("transformers-step", long)] if long else []
    results = []
    for side, n in runs:
        out = subprocess.run(
            [sys.executable, __file__, "--worker", side, "--folder", str(folder),
             "--worker-tokens", str(n), "--threads", str(threads)],
            check=True, capture_output=True, text=True,
        ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-5m")
    parser.add_argument("--book", type=Path,
                        default=SHARED / "books" / "pride_and_prejudice_austen_pg1342.txt")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1_000, 10_000])
    parser.add_argument("--long", type=int, default=100_000, help="0: skip")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=100, help="decode steps per step round")
    parser.add_argument("--memory", action="store_true", help="peak RSS per side, subprocesses")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["ours", "transformers", "transformers-step"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # positions past 512 are the point here
    if args.worker:
        print(json.dumps(worker(args.worker, args.folder, args.worker_tokens)))
        return 0
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp) / "export", args.book, args.preset, args.seed)
        checkpoint = load_checkpoint(folder)
        model = load_theirs(folder)
        prompt = prompt_ids(checkpoint)
        ours(checkpoint, prompt, 64)  # warm-ups
        theirs(model, prompt, 64)
        result: dict[str, object] = {
            "preset": args.preset, "variant": "sink_token", "threads": args.threads,
            "cache": default_cache(checkpoint).label, "prompt_tokens": len(prompt),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "step": bench_step(checkpoint, model, prompt, args.step_rounds, args.steps),
        }
        generated = [bench_generate(checkpoint, model, prompt, n, args.rounds)
                     for n in sorted(args.tokens)]
        result["generate"] = [run.to_json() for run in generated]
        if args.long:
            result["long"] = bench_long(checkpoint, model, prompt, args.long, generated[-1])
        if args.memory:
            result["memory"] = memory(folder, args.tokens, args.long, args.threads)
    result |= {"load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
