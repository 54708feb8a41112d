"""The export's custom_generate: transformers streams through the start+recent cache exactly as
`sinklm generate` does (same greedy tokens, log-probs within 1e-3), holding at most x+y entries.

The reference is sinklm's own :class:`Session` on the in-memory checkpoint; the exports are
loaded by transformers (plain GPT-NeoX for vanilla and sink-token models, remote code for
sink_logit and softmax1), and once in a process where sinklm cannot be imported.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers.export_models import (  # noqa: E402
    TEXT,
    load_export,
    make_checkpoint,
    run_without_sinklm,
    tiny_tokenizer,
)

from sinklm.eval.cache import Dense, StartRecent  # noqa: E402
from sinklm.eval.generate import Sampling, Session  # noqa: E402
from sinklm.models.hub import CUSTOM_GENERATE, export_model  # noqa: E402
from sinklm.models.load import Checkpoint  # noqa: E402

START, RECENT = 2, 14
NEW = 170  # > 10x the cache, so every token of the cache is evicted many times over
PROMPT = " ".join([TEXT] * 2)  # ~97 ids: longer than the cache, so the prompt is streamed too


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Checkpoint, Path]]:
    """Three variants, each with its export folder: vanilla and sink-token export as plain
    GPT-NeoX, sink_logit with remote code."""
    root = tmp_path_factory.mktemp("exports")
    found = {}
    for softmax, sinks in (("softmax", 0), ("softmax", 1), ("sink_logit", 0)):
        checkpoint = make_checkpoint(tiny_tokenizer(), softmax, sinks)
        found[checkpoint.name] = (checkpoint, export_model(checkpoint, root / checkpoint.name))
    return found


def reference(checkpoint: Checkpoint, policy: StartRecent | Dense, prompt: list[int],
              new: int) -> tuple[list[int], list[float]]:
    """`sinklm generate`'s greedy tokens and their log-probs after ``prompt``."""
    session = Session(checkpoint.model, policy, Sampling())
    session.feed(prompt)
    tokens, logprobs = zip(*(session.draw() for _ in range(new)), strict=True)
    return list(tokens), list(logprobs)


def held(cache: Any) -> int:
    """The most entries any layer holds: transformers' Cache, or the sinklm stream's KVCache."""
    if hasattr(cache, "layers"):
        return max(layer.get_seq_length() for layer in cache.layers)
    return max((k.shape[2] for k in cache.kv.keys if k is not None), default=0)


