"""Streaming generation: a model writes past its trained context with a start+recent cache.

A :class:`Session` is one endless stream through a model. It holds the same cache as streaming
evaluation (:class:`StartRecentCache` for ``x+y``: the first x and the y most recent tokens,
keys before rotary, positions re-assigned; a ``KVCache`` at true positions for ``dense``) and
runs the model's one forward step, ``CausalLM.hidden_states``. Fed ids go through in chunks of
any size (a prompt longer than the cache is streamed, never truncated) and drawn tokens one at
a time, with the log-probabilities the token-by-token reference evaluator gives the same stream
(tested). The session holds no text: :class:`Detokenizer` turns drawn ids into text as soon as
it is whole, and :func:`answer` runs one turn until a stop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from tokenizers import Tokenizer
from torch import Tensor

from sinklm.cli.main import UserError
from sinklm.models import CausalLM, KVCache
from sinklm.models.config import check_embeddable

from .cache import Dense, StartRecent, check_learned_positions
from .start_recent import StartRecentCache

# Ids per forward when feeding a prompt: long chunks amortise the per-call overhead and the
# start+recent cache takes any chunk exactly; this bounds the activations of one call.
FEED_CHUNK = 2048


class GenerateError(UserError, ValueError):
    """Generation settings that cannot work; the message names the flag and what is allowed."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: the argmax when ``temperature`` is 0 (greedy), else from
    softmax(logits / temperature) over the ``top_k`` most likely tokens and the smallest set
    whose probability reaches ``top_p``, with a generator seeded by ``seed``."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise GenerateError(f"--temperature {self.temperature}: must be >= 0 (0 is greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise GenerateError(f"--top-k {self.top_k}: must be at least 1")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise GenerateError(f"--top-p {self.top_p}: must lie in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_json(self) -> dict[str, object]:
        return {"greedy": self.greedy, **asdict(self)}

    def draw(self, logits: Tensor, generator: torch.Generator) -> int:
        """One token id from fp32 ``logits`` [vocab]."""
        if self.greedy:
            return int(logits.argmax())
        scores = logits / self.temperature
        if self.top_k is not None and self.top_k < len(scores):
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            before = torch.softmax(ordered, dim=-1).cumsum(-1) - torch.softmax(ordered, dim=-1)
            ordered = ordered.masked_fill(before >= self.top_p, float("-inf"))  # keeps the top 1
            scores = torch.full_like(scores, float("-inf")).scatter(0, order, ordered)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))


class Session:
    """One stream through ``model`` under ``policy``: :meth:`feed` ids, :meth:`draw` tokens.

    A drawn token is fed before whatever comes next (the next draw or the next :meth:`feed`),
    so the stream is every fed and drawn id in order, as the reference evaluator would read it.
    A model with learned positions is refused an ``x+y`` cache whose queries would reach past
    its position table (once the stream fills it), and ``dense`` ids past the table.
    """

    def __init__(self, model: CausalLM, policy: StartRecent | Dense, sampling: Sampling) -> None:
        config = model.config
        if config.learned_positions and isinstance(policy, StartRecent):
            # A stream long enough to fill the cache, as an endless one does: queries at x+y.
            check_learned_positions([policy], policy.size + 2, config.max_seq_len)
        self.model = model
        self.policy = policy
        self.sampling = sampling
        device = next(model.parameters()).device
        self.cache: StartRecentCache | KVCache = (
            StartRecentCache.empty(model, policy) if isinstance(policy, StartRecent)
            else KVCache(model.config.n_layer)
        )
        self.generator = torch.Generator(device=device).manual_seed(sampling.seed)
        self.device = device
        self.tokens = 0  # ids through the model so far
        self.most_held = 0  # the most cache entries (per layer) held after any forward
        self.pending: int | None = None  # drawn, not yet fed
        self.logits: Tensor | None = None  # fp32 [vocab]: what the last fed id predicts

    @property
    def max_position(self) -> int:
        """The largest position a query has reached (StartRecent re-assigns positions)."""
        if isinstance(self.policy, StartRecent):
            return min(self.tokens - 1, self.policy.size)
        return self.tokens - 1

    @torch.inference_mode()
    def feed(self, ids: Sequence[int]) -> None:
        """Run ``ids`` (after the token drawn last, if any) through the model."""
        stream = ([] if self.pending is None else [self.pending]) + list(ids)
        if not stream:
            raise GenerateError("nothing to feed: an empty prompt needs a model with sink ids")
        if isinstance(self.policy, Dense):
            limit = self.model.config.max_seq_len - 1
            check_embeddable(self.model.config, self.tokens + len(stream) - 1, "cache dense: ids",
                             f"generate with an x+y cache of at most {limit} tokens (x+y <= "
                             f"{limit}), as the default cache is")
        self.pending = None
        tensor = torch.tensor(stream, dtype=torch.long, device=self.device)
        for a in range(0, len(stream), FEED_CHUNK):
            hidden = self.model.hidden_states(tensor[None, a : a + FEED_CHUNK], cache=self.cache)
            self.most_held = max(self.most_held, len(self.cache))
        self.tokens += len(stream)
        self.logits = self.model.logits(hidden[0, -1:])[0].float()

    @torch.inference_mode()
    def draw(self) -> tuple[int, float]:
        """The next token (fed before anything else), and its log-probability under the model
        (before temperature and filtering: what the reference evaluator scores)."""
        if self.pending is not None:
            self.feed(())
        if self.logits is None:
            raise GenerateError("nothing fed yet: feed a prompt (or the sink ids) first")
        token = self.sampling.draw(self.logits, self.generator)
        logprob = float(torch.log_softmax(self.logits, dim=-1)[token])
        self.pending = token
        return token, logprob


