"""Megatron-LM's --apply-layernorm-1p: every norm stores w (starting at 0) and scales by 1 + w. The model is the
usual one with weight 1 + w (logits of a plain model given those weights), at initialisation the usual one exactly,
and exported to Hugging Face as 1 + w; a checkpoint of one parameterisation does not load into the other."""

from __future__ import annotations

import pytest
import torch

from megatron.model.gpt import GPTModel
from megatron.model.norm import NORM_WEIGHT_SUFFIX, effective_norm_weights
from tests.helpers.model import tiny_config

LLAMA = dict(normalization="rmsnorm", swiglu=True, position_embedding_type="rotary", add_bias_linear=False,
             untie_embeddings_and_output_weights=True, qk_layernorm=True)


def _ids():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


def _perturbed(model):
    torch.manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


@pytest.mark.parametrize("fields", [LLAMA, dict(normalization="layernorm")], ids=["rmsnorm", "layernorm"])
def test_zero_centred_norms_are_the_usual_model_with_weight_one_plus_w(fields):
    zero_centred = GPTModel(tiny_config(apply_layernorm_1p=True, **fields))
    plain = GPTModel(tiny_config(**fields))
    norms = [n for n, _ in zero_centred.named_parameters() if n.endswith(NORM_WEIGHT_SUFFIX)]
    assert norms and all(not zero_centred.state_dict()[n].any() for n in norms)  # w starts at 0
    with torch.no_grad():  # at initialisation: the usual model (1 + 0 = the usual 1)
        torch.testing.assert_close(zero_centred.eval()(_ids()), plain.eval()(_ids()), rtol=0, atol=0)
    _perturbed(zero_centred)
    plain.load_state_dict(effective_norm_weights(zero_centred.state_dict(), zero_centred.config))
    with torch.no_grad():  # the same operations on the same numbers: 1 + w formed once, in each model
        torch.testing.assert_close(zero_centred(_ids()), plain(_ids()), rtol=0, atol=0)
    assert any(float((plain.state_dict()[n] - 1).abs().max()) > 0.05 for n in norms)


def test_exported_to_hugging_face_as_one_plus_w(tmp_path):
    from megatron.checkpoint.hf.io import read_hf_model, write_hf_model

    fields = dict(LLAMA, qk_layernorm=False)  # Llama: no q / k norms
    model = _perturbed(GPTModel(tiny_config(apply_layernorm_1p=True, **fields)))
    write_hf_model(model.config, model.state_dict(), str(tmp_path))
    config, state, arch = read_hf_model(str(tmp_path), padded_vocab_size_fn=lambda v: 256)
    assert arch == "llama" and not config.apply_layernorm_1p
    ours = model.state_dict()
    for name in ours:
        expected = ours[name] + 1 if name.endswith(NORM_WEIGHT_SUFFIX) else ours[name]
        torch.testing.assert_close(state[name], expected, rtol=0, atol=0, msg=name)
    plain = GPTModel(config).eval()
    plain.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(plain(_ids()), model(_ids()), rtol=0, atol=0)


def test_a_checkpoint_of_one_parameterisation_does_not_load_into_the_other():
    import dataclasses

    from megatron.checkpoint.run_state import check_model_config

    saved = dataclasses.asdict(tiny_config(apply_layernorm_1p=True, **LLAMA))
    with pytest.raises(ValueError, match="apply_layernorm_1p = True but this run has False"):
        check_model_config(saved, dataclasses.asdict(tiny_config(**LLAMA)))
