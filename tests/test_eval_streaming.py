"""Streaming evaluators: the reference against an independent hand construction, and the fast
evaluator against the reference for every variant, sink count and cache, across the fill."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.sharp_models import VOCAB, sharp_model

from sinklm.data.sinks import SinkPrefix
from sinklm.eval.cache import CachePolicy, Dense, StartRecent, parse_cache
from sinklm.eval.fast import HEAD_ROWS, VocabHead, fast_losses
from sinklm.eval.reference import reference_losses
from sinklm.eval.scoring import StreamError
from sinklm.eval.start_recent import StartRecentCache
from sinklm.eval.streaming import evaluate
from sinklm.eval.texts import Stream
from sinklm.models import SOFTMAX_VARIANTS, CausalLM, ModelConfig
from sinklm.models.model import Attention


def stream(length: int, sinks: int, seed: int = 1) -> tuple[torch.Tensor, SinkPrefix]:
    """Random text tokens, and a prefix of sink ids (the top ids of the vocabulary)."""
    text = torch.randint(0, VOCAB - 2, (length,), generator=torch.Generator().manual_seed(seed))
    return text, SinkPrefix(range(VOCAB - 2, VOCAB - 2 + sinks))


def joined(text: torch.Tensor, prefix: SinkPrefix) -> torch.Tensor:
    """The stream as the model reads it, built by hand: sink ids, then the text."""
    return torch.cat([torch.tensor(prefix.ids, dtype=torch.long), text])


# --- the reference, built independently ---------------------------------------------------------


def kept_tokens(policy: CachePolicy, t: int) -> list[int]:
    """Stream indices in the cache when token t is the query, in cache order."""
    if isinstance(policy, Dense) or t <= policy.size:
        return list(range(t))
    return list(range(policy.start)) + list(range(t - policy.recent, t))


def rotate(x: torch.Tensor, position: int, config: ModelConfig) -> torch.Tensor:
    """GPT-NeoX rotate-half rotary of one token's heads [H, D], written out from the formula."""
    r = config.rotary_dims
    inv_freq = 1.0 / config.rotary_base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    angle = position * inv_freq
    cos, sin = torch.cos(angle).float(), torch.sin(angle).float()
    x1, x2 = x[:, : r // 2], x[:, r // 2 : r]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[:, r:]], dim=-1)


@torch.no_grad()
def hand_losses(model: CausalLM, ids: torch.Tensor, policy: CachePolicy, sinks: int) -> list[float]:
    """Token by token with plain Python lists: each token's keys and values are stored once per
    layer when it is the query; the query attends to the kept tokens at positions 0.. in cache
    order and to itself at the next position."""
    config, decoder = model.config, model.gpt_neox
    h_count, d = config.n_head, config.head_dim
    keys: list[list[torch.Tensor]] = [[] for _ in range(config.n_layer)]
    values: list[list[torch.Tensor]] = [[] for _ in range(config.n_layer)]
    losses = []
    for t in range(len(ids) - 1):
        kept = kept_tokens(policy, t)
        position = len(kept)
        h = decoder.embed_in.weight[ids[t]]
        for layer, block in enumerate(decoder.layers):
            attn = block.attention
            x = block.input_layernorm(h)
            q, k, v = attn.query_key_value(x).view(h_count, 3 * d).split(d, dim=-1)
            keys[layer].append(k)
            values[layer].append(v)
            seen_k = [rotate(keys[layer][i], p, config) for p, i in enumerate(kept)]
            seen_k.append(rotate(k, position, config))
            seen_v = torch.stack([values[layer][i] for i in kept] + [v], dim=1)  # [H, S, D]
            scores = (rotate(q, position, config)[:, None] * torch.stack(seen_k, 1)).sum(-1)
            scores = scores / math.sqrt(d)
            weights = torch.exp(scores)
            denominator = weights.sum(-1, keepdim=True)
            if config.attention.softmax == "softmax1":
                denominator = denominator + 1.0
            elif config.attention.softmax == "sink_logit":
                denominator = denominator + torch.exp(attn.sink_logit)[:, None]
            out = ((weights / denominator)[..., None] * seen_v).sum(1).reshape(-1)
            if config.attention.softmax == "gated":
                out = out * torch.sigmoid(attn.gate(x))
            h = h + attn.dense(out) + block.mlp(block.post_attention_layernorm(h))
        logits = model.embed_out(decoder.final_layer_norm(h))
        if t >= sinks:
            losses.append(float(torch.logsumexp(logits, -1) - logits[ids[t + 1]]))
    return losses


@pytest.mark.parametrize("softmax", SOFTMAX_VARIANTS)
@pytest.mark.parametrize("spec", ["0+6", "2+4", "3+0", "dense"])
def test_reference_matches_hand_construction(softmax: str, spec: str) -> None:
    sinks = 1
    model = sharp_model(softmax, sink_tokens=sinks)
    text, prefix = stream(16, sinks)
    policy = parse_cache(spec)
    got = reference_losses(model, text, policy, prefix)
    expected = torch.tensor(hand_losses(model, joined(text, prefix), policy, sinks))
    assert got.shape == (16 - 1,)
    assert (got - expected).abs().max().item() < 1e-4


def test_dense_reference_is_one_causal_forward() -> None:
    model = sharp_model("softmax")
    text, _ = stream(40, 0)
    with torch.no_grad():
        logits = model(text.unsqueeze(0))[0, :-1]
    expected = F.cross_entropy(logits, text[1:], reduction="none")
    assert (reference_losses(model, text, Dense()) - expected).abs().max().item() < 1e-5


def test_cache_semantics_matter() -> None:
    """The tolerance is meaningful: neighbouring caches give clearly different losses."""
    model = sharp_model("softmax")
    text, _ = stream(24, 0)
    base = reference_losses(model, text, StartRecent(2, 6))
    for other in (StartRecent(2, 7), StartRecent(1, 7), StartRecent(0, 8)):
        assert (reference_losses(model, text, other) - base).abs().max().item() > 1e-2


# --- fast == reference -------------------------------------------------------------------------

# 0+y, 1+(y-1), 4+(y-4) and dense with y = 8 on 24-token streams: the cache fills at token 8;
# chunks of 5 straddle that moment, chunks of 64 take the whole stream in one step.
CACHES = ["0+8", "1+7", "4+4", "dense", "2+0", "recompute:8", "recompute:8:3"]


@pytest.mark.parametrize("softmax", SOFTMAX_VARIANTS)
@pytest.mark.parametrize("sinks", [0, 1, 2])
def test_fast_equals_reference(softmax: str, sinks: int) -> None:
    model = sharp_model(softmax, sink_tokens=sinks)
    text, prefix = stream(24, sinks)
    for spec in CACHES:
        policy = parse_cache(spec)
        expected = reference_losses(model, text, policy, prefix)
        assert expected.shape == (24 - 1,)
        for chunk in (5, 64):
            got = fast_losses(model, text, policy, prefix, chunk_size=chunk)
            diff = (got - expected).abs().max().item()
            assert diff < 1e-4, f"{softmax} sinks={sinks} cache={spec} chunk={chunk}: {diff}"


@pytest.mark.parametrize("softmax", ["softmax1", "gated"])
def test_fast_equals_reference_with_query_blocks(softmax: str) -> None:
    """A cache of 4+196 splits each chunk into query blocks whose bands start mid-cache."""
    model = sharp_model(softmax, sink_tokens=1)
    text, prefix = stream(420, 1)
    policy = StartRecent(4, 196)
    expected = reference_losses(model, text, policy, prefix)
    got = fast_losses(model, text, policy, prefix, chunk_size=300)
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("softmax", ["softmax", "sink_logit"])
def test_fast_equals_reference_when_chunk_sizes_change(softmax: str) -> None:
    """Chunks of changing sizes through the state: the geometry of full-cache chunks is built
    once per size and reused, and must not leak from one size to another."""
    model = sharp_model(softmax, sink_tokens=1)
    text, prefix = stream(90, 1)
    policy = StartRecent(2, 9)
    expected = reference_losses(model, text, policy, prefix)
    cache = StartRecentCache.empty(model, policy)
    ids = joined(text, prefix)
    logits, a = [], 0
    with torch.no_grad():
        for size in [4, 3, 7, 7, 7, 5, 7, 7, 1, 1, 12, 20, 9]:  # the cache is full from 11 on
            logits.append(model(ids[None, a : a + size], cache=cache)[0])
            a += size
        assert a == len(ids) - 1
        got = F.cross_entropy(torch.cat(logits)[1:], ids[2:], reduction="none")
    assert (got - expected).abs().max().item() < 1e-4


def test_fast_path_takes_a_variant_from_the_model_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path gets a variant's sink term and output side from the model's Attention,
    not from a copy of the math: a made-up variant (a sink logit of 1.5 in every head, output
    halved before the projection), defined on Attention only, gives the reference's losses."""
    model = sharp_model("softmax", sink_tokens=1)
    text, prefix = stream(40, 1)
    policy = StartRecent(2, 9)
    vanilla = reference_losses(model, text, policy, prefix)
    sink = torch.full((model.config.n_head,), 1.5)
    output = Attention.output
    monkeypatch.setattr(Attention, "sink", lambda self: sink)
    monkeypatch.setattr(Attention, "output", lambda self, y, x: output(self, 0.5 * y, x))
    expected = reference_losses(model, text, policy, prefix)
    assert (expected - vanilla).abs().max().item() > 1e-2  # the variant changes the losses
    got = fast_losses(model, text, policy, prefix, chunk_size=7)
    assert (got - expected).abs().max().item() < 1e-4


def test_vocab_head_equals_cross_entropy_across_row_blocks() -> None:
    model = sharp_model("softmax")
    rows = 2 * HEAD_ROWS + 37
    hidden = torch.randn(rows, model.config.d_model, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, VOCAB, (rows,), generator=torch.Generator().manual_seed(1))
    out = torch.full((rows,), float("nan"))
    VocabHead(model, rows).losses(hidden, targets, out)
    with torch.no_grad():
        logits = model.embed_out(model.gpt_neox.final_layer_norm(hidden))
    expected = F.cross_entropy(logits, targets, reduction="none")
    assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("softmax", ["softmax1", "gated"])
def test_fast_equals_reference_in_float64(softmax: str) -> None:
    """Models in another dtype than the fp32 logits buffer take the head's copy path."""
    model = sharp_model(softmax, sink_tokens=1).double()
    text, prefix = stream(30, 1)
    for spec in ["0+8", "2+6"]:
        policy = parse_cache(spec)
        expected = reference_losses(model, text, policy, prefix)
        got = fast_losses(model, text, policy, prefix, chunk_size=7)
        assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("softmax", ["softmax", "sink_logit"])
def test_fast_runs_in_bfloat16(softmax: str) -> None:
    """bf16 takes the branches that accumulate in fp32 out of place. Both evaluators round
    bf16 in different orders, so they agree only to bf16 precision, not to 1e-4."""
    model = sharp_model(softmax, sink_tokens=1).to(torch.bfloat16)
    text, prefix = stream(30, 1)
    policy = StartRecent(2, 6)
    expected = reference_losses(model, text, policy, prefix)
    got = fast_losses(model, text, policy, prefix, chunk_size=7)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - expected).abs().max().item() < 0.1


