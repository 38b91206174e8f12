"""The benchmark's fixed prompts: the same text in every run, so runs compare."""

from __future__ import annotations

# 32 prompts of different kinds and lengths for the bfloat16 against float32 agreement (KL divergence
# and same top-1 token), as llama.cpp's perplexity tool reports quantisation error.
PRECISION_PROMPTS = [
    "The keys on the table",
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):\n    if n <",
    "The quick brown fox jumps over the",
    "In 1969, the first person to walk on the moon was",
    "She opened the door and saw",
    "import numpy as np\nx = np.",
    "The results of the experiment suggest that",
    "My favourite food is",
    "To be or not to be, that is the",
    "The price of the house was $",
    "He said that he would never",
    "Water boils at 100 degrees",
    "The committee will meet again on",
    "After the rain stopped, the children",
    "SELECT name FROM users WHERE",
    "The most important thing in life is",
    "According to the latest report, unemployment",
    "I can't believe you",
    "The cat sat on the",
    "Photosynthesis is the process by which plants",
    "1, 2, 3, 4, 5,",
    "The meeting was cancelled because",
    "Dear Sir or Madam, I am writing to",
    "The river flows from the mountains to the",
    "In conclusion, the evidence shows",
    "<html><head><title>",
    "The best way to learn a language is",
    "Tomorrow's weather will be",
    "The author of the novel was born in",
    "Thank you very much for your",
]

SUBJECTS = ["The key", "The keys", "The author", "The authors", "The dog", "The dogs", "The box", "The boxes"]
PLACES = ["on the table", "near the door", "in the drawer", "under the bed", "by the window", "of the house",
          "from the shop", "behind the chair"]
OPENINGS = ["", "I think ", "Yesterday ", "Perhaps "]


def file_prompts(n: int) -> list[str]:
    """n short subject-verb agreement prompts ("The keys on the table", "I think The dogs near the
    door", ...), up to 256, in a fixed order."""
    all_ = [f"{o}{s} {p}" for o in OPENINGS for p in PLACES for s in SUBJECTS]
    if n > len(all_):
        raise ValueError(f"at most {len(all_)} prompts")
    return all_[:n]
