"""The optimizer and its learning-rate schedule: ``OptimizerConfig`` (the client optimizer DeepSpeed gets: AdamW,
SGD or Muon, its learning rates and state dtypes) and ``LRScheduleConfig`` (Megatron's AnnealingLR lengths, in
iterations, samples or Megatron-DeepSpeed's tokens). Parts of ``megatron.config.run.RunConfig``."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.config._checks import _one_of, _positive
from megatron.config.muon import check_muon

LR_DECAY_STYLES = ("linear", "cosine", "constant")
OPTIMIZERS = ("adam", "sgd", "muon")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The client optimizer handed to DeepSpeed (torch AdamW or SGD), and gradient clipping."""

    optimizer: str = "adam"        # adam (decoupled weight decay, i.e. AdamW, as Megatron's Adam) | sgd
    lr: float = 1e-4               # peak learning rate, reached at the end of warmup
    min_lr: float = 0.0            # floor of the decay; held after the decay ends
    # Megatron-LM's decoupled learning rate: the word embedding's and the output layer's own peak (and floor; None:
    # min_lr), on the same schedule shape
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    # Megatron-LM's precision-aware optimizer: Adam's moments stored in fp32 | bf16 | fp16
    # (megatron.engine.adam_state_dtypes); needs use_precision_aware_optimizer, as there
    use_precision_aware_optimizer: bool = False
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9      # sgd only
    weight_decay: float = 0.01     # not applied to biases and norms (megatron.engine.optimizer)
    clip_grad: float = 1.0         # max global L2 norm of the gradients; 0 disables clipping
    # --optimizer muon (megatron.engine.muon; flags: megatron.arguments.muon_flags, Megatron-LM's names)
    muon_momentum: float = 0.9
    muon_nesterov: bool = False
    muon_split_qkv: bool = True    # --muon-no-split-qkv clears it
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "duplicated"
    muon_use_syrk: bool = False
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"

    @property
    def betas(self) -> tuple[float, float]:
        return (self.adam_beta1, self.adam_beta2)

    def validate(self) -> "OptimizerConfig":
        _one_of("--optimizer", self.optimizer, OPTIMIZERS)
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr {self.min_lr} must be between 0 and --lr {self.lr}; lower --min-lr")
        for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            value = getattr(self, name)
            _one_of(f"--{name.replace('_', '-')}", value, ("fp32", "bf16", "fp16"))
            if value != "fp32" and not self.use_precision_aware_optimizer:
                raise ValueError(f"--{name.replace('_', '-')} {value} needs --use-precision-aware-optimizer (as in "
                                 "Megatron-LM); add it or keep fp32")
            if value != "fp32" and self.optimizer != "adam":
                raise ValueError(f"--{name.replace('_', '-')} {value} stores Adam's moments; it needs --optimizer "
                                 f"adam, not {self.optimizer}")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ValueError(f"--decoupled-min-lr {self.decoupled_min_lr} needs --decoupled-lr (the embedding's and "
                             "output layer's peak); add it or drop --decoupled-min-lr")
        if self.decoupled_lr is not None:
            floor = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            if not self.decoupled_lr > 0 or not 0 <= floor <= self.decoupled_lr:
                raise ValueError(f"--decoupled-lr {self.decoupled_lr} must be positive and at least its floor "
                                 f"{floor} (--decoupled-min-lr, else --min-lr) >= 0")
        for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0:
            raise ValueError(f"--adam-eps must be positive, got {self.adam_eps}")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise ValueError(f"--weight-decay {self.weight_decay} and --clip-grad {self.clip_grad} must be >= 0")
        if self.optimizer == "muon":
            check_muon(self)
        return self


@dataclasses.dataclass(frozen=True)
class LRScheduleConfig:
    """Megatron's AnnealingLR: linear warmup 0 -> lr, then decay to min_lr, then min_lr.

    Exactly one unit is used, chosen by the run: iterations with --train-iters, samples with
    --train-samples. As in Megatron the scheduler always counts consumed samples: iteration
    values are multiplied by the global batch size (see ``RunConfig.lr_schedule_in_samples``).
    """

    lr_decay_style: str = "linear"          # linear | cosine | constant (constant: lr after warmup, forever)
    lr_decay_iters: Optional[int] = None    # iteration-based decay length; None: --train-iters
    lr_decay_samples: Optional[int] = None  # sample-based decay length; None: --train-samples
    lr_warmup_iters: int = 0                # iteration-based warmup length
    lr_warmup_samples: int = 0              # sample-based warmup length
    lr_warmup_fraction: Optional[float] = None  # warmup as a fraction of the decay length (either unit)
    lr_warmup_init: float = 0.0             # Megatron-LM: the rate the linear warmup starts from
    lr_decay_tokens: Optional[int] = None   # Megatron-DeepSpeed's token-based decay length (overrides the others)
    lr_warmup_tokens: Optional[int] = None  # token-based warmup length (needs lr_decay_tokens)
    override_lr_scheduler: bool = False     # on resume, keep these values over the checkpoint's
    use_checkpoint_lr_scheduler: bool = False  # on resume, take the checkpoint's values over these

    def validate(self) -> "LRScheduleConfig":
        _one_of("--lr-decay-style", self.lr_decay_style, LR_DECAY_STYLES)
        _positive("--lr-decay-iters", self.lr_decay_iters, allow_none=True)
        _positive("--lr-decay-samples", self.lr_decay_samples, allow_none=True)
        if self.lr_warmup_iters < 0 or self.lr_warmup_samples < 0:
            raise ValueError(f"--lr-warmup-iters {self.lr_warmup_iters} and --lr-warmup-samples "
                             f"{self.lr_warmup_samples} must be >= 0")
        if self.lr_warmup_fraction is not None:
            if not 0 <= self.lr_warmup_fraction < 1:
                raise ValueError(f"--lr-warmup-fraction must be in [0, 1), got {self.lr_warmup_fraction}")
            if self.lr_warmup_iters or self.lr_warmup_samples:
                raise ValueError("give one of --lr-warmup-fraction, --lr-warmup-iters, --lr-warmup-samples; got "
                                 f"fraction {self.lr_warmup_fraction}, iters {self.lr_warmup_iters}, "
                                 f"samples {self.lr_warmup_samples}")
        _positive("--lr-decay-tokens", self.lr_decay_tokens, allow_none=True)
        if self.lr_warmup_init < 0:
            raise ValueError(f"--lr-warmup-init must be >= 0, got {self.lr_warmup_init}")
        if self.lr_warmup_tokens is not None:
            if self.lr_decay_tokens is None:
                raise ValueError(f"--lr-warmup-tokens {self.lr_warmup_tokens} needs --lr-decay-tokens (a token warm-up "
                                 "before an iteration or sample decay mixes units); add --lr-decay-tokens")
            if self.lr_warmup_tokens < 0 or self.lr_warmup_iters or self.lr_warmup_samples or \
                    self.lr_warmup_fraction is not None:
                raise ValueError(f"--lr-warmup-tokens {self.lr_warmup_tokens}: give one non-negative warm-up "
                                 "(tokens, iterations, samples or a fraction)")
        if self.override_lr_scheduler and self.use_checkpoint_lr_scheduler:
            raise ValueError("--override-lr-scheduler and --use-checkpoint-lr-scheduler contradict each other; "
                             "pass one")
        return self
