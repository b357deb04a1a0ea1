"""Prompts for large-scale self-distillation, with no Spec-Bench question in them.

Three sources, each a `PromptSpec` (text, source tag, optional follow-up):

* templates    - the built-in template x subject set (services/train/prompts.py) and a wider
                 task x topic grid (coding, math, reasoning, writing, advice, explanation, QA);
* passages     - context-bearing tasks (summarise, QA over a given passage, extraction, rewriting,
                 translation) over text found on this machine: Python's own documentation
                 (pydoc_data topics and stdlib module docstrings), English man pages, and German
                 man pages for German -> English translation;
* self-instruct - the target writes the request itself ("write a math word problem about ..."),
                 and its answer becomes a new prompt through the spec's `followup` template
                 ("{out}" = the cleaned answer), so the data also holds questions nobody templated.

`base_prompts(seed)` is deterministic (same list every run: datagen resumes by prompt identity).
Spec-Bench (shared/data/spec_bench_dev.jsonl) is never read here; it is evaluation data only.
"""

from __future__ import annotations

import ast
import gzip
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from services.train.prompts import SUBJECTS, default_prompts


@dataclass(frozen=True, slots=True)
class PromptSpec:
    text: str
    source: str  # "template" | "passage" | "self-instruct" | "derived"
    followup: str | None = None  # a template with "{out}": the target's answer -> a new prompt


TOPICS = SUBJECTS + [
    "a small bakery", "a school garden", "a city bus network", "a family budget", "a birthday party",
    "a job interview", "learning a new language", "a hospital emergency room", "a football team",
    "a mountain village", "a rainy weekend", "a lost wallet", "a science fair", "a used car purchase",
    "a flooded basement", "a camping trip", "a new smartphone app", "online shopping", "a museum visit",
    "a farmers market", "a power outage", "a wedding speech", "a library fundraiser", "a marathon",
    "a startup company", "a chemistry lab", "a music festival", "a volunteer program", "a road trip",
    "a dentist appointment", "an apartment lease", "a recipe book", "a bookstore", "a coffee shop",
    "a train delay", "a school exam", "a pet adoption", "a home renovation", "a tax return",
    "a hiking accident", "a local election", "a software release", "a data breach", "a wildfire",
    "a medieval castle", "the Silk Road", "the Industrial Revolution", "World War I", "the Renaissance",
    "the Cold War", "ancient Greece", "the Ming dynasty", "the Aztec empire", "the Apollo program",
    "quantum computing", "neural networks", "blockchain", "cloud computing", "operating systems",
    "databases", "sorting algorithms", "binary search", "hash tables", "recursion", "unit testing",
    "version control", "web servers", "encryption", "compilers", "regular expressions", "linked lists",
    "graph algorithms", "dynamic programming", "memory management", "concurrency", "REST APIs",
    "probability", "statistics", "fractions", "percentages", "geometry", "prime numbers", "algebra",
    "calculus", "logarithms", "matrices", "interest rates", "unit conversion", "averages",
    "nutrition", "diabetes", "exercise", "meditation", "mental health", "first aid", "allergies",
    "genetics", "evolution", "cells", "bacteria", "the solar system", "stars", "electricity",
    "magnetism", "sound waves", "thermodynamics", "chemical reactions", "atoms", "oceans",
    "deserts", "rivers", "weather forecasting", "hurricanes", "agriculture", "forests", "wolves",
    "whales", "birds migration", "coral reefs", "mushrooms", "trees", "insects", "elephants",
    "economics", "supply and demand", "taxes", "unemployment", "trade", "banking", "cryptocurrency",
    "marketing", "leadership", "negotiation", "customer service", "project management", "teamwork",
    "philosophy", "ethics", "law", "human rights", "journalism", "social media", "advertising",
    "painting", "architecture", "film making", "photography", "poetry", "theatre", "novels",
    "football", "basketball", "tennis", "swimming", "cycling", "yoga", "running", "skiing",
    "cooking pasta", "vegetarian diets", "wine making", "chocolate", "spices", "street food",
    "time travel", "dragons", "robots", "space colonies", "detectives", "pirates", "a haunted house",
]

