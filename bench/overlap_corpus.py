"""The traffic ``bench/detection.py`` judges for the overlap and reworded figures: benign exchanges
of several callers built from real text nobody here wrote (Debian's documentation and licences,
the standard library's docstrings and code, famous quotes), which share system prompts, licences,
recited API docs, quoted and retold articles, code idioms and public topics (cities, products,
libraries: the same names and figures asked about, mentioned, pasted as notes and told from
memory); private passages of 40, 80 and 200 words leaked from one caller's prompt into another's
answer, each checked to share no 8-word run with any other caller's text (so a miss is the rule's,
not boilerplate's); and reworded leaks, new sentences around k of one caller's private names,
figures and identifiers.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import sysconfig
from pathlib import Path
from typing import NamedTuple

from kvcanary.monitor.traffic.judged_record import TrafficRecord
from kvcanary.tap.fingerprints import Fingerprinter
from kvcanary.tap.record import Exchange, summarize

#: The tap's fingerprint key in every figure (a fixed key: the same traffic, run after run).
KEY = b"bench-fingerprint-key-0123456789"

#: Famous public-domain lines callers ask about: the model recites them, nobody pastes them.
QUOTES = [
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived "
    "in Liberty, and dedicated to the proposition that all men are created equal.",
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer the slings and "
    "arrows of outrageous fortune, or to take arms against a sea of troubles.",
    "We hold these truths to be self-evident, that all men are created equal, that they are endowed by "
    "their Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit "
    "of Happiness.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
    "in want of a wife.",
    "Ask not what your country can do for you, ask what you can do for your country.",
    "The only thing we have to fear is fear itself: nameless, unreasoning, unjustified terror which "
    "paralyzes needed efforts to convert retreat into advance.",
    "Premature optimization is the root of all evil; yet we should not pass up our opportunities in "
    "that critical 3 percent.",
]
#: How callers ask about a public topic (each caller words it its own way).
ASKS = ["Explain {}.", "What does {} do?", "Show me the documentation of {}.", "How do I use {} in Python?"]
#: Modules whose public docstrings are the API documentation callers ask about.
API_MODULES = (  # noqa: SIM905 (one word a module, 36 of them)
    "json os re collections itertools functools pathlib subprocess shutil string textwrap random "
    "statistics datetime heapq bisect csv argparse logging threading queue socket hashlib base64 "
    "zipfile tarfile tempfile glob fnmatch difflib inspect dataclasses enum contextlib copy pickle"
).split()
#: Public topics callers ask about, each with the names and figures any answer about it may hold
#: (the model knows them): the same tokens reach many callers without any leak.
TOPICS: dict[str, list[str]] = {
    "Lisbon": ["Tagus", "1147", "Alfama", "Belem", "Pessoa", "1755", "Baixa", "Sintra"],
    "Berlin": ["Spree", "1237", "Reichstag", "Brandenburg", "Kreuzberg", "1989", "Tegel", "Charlottenburg"],
    "Kyoto": ["Kamo", "Gion", "Kinkakuji", "Heian", "1868", "Arashiyama", "Fushimi", "Nishiki"],
    "Montreal": ["Laurentian", "1642", "Maisonneuve", "Plateau", "Mirabel", "1976", "Verdun", "Habs"],
    "PostgreSQL": ["5432", "MVCC", "pg_dump", "1996", "Stonebraker", "WAL", "psql", "autovacuum"],
    "Redis": ["6379", "Sanfilippo", "2009", "RDB", "AOF", "Valkey", "ZADD", "Sentinel"],
    "Kubernetes": ["kubelet", "etcd", "2014", "kubectl", "Borg", "CNCF", "6443", "DaemonSet"],
    "NumPy": ["ndarray", "Oliphant", "2006", "BLAS", "einsum", "float64", "NEP", "linspace"],
    "ThinkPad": ["X1", "Lenovo", "1992", "TrackPoint", "IBM", "T480", "Carbon", "Yamato"],
    "Raspberry Pi": ["BCM2712", "Broadcom", "2012", "Upton", "GPIO", "Cortex", "A76", "RP2040"],
    "Danube": ["2850", "Donaueschingen", "Sulina", "Vienna", "Budapest", "Belgrade", "Iron Gates", "Passau"],
    "Apollo 11": ["1969", "Armstrong", "Aldrin", "Collins", "Columbia", "Eagle", "Tranquility", "Saturn"],
    "Linux": ["Torvalds", "1991", "GPLv2", "systemd", "ext4", "Btrfs", "KVM", "Kbuild"],
    "SQLite": ["Hipp", "2000", "B_tree", "WAL", "PRAGMA", "FTS5", "R_tree", "VACUUM"],
    "Rust": ["Graydon", "2015", "Cargo", "rustc", "Mozilla", "crates_io", "Clippy", "MIR"],
    "Amsterdam": ["Amstel", "1275", "Rijksmuseum", "Jordaan", "Schiphol", "IJ", "1602", "Vondelpark"],
}
#: How an answer tells one fact of a topic (the model's own sentences).
TOLD = ["{} is tied to {}.", "People link {} with {}.", "You will often hear {} mentioned with {}.",
        "A key fact about {}: {}.", "{} and {} go together in most accounts."]  # fmt: skip
#: The new sentences a reworded leak puts another caller's tokens in: none holds a token itself.
REWORDED = ["we went over {} again before the review", "the note about {} was checked twice",
            "someone asked whether {} still applies", "as agreed, {} stays on the list",
            "the figures for {} looked right to everyone", "next week we revisit {} with the team",
            "it turned out {} mattered more than expected", "nobody objected to {} in the end"]  # fmt: skip
SYSTEM = "You are the assistant of a software company. Answer in English, briefly, and cite the text you use."
WORD_RE = re.compile(r"\w+")  # the tap's words (kvcanary/tap/fingerprints.py)
LEAK_WORDS = (40, 80, 200)
#: Private tokens of one caller a reworded leak puts in another's answer.
LEAK_TOKENS = (3, 5, 8)


def api_docs() -> dict[str, str]:
    """Return the standard library's docstrings of 12 words or more, by name, each cut at 150
    words: real API documentation nobody here wrote, which every caller may ask about."""
    found: dict[str, str] = {}
    for name in API_MODULES:
        module = importlib.import_module(name)
        for attr, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) and not attr.startswith("_") else None
            if doc and getattr(obj, "__module__", None) == name and len(WORD_RE.findall(doc)) >= 12:
                found[f"{name}.{attr}"] = " ".join(doc.split()[:150])
    return found


def stdlib_code() -> list[str]:
    """Return the standard library's Python sources: code with the idioms every caller's code has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(errors="replace") for p in sorted(root.glob("*.py")) if p.stat().st_size > 4000]


