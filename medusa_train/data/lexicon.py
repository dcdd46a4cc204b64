"""Word lists for the embedded corpus generator (written for this project, no external source).

Plain tuples so the generator needs no files at run time. Each list is small on purpose: the
embedded corpus must be learnable by a few-million-parameter model in minutes, so the variety
comes from combining slots, not from a large vocabulary.
"""

from __future__ import annotations

# fmt: off

# (name, subject pronoun, object pronoun, possessive)
PEOPLE: tuple[tuple[str, str, str, str], ...] = tuple(
    (name, "she", "her", "her")
    for name in (
        "Anna", "Maria", "Lena", "Sofia", "Clara", "Emma", "Nora", "Ida", "Rosa", "Julia",
        "Mina", "Hanna", "Lucy", "Alice", "Grace", "Ella", "Mia", "Zoe", "Eva", "Lily",
    )
) + tuple(
    (name, "he", "him", "his")
    for name in (
        "Tom", "Ben", "Leo", "Max", "Sam", "Paul", "Jonas", "Felix", "Oscar", "Hugo",
        "Peter", "David", "Martin", "Adam", "Noah", "Jack", "Oliver", "Henry", "Lucas", "Milo",
    )
)

OCCUPATIONS: tuple[str, ...] = (
    "baker", "farmer", "fisher", "teacher", "painter", "doctor", "carpenter", "gardener",
    "librarian", "sailor", "tailor", "musician", "potter", "shepherd", "writer", "builder",
    "cook", "miller", "weaver", "nurse",
)

ADJECTIVES: tuple[str, ...] = (
    "kind", "brave", "clever", "quiet", "curious", "cheerful", "patient", "careful",
    "gentle", "busy", "young", "old", "honest", "shy", "friendly", "proud",
)

PLACES: tuple[str, ...] = (
    "a small village by the sea", "a busy town near the river", "a quiet farm in the hills",
    "an old house at the edge of the forest", "a little cottage in the valley",
    "a big city by the lake", "a mountain village", "an island far from the coast",
    "a sleepy town on the plain", "a cabin in the woods",
)

LANDMARKS: tuple[str, ...] = (
    "old bridge", "river", "market", "well", "big oak tree", "church", "harbor", "mill",
    "garden gate", "school", "library", "bakery", "train station", "lighthouse",
)

OBJECTS: tuple[str, ...] = (
    "key", "map", "box", "book", "lamp", "hat", "bell", "letter", "coin", "ring", "basket",
    "clock", "kite", "cup", "shell", "stone", "feather", "bottle", "ribbon", "compass",
)

COLORS: tuple[str, ...] = (
    "red", "blue", "green", "yellow", "white", "black", "brown", "orange", "purple", "gray",
)

SIZES: tuple[str, ...] = ("small", "large", "tiny", "heavy", "light", "shiny", "old", "new")

# Daily habits: "Every morning, NAME <habit>."
HABITS: tuple[str, ...] = (
    "walked to the market", "fed the chickens", "read a book by the window",
    "made a pot of tea", "swept the front steps", "watered the flowers",
    "went for a long walk", "sang a little song", "baked fresh bread", "fixed something broken",
)

# What the character does with the found object: "NAME decided to <deed>."
DEEDS: tuple[tuple[str, str], ...] = (
    ("find its owner", "asked everyone in town until the owner was found"),
    ("keep it safe", "put it in a safe place and told a friend about it"),
    ("follow where it led", "followed the clues all the way to a hidden garden"),
    ("share it with friends", "showed it to friends and they all had a happy day"),
    ("give it to the school", "gave it to the school so that the children could learn from it"),
    ("clean it carefully", "cleaned it carefully until it looked like new"),
)

MORALS: tuple[str, ...] = (
    "small things can bring great joy",
    "kindness always comes back",
    "it is good to ask for help",
    "patience is a kind of strength",
    "every day can bring a surprise",
    "friends make every journey better",
    "honesty is the best choice",
    "it is never too late to learn",
)

WEEKDAYS: tuple[str, ...] = (
    "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday",
)

NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve",
)

ORDINALS: tuple[str, ...] = (
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
)

# Countable things for word problems: (singular, plural)
COUNTABLES: tuple[tuple[str, str], ...] = (
    ("apple", "apples"), ("book", "books"), ("pencil", "pencils"), ("marble", "marbles"),
    ("cookie", "cookies"), ("stamp", "stamps"), ("egg", "eggs"), ("flower", "flowers"),
    ("card", "cards"), ("coin", "coins"), ("orange", "oranges"), ("sticker", "stickers"),
)

