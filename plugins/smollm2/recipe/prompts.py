"""Chat prompts for training and measuring the default model's draft: written here from
templates and subjects (no outside data set), split so that held-out prompts share no subject
with the training ones."""

from __future__ import annotations

import random

TEMPLATES = [
    "What is the capital of {place}?",
    "Tell me about {place}.",
    "What is {place} famous for?",
    "Explain how {thing} works.",
    "Explain {thing} to a ten-year-old.",
    "What are the main parts of {thing}?",
    "Why is {thing} important?",
    "Write a Python function that {task}.",
    "How do I {task} in Python?",
    "Write a JavaScript function that {task}.",
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Write a short story about {topic}.",
    "Give me three tips for {activity}.",
    "How can I get better at {activity}?",
    "What should a beginner know about {activity}?",
    "What does the word '{word}' mean?",
    "Use the word '{word}' in a sentence.",
    "What is the difference between {pair}?",
    "Compare {pair}.",
    "List five {category}.",
    "Name some {category} and describe one of them.",
    "What is {a} plus {b}?",
    "What is {a} times {b}?",
    "If I have {a} apples and give away {b}, how many are left?",
    "Summarize the history of {thing} in a few sentences.",
    "Write an email to a friend about {topic}.",
    "What are the pros and cons of {activity}?",
    "Translate 'good morning' into {language}.",
    "How do you say 'thank you' in {language}?",
    "Describe {place} in three sentences.",
    "What is the weather like in {place}?",
    "Who invented {thing}?",
    "What would happen without {thing}?",
    "Write a Python class that {task}.",
    "Explain this task step by step: a program that {task}.",
    "Write a limerick about {topic}.",
    "Describe {topic} to someone who has never seen it.",
    "Make a weekly plan for {activity}.",
    "What mistakes do beginners make with {activity}?",
    "Give me a synonym for '{word}'.",
    "Which is bigger: {pair}?",
    "What is your favorite of these: {category}?",
    "What is {a} minus {b}?",
]

SUBJECTS = {
    "place": ["France", "Japan", "Brazil", "Canada", "Egypt", "Italy", "Kenya", "Peru",
              "Norway", "India", "Mexico", "Spain", "Germany", "Australia", "Chile", "Vietnam",
              "Greece", "Poland", "Morocco", "Sweden", "Argentina", "Turkey", "Thailand",
              "Portugal", "Ireland", "Nigeria", "Finland", "Austria", "Iceland", "Cuba",
              "Nepal", "Ghana", "Belgium", "Colombia", "Indonesia", "Hungary", "Denmark",
              "Jamaica", "Scotland", "Mongolia", "Ethiopia", "Croatia", "Malaysia",
              "Switzerland", "Bolivia", "Romania", "Tanzania", "New Zealand", "Singapore",
              "Ukraine"],
    "thing": ["a refrigerator", "the internet", "photosynthesis", "a car engine", "vaccines",
              "a rainbow", "electricity", "the stock market", "a compass", "gravity",
              "a bicycle", "the human heart", "solar panels", "a microwave oven", "democracy",
              "the water cycle", "a telescope", "batteries", "recycling", "an airplane",
              "the immune system", "a volcano", "money", "tides", "a camera", "wifi",
              "earthquakes", "a thermometer", "a clock", "the moon's phases", "a light bulb",
              "a submarine", "wind turbines", "the brain", "a printer", "3D printing",
              "a rocket", "the postal service", "an elevator", "a smartphone", "soap",
              "a dishwasher", "bread yeast", "lightning", "a barometer", "the human eye",
              "a search engine", "an electric car", "GPS", "a dam"],
    "task": ["reverses a string", "checks if a number is prime", "sorts a list of numbers",
             "counts the words in a sentence", "finds the largest number in a list",
             "computes the factorial of a number", "removes duplicates from a list",
             "checks if a word is a palindrome", "converts Celsius to Fahrenheit",
             "returns the Fibonacci numbers up to n", "reads a file line by line",
             "merges two dictionaries", "counts vowels in a string", "flattens a nested list",
             "computes the average of a list", "capitalizes every word in a sentence",
             "finds the greatest common divisor of two numbers",
             "checks if a year is a leap year", "generates a random password",
             "converts a list to a set", "finds the second largest number in a list",
             "swaps two variables", "sums the digits of a number",
             "checks if two strings are anagrams", "counts how often each letter appears",
             "checks if a list is sorted", "returns the last n items of a list",
             "converts a string to title case", "finds the smallest number in a list",
             "adds two matrices", "checks if a string contains only digits",
             "reverses the words in a sentence", "converts kilometers to miles",
             "finds common elements of two lists", "removes spaces from a string",
             "computes the square root of a number", "checks if a number is even",
             "splits a list into chunks", "returns the length of the longest word",
             "joins a list of strings with commas", "computes simple interest",
             "rounds a number to two decimals", "finds the index of an item in a list",
             "counts lines in a text"],
    "topic": ["the ocean", "autumn leaves", "a rainy day", "friendship", "the moon",
              "a lost cat", "the mountains", "coffee", "a city at night", "the first snow",
              "a garden", "an old library", "the stars", "a summer holiday", "a robot",
              "the desert", "a river", "birthdays", "a train journey", "the forest",
              "a lighthouse", "a thunderstorm", "music", "home", "a quiet morning",
              "the sea breeze", "an old friend", "winter nights", "a candle", "the city park",
              "a small boat", "the harvest", "a mountain lake", "spring rain", "a kite",
              "the sunrise", "a bakery", "grandmother's kitchen", "a busy market",
              "an empty beach", "fireflies", "a school day", "the wind", "a bridge"],
    "activity": ["learning a language", "running", "cooking", "saving money", "gardening",
                 "public speaking", "studying for exams", "sleeping well", "writing",
                 "playing chess", "drawing", "working from home", "traveling cheaply",
                 "swimming", "learning to code", "photography", "meditation", "hiking",
                 "playing the guitar", "making friends", "time management", "baking bread",
                 "yoga", "learning math", "painting", "cycling", "reading more books",
                 "managing stress", "camping", "knitting", "dancing", "eating healthy",
                 "writing poetry", "job interviews", "budgeting", "fishing", "skiing",
                 "taking notes", "learning history", "keeping a journal", "rock climbing",
                 "playing the piano"],
    "word": ["serendipity", "ephemeral", "resilient", "ubiquitous", "eloquent", "meticulous",
             "pragmatic", "benevolent", "candid", "diligent", "frugal", "gregarious", "humble",
             "inevitable", "jubilant", "lucid", "nostalgia", "optimistic", "reluctant",
             "tenacious", "ambiguous", "curious", "generous", "vivid", "obscure", "brave",
             "fragile", "sincere", "abundant", "cautious", "wander", "serene", "vast", "loyal",
             "clever", "gentle", "rare", "bold", "patient", "modest"],
    "pair": ["a virus and a bacterium", "weather and climate", "a lake and a sea",
             "Python and JavaScript", "a list and a tuple", "speed and velocity",
             "an alligator and a crocodile", "a democracy and a republic", "RAM and storage",
             "a planet and a star", "baking soda and baking powder", "a frog and a toad",
             "hardware and software", "a crow and a raven", "tea and coffee", "mass and weight",
             "an ocean and a sea", "a hurricane and a tornado", "a rabbit and a hare",
             "a city and a town", "rain and snow", "a cup and a mug", "a moth and a butterfly",
             "a noun and a verb", "a bay and a gulf", "a violin and a cello",
             "an apple and a pear", "a lawyer and a judge", "a comet and an asteroid",
             "a river and a stream", "heat and temperature", "a laptop and a desktop",
             "a poem and a song", "a cold and the flu"],
    "category": ["fruits", "programming languages", "musical instruments", "planets", "mammals",
                 "board games", "vegetables", "famous painters", "sports", "kitchen tools",
                 "birds", "colors", "countries in Africa", "flowers", "dog breeds",
                 "types of clouds", "board games for children", "rivers", "insects", "trees",
                 "desserts", "card games", "ocean animals", "cheeses", "musical genres",
                 "tools in a garage", "things in a classroom", "spices", "breakfast foods",
                 "famous scientists", "things to do on a rainy day", "farm animals", "hobbies",
                 "winter sports"],
    "language": ["French", "Spanish", "German", "Italian", "Japanese", "Portuguese", "Dutch",
                 "Swedish", "Russian", "Chinese", "Korean", "Arabic", "Greek", "Turkish",
                 "Polish", "Hindi", "Norwegian", "Finnish"],
}


