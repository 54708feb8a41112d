"""Tiny exportable checkpoints and a transformers-only process, for the export tests.

The tokenizer is a tiny BPE trained here (no shared data needed), so sink ids are small.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from tokenizers import Tokenizer

from sinklm.data.tokenizer import sink_token_ids, train_tokenizer
from sinklm.models import CausalLM, ModelConfig
from sinklm.models.load import Checkpoint

TEXT = "The quick brown fox jumps over the lazy dog. A sink token sits in front of every text."
VOCAB = 320  # embedding rows; the trained tokenizer uses fewer, leaving room for sinks

# Prepended to a script run by `run_without_sinklm`: importing sinklm fails there.
NO_SINKLM = """
import importlib.abc, sys

class NoSinkLM(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "sinklm":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoSinkLM())
"""


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    """A BPE of 290 ids trained on a few sentences (cached: callers copy it)."""
    corpus = [TEXT, "the lazy dog sleeps", "foxes jump and dogs sleep", "tokens in front"] * 20
    return train_tokenizer(corpus, vocab_size=290, min_frequency=1)


def make_checkpoint(tokenizer: Tokenizer, softmax: str, sinks: int, seed: int = 0) -> Checkpoint:
    """A small random model whose every weight (sink logits and gates too) is non-trivial."""
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=VOCAB, n_layer=2, n_head=4, d_model=64, max_seq_len=64,
        attention={"softmax": softmax}, sink_tokens=sinks,
    )
    model = CausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    ids = sink_token_ids(tokenizer, sinks, VOCAB)
    return Checkpoint(model, tokenizer, ids, f"tiny-{softmax}-{sinks}", "memory")


def load_export(folder: Path, remote: bool) -> tuple[torch.nn.Module, object]:
    """The exported model (fp32, eval) and tokenizer, loaded by transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=remote, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=remote)
    return model, tokenizer


def run_without_sinklm(script: str, tmp_path: Path) -> str:
    """What ``script`` prints, run in a fresh process as a transformers user runs it: sinklm
    not importable, HF_HUB_OFFLINE=1 and an empty module cache. Fails the test on an error."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    done = subprocess.run(
        [sys.executable, "-c", NO_SINKLM + textwrap.dedent(script)], env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