class Sent(NamedTuple):
    """One benign exchange: who sent it, what kind it is, and its texts."""

    caller: int
    kind: str
    prompt: str
    response: str


def benign_traffic(docs: list[str], callers: int, exchanges: int) -> tuple[list[Sent], list[tuple[int, str]]]:
    """Return the benign exchanges, and each caller's private text as it was sent, in order.

    Caller ``k`` reads documents no other caller reads (``docs[k::callers + 1]``, as customers'
    own data) and code of its own (standard-library files), and shares with others: the system
    prompt (all), a team prompt (callers 2j and 2j+1), Debian's licences (half its prompts), an
    article pasted by two callers (7 and 0, 1 and 2, ...), and public topics asked in its own
    words (API docs, famous quotes, what a licence says) that the model answers from memory.
    """
    rng = random.Random(3)
    licences = sorted(Path("/usr/share/common-licenses").glob("*"))
    shared = [p.read_text(errors="replace")[:3000] for p in licences if p.is_file()][:6]
    public = docs[callers :: callers + 1]
    teams = [f"Team {j} rules: " + public[j][:600] for j in range(callers // 2 + 1)]
    articles = [d[:3000] for d in public[callers:]]
    apis, code = sorted(api_docs().items()), stdlib_code()
    sent: list[Sent] = []
    private: list[tuple[int, str]] = []
    kinds = ["own"] * 7 + ["article"] * 3 + ["api"] * 3 + ["quote", "recite", "retold"] + ["code"] * 4
    kinds += ["topic"] * 3
    for i in range(exchanges):
        k, kind = i % callers, rng.choice(kinds)
        system = f"{SYSTEM}\n{teams[k // 2]}"
        doc = rng.choice(docs[k :: callers + 1])
        at = rng.randrange(max(1, len(doc) - 2500))
        own, licence = doc[at : at + 2000], rng.choice(shared) if rng.random() < 0.5 else ""
        if kind == "own":
            prompt = "\n".join([system, licence, own])
            response = "Here it is: " + rng.choice([own[200:900], (licence or system)[300:1000], system])
            private.append((k, own))
        elif kind == "article":
            article = articles[((k + 1) % callers // 2 + i // 997) % len(articles)]
            at = rng.randrange(max(1, len(article) - 800))
            prompt, response = (
                f"{system}\n{article}",
                "The article says: " + article[at : at + rng.randrange(200, 800)],
            )
        elif kind == "retold":  # a caller asks about an article two others pasted: told it from memory
            article = articles[((k + 3) % callers // 2 + i // 997) % len(articles)]
            at = rng.randrange(max(1, len(article) - 800))
            prompt = f"{system}\nWhat does the article {article[:40]!r} say?"
            response = "It says: " + article[at : at + rng.randrange(150, 700)]
        elif kind == "api":
            name, doc = rng.choice(apis[: len(apis) // 3]) if rng.random() < 0.7 else rng.choice(apis)
            prompt, response = (
                f"{system}\n{ASKS[k % len(ASKS)].format(name)}",
                f"Sure. {doc} Hope this helps.",
            )
        elif kind == "quote":
            quote = rng.choice(QUOTES)
            prompt = [
                f"Who wrote: {quote[:40]}?",
                f"Where is this from: {quote[:30]}",
                f"Finish the quote {quote[:25]}",
            ][k % 3]
            response = f'The full line reads: "{quote}"'
        elif kind == "recite":
            text = rng.choice(shared)
            at = rng.randrange(300, 1500)
            prompt, response = (
                f"{system}\nWhat does this licence say: {text[:60]}",
                "In short: " + text[at : at + 500],
            )
        elif kind == "topic":
            prompt, response = topic_exchange(rng, system)
        else:
            source = rng.choice(code[k::callers])
            at = rng.randrange(max(1, len(source) - 1500))
            prompt = f"{system}\nWrite the code for this, in our house style:\n{own[:600]}"
            response = "```python\n" + source[at : at + rng.randrange(400, 1500)] + "\n```"
            private.append((k, own[:600]))
        sent.append(Sent(k, kind, prompt, response))
    return sent, private


def topic_exchange(rng: random.Random, system: str) -> tuple[str, str]:
    """Return a question about a public topic and the answer the model gives from memory. The
    caller names the topic, or mentions a few of its tokens, or pastes notes holding many."""
    name = rng.choice(sorted(TOPICS))
    tokens = TOPICS[name]
    mode = rng.random()
    if mode < 0.4:
        ask = f"Tell me about {name}."
    elif mode < 0.7:
        ask = f"I read that {name} has to do with {', '.join(rng.sample(tokens, rng.randint(1, 3)))}. True?"
    else:
        ask = (
            f"Here are my notes on {name}: {'; '.join(rng.sample(tokens, rng.randint(4, 8)))}. Tidy them up."
        )
    told = " ".join(rng.choice(TOLD).format(name, t) for t in rng.sample(tokens, rng.randint(3, 8)))
    return f"{system}\n{ask}", f"{name} is well known. {told}"


def records_of(sent: list[Sent], tap: Fingerprinter | None = None) -> list[TrafficRecord]:
    """Return the records the tap would send of the exchanges (``tap``: its fingerprints, with the
    public texts it was given), as the monitor reads them."""
    tap = tap or Fingerprinter(KEY)
    exchanges = [
        Exchange(f"r{i}", 1.8e9 + i, f"c{s.caller}", "team", "http://x", prompt=s.prompt, response=s.response)
        for i, s in enumerate(sent)
    ]
    return [TrafficRecord.model_validate(summarize(exchange, tap)) for exchange in exchanges]


def grams(text: str) -> set[int]:
    """Return the text's 8-word runs (the tap's words), hashed: what shows a passage is private."""
    words = WORD_RE.findall(text.lower())
    return {hash(tuple(words[i : i + 8])) for i in range(len(words) - 7)}


def private_leaks(
    sent: list[Sent],
    private: list[tuple[int, str]],
    callers: int,
    public: list[str] = (),  # type: ignore[assignment]
) -> list[tuple[int, int, str]]:
    """Return injected leaks, 300 of each length: (victim, words, passage), a stretch of a caller's
    private text (recent enough to be in the window) none of whose 8-word runs any other caller sent
    (boilerplate inside a caller's documents is common by design, and no leak of anyone's) nor any
    of the ``public`` texts holds (a licence quoted in a caller's document is nobody's secret)."""
    rng = random.Random(5)
    known = set().union(*map(grams, public)) if public else set()
    others: dict[int, set[int]] = {k: set(known) for k in range(callers)}
    for s in sent[-850:]:
        held = grams(s.prompt) | grams(s.response)
        for k in others:
            if k != s.caller:
                others[k] |= held
    leaks: list[tuple[int, int, str]] = []
    recent = private[-len(private) * 850 // len(sent) :]
    for words in LEAK_WORDS:
        made = 0
        while made < 300:
            victim, text = rng.choice(recent)
            spans = [m.span() for m in WORD_RE.finditer(text)]
            if len(spans) < words + 2:
                continue
            first = rng.randrange(len(spans) - words)
            passage = text[spans[first][0] : spans[first + words - 1][1]]
            if grams(passage) & others[victim]:
                continue
            leaks.append((victim, words, passage))
            made += 1
    return leaks


def shaped(word: str) -> bool:
    """Whether a word is a name, a figure or an identifier to the eye: a capital, a digit or an
    underscore, three characters or more (the bench's own reading, not the tap's rule)."""
    return len(word) >= 3 and (word[0].isupper() or "_" in word or any(c.isdigit() for c in word))


def reworded_leaks(
    sent: list[Sent], private: list[tuple[int, str]], callers: int
) -> list[tuple[int, int, str, str]]:
    """Return reworded leaks, 300 for each k of ``LEAK_TOKENS``: (victim, k, the reader's prompt,
    the leaked answer). The answer puts k tokens of a caller's recent private text (names, figures,
    identifiers no other caller sent lately) into new sentences; the reader, the next caller,
    asked one of its own recent questions."""
    rng = random.Random(7)
    others: dict[int, set[str]] = {k: set() for k in range(callers)}
    asked: dict[int, list[str]] = {k: [] for k in range(callers)}
    for s in sent[-850:]:
        words = {w.lower() for w in WORD_RE.findall(f"{s.prompt} {s.response}")}
        for k in others:
            if k != s.caller:
                others[k] |= words
        if s.kind == "own":
            asked[s.caller].append(s.prompt)
    recent = private[-len(private) * 850 // len(sent) :]
    leaks: list[tuple[int, int, str, str]] = []
    for k in LEAK_TOKENS:
        made = 0
        while made < 300:
            victim, text = rng.choice(recent)
            mine = [
                w
                for w in dict.fromkeys(WORD_RE.findall(text))
                if shaped(w) and w.lower() not in others[victim]
            ]
            if len(mine) < k:
                continue
            told = [rng.choice(REWORDED).format(token) for token in rng.sample(mine, k)]
            answer = "Sure. " + " ".join(f"{t[0].upper()}{t[1:]}." for t in told)
            leaks.append((victim, k, rng.choice(asked[(victim + 1) % callers]), answer))
            made += 1
    return leaks