class Detokenizer:
    """The text of a growing list of ids, given out as soon as it is whole.

    A byte-level BPE token may end inside a multi-byte character; decoding it alone gives a
    replacement character. Text is held back until the character is complete, and only a
    window of recent ids is decoded per token, so the cost stays flat in the stream length.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # ids before this are given out and need no decoding
        self.given = 0  # ids start..given are given out

    def _text(self, stop: int) -> str:
        return self.tokenizer.decode(self.ids[self.start : stop], skip_special_tokens=True)

    def add(self, token: int) -> str:
        """The new text once ``token`` joins the ids ('' while a character is incomplete)."""
        self.ids.append(token)
        before, text = self._text(self.given), self._text(len(self.ids))
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.start, self.given = self.given, len(self.ids)
        return text[len(before) :]

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end)."""
        before, text = self._text(self.given), self._text(len(self.ids))
        self.start = self.given = len(self.ids)
        return text[len(before) :]


@dataclass
class Turn:
    """One answer: the ids fed before it, the ids drawn, their log-probabilities and text."""

    prompt_ids: list[int]
    generated_ids: list[int]
    logprobs: list[float]
    text: str
    stop: str  # "max_new_tokens", "end_of_document" or "stop_string"

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def answer(
    session: Session,
    prompt_ids: Sequence[int],
    detokenizer: Detokenizer,
    max_new_tokens: int,
    stops: Sequence[str] = (),
    end_id: int | None = None,
    on_text: Callable[[str], object] | None = None,
) -> Turn:
    """Feed ``prompt_ids``, then draw until ``end_id``, a stop string or ``max_new_tokens``.

    ``on_text`` receives the text as it becomes whole. The drawn ids stay in the stream (the
    last one is fed with whatever comes next), so a conversation's cache carries over.
    """
    if max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    session.feed(prompt_ids)
    ids: list[int] = []
    logprobs: list[float] = []
    pieces: list[str] = []
    window = ""  # the text a stop string can still end in: the new piece and what precedes it
    keep = max((len(s) for s in stops), default=1) - 1
    stop = "max_new_tokens"
    for _ in range(max_new_tokens):
        token, logprob = session.draw()
        ids.append(token)
        logprobs.append(logprob)
        if token == end_id:
            stop = "end_of_document"
            break
        piece = detokenizer.add(token)
        if piece:
            pieces.append(piece)
            if on_text is not None:
                on_text(piece)
            window += piece
            if any(s in window for s in stops):
                stop = "stop_string"
                break
            window = window[-keep:] if keep else ""
    rest = detokenizer.flush()
    if rest:
        pieces.append(rest)
        if on_text is not None:
            on_text(rest)
    return Turn(list(prompt_ids), ids, logprobs, "".join(pieces), stop)
