"""Evaluation: streaming perplexity under KV cache policies (``cache``, ``streaming``,
``report``), attention-sink diagnostics (``sinks``), checkpoint loading (``checkpoint``), text
sources (``texts``) and the ``stream-eval`` / ``sinks`` commands (``cli``)."""
