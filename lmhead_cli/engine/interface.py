"""csrc/kernels.h as ctypes: the compiled kernels' functions (restype, argtypes) and the structures they
take, in the header's order. engine/kernels.py binds the functions to the module it loads;
tests/test_kernel_interface.py parses the header and compares it with these."""

from __future__ import annotations

import ctypes

_i64, _ptr, _int, _float, _text = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_char_p

# csrc/kernels.h's functions as ctypes (restype, argtypes), in the header's order: any pointer is a
# c_void_p (a tensor's data_ptr(), a structure's address), but `const char *`. tests/test_kernels.py
# parses the header and compares these, and the structures below, with it.
MODULE_FUNCTIONS = {  # module.c's own, one of each
    "lmhead_kernels_abi": (_int, []),
    "lmhead_release_thread_pool": (_int, []),
    "lmhead_kernels_max_rows": (_int, []),
    "lmhead_kernels_f32_max_rows": (_int, []),
    "lmhead_kernels_variants": (_text, []),
    "lmhead_kernels_supports": (_int, [_text]),
}
KERNEL_FUNCTIONS = {  # one of each per variant, the name suffixed by the variant's (lmhead_attend_avx2)
    "lmhead_int8_matvec": (_int, [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "lmhead_q8_0_matvec": (_int, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "lmhead_gguf_matvec": (_int, [_int, _int, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "lmhead_gguf_dequantise": (_int, [_int, _ptr, _i64, _ptr, _i64, _i64, _int]),
    "lmhead_bf16_matvec": (_int, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "lmhead_f32_matvec": (_int, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "lmhead_f32_kn_matvec": (_int, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "lmhead_score_rows": (_i64, [_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _int]),
    "lmhead_attend": (_int, [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64,
                             _float, _int]),
    # the plan (an array of lmhead_layer), then the step's arguments in order
    "lmhead_step": (_int, [_ptr, _i64, _int, _ptr, _i64, _i64, _i64, _i64, _i64, _float, _ptr, _ptr, _i64, _i64,
                           _i64, _i64, _ptr, _i64, _int]),
    # the lmhead_llama, the rows of x, their positions, the cache and mask as lmhead_step's
    "lmhead_llama_step": (_int, [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _int]),
    # lmhead_llama_step's arguments with the token ids after x (x or the ids NULL), then the logits and the
    # record's top-1 ids and figures
    "lmhead_llama_decode": (_int, [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64,
                                   _ptr, _ptr, _ptr, _int]),
    # the lmhead_model, then the tokens, positions, rows, the cache and mask as lmhead_step's, the logits,
    # the record's top-1 ids and figures
    "lmhead_decode": (_int, [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr,
                             _ptr, _int]),
    # the model (lmhead_llama or lmhead_model, as the flag says), the first token, the steps, end-of-text,
    # the cache as lmhead_step's, its length, the logits (2, V), each step's top-1 id and figures
    "lmhead_greedy_run": (_int, [_ptr, _int, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr,
                                 _ptr, _int]),
}
FUNCTIONS = tuple(KERNEL_FUNCTIONS)


class Layer(ctypes.Structure):
    """csrc/kernels.h's lmhead_layer: one block's weight pointers (engine/step.py fills them)."""

    _fields_ = [("w", _ptr * 4), ("s", _ptr * 4), ("b", _ptr * 4), ("ln1_w", _ptr), ("ln1_b", _ptr),
                ("ln2_w", _ptr), ("ln2_b", _ptr)]


class Model(ctypes.Structure):
    """csrc/kernels.h's lmhead_model: the blocks (an array of Layer), the embeddings, ln_f and the head
    (engine/step.py fills it)."""

    _fields_ = [("layers", _ptr), ("L", _i64), ("D", _i64), ("H", _i64), ("inner", _i64), ("V", _i64),
                ("n_pos", _i64), ("kind", _int), ("eps", ctypes.c_float), ("wte", _ptr), ("wpe", _ptr),
                ("lnf_w", _ptr), ("lnf_b", _ptr), ("head", _ptr), ("wte_s", _ptr), ("head_s", _ptr)]


class LlamaLayer(ctypes.Structure):
    """csrc/kernels.h's lmhead_llama_layer: one Llama layer's seven products (q, k, v, o, gate, up, down:
    weights, biases, GGUF row bytes and types, rounded or not) and its two norms (engine/llama_step.py
    fills them)."""

    _fields_ = [("w", _ptr * 7), ("b", _ptr * 7), ("row_bytes", _i64 * 7), ("type", _int * 7), ("rounded", _int * 7),
                ("norm1", _ptr), ("norm2", _ptr)]


class Llama(ctypes.Structure):
    """csrc/kernels.h's lmhead_llama: the layers (an array of LlamaLayer), the sizes, RoPE's table, the final
    norm, the head and the token table."""

    _fields_ = [("layers", _ptr), ("L", _i64), ("D", _i64), ("H", _i64), ("K", _i64), ("hd", _i64),
                ("inner", _i64), ("rope_len", _i64), ("eps", ctypes.c_float), ("rope", _ptr), ("norm", _ptr),
                ("head", _ptr), ("V", _i64), ("head_row_bytes", _i64), ("head_type", _int), ("head_rounded", _int),
                ("embed", _ptr), ("embed_rows", _i64), ("embed_row_bytes", _i64), ("embed_type", _int)]
