"""The plain transformers script that does what `lmhead score` does on a text that fits the context:
import, load a local folder, one forward with the full logits, log-softmax, gather each token's
log-probability. The baseline for `lmhead score` end to end.

    python benchmarks/transformers_score.py FOLDER TEXT_FILE
"""

import json
import sys

import torch
from transformers import AutoTokenizer, GPT2LMHeadModel

folder, path = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = GPT2LMHeadModel.from_pretrained(folder).eval()
with open(path, encoding="utf-8") as f:
    ids = tokenizer(f.read(), return_tensors="pt").input_ids[:, : model.config.n_positions]  # (1, T)
with torch.inference_mode():
    logits = model(ids).logits[0, :-1]  # (T - 1, V): position t predicts token t + 1
logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[0, 1:, None])[:, 0]  # (T - 1,)
nll = -float(logprobs.double().sum())
print(json.dumps({"scored_tokens": len(logprobs), "nll": nll, "perplexity": float(torch.tensor(nll / len(logprobs)).exp())}))
