"""Template prompts for distilling the draft (training only, never evaluated on).

The 219 hand-written task prompts are few; a draft distilled on answers to ~170 training
prompts memorises them (train agreement 0.8, held-out 0.38). This module widens the
distillation data with many varied prompts of the same four task types, built from
templates and seeded choices, so the draft sees more contexts:

* code, math, chat: templates x topic lists x random numbers;
* summarization: the target first writes a short passage on a topic (greedy), and the
  prompt asks for a two-sentence summary of that passage, as the hand-written ones do.

Every prompt gets ``split = "train"`` and an id starting with ``gen-``; any prompt whose
text equals a held-out prompt is dropped. Run ``speckv-distill prompts``.
"""

from __future__ import annotations

import random
from typing import Any

LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Java", "Go", "Rust", "TypeScript", "Bash"]
CODE_TASKS = [
    "reverses the words in a sentence",
    "counts the vowels in a string",
    "returns the largest element of a list",
    "merges two sorted lists into one sorted list",
    "checks whether a number is prime",
    "computes the factorial of n recursively",
    "removes all whitespace from a string",
    "converts a temperature from Celsius to Fahrenheit",
    "returns the second smallest number in a list",
    "flattens a nested list",
    "counts how often each word appears in a text",
    "checks whether two strings are anagrams",
    "rotates a list by k positions",
    "computes the greatest common divisor of two numbers",
    "returns the sum of the digits of an integer",
    "finds the longest word in a sentence",
    "validates that a string is a well-formed email address",
    "converts a binary string to an integer",
    "returns the transpose of a matrix",
    "finds all duplicates in a list",
    "capitalizes the first letter of every word",
    "computes the running average of a list of numbers",
    "splits a list into chunks of size n",
    "checks whether parentheses in a string are balanced",
    "returns the n-th row of Pascal's triangle",
    "computes the dot product of two vectors",
    "finds the index of the first repeated character",
    "reads a CSV file and returns the number of rows",
    "sorts a list of dictionaries by a given key",
    "returns the intersection of two lists without duplicates",
    "converts a Roman numeral to an integer",
    "computes the median of a list",
    "generates all subsets of a small set",
    "checks whether a year is a leap year",
    "counts the number of set bits in an integer",
    "returns the unique characters of a string in order",
    "computes compound interest for a principal, rate and number of years",
    "implements a simple stack with push and pop",
    "implements a queue using two stacks",
    "finds the missing number in a list from 1 to n",
    "computes the Levenshtein distance between two strings",
    "returns the prime factors of a number",
    "converts snake_case to camelCase",
    "parses a date string in YYYY-MM-DD format",
    "groups words by their first letter",
    "returns the k most frequent elements of a list",
    "checks whether a list is sorted",
    "computes the area of a circle given its radius",
    "truncates a string to n characters and adds an ellipsis",
    "implements bubble sort",
    "implements insertion sort",
    "returns the cumulative sum of a list",
    "checks whether a number is a perfect square",
    "finds the maximum subarray sum",
    "swaps the keys and values of a dictionary",
]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "Write a short {lang} function that {task}. Add a docstring or comment.",
    "In {lang}, implement a function that {task}, and show one example call.",
    "Write {lang} code that {task}. Keep it simple and explain it in one sentence.",
    "Can you write a {lang} function that {task}?",
]
CODE_EXTRA = [
    "Explain what a {concept} is in programming, with a short Python example.",
    "What is the difference between a {a} and a {b} in Python?",
    "Fix the bug in this Python code: def add(a, b): return a - b",
    "Write a SQL query that selects all {things} whose {field} is greater than {n}.",
    "Write a Python class named {cls} with an __init__ method and one useful method.",
]
CONCEPTS = [
    "closure",
    "generator",
    "decorator",
    "recursion",
    "hash map",
    "linked list",
    "binary tree",
    "lambda function",
    "list comprehension",
    "exception",
    "iterator",
    "unit test",
    "class",
    "module",
    "thread",
    "queue",
]
PAIRS = [
    ("list", "tuple"),
    ("set", "list"),
    ("dictionary", "list"),
    ("function", "method"),
    ("class", "instance"),
    ("for loop", "while loop"),
    ("shallow copy", "deep copy"),
    ("module", "package"),
]
SQL_THINGS = [
    ("customers", "age"),
    ("orders", "total"),
    ("products", "price"),
    ("employees", "salary"),
    ("students", "grade"),
    ("books", "pages"),
]
CLASSES = ["BankAccount", "Rectangle", "Counter", "Student", "Temperature", "Inventory", "Timer", "Playlist"]

