#!/usr/bin/env python3
"""Generate data/corpus.txt: a small, deterministic, English-like corpus.

A toy village world: a few people, animals with fixed traits (colour, home,
food), places, objects, numbers written out, little sums, short dialogues and
weekday routines. The text is regular enough that a tiny byte-level Llama
learns a lot of it in a few hundred steps (spelling, common words, the facts
about each animal, the arithmetic pattern), but the templates are combined at
random so it cannot simply memorise the file.

Standard library only, and its own random generator (a 64-bit LCG), so the
output is byte-identical for every Python version:
    python3 tools/make_corpus.py [--out data/corpus.txt] [--bytes 300000]
"""
import argparse
import os
import sys

SEED = 20240611
TARGET_BYTES = 300_000


class Rand:
    """A 64-bit linear congruential generator (Knuth's MMIX constants)."""

    def __init__(self, seed):
        self.s = seed & 0xFFFFFFFFFFFFFFFF

    def next(self):
        self.s = (self.s * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        return self.s >> 33

    def below(self, n):
        return self.next() % n

    def pick(self, seq):
        return seq[self.below(len(seq))]

    def chance(self, percent):
        return self.below(100) < percent


NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
           "nineteen", "twenty"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TIMES = ["In the morning", "At noon", "In the afternoon", "In the evening", "Late at night", "Before breakfast"]
WEATHER = ["it was sunny", "it was raining", "the wind was cold", "the sky was grey", "it was warm",
           "a light snow was falling", "the fog was thick"]

# name -> (pronoun, possessive, trade)
PEOPLE = {
    "Mira": ("she", "her", "baker"),
    "Tobin": ("he", "his", "miller"),
    "Wren": ("she", "her", "fisher"),
    "Odo": ("he", "his", "farmer"),
    "Sela": ("she", "her", "weaver"),
    "Pell": ("he", "his", "potter"),
    "Ansa": ("she", "her", "teacher"),
    "Brom": ("he", "his", "smith"),
}

# animal -> (colour, home, food, sound, size)
ANIMALS = {
    "fox": ("red", "the woods", "berries", "yips", "small"),
    "heron": ("grey", "the river", "fish", "croaks", "tall"),
    "goat": ("white", "the hill", "grass", "bleats", "stubborn"),
    "otter": ("brown", "the pond", "crabs", "whistles", "quick"),
    "badger": ("black and white", "the old bridge", "worms", "grunts", "strong"),
    "crow": ("black", "the mill roof", "seeds", "caws", "clever"),
    "hare": ("tan", "the meadow", "clover", "thumps", "fast"),
    "owl": ("speckled", "the orchard", "mice", "hoots", "wise"),
}

PLACES = ["the mill", "the river", "the orchard", "the hill", "the market", "the bakery", "the old bridge",
          "the pond", "the meadow", "the woods", "the school", "the forge"]
# a workplace for each trade
WORKPLACE = {"baker": "the bakery", "miller": "the mill", "fisher": "the river", "farmer": "the meadow",
             "weaver": "the market", "potter": "the market", "teacher": "the school", "smith": "the forge"}
# countable things: (singular, plural)
THINGS = [("apple", "apples"), ("loaf", "loaves"), ("pear", "pears"), ("stone", "stones"), ("cup", "cups"),
          ("basket", "baskets"), ("egg", "eggs"), ("candle", "candles"), ("plum", "plums"), ("kite", "kites"),
          ("shell", "shells"), ("nail", "nails")]
OBJECTS = ["the lantern", "the red basket", "the blue cup", "the key", "the map", "the kite", "the big pot",
           "the little boat", "the bell", "the ladder"]
ADJ_FEEL = ["happy", "tired", "hungry", "sleepy", "glad", "cold", "curious", "busy"]


def count(n, thing):
    return f"{NUMBERS[n]} {thing[0] if n == 1 else thing[1]}"


def cap(s):
    return s[0].upper() + s[1:]


# Sentence templates: {a}, {p} ... are the subject's fields; {feel}, {time} and {somewhere} are fresh picks
# from these lists, drawn left to right as the sentence is written.
DRAWS = {"feel": ADJ_FEEL, "time": TIMES, "somewhere": PLACES}
ANIMAL_FACTS = ["The {a} is {colour}. It lives near {home} and eats {food}.",
                "The {a} {sound} when it is {feel}.",
                "The {a} is {size}. Every day it looks for {food} near {home}.",
                "Where does the {a} live? The {a} lives near {home}.",
                "What does the {a} eat? The {a} eats {food}, and it {sound}."]
PERSON_WORK = ["{p} is the {trade}. Every day {pro} works at {place}.",
               "{time}, {p} walked to {place}, because {pro} is the {trade}.",
               "Who works at {place}? {p} does. {Pro} is the {trade}.",
               "{p} the {trade} was {feel}, so {pro} sat down near {somewhere}."]


def one_of(r, templates, **fields):
    """One of the templates, picked uniformly, written out with fields (and DRAWS' fresh picks)."""
    class Drawing(dict):
        def __missing__(self, name):
            return r.pick(DRAWS[name])
    return templates[r.below(len(templates))].format_map(Drawing(fields))


def s_animal_fact(r):
    a = r.pick(list(ANIMALS))
    colour, home, food, sound, size = ANIMALS[a]
    return one_of(r, ANIMAL_FACTS, a=a, colour=colour, home=home, food=food, sound=sound, size=size)


def s_person_work(r):
    p = r.pick(list(PEOPLE))
    pro, _, trade = PEOPLE[p]
    return one_of(r, PERSON_WORK, p=p, pro=pro, Pro=cap(pro), trade=trade, place=WORKPLACE[trade])


def s_sum(r):
    p = r.pick(list(PEOPLE))
    pro, pos, _ = PEOPLE[p]
    thing = r.pick(THINGS)
    if r.chance(50):
        a = 1 + r.below(12)
        b = 1 + r.below(8)
        return (f"{p} had {count(a, thing)}. Then {pro} found {count(b, thing)} more, "
                f"so now {pro} has {count(a + b, thing)}.")
    a = 2 + r.below(19)
    b = 1 + r.below(a - 1)
    q = r.pick(list(PEOPLE) + [f"the {x}" for x in ANIMALS])
    if q == p:
        q = "a friend"
    return f"{p} had {count(a, thing)} and gave {NUMBERS[b]} to {q}. Now {pro} has {count(a - b, thing)}."


def s_counting(r):
    start = r.below(12)
    n = 3 + r.below(6)
    seq = ", ".join(NUMBERS[start:start + n])
    return f"{r.pick(list(PEOPLE))} counted: {seq}."


def s_dialogue(r):
    p, q = r.pick(list(PEOPLE)), r.pick(list(PEOPLE))
    while q == p:
        q = r.pick(list(PEOPLE))
    k = r.below(4)
    if k == 0:
        o, place = r.pick(OBJECTS), r.pick(PLACES)
        return f"\"Where is {o}?\" asked {p}. \"It is at {place},\" said {q}."
    if k == 1:
        a = r.pick(list(ANIMALS))
        return (f"\"What colour is the {a}?\" asked {p}. "
                f"\"The {a} is {ANIMALS[a][0]},\" said {q}.")
    if k == 2:
        x, y = 1 + r.below(10), 1 + r.below(10)
        return (f"\"What is {NUMBERS[x]} and {NUMBERS[y]}?\" asked {p}. "
                f"\"{cap(NUMBERS[x + y])},\" said {q}.")
    trade = PEOPLE[q][2]
    return f"\"Good {r.pick(['morning', 'evening', 'day'])}, {q},\" said {p}. \"Are you going to {WORKPLACE[trade]}?\""


def s_weather(r):
    day = r.pick(DAYS)
    p = r.pick(list(PEOPLE))
    pro, pos, _ = PEOPLE[p]
    w = r.pick(WEATHER)
    o = r.pick(OBJECTS)
    return f"On {day} {w}, so {p} took {o} and stayed near {r.pick(PLACES)}."


def s_week(r):
    i = r.below(7)
    n = 2 + r.below(3)
    parts = []
    for j in range(n):
        d = DAYS[(i + j) % 7]
        p = r.pick(list(PEOPLE))
        parts.append(f"On {d}, {p} went to {r.pick(PLACES)}.")
    if (i + n) % 7 != i:
        parts.append(f"The next day was {DAYS[(i + n) % 7]}.")
    return " ".join(parts)


def s_story(r):
    p = r.pick(list(PEOPLE))
    pro, pos, trade = PEOPLE[p]
    a = r.pick(list(ANIMALS))
    colour, home, food, sound, size = ANIMALS[a]
    lines = [f"{r.pick(TIMES)}, {p} the {trade} saw a {colour} {a} near {home}."]
    if r.chance(50):
        lines.append(f"The {a} {sound}, and {p} laughed.")
    lines.append(f"{cap(pro)} gave the {a} some {food}, and the {a} was {r.pick(['happy', 'glad', 'full'])}.")
    if r.chance(40):
        thing = r.pick(THINGS)
        n = 2 + r.below(9)
        lines.append(f"Then {pro} went home with {count(n, thing)} in {pos} basket.")
    return " ".join(lines)


SENTENCES = [s_animal_fact, s_person_work, s_sum, s_counting, s_dialogue, s_weather, s_week, s_story]
WEIGHTS = [4, 3, 4, 1, 4, 2, 1, 3]


def paragraph(r):
    n = 2 + r.below(4)
    out = []
    table = [f for f, w in zip(SENTENCES, WEIGHTS) for _ in range(w)]
    for _ in range(n):
        out.append(r.pick(table)(r))
    return " ".join(out)


def make_corpus(target=TARGET_BYTES, seed=SEED):
    r = Rand(seed)
    paras, size = [], 0
    while size < target:
        p = paragraph(r)
        paras.append(p)
        size += len(p) + 2
    return "\n\n".join(paras) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--out", default=os.path.join(root, "data", "corpus.txt"))
    ap.add_argument("--bytes", type=int, default=TARGET_BYTES)
    args = ap.parse_args()
    text = make_corpus(args.bytes)
    data = text.encode("ascii")
    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(data)} bytes, {text.count(chr(10) + chr(10)) + 1} paragraphs", file=sys.stderr)


if __name__ == "__main__":
    main()
