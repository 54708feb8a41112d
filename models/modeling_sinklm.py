"""transformers wrapper of the sinklm network, for variants GPT-NeoX cannot express.

Shipped as ``modeling_sinklm.py`` in exported folders of softmax1, sink_logit and gated models
and of models with learned absolute positions (``learned_positions``, a research option), next
to verbatim copies of sinklm's config.py, attention.py, model.py and convert.py.
transformers copies a remote-code module's relative imports into its module cache, so
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` runs sinklm's own
network, offline and without sinklm installed: nothing here re-implements it.

Generation recomputes the whole sequence at every step (no transformers cache); sinklm's own
``KVCache`` is the fast path. Padded batches are refused: the network has no padding mask.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_sinklm import SinkLMConfig
from .convert import config_from_hf
from .model import Attention, CausalLM


class SinkLMForCausalLM(PreTrainedModel, GenerationMixin):
    """A sinklm ``CausalLM`` with transformers' loading, saving and ``generate``."""

    config_class = SinkLMConfig
    base_model_prefix = "gpt_neox"
    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self, config: SinkLMConfig) -> None:
        super().__init__(config)
        network = CausalLM(config_from_hf(config))
        # The network's parts are registered under GPT-NeoX's names, so the weights file reads
        # like Pythia's; the network object itself stays unregistered and runs the forward on
        # these same modules.
        self.gpt_neox = network.gpt_neox
        self.embed_out = network.embed_out
        self.__dict__["network"] = network
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Recompute the non-persistent buffer transformers leaves uninitialised after loading.

        Parameters come from the weights file, or from CausalLM's Pythia initialisation when
        the model is built from a config, so they are left alone.
        """
        if isinstance(module, Attention) and module.softmax == "softmax1":
            module.zero_sink.zero_()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.gpt_neox.embed_in

    def get_output_embeddings(self) -> nn.Linear:
        return self.embed_out

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutput:
        """Logits (and the mean next-token loss for ``labels``, -100 ignored).

        Other keyword arguments transformers passes (``use_cache``, ``return_dict``, a cache)
        are accepted and ignored: the network always sees the whole sequence.
        """
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError(
                "sinklm models have no padding mask: pass unpadded sequences (one at a time, "
                "or a batch of equal lengths)"
            )
        logits = self.network(input_ids, position_ids=position_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, attention_mask: Tensor | None = None, **kwargs: Any
    ) -> dict[str, Tensor | None]:
        """The whole sequence at every step, whatever ``use_cache`` says: there is no cache."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}
