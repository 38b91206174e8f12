"""transformers' own greedy decoding, the baseline for `lmhead greedy`: load a local folder in DTYPE,
one `generate(do_sample=False)` call for exactly N new tokens (min_new_tokens = N: end-of-text
does not stop it), timed from the call to its return (prefill and every step). One untimed
one-token call first: generate()'s first call costs some tenths of a second more, which would
count against it (`lmhead greedy` gets no warm-up: its own figure includes its first call).
Prints one JSON line.

    python benchmarks/transformers_generate.py FOLDER "PROMPT" N DTYPE [columns]

With `columns`, the tied wte/lm_head matrix is first re-laid out column by column, in place (what
`--head-layout columns` does in lmhead): the same model, with the head's product in BLAS's faster form.
"""

import json
import sys
import time

import torch
from transformers import AutoTokenizer, GPT2LMHeadModel

folder, prompt, n, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = GPT2LMHeadModel.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
if sys.argv[5:] == ["columns"]:
    w = model.lm_head.weight
    w.data = w.data.t().contiguous().t()  # still one Parameter shared with wte: the tie holds
ids = tokenizer(prompt, return_tensors="pt").input_ids
with torch.inference_mode():
    model.generate(ids, do_sample=False, max_new_tokens=1, pad_token_id=tokenizer.eos_token_id)  # warm-up
    start = time.perf_counter()
    out = model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
new = out[0, ids.shape[1]:].tolist()
print(json.dumps({"generated_ids": new, "elapsed_s": elapsed, "tokens_per_second": len(new) / elapsed}))
