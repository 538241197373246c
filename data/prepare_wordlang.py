#!/usr/bin/env python3
"""Rebuilds data/wordlang/{train,test}.tsv from Debian's word lists.

Install the lists first (as root):
    apt-get install wamerican wfrench wngerman wspanish witalian wdutch wpolish wswedish
then run:
    python3 data/prepare_wordlang.py [--dict-dir /usr/share/dict]

Recipe (identical to the PyTorch anchor in shared/anchors/hybrid_rnn): per language, read
utf-8 (errors ignored), strip, drop words with an apostrophe, keep words of at least 3
characters, lowercase, dedupe (sorted), shuffle with random.Random(0), take 10,000. The 80,000
(word, language) pairs are shuffled with random.Random(0) and split 80/20. Output lines are
"word<TAB>language".
"""
import argparse
import os
import random

LANGS = ["american-english", "french", "ngerman", "spanish", "italian", "dutch", "polish", "swedish"]
PER_LANG = 10_000


def load_words(path):
    seen = set()
    with open(path, encoding="utf-8", errors="ignore") as f:
        for line in f:
            w = line.strip()
            if "'" in w or len(w) < 3:
                continue
            seen.add(w.lower())
    words = sorted(seen)
    random.Random(0).shuffle(words)
    if len(words) < PER_LANG:
        raise SystemExit(f"{path} has only {len(words)} usable words, need {PER_LANG}")
    return words[:PER_LANG]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dict-dir", default="/usr/share/dict")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "wordlang"))
    a = p.parse_args()
    pairs = []
    for lang in LANGS:
        path = os.path.join(a.dict_dir, lang)
        if not os.path.exists(path):
            raise SystemExit(f"missing {path}: install the Debian word lists (see this script's help)")
        pairs += [(w, lang) for w in load_words(path)]
    random.Random(0).shuffle(pairs)
    ntr = int(0.8 * len(pairs))
    os.makedirs(a.out, exist_ok=True)
    for name, part in [("train.tsv", pairs[:ntr]), ("test.tsv", pairs[ntr:])]:
        with open(os.path.join(a.out, name), "w", encoding="utf-8") as f:
            for w, lang in part:
                f.write(f"{w}\t{lang}\n")
    print(f"wrote {ntr} training and {len(pairs) - ntr} test words over {len(LANGS)} languages to {a.out}")


if __name__ == "__main__":
    main()
