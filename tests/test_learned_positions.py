"""``learned_positions``: GPT-2/OPT-style absolute position rows added to the token embedding (a
research option, on top of rotary). Every number is checked against an independent reference:
a rotary-only model (the default path, untouched) fed "pseudo-tokens" whose embedding rows are
token row + position row, built by hand; streaming's fast path against the token-by-token
reference; positions past the table refused before any compute; exports through transformers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sinklm.data.sinks import SinkPrefix
from sinklm.eval.cache import (
    CachePositionError,
    Dense,
    Recompute,
    StartRecent,
    check_policies,
)
from sinklm.eval.fast import fast_losses
from sinklm.eval.generate import Sampling, Session
from sinklm.eval.reference import reference_logits, reference_losses
from sinklm.eval.streaming import evaluate
from sinklm.eval.texts import Stream
from sinklm.models import CausalLM, ConfigError, KVCache, ModelConfig
from sinklm.models.config import PositionError, variant_name
from sinklm.models.convert import (
    config_from_hf,
    export_block,
    needs_remote_code,
    to_hf_model,
    to_hf_state_dict,
)

VOCAB, CONTEXT = 61, 48


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models: one intra-op thread is many times faster than contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def learned_model(n_layer: int = 2, softmax: str = "softmax", seed: int = 0,
                  sink_tokens: int = 0, parallel: bool = True) -> CausalLM:
    """A small model whose attention is sharp and whose position rows are large, so that a
    token embedded at a wrong position changes losses by far more than the tolerances."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=2, d_model=32,
                         max_seq_len=CONTEXT, attention={"softmax": softmax},
                         sink_tokens=sink_tokens, use_parallel_residual=parallel,
                         learned_positions=True)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("query_key_value.weight"):
                param.mul_(4.0)
            elif name.endswith("bias") or name.endswith("sink_logit"):
                param.normal_(0.0, 0.1)
        model.gpt_neox.embed_positions.weight.normal_(0.0, 1.0)
    return model


def rotary_only_twin(model: CausalLM, rows: torch.Tensor) -> CausalLM:
    """A model without learned positions with ``model``'s blocks and final norm, whose
    embedding rows are ``rows`` [R, d]: feeding it ids 0..R-1 feeds hand-built embeddings."""
    config = model.config.replace(learned_positions=False, vocab_size=len(rows))
    twin = CausalLM(config).eval()
    state = {k: v for k, v in model.state_dict().items()
             if k.startswith("gpt_neox.") and "embed_" not in k}
    missing, unexpected = twin.load_state_dict(state, strict=False)
    assert sorted(missing) == ["embed_out.weight", "gpt_neox.embed_in.weight"] and not unexpected
    with torch.no_grad():
        twin.gpt_neox.embed_in.weight.copy_(rows)
    return twin


def hand_hidden(model: CausalLM, ids: list[int], positions: list[int],
                rotary: list[int] | None = None) -> torch.Tensor:
    """Hidden states [T, d] of tokens ``ids`` with learned rows ``positions`` and rotary
    positions ``rotary`` (default: the same), through the rotary-only twin."""
    decoder = model.gpt_neox
    rows = decoder.embed_in.weight[ids] + decoder.embed_positions.weight[positions]
    twin = rotary_only_twin(model, rows.detach())
    rope = torch.tensor([rotary if rotary is not None else positions])
    with torch.no_grad():
        return twin.hidden_states(torch.arange(len(ids))[None], position_ids=rope)[0]


def test_config_option_is_a_bool_and_named() -> None:
    config = ModelConfig.from_preset("lab-1l", learned_positions=True)
    assert config.learned_positions is True
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert config.name == "lab-1l+learned_positions" and variant_name(config) == "vanilla"
    with pytest.raises(ConfigError, match="learned_positions=1: must be true or false"):
        ModelConfig(learned_positions=1)  # type: ignore[arg-type]


