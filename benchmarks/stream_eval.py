"""Fast streaming evaluator against the token-by-token reference, in one process.

Same model, stream and cache for both; prints tokens/s of each, the speed-up and the largest
per-token loss difference on the tokens both scored, and the "head floor": the rate of the vocab
head and log-softmax alone, which any exact evaluator must compute for every token. The
reference decodes one token per model call, so on long streams time it on a prefix
(``--reference-tokens``) and say so.

    python benchmarks/stream_eval.py                                  # tiny-1m, 20k tokens, 4+252
    python benchmarks/stream_eval.py --tokens 1000000 --fast-only    # flat memory on 1M tokens
    python benchmarks/stream_eval.py --preset pythia-160m --cache 4+1020 --device cuda \\
        --reference-tokens 2000
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sinklm.eval.cache import parse_cache
from sinklm.eval.streaming import DEFAULT_CHUNK, fast_losses, reference_losses
from sinklm.models import PRESETS, VARIANTS, CausalLM, ModelConfig


def timed(run: Callable[[], torch.Tensor], device: str) -> tuple[torch.Tensor, float]:
    """The losses ``run`` returns and its wall time, waiting for the GPU to finish."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    losses = run()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return losses, time.perf_counter() - start


@torch.no_grad()
def head_floor(model: CausalLM, ids: torch.Tensor, device: str) -> float:
    """Seconds for the final norm, vocab head and log-softmax of every scored token: work any
    exact evaluator does, so the fast path can be at most this fast."""
    hidden = torch.randn(512, model.config.d_model, device=device)  # reused: memory stays flat

    def head() -> torch.Tensor:
        for r in range(0, len(ids) - 1, 512):
            targets = ids[r + 1 : r + 513]
            logits = model.embed_out(model.gpt_neox.final_layer_norm(hidden[: len(targets)]))
            F.cross_entropy(logits.float(), targets, reduction="none")
        return hidden

    return statistics.median(timed(head, device)[1] for _ in range(3))


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
                        help="fast runs; the median time counts (the machine may be shared)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = ModelConfig.from_preset(args.preset, variant=args.variant)
    model = CausalLM(config).to(args.device).eval()
    policy = parse_cache(args.cache)
    sinks = config.sink_tokens
    generator = torch.Generator().manual_seed(args.seed + 1)
    text = torch.randint(0, config.vocab_size - sinks, (args.tokens,), generator=generator)
    sink_ids = torch.arange(config.vocab_size - sinks, config.vocab_size)
    ids = torch.cat([sink_ids, text]).to(args.device)

    runs = [
        timed(lambda: fast_losses(model, ids, policy, sinks, args.chunk_size), args.device)
        for _ in range(max(1, args.repeat))
    ]
    fast = runs[0][0]
    fast_seconds = statistics.median(seconds for _, seconds in runs)
    peak_after_fast = peak_rss_mib()
    result = {
        "preset": args.preset, "variant": args.variant, "cache": policy.label,
        "device": args.device, "threads": torch.get_num_threads(),
        "stream_tokens": args.tokens, "chunk_size": args.chunk_size,
        "fast_tokens_per_second": len(fast) / fast_seconds, "fast_seconds": fast_seconds,
        "fast_runs": len(runs),
        "head_floor_tokens_per_second": len(fast) / head_floor(model, ids, args.device),
        "ppl": float(torch.exp(fast.double().mean())),
        "peak_rss_mib_after_fast": peak_after_fast,
    }
    if not args.fast_only:
        prefix = min(args.reference_tokens or args.tokens, args.tokens)
        reference, reference_seconds = timed(
            lambda: reference_losses(model, ids[: sinks + prefix], policy, sinks), args.device
        )
        diff = (reference - fast[: len(reference)]).abs().max().item()
        reference_rate = len(reference) / reference_seconds
        result |= {
            "reference_tokens": prefix,
            "reference_tokens_per_second": reference_rate,
            "reference_seconds": reference_seconds,
            "speedup": result["fast_tokens_per_second"] / reference_rate,
            "max_abs_loss_diff": diff,
            "identical_within_1e-4": diff < 1e-4,
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
