"""ModelConfig: the decoder's architecture (what a checkpoint must agree on) and its init."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.config._checks import _one_of
from megatron.config.combinations import refusal
from megatron.config.fp8 import FP8Config
from megatron.config.mla import MLAConfig
from megatron.config.moe import MoEConfig

POSITION_EMBEDDING_TYPES = ("absolute", "rotary", "alibi", "none")
NORMALIZATIONS = ("layernorm", "rmsnorm")
PARAMS_DTYPES = ("fp32", "bf16", "fp16")
ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "flash", "unfused")
# --recompute-modules' choices (Megatron-LM's names; its gated-delta-net and mHC modules have no model here)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def swiglu_default_ffn_size(hidden_size: int) -> int:
    """Megatron's MLP width for --swiglu without --ffn-hidden-size: 2/3 of 4h (the gated MLP has three
    matrices instead of two, so the parameter count stays that of a 4h GeLU MLP), rounded down to a
    multiple of 64."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64


def megatron_flops(num_layers: int, hidden_size: int, vocab_size: int, seq_length: int, global_batch_size: int,
                   recompute: bool, *, ffn_hidden_size: Optional[int] = None, kv_hidden_size: Optional[int] = None,
                   swiglu: bool = False, query_hidden_size: Optional[int] = None, mtp_num_layers: int = 0,
                   mla: Optional[MLAConfig] = None, num_attention_heads: Optional[int] = None) -> float:
    """Megatron's FLOPs per iteration (its "TFLOPs" formula), read by the training log and the planner alike.

    c B s (L (2 P + 4 s q) + 1.5 V h), with c = 4 (forward + recomputed forward + backward) when
    activations are recomputed, else 3; P the weights of one layer's matrices, h (q + 2 kv) + q h + m f h
    (q = query_hidden_size, the query heads' width heads x head size, default h; kv = kv_hidden_size, the key /
    value heads' width, default h; m = 3 matrices with SwiGLU, else 2; f = ffn_hidden_size, default 4h); 4 s q
    the attention scores and context per token; V the padded vocabulary. With the defaults (P = 12 h^2) this is
    Megatron's 24 c B s L h^2 (1 + s / (6h) + V / (16 L h)).

    ``mtp_num_layers`` D (multi-token prediction; ``num_layers`` then counts the decoder's layers and the depths'
    alike, as Megatron-LM's count does): each depth adds its projection and norms, 2 (2 h^2 + 3 h) per token, and
    its own logits, 1.5 V h.

    ``mla`` (multi-head latent attention, with ``num_attention_heads``): the attention's part of P is MLA's
    projections (``MLAConfig.matmul_weights``) and 4 s q its scores and context (q = ``MLAConfig.score_width``),
    as Megatron-LM counts MLA (without its causal halving, as this formula's attention term).
    """
    s, L, h, V = seq_length, num_layers, hidden_size, vocab_size
    f = ffn_hidden_size if ffn_hidden_size is not None else 4 * h
    kv = kv_hidden_size if kv_hidden_size is not None else h
    q = query_hidden_size if query_hidden_size is not None else h
    c = 4 if recompute else 3
    attention = h * (q + 2 * kv) + q * h
    if mla is not None:
        attention, q = mla.matmul_weights(h, num_attention_heads), mla.score_width(num_attention_heads)
    layer_weights = attention + (3 if swiglu else 2) * f * h
    mtp = mtp_num_layers * 2 * (2 * h * h + 3 * h)
    return c * global_batch_size * s * (L * (2 * layer_weights + 4 * s * q) + mtp + 1.5 * V * h * (1 + mtp_num_layers))


