"""The multi-token prediction flags (one argument group): Megatron-LM's ``--mtp-num-layers`` and
``--mtp-loss-scaling-factor`` (the model: ``megatron.model.mtp``; the rules: ``ModelConfig``'s).
"""

from __future__ import annotations

__all__ = ["add_mtp_arguments"]


def add_mtp_arguments(parser) -> None:
    g = parser.add_argument_group("multi-token prediction (--mtp-num-layers)")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="Multi-token prediction (DeepSeek-V3; Megatron-LM's flag): N extra depths after the final "
                        "norm, depth k predicting token i+1+k from the previous depth's hidden state and the "
                        "embedding of token i+k, through one transformer layer of the model's kind and the shared "
                        "embedding and output head. Their loss is added to the training loss; the reported LM loss "
                        "stays the next-token one (the MTP losses are logged as 'mtp_k loss'). Default: none.")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="The weight of the MTP losses: the training loss adds this x their mean over the depths "
                        "(Megatron-LM's default 0.1; DeepSeek-V3 used 0.3, then 0.1).")
