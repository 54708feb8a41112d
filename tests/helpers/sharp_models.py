"""Small random models whose attention is far from uniform, for exactness tests: a key at a
wrong position or a missing key changes the loss by much more than the tolerance."""

from __future__ import annotations

import torch

from sinklm.models import CausalLM, ModelConfig

VOCAB = 97


def sharp_model(softmax: str, sink_tokens: int = 0, seed: int = 0,
                max_seq_len: int = 64) -> CausalLM:
    """Two layers, four heads, ``VOCAB`` ids; QKV scaled up, random biases and sink logits."""
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, max_seq_len=max_seq_len,
        attention={"softmax": softmax, "backend": "sdpa"}, sink_tokens=sink_tokens,
    )
    model = CausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("query_key_value.weight"):
                param.mul_(4.0)
            elif name.endswith("sink_logit"):
                param.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model
