"""The registry of transformers families: each model type read by one family, each model of ours exported by at
most one, the class names it gives transformers real, and no transformers import before a directory is written.

The conversions themselves are tested per family (test_hf_export.py: Bloom, GPT-2, GPT-NeoX; test_hf_llama.py,
test_hf_moe.py, test_hf_deepseek.py)."""

import subprocess
import sys

import pytest

from megatron.checkpoint.hf.families import FAMILIES, family_for, family_of, hf_architecture
from tests.helpers.checkpoint import POSITIONS, tiny_model_config

EXPECTED = {"alibi": "bloom", "absolute": "gpt2", "rotary": "gpt_neox", "llama": "llama"}


def test_each_model_type_is_read_by_one_family():
    model_types = [name for family in FAMILIES.values() for name in family.model_types]
    assert len(model_types) == len(set(model_types)), model_types
    for name, family in FAMILIES.items():
        for model_type in family.model_types:
            assert family_of(model_type) is family, (name, model_type)
    with pytest.raises(ValueError, match="'opt' model; this converter reads bloom, gpt2, gpt_neox, llama"):
        family_of("opt")


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_one_family_holds_each_model(kind):
    config = tiny_model_config(**POSITIONS[kind])
    holders = [name for name, family in FAMILIES.items() if family.holds(config)]
    assert len(holders) == 1, holders
    family, model_type = family_for(config)
    assert model_type == hf_architecture(config) == EXPECTED[kind] and model_type in family.model_types


def test_a_model_no_family_holds_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="this model lacks biases"):
        hf_architecture(tiny_model_config(add_bias_linear=False))
    with pytest.raises(ValueError, match="no transformers architecture maps position_embedding_type 'rotary'"):
        hf_architecture(tiny_model_config(position_embedding_type="rotary", embed_layernorm=True))
    # a dense --qk-layernorm model is Qwen3's, which has RMSNorm, SwiGLU, rotary and no biases
    with pytest.raises(ValueError, match="Llama family cannot hold this model: .*--qk-layernorm with biases"):
        hf_architecture(tiny_model_config(qk_layernorm=True))


def test_the_classes_named_exist_in_transformers():
    import transformers

    for family in FAMILIES.values():
        for model_type, (config_class, model_class) in family.model_types.items():
            assert getattr(transformers, config_class).model_type == model_type
            assert hasattr(transformers, model_class), model_class


def test_the_registry_and_io_import_neither_transformers_nor_deepspeed():
    code = ("import sys, megatron.checkpoint, megatron.checkpoint.hf.io, megatron.checkpoint.resume; "
            "loaded = [m for m in ('transformers', 'deepspeed', 'safetensors', 'tokenizers') if m in sys.modules]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True)
