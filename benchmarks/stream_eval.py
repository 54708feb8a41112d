"""Fast streaming evaluator against the token-by-token reference, in one process.

Same model, stream and cache for both; prints tokens/s of each, the speed-up and the largest
per-token loss difference on the tokens both scored, and two floors, work any exact evaluator
does for every token whatever its attention: the "head floor" (final norm, vocab head and
log-softmax) and the "no-attention floor" (every layer's norms, projections and MLP with the
attention itself skipped, then the head). ``speedup_bound`` is the no-attention floor against
the reference: the speed-up of an evaluator, built from the same kernels, whose attention cost
nothing, on this machine and thread count. The reference decodes one token per model call, so
on long streams time it on a prefix (``--reference-tokens``) and say so.

The machine may be shared: the load average before and after is recorded, and CPU seconds
beside wall seconds (with one thread, CPU time is what the work cost, whatever the load).

    python benchmarks/stream_eval.py                                  # tiny-1m, 20k tokens, 4+252
    python benchmarks/stream_eval.py --tokens 1000000 --fast-only    # flat memory on 1M tokens
    python benchmarks/stream_eval.py --preset pythia-160m --cache 4+1020 --device cuda \\
        --reference-tokens 2000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sinklm.data.sinks import SinkPrefix
from sinklm.eval.cache import parse_cache
from sinklm.eval.fast import DEFAULT_CHUNK, VocabHead, fast_losses
from sinklm.eval.reference import reference_losses
from sinklm.models import PRESETS, VARIANTS, CausalLM, ModelConfig


@dataclass
class Timing:
    wall: float
    cpu: float  # this process's CPU seconds, all threads


def timed(run: Callable[[], torch.Tensor], device: str) -> tuple[torch.Tensor, Timing]:
    """The losses ``run`` returns and its wall and CPU time, waiting for the GPU to finish."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.process_time()
    losses = run()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return losses, Timing(time.perf_counter() - start, time.process_time() - start_cpu)


def median(timings: list[Timing]) -> Timing:
    return Timing(statistics.median(t.wall for t in timings),
                  statistics.median(t.cpu for t in timings))


