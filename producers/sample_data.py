"""Built-in sample conversations, so `dflashq demo` and first-time users need no dataset."""

from __future__ import annotations

import json
import random
from pathlib import Path

_TOPICS = ["the moon", "rivers", "prime numbers", "bread", "bicycles", "volcanoes", "owls", "glass", "chess", "rain"]
_FACTS = {
    "the moon": "The moon orbits the earth about once every 27 days and always shows us the same face.",
    "rivers": "Rivers carry water from high ground to the sea and shape valleys over thousands of years.",
    "prime numbers": "A prime number has exactly two divisors, one and itself; 2, 3, 5, 7 and 11 are the first five.",
    "bread": "Bread rises because yeast turns sugar into carbon dioxide, which the gluten network traps.",
    "bicycles": "A bicycle stays upright mostly because of steering geometry and the rider's small corrections.",
    "volcanoes": "Volcanoes form where molten rock from the mantle reaches the surface through cracks in the crust.",
    "owls": "Owls hunt at night; their soft feathers let them fly almost silently.",
    "glass": "Glass is made by melting sand with soda and lime, then cooling it before crystals can form.",
    "chess": "Chess is played on a board of 64 squares; each side starts with sixteen pieces.",
    "rain": "Rain falls when droplets in a cloud grow heavy enough to overcome rising air.",
}


def sample_conversations(n: int = 200, seed: int = 0) -> list[dict]:
    """Deterministic single- and multi-turn conversations, some with thinking blocks."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = rng.choice(_TOPICS)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        messages = [{"role": "user", "content": f"Tell me one fact about {topic}."}]
        answer = _FACTS[topic]
        if i % 3 == 0:
            answer = f"<think>\nThe user wants a short fact about {topic}.\n</think>\n\n{answer}"
        messages.append({"role": "assistant", "content": answer})
        if i % 2 == 0:
            messages.append({"role": "user", "content": f"And what is {a} plus {b}?"})
            messages.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}."})
        if i % 5 == 0:
            messages.insert(0, {"role": "system", "content": "You are a concise assistant."})
        out.append({"messages": messages})
    return out


def write_sample_data(path: str | Path, n: int = 200, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for conv in sample_conversations(n, seed):
            f.write(json.dumps(conv) + "\n")
    return path
