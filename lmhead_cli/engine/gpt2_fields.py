"""Every field of transformers' GPT2Config, and what the lean engine does with it.

The lean engine is plain GPT-2: gelu_new, attention scaled by 1/sqrt(head_dim), LayerNorm with the
config's epsilon. A GPT-2 config that asks for other arithmetic must not run there as plain GPT-2
with no word said: such a field is *routed* (the model runs on transformers' own GPT-2, with a
note; `--engine lean` refuses it by name). tests/test_checkpoints.py checks that this table covers
every GPT2Config field and that each routed field gives transformers' figures. No torch here.
"""

from __future__ import annotations

# Read by the lean engine (engine/lean.py, loading/checks.py) or by lmhead itself (token ids).
HONOURED = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "layer_norm_epsilon",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")

# field -> the values the lean engine computes exactly; any other value changes the arithmetic.
ROUTED = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # tanh-approximated GELU, as lean.MLP applies it
    "scale_attn_weights": (True,),  # scores / sqrt(head_dim)
    "scale_attn_by_inverse_layer_idx": (False,),  # scores / (layer + 1) as well
    "reorder_and_upcast_attn": (False,),  # attention scores computed in float32 under bf16/fp16
    "add_cross_attention": (False,),  # a cross-attention block in every layer, with its own weights
}

# No effect on the logits of a loaded model in eval mode: dropout is off, initialisation is replaced by
# the file's weights, the summary head belongs to GPT2DoubleHeadsModel, the rest is bookkeeping.
NO_EFFECT = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout", "initializer_range",
             "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "use_cache",
             "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
             "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type")

DECIDED = frozenset(HONOURED) | frozenset(ROUTED) | frozenset(NO_EFFECT)


def lean_cannot_run(config: dict) -> list[str]:
    """The fields of a GPT-2 config.json, as `field=value`, whose value the lean engine does not compute
    (defaults as transformers' GPT2Config: a missing field is its default)."""
    return [f"{key}={config[key]!r}" for key, exact in ROUTED.items()
            if key in config and not any(config[key] == v and type(config[key]) is type(v) for v in exact)]