def test_default_model_has_no_new_parameter_and_unchanged_outputs() -> None:
    kwargs = dict(vocab_size=VOCAB, n_layer=2, n_head=2, d_model=32, max_seq_len=CONTEXT)
    torch.manual_seed(3)
    absent = CausalLM(ModelConfig(**kwargs)).eval()
    torch.manual_seed(3)
    explicit = CausalLM(ModelConfig(**kwargs, learned_positions=False)).eval()
    keys = list(absent.state_dict())
    assert keys == list(explicit.state_dict())
    assert not any("embed_positions" in k for k in keys)
    assert keys[0] == "gpt_neox.embed_in.weight" and keys[-1] == "embed_out.weight"
    assert absent.gpt_neox.embed_positions is None
    ids = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        assert torch.equal(absent(ids), explicit(ids))
        # Past max_seq_len is only untrained territory for rotary: no error without the option.
        absent(torch.randint(0, VOCAB, (1, CONTEXT + 5)))
    torch.manual_seed(3)
    learned = CausalLM(ModelConfig(**kwargs, learned_positions=True))
    assert list(learned.state_dict()) == [keys[0], "gpt_neox.embed_positions.weight", *keys[1:]]
    table = learned.gpt_neox.embed_positions.weight
    assert table.shape == (CONTEXT, 32)
    assert abs(table.std().item() - (2 / (5 * 32)) ** 0.5) < 0.02  # like the token rows


@pytest.mark.parametrize("parallel", [True, False])
def test_forward_is_token_rows_plus_position_rows(parallel: bool) -> None:
    model = learned_model(parallel=parallel)
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.hidden_states(ids)[0]
        shifted = model.hidden_states(ids, position_ids=torch.arange(7, 27)[None])[0]
    expected = hand_hidden(model, ids[0].tolist(), list(range(20)))
    assert (ours - expected).abs().max().item() < 1e-5
    expected_shifted = hand_hidden(model, ids[0].tolist(), list(range(7, 27)))
    assert (shifted - expected_shifted).abs().max().item() < 1e-5
    # The rows matter: without them (a zero table) the hidden states are far off.
    with torch.no_grad():
        model.gpt_neox.embed_positions.weight.zero_()
        assert (model.hidden_states(ids)[0] - expected).abs().max().item() > 0.1


def test_kv_cache_embeds_new_tokens_after_the_cached_ones() -> None:
    model = learned_model()
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = KVCache(model.config.n_layer)
    with torch.no_grad():
        pieces = [model(ids[:, a : a + 7], cache=cache) for a in range(0, 30, 7)]
        whole = model(ids)
    assert (torch.cat(pieces, 1) - whole).abs().max().item() < 1e-4


@pytest.mark.parametrize("softmax", ["softmax", "sink_logit"])
def test_start_recent_fast_path_equals_the_reference(softmax: str) -> None:
    """Chunks (several sizes, across the fill) through StartRecentCache against one token at a
    time through KVCache with positions re-assigned: both embed a token where it entered."""
    model = learned_model(softmax=softmax)
    text = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(4))
    for policy in (StartRecent(0, 16), StartRecent(1, 15), StartRecent(4, 12)):
        reference = reference_losses(model, text, policy)
        # 1: one-token steps (the Ring layout) from the first x on; 37: chunks across the fill.
        for chunk in (1, 37) if policy.start == 1 else (37,):
            fast = fast_losses(model, text, policy, chunk_size=chunk)
            assert (fast - reference).abs().max().item() < 1e-4, (policy, chunk)
    # The same losses with the rows at true stream positions would be another model entirely:
    # the stream runs far past the table, which the option refuses (see below) rather than wrap.
    dense = fast_losses(model, text[:CONTEXT], Dense())
    assert (dense - reference_losses(model, text[:CONTEXT], Dense())).abs().max() < 1e-4