TASKS = [
    "Explain {t} in simple terms.",
    "What are the most important things to know about {t}?",
    "Write a short story involving {t}.",
    "Write a formal email about {t}.",
    "Give me a list of practical tips related to {t}.",
    "What are the pros and cons of {t}?",
    "Write a short persuasive essay about {t}.",
    "Describe a typical day that involves {t}.",
    "Write a news report about {t}.",
    "Create a quiz with four questions about {t}, then give the answers.",
    "Compare {t} with something similar and explain the differences.",
    "What questions should I ask an expert on {t}?",
    "Write a product description for something related to {t}.",
    "Write a short speech about {t}.",
    "Imagine you are a tour guide. Talk about {t}.",
    "Write a limerick about {t}.",
    "What is the history of {t}? Keep it brief.",
    "Give a step-by-step guide for a beginner interested in {t}.",
]

CODE_TASKS = [
    "Write a Python function to {c}. Explain how it works.",
    "Write a Python program that can {c}. Include a short example.",
    "How would I {c} in JavaScript?",
    "Write a C function to {c}.",
    "Write a Java method to {c}.",
    "What is the time complexity of the usual way to {c}? Show code.",
    "Write unit tests for a function that should {c}.",
]

CODE_GOALS = [
    "count the vowels in a string", "merge two sorted lists", "find the largest element in a list",
    "check if a number is prime", "compute the factorial of a number", "reverse the words in a sentence",
    "remove duplicates from a list while keeping order", "flatten a nested list", "parse a CSV file",
    "compute the average of a list of numbers", "find the second largest number in a list",
    "convert Celsius to Fahrenheit", "check whether two strings are anagrams", "sort a dictionary by value",
    "count word frequencies in a text", "find the longest common prefix of a list of strings",
    "validate an email address", "compute the greatest common divisor of two numbers",
    "generate all permutations of a string", "implement binary search", "implement a stack",
    "implement a queue with two stacks", "detect a cycle in a linked list", "transpose a matrix",
    "read a JSON file and print its keys", "find all pairs in a list that sum to a target",
    "compute the n-th row of Pascal's triangle", "convert a number to Roman numerals",
    "check whether parentheses in a string are balanced", "rotate a list by k positions",
    "find the median of a list", "capitalize the first letter of every word", "compute a running sum",
    "split a list into chunks of size n", "find the missing number in a list from 1 to n",
]

MATH_TEMPLATES = [
    "{a} people share {b} apples equally. How many apples does each person get, and how many are left over?",
    "A store sells pens for ${a} each. If Maria buys {b} pens and pays with a $200 bill, how much change does she get?",
    "A car uses {a} liters of fuel per 100 km. How much fuel does it need for {b} km?",
    "Tom reads {a} pages a day. How many days does he need to finish a book with {c} pages?",
    "A recipe needs {a} eggs for {b} cookies. How many eggs are needed for {c} cookies?",
    "A rectangle is {a} m long and {b} m wide. What are its area and perimeter?",
    "If you save ${a} every week, how much will you have after {b} weeks?",
    "A class has {c} students. {a} of them walk to school and {b} take the bus; the rest cycle. How many cycle?",
    "What is {a}% of {c}?",
    "A worker earns ${a} per hour and works {b} hours a week. How much does the worker earn in 4 weeks?",
    "A tank holds {c} liters and is filled at {a} liters per minute. How long does filling it take?",
    "Sarah is {a} years old. Her father is {b} years older than twice her age. How old is her father?",
    "A shop had {c} shirts. It sold {a} on Monday and {b} on Tuesday. How many are left?",
    "Solve for x: {a}x + {b} = {c}.",
    "A train leaves at 9:00 and travels at {a} km/h. How far has it gone by {b}:00 if {b} is later in the day?",
]

