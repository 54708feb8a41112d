"""Option values and hints the evaluation commands share, importable without torch.

Argument parsers are built for every ``sinklm`` call, ``--help`` included; they import this,
not the torch-based modules, so help and argument errors answer at once.
"""

from __future__ import annotations

# Weight precisions a checkpoint can be loaded in (``models.load.DTYPES`` maps them to torch).
DTYPE_NAMES = ("bfloat16", "float16", "float32")
DEVICE_HELP = "torch device (default: cuda when available, else cpu)"
# What every --checkpoint takes (models/load.py reads each kind).
CHECKPOINT_HELP = ("a `sinklm fit` checkpoint (.ckpt), an exported or transformers GPTNeoX folder "
                   "(with tokenizer.json), or a Hub id such as EleutherAI/pythia-160m")
# What to do when lm-eval's datasets cannot reach the Hub (zeroshot, compare).
OFFLINE_HINT = "the Hub datasets need the network; --data-dir FOLDER reads local files instead"


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu`` (imports torch: call it when running)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
