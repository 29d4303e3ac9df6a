"""Built-in distillation data: chat prompts (tasks x topics) and offline text (the stdlib's sources).

Held-out prompts use topics that never appear in training prompts, so held-out alpha
measures generalisation to new subjects, not memorised continuations.
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

TASKS = [
    "Explain {topic} to a ten-year-old.",
    "Write a short poem about {topic}.",
    "Give me three interesting facts about {topic}.",
    "What are the pros and cons of {topic}?",
    "Summarize the history of {topic} in a few sentences.",
    "Write a tweet about {topic}.",
    "How would you teach a beginner about {topic}?",
    "Write a short story that involves {topic}.",
    "What is a common misconception about {topic}?",
    "List five questions a student might ask about {topic}, with answers.",
    "Write a Python function related to {topic}, with a docstring.",
    "Describe {topic} in one paragraph.",
    "Compare {topic} with something similar and explain the differences.",
    "Write an email to a friend recommending they learn about {topic}.",
    "What are the key terms someone should know about {topic}?",
    "Give a step-by-step guide to getting started with {topic}.",
    "Why does {topic} matter today?",
    "Write a haiku about {topic}.",
    "Tell me a joke about {topic}.",
    "What would the future of {topic} look like in 50 years?",
    "Write a product description for something related to {topic}.",
    "Explain {topic} using an analogy.",
    "What are the ethical questions around {topic}?",
    "Create a short quiz about {topic}.",
]

# A table, five to a line: easier to scan than one topic per line.
# fmt: off
TOPICS = [
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "coffee",
    "volcanoes", "the stock market", "honeybees", "climate change", "the Roman Empire",
    "quantum computing", "gardening", "the human heart", "chess", "electric cars",
    "the moon landing", "vaccines", "jazz music", "rainforests", "cryptography",
    "the Great Wall of China", "sleep", "recycling", "dinosaurs", "the internet",
    "Shakespeare", "mountain climbing", "bread baking", "solar energy", "octopuses",
    "the printing press", "meditation", "earthquakes", "sorting algorithms", "the Olympic Games",
    "renewable energy", "ancient Egypt", "friendship", "time management", "the water cycle",
    "robots", "the piano", "democracy", "plate tectonics", "penguins",
    "video games", "the immune system", "world maps", "origami", "public libraries",
    "artificial intelligence", "the ocean", "trains", "bicycles", "cheese making",
    "the Renaissance", "smartphones", "tornadoes", "linear algebra", "birds migration",
    "space telescopes", "football", "programming in Python", "the periodic table", "tea ceremonies",
    "deserts", "urban planning", "the Silk Road", "wolves", "nutrition",
    "DNA", "social media", "lighthouses", "mathematics competitions", "the violin",
    "hot air balloons", "glaciers", "electric guitars", "ants", "budgeting",
]
# fmt: on

# Every HOLDOUT_EVERY-th topic is held out of training.
HOLDOUT_EVERY = 6


def split_topics() -> tuple[list[str], list[str]]:
    train = [t for i, t in enumerate(TOPICS) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    held = [t for i, t in enumerate(TOPICS) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    return train, held


def train_prompts(seed: int = 0) -> list[str]:
    """All task x training-topic prompts, in a seeded order."""
    train, _ = split_topics()
    prompts = [task.format(topic=topic) for task in TASKS for topic in train]
    random.Random(seed).shuffle(prompts)
    return prompts


def heldout_prompts(count: int = 16, seed: int = 1234) -> list[str]:
    """`count` prompts over held-out topics (tasks spread round-robin), fixed for a given seed."""
    _, held = split_topics()
    rng = random.Random(seed)
    tasks = TASKS[:]
    rng.shuffle(tasks)
    topics = held[:]
    rng.shuffle(topics)
    return [tasks[i % len(tasks)].format(topic=topics[i % len(topics)]) for i in range(count)]


def chat_token_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the model services' chat mode sends it (template + generation prompt)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def stdlib_files(seed: int = 0) -> list[Path]:
    """The Python standard library's .py sources (tests excluded), in a seeded order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "test", "tests", "idlelib"}
    files = sorted(p for p in root.rglob("*.py") if skipped.isdisjoint(p.parts))
    random.Random(seed).shuffle(files)
    return files


def text_windows(tokenizer, seq_len: int, count: int, seed: int = 0):
    """Yield up to `count` windows of `seq_len` token ids cut from stdlib sources.

    At most a few windows per file, so the mix covers many modules.
    """
    if count <= 0:
        return
    produced = 0
    for path in stdlib_files(seed):
        if produced >= count:
            return
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        ids = tokenizer(text)["input_ids"]
        for start in range(0, max(0, len(ids) - seq_len // 2), seq_len)[:4]:
            window = ids[start : start + seq_len]
            if len(window) < seq_len // 2:
                break
            yield [int(i) for i in window]
            produced += 1
            if produced >= count:
                return