@pytest.mark.parametrize(
    ("name", "trust_at_load"),
    # Vanilla loads without remote code (transformers' generate runs custom_generate); the
    # others with it, so model.generate already is custom_generate when it is named again.
    [("tiny-softmax-0", False), ("tiny-softmax-1", True), ("tiny-sink_logit-0", True)],
)
def test_streaming_generate_equals_sinklm_generate(
    exports: dict[str, tuple[Checkpoint, Path]], name: str, trust_at_load: bool
) -> None:
    checkpoint, folder = exports[name]
    model, tokenizer = load_export(folder, trust_at_load)
    prompt = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    assert prompt.shape[1] > 3 * (START + RECENT)
    expected, expected_logprobs = reference(
        checkpoint, StartRecent(START, RECENT), prompt[0].tolist(), NEW
    )

    sizes: list[int] = []  # entries per layer before and after every forward
    remote = model.config.model_type == "sinklm"
    runner = model.network if remote else model

    def record(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], *out: Any) -> None:
        sizes.append(held(kwargs["cache"]))

    hooks = [runner.register_forward_pre_hook(record, with_kwargs=True),
             runner.register_forward_hook(record, with_kwargs=True)]
    try:
        out = model.generate(
            prompt, custom_generate=str(folder), trust_remote_code=True, start_size=START,
            recent_size=RECENT, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
            return_dict_in_generate=True, output_logits=True,
        )
    finally:
        for hook in hooks:
            hook.remove()
    assert out.sequences[0, : prompt.shape[1]].tolist() == prompt[0].tolist()
    tokens = out.sequences[0, prompt.shape[1] :].tolist()
    assert tokens == expected
    logprobs = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, tokens,
                                                                            strict=True)]
    assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs, strict=True)) < 1e-3
    # One forward for the first x+y+1 prompt ids, then one per id; never past x+y entries.
    assert len(sizes) == 2 * (prompt.shape[1] - (START + RECENT + 1) + NEW)
    assert max(sizes) == START + RECENT

    # Stops at the end-of-text id unless told otherwise: here a token the stream draws.
    stop = expected[NEW // 2]
    stopped = model.generate(
        prompt, custom_generate=str(folder), trust_remote_code=True, start_size=START,
        recent_size=RECENT, max_new_tokens=NEW, eos_token_id=stop,
    )
    assert stopped[0, prompt.shape[1] :].tolist() == expected[: expected.index(stop) + 1]


@pytest.mark.parametrize("name", ["tiny-softmax-0", "tiny-softmax-1", "tiny-sink_logit-0"])
def test_generate_without_cache_sizes_is_transformers_own(
    exports: dict[str, tuple[Checkpoint, Path]], name: str
) -> None:
    """Loaded with remote code, every export's generate is custom_generate; without the sizes
    it is ordinary generation: sinklm's greedy tokens with a dense cache."""
    checkpoint, folder = exports[name]
    model, tokenizer = load_export(folder, remote=True)
    assert isinstance(model.generate, functools.partial)  # transformers put ours in place
    inputs = tokenizer("the lazy dog", return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=5, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    prompt = inputs["input_ids"][0].tolist()
    assert output[0].tolist() == prompt + reference(checkpoint, Dense(), prompt, 5)[0]


def test_streaming_generate_refuses_what_it_cannot_do(
    exports: dict[str, tuple[Checkpoint, Path]]
) -> None:
    _, folder = exports["tiny-softmax-0"]
    model, tokenizer = load_export(folder, remote=True)
    prompt = tokenizer("the lazy dog", return_tensors="pt")["input_ids"]
    generate = functools.partial(model.generate, max_new_tokens=3)
    cases = [
        ({"start_size": 4}, "go together"),
        ({"start_size": 4, "recent_size": -1}, r"recent_size=-1: must be an integer >= 0"),
        ({"start_size": 1.5, "recent_size": 4}, r"start_size=1.5: must be an integer"),
        ({"start_size": 0, "recent_size": 0}, "keep no token"),
        ({"start_size": 1, "recent_size": 4, "do_sample": True}, "greedy"),
        ({"start_size": 1, "recent_size": 4, "num_beams": 2}, "greedy"),
        ({"start_size": 1, "recent_size": 4, "streamer": object()}, "does not take streamer"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(prompt, **kwargs)
    with pytest.raises(ValueError, match="pass max_new_tokens"):  # the export sets no length
        model.generate(prompt, start_size=1, recent_size=4)
    with pytest.raises(ValueError, match="batch size 1"):
        generate(prompt.repeat(2, 1), start_size=1, recent_size=4)
    with pytest.raises(ValueError, match="unpadded"):
        generate(prompt, attention_mask=torch.zeros_like(prompt), start_size=1, recent_size=4)
    with pytest.warns(UserWarning, match="past the 64 positions"):
        generate(prompt, start_size=4, recent_size=60)


def test_reexport_replaces_custom_generate_and_the_card_shows_it(
    exports: dict[str, tuple[Checkpoint, Path]], tmp_path: Path
) -> None:
    checkpoint, _ = exports["tiny-softmax-1"]
    folder = export_model(checkpoint, tmp_path / "e")
    (folder / CUSTOM_GENERATE).write_text("stale")
    (folder / "custom_generate" / "notes.txt").write_text("mine")
    export_model(checkpoint, folder, overwrite=True)
    assert "def generate(" in (folder / CUSTOM_GENERATE).read_text()
    assert (folder / "custom_generate" / "notes.txt").read_text() == "mine"
    card = (folder / "README.md").read_text()
    assert "## Streaming generation" in card
    assert f'custom_generate="{folder}", trust_remote_code=True' in card
    assert "start_size=1, recent_size=62" in card  # the sink token, then the rest of 64 - 1


def test_streaming_generate_needs_only_transformers(tmp_path: Path) -> None:
    """A fresh process where sinklm cannot be imported, offline: a remote-code export (zero
    sink) loaded with trust_remote_code streams through plain `model.generate(..., sizes)`, a
    plain GPT-NeoX export through `custom_generate=`, both as sinklm's Session does."""
    results = {}
    for softmax in ("softmax1", "softmax"):
        checkpoint = make_checkpoint(tiny_tokenizer(), softmax, 0, seed=3)
        folder = export_model(checkpoint, tmp_path / softmax)
        prompt = checkpoint.tokenizer.encode(PROMPT).ids
        results[softmax] = {
            "folder": str(folder), "prompt": prompt,
            "expected": reference(checkpoint, StartRecent(1, 15), prompt, 40)[0],
        }
    output = run_without_sinklm(f"""
        import json, torch, transformers
        runs = json.loads({json.dumps(json.dumps(results))})
        sizes = dict(start_size=1, recent_size=15, max_new_tokens=40, eos_token_id=None)
        got = {{}}
        for softmax, run in runs.items():
            remote = softmax != "softmax"
            model = transformers.AutoModelForCausalLM.from_pretrained(
                run["folder"], trust_remote_code=remote).eval()
            prompt = torch.tensor([run["prompt"]])
            if remote:
                out = model.generate(prompt, **sizes)
            else:
                out = model.generate(prompt, custom_generate=run["folder"],
                                     trust_remote_code=True, **sizes)
            got[softmax] = out[0, prompt.shape[1]:].tolist()
        print(json.dumps(got))
    """, tmp_path)
    got = json.loads(output.strip().splitlines()[-1])
    assert got == {softmax: run["expected"] for softmax, run in results.items()}
