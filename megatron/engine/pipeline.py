"""The GPT/BLOOM/Llama-style model as a DeepSpeed ``PipelineModule``, built from the model's own modules.

There is one network, in ``megatron.model``; this file only lists its modules as pipeline layers,
in the order ``megatron.model.layout.pipeline_items`` gives (the index checkpoints number files by):

    pass_through                                 BLOOM's fp16 cast (0): inputs unchanged
    TiedLayerSpec("embed", EmbeddingPipe)        (input_ids, position_ids) -> hidden [s, b, h]
    pass_through                                 BLOOM's transpose (2): hidden unchanged
    LayerSpec(TransformerLayer) x num_layers     hidden -> hidden
    end_of_layers                                BLOOM's transpose back (L+3): hidden unchanged
    LayerSpec(FinalLayerNorm)                    hidden -> hidden
    TiedLayerSpec("embed", LMHeadPipe, forward_fn=lm_head_forward)
                                                 hidden -> vocab-parallel logits [s, b, vp]
    loss_fn = GPTLossFn                          (logits, (labels, loss_mask)) -> scalar

With --reset-attention-mask the first stage reads (input_ids, position_ids, document_ids) and the activation
between the embedding and slot L+3 is the tuple (hidden, document_ids): the document ids [b, s] (int64, no
gradient; DeepSpeed's engine and the interleaved schedule send non-float tensors without one) travel with the
hidden state to every stage's layers (``TransformerLayer.forward``); slot L+3 drops them.

With --untie-embeddings-and-output-weights there is no tied module: the embedding is a plain
``LayerSpec(EmbeddingPipe)`` and the head ``LayerSpec(OutputLayer)`` with its own weight.

With --mtp-num-layers (``megatron.model.mtp``) two items come between the final norm and the head:
    TiedLayerSpec("embed", LMHeadPipe, forward_fn=pass_hidden)   the word embedding's last-stage copy (the embedding
                                                 is then tied whatever the head's tie); hidden unchanged
    LayerSpec(MTPPipe)                           the depths' parameters; hidden unchanged
and the head returns (logits, hidden). The depths run in the loss function (``GPTLossFn.attach_mtp``): they need
the shifted tokens, and the last stage of DeepSpeed's pipeline engine sees only the labels, which are the inputs
shifted once (the depths' embedded tokens, megatron.model.mtp).

The pass-through slots are plain functions, so DeepSpeed writes no file for them, as for BLOOM's.
(With --checkpoint-num-layers above 1, a run of layers that includes a slot is not recomputed:
DeepSpeed recomputes only runs made of TransformerLayers.) The embedding's layer file uses
BLOOM's key for its LayerNorm (``word_embeddings.norm.*``; ``embed_layernorm.*`` in memory).

A tied word embedding lives on the first and the last stage (DeepSpeed keeps the two copies tied and
all-reduces their gradients). Every module initializes from (seed, its own identity) only, so a
stage holding layers 4..7 starts exactly as the same layers of a single-stage model.

With ``--num-virtual-stages-per-pipeline-rank`` v > 1 the same specs are cut into PP x v chunks and each rank
builds v of them (``megatron.engine.schedules.interleaved``); layer files keep the same numbers.

``--pp-partition-method``: DeepSpeed's own methods. ``type:transformer`` balances the transformer
layers (regex on class names, case-insensitive); ``type:transformer|embedding`` counts the two
embeddings as layers too (BLOOM-176B's setting); ``parameters`` balances parameter counts;
``uniform`` balances the number of specs. Megatron-LM's pipeline layout flags (--pipeline-model-parallel-layout,
--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split) place the layers
instead: ``parts`` (``megatron.engine.partition.virtual_stage_bounds``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megatron.config import PARTITION_METHODS, ModelConfig
from megatron.engine.schedules.interleaved import InterleavedPipelineModule, PartedPipelineModule
from megatron.engine.ulysses import sequence_parallel_loss
from megatron.model import EmbeddingLayer, FinalLayerNorm, OutputLayer, TransformerLayer, gpt_loss, per_token_loss
from megatron.model.layout import (
    EMBEDDING,
    FINAL_NORM,
    HEAD,
    MTP,
    MTP_EMBEDDING,
    PASS_THROUGH,
    TRANSFORMER,
    PipelineItem,
    file_key,
    local_name_of_file_key,
    pipeline_items,
)
from megatron.model.mtp import MultiTokenPrediction, add_mtp_loss, mtp_depth_losses
from megatron.parallel.context_parallel import gather_sequence, load_balanced_positions
from megatron.parallel.random import RNGStatesTracker, tracked_checkpoint_func
from megatron.parallel.state import ParallelState


def _to_file_keys(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + file_key(key[len(prefix):])] = state_dict.pop(key)


def _from_file_keys(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                    error_msgs) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + local_name_of_file_key(key[len(prefix):])] = state_dict.pop(key)


class EmbeddingPipe(EmbeddingLayer):
    """The embedding as a pipeline layer: takes the (input_ids, position_ids) tuple DeepSpeed passes.
    Its state dict (hence its layer file) uses the checkpoint layout's keys (``file_key``)."""

    def __init__(self, config: ModelConfig, tp_group=None, rng_tracker=None):
        super().__init__(config, tp_group, rng_tracker)
        self.register_state_dict_post_hook(_to_file_keys)
        self.register_load_state_dict_pre_hook(_from_file_keys)

    def forward(self, inputs):
        input_ids, position_ids, *documents = inputs  # --reset-attention-mask: the document ids [b, s] too
        hidden = super().forward(input_ids, position_ids)  # [s, b, h]
        return (hidden, documents[0]) if documents else hidden