def test_a_token_entering_a_full_cache_gets_the_last_position_row() -> None:
    """A 1-layer model (the sink lab's), cache 1+15: the query at stream index j >= 16 sits at
    position 16 and carries row 16; each cached token carries the row of where it entered
    (min(i, 16)) and is seen at its re-assigned rotary position. Built by hand: token 0 at
    0, the 15 most recent at rotary 1..15, the query at 16."""
    model = learned_model(n_layer=1)
    text = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(5))
    stream = text.tolist()
    policy = StartRecent(1, 15)
    fast = fast_losses(model, text, policy, chunk_size=13)
    reference = reference_losses(model, text, policy)
    for j in (16, 17, 30, 58):
        kept = [0, *range(max(1, j - 15), j), j]
        entered = [min(i, 16) for i in kept]
        rotary = list(range(len(kept)))
        hidden = hand_hidden(model, [stream[i] for i in kept], entered, rotary)[-1]
        with torch.no_grad():
            logits = model.logits(hidden)
        loss = -torch.log_softmax(logits, -1)[stream[j + 1]].item()
        assert abs(fast[j].item() - loss) < 1e-4, j
        assert abs(reference[j].item() - loss) < 1e-4, j
    # Position 16's row is the one: changing it changes the losses of queries 16.. only (not
    # by a constant: the LayerNorms would take it out).
    with torch.no_grad():
        model.gpt_neox.embed_positions.weight[16].normal_(0.0, 1.0)
    changed = (fast_losses(model, text, policy) - fast).abs() > 1e-4
    assert not changed[:16].any() and changed[16:].all()


def test_generation_steps_equal_the_reference() -> None:
    """One-token steps (the Ring layout) and chunked feeds: every drawn token's log-probability
    is the token-by-token reference's."""
    model = learned_model(sink_tokens=1)
    sinks = SinkPrefix([VOCAB - 1])
    policy = StartRecent(1, 15)
    session = Session(model, policy, Sampling())
    prompt = sinks.prepend(list(range(3, 40)))
    session.feed(prompt)
    drawn = [session.draw() for _ in range(60)]
    stream = prompt + [token for token, _ in drawn]
    reference = [torch.log_softmax(logits.float(), -1) for logits in
                 reference_logits(model, torch.tensor(stream[1:]), policy, sinks)]
    for (token, logprob), expected in zip(drawn, reference[len(prompt) - 1 :], strict=True):
        assert token == int(expected.argmax())
        assert abs(logprob - float(expected[token])) < 1e-4
    assert session.max_position == policy.size < CONTEXT


