"""Everything between raw text and the batches the trainer sees.

sources (Hub or local documents) -> tokenizer (with sink ids) -> packing (memmap token
shards + meta.json) -> windows (PackedDataset / MegatronRows, SinkCollator, a resumable
seeded order, build_loader).
"""

from .errors import DataError
from .megatron import MegatronRows, MMapIndexedDataset, write_mmap_indexed
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
from .windows import (
    IGNORE_INDEX,
    PackedDataset,
    ResumableLoader,
    ResumableSampler,
    SinkCollator,
    build_loader,
)

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