class LMHeadPipe(EmbeddingLayer):
    """The tied output head's module on the last stage: the word embedding only.

    Positions and the embedding LayerNorm are used on the first stage alone; a copy on the last
    stage would never train, and checkpoint tools would meet two different tensors of one name.
    (With a single stage, DeepSpeed builds the tied module once, from the first spec: EmbeddingPipe.)
    """

    def __init__(self, config: ModelConfig, tp_group=None, rng_tracker=None):
        super().__init__(config, tp_group, rng_tracker)
        self.position_embeddings = None
        self.embed_layernorm = None


def lm_head_forward(embedding: EmbeddingLayer, hidden: torch.Tensor) -> torch.Tensor:
    """The tied output head on the last stage: hidden [s, b, h] -> logits [s, b, vp]."""
    return embedding.lm_logits(hidden)


def pass_through(inputs):
    """A parameter-free slot of BLOOM's pipeline numbering (``megatron.model.layout.PASS_THROUGH``)."""
    return inputs


def end_of_layers(inputs):
    """The slot after the transformer layers (L+3, BLOOM's transpose back): the hidden state, without the document
    ids that travel with it under --reset-attention-mask."""
    return inputs[0] if isinstance(inputs, tuple) else inputs


def pass_hidden(embedding: EmbeddingLayer, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP embedding slot (``megatron.model.layout.MTP_EMBEDDING``): holds the tied word embedding on the last
    stage for the MTP depths (the loss function embeds with it); the hidden state passes unchanged."""
    return hidden


class MTPPipe(MultiTokenPrediction):
    """The MTP depths as a pipeline layer: their parameters (and layer file); the hidden state passes unchanged,
    the depths run in ``GPTLossFn`` (the module docstring)."""

    def __init__(self, config: ModelConfig, groups=None, rng_tracker=None):
        super().__init__(config, groups, rng_tracker)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class OutputPipe(OutputLayer):
    """The untied head of a model with MTP: hidden -> (logits, hidden), the hidden state for the depths."""

    def forward(self, hidden: torch.Tensor):
        return super().forward(hidden), hidden


def lm_head_forward_with_hidden(embedding: EmbeddingLayer, hidden: torch.Tensor):
    """The tied head of a model with MTP: hidden -> (logits, hidden)."""
    return embedding.lm_logits(hidden), hidden


class GPTLossFn:
    """Pipeline loss: masked mean of the vocab-parallel cross-entropy over the micro-batch.

    With context parallelism (``cp_group``) each rank holds 1/cp of the tokens: its part of the whole sequence's
    masked mean (the mask count all-reduced over the group), times cp, because DeepSpeed averages gradients and
    reported losses over the data axis, which holds the dp x cp ranks (Megatron-LM scales by cp likewise).

    ``tokens_per_micro_batch``: set for a step by ``megatron.training.token_count`` (--calculate-per-token-loss
    with a loss mask): the masked sum divided by it instead of by the micro-batch's own count."""

    def __init__(self, tp_group, cp_group=None, cp_size: int = 1):
        self.tp_group, self.cp_group, self.cp_size = tp_group, cp_group, cp_size
        self.tokens_per_micro_batch = None
        self.mtp = None  # (MultiTokenPrediction, word embedding, head) on a last stage with MTP: attach_mtp

    def attach_mtp(self, block: MultiTokenPrediction, embedding: EmbeddingLayer, head) -> None:
        """Run the MTP depths after the main loss: ``head(hidden)`` -> logits is the stage's own output head."""
        self.mtp = (block, embedding, head)

    def __call__(self, output, labels) -> torch.Tensor:
        if self.mtp is None:
            return self._loss(output, labels)
        logits, hidden = output
        block, embedding, head = self.mtp
        target, loss_mask = labels
        sequence = None
        if self.cp_group is not None:  # this rank's load-balanced tokens: shift on the whole sequence
            positions = load_balanced_positions(target.shape[1] * self.cp_size, self.cp_size,
                                                dist.get_rank(self.cp_group), target.device)
            sequence = (lambda x: gather_sequence(x, self.cp_group), positions)
        depth_losses = mtp_depth_losses(
            block, hidden, target, loss_mask, lambda ids: EmbeddingLayer.forward(embedding, ids),
            lambda h, t, m: self._loss(head(h), (t, m)), sequence)
        return add_mtp_loss(self._loss(logits, labels), block, depth_losses)

    def _loss(self, logits: torch.Tensor, labels) -> torch.Tensor:
        target, loss_mask = labels
        if self.tokens_per_micro_batch is not None:  # no CP here (RunConfig refuses it)
            loss = per_token_loss(logits, target, self.tp_group)
            return (loss * loss_mask.to(torch.float32)).sum() / self.tokens_per_micro_batch
        if self.cp_group is None:
            return gpt_loss(logits, target, loss_mask, self.tp_group)
        part = sequence_parallel_loss(per_token_loss(logits, target, self.tp_group), loss_mask, self.cp_group)
        return part * self.cp_size


def _spec(item: PipelineItem, config: ModelConfig, state: ParallelState, tracker: Optional[RNGStatesTracker]):
    embed = dict(tied_weight_attr="word_embeddings.weight", tp_group=state.tp_group, rng_tracker=tracker)
    if item.kind == EMBEDDING:
        if not config.embedding_on_last_stage:
            return LayerSpec(EmbeddingPipe, config, tp_group=state.tp_group, rng_tracker=tracker)
        return TiedLayerSpec("embed", EmbeddingPipe, config, **embed)
    if item.kind == TRANSFORMER:
        return LayerSpec(TransformerLayer, config, groups=state.layer_groups(), layer_number=item.layer_number,
                         rng_tracker=tracker)
    if item.kind == FINAL_NORM:
        return LayerSpec(FinalLayerNorm, config, tp_group=state.tp_group)
    if item.kind == MTP_EMBEDDING:
        return TiedLayerSpec("embed", LMHeadPipe, config, forward_fn=pass_hidden, **embed)
    if item.kind == MTP:
        return LayerSpec(MTPPipe, config, groups=state.layer_groups(), rng_tracker=tracker)
    if item.kind == HEAD:
        mtp = config.mtp_num_layers > 0
        if not config.tied_embeddings:
            return LayerSpec(OutputPipe if mtp else OutputLayer, config, tp_group=state.tp_group)
        return TiedLayerSpec("embed", LMHeadPipe, config,
                             forward_fn=lm_head_forward_with_hidden if mtp else lm_head_forward, **embed)
    if item.kind == PASS_THROUGH:
        return end_of_layers if item.index == config.num_layers + 3 else pass_through
    raise AssertionError(f"no pipeline spec for layer kind {item.kind!r}")


def layer_specs(config: ModelConfig, state: ParallelState, tracker: Optional[RNGStatesTracker]) -> list:
    """The ordered pipeline layers of the model, one spec per ``megatron.model.layout.pipeline_items``."""
    return [_spec(item, config, state, tracker) for item in pipeline_items(config)]


def build_pipeline_module(config: ModelConfig, state: ParallelState, *, partition_method: str = "type:transformer",
                          activation_checkpoint_interval: int = 0, tracker: Optional[RNGStatesTracker] = None,
                          num_virtual_stages: int = 1, parts: Optional[Sequence[int]] = None) -> PipelineModule:
    """The model's stage for this rank, on a topology identical to ``state``'s layout.

    num_virtual_stages: above 1, the rank's v chunks for the interleaved schedule (``megatron.engine.schedules.interleaved``).

    parts: the PP x v stages' bounds over ``layer_specs`` from the pipeline layout flags
    (``megatron.engine.partition.virtual_stage_bounds``), in place of ``partition_method``'s; None: the method's.

    activation_checkpoint_interval: recompute the activations of every run of this many layers in
    backward (``--checkpoint-num-layers`` with ``--checkpoint-activations``); 0 keeps them all.
    """
    if partition_method not in PARTITION_METHODS:
        raise ValueError(f"--pp-partition-method {partition_method!r} is not one of {', '.join(PARTITION_METHODS)}")
    if state.sp_size > 1:
        raise ValueError(f"the pipeline engine has no DeepSpeed-Ulysses (this layout has sequence-parallel size "
                         f"{state.sp_size}); build the model with megatron.engine.model_engine.build_model_module")
    if parts is None and partition_method == "type:transformer" and config.num_layers < state.pp_size:
        raise ValueError(f"--num-layers {config.num_layers} is smaller than --pipeline-model-parallel-size "
                         f"{state.pp_size}: every stage needs at least one transformer layer")
    # Context parallelism: DeepSpeed's data axis holds the dp x cp ranks (CP innermost, as in our layout), so
    # that it reduces gradients and partitions ZeRO-1 state over both, as Megatron's data-parallel-with-CP group.
    topology = PipeModelDataParallelTopology(num_pp=state.pp_size, num_mp=state.tp_size,
                                             num_dp=state.dp_size * state.cp_size)
    data_rank = state.dp_rank * state.cp_size + state.cp_rank
    assert topology.get_rank(pipe=state.pp_rank, data=data_rank, model=state.tp_rank) == dist.get_rank()
    # The constructor copies the tied word embedding from the first stage to the last with an in-place
    # dist.broadcast of the parameter. c10d::broadcast_ has no autograd kernel: in grad mode torch's fallback
    # then warns on every backward that reaches the parameter ("c10d::broadcast_: an autograd kernel was not
    # registered ... may lead to silently incorrect behavior"), on each rank holding the tie. The gradients
    # were right (the fallback passes them through), but copying weights is not part of the model's function:
    # no grad is what is meant. checkpoint/training_io.load_checkpoint does the same for DeepSpeed's re-sync.
    module_class, chunks = PipelineModule, {}
    if parts is not None:
        module_class, chunks = PartedPipelineModule, dict(parts=parts)
    if num_virtual_stages > 1:
        module_class, chunks = InterleavedPipelineModule, dict(chunks, num_virtual_stages=num_virtual_stages)
    loss_fn = GPTLossFn(state.tp_group, state.cp_group, state.cp_size)
    with torch.no_grad():
        module = module_class(
            layers=layer_specs(config, state, tracker),
            topology=topology,
            loss_fn=loss_fn,
            partition_method=partition_method,
            activation_checkpoint_interval=activation_checkpoint_interval,
            activation_checkpoint_func=tracked_checkpoint_func(tracker),
            checkpointable_layers=["TransformerLayer"],
            seed_layers=False,
            **chunks,
        )
    _attach_mtp(module, loss_fn)
    return module


def _attach_mtp(module: PipelineModule, loss_fn: GPTLossFn) -> None:
    """On the stage holding the MTP depths (the last), hand them, the tied word embedding and the head to the loss."""
    funcs = [f for chunk in getattr(module, "chunk_funcs", [module.forward_funcs]) for f in chunk]  # interleaved: v
    blocks = [f for f in funcs if isinstance(f, MTPPipe)]
    if not blocks:
        return
    embedding = module.tied_modules["embed"]
    heads = [f for f in funcs if isinstance(f, OutputPipe)]
    head = (lambda hidden: OutputLayer.forward(heads[0], hidden)) if heads else embedding.lm_logits
    loss_fn.attach_mtp(blocks[0], embedding, head)
