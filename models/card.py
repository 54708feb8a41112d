"""The model card (README.md) of an export: Hub metadata, how to load it, the model, its
training recipe and its evaluation results.

Zero-shot results files declare ``kind: RESULTS_KIND`` (``sinklm zeroshot`` writes them) and
show as a table; any other results file shows its numeric fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import yaml
from tokenizers import Tokenizer

from sinklm.data.sinks import SinkPrefix
from sinklm.models.convert import needs_remote_code

if TYPE_CHECKING:
    from sinklm.models.load import Checkpoint

# The ``kind`` of a zero-shot results file, which model cards recognise.
RESULTS_KIND = "sinklm-zeroshot"
# Each attention.softmax as the card describes it.
ATTENTION = {
    "softmax": "vanilla softmax",
    "softmax1": "softmax-off-by-one (a zero sink in every head's denominator)",
    "sink_logit": "one learned sink logit per head in the softmax denominator (as gpt-oss)",
    "gated": "a sigmoid gate on each head's output (Gated Attention)",
}
# The learned_positions research option as the card describes it.
LEARNED_POSITIONS = (
    "learned absolute position embeddings (a research option, GPT-2/OPT style: one learned row "
    "per position 0..context-1 added to the token embedding, on top of rotary)"
)


def model_card(
    checkpoint: Checkpoint,
    tokenizer: Tokenizer,
    training: Mapping[str, Any] | None,
    results: Mapping[str, Any],
    where: str,
) -> str:
    """README.md: Hub metadata, how to load it, the model, its recipe and its results."""
    config = checkpoint.model.config
    softmax, remote = config.attention.softmax, needs_remote_code(config)
    names = SinkPrefix(checkpoint.sink_token_ids).names(tokenizer)
    tags = ["sinklm", "gpt_neox", "pythia", "attention-sinks", f"attention-{softmax}",
            "custom_generate"]
    if config.sink_tokens:
        tags.append("sink-token")
    if config.learned_positions:
        tags.append("learned-positions")
    if remote:
        tags.append("custom_code")
    front = {"library_name": "transformers", "pipeline_tag": "text-generation", "tags": tags}
    trust = ", trust_remote_code=True" if remote else ""
    pairs = zip(names, checkpoint.sink_token_ids, strict=True)
    sinks = ", ".join(f"`{name}` (id {i})" for name, i in pairs)
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {checkpoint.name}",
        "",
        f"A Pythia-style (GPT-NeoX) language model trained with sinklm: attention "
        f"`{softmax}` ({ATTENTION[softmax]}), {config.sink_tokens} sink token(s)"
        + (f", and {LEARNED_POSITIONS}" if config.learned_positions else "") + ".",
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{where}"{trust})',
        f'model = AutoModelForCausalLM.from_pretrained("{where}"{trust})',
        'inputs = tokenizer("The first token of a text", return_tensors="pt")',
        "output = model.generate(**inputs, max_new_tokens=20)",
        "print(tokenizer.decode(output[0], skip_special_tokens=True))",
        "```",
        "",
    ]
    if names:
        lines += [
            f"The model was trained with {sinks} in front of every sequence, and the tokenizer "
            "puts them there for you: `tokenizer(text)` starts with the sink id(s), so the "
            "model's losses are those it had in training. `add_special_tokens=False` gives the "
            "text alone.",
            "",
        ]
    if remote:
        lacks = [f"`{softmax}` attention"] if softmax != "softmax" else []
        if config.learned_positions:
            lacks.append("learned absolute position embeddings")
        lines += [
            f"`GPTNeoXForCausalLM` cannot compute {' and '.join(lacks)}, so this folder ships "
            "sinklm's network (`model.py`, `attention.py`, `config.py`, `convert.py`, "
            "`compat.py`) with a thin transformers wrapper (`modeling_sinklm.py`); loading "
            "(model and tokenizer: transformers reads the config for both) needs "
            "`trust_remote_code=True` and works offline. Plain `generate` recomputes the whole "
            "sequence at each step and padded batches are refused; streaming generation "
            "(below) runs the network's own KV cache.",
            "",
        ]
    lines += [*_streaming_section(checkpoint, where), *_model_table(checkpoint), "",
              "## Training recipe", ""]
    if training:
        lines += ["```yaml", yaml.safe_dump(dict(training), sort_keys=False).rstrip(), "```"]
    else:
        lines.append("No training recipe was found beside the checkpoint.")
    lines += ["", "## Evaluation", ""]
    if not results:
        lines.append("No evaluation results were found beside the checkpoint.")
    for name, data in results.items():
        lines += [*_results_section(name, data), ""]
    return "\n".join(lines).rstrip() + "\n"


def _streaming_section(checkpoint: Checkpoint, where: str) -> list[str]:
    """How to stream past the context with the start+recent cache the folder's
    ``custom_generate/generate.py`` implements, with ``sinklm generate``'s default sizes."""
    start, recent = checkpoint.model.config.stream_cache()
    return [
        "## Streaming generation",
        "",
        "The folder ships StreamingLLM's cache as transformers `custom_generate` code "
        "(`custom_generate/generate.py`, torch and transformers only): `start_size` first "
        "tokens and `recent_size` most recent ones, positions re-assigned inside the cache at "
        "every step, so generation runs past the context with a cache of "
        "`start_size + recent_size` entries per layer. It gives the same greedy tokens as "
        f"`sinklm generate --cache {start}+{recent} --greedy`. With `model` and `inputs` as "
        "above:",
        "",
        "```python",
        "output = model.generate(",
        f'    **inputs, custom_generate="{where}", trust_remote_code=True,',
        f"    start_size={start}, recent_size={recent}, max_new_tokens=2000,",
        ")",
        "```",
        "",
        "Greedy and one sequence at a time; a prompt longer than the cache is streamed through "
        "it too. Without `start_size` and `recent_size`, `generate` is transformers' own.",
        "",
    ]