NAMES = [
    "Anna",
    "Ben",
    "Carlos",
    "Dana",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemi",
    "Liam",
    "Maya",
    "Noah",
    "Olga",
    "Priya",
    "Sam",
    "Tara",
    "Umar",
    "Vera",
]
ITEMS = [
    "apples",
    "pencils",
    "notebooks",
    "tickets",
    "cookies",
    "books",
    "stickers",
    "bottles of water",
    "plants",
    "cupcakes",
]
MATH_TEMPLATES = [
    "{name} buys {a} {item} at {p} dollars each. How much does {name} pay in total?",
    "{name} has {big} {item} and gives away {a}. How many are left?",
    "A car travels {d} km in {h} hours. What is its average speed in km per hour?",
    "What is {a} multiplied by {b}? Show the steps.",
    "What is {big} divided by {a}? Give the answer with the remainder.",
    "Solve for x: {a}x + {b} = {c}.",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "What is {pct}% of {big}?",
    "The price of a jacket is {big} dollars. It is discounted by {pct}%. What is the new price?",
    "{name} reads {a} pages a day. How many days does it take to read a {big}-page book?",
    "What is the sum of all integers from 1 to {b}?",
    "A recipe needs {a} eggs for {b} people. How many eggs are needed for {c} people?",
    "Convert {d} minutes into hours and minutes.",
    "If a number is increased by {a} and then doubled, the result is {c2}. What is the number?",
    "The average of {a}, {b} and {c} is what?",
    "A tank holds {big} liters and fills at {a} liters per minute. How long does it take to fill it?",
    "What is the least common multiple of {a} and {b}?",
    "Simplify the fraction {a2}/{b2}.",
    "A triangle has angles of {ang1} and {ang2} degrees. What is the third angle?",
    "{name} saves {a} dollars every week. How much will {name} have saved after {b} weeks?",
    "What is {a} squared plus {b} squared?",
    "A train leaves at {t1}:00 and arrives at {t2}:30. How long is the trip?",
]

CHAT_TOPICS = [
    "learning a new language",
    "saving money",
    "starting to run",
    "cooking at home",
    "keeping houseplants alive",
    "public speaking",
    "time management",
    "writing a resume",
    "staying motivated",
    "making friends in a new city",
    "planning a trip",
    "reducing screen time",
    "learning to play the guitar",
    "studying for exams",
    "working in a team",
    "eating healthier",
    "starting a small business",
    "reading more books",
    "handling stress",
    "writing a cover letter",
    "taking better photos",
    "learning to code",
    "organizing a closet",
    "preparing for a job interview",
    "growing tomatoes",
    "training a puppy",
    "riding a bike in the city",
    "meditating",
    "hosting a dinner party",
    "keeping a journal",
    "volunteering",
    "learning to swim",
    "moving to a new apartment",
    "being a good listener",
]
CHAT_CONCEPTS = [
    "photosynthesis",
    "inflation",
    "the water cycle",
    "gravity",
    "how vaccines work",
    "the internet",
    "black holes",
    "compound interest",
    "climate change",
    "how a bill becomes law",
    "the immune system",
    "electricity",
    "supply and demand",
    "the moon's phases",
    "volcanoes",
    "how airplanes fly",
    "DNA",
    "rainbows",
    "earthquakes",
    "machine learning",
    "recycling",
    "the stock market",
    "tides",
    "the seasons",
    "how batteries work",
    "bacteria",
    "the Roman Empire",
    "the printing press",
    "renewable energy",
    "sleep",
    "memory",
    "music theory",
    "chess openings",
]
CHAT_TEMPLATES = [
    "Can you give me some tips for {topic}?",
    "What are the most common mistakes people make when {topic}?",
    "I want to get better at {topic}. Where should I start?",
    "Give me three practical tips for {topic}.",
    "What are the benefits of {topic}?",
    "How can a busy person make time for {topic}?",
    "Explain {concept} in simple terms.",
    "How would you explain {concept} to a ten-year-old?",
    "What is {concept}, and why does it matter?",
    "Tell me three interesting facts about {concept}.",
    "Write a short, friendly message inviting a friend to try {topic} with me.",
    "What is a good way to learn about {concept}?",
]
PASSAGE_TEMPLATES = [
    "Write a short factual paragraph of about 80 words about {concept}.",
    "Write a paragraph of about 80 words describing the history of {concept}.",
    "Write a short news report of about 80 words about a new discovery related to {concept}.",
    "Write a paragraph of about 80 words for a school textbook explaining {concept}.",
    "Write a paragraph of about 80 words describing a museum exhibition about {concept}.",
    "Write a paragraph of about 80 words on why people misunderstand {concept}.",
    "Write a short story of about 80 words about someone {topic}.",
    "Write a paragraph of about 80 words of advice for someone {topic}.",
]
SUMMARY_INSTRUCTIONS = [
    "Summarize the following passage in two sentences.",
    "Summarize the following passage in two sentences.",
    "Summarize the following text in one sentence.",
    "Give a two-sentence summary of the following passage.",
]


def _code(rng: random.Random) -> str:
    if rng.random() < 0.8:
        return rng.choice(CODE_TEMPLATES).format(lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS))
    t = rng.choice(CODE_EXTRA)
    a, b = rng.choice(PAIRS)
    things, field = rng.choice(SQL_THINGS)
    return t.format(
        concept=rng.choice(CONCEPTS),
        a=a,
        b=b,
        things=things,
        field=field,
        n=rng.randint(10, 500),
        cls=rng.choice(CLASSES),
    )


