"""Zero-shot benchmarks through lm-eval, with the model's sink ids in front of every request.

``SinkLMEval`` is registered with lm-eval as ``sinklm``. It scores a sinklm ``CausalLM`` the
way lm-eval's own ``hf`` model scores a causal LM (same tokenisation of context and
continuation, same rolling windows, same truncation from the left), except that every sequence
the network sees starts with the checkpoint's sink ids, as in training. The sinks count against
the model's context: ``max_length`` is ``max_seq_len`` minus the number of sinks.

Loglikelihood requests are batched (longest first, right-padded: the network is causal, so
padding after a sequence cannot change its logits); generation is greedy, one request at a
time with the network's KV cache. Python users import this module (which registers the name)
and call ``lm_eval.simple_evaluate(model="sinklm", model_args="checkpoint=PATH")``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import lm_eval
import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from sinklm.data.errors import DataError
from sinklm.data.sinks import SinkPrefix
from sinklm.data.tokenizer import eod_token_id
from sinklm.models import KVCache
from sinklm.models.card import RESULTS_KIND
from sinklm.models.load import DTYPES, Checkpoint, load_checkpoint

from .zeroshot_tasks import (
    ZeroshotError,
    data_source,
    task_manager,
)

# A loglikelihood request after tokenisation: ((context, continuation), context ids, cont. ids).
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]


@register_model("sinklm")
class SinkLMEval(TemplateLM):
    """A sinklm checkpoint as an lm-eval model (``--model sinklm``).

    ``checkpoint`` is a loaded :class:`Checkpoint` or anything ``load_checkpoint`` accepts;
    ``device``, ``dtype`` and ``tokenizer`` apply when it is loaded here.
    """

    def __init__(
        self,
        checkpoint: str | Checkpoint,
        batch_size: int | str = 16,
        device: str | None = None,
        dtype: str = "float32",
        tokenizer: str | None = None,
        max_gen_toks: int = 256,
    ) -> None:
        super().__init__()
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise ZeroshotError(f"batch_size={batch_size!r}: give a positive integer")
        if dtype not in DTYPES:
            raise ZeroshotError(f"dtype={dtype!r}: allowed {sorted(DTYPES)}")
        if isinstance(checkpoint, str):
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            checkpoint = load_checkpoint(checkpoint, tokenizer, device, DTYPES[dtype])
        self.checkpoint = checkpoint
        self.network = checkpoint.model.eval()
        self.tokenizer = checkpoint.tokenizer
        self.sinks = SinkPrefix(checkpoint.sink_token_ids)
        self.batch_size = int(batch_size)
        self.max_gen_toks = max_gen_toks
        self._device = next(self.network.parameters()).device
        try:
            self._eot = eod_token_id(self.tokenizer)
        except DataError as error:
            raise ZeroshotError(str(error)) from error

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def sink_ids(self) -> list[int]:
        """The checkpoint's sink ids, as lm-eval's results record them."""
        return list(self.sinks.ids)

    @property
    def max_length(self) -> int:
        """Text tokens per sequence: the trained context less the sink positions."""
        return self.network.config.max_seq_len - len(self.sinks)

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Text ids only: sinks are added by the model, whatever the tokenizer's template."""
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in its results' config."""
        return {**self.checkpoint.describe(), "sink_token_ids": self.sink_ids}

    @torch.no_grad()
    def _logits(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits of the text positions of each row, [B, T, V]: sinks in front, right-padded."""
        width = max(len(row) for row in rows)
        text = torch.full((len(rows), width), self._eot, dtype=torch.long)
        for i, row in enumerate(rows):
            text[i, : len(row)] = torch.tensor(row)
        ids = self.sinks.prepend(text)
        return self.network(ids.to(self._device))[:, len(self.sinks) :]

    def _loglikelihood_tokens(
        self,
        requests: list[TokenRequest],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """Sum of continuation log-probs and whether greedy decoding gives the continuation."""
        # Longest first, as lm-eval's hf model: the first batch shows the memory peak.
        order = Collator(requests, sort_fn=lambda req: (-len(req[1] + req[2]), req[1] + req[2]))
        results: list[tuple[float, bool]] = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="sinklm loglikelihood")
        for chunk in order.get_batched(n=override_bs or self.batch_size):
            # As lm-eval's hf model: the last max_length + 1 tokens, the final one only predicted.
            too_long = [len(cont) for _, _, cont in chunk if len(cont) > self.max_length]
            if too_long:
                raise ZeroshotError(
                    f"a continuation of {too_long[0]} tokens does not fit the model's "
                    f"{self.max_length}-token context"
                )
            rows = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in chunk]
            logits = self._logits(rows)
            for (request, _, cont), row, row_logits in zip(chunk, rows, logits, strict=True):
                scored = row_logits[len(row) - len(cont) : len(row)].float()
                target = torch.tensor(cont, device=scored.device)
                logprobs = F.log_softmax(scored, dim=-1)
                answer = (
                    float(logprobs.gather(1, target[:, None]).sum()),
                    bool((scored.argmax(dim=-1) == target).all()),
                )
                results.append(answer)
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
                bar.update(1)
        bar.close()
        return order.get_original(results)

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """Whole-text log-likelihood in disjoint windows of max_length, as lm-eval's hf model."""
        windows: list[TokenRequest] = []
        counts: list[int] = []
        for (text,) in (req.args for req in requests):
            pairs = [
                lm_utils.make_disjoint_window(pair)
                for pair in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            windows.extend((None, ctx, cont) for ctx, cont in pairs)
            counts.append(len(pairs))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals: list[float] = []
        start = 0
        for request, count in zip(requests, counts, strict=True):
            total = sum(score for score, _ in scores[start : start + count])
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            totals.append(total)
            start += count
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first stop sequence (lm-eval's ``until``)."""
        eos = self.tokenizer.decode([self._eot], skip_special_tokens=False)
        outputs: list[str] = []
        for request in tqdm(requests, disable=disable_tqdm, desc="sinklm generate_until"):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ZeroshotError(
                    f"task {request.task_name} samples (do_sample=True): sinklm decodes greedily"
                )
            until = handle_stop_sequences(kwargs["until"], eos=eos)
            text = self._greedy(self.tok_encode(context), kwargs["max_gen_toks"], until)
            text = postprocess_generated_text(text, until, None)
            self.cache_hook.add_partial("generate_until", request.args, text)
            outputs.append(text)
        return outputs

    @torch.no_grad()
    def _greedy(self, context: list[int], max_new: int, until: list[str]) -> str:
        """Decode up to ``max_new`` tokens after sinks + context, stopping at EOT or ``until``."""
        keep = max(self.max_length - max_new, 1)
        ids = torch.tensor([self.sinks.prepend(context[-keep:])], device=self._device)
        cache = KVCache(self.network.config.n_layer)
        logits = self.network(ids, cache=cache)
        generated: list[int] = []
        for _ in range(max_new):
            token = int(logits[0, -1].argmax())
            if token == self._eot:
                break
            generated.append(token)
            if any(stop and stop in self.tok_decode(generated) for stop in until):
                break
            logits = self.network(torch.tensor([[token]], device=self._device), cache=cache)
        return self.tok_decode(generated)


def evaluate(
    model: SinkLMEval,
    specs: Sequence[str | dict[str, Any]],
    limit: int | None = None,
    bootstrap_iters: int = 100_000,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's raw results at zero shots for ``task_specs(...)`` (stock names or local configs).

    Adds ``sinklm_sources``: each task's data (``hub`` or the local files).
    """
    raw = lm_eval.simple_evaluate(
        model=model,
        tasks=list(specs),
        num_fewshot=0,
        limit=limit,
        bootstrap_iters=bootstrap_iters,
        log_samples=log_samples,
        task_manager=task_manager(),
    )
    raw["sinklm_sources"] = {
        spec["task"]: data_source(spec) for spec in specs if isinstance(spec, dict)
    }
    return raw


def summarize(raw: dict[str, Any], model: SinkLMEval, settings: dict[str, Any]) -> dict[str, Any]:
    """The results file: every metric with its stderr per task, the model, lm-eval's version.

    lm-eval keys metrics as ``acc,none`` and ``acc_stderr,none`` (metric, filter); for these
    tasks the filter is always ``none``, so the file drops it: ``acc``, ``acc_stderr``.
    """
    tasks: dict[str, dict[str, Any]] = {}
    for task, metrics in raw["results"].items():
        row: dict[str, Any] = {}
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if filter_name == "none":
                row[metric] = None if value == "N/A" else value
        # Groups (e.g. mmlu) aggregate their tasks and have no samples or version of their own.
        row["samples"] = raw["n-samples"].get(task, {}).get("effective")
        row["version"] = raw["versions"].get(task)
        row["source"] = raw["sinklm_sources"].get(task, "hub")
        tasks[task] = row
    return {
        "kind": RESULTS_KIND,
        "lm_eval_version": lm_eval.__version__,
        "model": model.get_model_info(),
        "tasks": tasks,
        "settings": {"num_fewshot": 0, **settings},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