def test_positions_past_the_table_are_refused_before_compute() -> None:
    model = learned_model()
    calls: list[int] = []  # the first layer's QKV projection: every path computes it first
    model.gpt_neox.layers[0].attention.query_key_value.register_forward_pre_hook(
        lambda *_: calls.append(1))
    long_text = torch.randint(0, VOCAB, (200,))
    message = re.escape("cache dense: queries reach position 198, but learned_positions embeds "
                        "only positions 0..47; use x+y caches of at most 47 tokens and no dense")
    for run in (fast_losses, reference_losses):
        with pytest.raises(CachePositionError, match=message):
            run(model, long_text, Dense())
    with pytest.raises(CachePositionError, match=r"cache 40\+8: .* position 48, .*x\+y <= 47"):
        fast_losses(model, long_text, StartRecent(40, 8))
    with pytest.raises(CachePositionError, match="recompute window of at most 48"):
        reference_losses(model, long_text, Recompute(49))
    results: list[object] = []
    with pytest.raises(CachePositionError, match="cache dense"):
        evaluate(model, [Stream("s", long_text, SinkPrefix(()))],
                 [StartRecent(4, 12), Dense()], on_result=results.append)
    assert not results and not calls  # nothing ran, not even the cache that fits
    # A stream whose queries stay inside the table (its last token predicts nothing) runs.
    fast_losses(model, long_text[: CONTEXT + 1], Dense())

    # check_policies raises for a model with learned positions, and only warns otherwise.
    with pytest.raises(CachePositionError, match=message):
        check_policies([Dense()], 200, CONTEXT, 0, learned_positions=True)
    assert check_policies([Dense()], 200, CONTEXT, 0) != []
    assert check_policies([StartRecent(4, 43)], 200, CONTEXT, 0, learned_positions=True) == []
    assert issubclass(CachePositionError, PositionError)

    # The model itself: a cheap check when positions are learned, one line naming the fix.
    calls.clear()  # fast_losses on the short stream above ran
    with pytest.raises(PositionError, match=r"tokens reach position 48, .*0\.\.47"):
        model(torch.zeros(1, CONTEXT + 1, dtype=torch.long))
    with pytest.raises(PositionError, match="position 50"):
        model(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[48, 49, 50]]))
    cache = KVCache(model.config.n_layer)
    model(torch.zeros(1, CONTEXT, dtype=torch.long), cache=cache)
    with pytest.raises(PositionError, match="position 48"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert len(calls) == 1  # only the forward that fitted reached the layers

    # Generation: an x+y cache past the table is refused up front, dense once ids reach it.
    with pytest.raises(CachePositionError, match=r"cache 4\+44"):
        Session(model, StartRecent(4, 44), Sampling())
    session = Session(model, Dense(), Sampling())
    session.feed(list(range(CONTEXT - 1)))
    with pytest.raises(PositionError, match="cache dense: ids reach position 48"):
        session.feed([1, 2])


def test_conversion_refuses_plain_gpt_neox_and_records_the_option() -> None:
    model = learned_model()
    assert needs_remote_code(model.config)
    assert not needs_remote_code(model.config.replace(learned_positions=False))
    with pytest.raises(ConfigError, match=r"learned_positions=True.*gpt_neox\.embed_positions"):
        to_hf_state_dict(model)
    with pytest.raises(ConfigError, match="learned_positions=True: a plain GPTNeoXForCausalLM"):
        to_hf_model(model)
    block = export_block("m", model.config, [], "0")
    assert block["learned_positions"] is True

    pytest.importorskip("transformers")
    from sinklm.models.convert import hf_config_from

    hf_config = hf_config_from(model.config)
    hf_config.sinklm = block
    assert config_from_hf(hf_config).replace(name=model.config.name) == model.config.replace(
        attention={"backend": "sdpa"})
    hf_config.sinklm = {**block, "learned_positions": "yes"}
    with pytest.raises(ConfigError, match="learned_positions='yes'"):
        config_from_hf(hf_config)
    hf_config.sinklm = {k: v for k, v in block.items() if k != "learned_positions"}
    assert config_from_hf(hf_config).learned_positions is False  # exports from before it


def test_export_loads_in_transformers_with_our_logits(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from helpers.export_models import load_export, tiny_tokenizer
    from tokenizers import Tokenizer

    from sinklm.data.tokenizer import sink_token_ids
    from sinklm.models.hub import export_model
    from sinklm.models.load import Checkpoint, load_checkpoint

    tokenizer = Tokenizer.from_str(tiny_tokenizer().to_str())
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=320, n_layer=2, n_head=4, d_model=64, max_seq_len=CONTEXT,
                         sink_tokens=1, learned_positions=True)
    model = CausalLM(config).eval()
    with torch.no_grad():
        model.gpt_neox.embed_positions.weight.normal_(0.0, 1.0)
    sinks = sink_token_ids(tokenizer, 1, 320)
    checkpoint = Checkpoint(model, tokenizer, sinks, "tiny-learned", "memory")
    folder = export_model(checkpoint, tmp_path / "export")
    data = json.loads((folder / "config.json").read_text())
    assert data["model_type"] == "sinklm" and data["sinklm"]["learned_positions"] is True
    assert "learned absolute position embeddings" in (folder / "README.md").read_text()

    hf_model, _ = load_export(folder, remote=True)
    assert type(hf_model).__module__.startswith("transformers_modules.")
    ids = torch.tensor([[*sinks, 5, 17, 42, 99, 7, 7, 3]])
    with torch.no_grad():
        theirs = hf_model(ids).logits
        ours = model(ids)
    assert (theirs - ours).abs().max().item() < 1e-4
    # sinklm reads the export back as its own network, table included.
    loaded = load_checkpoint(folder)
    assert loaded.model.config.learned_positions and loaded.sink_token_ids == sinks
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), ours)

    # The export's streaming generation: the same greedy tokens as sinklm's Session.
    start, recent = 1, 15
    prompt = torch.tensor([[*sinks, *range(3, 30)]])
    session = Session(model, StartRecent(start, recent), Sampling())
    session.feed(prompt[0].tolist())
    expected = [session.draw()[0] for _ in range(40)]
    out = hf_model.generate(prompt, custom_generate=str(folder), trust_remote_code=True,
                            start_size=start, recent_size=recent, max_new_tokens=40,
                            eos_token_id=None)
    assert out[0, prompt.shape[1] :].tolist() == expected
    with pytest.raises(ValueError, match=r"learned positions embed only 0\.\.47"):
        hf_model.generate(prompt, custom_generate=str(folder), trust_remote_code=True,
                          start_size=4, recent_size=CONTEXT - 4, max_new_tokens=2)
