"""Training-step throughput: the Lightning loop against a bare PyTorch loop, and MFU on a GPU.

    python benchmarks/train_throughput.py [--preset tiny-5m] [--seq-len 512] [--steps 30]

Both loops train the same model from the same initial weights on the same batches with the
same AdamW + schedule + clipping, in one process, alternating for --rounds rounds (medians
reported); the first steps of each run are warm-up and not timed.
Goal on CPU: Lightning overhead <= 5%. On a CUDA machine it then measures --gpu-preset
(default Pythia-160M, seq 2048, bf16) through the Lightning loop and reports tokens/s per GPU
and MFU (goal >= 50% on an H100/H200). Prints Markdown for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from sinklm.train.callbacks import Throughput
from sinklm.train.module import OptimizerConfig, SinkLMModule, lr_multiplier, parameter_groups

WARMUP = 5


class StepTimer(L.Callback):
    """Wall time of the steps after the warm-up ones."""

    def __init__(self) -> None:
        self.start = 0.0
        self.elapsed = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == WARMUP:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, module) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize()
        self.elapsed = time.perf_counter() - self.start


def make_module(preset: str, seq_len: int, backend: str = "sdpa", variant: str = "vanilla",
                compile: bool = False) -> SinkLMModule:
    torch.manual_seed(0)
    return SinkLMModule(preset=preset, variant=variant, backend=backend,
                        model_overrides={"max_seq_len": seq_len}, optimizer=OptimizerConfig(),
                        compile=compile)


def bare_loop(module: SinkLMModule, batches: list[dict[str, torch.Tensor]], steps: int,
              precision: str) -> float:
    """What Lightning does per step, by hand: the reference for its overhead."""
    model, optim = module.model, module.optim
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(parameter_groups(model, optim.weight_decay), lr=optim.lr,
                                  betas=tuple(optim.betas), eps=optim.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, steps, optim.warmup_fraction, optim.min_lr_ratio))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled="bf16" in precision)
    start = 0.0
    for step in range(steps):
        if step == WARMUP:
            start = time.perf_counter()
        batch = {k: v.to(device) for k, v in batches[step % len(batches)].items()}
        with autocast:
            logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def lightning_loop(module: SinkLMModule, batches: list[dict[str, torch.Tensor]], steps: int,
                   accelerator: str, precision: str, extra_callbacks: list | None = None
                   ) -> tuple[float, L.Trainer]:
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, max_steps=steps, precision=precision,
        gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[timer, *(extra_callbacks or [])], log_every_n_steps=10,
    )
    loader = DataLoader(batches * (steps // len(batches) + 1), batch_size=None)
    trainer.fit(module, train_dataloaders=loader)
    return timer.elapsed, trainer


def random_batches(vocab: int, batch_size: int, seq_len: int, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-5m")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timing rounds")
    parser.add_argument("--gpu-preset", default="pythia-160m")
    parser.add_argument("--gpu-seq-len", type=int, default=2048)
    parser.add_argument("--gpu-batch-size", type=int, default=16)
    parser.add_argument("--gpu-backend", default="sdpa")
    parser.add_argument("--gpu-variants", default="vanilla",
                        help="comma-separated variants to measure on the GPU")
    parser.add_argument("--gpu-compile", action="store_true", help="torch.compile the network")
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU loop comparison")
    args = parser.parse_args()

    if not args.gpu_only:
        cpu_overhead(args)
    if not torch.cuda.is_available():
        print("\nno CUDA device: GPU throughput and MFU not measured")
        return
    print("\n| GPU | preset | variant | seq | micro-batch | precision | backend | compiled | "
          "tokens/s | MFU |\n|---|---|---|---|---:|---|---|---|---:|---:|")
    for variant in args.gpu_variants.split(","):
        gpu = make_module(args.gpu_preset, args.gpu_seq_len, args.gpu_backend, variant,
                          args.gpu_compile)
        gpu_batches = random_batches(gpu.config.vocab_size, args.gpu_batch_size,
                                     args.gpu_seq_len, 4)
        elapsed, trainer = lightning_loop(gpu, gpu_batches, args.steps, "gpu", "bf16-mixed",
                                          [Throughput()])
        tokens_per_s = (args.steps - WARMUP) * args.gpu_batch_size * args.gpu_seq_len / elapsed
        peak = Throughput._table_peak(trainer, gpu)
        flops = gpu.config.training_flops_per_token(args.gpu_seq_len)
        mfu = f"{tokens_per_s * flops / peak:.1%}" if peak else "n/a (GPU not in the table)"
        print(f"| {torch.cuda.get_device_name()} | {args.gpu_preset} | {variant} | "
              f"{args.gpu_seq_len} | {args.gpu_batch_size} | bf16-mixed | {args.gpu_backend} | "
              f"{args.gpu_compile} | {tokens_per_s:,.0f} | {mfu} |", flush=True)


def cpu_overhead(args: argparse.Namespace) -> None:
    """The Lightning loop against the bare loop on CPU-sized settings, alternating rounds."""
    vocab = make_module(args.preset, args.seq_len).config.vocab_size
    batches = random_batches(vocab, args.batch_size, args.seq_len, 8)
    timed_tokens = (args.steps - WARMUP) * args.batch_size * args.seq_len
    # Alternate the two loops so that load from other processes hits both alike.
    bare_times, lit_times = [], []
    for _ in range(args.rounds):
        bare_times.append(bare_loop(make_module(args.preset, args.seq_len), batches,
                                    args.steps, "32-true"))
        lit_times.append(lightning_loop(make_module(args.preset, args.seq_len), batches,
                                        args.steps, "cpu", "32-true")[0])
    bare, lit = statistics.median(bare_times), statistics.median(lit_times)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}\n")
    print("| loop | preset | batch x seq | tokens/s | Lightning overhead |")
    print("|---|---|---|---|---|")
    print(f"| bare PyTorch | {args.preset} | {args.batch_size} x {args.seq_len} | "
          f"{timed_tokens / bare:,.0f} | |")
    print(f"| Lightning (SinkLMModule) | {args.preset} | {args.batch_size} x {args.seq_len} | "
          f"{timed_tokens / lit:,.0f} | {lit / bare - 1:+.1%} |")


if __name__ == "__main__":
    main()
