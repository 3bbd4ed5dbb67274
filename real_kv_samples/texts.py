"""Fixed English paragraphs that the real-model check feeds through the model.

Written for this project (no third-party text). Varied on purpose: narrative, technical prose
with numbers and units, a recipe-like list, and dialogue with punctuation, so that the
activations cover ordinary words, sub-word pieces, digits and symbols. Changing them changes the
numbers in docs/accuracy.md.
"""

from __future__ import annotations

PARAGRAPHS: tuple[str, ...] = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
    "one hundred and twelve steps out of habit rather than need. From the lamp room she could "
    "see the fishing boats returning to the harbour, their wakes drawing pale lines across the "
    "dark water. In winter the storms came from the north-west and rattled the windows for days; "
    "in summer the island filled with visitors who asked whether she was ever lonely. She never "
    "quite knew how to answer them, because the sea was never the same twice.",
    "A modern graphics processor hides memory latency by keeping thousands of threads in "
    "flight. When one group of threads waits for data from high-bandwidth memory, the scheduler "
    "switches to another group that is ready to compute. Kernels that move large arrays are "
    "therefore limited by bandwidth, not arithmetic: copying 4 GiB at 3.3 TB/s takes about 1.3 "
    "milliseconds, and a well-written kernel should reach 80 to 90 percent of that figure. "
    "Storing the attention cache in 4-bit or 8-bit formats reduces the bytes per token and lets "
    "the same memory hold longer contexts.",
    "To bake a simple loaf of bread, mix 500 grams of flour, 350 millilitres of warm water, "
    "10 grams of salt and 7 grams of dried yeast. Knead the dough for ten minutes until it is "
    "smooth and elastic, then leave it covered in a warm place for an hour. Shape it gently, let "
    "it rise again for forty-five minutes, and bake at 230 degrees Celsius for thirty minutes, "
    "until the crust is deep brown and the base sounds hollow when tapped.",
    '"Are you sure this is the right train?" asked Maria, looking at the departure board. '
    '"Platform nine, the 14:05 to Edinburgh," her brother replied, without lifting his eyes '
    'from the map. "It stops at York and Newcastle; we change nowhere." The station was busy, '
    "full of announcements, rolling suitcases and the smell of coffee. When the doors finally "
    "opened, they found two seats by the window and watched the city give way to fields, "
    "rivers and low grey hills.",
)
"""The paragraphs, each run through the model as its own sequence."""
