"""GPU checks: bf16 and fused-kernel paths against an fp32 eager reference, and MFU.

    python benchmarks/gpu_check.py [--mfu-preset pythia-160m] [--seq-len 2048] [--batch-size 16]

1. For every attention variant and every backend this machine has (sdpa, flex, and flash when
   flash-attn is installed): logits and gradients in bf16 autocast against the fp32 eager model
   with the same weights. Prints the worst relative errors; bf16 keeps ~3 significant digits,
   so anything under ~2e-2 is what bf16 allows, and anything far above it is a bug.
2. Training-step throughput and MFU of a preset (default Pythia-160M, seq 2048, bf16 autocast,
   AdamW step included), for each backend, with and without torch.compile.

Needs CUDA; on a machine without it, says so and exits 0. Prints Markdown for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from sinklm.models import CausalLM, ModelConfig
from sinklm.models.attention import flash_attn_func

# Dense bf16 peak of the GPUs we run on (TFLOP/s, without sparsity).
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}


def peak_tflops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def check_paths(backends: list[str]) -> None:
    config = ModelConfig.from_preset("pythia-14m", max_seq_len=512)
    tokens = torch.randint(0, config.vocab_size, (4, 512), device="cuda")
    targets = torch.roll(tokens, -1, dims=1)
    print("| variant | backend | logits rel. err (bf16) | worst grad rel. err (bf16) |")
    print("|---|---|---|---|")
    for softmax in ("softmax", "softmax1", "sink_logit", "gated"):
        torch.manual_seed(0)
        reference = CausalLM(config.replace(attention={"softmax": softmax, "backend": "eager"}))
        reference = reference.cuda()
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name.endswith("sink_logit"):
                    param.normal_()
        ref_logits = reference(tokens)
        F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten()).backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        for backend in backends:
            model = CausalLM(config.replace(attention={"softmax": softmax, "backend": backend}))
            model = model.cuda()
            model.load_state_dict(reference.state_dict())
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
            worst = max(relative_error(p.grad, ref_grads[n]) for n, p in model.named_parameters())
            print(f"| {softmax} | {backend} | {relative_error(logits, ref_logits):.2e} | "
                  f"{worst:.2e} |")


def measure_mfu(preset: str, seq_len: int, batch_size: int, backends: list[str]) -> None:
    device_name = torch.cuda.get_device_name()
    peak = peak_tflops(device_name)
    print(f"\n{preset}, seq {seq_len}, micro-batch {batch_size}, bf16 autocast, AdamW, "
          f"{device_name} (peak {peak} TFLOP/s)\n")
    print("| backend | compile | tokens/s | TFLOP/s | MFU |")
    print("|---|---|---|---|---|")
    for backend in backends:
        for compiled in (False, True):
            config = ModelConfig.from_preset(preset, attention={"backend": backend})
            model = CausalLM(config).cuda()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            forward = torch.compile(model) if compiled else model
            tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len), device="cuda")
            targets = torch.roll(tokens, -1, dims=1)

            def step(forward=forward, optimizer=optimizer, tokens=tokens, targets=targets) -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = forward(tokens)
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            iters = 10
            start = time.perf_counter()
            for _ in range(iters):
                step()
            torch.cuda.synchronize()
            tokens_per_s = iters * batch_size * seq_len / (time.perf_counter() - start)
            tflops = tokens_per_s * config.training_flops_per_token(seq_len) / 1e12
            mfu = f"{tflops / peak:.1%}" if peak else "n/a"
            print(f"| {backend} | {compiled} | {tokens_per_s:,.0f} | {tflops:.0f} | {mfu} |")
            del model, optimizer, forward
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mfu-preset", default="pythia-160m")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run this script on a GPU machine.")
        return
    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 reference that is really fp32
    backends = ["sdpa", "flex"] + (["flash"] if flash_attn_func is not None else [])
    if flash_attn_func is None:
        print("flash-attn is not installed: the flash backend is not checked.\n")
    check_paths(backends)
    measure_mfu(args.mfu_preset, args.seq_len, args.batch_size, backends)


if __name__ == "__main__":
    main()
