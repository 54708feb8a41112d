"""Streaming generation: every drawn token checked against the token-by-token reference
evaluator fed the same stream (teacher forcing), for every variant and cache, across the
moment the cache fills and over a stream of many times the cache; sampling, stops, the
incremental detokenizer and the ``sinklm generate`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.sharp_models import VOCAB, sharp_model
from tokenizers import Tokenizer

from sinklm.cli.main import main
from sinklm.data.sinks import SinkPrefix
from sinklm.eval import generate as generate_module
from sinklm.eval.cache import Dense, StartRecent
from sinklm.eval.generate import Detokenizer, GenerateError, Sampling, Session, answer
from sinklm.eval.reference import reference_logits

W = 16  # the models' trained context; the caches below are the issue's 0+W, 1+(W-1), 4+(W-4)
VARIANTS = {  # name: (softmax, sink ids)
    "vanilla": ("softmax", 0), "zero_sink": ("softmax1", 0), "sink_token": ("softmax", 1),
    "sink_logit": ("sink_logit", 0), "gated": ("gated", 0),
}


def teacher_forced(model: torch.nn.Module, stream: list[int], sinks: SinkPrefix,
                   policy: StartRecent | Dense) -> list[torch.Tensor]:
    """The reference's log-probabilities for every query of ``stream`` (sink ids first)."""
    text = torch.tensor(stream[len(sinks) :])
    return [torch.log_softmax(logits.float(), -1) for logits in
            reference_logits(model, text, policy, sinks)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_is_the_reference_argmax_at_every_step(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 40-token prompt (longer than every cache: streamed in chunks of 7 across the fill),
    then 10 x W greedy tokens: each is the argmax of the reference's distribution and its
    log-probability the reference's, within 1e-4."""
    monkeypatch.setattr(generate_module, "FEED_CHUNK", 7)
    softmax, n_sinks = VARIANTS[variant]
    model = sharp_model(softmax, sink_tokens=n_sinks, max_seq_len=W)
    sinks = SinkPrefix(range(VOCAB - n_sinks, VOCAB))
    prompt = torch.randint(0, VOCAB - 2, (40,), generator=torch.Generator().manual_seed(3))
    for policy in (StartRecent(0, W), StartRecent(1, W - 1), StartRecent(4, W - 4), Dense()):
        session = Session(model, policy, Sampling())
        first = sinks.prepend(prompt.tolist())
        session.feed(first)
        drawn = [session.draw() for _ in range(10 * W)]
        tokens = [token for token, _ in drawn]
        expected = teacher_forced(model, first + tokens, sinks, policy)[len(first) - 1 :]
        assert len(expected) == len(tokens)
        for step, ((token, logprob), reference) in enumerate(zip(drawn, expected, strict=True)):
            assert token == int(reference.argmax()), (variant, policy, step)
            assert abs(logprob - float(reference[token])) < 1e-4, (variant, policy, step)
        if isinstance(policy, StartRecent):
            assert session.most_held == policy.size  # flat: never more than x + y per layer
        assert len(set(tokens)) > 2  # the test would be weak on a constant stream


def test_sampled_tokens_are_scored_like_the_reference_across_turns() -> None:
    """Sampling with top-k and top-p over three turns, one cache carried through: the stream
    (every fed and drawn id, in order) teacher-forced through the reference gives every drawn
    token's log-probability."""
    model = sharp_model("sink_logit", sink_tokens=1, max_seq_len=W)
    sinks = SinkPrefix([VOCAB - 1])
    policy = StartRecent(1, W - 2)
    session = Session(model, policy, Sampling(temperature=0.9, top_k=20, top_p=0.9, seed=4))
    detokenizer = Detokenizer(word_tokenizer())
    turns = [sinks.prepend([5, 6, 7]), [8, 9], [10, 11, 12, 13]]
    done = [answer(session, ids, detokenizer, max_new_tokens=25) for ids in turns]
    stream = [i for turn in done for i in (*turn.prompt_ids, *turn.generated_ids)]
    reference = teacher_forced(model, stream, sinks, policy)
    position = 0
    for turn in done:
        position += len(turn.prompt_ids)
        for i, (token, logprob) in enumerate(zip(turn.generated_ids, turn.logprobs, strict=True)):
            assert abs(logprob - float(reference[position + i - 1][token])) < 1e-4
        position += len(turn.generated_ids)
    assert all(turn.stop == "max_new_tokens" for turn in done)


def test_sampling_is_seeded_and_respects_top_k_and_top_p() -> None:
    logits = torch.log_softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    top3 = set(torch.topk(logits, 3).indices.tolist())

    def draws(sampling: Sampling) -> list[int]:
        generator = torch.Generator().manual_seed(sampling.seed)
        return [sampling.draw(logits, generator) for _ in range(300)]

    assert draws(Sampling(1.0, seed=5)) == draws(Sampling(1.0, seed=5))
    assert draws(Sampling(1.0, seed=5)) != draws(Sampling(1.0, seed=6))
    assert set(draws(Sampling(1.0, top_k=3, seed=1))) == top3
    # The nucleus of p: the most likely tokens until their mass reaches p (the top one always).
    probs, order = torch.sort(logits.exp(), descending=True)
    nucleus = set(order[: int((probs.cumsum(0) < 0.5).sum()) + 1].tolist())
    assert set(draws(Sampling(1.0, top_p=0.5, seed=1))) == nucleus
    assert set(draws(Sampling(1.0, top_p=1e-6, seed=1))) == {int(logits.argmax())}
    assert draws(Sampling())[:3] == [int(logits.argmax())] * 3
    # A low temperature concentrates the draws on the argmax.
    assert draws(Sampling(0.05, seed=2)).count(int(logits.argmax())) > 290
    for bad, match in ((dict(top_p=0.0), "top-p"), (dict(top_p=1.5), "top-p"),
                       (dict(top_k=0), "top-k"), (dict(temperature=-1.0), "temperature")):
        with pytest.raises(GenerateError, match=match):
            Sampling(**bad)


def word_tokenizer() -> Tokenizer:
    """Ids 0..96 as words w0..w96 (w0 the end of document), decoded with spaces."""
    from tokenizers import decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer


def test_answer_stops_at_the_end_of_document_and_at_stop_strings() -> None:
    model = sharp_model("softmax", max_seq_len=W)
    greedy = Session(model, StartRecent(2, 10), Sampling())
    turn = answer(greedy, [3, 4, 5], Detokenizer(word_tokenizer()), max_new_tokens=30)
    tokens, text = turn.generated_ids, turn.text
    assert turn.stop == "max_new_tokens" and len(tokens) == 30
    assert text.split() == [f"w{t}" for t in tokens]
    # The same draws, stopped at the third token taken as end of document, then at a string
    # that ends inside the fifth token's text.
    stopped = answer(Session(model, StartRecent(2, 10), Sampling()), [3, 4, 5],
                     Detokenizer(word_tokenizer()), 30, end_id=tokens[2])
    assert stopped.generated_ids == tokens[: tokens.index(tokens[2]) + 1]
    assert stopped.stop == "end_of_document"
    stop = f"w{tokens[3]} w{tokens[4]}"[:-1]
    cut = answer(Session(model, StartRecent(2, 10), Sampling()), [3, 4, 5],
                 Detokenizer(word_tokenizer()), 30, stops=[stop])
    assert cut.stop == "stop_string" and cut.generated_ids == tokens[:5]
    with pytest.raises(GenerateError, match="max-new-tokens"):
        answer(greedy, [3], Detokenizer(word_tokenizer()), 0)
    with pytest.raises(GenerateError, match="empty prompt"):
        Session(model, Dense(), Sampling()).feed([])


def test_detokenizer_gives_whole_characters_as_they_complete(data_neox_path: Path) -> None:
    """Byte-level BPE splits multi-byte characters across tokens: no piece holds half of one,
    and the pieces add up to the decoded whole."""
    tokenizer = Tokenizer.from_file(str(data_neox_path))
    text = "Naïve café — 日本語のテキスト 🎉🎉 and plain words; ∑ᵢ xᵢ² ≤ ∞."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > len(text.split())  # some characters take several tokens
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.add(token) for token in ids]
    pieces.append(detokenizer.flush())
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces  # some tokens ended inside a character and were held back


# --- the command -------------------------------------------------------------------------------

SINK = VOCAB - 1


def command_tokenizer() -> Tokenizer:
    """Words w1..w95, <|endoftext|> (id 0) and <|sink|> (the last id) as special tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, SINK)}, "<|sink|>": SINK}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>",
                                                                        "<|sink|>")])
    return tokenizer


@pytest.fixture
def checkpoint_file(tmp_path: Path) -> Path:
    """A sink-token model saved as `sinklm fit` saves it (the .ckpt entries evaluators read)."""
    from sinklm.models.checkpoint import STATE_PREFIX, write_entries

    model = sharp_model("softmax", sink_tokens=1, max_seq_len=W)
    checkpoint: dict = {"state_dict": {STATE_PREFIX + k: v for k, v in
                                       model.state_dict().items()}}
    write_entries(checkpoint, model.config, command_tokenizer(), [SINK])
    torch.save(checkpoint, tmp_path / "model.ckpt")
    return tmp_path / "model.ckpt"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_command_prints_and_records_a_run_that_rescores(
    checkpoint_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "run.json"
    code, out, err = run(capsys, "--checkpoint", str(checkpoint_file), "--prompt", "w5 w6 w7",
                         "--max-new-tokens", "60", "--ignore-eod", "--output", str(output))
    assert code == 0, err
    record = json.loads(output.read_text())
    assert record["cache"] == "1+14"  # the sink id + the rest of W = 16, less the query's slot
    assert record["prompt_ids"] == [SINK, 5, 6, 7] and len(record["generated_ids"]) == 60
    assert record["stream_ids"] == record["prompt_ids"] + record["generated_ids"]
    assert out.strip() == record["text"].strip() != ""
    assert "60 tokens" in err and "cache 1+14 (at most 15 held per layer)" in err
    # Re-scored from the record alone: the reference's argmax and log-probability at each step.
    model = sharp_model("softmax", sink_tokens=1, max_seq_len=W)
    reference = teacher_forced(model, record["stream_ids"], SinkPrefix([SINK]),
                               StartRecent(1, 14))[3:]
    for token, logprob, expected in zip(record["generated_ids"], record["turns"][0]["logprobs"],
                                        reference, strict=True):
        assert token == int(expected.argmax()) and abs(logprob - float(expected[token])) < 1e-4
    code, _, err = run(capsys, "--checkpoint", str(checkpoint_file), "--prompt", "w5",
                       "--output", str(output))
    assert code == 2 and "exists: pass --overwrite" in err


def test_generate_command_carries_the_cache_through_turns(
    checkpoint_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    turns = tmp_path / "chat.jsonl"
    turns.write_text('"w3 w4"\n{"text": "w8"}\n\n"w9 w10 w11"\n')
    output = tmp_path / "chat.json"
    code, out, err = run(capsys, "--checkpoint", str(checkpoint_file), "--turns", str(turns),
                         "--turn-template", "w2 {turn} w2", "--max-new-tokens", "30",
                         "--temperature", "0.8", "--top-k", "10", "--seed", "3",
                         "--ignore-eod", "--output", str(output))
    assert code == 0, err
    record = json.loads(output.read_text())
    assert [turn["prompt_ids"] for turn in record["turns"]] == [
        [SINK, 2, 3, 4, 2], [2, 8, 2], [2, 9, 10, 11, 2]]
    assert record["sampling"] == {"greedy": False, "temperature": 0.8, "top_k": 10,
                                  "top_p": None, "seed": 3}
    assert out.startswith("w2 w3 w4 w2") and "w2 w9 w10 w11 w2" in out
    assert len(record["stream_ids"]) == 13 + 90 > 6 * W  # the stream outgrows the cache
    reference = teacher_forced(sharp_model("softmax", sink_tokens=1, max_seq_len=W),
                               record["stream_ids"], SinkPrefix([SINK]), StartRecent(1, 14))
    logprobs = [p for turn in record["turns"] for p in turn["logprobs"]]
    position, got = 0, []
    for turn in record["turns"]:
        position += len(turn["prompt_ids"])
        got += [float(reference[position + i - 1][token])
                for i, token in enumerate(turn["generated_ids"])]
        position += len(turn["generated_ids"])
    assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize(("args", "message"), [
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
    (["--top-p", "1.5"], "--top-p 1.5: must lie in (0, 1]"),
    (["--greedy", "--temperature", "0.7"], "pick greedy or sampling"),
    (["--temperature", "0"], "use --greedy"),
    (["--cache", "recompute:8"], "generation takes X+Y or dense"),
    (["--cache", "4-4"], "expected X+Y"),
    (["--turn-template", "USER:"], "has no {turn}"),
])
def test_generate_command_refuses_bad_settings_before_loading(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused in one line, exit 2: the checkpoint does not even exist."""
    code, _, err = run(capsys, "--checkpoint", str(tmp_path / "none.ckpt"), "--prompt", "w5",
                       *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_generate_command_warns_about_caches_and_refuses_an_empty_start(
    checkpoint_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--checkpoint", str(checkpoint_file), "--max-new-tokens", "3"]
    code, _, err = run(capsys, *common, "--prompt", "w5", "--cache", "0+15")
    assert code == 0 and "keeps 0 of the model's 1 sink ids" in err and "41.11" in err
    code, _, err = run(capsys, *common, "--prompt", "w5", "--cache", "10+10")
    assert code == 0 and "past the" not in err  # 5 tokens never reach position 16
    code, _, err = run(capsys, *common[:2], "--max-new-tokens", "30", "--prompt", "w5",
                       "--cache", "10+10")
    assert code == 0 and "queries reach position 20, past the 16 positions" in err
    code, _, err = run(capsys, *common, "--prompt", " ".join(["w5"] * 30))
    assert code == 0 and "streamed through it, not cut" in err
    code, _, err = run(capsys, *common, "--stop", "no such text \u2603")
    assert code == 0, err  # a stop the tokenizer cannot produce is no error; sink ids start it
    vanilla = tmp_path / "vanilla.ckpt"
    from sinklm.models.checkpoint import STATE_PREFIX, write_entries

    model = sharp_model("softmax", max_seq_len=W)
    checkpoint: dict = {"state_dict": {STATE_PREFIX + k: v for k, v in
                                       model.state_dict().items()}}
    write_entries(checkpoint, model.config, command_tokenizer(), [])
    torch.save(checkpoint, vanilla)
    code, _, err = run(capsys, "--checkpoint", str(vanilla), "--max-new-tokens", "3")
    assert code == 2 and "the model has no sink ids to start from" in err