def _model_table(checkpoint: Checkpoint) -> list[str]:
    model = checkpoint.model
    config = model.config
    rows = {
        "parameters": f"{model.num_params():,}",
        "layers / d_model / heads": f"{config.n_layer} / {config.d_model} / {config.n_head}",
        "context": f"{config.max_seq_len} tokens, sink tokens included",
        "rotary": f"{config.rotary_pct:g} of each head's dims, base {config.rotary_base:g}",
        "attention": f"`{config.attention.softmax}`",
        "sink token ids": str(list(checkpoint.sink_token_ids) or "none"),
        "vocabulary": f"{config.vocab_size} embedding rows",
        "weights": f"{str(next(model.parameters()).dtype).removeprefix('torch.')} safetensors",
    }
    if config.learned_positions:
        rows["learned positions"] = (f"{config.max_seq_len} learned absolute position rows "
                                     "added to the token embedding, on top of rotary (research "
                                     "option)")
    return ["## Model", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows.items()]


def _results_section(name: str, data: Any) -> list[str]:
    """A zero-shot results file as a table; any other results file as its numeric fields."""
    if isinstance(data, dict) and data.get("kind") == RESULTS_KIND:
        lines = [
            f"Zero-shot, lm-eval {data.get('lm_eval_version')} (`{name}`):",
            "",
            "| task | metric | value | stderr | n |",
            "|---|---|---|---|---|",
        ]
        for task, row in data.get("tasks", {}).items():
            metrics = [
                m for m, value in row.items()
                if isinstance(value, float) and m != "version" and not m.endswith("_stderr")
            ]
            for metric in metrics:
                value, stderr = row[metric], row.get(f"{metric}_stderr")
                shown = f"{stderr:.4f}" if isinstance(stderr, float | int) else ""
                lines.append(f"| {task} | {metric} | {value:.4f} | {shown} | {row['samples']} |")
        return lines
    numbers = list(_numeric_leaves(data, ""))
    lines = [f"`{name}`:", "", "| field | value |", "|---|---|"]
    lines += [f"| {key} | {value:g} |" for key, value in numbers[:50]]
    if len(numbers) > 50:
        lines.append(f"| ... | {len(numbers) - 50} more in the file |")
    return lines


def _numeric_leaves(data: Any, prefix: str) -> Any:
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _numeric_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(data, float | int) and not isinstance(data, bool):
        yield prefix, data
