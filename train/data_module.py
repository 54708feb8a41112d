"""The LightningDataModule: packed shards (or Pythia's Megatron rows) -> resumable loaders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from sinklm.data import (
    MegatronRows,
    PackedDataset,
    ResumableLoader,
    ResumableSampler,
    SinkCollator,
    build_loader,
    load_tokenizer,
    packed_tokenizer,
    read_meta,
    sink_token_ids,
    tokenizer_hash,
)
from sinklm.data.errors import DataError
from sinklm.data.tokenizer import DEFAULT_TOKENIZER
from sinklm.data.windows import check_windows
from sinklm.models.checkpoint import write_data_entries


class SinkLMDataModule(L.LightningDataModule):
    """Training and validation batches {"input_ids", "labels"} of ``seq_len`` tokens.

    Args:
        path: a folder written by ``sinklm prepare-data`` (meta.json + shards).
        megatron_path: instead of ``path``, the prefix of Pythia's pre-tokenized, pre-shuffled
            Megatron files (``PREFIX.bin``/``PREFIX.idx``), read in order so step s trains on
            the rows Pythia trained on at step s.
        tokenizer: tokenizer.json (or Hub id) for the sink ids; default: the one the data was
            packed with (and for Megatron data, GPT-NeoX's).
        seq_len: sequence length, sink ids included.
        sink_tokens: sink ids in front of every sequence (linked from the model's variant).
        vocab_size: the model's embedding rows, where sink ids must fit (linked from the model).
        micro_batch_size: sequences per device per step.
        global_batch_size: when set, checked to equal micro x devices x nodes x accumulation.
        seed: the order's seed (the permutation is fixed by seed and epoch).
        num_workers: loader worker processes per rank.
        windows: where training and validation windows start. ``stream`` (default): a fixed
            grid over the packed stream, window i holding tokens [i*T, i*T + T + 1) with
            T = seq_len - sink_tokens, so most start mid-document. ``documents``: a window at
            every document start, beginning with the end-of-document id that closed the
            previous document (after the sink ids, if any), then every T tokens within that
            document (the last may run into the next one), as packed pretraining with
            document separators does; evaluate such a model with ``--eod-first``. Needs
            ``path`` (Pythia's Megatron rows are fixed); a checkpoint resumes only with the
            value it was trained with.
    """

    def __init__(
        self,
        path: str | None = None,
        megatron_path: str | None = None,
        tokenizer: str | None = None,
        seq_len: int = 2048,
        sink_tokens: int = 0,
        vocab_size: int | None = None,
        micro_batch_size: int = 8,
        global_batch_size: int | None = None,
        seed: int = 1234,
        num_workers: int = 2,
        windows: str = "stream",
    ) -> None:
        super().__init__()
        # Recorded in every checkpoint (datamodule_hyper_parameters), so evaluation can tell
        # how the model was trained; not logged, since data.sink_tokens (linked) would clash
        # with model.sink_tokens (as given) in the merged hyperparameters.
        self.save_hyperparameters(logger=False)
        if (path is None) == (megatron_path is None):
            raise DataError("set exactly one of data.path (a prepare-data folder) and "
                            "data.megatron_path (Pythia's .bin/.idx prefix)")
        check_windows(windows, "data.windows")
        if windows == "documents" and megatron_path is not None:
            raise DataError(
                "data.windows=documents needs data.path: Pythia's Megatron rows are fixed, "
                "pre-shuffled sequences that cannot be re-cut at documents; use data.windows: "
                "stream (the default) with data.megatron_path"
            )
        if path is not None:
            self.meta = read_meta(path)  # fails now, before any compute, if the folder is bad
            if windows == "documents" and self.meta.get("eod_id") is None:
                raise DataError(
                    f"data.windows=documents: {path}/meta.json records no eod_id, so its "
                    "documents cannot be found; re-pack it with `sinklm prepare-data ... "
                    "--overwrite`, or use data.windows: stream"
                )
        elif not Path(f"{megatron_path}.idx").is_file():
            raise DataError(f"data.megatron_path={megatron_path}: no {megatron_path}.idx")
        if micro_batch_size < 1:
            raise DataError(f"data.micro_batch_size={micro_batch_size}: must be >= 1")
        self.path, self.megatron_path = path, megatron_path
        self.tokenizer_spec = tokenizer
        self.seq_len, self.sink_tokens, self.vocab_size = seq_len, sink_tokens, vocab_size
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.seed, self.num_workers = seed, num_workers
        self.windows = windows
        self._datasets: dict[str, PackedDataset] = {}  # documents' starts are found once
        self.sink_ids: list[int] | None = None
        self.tokenizer: Tokenizer | None = None  # set with the sink ids by check_vocabulary

    def load_tokenizer(self) -> Tokenizer:
        if self.tokenizer_spec is not None:
            return load_tokenizer(self.tokenizer_spec)
        if self.path is not None:
            return packed_tokenizer(self.path)
        return load_tokenizer(DEFAULT_TOKENIZER)

    def check_vocabulary(self, vocab_size: int) -> list[int]:
        """Sink ids inside ``vocab_size`` rows, and a packed tokenizer that matches the data."""
        tokenizer = self.load_tokenizer()
        if self.path is not None and tokenizer_hash(tokenizer) != self.meta["tokenizer_hash"]:
            raise DataError(
                f"data.tokenizer={self.tokenizer_spec} is not the tokenizer {self.path} was "
                f"packed with ({self.meta['tokenizer']}); drop data.tokenizer or re-pack"
            )
        used = tokenizer.get_vocab_size(with_added_tokens=True)
        if used > vocab_size:
            raise DataError(
                f"the tokenizer has {used} ids but the model has vocab_size={vocab_size} "
                "embedding rows; set model.model_overrides.vocab_size (a multiple of 128) to "
                "fit it"
            )
        self.sink_ids = sink_token_ids(tokenizer, self.sink_tokens, vocab_size)
        self.tokenizer = tokenizer  # now holding the sink tokens
        self.vocab_size = vocab_size
        return self.sink_ids

    def identity(self) -> dict[str, str | None]:
        """What a checkpoint records of its data, so a resume on other data is refused: the
        tokenizer's hash, the source fingerprint from meta.json (Pythia's Megatron files
        carry none) and where windows start (``windows``)."""
        if self.path is not None:
            return {"tokenizer_hash": self.meta["tokenizer_hash"],
                    "source_fingerprint": self.meta["source_fingerprint"],
                    "windows": self.windows}
        return {"tokenizer_hash": tokenizer_hash(self.tokenizer or self.load_tokenizer()),
                "source_fingerprint": None, "windows": self.windows}

    @staticmethod
    def recorded_identity(saved: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's recorded identity with what older checkpoints leave out filled in:
        before ``windows`` was recorded, every run used the stream grid."""
        return {"windows": "stream", **saved}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the tokenizer (with its sink tokens) and the sink ids, which evaluation loads,
        and the data's identity, which a resume checks. Lightning calls this hook of the
        training module only, which passes the checkpoint on to this one."""
        if self.tokenizer is not None:
            write_data_entries(checkpoint, self.tokenizer, self.sink_ids or [], self.identity())

    def _dataset(self, split: str) -> PackedDataset | MegatronRows:
        if self.megatron_path is not None:
            return MegatronRows(self.megatron_path, self.seq_len, self.sink_tokens)
        if split not in self._datasets:
            self._datasets[split] = PackedDataset(
                self.path, split, self.seq_len, self.sink_tokens,
                tokenizer_hash=self.meta["tokenizer_hash"], windows=self.windows,
            )
        return self._datasets[split]

    def _sinks(self) -> list[int]:
        if self.sink_ids is None:
            if self.vocab_size is None:
                raise DataError("data.vocab_size is unknown: call check_vocabulary(vocab_size) "
                                "or set data.vocab_size to the model's embedding rows")
            self.check_vocabulary(self.vocab_size)
        assert self.sink_ids is not None
        return self.sink_ids

    def _has_validation(self) -> bool:
        return self.path is not None and self.meta["splits"].get("validation", {}).get(
            "tokens", 0
        ) > self.seq_len

    def train_dataloader(self) -> ResumableLoader:
        # Megatron rows are Pythia's pre-shuffled order: read them in sequence.
        return build_loader(
            self._dataset("train"), self.micro_batch_size, self._sinks(), seed=self.seed,
            shuffle=self.megatron_path is None, num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )

    def val_dataloader(self) -> DataLoader | list:
        """The validation split in order, from its first window at every pass, so each check
        scores the same windows (the first ``trainer.limit_val_batches`` batches, or all).

        A plain DataLoader: the ResumableLoader of training counts the batches it hands out,
        so each check would resume where the last one stopped.
        """
        if not self._has_validation():
            return []
        dataset = self._dataset("validation")
        return DataLoader(
            dataset, batch_size=self.micro_batch_size,
            sampler=ResumableSampler(len(dataset), self.seed, shuffle=False),
            collate_fn=SinkCollator(self._sinks(), self.seq_len), drop_last=False,
        )

    def probe_dataloader(self) -> ResumableLoader:
        """A fixed batch source for attention diagnostics: validation data, in order."""
        split = "validation" if self._has_validation() else "train"
        return build_loader(
            self._dataset(split), self.micro_batch_size, self._sinks(), seed=self.seed,
            shuffle=False, drop_last=False, rank=0, world_size=1,
        )
