"""GPU checks: bf16 and fused-kernel paths against an fp32 eager reference.

    python benchmarks/gpu_check.py

For every attention variant and every backend this machine has (sdpa, flex, and flash when
flash-attn is installed): logits and gradients in bf16 autocast against the fp32 eager model
with the same weights. Prints the worst relative errors; bf16 keeps ~3 significant digits, so
anything under ~2e-2 is what bf16 allows, and anything far above it is a bug. Throughput and
MFU are benchmarks/train_throughput.py's job.

Needs CUDA; on a machine without it, says so and exits 0. Prints Markdown for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from sinklm.models import CausalLM, ModelConfig
from sinklm.models.attention import flash_attn_func


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


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run this script on a GPU machine.")
        return
    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 reference that is really fp32
    backends = ["sdpa", "flex"] + (["flash"] if flash_attn_func is not None else [])
    if flash_attn_func is None:
        print("flash-attn is not installed: the flash backend is not checked.\n")
    check_paths(backends)


if __name__ == "__main__":
    main()
