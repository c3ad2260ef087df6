#!/usr/bin/env python3
"""Writes data/corpus.txt: a small English-like text generated from a fixed grammar.

The corpus is produced by this script alone (no outside text), so the project can ship it.
It is deterministic: rerunning the script reproduces the file byte for byte.
"""
import os
import random

SUBJECTS = ["the miller", "the old sailor", "a young farmer", "the baker", "my sister",
            "the teacher", "a tired traveller", "the captain", "the shepherd", "our neighbour",
            "the clockmaker", "a quiet student", "the gardener", "the weaver", "the fisherman"]
VERBS = ["carried", "found", "painted", "repaired", "sold", "watched", "counted", "lost",
         "borrowed", "cleaned", "opened", "followed", "wrote about", "remembered", "built"]
OBJECTS = ["a basket of apples", "the broken wheel", "an old map", "the red door",
           "a letter from the city", "the little boat", "a loaf of bread", "the silver key",
           "a pair of boots", "the wooden bridge", "a jar of honey", "the long road",
           "a box of candles", "the stone wall", "a bundle of wool"]
PLACES = ["by the river", "in the market", "near the mill", "on the hill", "at the harbour",
          "behind the church", "in the garden", "along the coast", "under the old oak",
          "at the edge of the forest", "in the village square", "beside the well"]
TIMES = ["at dawn", "before supper", "in the spring", "after the storm", "on a cold morning",
         "late at night", "during the fair", "when the bells rang", "in the autumn",
         "on the first day of summer"]
ADVERBS = ["slowly", "carefully", "happily", "quietly", "quickly", "patiently", "proudly"]
CLOSERS = ["and nobody said a word.", "and the dogs began to bark.",
           "while the rain kept falling.", "and then went home.",
           "because the winter was coming.", "as the sun went down.",
           "and everyone laughed.", "though it was not easy."]


def sentence(rng):
    s = rng.choice(SUBJECTS)
    form = rng.randrange(4)
    if form == 0:
        text = f"{s} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)} {rng.choice(TIMES)}."
    elif form == 1:
        text = f"{rng.choice(TIMES)}, {s} {rng.choice(ADVERBS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."
    elif form == 2:
        text = f"{s} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(CLOSERS)}"
    else:
        text = (f"{s} and {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
                f"{rng.choice(PLACES)}.")
    return text[0].upper() + text[1:]


def main():
    rng = random.Random(20261122)
    paragraphs = []
    size = 0
    while size < 160_000:
        para = " ".join(sentence(rng) for _ in range(rng.randint(3, 7)))
        paragraphs.append(para)
        size += len(para) + 2
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "corpus.txt")
    with open(out, "w", encoding="ascii") as f:
        f.write("\n\n".join(paragraphs) + "\n")


if __name__ == "__main__":
    main()