def test_fast_memory_is_bounded_by_the_cache() -> None:
    model = sharp_model("softmax")
    policy = StartRecent(3, 10)
    cache = StartRecentCache.empty(model, policy)
    text, _ = stream(200, 0)
    held = []
    with torch.no_grad():
        for a in range(0, 200, 7):
            model.hidden_states(text[None, a : a + 7], cache=cache)
            held.append(len(cache))
    assert max(held) == policy.size
    assert all(n == policy.size for n in held[2:])
    assert all(layer.initial_k.shape[1] == 3 for layer in cache.layers)
    assert all(layer.recent_k.shape[1] == 10 for layer in cache.layers)


def resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_fast_memory_is_flat_in_the_stream_length() -> None:
    """Three times the stream, same resident memory: nothing per chunk outlives its chunk."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(vocab_size=2048, n_layer=1, n_head=2, d_model=32,
                                 max_seq_len=64)).eval()
    text = torch.randint(0, 2048, (60_000,), generator=torch.Generator().manual_seed(0))
    policy = StartRecent(4, 60)
    fast_losses(model, text[:20_000], policy)
    before = resident_mib()
    fast_losses(model, text, policy)
    assert resident_mib() - before < 40  # ~40 chunks x 8 MB of logits if they were pinned


def test_streams_shorter_than_the_cache_equal_dense_and_say_so() -> None:
    model = sharp_model("softmax")
    text, prefix = stream(12, 0)
    dense, window = evaluate(model, [Stream("s", text, prefix)], [Dense(), StartRecent(2, 30)])
    assert (dense.losses - window.losses).max() < 1e-5
    assert window.notes and "never fill" in window.notes[0]
    assert not dense.notes


def test_evaluate_concatenates_streams_and_scores_the_same_targets() -> None:
    model = sharp_model("sink_logit", sink_tokens=1)
    streams = [Stream(f"s{seed}", *stream(length, 1, seed=seed)) for length, seed in ((20, 2),
                                                                                      (9, 3))]
    fast, ref = (
        evaluate(model, streams, [StartRecent(1, 5)], reference=reference)[0]
        for reference in (False, True)
    )
    assert fast.tokens == ref.tokens == 19 + 8
    assert abs(fast.nll - ref.nll) < 1e-5
    assert fast.ppl == pytest.approx(math.exp(fast.nll))
    row = fast.to_json()
    assert (row["cache"], row["start"], row["recent"]) == ("1+5", 1, 5)
    assert {"ppl", "nll", "tokens_per_second"} <= set(row)


def test_bad_streams_are_refused() -> None:
    model = sharp_model("softmax")
    with pytest.raises(StreamError, match="outside the model's 97-row embedding"):
        fast_losses(model, torch.tensor([1, 2, 500]), Dense())
    with pytest.raises(StreamError, match="at least two text tokens"):
        reference_losses(model, torch.tensor([3]), Dense(), SinkPrefix([95]))
    with pytest.raises(StreamError, match="sink ids"):
        fast_losses(model, *stream(10, 2)[:1], parse_cache("recompute:2"), stream(10, 2)[1])


@pytest.mark.parametrize("spec", ["2+30", "0+16", "dense", "recompute:24", "recompute:24:5"])
def test_progress_counts_every_scored_token_once(spec: str) -> None:
    model = sharp_model("softmax", sink_tokens=1)
    text, prefix = stream(150, sinks=1)
    for losses in (fast_losses, reference_losses):
        told: list[int] = []
        kwargs = {"chunk_size": 32} if losses is fast_losses else {}
        losses(model, text, parse_cache(spec), prefix, progress=told.append, **kwargs)
        assert sum(told) == len(text) - 1 and min(told) >= 0, losses.__name__


def test_stream_sequential_residual_fast_equals_reference() -> None:
    """GPT-2's block (the sink lab's model) through the fast path's shared block residual."""
    torch.manual_seed(3)
    config = ModelConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=64,
                         use_parallel_residual=False)
    model = CausalLM(config).eval()
    text, prefix = torch.randint(0, 63, (200,)), SinkPrefix([63])
    for spec in ("1+31", "0+16", "dense"):
        policy = parse_cache(spec)
        fast = fast_losses(model, text, policy, prefix, chunk_size=48)
        assert (fast - reference_losses(model, text, policy, prefix)).abs().max().item() < 1e-4
