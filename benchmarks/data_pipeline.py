"""Data pipeline throughput: packing against plain tokenizers, loading against training.

    python benchmarks/data_pipeline.py [--source FILE] [--tokenizer tokenizer.json] [--repeats 3]

1. Tokenize+pack: ``prepare_data`` end to end (read through datasets, check, tokenize, write
   shards and meta.json) against ``Tokenizer.encode_batch`` alone on the same documents, in
   alternating rounds so machine drift hits both alike. Goal: >= 0.8 of encode_batch.
2. Loading: windows/s from the packed shards through ``build_loader`` (sink collator, one
   process), against the tokens/s a pythia-14m training step consumes on this CPU (fp32
   forward + loss + backward + AdamW step on the same batches). Goal: >= 100x.

Defaults use ../shared/data (the 2.3M-token corpus and the Pythia tokenizer). Prints a
Markdown table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sinklm.data import (
    PackedDataset,
    PrepareConfig,
    Source,
    SourceSpec,
    build_loader,
    load_tokenizer,
    prepare_data,
    sink_token_ids,
)
from sinklm.models import CausalLM, ModelConfig

SHARED = Path(os.environ.get("SINKLM_SHARED_DATA",
                             Path(__file__).resolve().parents[2] / "shared" / "data"))


def bench_packing(source: str, tokenizer_path: str, repeats: int, root: Path) -> dict[str, float]:
    """Median seconds of encode_batch(_fast) and of prepare_data on the same documents."""
    spec = SourceSpec(source, cache_dir=str(root / "hf-cache"))
    texts = [t for batch in Source(spec).iter_texts() for t in batch]
    tokenizer = load_tokenizer(tokenizer_path)
    text_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts))  # also a warm-up
    prepare_data(PrepareConfig(source=spec, output=str(root / "warm"), tokenizer=tokenizer_path),
                 log=None)  # warms the datasets cache, as any second run finds it
    encode, fast, pack = [], [], []
    for round_ in range(repeats):
        start = time.perf_counter()
        tokenizer.encode_batch(texts)
        encode.append(time.perf_counter() - start)
        start = time.perf_counter()
        tokenizer.encode_batch_fast(texts)  # no offsets: what prepare_data calls
        fast.append(time.perf_counter() - start)
        config = PrepareConfig(source=spec, output=str(root / f"packed-{round_}"),
                               tokenizer=tokenizer_path)
        start = time.perf_counter()
        meta = prepare_data(config, log=None)
        pack.append(time.perf_counter() - start)
    start = time.perf_counter()
    prepare_data(config, log=None)
    reuse = time.perf_counter() - start
    assert meta["splits"]["train"]["tokens"] == text_tokens + meta["splits"]["train"]["documents"]
    return {"documents": len(texts), "text_tokens": text_tokens,
            "encode_s": statistics.median(encode), "fast_s": statistics.median(fast),
            "pack_s": statistics.median(pack),
            "reuse_s": reuse, "packed": str(root / "packed-0")}


def bench_loader(packed: str, tokenizer_path: str, seq_len: int, batch_size: int) -> float:
    """Tokens/s of one epoch through build_loader (one sink token, shuffled, one process)."""
    tokenizer = load_tokenizer(tokenizer_path)
    sinks = sink_token_ids(tokenizer, 1, ModelConfig.from_preset("pythia-14m").vocab_size)
    loader = build_loader(PackedDataset(packed, "train", seq_len, 1), batch_size, sinks, seed=0)
    start = time.perf_counter()
    tokens = sum(batch["input_ids"].numel() for batch in loader)
    return tokens / (time.perf_counter() - start)


def bench_training(packed: str, tokenizer_path: str, seq_len: int, batch_size: int,
                   steps: int) -> float:
    """Tokens/s that pythia-14m (sink_token variant, fp32) trains at on real batches."""
    tokenizer = load_tokenizer(tokenizer_path)
    config = ModelConfig.from_preset("pythia-14m", variant="sink_token")
    sinks = sink_token_ids(tokenizer, 1, config.vocab_size)
    loader = build_loader(PackedDataset(packed, "train", seq_len, 1), batch_size, sinks, seed=0)
    model = CausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = iter(loader)

    def step() -> None:
        batch = next(batches)
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), batch["labels"].view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps * batch_size * seq_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(SHARED / "corpus" / "english_pd_mix.jsonl.gz"))
    parser.add_argument("--tokenizer",
                        default=str(SHARED / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--train-steps", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        packing = bench_packing(args.source, args.tokenizer, args.repeats, Path(tmp))
        loader = bench_loader(packing["packed"], args.tokenizer, args.seq_len, args.batch_size)
        train = bench_training(packing["packed"], args.tokenizer, args.seq_len,
                               args.batch_size, args.train_steps)
    encode = packing["text_tokens"] / packing["encode_s"]
    fast = packing["text_tokens"] / packing["fast_s"]
    pack = packing["text_tokens"] / packing["pack_s"]
    shape = f"{args.batch_size}x{args.seq_len}"
    rows = [
        ("tokenizers encode_batch (alone)", f"{encode:,.0f}", "", ""),
        ("tokenizers encode_batch_fast (alone)", f"{fast:,.0f}", "", ""),
        ("prepare-data (read, tokenize, pack)", f"{pack:,.0f}",
         f"{pack / encode:.2f}x / {pack / fast:.2f}x", ">= 0.8x encode_batch"),
        (f"loader, 1 sink, {shape}", f"{loader:,.0f}", "", ""),
        (f"pythia-14m train step fp32, {shape}", f"{train:,.0f}", f"{loader / train:,.0f}x",
         ">= 100x (loader / train)"),
    ]
    print(f"{packing['documents']} documents, {packing['text_tokens']:,} tokens; "
          f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"median of {args.repeats}; rerun with the same inputs: {packing['reuse_s']:.2f}s")
    print("| measure | tokens/s | ratio | goal |\n|---|---:|---:|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(json.dumps({"encode_tokens_per_s": encode, "encode_fast_tokens_per_s": fast,
                      "pack_tokens_per_s": pack, "pack_over_encode": pack / encode,
                      "pack_over_encode_fast": pack / fast, "loader_tokens_per_s": loader,
                      "train_tokens_per_s": train, "loader_over_train": loader / train,
                      "reuse_s": packing["reuse_s"]}))


if __name__ == "__main__":
    main()
