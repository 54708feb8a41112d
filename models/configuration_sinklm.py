"""transformers config of a sinklm model GPT-NeoX cannot express.

Shipped as ``configuration_sinklm.py`` in exported folders of the softmax1, sink_logit and gated
variants and of models with ``learned_positions``. Its GPT-NeoX fields describe the network; the
``sinklm`` dict names the variant and says whether positions are learned. A
model type of its own (not ``gpt_neox``) makes transformers refuse to load such a folder without
``trust_remote_code=True`` instead of silently building a vanilla-softmax GPTNeoX from it.
"""

from __future__ import annotations

from transformers import GPTNeoXConfig

MODEL_TYPE = "sinklm"


class SinkLMConfig(GPTNeoXConfig):
    """GPT-NeoX settings plus ``sinklm`` = {attention_softmax, sink_tokens, sink_token_ids,
    learned_positions}."""

    model_type = MODEL_TYPE
