"""The demo's corpus: short stories from a small deterministic grammar of splitlearn's own.

``python -m splitlearn.model.corpus.generate`` writes ``tiny_tales.txt`` beside this file (and
``--check`` only compares): a seeded ``random.Random`` picks characters, places, things and actions
for a handful of sentence templates, so the same code gives the same bytes on every machine and
Python (``random.Random(seed)`` with an int seed, ``choice`` and ``randrange`` are stable).
About 200,000 words of ~370 distinct ones: enough for the 6-block ``tiny-tales`` model to learn its
sentences in a few minutes on a CPU (``make demo``), small enough to ship (~1.1 MB).
``tests/test_corpus.py`` regenerates it and compares the digest."""
from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "tiny_tales.txt"
SEED, STORIES = 2026, 1960  # the grammar's seed; stories written (~125 words each)

GIRLS = ["Mia", "Lily", "Anna", "Zoe", "Emma", "Lucy", "Sara", "Nina", "Rosa", "Ella"]
BOYS = ["Tom", "Ben", "Sam", "Max", "Leo", "Jack", "Finn", "Omar", "Theo", "Noah"]
KIN = ["mother", "father", "grandmother", "grandfather", "sister", "brother", "aunt", "uncle"]
LOOKS = ["little", "small", "happy", "brave", "kind", "curious", "shy", "clever", "young", "funny"]
PLACES = ["the park", "the forest", "the garden", "the beach", "the river", "the market", "the farm",
          "the school", "the hill", "the lake", "the village", "the library", "the meadow", "the harbour"]
HOMES = ["a small house", "a big house", "a little farm", "a blue boat", "a cosy flat", "an old mill",
         "a tall tower", "a warm cottage"]
COLOURS = ["red", "blue", "green", "yellow", "shiny", "tiny", "big", "soft", "old", "new", "golden", "pink"]
THINGS = ["ball", "kite", "hat", "box", "key", "book", "stone", "shell", "flower", "cake", "boat", "drum",
          "bell", "map", "cup", "coat", "lamp", "apple", "feather", "ribbon"]
GOALS = ["play with friends", "find a treasure", "pick some flowers", "buy some bread", "look for shells",
         "watch the birds", "fly a kite", "read a story", "catch a fish", "climb a tree", "see the sunset",
         "visit a friend"]
FRIENDS = ["a little cat", "an old dog", "a brown rabbit", "a wise owl", "a small bird", "a kind bear",
           "a funny duck", "a green frog", "a grey mouse", "a white horse", "a red fox", "a busy bee"]
FEELINGS = ["happy", "sad", "scared", "excited", "surprised", "tired", "proud", "worried", "glad", "angry"]
WEATHER = ["The sun was shining.", "It was a cold morning.", "The sky was blue.", "It began to rain.",
           "The wind was strong.", "It was a warm day.", "The snow was falling.", "The air was fresh."]
PROBLEMS = ["it was stuck in a tree", "it fell into the water", "it was lost in the grass",
            "the wind blew it away", "it was under a big rock", "a dog ran off with it",
            "it rolled down the hill", "it was too high to reach"]
HELPS = ["climbed up and got it down", "used a long stick", "asked {friend} for help",
         "pulled very hard", "looked everywhere until {pro} found it", "ran after it as fast as {pro} could"]
ENDINGS = ["From that day on, {name} and {friend} were best friends.",
           "{Name} smiled and went home to tell {pos} {kin}.",
           "That night, {name} slept with the {thing} next to {obj}.",
           "{Name} learned that it is good to help others.",
           "{Name} and {pos} {kin} had a big cake to celebrate.",
           "It was the best day ever, and {name} never forgot it."]
SAYS = ["said", "asked", "shouted", "whispered"]
LINES = ["Can you help me?", "Look at this!", "Let us play together.", "I am so happy!",
         "Thank you very much!", "Where are you going?", "Do not be scared.", "We did it!"]


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def story(r: random.Random) -> str:
    girl = r.randrange(2) == 0
    name = r.choice(GIRLS if girl else BOYS)
    pro, obj, pos = ("she", "her", "her") if girl else ("he", "him", "his")
    friend, kin = r.choice(FRIENDS), r.choice(KIN)
    place, thing, colour = r.choice(PLACES), r.choice(THINGS), r.choice(COLOURS)
    fill = dict(name=name, Name=name, pro=pro, Pro=pro.capitalize(), obj=obj, pos=pos, Pos=pos.capitalize(),
                friend="the " + friend.split()[-1], kin=kin, thing=thing)
    s = [r.choice(["Once upon a time, there was a {look} {kind} named {name}.",
                   "There once was a {look} {kind} called {name}.",
                   "Once upon a time, in {home}, lived a {look} {kind} named {name}."]).format(
        look=r.choice(LOOKS), kind="girl" if girl else "boy", home=r.choice(HOMES), name=name)]
    s.append(r.choice(["{Pro} lived in {home} with {pos} {kin}.", "{Pro} loved to {goal}.",
                       "Every day, {name} went to {place2} with {pos} {kin}."]).format(
        home=r.choice(HOMES), goal=r.choice(GOALS), place2=r.choice(PLACES), **fill))
    s.append(r.choice(WEATHER))
    s.append(f"One day, {name} went to {place} to {r.choice(GOALS)}.")
    s.append(f"There {pro} saw {friend}.")
    s.append(f"\"Hello,\" {r.choice(SAYS)} {name}. \"{r.choice(LINES)}\"")
    s.append(f"The {friend.split()[-1]} had {article(colour)} {thing}, but {r.choice(PROBLEMS)}.")
    s.append(f"{name} felt {r.choice(FEELINGS)}.")
    s.append(f"{pro.capitalize()} {r.choice(HELPS).format(**fill)}.")
    s.append(f"At last, the {colour} {thing} was safe.")
    s.append(f"The {friend.split()[-1]} was very {r.choice(['happy', 'glad', 'thankful', 'proud'])}.")
    s.append(f"\"{r.choice(LINES)}\" {r.choice(SAYS)} the {friend.split()[-1]}.")
    if r.randrange(2):
        s.append(f"Then they went to {r.choice(PLACES)} and {r.choice(['played', 'sang', 'danced', 'ate', 'talked'])} "
                 f"until the sun went down.")
    s.append(r.choice(ENDINGS).format(**fill))
    return " ".join(s)


def generate(seed: int = SEED, stories: int = STORIES) -> str:
    """The corpus' text: ``stories`` stories, one paragraph each, separated by a blank line."""
    r = random.Random(seed)
    return "\n\n".join(story(r) for _ in range(stories)) + "\n"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitlearn.model.corpus.generate", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help="where to write the text")
    p.add_argument("--check", action="store_true", help="only compare with the file at --out (exit 1 if it differs)")
    a = p.parse_args(argv)
    text = generate()
    if a.check:
        same = a.out.is_file() and a.out.read_text(encoding="utf-8") == text
        print(f"{a.out}: {'identical' if same else 'DIFFERS from the grammar'} (sha256 {digest(text)[:16]})")
        return 0 if same else 1
    a.out.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {a.out}: {len(text.split())} words, {len(text.encode())} bytes, sha256 {digest(text)[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
