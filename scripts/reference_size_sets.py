"""Write the reference-size example sets of experiments 1-3 (assets/experiments/*-reference-size.json) from small
fact tables written for jlens, and report every scored word that is not one token under the default model's
tokenizer (the experiments report such items as unscored; this script lets the tables avoid them).

Sizes (the reference's, docs/experiments.md "Speed"): probe-swap 90 items (7 relations, up to 15 countries each);
verbal-report 14 categories x 10 candidates; flexible-generalization 4 categories x 4 functions x 4 arguments
(12 swaps per function).

Usage: ``python scripts/reference_size_sets.py [--check]`` (``--check``: only report, write nothing).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "assets" / "experiments"

# country: capital, language, currency, landmark, dish
COUNTRIES = {  # None: no single-token spelling under the default model's tokenizer (the relation skips it)
    "France": ("Paris", "French", "euro", "the Eiffel Tower", "croissants"),
    "Japan": ("Tokyo", "Japanese", "yen", "Mount Fuji", "sushi"),
    "Italy": ("Rome", "Italian", "euro", "the Colosseum", "pizza"),
    "Russia": ("Moscow", "Russian", None, "the Kremlin", "borscht"),
    "Egypt": ("Cairo", "Arabic", "pound", "the pyramids of Giza", "falafel"),
    "China": ("Beijing", "Chinese", "yuan", "the Forbidden City", "dumplings"),
    "Greece": ("Athens", "Greek", "euro", "the Parthenon", "moussaka"),
    "Germany": ("Berlin", "German", "euro", "the Brandenburg Gate", "sauerkraut"),
    "Spain": ("Madrid", "Spanish", "euro", "the Alhambra", "paella"),
    "Korea": ("Seoul", "Korean", "won", "Gyeongbokgung Palace", "kimchi"),
    "Poland": ("Warsaw", "Polish", None, "Wawel Castle", "pierogi"),
    "Sweden": ("Stockholm", "Swedish", None, "the Vasa Museum", "meatballs"),
    "Iran": ("Tehran", "Persian", "rial", "the Azadi Tower", "tahdig"),
    "Portugal": ("Lisbon", "Portuguese", "euro", "the Belem Tower", "pastel de nata"),
    "India": ("Delhi", "Hindi", None, "the Taj Mahal", "curry"),
    "Peru": ("Lima", "Spanish", "sol", "Machu Picchu", "ceviche"),
    "Brazil": (None, "Portuguese", "real", "the Christ the Redeemer statue", "feijoada"),
    "Kenya": ("Nairobi", "Swahili", None, "the Maasai Mara", "nyama choma"),
}
CAPITAL, LANGUAGE, CURRENCY, LANDMARK, DISH = range(5)
# relation: (category, template, the clue's field, the answer's field); a clue that names several countries of the
# table (the euro; Spanish, Portuguese) is left out of that relation
RELATIONS = [
    ("capital_by_landmark", "The capital of the country famous for {clue} is", LANDMARK, CAPITAL),
    ("language_by_landmark", "The language spoken in the country famous for {clue} is", LANDMARK, LANGUAGE),
    ("language_by_capital", "The main language of the country whose capital is {clue} is", CAPITAL, LANGUAGE),
    ("capital_by_currency", "The capital of the country whose currency is the {clue} is", CURRENCY, CAPITAL),
    ("capital_by_dish", "The capital of the country whose national dish is {clue} is", DISH, CAPITAL),
    ("currency_by_landmark", "The currency of the country famous for {clue} is the", LANDMARK, CURRENCY),
    ("language_by_dish", "The language spoken in the country whose national dish is {clue} is", DISH, LANGUAGE),
]
PER_RELATION = 15
N_ITEMS = 90

CANDIDATES = {
    "fruit": ["apple", "banana", "orange", "pear", "grape", "lemon", "cherry", "peach", "mango", "plum"],
    "animal": ["dog", "cat", "horse", "lion", "tiger", "bear", "wolf", "fox", "rabbit", "mouse"],
    "colour": ["red", "blue", "green", "yellow", "purple", "pink", "black", "white", "brown", "grey"],
    "country": ["France", "Japan", "Brazil", "Canada", "Italy", "Spain", "India", "China", "Egypt", "Mexico"],
    "vegetable": ["carrot", "potato", "onion", "tomato", "cabbage", "pepper", "pea", "bean", "corn", "garlic"],
    "musical instrument": ["piano", "guitar", "violin", "drum", "flute", "trumpet", "harp", "sax", "organ", "bass"],
    "sport": ["football", "tennis", "golf", "soccer", "rugby", "cricket", "hockey", "baseball", "boxing", "chess"],
    "metal": ["iron", "gold", "silver", "copper", "steel", "lead", "tin", "zinc", "aluminum", "bronze"],
    "flower": ["rose", "lily", "sunflower", "daisy", "orchid", "lotus", "violet", "iris", "poppy", "lavender"],
    "bird": ["eagle", "owl", "robin", "sparrow", "crow", "parrot", "swan", "duck", "hawk", "pigeon"],
    "vehicle": ["car", "bus", "truck", "train", "bike", "boat", "plane", "van", "taxi", "tractor"],
    "drink": ["water", "tea", "coffee", "milk", "juice", "wine", "beer", "soda", "lemonade", "whiskey"],
    "job": ["teacher", "doctor", "nurse", "lawyer", "engineer", "farmer", "pilot", "chef", "artist", "writer"],
    "tree": ["oak", "pine", "maple", "birch", "willow", "palm", "cedar", "elm", "ash", "cherry"],
}

FLEXIBLE = [
    ("country", ["France", "Japan", "Korea", "China"], [
        ("capital", "The capital city of {arg} is", ["Paris", "Tokyo", "Seoul", "Beijing"]),
        ("language", "The main language spoken in {arg} is", ["French", "Japanese", "Korean", "Chinese"]),
        ("currency", "The currency used in {arg} is the", ["euro", "yen", "won", "yuan"]),
        ("people", "The people of {arg} are called the", ["French", "Japanese", "Koreans", "Chinese"]),
    ]),
    ("number", ["two", "three", "four", "five"], [
        ("successor", "Counting up, the number after {arg} is", ["three", "four", "five", "six"]),
        ("predecessor", "Counting down, the number before {arg} is", ["one", "two", "three", "four"]),
        ("double", "Twice {arg} is", ["four", "six", "eight", "ten"]),
        ("plus_ten", "Ten plus {arg} equals", ["twelve", "thirteen", "fourteen", "fifteen"]),
    ]),
    ("animal", ["dog", "cat", "cow", "sheep"], [
        ("young", "A young {arg} is called a", ["puppy", "kitten", "calf", "lamb"]),
        ("plural", "One {arg}, two", ["dogs", "cats", "cows", "sheep"]),
        ("male", "A male {arg} is called a", ["dog", "tom", "bull", "ram"]),
        ("capitals", "The word {arg} written in capital letters is", ["DOG", "CAT", "COW", "SHEEP"]),
    ]),
    ("month", ["January", "March", "May", "July"], [
        ("next", "The month after {arg} is", ["February", "April", "June", "August"]),
        ("previous", "The month before {arg} is", ["December", "February", "April", "June"]),
        ("two_later", "Two months after {arg} comes", ["March", "May", "July", "September"]),
        ("ordinal", "In the calendar, {arg} is the month number", ["one", "three", "five", "seven"]),
    ]),
]


def probe_items() -> list[dict]:
    names = list(COUNTRIES)
    items = []
    for category, template, clue, answer in RELATIONS:
        clues = [COUNTRIES[c][clue] for c in names]
        usable = [c for c in names if clues.count(COUNTRIES[c][clue]) == 1 and None not in (COUNTRIES[c][clue],
                                                                                            COUNTRIES[c][answer])]
        for i, country in enumerate(usable):
            if i == PER_RELATION or len(items) == N_ITEMS:
                break
            # swap to the next usable country whose answer differs (a swap must change the answer)
            other = next(o for o in usable[i + 1:] + usable[:i] if COUNTRIES[o][answer] != COUNTRIES[country][answer])
            items.append({"name": f"{category}_{country.lower()}", "category": category,
                          "prompt": template.replace("{clue}", COUNTRIES[country][clue]),
                          "intermediate": country, "answer": COUNTRIES[country][answer],
                          "swap_to": other, "swap_answer": COUNTRIES[other][answer]})
    return items


def flexible() -> dict:
    categories = []
    for name, args, funcs in FLEXIBLE:
        categories.append({"name": name, "args": args, "funcs": [
            {"name": f, "template": t, "answers": dict(zip(args, answers))} for f, t, answers in funcs]})
    return {"description": "Reference-size flexible-generalization set written for jlens: 4 categories x 4 functions "
                           "x 4 arguments (12 swaps per function).", "categories": categories}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report words that are not one token")
    args = parser.parse_args()
    from jlens_core import load_model
    from jlens_core.experiments.core import word_ids

    model = load_model()
    probe = {"description": "Reference-size probe-swap set written for jlens: 90 two-hop items (7 relations, up to 15 "
                            "countries each) from a small table of countries (capital, language, currency, landmark, "
                            "dish); the category is the relation.", "items": probe_items()}
    report = {"description": "Reference-size verbal-report set written for jlens: 14 categories x 10 candidates.",
              "candidates": CANDIDATES}
    flex = flexible()
    words = {w for it in probe["items"] for w in (it["intermediate"], it["answer"], it["swap_to"], it["swap_answer"])}
    words |= {w for ws in CANDIDATES.values() for w in ws}
    words |= {w for c in flex["categories"] for f in c["funcs"] for w in [*c["args"], *f["answers"].values()]}
    bad = sorted(w for w in words if not word_ids(model, w))
    print(f"probe-swap {len(probe['items'])} items; verbal-report {len(CANDIDATES)} x "
          f"{min(len(v) for v in CANDIDATES.values())}; flexible {len(flex['categories'])} categories")
    print("not one token:", ", ".join(bad) or "none")
    if args.check:
        return
    for name, data in (("probe-swap", probe), ("verbal-report", report), ("flexible-generalization", flex)):
        (OUT / f"{name}-reference-size.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
