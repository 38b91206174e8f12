"""The plain transformers script that does what `lmhead inspect` does: import, load a local folder,
one forward with logits_to_keep=1, softmax, top-k. The baseline for `lmhead inspect` end to end.

    python benchmarks/transformers_inspect.py FOLDER "PROMPT" [K] [DEVICE]
"""

import sys

import torch
from transformers import AutoTokenizer, GPT2LMHeadModel

folder, prompt = sys.argv[1], sys.argv[2]
k = int(sys.argv[3]) if len(sys.argv) > 3 else 10
device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
tokenizer = AutoTokenizer.from_pretrained(folder)
model = GPT2LMHeadModel.from_pretrained(folder).to(device).eval()
ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
with torch.inference_mode():
    logits = model(ids, logits_to_keep=1).logits[0, -1]
probs = torch.softmax(logits.float(), dim=-1)
top = torch.topk(probs, k)
for p, i in zip(top.values.tolist(), top.indices.tolist()):
    print(f"{i:>6} {tokenizer.decode([i])!r:<16} {p:.6f}")