def mlp_flops_width(num_layers: int, ffn: int, swiglu: bool, num_moe_layers: int = 0, topk: int = 0,
                    expert_ffn: int = 0, shared_expert_ffn: int = 0, num_experts: int = 0) -> float:
    """The dense MLP width with the same matmul cost per token, averaged over the layers: ``ffn`` for a dense layer;
    for an MoE layer ``topk`` x the expert width + the shared expert's + the router's E / m (m = 3 matrices with
    SwiGLU, else 2), what Megatron-LM counts (dropped tokens are not subtracted). ``ModelConfig`` and the planner's
    ``ModelShape`` both ask this."""
    moe_width = topk * expert_ffn + shared_expert_ffn + num_experts / (3 if swiglu else 2)
    return ((num_layers - num_moe_layers) * ffn + num_moe_layers * moe_width) / num_layers


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A GPT / BLOOM / Llama-style decoder. Sequence-first activations [s, b, h].

    The variants are settings of one block: ``normalization`` (LayerNorm or RMSNorm), ``swiglu`` (gated
    SiLU MLP instead of GeLU), ``num_key_value_heads`` (grouped-query attention; 1 is multi-query),
    ``position_embedding_type``, ``add_bias_linear`` / ``add_qkv_bias`` and
    ``untie_embeddings_and_output_weights``. Llama: rmsnorm, swiglu, rotary, no biases, untied.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    padded_vocab_size: int                 # rows of the word embedding, divisible by TP
    seq_length: int
    max_position_embeddings: Optional[int] = None  # learned positions only; defaults to seq_length
    ffn_hidden_size: Optional[int] = None  # defaults to 4 * hidden_size (swiglu: swiglu_default_ffn_size)
    position_embedding_type: str = "absolute"      # absolute | rotary | alibi | none
    num_key_value_heads: Optional[int] = None      # key / value heads (query groups); None: one per query head
    # --kv-channels, Megatron-LM's head size: each query / key / value head's width, independent of the hidden size
    # (Qwen3: 128 with hidden 4096 and 64 heads). None: hidden_size / num_attention_heads.
    kv_channels: Optional[int] = None
    normalization: str = "layernorm"       # layernorm | rmsnorm: every norm of the model (layernorm_epsilon)
    swiglu: bool = False                   # MLP silu(x W_gate) * (x W_up) instead of gelu(x W1)
    add_bias_linear: bool = True           # biases in every linear layer (False: --disable-bias-linear)
    add_qkv_bias: bool = False             # a bias in the QKV projection even without add_bias_linear (Qwen2)
    qk_layernorm: bool = False             # normalization (the model's kind) of each query / key head (Qwen3)
    apply_layernorm_1p: bool = False       # Megatron-LM's zero-centred norm weights: every norm scales by 1 + w
    untie_embeddings_and_output_weights: bool = False  # an output head of its own instead of the word embedding
    embed_layernorm: bool = False          # LayerNorm right after the word embedding (BLOOM)
    layernorm_epsilon: float = 1e-5
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02          # normal(0, std); output projections std / sqrt(2 * num_layers)
    rotary_base: float = 10000.0
    # Llama 3.1's rope scaling (--use-rope-scaling): frequencies whose wavelength exceeds the original context
    # / low_freq_factor are divided by the factor, those below original / high_freq_factor kept, the band
    # between interpolated. None: plain rotary.
    rope_scaling_factor: Optional[float] = None
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_positions: int = 8192
    # YaRN (Megatron-LM's --position-embedding-type yarn, MLA's --rope-type yarn): a model trained on
    # yarn_original_max_position_embeddings positions extended yarn_rotary_scaling_factor times; the ramp between
    # beta_fast and beta_slow turns per original context mixes kept and interpolated frequencies, and mscale /
    # mscale_all_dim scale the attention (megatron.model.positional.Yarn). None (or 1): plain rotary. Not an
    # architecture field: a long-context phase resumes a checkpoint trained without it.
    yarn_rotary_scaling_factor: Optional[float] = None
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    params_dtype: str = "fp32"             # fp32 | bf16 | fp16: dtype of the module parameters
    original_vocab_size: Optional[int] = None      # the tokenizer's vocabulary before padding
    seed: int = 1234                       # initialization seed (each layer's weights depend on it and its index only)
    # How, not what: execution choices a checkpoint does not record (like the dropout rates above).
    attention_backend: str = "auto"        # auto | sdpa | flex | flash | unfused: the attention core's kernel (attention_core.py)
    # --recompute-granularity selective: keep only the attention core's inputs (q, k, v) in forward and recompute
    # softmax(QK^T)V in backward (Korthikanti et al. 2022: the 5as/h part of the activations, for little compute).
    recompute_core_attention: bool = False
    # --recompute-modules (with --recompute-granularity selective; Megatron-LM's names) other than core_attn, which
    # is recompute_core_attention above: each named part of every layer keeps only its inputs for backward and is
    # recomputed there (megatron.parallel.recompute). layernorm: both norms' outputs; mlp: the dense MLP; moe: the
    # whole MoE layer (router, dispatch, experts, shared expert); moe_act: the experts' activation; shared_experts:
    # the shared expert; mla_up_proj: MLA's up-projections and RoPE (the query, key and value).
    recompute_modules: tuple[str, ...] = ()
    # --sequence-parallel (Korthikanti et al. 2022) with TP > 1: norms, dropout and residual adds run on this TP
    # rank's [s/tp, b, h] shard of the sequence; column-parallel inputs are all-gathered along s, row-parallel
    # outputs reduce-scattered. Changes no parameter; a model built for decoding leaves it False.
    sequence_parallel: bool = False
    # Mixture of experts (--num-experts): the MLP of the layers moe.layer_pattern marks is routed experts; None: dense.
    moe: Optional[MoEConfig] = None
    # Multi-head latent attention (--multi-latent-attention, DeepSeek-V3) in every layer; None: the fused-QKV attention.
    mla: Optional[MLAConfig] = None
    # FP8 GEMMs in the transformer layers' linear layers (--fp8-format, megatron.config.fp8); None: the run's precision.
    fp8: Optional[FP8Config] = None
    # Multi-token prediction (--mtp-num-layers, DeepSeek-V3): that many extra depths after the final norm, each
    # predicting one token further with the shared embedding and output head (megatron.model.mtp); their mean loss,
    # times --mtp-loss-scaling-factor, is added to the training loss (not to the reported LM loss).
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1

    @property
    def expert_ffn_size(self) -> int:
        """Each expert's MLP width: --moe-ffn-hidden-size, else the dense MLP's."""
        moe_width = self.moe.ffn_hidden_size if self.moe is not None else None
        return moe_width if moe_width is not None else self.ffn_size

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return swiglu_default_ffn_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size

    @property
    def num_kv_heads(self) -> int:
        """Key / value heads: ``num_key_value_heads``, or one per query head (multi-head attention)."""
        return self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def embedding_on_last_stage(self) -> bool:
        """Whether the last pipeline stage holds a copy of the word embedding, tied to the first stage's: for the tied
        output head, or for the MTP depths (megatron.model.mtp), which embed tokens with it."""
        return self.tied_embeddings or self.mtp_num_layers > 0

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length

    @property
    def head_dim(self) -> int:
        """Each attention head's width hn: --kv-channels, else hidden / heads."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def query_hidden_size(self) -> int:
        """The query heads' (and the attention context's) width, heads x hn: the QKV projection's query rows and
        the output projection's input; the hidden size unless --kv-channels says otherwise."""
        return self.num_attention_heads * self.head_dim

    @property
    def mlp_flops_width(self) -> float:
        """The dense MLP width with the same matmul cost per token, averaged over the layers: f for a dense layer;
        for an MoE layer k x the expert width + the shared expert's + the router's E / m (m = 3 matrices with
        SwiGLU, else 2), what Megatron-LM counts (dropped tokens are not subtracted)."""
        moe = self.moe
        if moe is None:
            return self.ffn_size
        num_moe = sum(moe.layer_pattern) + self.mtp_num_layers * moe.layer_pattern[-1]  # the MTP layers: the last's kind
        return mlp_flops_width(self.total_layers, self.ffn_size, self.swiglu, num_moe, moe.router_topk,
                               self.expert_ffn_size, moe.shared_expert_intermediate_size or 0, moe.num_experts)

    def flops_per_iteration(self, global_batch_size: int, recompute: bool) -> float:
        """``megatron_flops`` of this model (``padded_vocab_size`` rows) for one global batch (an MoE model's
        MLPs counted by ``mlp_flops_width``)."""
        return megatron_flops(self.total_layers, self.hidden_size, self.padded_vocab_size, self.seq_length,
                              global_batch_size, recompute, ffn_hidden_size=self.mlp_flops_width,
                              kv_hidden_size=self.num_kv_heads * self.head_dim, swiglu=self.swiglu,
                              query_hidden_size=self.query_hidden_size, mtp_num_layers=self.mtp_num_layers,
                              mla=self.mla, num_attention_heads=self.num_attention_heads)

    def validate(self, tensor_model_parallel_size: int = 1) -> "ModelConfig":
        """Raise ValueError for an impossible configuration; return self so calls can chain."""
        tp = tensor_model_parallel_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size", "seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.kv_channels is not None and (not isinstance(self.kv_channels, int) or self.kv_channels < 1):
            raise ValueError(f"--kv-channels must be a positive integer, got {self.kv_channels!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % tp:
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                             f"--tensor-model-parallel-size {tp}; each TP rank must hold whole heads")
        self._validate_attention(tp)
        self._validate_moe(tp)
        self._validate_mla()
        self._validate_fp8()
        self._validate_mtp()
        self._validate_recompute_modules()
        if self.sequence_parallel and self.seq_length % tp:
            raise ValueError(f"--sequence-parallel splits the sequence over the {tp} tensor-parallel ranks, but "
                             f"--seq-length {self.seq_length} is not a multiple of --tensor-model-parallel-size {tp}; "
                             f"use a multiple of {tp} or drop --sequence-parallel")
        if self.ffn_size < 1:
            raise ValueError(f"ffn hidden size {self.ffn_size} must be positive: set --ffn-hidden-size "
                             f"(--swiglu's default, 2/3 of 4 x --hidden-size {self.hidden_size} rounded down to a "
                             f"multiple of 64, is 0)")
        if self.ffn_size % tp:
            raise ValueError(f"ffn hidden size {self.ffn_size} is not divisible by "
                             f"--tensor-model-parallel-size {tp}")
        if self.padded_vocab_size % tp:
            raise ValueError(f"padded vocabulary size {self.padded_vocab_size} is not divisible by "
                             f"--tensor-model-parallel-size {tp}; pad it (--make-vocab-size-divisible-by)")
        _one_of("--position-embedding-type", self.position_embedding_type, POSITION_EMBEDDING_TYPES)
        if self.position_embedding_type == "absolute" and self.seq_length > self.max_positions:
            raise ValueError(f"--seq-length {self.seq_length} is longer than --max-position-embeddings "
                             f"{self.max_positions}: learned positions exist only up to that length")
        if self.position_embedding_type == "rotary" and self.head_dim % 2:
            source = ("--kv-channels" if self.kv_channels is not None else
                      f"--hidden-size {self.hidden_size} / --num-attention-heads {self.num_attention_heads}")
            raise ValueError(f"rotary positions need an even head dimension, got {self.head_dim} ({source})")
        if self.rope_scaling_factor is not None:
            if self.position_embedding_type != "rotary":
                raise ValueError(f"--use-rope-scaling scales rotary frequencies, but --position-embedding-type is "
                                 f"{self.position_embedding_type}; use rotary (rope) positions or drop it")
            if self.rope_scaling_factor < 1 or self.rope_scaling_high_freq_factor <= self.rope_scaling_low_freq_factor:
                raise ValueError(f"rope scaling needs factor >= 1 and high_freq_factor > low_freq_factor, got "
                                 f"{self.rope_scaling_factor}, {self.rope_scaling_high_freq_factor}, "
                                 f"{self.rope_scaling_low_freq_factor}")
        self._validate_yarn()
        _one_of("--normalization", self.normalization, NORMALIZATIONS)
        _one_of("--attention-backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.attention_backend == "flex" and self.attention_dropout > 0:
            raise ValueError(f"--attention-backend flex has no attention dropout; set --attention-dropout 0 (got "
                             f"{self.attention_dropout}) or use sdpa")
        _one_of("params_dtype", self.params_dtype, PARAMS_DTYPES)
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.original_vocab_size is not None and self.original_vocab_size > self.padded_vocab_size:
            raise ValueError(f"original vocabulary size {self.original_vocab_size} is larger than the padded "
                             f"size {self.padded_vocab_size}")
        return self

    def _validate_yarn(self) -> None:
        factor = self.yarn_rotary_scaling_factor
        if factor is None:
            return
        if self.position_embedding_type != "rotary":
            raise ValueError(f"YaRN (--rotary-scaling-factor {factor}) scales rotary frequencies, but "
                             f"--position-embedding-type is {self.position_embedding_type}; use --position-embedding-"
                             f"type yarn (or rope with --multi-latent-attention) or drop the YaRN flags")
        if self.rope_scaling_factor is not None:
            raise ValueError("YaRN (--position-embedding-type yarn / --rope-type yarn) and Llama 3.1's "
                             "--use-rope-scaling are two scalings of the same frequencies; pick one")
        if not factor >= 1.0:
            raise ValueError(f"--rotary-scaling-factor {factor}: YaRN extends the context, the factor must be >= 1 "
                             f"(1 is plain rotary)")
        original = self.yarn_original_max_position_embeddings
        if not isinstance(original, int) or original < 1:
            raise ValueError(f"--yarn-original-max-position-embeddings must be a positive integer, got {original!r}")
        if not self.yarn_beta_fast >= self.yarn_beta_slow > 0:
            raise ValueError(f"--yarn-beta-fast {self.yarn_beta_fast} / --yarn-beta-slow {self.yarn_beta_slow}: YaRN "
                             f"keeps the pairs turning more than beta_fast times over the original context and "
                             f"interpolates those turning fewer than beta_slow times; it needs beta_fast >= "
                             f"beta_slow > 0 (DeepSeek-V3, Qwen3: 32 and 1)")

    def _validate_moe(self, tp: int) -> None:
        if self.moe is None:
            return
        self.moe.validate(self.num_layers)
        for name, width in (("--moe-ffn-hidden-size", self.expert_ffn_size),
                            ("--moe-shared-expert-intermediate-size", self.moe.shared_expert_intermediate_size or tp)):
            if width % tp:
                raise ValueError(f"{name} {width} is not divisible by --tensor-model-parallel-size {tp}: each TP rank "
                                 f"holds an equal slice of every expert; use a multiple of {tp}")

    def _validate_attention(self, tp: int) -> None:
        kv, heads = self.num_key_value_heads, self.num_attention_heads
        if kv is None:
            return
        if not isinstance(kv, int) or kv < 1:
            raise ValueError(f"--num-key-value-heads must be a positive integer, got {kv!r}")
        if heads % kv:
            raise ValueError(f"--num-key-value-heads {kv} does not divide --num-attention-heads {heads}: each key / "
                             f"value head serves a whole group of query heads; use a divisor of {heads}")
        if kv % tp:
            raise ValueError(f"--num-key-value-heads {kv} is not divisible by --tensor-model-parallel-size {tp}: "
                             f"each TP rank must hold whole query groups. Megatron-DeepSpeed refuses this too; "
                             f"Megatron-LM instead replicates key / value heads when TP is a multiple of the "
                             f"group count, which is not implemented here. Use a TP size dividing {kv}, or more "
                             f"key / value heads")

    def _validate_fp8(self) -> None:
        if self.fp8 is None:
            return
        if self.params_dtype == "fp16":  # the table's refusal (megatron.config.combinations), found with the model's
            entry = refusal("FP8", "fp16")
            raise ValueError(entry.say.format(a="--fp8-format", b="--fp16", reason=entry.reason, fix=entry.fix))
        self.fp8.validate(self.num_layers)

    @property
    def total_layers(self) -> int:
        """The transformer layers the model builds: the decoder's and each MTP depth's (its layer numbers follow the
        decoder's: ``num_layers + depth``)."""
        return self.num_layers + self.mtp_num_layers

    def _validate_mtp(self) -> None:
        if not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0:
            raise ValueError(f"--mtp-num-layers must be a non-negative integer, got {self.mtp_num_layers!r}")
        if self.mtp_loss_scaling_factor < 0:
            raise ValueError(f"--mtp-loss-scaling-factor must be >= 0, got {self.mtp_loss_scaling_factor}")
        if not self.mtp_num_layers:
            return
        # The MTP depths embed shifted tokens with the shared word embedding only: a pipeline's last stage holds that
        # weight (tied to the first stage's) but not learned positions or BLOOM's embedding norm.
        wrong = [what for what, present in (
            ("--position-embedding-type absolute (learned positions; use rope)",
             self.position_embedding_type == "absolute"),
            ("--embed-layernorm", self.embed_layernorm)) if present]
        if wrong:
            raise ValueError(f"--mtp-num-layers {self.mtp_num_layers} is not implemented with {', '.join(wrong)}: the "
                             f"MTP depths re-embed tokens with the word embedding alone (DeepSeek-V3, Qwen3 and "
                             f"Llama-style models have neither); drop --mtp-num-layers or the other flag")

    def _validate_recompute_modules(self) -> None:
        for name in self.recompute_modules:
            _one_of("--recompute-modules", name, RECOMPUTE_MODULES[1:])  # core_attn is recompute_core_attention
        need = [(name, flag) for name, flag, present in (
            ("moe", "--num-experts", self.moe is not None), ("moe_act", "--num-experts", self.moe is not None),
            ("shared_experts", "--moe-shared-expert-intermediate-size",
             self.moe is not None and self.moe.shared_expert_intermediate_size is not None),
            ("mla_up_proj", "--multi-latent-attention", self.mla is not None)) if name in self.recompute_modules
            and not present]
        if need:
            raise ValueError(f"--recompute-modules {' '.join(n for n, _ in need)} recomputes a part this model does not "
                             f"have: it needs {', '.join(f for _, f in need)}")
        if "shared_experts" in self.recompute_modules and self.moe.shared_expert_overlap:
            raise ValueError("--recompute-modules shared_experts cannot work with --moe-shared-expert-overlap (as in "
                             "Megatron-LM): the overlapped shared expert runs inside the dispatch; drop one of them")

    def _validate_mla(self) -> None:
        if self.mla is None:
            return
        self.mla.validate()
        wrong = [what for what, present in (
            (f"--position-embedding-type {self.position_embedding_type} (needs rope)",
             self.position_embedding_type != "rotary"),
            ("--num-key-value-heads / --group-query-attention (every head has its own expanded key and value)",
             self.num_key_value_heads not in (None, self.num_attention_heads)),
            ("biases (--disable-bias-linear; DeepSeek-V3 has none)", self.qkv_bias)) if present]
        if wrong:
            raise ValueError(f"--multi-latent-attention is not implemented with {', '.join(wrong)}")
