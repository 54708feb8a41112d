"""Everything between raw text and the batches the trainer sees.

sources (Hub or local documents) -> tokenizer (with sink ids) -> packing (memmap token
shards + meta.json) -> windows (PackedDataset / MegatronRows, SinkCollator, a resumable
seeded order, build_loader).

The torch-based parts (windows, megatron) load on first use (PEP 562): the argument parser of
every ``sinklm`` command imports this package and must not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import DataError
from .lazy import lazy_exports
from .packing import PrepareConfig, packed_tokenizer, prepare_data, read_meta
from .sources import Source, SourceSpec, reflow
from .tokenizer import (
    DEFAULT_TOKENIZER,
    eod_token_id,
    load_tokenizer,
    save_tokenizer,
    sink_token_ids,
    sink_token_names,
    tokenizer_hash,
    train_tokenizer,
)

if TYPE_CHECKING:
    from .megatron import MegatronRows, MMapIndexedDataset, write_mmap_indexed
    from .windows import (
        IGNORE_INDEX,
        PackedDataset,
        ResumableLoader,
        ResumableSampler,
        SinkCollator,
        build_loader,
    )

__getattr__ = lazy_exports(__name__, {
    "MegatronRows": ".megatron",
    "MMapIndexedDataset": ".megatron",
    "write_mmap_indexed": ".megatron",
    "IGNORE_INDEX": ".windows",
    "PackedDataset": ".windows",
    "ResumableLoader": ".windows",
    "ResumableSampler": ".windows",
    "SinkCollator": ".windows",
    "build_loader": ".windows",
})

__all__ = [
    "DEFAULT_TOKENIZER",
    "IGNORE_INDEX",
    "DataError",
    "MMapIndexedDataset",
    "MegatronRows",
    "PackedDataset",
    "PrepareConfig",
    "ResumableLoader",
    "ResumableSampler",
    "SinkCollator",
    "Source",
    "SourceSpec",
    "build_loader",
    "eod_token_id",
    "load_tokenizer",
    "packed_tokenizer",
    "prepare_data",
    "read_meta",
    "reflow",
    "save_tokenizer",
    "sink_token_ids",
    "sink_token_names",
    "tokenizer_hash",
    "train_tokenizer",
    "write_mmap_indexed",
]