def _math(rng: random.Random) -> str:
    a, b = rng.randint(2, 19), rng.randint(2, 30)
    g = rng.randint(2, 9)
    ang1 = rng.randint(20, 100)
    t1 = rng.randint(6, 15)
    return rng.choice(MATH_TEMPLATES).format(
        name=rng.choice(NAMES),
        item=rng.choice(ITEMS),
        a=a,
        b=b,
        c=rng.randint(a + b, 200),
        c2=2 * (rng.randint(3, 40) + a),
        p=rng.randint(2, 15),
        big=rng.randint(40, 900),
        d=rng.randint(60, 600),
        h=rng.randint(2, 8),
        pct=rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75]),
        a2=a * g,
        b2=b * g,
        ang1=ang1,
        ang2=rng.randint(10, 170 - ang1),
        t1=t1,
        t2=t1 + rng.randint(1, 7),
    )


def _chat(rng: random.Random, templates: list[str]) -> str:
    return rng.choice(templates).format(topic=rng.choice(CHAT_TOPICS), concept=rng.choice(CHAT_CONCEPTS))


#: Draws in a row without a new prompt after which the templates count as spent.
SPENT_AFTER_MISSES = 20_000


def template_prompts(per_task: int, *, seed: int = 0, exclude: set[str] = frozenset()) -> dict[str, list[str]]:
    """Distinct template prompts per task type; ``summarization`` holds passage *requests*.

    Parameters
    ----------
    per_task : int
        Number of prompts per task type.
    seed : int
        Seed of the choices (the same seed gives the same prompts).
    exclude : set of str
        Prompt texts that must not appear (the held-out prompts).
    """
    rng = random.Random(seed)
    makers = {
        "code": lambda: _code(rng),
        "math": lambda: _math(rng),
        "chat": lambda: _chat(rng, CHAT_TEMPLATES),
        "summarization": lambda: _chat(rng, PASSAGE_TEMPLATES),
    }
    out: dict[str, list[str]] = {}
    for task, make in makers.items():
        seen: set[str] = set()
        misses = 0  # draws in a row that made nothing new: the templates are spent long before per_task * 200
        for _ in range(per_task * 200):
            if len(seen) >= per_task or misses >= SPENT_AFTER_MISSES:
                break
            text = make()
            if text not in exclude and text not in seen:
                seen.add(text)
                misses = 0
            else:
                misses += 1
        if len(seen) < per_task:
            raise ValueError(
                f"only {len(seen)} distinct {task} prompts can be made from the templates (asked for {per_task})"
            )
        out[task] = sorted(seen, key=lambda s: rng.random())
    return out


def build_distill_prompts(
    per_task: int,
    *,
    seed: int = 0,
    heldout_texts: set[str] = frozenset(),
    passage_tokens: int = 120,
    batch_size: int = 16,
    dtype: str = "bf16",
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Prompt records for ``speckv-distill corpus``; the target writes the summarization passages."""
    texts = template_prompts(per_task, seed=seed, exclude=set(heldout_texts))
    passages = write_passages(
        texts["summarization"], max_new_tokens=passage_tokens, batch_size=batch_size, dtype=dtype, progress=progress
    )
    rng = random.Random(seed + 1)
    records = []
    for task in ("code", "math", "chat"):
        records += [
            {"id": f"gen-{task}-{i:04d}", "task_type": task, "split": "train", "prompt": t}
            for i, t in enumerate(texts[task])
        ]
    i = 0
    for passage in passages:
        text = f"{rng.choice(SUMMARY_INSTRUCTIONS)}\n\n{passage}"
        if len(passage.split()) < 25 or text in heldout_texts:
            continue
        records.append(
            {"id": f"gen-summarization-{i:04d}", "task_type": "summarization", "split": "train", "prompt": text}
        )
        i += 1
    return records


def write_passages(
    requests: list[str], *, max_new_tokens: int = 120, batch_size: int = 16, dtype: str = "bf16", progress: bool = True
) -> list[str]:
    """Greedy answers of the target to passage requests, cut at the last full sentence."""
    import sys

    import torch
    from tqdm.auto import tqdm

    from .models import load_model, load_tokenizer

    tok = load_tokenizer("smollm2")
    model = load_model("smollm2", dtype)
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out: list[str] = []
    for i in tqdm(range(0, len(requests), batch_size), desc="passages", disable=not progress, file=sys.stderr):
        chunk = requests[i : i + batch_size]
        chats = [
            tok.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True, tokenize=False)
            for r in chunk
        ]
        enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        for row in gen[:, enc["input_ids"].shape[1] :]:
            text = tok.decode(row, skip_special_tokens=True).strip()
            cut = max(text.rfind(". "), text.rfind(".\n"), len(text) - 1 if text.endswith(".") else -1)
            out.append(" ".join(text[: cut + 1].split()) if cut > 0 else " ".join(text.split()))
    return out
