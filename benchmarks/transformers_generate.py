"""transformers' own greedy decoding, the baseline for `lmhead greedy`: load a local folder in DTYPE,
one `generate(do_sample=False)` call for exactly N new tokens (min_new_tokens = N: end-of-text
does not stop it), timed as `lmhead greedy` times itself: from the call to its return (prefill and
every step, no warm-up: a first call's set-up counts, as it does for lmhead), and the steady rate
after the first new token (a streamer notes when each token arrives). Prints one JSON line.

    python benchmarks/transformers_generate.py FOLDER "PROMPT" N DTYPE [DEVICE]
"""

import json
import sys
import time

import torch
from transformers import AutoTokenizer, GPT2LMHeadModel


class Clock:
    """A generate() streamer that only notes the time of each put: the prompt first, then each token."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


folder, prompt, n, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
tokenizer = AutoTokenizer.from_pretrained(folder)
model = GPT2LMHeadModel.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
clock = Clock()
with torch.inference_mode():
    start = time.perf_counter()
    out = model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=tokenizer.eos_token_id, streamer=clock)
    elapsed = time.perf_counter() - start
new = out[0, ids.shape[1]:].tolist()
first = clock.times[1] - start  # times[0] is the prompt
print(json.dumps({"generated_ids": new, "elapsed_s": elapsed, "first_token_s": first,
                  "tokens_per_second": len(new) / elapsed,
                  "decode_tokens_per_second": (len(new) - 1) / (elapsed - first)}))
