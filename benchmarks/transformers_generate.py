"""transformers' own greedy decoding, the baseline for `lmhead greedy`: load a local folder in DTYPE,
one `generate(do_sample=False)` call for exactly N new tokens (min_new_tokens = N: end-of-text
does not stop it), timed from the call to its return (prefill and every step, no warm-up, as
`lmhead greedy` times itself). Prints one JSON line.

    python benchmarks/transformers_generate.py FOLDER "PROMPT" N DTYPE
"""

import json
import sys
import time

import torch
from transformers import AutoTokenizer, GPT2LMHeadModel

folder, prompt, n, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = GPT2LMHeadModel.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
ids = tokenizer(prompt, return_tensors="pt").input_ids
with torch.inference_mode():
    start = time.perf_counter()
    out = model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
new = out[0, ids.shape[1]:].tolist()
print(json.dumps({"generated_ids": new, "elapsed_s": elapsed, "tokens_per_second": len(new) / elapsed}))