@torch.inference_mode()
def floors(model: CausalLM, ids: torch.Tensor, device: str, chunk: int) -> tuple[Timing, Timing]:
    """Times of the head alone and of the model without attention on every scored token, in
    chunks as the fast path runs (one hidden chunk reused: memory stays flat)."""
    n, d = len(ids) - 1, model.config.d_model
    hidden = torch.randn(chunk, d, device=device)
    head = VocabHead(model, chunk)
    out = torch.empty(chunk, device=device)

    def head_only() -> torch.Tensor:
        for r in range(0, n, chunk):
            targets = ids[r + 1 : r + 1 + chunk]
            head.losses(hidden[: len(targets)], targets, out[: len(targets)])
        return out

    def without_attention() -> torch.Tensor:
        for r in range(0, n, chunk):
            targets = ids[r + 1 : r + 1 + chunk]
            x = hidden[: len(targets)]
            for block in model.gpt_neox.layers:
                attn, x_in = block.attention, block.input_layernorm(x)
                mixed = attn.query_key_value(x_in)[:, :d]  # attention for free: any d columns
                if attn.softmax == "gated":
                    mixed = mixed * torch.sigmoid(attn.gate(x_in))
                x = x + attn.dense(mixed) + block.mlp(block.post_attention_layernorm(x))
            head.losses(x, targets, out[: len(targets)])
        return out

    return tuple(  # type: ignore[return-value]
        median([timed(run, device)[1] for _ in range(3)]) for run in (head_only, without_attention)
    )


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-1m", choices=sorted(PRESETS))
    parser.add_argument("--variant", default="vanilla", choices=sorted(VARIANTS))
    parser.add_argument("--tokens", type=int, default=20_000, help="stream length (text tokens)")
    parser.add_argument("--cache", default="4+252")
    parser.add_argument("--reference-tokens", type=int,
                        help="time the reference on this prefix only (default: the whole stream)")
    parser.add_argument("--fast-only", action="store_true", help="skip the reference")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK)
    parser.add_argument("--repeat", type=int, default=5,
                        help="fast runs per round, half before and half after the reference")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of fast runs around one reference run; the speed-up is the "
                        "median of the rounds' (the machine may be shared)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--reference-threads", type=int,
                        help="torch CPU threads for the reference (default: --threads); its "
                        "one-token ops gain nothing from more, and lose a little on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = ModelConfig.from_preset(args.preset, variant=args.variant)
    model = CausalLM(config).to(args.device).eval()
    policy = parse_cache(args.cache)
    n_sink_ids = config.sink_tokens
    generator = torch.Generator().manual_seed(args.seed + 1)
    text = torch.randint(0, config.vocab_size - n_sink_ids, (args.tokens,), generator=generator)
    text = text.to(args.device)
    sinks = SinkPrefix(range(config.vocab_size - n_sink_ids, config.vocab_size))

    def run_fast() -> tuple[torch.Tensor, Timing]:
        return timed(lambda: fast_losses(model, text, policy, sinks, args.chunk_size),
                     args.device)

    # Rounds of fast runs on both sides of one reference run: a load that changes meanwhile
    # shows in both, and each round gives its own speed-up (the median one is reported).
    load_before = os.getloadavg()[0]
    repeat = max(1, args.repeat)
    threads = torch.get_num_threads()
    prefix = min(args.reference_tokens or args.tokens, args.tokens)
    runs: list[tuple[torch.Tensor, Timing]] = []
    references: list[Timing] = []
    speedups: list[float] = []
    head = no_attention = None
    peak_after_fast = 0.0
    for _ in range(1 if args.fast_only else max(1, args.rounds)):
        before = [run_fast() for _ in range(-(-repeat // 2))]
        if head is None:
            peak_after_fast = peak_rss_mib()
            head, no_attention = floors(model, text, args.device, args.chunk_size)
        if not args.fast_only:
            torch.set_num_threads(args.reference_threads or threads)
            reference, reference_time = timed(
                lambda: reference_losses(model, text[:prefix], policy, sinks),
                args.device,
            )
            torch.set_num_threads(threads)
            references.append(reference_time)
        after = [run_fast() for _ in range(repeat // 2)]
        runs += before + after
        if not args.fast_only:
            round_fast = median([timing for _, timing in before + after])
            speedups.append((reference_time.wall / prefix) / (round_fast.wall / len(before[0][0])))
    fast, n = runs[0][0], len(runs[0][0])
    fast_time = median([timing for _, timing in runs])
    fast_rate = n / fast_time.wall
    result: dict[str, object] = {
        "preset": args.preset, "variant": args.variant, "cache": policy.label,
        "device": args.device, "threads": threads,
        "stream_tokens": args.tokens, "chunk_size": args.chunk_size,
        "fast_tokens_per_second": fast_rate,
        "fast_tokens_per_second_range": [n / max(t.wall for _, t in runs),
                                         n / min(t.wall for _, t in runs)],
        "fast_seconds": fast_time.wall, "fast_cpu_seconds": fast_time.cpu, "fast_runs": len(runs),
        "head_floor_tokens_per_second": n / head.wall,
        "no_attention_floor_tokens_per_second": n / no_attention.wall,
        "ppl": float(torch.exp(fast.double().mean())),
        "peak_rss_mib_after_fast": peak_after_fast,
    }
    if not args.fast_only:
        diff = (reference - fast[: len(reference)]).abs().max().item()
        reference_time = median(references)
        reference_rate = len(reference) / reference_time.wall
        result |= {
            "reference_tokens": prefix,
            "reference_threads": args.reference_threads or threads,
            "reference_tokens_per_second": reference_rate,
            "reference_seconds": reference_time.wall,
            "reference_cpu_seconds": reference_time.cpu,
            "rounds": len(speedups),
            "speedup": statistics.median(speedups),
            "speedup_per_round": speedups,
            "speedup_cpu_time": (reference_time.cpu / len(reference)) / (fast_time.cpu / n),
            "speedup_bound": n / no_attention.wall / reference_rate,
            "max_abs_loss_diff": diff,
            "identical_within_1e-4": diff < 1e-4,
        }
    result |= {"load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