SELF_INSTRUCT = [
    ("Write one realistic question that a person might ask an AI assistant about {t}. "
     "Reply with the question only.", "{out}"),
    ("Write a short math word problem about {t} that needs two or three steps to solve. "
     "Write only the problem, not the solution.", "{out}"),
    ("Write a coding task related to {t} that a programmer could ask for help with. "
     "Reply with the task only.", "{out}"),
    ("Write a tricky logic or reasoning question about {t}. Reply with the question only.", "{out}"),
    ("Write a request for a piece of creative writing about {t}. Reply with the request only.", "{out}"),
    ("Write two sentences in German about {t}.", "Translate German to English: {out}"),
    ("Write two sentences in French about {t}.", "Translate French to English: {out}"),
    ("Write a short news article about {t}.", "Summarize: {out}"),
    ("Write an encyclopedia paragraph about {t}.", "{out}\nWhat is the most important fact about {t}?"),
    ("Write a factual paragraph about {t} that mentions a date and a place.",
     "{out}\nWhen and where did this happen?"),
]

PASSAGE_TASKS = [
    "Summarize: {p}",
    "Summarize the following text in a few sentences.\n\n{p}",
    "{p}\nWhat is the main point of this text?",
    "{p}\nExplain the text above to a beginner.",
    "Extract the key terms from the following text and explain each in one line.\n\n{p}",
    "Write three questions about the following passage and answer them.\n\n{p}",
    "{p}\nWhat problem does the text above solve?",
    "Rewrite the following passage in plain, simple English.\n\n{p}",
    "{p}\nGive a one-sentence summary, then list three details.",
    "Read the text and answer: what should a user be careful about?\n\n{p}",
]


def _words(text: str) -> int:
    return len(text.split())


def _pack(paragraphs: list[str], lo: int = 60, hi: int = 260) -> list[str]:
    """Join consecutive paragraphs into passages of lo..hi words."""
    out, cur = [], []
    for para in paragraphs:
        para = " ".join(para.split())
        if not para:
            continue
        if cur and _words(" ".join(cur + [para])) > hi:
            if _words(" ".join(cur)) >= lo:
                out.append("\n".join(cur))
            cur = []
        if _words(para) <= hi:
            cur.append(para)
    if cur and _words(" ".join(cur)) >= lo:
        out.append("\n".join(cur))
    return out