# Categories for list tasks: category -> members
CATEGORIES: dict[str, tuple[str, ...]] = {
    "fruits": ("apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "pear", "plum", "peach"),
    "animals": ("bear", "cat", "deer", "dog", "fox", "horse", "lion", "mouse", "rabbit", "wolf"),
    "colors": COLORS,
    "vegetables": ("bean", "cabbage", "carrot", "corn", "leek", "onion", "pea", "potato", "radish", "tomato"),
    "tools": ("drill", "hammer", "ladder", "knife", "rake", "saw", "shovel", "wrench", "brush", "needle"),
    "birds": ("crow", "duck", "eagle", "goose", "hawk", "owl", "robin", "sparrow", "swan", "pigeon"),
    "instruments": ("drum", "flute", "guitar", "harp", "piano", "trumpet", "violin", "cello", "bell", "horn"),
}

# Animal facts: (animal, weight in kilograms, habitat, food)
ANIMALS: tuple[tuple[str, int, str, str], ...] = (
    ("mouse", 1, "fields and houses", "seeds"),
    ("rabbit", 2, "meadows", "grass"),
    ("cat", 4, "houses and farms", "fish and meat"),
    ("fox", 7, "forests", "small animals"),
    ("goose", 5, "lakes", "grass and grain"),
    ("dog", 20, "houses and farms", "meat"),
    ("sheep", 70, "hills and farms", "grass"),
    ("wolf", 40, "forests", "meat"),
    ("deer", 90, "forests", "leaves and grass"),
    ("pig", 150, "farms", "almost anything"),
    ("bear", 300, "forests and mountains", "berries and fish"),
    ("horse", 500, "farms and meadows", "hay and grass"),
    ("cow", 700, "farms", "grass"),
    ("camel", 500, "deserts", "dry plants"),
    ("elephant", 5000, "savannas", "leaves and fruit"),
)

# Dishes: dish -> (ingredients, steps as (verb phrase, minutes))
DISHES: dict[str, tuple[tuple[str, ...], tuple[tuple[str, int], ...]]] = {
    "pancakes": (
        ("2 eggs", "1 cup of flour", "1 cup of milk", "a pinch of salt", "butter for the pan"),
        (("Whisk the eggs, flour, milk and salt into a smooth batter", 5),
         ("Heat a little butter in a pan", 2),
         ("Pour in a small ladle of batter and cook until golden on both sides", 10),
         ("Serve warm with fruit or honey", 1)),
    ),
    "tomato soup": (
        ("6 tomatoes", "1 onion", "2 cups of water", "a spoon of oil", "salt and pepper"),
        (("Chop the onion and the tomatoes", 5),
         ("Fry the onion in the oil until soft", 5),
         ("Add the tomatoes and the water and simmer", 20),
         ("Blend the soup and season it with salt and pepper", 3)),
    ),
    "fried rice": (
        ("2 cups of cooked rice", "2 eggs", "1 carrot", "a handful of peas", "soy sauce"),
        (("Dice the carrot", 3),
         ("Scramble the eggs in a hot pan and set them aside", 3),
         ("Fry the carrot and the peas for a few minutes", 4),
         ("Add the rice, the eggs and the soy sauce and stir well", 5)),
    ),
    "lemonade": (
        ("4 lemons", "4 cups of cold water", "half a cup of sugar", "ice"),
        (("Squeeze the juice from the lemons", 5),
         ("Stir the sugar into the water until it dissolves", 2),
         ("Add the lemon juice and the ice", 1)),
    ),
    "potato salad": (
        ("6 potatoes", "1 onion", "2 spoons of mustard", "3 spoons of oil", "a spoon of vinegar"),
        (("Boil the potatoes until soft", 20),
         ("Let them cool and cut them into slices", 10),
         ("Chop the onion finely", 3),
         ("Mix the mustard, the oil and the vinegar", 2),
         ("Toss everything together and let it rest", 15)),
    ),
    "banana bread": (
        ("3 ripe bananas", "2 eggs", "2 cups of flour", "half a cup of sugar", "a spoon of baking soda"),
        (("Mash the bananas in a bowl", 3),
         ("Beat in the eggs and the sugar", 3),
         ("Fold in the flour and the baking soda", 3),
         ("Pour the batter into a tin and bake it", 50)),
    ),
    "vegetable stew": (
        ("2 carrots", "3 potatoes", "1 onion", "1 leek", "4 cups of broth"),
        (("Peel and chop all the vegetables", 10),
         ("Fry the onion and the leek in a large pot", 5),
         ("Add the carrots, the potatoes and the broth", 2),
         ("Simmer the stew until the vegetables are tender", 30)),
    ),
    "scrambled eggs": (
        ("3 eggs", "a splash of milk", "a handful of cheese", "salt", "butter"),
        (("Beat the eggs with the milk and the salt", 2),
         ("Melt the butter in a pan", 1),
         ("Pour in the eggs and stir them gently", 4),
         ("Sprinkle the cheese on top and serve", 1)),
    ),
}

# Syllables for the made-up glossary words.
SYLLABLES: tuple[str, ...] = (
    "ba", "lo", "mi", "ren", "ta", "vo", "ki", "sul", "do", "fen", "ga", "pri", "zu", "mor",
    "la", "nek", "ti", "bro", "sa", "vel", "qua", "dri", "ho", "pen",
)

# (kind of thing, what it does) for glossary definitions
GLOSSARY_KINDS: tuple[str, ...] = (
    "a small tool", "a kind of boat", "a sweet fruit", "a warm drink", "a folk dance",
    "a type of bread", "a kind of bird", "a wooden toy", "a winter coat", "a garden plant",
    "a board game", "a kind of song",
)
GLOSSARY_USES: tuple[str, ...] = (
    "used to open heavy doors", "used to carry fish across the lake", "eaten in the summer",
    "served after dinner", "performed at weddings", "baked for holidays",
    "known for its bright feathers", "given to children on their birthday", "worn in the mountains",
    "grown near the kitchen door", "played on long evenings", "sung while working in the fields",
)

STREETS: tuple[str, ...] = (
    "Elm Street", "Main Street", "Oak Road", "River Lane", "Mill Road", "Park Avenue",
    "Hill Street", "Station Road", "Church Lane", "Market Street",
)

REQUESTS: tuple[str, ...] = (
    "send me the report", "join the meeting", "help with the garden party", "return the book",
    "check the schedule", "bring the chairs", "call the landlord", "look at the new plan",
    "water my plants", "pick up the tickets",
)

TOPICS: tuple[str, ...] = (
    "the weather", "the school trip", "the new library", "the summer fair", "the garden",
    "the book club", "the football match", "the village concert",
)
