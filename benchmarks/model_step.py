"""Forward+backward throughput of our model against transformers' GPTNeoX, in one process.

    python benchmarks/model_step.py [--presets tiny-5m pythia-14m] [--seq-len 512] [--repeats 5]

For each size: tokens/s of sinklm (sdpa) and of ``GPTNeoXForCausalLM`` (sdpa) with the same
config, dtype, batch and loss, measured in alternating rounds so drift hits both alike; then
each attention variant against vanilla on our model. Goals: ours/transformers >= 1.0,
variant overhead <= 5%. Prints a Markdown table (paste into BENCHMARKS.md) and JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sinklm.models import CausalLM, ModelConfig
from sinklm.models.convert import hf_config_from


def step_fn(model: torch.nn.Module, tokens: torch.Tensor, hf: bool) -> Callable[[], None]:
    targets = torch.roll(tokens, -1, dims=1)

    def step() -> None:
        logits = model(tokens).logits if hf else model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def tokens_per_second(steps: dict[str, Callable[[], None]], n_tokens: int, repeats: int,
                      iters: int) -> dict[str, float]:
    """Median tokens/s per entry, timing the entries round-robin ``repeats`` times."""
    for step in steps.values():  # warm-up
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(iters):
                step()
            times[name].append((time.perf_counter() - start) / iters)
    return {name: n_tokens / statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny-5m", "pythia-14m"])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()

    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(0)
    results = []
    for preset in args.presets:
        config = ModelConfig.from_preset(preset, max_seq_len=args.seq_len)
        tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len))
        n_tokens = tokens.numel()
        ours = CausalLM(config)
        hf_config = hf_config_from(config)
        hf_config._attn_implementation = "sdpa"
        theirs = GPTNeoXForCausalLM(hf_config)
        steps = {"sinklm": step_fn(ours, tokens, hf=False),
                 "transformers": step_fn(theirs, tokens, hf=True)}
        for softmax in ("softmax1", "sink_logit", "gated"):
            variant = CausalLM(config.replace(attention={"softmax": softmax}))
            steps[f"sinklm {softmax}"] = step_fn(variant, tokens, hf=False)
        speed = tokens_per_second(steps, n_tokens, args.repeats, args.iters)
        results.append({"preset": preset, "params": ours.num_params(),
                        "seq_len": args.seq_len, "batch_size": args.batch_size,
                        "tokens_per_second": speed})

    print(f"machine: {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| preset | sinklm tok/s | transformers tok/s | ratio | softmax1 | sink_logit | gated |")
    print("|---|---|---|---|---|---|---|")
    for row in results:
        s = row["tokens_per_second"]
        overhead = [f"{s['sinklm'] / s[f'sinklm {v}'] - 1:+.1%}"
                    for v in ("softmax1", "sink_logit", "gated")]
        print(f"| {row['preset']} | {s['sinklm']:,.0f} | {s['transformers']:,.0f} | "
              f"{s['sinklm'] / s['transformers']:.3f} | " + " | ".join(overhead) + " |")
    print("\n(variant columns: extra time per token against vanilla sinklm)\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