def pydoc_passages() -> list[str]:
    """Python's language reference topics (shipped with every CPython as pydoc_data)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    out = []
    for name in sorted(topics):
        out += _pack(re.split(r"\n\s*\n", topics[name]))
    return out


def stdlib_docstrings(limit_modules: int = 400) -> list[str]:
    """Module, class and function docstrings of the standard library (parsed, never imported)."""
    root = Path(sys.modules["os"].__file__).parent
    out = []
    for path in sorted(root.glob("*.py"))[:limit_modules]:
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        for node in [tree] + [n for n in ast.walk(tree)
                              if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]:
            doc = ast.get_docstring(node)
            if doc and _words(doc) >= 60:
                out += _pack(re.split(r"\n\s*\n", doc))
    return out


_ROFF_CHARS = {":a": "ä", ":o": "ö", ":u": "ü", ":A": "Ä", ":O": "Ö", ":U": "Ü", "ss": "ß",
               "'e": "é", "`e": "è", "aq": "'", "dq": '"', "em": "-", "en": "-", "hy": "-", "bu": "*"}
_ROFF_NAMED = re.compile(r"\\\(([^ ]{2})|\\\[([^\]]{1,4})\]")
_ROFF_ESC = re.compile(r"\\f[BIRP]|\\f\(..|\\\*\(..|\\[&|^ ]|\\-|\\\(..|\\e")


def man_text(path: Path) -> str:
    """Plain text of a roff man page (macros dropped, font escapes removed)."""
    try:
        raw = gzip.open(path, "rt", errors="ignore").read() if path.suffix == ".gz" else path.read_text()
    except (OSError, EOFError, gzip.BadGzipFile):
        return ""
    lines = []
    for line in raw.splitlines():
        if line.startswith((".\\\"", "'\\\"")):
            continue
        if line.startswith("."):
            m = re.match(r"\.(SH|SS)\s+(.*)", line)
            if m:
                lines += ["", m.group(2).strip('"'), ""]
            elif re.match(r"\.(PP|LP|P|TP|IP|sp|br)\b", line):
                lines.append("")
            continue
        line = _ROFF_NAMED.sub(lambda m: _ROFF_CHARS.get(m.group(1) or m.group(2), ""), line)
        lines.append(_ROFF_ESC.sub(lambda m: "-" if m.group(0) == "\\-" else "", line))
    return "\n".join(lines)


def man_passages(lang_dir: str = "/usr/share/man/man1", limit: int = 1500) -> list[str]:
    d = Path(lang_dir)
    if not d.is_dir():
        return []
    out = []
    for p in sorted(d.iterdir())[:limit]:
        out += _pack(re.split(r"\n\s*\n", man_text(p)), lo=50, hi=220)
    return out


def german_sentences(limit: int = 3000) -> list[str]:
    """Sentences of prose from the German man pages (for German -> English translation)."""
    out = []
    for sub in ("man1", "man5", "man8"):
        d = Path("/usr/share/man/de") / sub
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            text = " ".join(man_text(p).split())
            for s in re.split(r"(?<=[.!?])\s+", text):
                if 8 <= _words(s) <= 40 and re.search(r"\b(der|die|das|und|ist|nicht)\b", s) \
                        and not re.search(r"[{}<>=|\\]", s):
                    out.append(s)
    return out[:limit]


def base_prompts(seed: int = 0) -> list[PromptSpec]:
    """Every prompt datagen may use, deduplicated, in a fixed interleaved order."""
    rng = random.Random(seed)
    groups: dict[str, list[PromptSpec]] = {}
    groups["builtin"] = [PromptSpec(p, "template") for p in default_prompts(seed)]
    groups["tasks"] = [PromptSpec(t.format(t=x), "template") for t in TASKS for x in TOPICS]
    groups["code"] = [PromptSpec(t.format(c=c), "template") for t in CODE_TASKS for c in CODE_GOALS]
    math = []
    for i in range(600):
        a, b = rng.randint(2, 40), rng.randint(2, 30)
        c = rng.randint(max(a, b) + 10, 500)
        math.append(PromptSpec(rng.choice(MATH_TEMPLATES).format(a=a, b=b, c=c), "template"))
    groups["math"] = math
    groups["self"] = [PromptSpec(q.format(t=x), "self-instruct", f.replace("{t}", x))
                      for q, f in SELF_INSTRUCT for x in TOPICS]
    passages = pydoc_passages() + stdlib_docstrings() + man_passages()
    rng.shuffle(passages)
    groups["passage"] = [PromptSpec(rng.choice(PASSAGE_TASKS).format(p=p), "passage") for p in passages]
    groups["translate"] = [PromptSpec(f"Translate German to English: {s}", "passage")
                           for s in german_sentences()]
    for g in groups.values():
        rng.shuffle(g)
    # interleave the groups so any prefix of the run covers every kind of request
    out, seen = [], set()
    iters = {k: iter(v) for k, v in groups.items()}
    while iters:
        for k in list(iters):
            spec = next(iters[k], None)
            if spec is None:
                del iters[k]
            elif spec.text not in seen:
                seen.add(spec.text)
                out.append(spec)
    return out


def clean_followup(answer: str, max_words: int = 400) -> str | None:
    """The target's answer to a self-instruct prompt, trimmed to something usable as a prompt
    (None when it is empty, too long, or a refusal-like stub)."""
    text = answer.strip().strip('"').strip()
    text = re.sub(r"^(Question|Task|Problem|Request)\s*:\s*", "", text, flags=re.I)
    if not 4 <= _words(text) <= max_words:
        return None
    return text
