"""The one helper that puts a model's sink ids in front of a sequence.

Training (the collator), evaluation (streams, sink-diagnostic windows, recompute windows,
zero-shot requests) and the exported tokenizer's template all go through ``SinkPrefix``, so
what the model sees at evaluation is what it saw in training by construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import overload

import torch
from tokenizers import Tokenizer, processors
from torch import Tensor

from .errors import DataError


@dataclass(frozen=True)
class SinkPrefix:
    """The sink ids (``sink_token_ids`` of the tokenizer) that lead every sequence."""

    ids: tuple[int, ...]

    def __init__(self, ids: Iterable[int]) -> None:
        object.__setattr__(self, "ids", tuple(int(i) for i in ids))

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def prepend(self, tokens: Tensor) -> Tensor: ...

    @overload
    def prepend(self, tokens: Sequence[int]) -> list[int]: ...

    def prepend(self, tokens: Tensor | Sequence[int]) -> Tensor | list[int]:
        """The sink ids, then ``tokens``: a list, a 1-D tensor, or each row of a [B, T] batch."""
        if not isinstance(tokens, Tensor):
            return [*self.ids, *tokens]
        sinks = torch.tensor(self.ids, dtype=torch.long, device=tokens.device)
        return torch.cat([sinks.expand(*tokens.shape[:-1], len(self)), tokens], dim=-1)

    def is_sink(self, tokens: Tensor) -> Tensor:
        """Where ``tokens`` holds a sink id: such a target is never scored or trained on."""
        return torch.isin(tokens, torch.tensor(self.ids, dtype=torch.long, device=tokens.device))

    def names(self, tokenizer: Tokenizer) -> list[str]:
        """The sink ids' tokens in ``tokenizer`` (``<|sink|>``, ...)."""
        names = [tokenizer.id_to_token(sink_id) for sink_id in self.ids]
        for sink_id, name in zip(self.ids, names, strict=True):
            if name is None:
                raise DataError(f"sink id {sink_id} is not in the tokenizer's vocabulary")
        return [str(name) for name in names]

    def template(self, tokenizer: Tokenizer) -> processors.TemplateProcessing:
        """A post-processor that does ``prepend`` on every text ``tokenizer`` encodes.

        ``transformers`` users of an exported tokenizer then get the sink ids as training did.
        """
        names = self.names(tokenizer)
        return processors.TemplateProcessing(
            single=" ".join([*names, "$A:0"]),
            pair=" ".join([*names, "$A:0", "$B:1"]),
            special_tokens=list(zip(names, self.ids, strict=True)),
        )