def _fill(template: str, rng: random.Random, pools: dict[str, list[str]], low: int
          ) -> str | None:
    values = {}
    for key in ("place", "thing", "task", "topic", "activity", "word", "pair", "category",
                "language"):
        if "{" + key + "}" in template:
            if not pools[key]:
                return None
            values[key] = rng.choice(pools[key])
    if "{a}" in template:
        values["a"], values["b"] = str(rng.randint(low, low + 58)), str(rng.randint(1, 20))
    return template.format(**values)


#: ways of asking the same thing, shared by both splits (they name no subject): with them
#: the worded templates have as many prompts as the number ones
STYLES = ["", "", " Keep it short.", " Use simple words.", " Give an example.",
          " Answer in a few sentences.", " Explain step by step.", " Be specific."]


def prompts(split: str, count: int, seed: int = 0) -> list[str]:
    """Up to ``count`` distinct prompts of ``split`` ("train" or "heldout"): held-out prompts
    use the last fifth of every subject list, training prompts the rest.

    No template gives more than 1.5 times its share: the number templates alone have
    thousands of prompts, and without a cap they filled most of a large set (3496 of 4000
    training prompts were sums and apples, against 12 of the 80 held-out ones)."""
    rng = random.Random(f"{split}-{seed}")
    pools = {}
    for key, values in SUBJECTS.items():
        cut = len(values) - max(2, len(values) // 5)
        pools[key] = values[:cut] if split == "train" else values[cut:]
    quota = max(1, -(-3 * count // (2 * len(TEMPLATES))))
    taken = dict.fromkeys(TEMPLATES, 0)
    out: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < count and attempts < count * 50:
        attempts += 1
        template = rng.choice(TEMPLATES)
        if taken[template] >= quota:
            continue
        text = _fill(template, rng, pools, 2 if split == "train" else 61)
        if text is None:
            continue
        if "{a}" not in template:
            text += rng.choice(STYLES)
        if text not in seen:
            seen.add(text)
            taken[template] += 1
            out.append(text)
    return out
