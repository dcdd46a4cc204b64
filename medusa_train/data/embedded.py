"""The embedded offline corpus: procedurally generated user/assistant conversations.

Nothing is downloaded: every conversation is written by the templates below from the word lists in
`medusa_train.data.lexicon`. The tasks have real structure (stories about characters, recipes with
numbered steps and timed totals, arithmetic word problems with worked answers, day-of-week and unit
arithmetic, counting, facts about animals, a made-up glossary, reading comprehension over a generated
context, emails, directions turned into steps, lists) and multi-turn follow-ups ("make it shorter",
"sort them alphabetically", "what if ...") whose answers are consistent with the earlier turns.

The assistant replies are templated with a little variation, so a small model trained for minutes
gives fluent, predictable greedy continuations (what Medusa heads need), while the slot filling,
copying from the prompt, and the worked arithmetic are regularities it has to learn, not memorise.

Determinism: every conversation is generated from its own `random.Random` seeded by a string
namespace (`"{namespace}:{seed}:{index}"`), so no global state is touched, conversation `i` is the
same whatever `n` is, and generating 30k conversations takes about a second.

Splits: `embedded_conversations(split, n, seed)` partitions the conversation space by a stable hash
of the first user message (about 1 in 10 to `eval`, the rest to `train`), so the two splits never
share a first prompt, whatever their seeds and sizes.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Iterator

from medusa_train.data import lexicon as lx

Message = dict[str, str]
Conversation = list[Message]

SPLITS = ("train", "eval")
_EVAL_BUCKETS = 10  # 1 in _EVAL_BUCKETS first prompts belongs to the eval split


# ---------------------------------------------------------------------------------------------
# small helpers


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _a(word: str) -> str:
    """`word` with its indefinite article ("an elephant", "a fox")."""
    return ("an " if word[:1].lower() in "aeiou" else "a ") + word


def _join(items: list[str]) -> str:
    """ "a, b, and c" (Oxford comma), "a and b", "a"."""
    if len(items) <= 2:
        return " and ".join(items)
    return ", ".join(items[:-1]) + ", and " + items[-1]


def _numbered(items: list[str]) -> str:
    return "\n".join(f"{i}. {item}" for i, item in enumerate(items, 1))


def _bullets(items: list[str]) -> str:
    return "\n".join(f"- {item}" for item in items)


def _num_word(n: int) -> str:
    return lx.NUMBER_WORDS[n] if 0 <= n < len(lx.NUMBER_WORDS) else str(n)


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


def _assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def _dialog(rng: random.Random, first: tuple[str, str], followups: list[tuple[str, str]], max_extra: int = 2):
    """Build a conversation: the first exchange, then 0..max_extra follow-ups picked from `followups`."""
    conv = [_user(first[0]), _assistant(first[1])]
    n_extra = rng.choice([0, 0, 1, 1, 2][: max_extra + 3]) if followups else 0
    for question, answer in rng.sample(followups, min(n_extra, len(followups))):
        conv += [_user(question), _assistant(answer)]
    if rng.random() < 0.08:
        conv += [
            _user(rng.choice(["Thanks!", "Thank you!", "Great, thanks.", "Thank you very much."])),
            _assistant(
                rng.choice(["You are welcome!", "You are welcome! Let me know if you need anything else."])
            ),
        ]
    return conv


# ---------------------------------------------------------------------------------------------
# tasks: each takes an rng and returns one conversation


def _story(rng: random.Random) -> Conversation:
    name, pron, _obj, _poss = rng.choice(lx.PEOPLE)
    adj, occ, place = rng.choice(lx.ADJECTIVES), rng.choice(lx.OCCUPATIONS), rng.choice(lx.PLACES)
    habit, landmark = rng.choice(lx.HABITS), rng.choice(lx.LANDMARKS)
    color, thing = rng.choice(lx.COLORS), rng.choice(lx.OBJECTS)
    (goal, done), moral = rng.choice(lx.DEEDS), rng.choice(lx.MORALS)
    prompt = rng.choice(
        [
            f"Write a short story about {name}, {_a(adj)} {occ} who lives in {place}.",
            f"Tell me a story about {_a(adj)} {occ} named {name}.",
            f"Can you write a little story about {name} the {occ}?",
            f"I would like a short story. The main character is {name}, {_a(adj)} {occ}.",
        ]
    )
    opening = rng.choice(["Once upon a time", "Long ago", "Many years ago"])
    story = (
        f"{opening}, in {place}, there lived {_a(adj)} {occ} named {name}. "
        f"Every morning, {name} {habit}. "
        f"One day, near the {landmark}, {pron} found {_a(color)} {thing}. "
        f"{_cap(pron)} did not know where it came from, so {pron} decided to {goal}. "
        f"{name} {done}. "
        f"In the end, {name} learned that {moral}."
    )
    title = f"{name} and the {_cap(color)} {_cap(thing)}"
    followups = [
        (
            "Make it shorter.",
            f"{name}, {_a(adj)} {occ} from {place}, found {_a(color)} {thing} near the "
            f"{landmark}, decided to {goal}, and learned that {moral}.",
        ),
        ("Give the story a title.", f'A good title for the story would be "{title}".'),
        (
            "Who is the main character?",
            f"The main character is {name}, {_a(adj)} {occ} who lives in {place}.",
        ),
        (f"What did {name} find?", f"{name} found {_a(color)} {thing} near the {landmark}."),
        ("What is the lesson of the story?", f"The lesson of the story is that {moral}."),
    ]
    return _dialog(rng, (prompt, story), followups)


def _recipe(rng: random.Random) -> Conversation:
    dish = rng.choice(sorted(lx.DISHES))
    ingredients, steps = lx.DISHES[dish]
    prompt = rng.choice(
        [
            f"How do I make {dish}?",
            f"Give me a simple recipe for {dish}.",
            f"Can you tell me how to cook {dish}?",
            f"What is an easy way to make {dish} at home?",
        ]
    )
    answer = (
        f"Here is a simple recipe for {dish}.\n\nIngredients:\n{_bullets(list(ingredients))}\n\n"
        f"Steps:\n{_numbered([s + '.' for s, _ in steps])}\n\nEnjoy your {dish}!"
    )
    minutes = [m for _, m in steps]
    total = sum(minutes)
    k = rng.randrange(len(steps))
    step_text = steps[k][0]
    followups = [
        (
            "How long does it take?",
            f"Adding up the steps, it takes {' + '.join(map(str, minutes))} = {total} "
            f"minutes, so about {total} minutes in total.",
        ),
        ("Just list the ingredients.", f"For {dish} you need:\n{_bullets(list(ingredients))}"),
        (f"What is the {lx.ORDINALS[k]} step?", f"The {lx.ORDINALS[k]} step is: {step_text}."),
        ("How many steps are there?", f"There are {_num_word(len(steps))} steps."),
    ]
    return _dialog(rng, (prompt, answer), followups)


def _word_problem(rng: random.Random) -> Conversation:
    (name, pron, _o, _p), (name2, *_rest) = rng.sample(lx.PEOPLE, 2)
    one, many = rng.choice(lx.COUNTABLES)
    kind = rng.randrange(3)
    followups: list[tuple[str, str]] = []
    if kind == 0:  # add then subtract
        a, b = rng.randint(2, 20), rng.randint(1, 10)
        s = a + b
        c = rng.randint(1, s)
        prompt = (
            f"{name} has {a} {many}. {_cap(pron)} buys {b} more and then gives {c} to {name2}. "
            f"How many {many} does {name} have now?"
        )
        answer = (
            f"{name} starts with {a} {many}. After buying {b} more, {pron} has {a} + {b} = {s} {many}. "
            f"After giving {c} to {name2}, {pron} has {s} - {c} = {s - c} {many}. "
            f"The answer is {s - c}."
        )
        c2 = rng.randint(1, s)
        followups.append(
            (
                f"What if {pron} had given away {c2} instead?",
                f"Then {name} would have {s} - {c2} = {s - c2} {many}. The answer would be {s - c2}.",
            )
        )
    elif kind == 1:  # multiply
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        prompt = (
            f"{name} has {a} boxes. Each box holds {b} {many}. How many {many} does {name} have in total?"
        )
        answer = (
            f"{name} has {a} boxes with {b} {many} in each box, so {pron} has {a} x {b} = {a * b} "
            f"{many}. The answer is {a * b}."
        )
        a2 = rng.randint(2, 9)
        followups.append(
            (f"And with {a2} boxes?", f"With {a2} boxes, {name} would have {a2} x {b} = {a2 * b} {many}.")
        )
    else:  # share equally
        b, q = rng.randint(2, 6), rng.randint(2, 9)
        a = b * q
        prompt = (
            f"{name} wants to share {a} {many} equally among {b} friends. How many {many} does "
            f"each friend get?"
        )
        answer = (
            f"{name} shares {a} {many} among {b} friends, so each friend gets {a} / {b} = {q} {many}. "
            f"The answer is {q}."
        )
        followups.append(
            (
                "Can you check the answer?",
                f"Yes. {b} friends with {q} {many} each have {b} x {q} = {a} {many}, "
                f"which is what {name} started with. The answer {q} is correct.",
            )
        )
    return _dialog(rng, (prompt, answer), followups, max_extra=1)


def _days(rng: random.Random) -> Conversation:
    d = rng.randrange(7)
    n = rng.randint(1, 6)
    day = lx.WEEKDAYS[d]
    prompt = rng.choice(
        [
            f"If today is {day}, what day will it be in {n} days?",
            f"Today is {day}. Which day is it {n} days from now?",
            f"What day comes {n} days after {day}?",
        ]
    )
    chain = [
        f"{_num_word(i)} day{'s' if i > 1 else ''} later is {lx.WEEKDAYS[(d + i) % 7]}"
        for i in range(1, n + 1)
    ]
    answer = f"Today is {day}. Counting forward, {_join(chain)}. So it will be {lx.WEEKDAYS[(d + n) % 7]}."
    m = rng.randint(1, 6)
    back = [
        f"{_num_word(i)} day{'s' if i > 1 else ''} earlier is {lx.WEEKDAYS[(d - i) % 7]}"
        for i in range(1, m + 1)
    ]
    followups = [
        (
            f"And what day was it {m} days ago?",
            f"Counting back from {day}, {_join(back)}. So it was {lx.WEEKDAYS[(d - m) % 7]}.",
        ),
        ("What day will it be in a week?", f"A week has seven days, so in a week it will be {day} again."),
    ]
    return _dialog(rng, (prompt, answer), followups, max_extra=1)


def _counting(rng: random.Random) -> Conversation:
    a = rng.randint(0, 40)
    b = a + rng.randint(3, 10)
    nums = list(range(a, b + 1))
    kind = rng.randrange(3)
    if kind == 0:
        prompt = rng.choice([f"Count from {a} to {b}.", f"Please count from {a} up to {b}."])
        answer = ", ".join(map(str, nums)) + "."
        shown = nums
    elif kind == 1:
        prompt = rng.choice([f"Count down from {b} to {a}.", f"Count backwards from {b} to {a}."])
        shown = nums[::-1]
        answer = ", ".join(map(str, shown)) + "."
    else:
        shown = [x for x in nums if x % 2 == 0]
        prompt = f"List the even numbers from {a} to {b}."
        answer = f"The even numbers from {a} to {b} are {_join(list(map(str, shown)))}."
    followups = [
        ("How many numbers is that?", f"That is {_num_word(len(shown))} numbers."),
        ("Now write them in reverse order.", ", ".join(map(str, shown[::-1])) + "."),
        (
            "What is the sum of the first two?",
            f"The first two are {shown[0]} and {shown[1]}, and {shown[0]} + {shown[1]} = {shown[0] + shown[1]}.",
        ),
    ]
    return _dialog(rng, (prompt, answer), followups, max_extra=1)


_UNITS = (  # (big, small, factor)
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("weeks", "days", 7),
    ("days", "hours", 24),
    ("kilograms", "grams", 1000),
    ("meters", "centimeters", 100),
    ("years", "months", 12),
)


def _units(rng: random.Random) -> Conversation:
    big, small, f = rng.choice(_UNITS)
    n, m = rng.randint(2, 9), rng.randint(2, 9)
    one_big = big[:-1]
    prompt = rng.choice(
        [
            f"How many {small} are in {n} {big}?",
            f"Convert {n} {big} to {small}.",
            f"What is {n} {big} in {small}?",
        ]
    )
    answer = f"There are {f} {small} in one {one_big}, so {n} {big} is {n} x {f} = {n * f} {small}."
    followups = [(f"And {m} {big}?", f"{m} {big} is {m} x {f} = {m * f} {small}.")]
    return _dialog(rng, (prompt, answer), followups, max_extra=1)


def _animals(rng: random.Random) -> Conversation:
    (a, wa, ha, fa), (b, wb, _hb, _fb) = rng.sample(lx.ANIMALS, 2)
    kind = rng.randrange(3)
    if kind == 0:
        prompt = f"Which is heavier, {_a(a)} or {_a(b)}?"
        heavy, light = ((a, wa), (b, wb)) if wa > wb else ((b, wb), (a, wa))
        answer = (
            f"{_cap(_a(heavy[0]))} is heavier. {_cap(_a(heavy[0]))} weighs about {heavy[1]} kilograms, "
            f"while {_a(light[0])} weighs about {light[1]} kilograms."
        )
    elif kind == 1:
        prompt = rng.choice([f"Tell me about the {a}.", f"What do you know about the {a}?"])
        answer = f"The {a} lives in {ha} and mostly eats {fa}. An adult {a} weighs about {wa} kilograms."
    else:
        prompt = rng.choice([f"Where does {_a(a)} live?", f"What is the home of {_a(a)}?"])
        answer = f"{_cap(_a(a))} usually lives in {ha}."
    followups = [
        (f"What does {_a(a)} eat?", f"{_cap(_a(a))} mostly eats {fa}."),
        (f"How heavy is {_a(a)}?", f"An adult {a} weighs about {wa} kilograms."),
        (f"Where does {_a(a)} live?", f"{_cap(_a(a))} usually lives in {ha}."),
    ]
    return _dialog(rng, (prompt, answer), followups)


def _build_glossary() -> list[tuple[str, str, str]]:
    rng = random.Random("medusa_train-glossary")
    words: dict[str, tuple[str, str]] = {}
    while len(words) < 120:
        word = "".join(rng.choice(lx.SYLLABLES) for _ in range(rng.choice([2, 2, 3])))
        if word not in words:
            i = rng.randrange(len(lx.GLOSSARY_KINDS))
            words[word] = (lx.GLOSSARY_KINDS[i], lx.GLOSSARY_USES[i])
    return [(w, k, u) for w, (k, u) in words.items()]


GLOSSARY: list[tuple[str, str, str]] = _build_glossary()  # (word, kind, use), fixed for all splits


def _glossary(rng: random.Random) -> Conversation:
    word, kind, use = rng.choice(GLOSSARY)
    prompt = rng.choice(
        [
            f'What does the word "{word}" mean?',
            f'Define "{word}".',
            f"What is a {word}?",
            f'I heard the word "{word}" today. What is it?',
        ]
    )
    answer = f"A {word} is {kind} {use}."
    name = rng.choice(lx.PEOPLE)[0]
    others = [w for w, k, _ in GLOSSARY if k == kind and w != word]
    followups = [
        (
            "Use it in a sentence.",
            f'Here is a sentence: "{name} brought a {word} to the {rng.choice(lx.LANDMARKS)}."',
        ),
    ]
    if others:
        other = rng.choice(others)
        followups.append(("Is there another word like that?", f"Yes, a {other} is also {kind} {use}."))
    return _dialog(rng, (prompt, answer), followups, max_extra=1)


def _reading(rng: random.Random) -> Conversation:
    people = rng.sample(lx.PEOPLE, 3)
    facts: list[str] = []
    questions: list[tuple[str, str]] = []
    ages = rng.sample(range(8, 70), 3)
    for (name, _pron, _obj, _poss), age in zip(people, ages, strict=True):
        color, thing = rng.choice(lx.COLORS), rng.choice(lx.OBJECTS)
        landmark, occ = rng.choice(lx.LANDMARKS), rng.choice(lx.OCCUPATIONS)
        facts.append(
            f"{name} is {age} years old and works as {_a(occ)}. {name} lives near the {landmark} "
            f"and has {_a(color)} {thing}."
        )
        questions += [
            (f"What color is {name}'s {thing}?", f"{name}'s {thing} is {color}."),
            (f"Where does {name} live?", f"{name} lives near the {landmark}."),
            (f"What does {name} do for work?", f"{name} works as {_a(occ)}."),
            (f"How old is {name}?", f"{name} is {age} years old."),
        ]
    (x, *_), (y, *_) = people[0], people[1]
    older, younger = (x, y) if ages[0] > ages[1] else (y, x)
    questions.append(
        (
            f"Who is older, {x} or {y}?",
            f"{older} is older. {older} is {max(ages[:2])} years old and {younger} is "
            f"{min(ages[:2])} years old.",
        )
    )
    (q1, a1), *rest = rng.sample(questions, len(questions))
    prompt = f"Read the text and answer the question.\n\n{' '.join(facts)}\n\nQuestion: {q1}"
    return _dialog(rng, (prompt, a1), [(f"And {q[:1].lower()}{q[1:]}", a) for q, a in rest[:3]])


def _email(rng: random.Random) -> Conversation:
    (name, _pron, obj, _poss), (sender, *_) = rng.sample(lx.PEOPLE, 2)
    request, day = rng.choice(lx.REQUESTS), rng.choice(lx.WEEKDAYS)
    prompt = rng.choice(
        [
            f"Write a short email to {name} asking {obj} to {request} on {day}. Sign it {sender}.",
            f"Help me write an email to {name}. I need {obj} to {request} on {day}. My name is {sender}.",
        ]
    )

    def body(d: str) -> str:
        return (
            f"Subject: {_cap(request)}\n\nDear {name},\n\nI hope you are doing well. I am writing to ask if "
            f"you could {request} on {d}. Please let me know if that works for you.\n\n"
            f"Thank you very much,\n{sender}"
        )

    day2 = rng.choice([d for d in lx.WEEKDAYS if d != day])
    followups = [
        ("Make it shorter.", f"Hi {name},\n\nCould you {request} on {day}? Thanks!\n\n{sender}"),
        (
            "Make it more formal.",
            f"Dear {name},\n\nI would be grateful if you could {request} on {day}. "
            f"Thank you in advance for your help.\n\nKind regards,\n{sender}",
        ),
        (f"Change the day to {day2}.", body(day2)),
    ]
    return _dialog(rng, (prompt, body(day)), followups, max_extra=1)


def _directions(rng: random.Random) -> Conversation:
    streets = rng.sample(lx.STREETS, 3)
    marks = rng.sample(lx.LANDMARKS, 3)
    steps = [
        f"walk {rng.choice(['north', 'south', 'east', 'west'])} on {streets[0]}",
        f"turn {rng.choice(['left', 'right'])} at the {marks[0]}",
        f"go straight for {_num_word(rng.randint(2, 5))} blocks",
        f"cross {streets[1]}",
        f"turn {rng.choice(['left', 'right'])} onto {streets[2]}",
    ]
    steps = steps[: rng.randint(3, 5)] + [f"the {marks[2]} is on your {rng.choice(['left', 'right'])}"]
    prompt = rng.choice(
        [
            f"Turn these directions into numbered steps: {', '.join(steps)}.",
            f"Please rewrite my notes as a numbered list: {', '.join(steps)}.",
        ]
    )
    answer = _numbered([_cap(s) + "." for s in steps])
    sentence = f"First {steps[0]}, then " + ", then ".join(steps[1:-1]) + f", and finally {steps[-1]}."
    followups = [
        ("How many steps are there?", f"There are {_num_word(len(steps))} steps."),
        ("What is the last step?", f"The last step is: {_cap(steps[-1])}."),
        ("Now write them as one sentence.", _cap(sentence)),
    ]
    return _dialog(rng, (prompt, answer), followups, max_extra=1)


def _lists(rng: random.Random) -> Conversation:
    category = rng.choice(sorted(lx.CATEGORIES))
    n = rng.randint(3, 6)
    items = rng.sample(lx.CATEGORIES[category], n)
    prompt = rng.choice(
        [
            f"Name {_num_word(n)} {category}.",
            f"List {n} {category}, please.",
            f"Can you give me {_num_word(n)} {category}?",
        ]
    )
    answer = f"Here are {_num_word(n)} {category}:\n{_numbered(items)}"
    first = min(items)
    followups = [
        ("Sort them alphabetically.", f"Here they are in alphabetical order:\n{_numbered(sorted(items))}"),
        ("Which one comes first in the alphabet?", f"{_cap(first)} comes first in the alphabet."),
        ("Put them in one sentence.", f"Some {category} are {_join(items)}."),
    ]
    return _dialog(rng, (prompt, answer), followups)


def _greeting(rng: random.Random) -> Conversation:
    prompt = rng.choice(["Hello!", "Hi there.", "Good morning!", "Hey, how are you?"])
    answer = rng.choice(["Hello! How can I help you today?", "Hi! What can I do for you today?"])
    return _dialog(rng, (prompt, answer), [])


# (task, weight): weights set the mix of the corpus
TASKS: tuple[tuple[Callable[[random.Random], Conversation], int], ...] = (
    (_story, 12),
    (_recipe, 8),
    (_word_problem, 10),
    (_days, 6),
    (_counting, 6),
    (_units, 6),
    (_animals, 8),
    (_glossary, 8),
    (_reading, 10),
    (_email, 8),
    (_directions, 8),
    (_lists, 8),
    (_greeting, 2),
)
_TASK_FNS = [t for t, _ in TASKS]
_TASK_WEIGHTS = [w for _, w in TASKS]


# ---------------------------------------------------------------------------------------------
# public API


def generate_conversation(namespace: str, seed: int, index: int) -> Conversation:
    """Generate conversation number `index` of the stream `(namespace, seed)`.

    Args:
        namespace: stream name; different namespaces give independent streams.
        seed: stream seed.
        index: position in the stream.

    Returns:
        Messages `{"role": "user" | "assistant", "content": str}`, alternating, user first.
    """
    rng = random.Random(f"{namespace}:{seed}:{index}")
    task = rng.choices(_TASK_FNS, weights=_TASK_WEIGHTS)[0]
    return task(rng)


def iter_conversations(seed: int, namespace: str = "all") -> Iterator[Conversation]:
    """Endless, lazy stream of conversations (deterministic for a `(namespace, seed)`)."""
    index = 0
    while True:
        yield generate_conversation(namespace, seed, index)
        index += 1


def generate_conversations(seed: int, n: int) -> list[Conversation]:
    """The first `n` conversations of the stream for `seed` (no split filtering).

    Args:
        seed: stream seed; the same seed always gives the same conversations.
        n: how many conversations.

    Returns:
        `n` conversations, each a list of `{"role", "content"}` messages, user first, alternating.
    """
    return [generate_conversation("all", seed, i) for i in range(n)]


def split_of(conversation: Conversation) -> str:
    """The split ("train" or "eval") a conversation belongs to, by a stable hash of its first message."""
    digest = hashlib.blake2b(conversation[0]["content"].encode("utf-8"), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") % _EVAL_BUCKETS == 0 else "train"


def embedded_conversations(split: str, n: int, seed: int = 0) -> list[Conversation]:
    """`n` conversations of one split, with reference assistant replies.

    The `train` and `eval` splits never share a first user message (see `split_of`), so no eval
    prompt was seen in training, for any seeds and sizes.

    Args:
        split: "train" or "eval".
        n: how many conversations.
        seed: stream seed.

    Returns:
        `n` conversations (user first, alternating roles).

    Raises:
        ValueError: unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {SPLITS}")
    out: list[Conversation] = []
    for conv in iter_conversations(seed, namespace=split):
        if split_of(conv) == split:
            out.append(conv)
            if len(out) == n:
                break
    return out


def embedded_prompts(split: str, n: int, seed: int = 0) -> list[Conversation]:
    """Conversations whose assistant turns are to be regenerated by the backbone (self-distillation).

    Each conversation keeps its user turns and the reference assistant turns; a distiller regenerates
    every assistant turn in order, each conditioned on the user turns and on its own earlier replies,
    and ignores the reference text (it is there for inspection and for reference metrics). Follow-up
    questions ("Make it shorter.") refer to the earlier reply, so they stay meaningful when that
    reply is the backbone's own. Same split semantics as `embedded_conversations`.

    Args:
        split: "train" or "eval" (disjoint first prompts).
        n: how many conversations.
        seed: stream seed.

    Returns:
        `n` conversations, user first, alternating, ending with an assistant turn.
    """
    return embedded_conversations(split, n, seed)


def conversation_texts(conversations: Iterable[Conversation]) -> Iterator[str]:
    """Message contents, one string per message (e.g. to train a tokenizer)."""
    for conv in conversations:
        for message in conv:
            yield message["content"]
