"""Input embedding (vocab-parallel words, optional learned positions and norm) and the output head.

    x = dropout(N?(E_word[ids] + E_pos[positions]?))       [b, s] -> [s, b, h]
    logits = y @ E_word^T   (tied)                        [s, b, h] -> [s, b, vp]
    logits = y @ W_out^T    (untied, OutputLayer)         [s, b, h] -> [s, b, vp]

The word embedding is split along the vocabulary: rank r holds rows [r * vp, (r + 1) * vp). The
output head reuses that same weight (tied), or has its own split the same way
(--untie-embeddings-and-output-weights, Llama); its logits are vocab-parallel either way.

With ``config.sequence_parallel`` the embedding hands on this TP rank's [s/tp, b, h] shard (scattered
after the positions are added, before the norm and dropout), and the head all-gathers the sequence
first (its backward reduce-scatters: each rank keeps the summed gradient of its own tokens).

Shape letters: s sequence, b micro-batch, h hidden, np heads per partition, hn head dim,
hp = np * hn, v / vp vocabulary (per partition).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.model.initialization import normal_init, params_torch_dtype
from megatron.model.norm import Norm
from megatron.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from megatron.parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.parallel.random import sequence_parallel_dropout
from megatron.parallel.state import group_size
from megatron.parallel.weight_grad_store import linear

__all__ = ["EmbeddingLayer", "OutputLayer"]


class _PositionEmbedding(nn.Embedding):
    """nn.Embedding initialized by ``init_method`` inside its own constructor: under ZeRO-3's zero.Init a
    module's parameters are partitioned when its constructor returns, so an init applied afterwards would
    write into an empty placeholder (and the learned positions would start from torch's N(0, 1))."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_method):
        self._init_method = init_method
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        self._init_method(self.weight)


class EmbeddingLayer(nn.Module):
    """Token ids -> hidden states [s, b, h]; also the tied output head (:meth:`lm_logits`).

    Args:
        config: the model configuration. Learned positions exist when
            ``position_embedding_type == 'absolute'``; ``embed_layernorm`` adds BLOOM's LayerNorm;
            ``hidden_dropout`` is the embedding dropout.
        tp_group: the tensor-parallel process group (None: one rank).
        rng_tracker: the ``RNGStatesTracker`` whose model-parallel stream draws the dropout of a
            sequence-parallel shard (needed with sequence parallelism and a dropout above 0).

    Parameters: ``word_embeddings.weight`` [vp, h] (vocab-parallel), ``position_embeddings.weight``
    [max_positions, h] and ``embed_layernorm.{weight,bias}`` (both replicated across TP).
    """

    def __init__(self, config: ModelConfig, tp_group=None, rng_tracker=None):
        super().__init__()
        config.validate(group_size(tp_group))
        self.tp_group = tp_group
        self.dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel and group_size(tp_group) > 1
        self.rng_tracker = rng_tracker
        if self.sequence_parallel and self.dropout > 0 and rng_tracker is None:
            raise ValueError(f"sequence parallelism with --hidden-dropout {self.dropout} needs an RNG tracker for "
                             f"the embedding dropout (each TP rank drops its own tokens); pass rng_tracker")
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, tp_group=tp_group,
            init_method=normal_init(config.init_method_std, config.seed, "embedding.word_embeddings.weight"))
        self.word_embeddings.weight.is_embedding_or_output_parameter = True  # --decoupled-lr's (megatron.engine.optimizer)
        self.position_embeddings = None
        if config.position_embedding_type == "absolute":
            self.position_embeddings = _PositionEmbedding(
                config.max_positions, config.hidden_size,
                normal_init(config.init_method_std, config.seed, "embedding.position_embeddings.weight"))
        self.embed_layernorm = None
        if config.embed_layernorm:
            self.embed_layernorm = Norm(config, tp_group)
        self.to(params_torch_dtype(config))
        self.weight_grad_store = None  # ZB-H1: where the tied head's weight gradient is deferred

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids [b, s] (and position_ids [b, s], learned positions only) -> [s, b, h].

        position_ids defaults to 0 .. s-1; pass offset positions when decoding with a KV cache.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [b, s], got shape {list(input_ids.shape)}")
        embeddings = self.word_embeddings(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]  # [1, s]
            embeddings = embeddings + self.position_embeddings(position_ids)  # [b, s, h]
        embeddings = embeddings.transpose(0, 1).contiguous()  # [s, b, h]
        if self.sequence_parallel:
            embeddings = scatter_to_sequence_parallel_region(embeddings, self.tp_group)  # [s/tp, b, h]
        if self.embed_layernorm is not None:
            embeddings = self.embed_layernorm(embeddings)
        if self.sequence_parallel:  # each TP rank drops its own tokens
            return sequence_parallel_dropout(embeddings, self.dropout, self.training, self.rng_tracker)
        return F.dropout(embeddings, p=self.dropout, training=self.training)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, h] -> vocab-parallel logits [s, b, vp] with the tied word embedding.

        copy_to (forward identity, backward all-reduce) gives every rank the full gradient of the
        replicated hidden state, since each rank's logits depend on it through its own rows. With
        sequence parallelism hidden is this rank's [s/tp, b, h]; the gather's backward reduce-scatters,
        the same sum kept for this rank's tokens only.
        """
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)  # [s, b, h]
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, self.tp_group)  # [s, b, h]
        return linear(hidden, self.word_embeddings.weight, None, self.weight_grad_store)  # [s, b, vp]


class OutputLayer(ColumnParallelLinear):
    """The untied output head: hidden [s, b, h] -> vocab-parallel logits [s, b, vp].

    logits = hidden @ W^T with W [v, h] split along the vocabulary (rank r: rows [r * vp, (r + 1) * vp)),
    no bias; the column-parallel input copy (forward identity, backward all-reduce) gives every rank
    the full gradient of the replicated hidden state, as the tied head's does (with sequence parallelism
    the layer's input all-gather along s instead, backward reduce-scatter). Parameter
    ``weight`` [vp, h], tagged ``vocab_parallel`` (rows are the padded vocabulary).
    """

    def __init__(self, config: ModelConfig, tp_group=None):
        super().__init__(config.hidden_size, config.padded_vocab_size, tp_group=tp_group, bias=False,
                         gather_output=False, params_dtype=params_torch_dtype(config),
                         sequence_parallel=config.sequence_parallel and group_size(tp_group) > 1,
                         init_method=normal_init(config.init_method_std, config.seed, "output_layer.weight"))
        self.weight.vocab_parallel = True
        self.weight.is_embedding_or_output_parameter = True  # --decoupled-lr's (megatron.engine.optimizer)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits, _ = super().forward(hidden)  # [s, b, vp]
        return logits
