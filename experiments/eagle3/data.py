"""Training data for an EAGLE-3 head: the target's own greedy answers to a built-in prompt corpus.

No dataset download: prompts come from templates (topics × task types: explain, list, write, summarise or
rewrite a given text, math word problems, code, compare, how-to, stories, emails), drawn deterministically
from a seed. Answers are regenerated with the target (transformers `generate`, greedy, left-padded batches)
and cached as JSONL under `<cache>/eagle3/data/<hash of the settings>.jsonl`, so a re-run skips them.
The serving workloads' prompt sets (experiments/prompt_sets/) are deliberately not used.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from experiments.tracking.records import read_jsonl

CORPUS_VERSION = 2          # 2: more topics, everyday advice / recipes / reasoning, answer-style modifiers

TOPICS = [
    "photosynthesis", "volcanoes", "black holes", "the water cycle", "vaccines", "compound interest",
    "the French Revolution", "machine learning", "electric cars", "coral reefs", "the stock market", "recycling",
    "sleep", "coffee", "honeybees", "the Apollo moon landing", "solar panels", "earthquakes", "the human heart",
    "democracy", "inflation", "rainforests", "the printing press", "blockchains", "climate change", "DNA",
    "the immune system", "chess", "jazz music", "the Olympic Games", "gardening", "meditation", "wind power",
    "the Great Wall of China", "smartphones", "antibiotics", "plate tectonics", "the Renaissance",
    "time management", "bicycles", "ocean tides", "nutrition", "cloud computing", "password security",
    "the pyramids of Egypt", "tea", "volunteering", "the solar system", "dinosaurs", "the human brain",
    "artificial satellites", "rain forests' animals", "the metric system", "electricity", "magnets", "bread baking",
    "the internet", "rainbows", "glaciers", "the moon", "photosynthesis in the ocean", "whales", "ants",
    "nuclear power", "batteries", "3D printing", "social media", "email etiquette", "the Roman Empire",
    "ancient Greece", "the Industrial Revolution", "World War I", "the Silk Road", "the Amazon river", "deserts",
    "hurricanes", "lightning", "the northern lights", "gravity", "sound waves", "light", "atoms", "vitamins",
    "exercise", "stress", "habits", "friendship", "budgeting", "credit cards", "renting an apartment",
    "job interviews", "remote work", "online learning", "video games", "photography", "painting", "poetry",
    "football", "tennis", "yoga", "camping", "travel on a budget", "public transport", "cities of the future",
    "space exploration", "Mars", "robots", "self-driving cars", "open-source software", "databases", "the cloud",
    "cybersecurity", "spreadsheets", "healthy breakfasts", "houseplants", "pets", "dogs", "cats", "birds",
    "recycling plastic", "fast fashion", "water pollution", "forests", "bees and pollination", "mushrooms",
]
MODIFIERS = ["", "", " Keep it short.", " Answer in three sentences.", " Use bullet points.",
             " Explain it like I'm five.", " Give an example.", " Be detailed.", " Use simple words."]
EXPLAIN = ["Explain {t} in simple terms.", "How does {t} work?", "What is {t}, and why does it matter?",
           "Explain {t} to a high school student.", "Give a short overview of {t}.",
           "What are the most important things to know about {t}?", "What is the history of {t}?"]
LISTS = ["List five interesting facts about {t}.", "Give me three tips related to {t}.",
         "What are the main advantages and disadvantages of {t}?", "List some common misconceptions about {t}.",
         "Name four key terms related to {t} and define each one.", "What are three questions people often ask "
         "about {t}? Answer each briefly."]
WRITE = ["Write a short poem about {t}.", "Write a short paragraph about {t} for a school newsletter.",
         "Write a tweet about {t}.", "Write a haiku about {t}.", "Write a short quiz with three questions "
         "about {t}.", "Write an introduction for a blog post about {t}."]
PASSAGES = [
    "The city council voted on Tuesday to extend the opening hours of the public library. From next month the "
    "library will stay open until nine in the evening on weekdays. Council members said the change responds to "
    "requests from students and working parents, and that it will be paid for by cutting printing costs.",
    "Honeybees communicate the location of flowers through a movement called the waggle dance. The angle of "
    "the dance shows the direction of the food relative to the sun, and its length shows the distance. Other "
    "bees watch the dance and then fly out to find the flowers themselves.",
    "Our quarterly sales grew by twelve percent compared with last year, driven mostly by online orders. Store "
    "sales were flat. Shipping costs rose, so the profit margin fell slightly. Next quarter we plan to expand "
    "the delivery network and to open two new stores in the north.",
    "A balanced breakfast gives the body energy for the morning. Foods rich in fibre, such as oats and fruit, "
    "release energy slowly. Adding some protein, like eggs or yoghurt, helps people feel full for longer. "
    "Sugary cereals give a quick boost but often lead to tiredness later.",
    "The bridge across the river was built in 1890 and was the first steel bridge in the region. It carried "
    "trains for eighty years before being converted into a path for walkers and cyclists. Today it is one of "
    "the most visited places in the town, especially at sunset.",
    "Regular software updates fix security problems and bugs. Many attacks use weaknesses that were fixed "
    "months earlier, but only on devices that were never updated. Turning on automatic updates is one of the "
    "simplest ways to keep a computer or phone safe.",
    "The new train line connects the airport with the city centre in eighteen minutes. Trains run every ten "
    "minutes from five in the morning until midnight. A single ticket costs four euros, and children under six "
    "travel for free.",
    "Composting turns kitchen scraps and garden waste into rich soil. Microorganisms break down the material "
    "when it has enough air and moisture. A good compost pile mixes green material, such as vegetable peels, "
    "with brown material, such as dry leaves or cardboard.",
    "The museum's new exhibition shows tools and clothing from the Bronze Age. Visitors can see a reconstructed "
    "house and try grinding grain with a stone. The exhibition is open until the end of the year and entry is "
    "free on the first Sunday of each month.",
    "Remote work has changed how many teams communicate. Written messages and video calls replaced many "
    "face-to-face meetings. Some workers enjoy the flexibility and the lack of a commute, while others miss "
    "the social contact and find it harder to separate work from home life.",
    "Mount Everest is the highest mountain above sea level, at about 8,849 metres. Climbers usually need weeks "
    "to adjust to the thin air. Most expeditions start from base camps in Nepal or Tibet and climb in spring, "
    "when the weather is most stable.",
    "The school garden project started with four raised beds and a small budget. Students plant vegetables in "
    "spring and harvest them before the summer break. Teachers use the garden for lessons in biology and maths, "
    "and the produce is shared with families.",
]
GROUNDED = ["Summarise the following text in one sentence:\n\n{p}", "Extract the key points from this text as a "
            "bulleted list:\n\n{p}", "Rewrite this text in simpler words:\n\n{p}", "Write a title for this text "
            "and explain your choice:\n\n{p}", "What are the main facts in this text?\n\n{p}",
            "Turn this text into three questions with answers:\n\n{p}", "Translate the main idea of this text into "
            "one tweet:\n\n{p}", "What is the tone of this text? Explain.\n\n{p}", "List all the numbers in this "
            "text and what they refer to:\n\n{p}", "Rewrite this text as a short formal announcement:\n\n{p}"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the factorial of n", "counts the vowels in "
    "a string", "finds the largest number in a list", "removes duplicates from a list while keeping the order",
    "returns the first n Fibonacci numbers", "checks whether a word is a palindrome", "sorts a list of "
    "dictionaries by a given key", "converts Celsius to Fahrenheit", "counts the lines in a text file",
    "merges two sorted lists", "computes the average of a list of numbers", "flattens a nested list",
    "counts how often each word appears in a sentence", "returns the greatest common divisor of two numbers",
    "implements binary search on a sorted list", "checks whether two strings are anagrams", "returns the "
    "squares of the even numbers in a list", "capitalises the first letter of every word",
    "checks whether a year is a leap year", "converts a number to Roman numerals", "validates an email address",
    "finds the second largest number in a list", "rotates a list by k positions", "counts the digits of a number",
    "reads a JSON file and prints its keys", "returns the median of a list", "generates a random password",
    "checks whether brackets in a string are balanced", "converts a string to title case", "sums a matrix row by row",
]
CODE = ["Write a Python function that {c}.", "Write a JavaScript function that {c}.",
        "Show me how to write a function that {c} in Python, and explain how it works.",
        "Write a Python function that {c}, with a docstring and an example.", "Write a Java method that {c}.",
        "Write a C function that {c}.", "Write a function that {c}, then write two unit tests for it.",
        "Explain, step by step, how you would write a program that {c}."]
SKILLS = ["cooking", "writing essays", "learning a new language", "drawing", "running", "saving money",
          "playing the guitar", "public speaking", "programming", "taking photos", "chess", "studying for exams"]
HOWTO = ["How can I get better at {s}?", "Give me a step-by-step plan for a beginner in {s}.",
         "What mistakes do beginners make in {s}?"]
PAIRS = [("a virus", "a bacterium"), ("weather", "climate"), ("a list", "a tuple in Python"), ("speed", "velocity"),
         ("a lake", "a sea"), ("HTTP", "HTTPS"), ("a crocodile", "an alligator"), ("stocks", "bonds"),
         ("RAM", "storage"), ("a comet", "an asteroid"), ("baking soda", "baking powder"), ("a simile",
         "a metaphor"), ("mitosis", "meiosis"), ("a democracy", "a monarchy"), ("TCP", "UDP")]
COMPARE = ["What is the difference between {a} and {b}?", "Compare {a} and {b} in a short table.",
           "Explain how {a} and {b} are similar and how they differ."]
CHARACTERS = ["a lonely lighthouse keeper", "a curious cat", "a young inventor", "an old sailor", "a shy dragon",
              "a detective in a small town", "a girl who can talk to birds", "a retired astronaut"]
EVENTS = ["finds a mysterious map", "loses their way in a forest", "makes an unexpected friend",
          "discovers a hidden talent", "has to solve a puzzle to get home", "wins a competition"]
STORY = ["Write a short story about {c} who {e}.", "Tell a bedtime story about {c} who {e}."]
EMAILS = [("my neighbour", "the noise late at night"), ("my manager", "taking a day off next week"),
          ("a customer", "a delayed order"), ("my teacher", "an extension for my homework"),
          ("a hotel", "changing my booking"), ("a colleague", "feedback on a presentation"),
          ("my team", "the new meeting schedule"), ("a supplier", "a wrong invoice"),
          ("the school", "my child's absence"), ("a friend", "a birthday party invitation"),
          ("the city council", "a broken street light"), ("a new client", "our first project meeting")]
EMAIL = ["Write a polite email to {r} about {s}.", "Write a short, friendly message to {r} about {s}.",
         "Draft a formal letter to {r} regarding {s}."]
SITUATIONS = ["a rainy weekend at home", "a weekend with no plans", "a long flight", "my first day at a new job",
              "a phone interview next week", "moving to a new city", "a tight budget this month", "a noisy neighbour",
              "feeling tired every afternoon", "a friend's birthday", "a family dinner", "learning to cook",
              "a trip to the mountains", "a presentation at work", "starting university", "a small garden",
              "working from home", "a picky eater at home", "a lost wallet", "a power cut in the evening",
              "a slow laptop", "a messy room", "a week-long holiday", "a new puppy", "an exam next week"]
ADVICE = ["What are some good things to do on {x}?", "I have {x}. How should I prepare?",
          "Give me some practical advice for {x}.", "What should I keep in mind for {x}?",
          "Make a simple plan for {x}."]
DISHES = ["mushroom soup", "pancakes", "a vegetable curry", "banana bread", "a green salad", "fried rice",
          "lentil soup", "scrambled eggs", "a pasta sauce", "guacamole", "a fruit smoothie", "chocolate cookies",
          "roast chicken", "a vegetable stir fry", "hummus", "an omelette", "porridge", "a simple pizza"]
RECIPE = ["How do I make {d} at home?", "Give me a simple recipe for {d}.", "What do I need to cook {d}?",
          "Explain step by step how to make {d}."]
PUZZLES = ["If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
           "A bat and a ball cost {a}.10 dollars together. The bat costs {a} dollar more than the ball. How much "
           "does the ball cost?", "Which is heavier, a kilogram of feathers or a kilogram of iron? Why?",
           "If it takes {b} machines {b} minutes to make {b} widgets, how long do {c} machines take to make {c} "
           "widgets?", "Is {n} an even or an odd number? Think step by step.",
           "I have {b} brothers and each brother has {c} sisters. What is the smallest number of sisters I have?",
           "What comes next in the sequence {a}, {a2}, {a3}, ...? Explain the pattern.",
           "A farmer has {n} sheep and all but {b} run away. How many are left?",
           "Think step by step: how many minutes are there in {b} hours and {c} minutes?",
           "If today is {day}, what day of the week will it be in {n} days? Reason it out."]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def _math(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(3, 12)
    return rng.choice([
        f"A shop sells pencils for {a} cents each. If Maria buys {b} pencils, how much does she pay?",
        f"A train travels at {a + 40} km per hour for {c} hours. How far does it go?",
        f"Tom has {a + b} apples and gives {b} to his friend. How many apples does he have left?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
        f"A recipe needs {c} eggs for 4 people. How many eggs are needed for {4 * b} people?",
        f"What is {b * 5}% of {a * 10}? Show your steps.",
        f"Sarah saves {c} dollars a week. How many weeks does she need to save {c * a} dollars?",
        f"A class has {a + 10} students and {b} of them are absent. What fraction of the class is present?",
        f"If a car uses {c} litres of fuel per 100 km, how much fuel does it need for {a * 10} km?",
        f"Solve for x: {c}x + {a} = {c * b + a}. Explain each step.",
    ])


def _reasoning(rng: random.Random) -> str:
    a, b, c, n = rng.randint(1, 9), rng.randint(2, 9), rng.randint(2, 12), rng.randint(10, 400)
    return rng.choice(PUZZLES).format(a=a, a2=a * 2, a3=a * 4, b=b, c=c, n=n, day=rng.choice(DAYS))


# kind -> (templates, placeholder, fillers): one template, one filler, one modifier (in this order: seeded corpora)
ONE_FILLER = {"explain": (EXPLAIN, "t", TOPICS), "list": (LISTS, "t", TOPICS), "advice": (ADVICE, "x", SITUATIONS),
              "recipe": (RECIPE, "d", DISHES), "write": (WRITE, "t", TOPICS), "grounded": (GROUNDED, "p", PASSAGES),
              "code": (CODE, "c", CODE_TASKS), "howto": (HOWTO, "s", SKILLS)}


def _fill(rng: random.Random, kind: str) -> str:
    if kind in ONE_FILLER:
        templates, key, fillers = ONE_FILLER[kind]
        return rng.choice(templates).format(**{key: rng.choice(fillers)}) + rng.choice(MODIFIERS)
    if kind == "reasoning":
        return _reasoning(rng)
    if kind == "math":
        return _math(rng)
    if kind == "compare":
        a, b = rng.choice(PAIRS)
        return rng.choice(COMPARE).format(a=a, b=b) + rng.choice(MODIFIERS)
    if kind == "story":
        return rng.choice(STORY).format(c=rng.choice(CHARACTERS), e=rng.choice(EVENTS)) + rng.choice(MODIFIERS)
    if kind == "email":
        r, s = rng.choice(EMAILS)
        return rng.choice(EMAIL).format(r=r, s=s) + rng.choice(MODIFIERS)
    raise ValueError(kind)


KINDS = ["explain", "explain", "list", "advice", "write", "grounded", "math", "code", "howto", "compare", "story",
         "email", "recipe", "reasoning"]


def serving_prompts() -> set[str]:
    """Every user message of the serving prompt sets (experiments/prompt_sets): never a training prompt."""
    folder = Path(__file__).resolve().parents[1] / "prompt_sets"
    return {m["content"] for f in sorted(folder.glob("*.jsonl")) for row in read_jsonl(f)
            for m in row.get("messages", []) if m.get("role") == "user"}


def build_prompts(n: int, seed: int) -> list[dict]:
    """`n` distinct single-turn chat prompts, deterministic in (n, seed): rows {"id", "kind", "messages"}.
    Prompts equal to a serving prompt are skipped (those sets measure the head, held out)."""
    rng = random.Random(seed)
    rows, seen, exhausted = [], serving_prompts(), set()
    while len(rows) < n:
        kinds = [k for k in KINDS if k not in exhausted]
        if not kinds:
            raise ValueError(f"the template corpus cannot give {n} distinct prompts")
        kind = kinds[len(rows) % len(kinds)]
        for _ in range(200):
            text = _fill(rng, kind)
            if text not in seen:
                break
        else:
            exhausted.add(kind)      # every combination of this kind is used: the others fill the rest
            continue
        seen.add(text)
        rows.append({"id": f"{kind}-{len(rows)}", "kind": kind, "messages": [{"role": "user", "content": text}]})
    return rows


@dataclass(frozen=True)
class DataSettings:
    model_path: str
    num_prompts: int = 512
    seed: int = 0
    max_new_tokens: int = 128
    batch_size: int = 64
    dtype: str = "bfloat16"     # the engines serve the target in bfloat16: its greedy answers are the ones to learn
    device: str = "cpu"
    synthetic_prompts: int = 0  # extra prompts the target writes itself (synth_prompts.py), after the templates

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self._ident(), sort_keys=True).encode()).hexdigest()[:16]

    def _ident(self, *drop: str) -> dict:
        cfg = Path(self.model_path, "config.json")
        model_id = hashlib.sha256(cfg.read_bytes()).hexdigest()[:12] if cfg.exists() else self.model_path
        d = {**asdict(self), "model_path": model_id, "corpus": CORPUS_VERSION}
        if not self.synthetic_prompts:
            drop = (*drop, "synthetic_prompts")     # template-only corpora keep the keys they had before the field
        return {k: v for k, v in d.items() if k not in drop}

    def build(self, progress: Callable[[str], None] = print) -> Path:
        return generate_responses(self, progress)

    def answers_key(self) -> str:
        """What an answer depends on (not how many prompts were drawn): cached answers with the same
        answers_key are reused when a larger prompt set starts with the same prompts."""
        return hashlib.sha256(json.dumps(self._ident("num_prompts"), sort_keys=True).encode()).hexdigest()[:16]


def eagle3_cache() -> Path:
    """`<cache>/eagle3`; SPECWS_EAGLE3_CACHE overrides it (the GPU command sets it: it runs without OmegaConf)."""
    if os.environ.get("SPECWS_EAGLE3_CACHE"):
        return Path(os.environ["SPECWS_EAGLE3_CACHE"])
    from experiments.config.paths import cache_dir

    return cache_dir() / "eagle3"


def _reusable_answers(s: DataSettings) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for side in sorted((eagle3_cache() / "data").glob("*.settings.json")):
        if json.loads(side.read_text()).get("answers_key") != s.answers_key():
            continue
        for r in load_rows(side.with_name(side.name.replace(".settings.json", ".jsonl"))):
            found[json.dumps(r["messages"], sort_keys=True)] = r
    return found


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])]


def greedy_answers(model, tok, rows: list[dict], max_new_tokens: int, batch_size: int,
                   progress: Callable[[str], None] = print) -> None:
    """Fill rows[i]["response_ids"] / ["finished"] with the model's greedy answer to rows[i]["prompt_ids"]
    (left-padded batches of similar length, on the model's device). An answer ends at the first end-of-turn
    token (kept) or after `max_new_tokens`."""
    import torch

    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos_ids))
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt_ids"]))
    t0 = time.time()
    for b in range(0, len(order), batch_size):
        batch = [rows[i] for i in order[b: b + batch_size]]
        width = max(len(r["prompt_ids"]) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r["prompt_ids"])) + r["prompt_ids"] for r in batch])
        mask = torch.tensor([[0] * (width - len(r["prompt_ids"])) + [1] * len(r["prompt_ids"]) for r in batch])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                 eos_token_id=sorted(eos_ids))
        for r, seq in zip(batch, gen[:, width:].tolist(), strict=True):
            resp = []
            for t in seq:
                resp.append(t)
                if t in eos_ids:
                    break
            r["response_ids"], r["finished"] = resp, resp[-1] in eos_ids
        progress(f"eagle3 data: {min(b + batch_size, len(order))}/{len(order)} answers, {time.time() - t0:.0f}s")


def generate_responses(s: DataSettings, progress: Callable[[str], None] = print) -> Path:
    """Greedy answers of the target, cached; returns the JSONL path (rows: id, kind, prompt_ids, response_ids,
    finished)."""
    out = eagle3_cache() / "data" / f"{s.key()}.jsonl"
    if out.exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(s.model_path)
    model = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=getattr(torch, s.dtype)).eval().to(s.device)
    rows = build_prompts(s.num_prompts, s.seed)
    if s.synthetic_prompts:
        from experiments.eagle3.synth_prompts import synthesize_prompts

        texts = synthesize_prompts(model, tok, s.synthetic_prompts, s.seed, serving_prompts() | {
            r["messages"][0]["content"] for r in rows}, batch_size=s.batch_size, progress=progress)
        rows += [{"id": f"synthetic-{i}", "kind": "synthetic", "messages": [{"role": "user", "content": t}]}
                 for i, t in enumerate(texts)]
    known = _reusable_answers(s)
    for r in rows:
        r["prompt_ids"] = chat_ids(tok, r["messages"])
        old = known.get(json.dumps(r["messages"], sort_keys=True))
        if old is not None and old["prompt_ids"] == r["prompt_ids"]:
            r["response_ids"], r["finished"] = old["response_ids"], old["finished"]
    todo = [r for r in rows if "response_ids" not in r]
    progress(f"eagle3 data: {len(rows) - len(todo)} answers reused from the cache, {len(todo)} to generate")
    greedy_answers(model, tok, todo, s.max_new_tokens, s.batch_size, progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    with tmp.open("w") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in ("id", "kind", "messages", "prompt_ids", "response_ids",
                                                  "finished")}) + "\n")
    tmp.replace(out)
    out.with_name(f"{s.key()}.settings.json").write_text(json.dumps({**s._ident(), "answers_key": s.answers_key()}))
    return out


def load_rows(path: Path) -> list[dict]:
    return read_jsonl(path)
