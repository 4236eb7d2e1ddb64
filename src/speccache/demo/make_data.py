"""Write the bundled demo chat dataset, in ShareGPT and OpenAI form.

Run ``python -m speccache.demo.make_data`` after editing the content below; it
rewrites ``data/chat_sharegpt.jsonl`` and ``data/chat_openai.jsonl`` (both are
committed). The output is a pure function of this file: a fixed seed drives
every choice and nothing iterates over a set or a hash-ordered container.

The demo tokenizer is trained on these files, so changing them changes the
demo vocabulary; bump ``DEMO_VERSION`` in ``speccache.demo`` when you do, so
cached demo targets built from the old vocabulary are not reused.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["build_conversations", "main", "write_files"]

SEED = 20240917
N_CONVERSATIONS = 240

Exchange = tuple[str, str]
Item = tuple[str, str, list[Exchange]]

SYSTEM_PROMPTS = [
    "You are a helpful assistant. Answer clearly and briefly.",
    "You are a patient tutor. Explain each step so a beginner can follow.",
    "You are a friendly assistant for everyday questions. Keep answers practical.",
    "You are an expert programmer. Prefer short, correct code examples.",
    "You are a science teacher. Use simple words and one concrete example.",
    "Answer in at most three sentences.",
]

GREETINGS: list[Item] = [
    ("Hi", "Hello! How can I help you today?", []),
    ("Hello there.", "Hi! What would you like to talk about?", []),
    ("Good morning!", "Good morning! What can I do for you?", []),
    ("Are you there?", "Yes, I am here. What do you need?", []),
    ("Thanks for your help yesterday.", "You are welcome. I am glad it helped.", []),
    ("Can you help me with something?", "Of course. Tell me what you need.", []),
    ("Say yes or no: is water wet?", "Yes.", []),
    ("What is your name?", "I am a small demo assistant without a name.", []),
    ("Tell me a short joke.", "Why did the computer go to the doctor? It had a virus.", []),
    ("Give me one word that means happy.", "Cheerful.", []),
    ("How are you?", "I am doing well, thank you. How can I help?", []),
    ("Bye!", "Goodbye! Have a nice day.", []),
]

EVERYDAY: list[Item] = [
    (
        "How do I cook rice on the stove?",
        "Rinse one cup of rice until the water runs mostly clear. Put it in a pot with "
        "about one and a half cups of water and a pinch of salt. Bring it to a boil, then "
        "cover the pot, turn the heat to low and simmer for 15 to 18 minutes. Turn off the "
        "heat and let it rest, still covered, for 5 minutes before fluffing it with a fork.",
        [
            (
                "What if it comes out sticky?",
                "Rinse the rice a little longer next time to remove extra starch, and use "
                "slightly less water. Also avoid lifting the lid while it simmers.",
            )
        ],
    ),
    (
        "How much sleep does an adult need?",
        "Most adults need 7 to 9 hours of sleep each night. Going to bed and waking up "
        "at the same time every day, even on weekends, makes it easier to sleep well.",
        [
            (
                "Any tips for falling asleep faster?",
                "Keep the bedroom dark, quiet and cool. Avoid caffeine in the afternoon, "
                "put screens away about an hour before bed, and try a short routine such as "
                "reading or stretching so your body learns that it is time to rest.",
            )
        ],
    ),
    (
        "What should I pack for a weekend trip?",
        "Pack two or three outfits, a warm layer, sleepwear, comfortable shoes, "
        "toiletries, any medicine you take, a phone charger, and your ID and wallet. "
        "Check the weather forecast first so you can add a rain jacket or sunscreen.",
        [],
    ),
    (
        "How often should I water a cactus?",
        "Water a cactus only when the soil is completely dry. In spring and summer that "
        "is usually every two to three weeks; in winter, once a month or less is enough. "
        "Too much water is the most common way to kill a cactus.",
        [],
    ),
    (
        "How do I remove a coffee stain from a shirt?",
        "Act quickly. Blot the stain with a paper towel, then rinse it from the back "
        "with cold water. Rub in a little liquid laundry detergent, wait five minutes and "
        "wash the shirt as usual. Do not put it in the dryer until the stain is gone, "
        "because heat can set it.",
        [],
    ),
    (
        "What is a good way to save money each month?",
        "Write down what you spend for one month, then set a budget for each category. "
        "Move a fixed amount into a savings account on the day you get paid, so you save "
        "first and spend what is left. Cancel subscriptions you do not use.",
        [
            (
                "How much should I save?",
                "A common rule of thumb is to save at least 10 to 20 percent of your income. "
                "If that is too much right now, start smaller and increase it over time.",
            )
        ],
    ),
    (
        "How do I convert Celsius to Fahrenheit?",
        "Multiply the Celsius temperature by 9, divide by 5, then add 32. For example, "
        "20 degrees Celsius is 20 * 9 / 5 + 32 = 68 degrees Fahrenheit.",
        [
            (
                "And the other way around?",
                "Subtract 32, then multiply by 5 and divide by 9. For example, 50 degrees "
                "Fahrenheit is (50 - 32) * 5 / 9 = 10 degrees Celsius.",
            )
        ],
    ),
    (
        "How long should I boil an egg?",
        "Put the egg into boiling water. For a soft yolk, cook it for about 6 minutes; "
        "for a fully firm yolk, about 10 minutes. Then cool it in cold water so it is "
        "easier to peel.",
        [],
    ),
    (
        "What can I do when I feel bored?",
        "Go for a walk, call a friend, read a few pages of a book, cook something new, "
        "or tidy one small corner of your home. Learning a short skill, like a card "
        "trick or a few words in another language, also helps.",
        [],
    ),
    (
        "How do I make a good first impression at a job interview?",
        "Arrive a few minutes early, dress a little more formally than the daily dress "
        "code, and learn what the company does before you go. Listen carefully, answer "
        "with concrete examples from your experience, and prepare two or three questions "
        "to ask at the end.",
        [
            (
                "What questions could I ask?",
                "You could ask what a typical week in the role looks like, how success is "
                "measured in the first few months, and what the team is working on now.",
            )
        ],
    ),
    (
        "Is it better to shower in the morning or at night?",
        "Both are fine; it depends on your routine. A morning shower can help you wake "
        "up, while an evening shower can help you relax and keeps your sheets cleaner.",
        [],
    ),
    (
        "How do I keep bread fresh longer?",
        "Store bread in a bread box or a paper bag at room temperature for a few days. "
        "For longer storage, slice it and freeze it in a sealed bag; you can toast slices "
        "straight from the freezer. Avoid the fridge, because bread goes stale faster there.",
        [],
    ),
    (
        "What time is it in Tokyo when it is noon in London?",
        "Tokyo is 9 hours ahead of London in winter and 8 hours ahead when London uses "
        "summer time. So noon in London is 9 pm in Tokyo in winter and 8 pm in summer.",
        [],
    ),
    (
        "How many cups are in a liter?",
        "One liter is about 4.2 US cups, since one US cup is about 237 milliliters.",
        [],
    ),
    (
        "How can I stay focused while studying?",
        "Put your phone in another room, study in blocks of about 25 minutes with a "
        "5 minute break after each, and start each block with one clear goal. Write down "
        "distracting thoughts on paper and deal with them later.",
        [
            (
                "What is that method called?",
                "Working in short timed blocks with breaks is often called the Pomodoro "
                "technique, named after a tomato shaped kitchen timer.",
            )
        ],
    ),
    (
        "What should I do if my phone gets wet?",
        "Turn it off right away and do not charge it. Wipe it dry, remove the case and "
        "any card trays, and let it dry in a place with good air flow for at least a day. "
        "Putting it in rice does not help much.",
        [],
    ),
    (
        "How do I write a polite email asking for a deadline extension?",
        "Keep it short. Start with a greeting, explain briefly why you need more time, "
        "propose a specific new date, and thank the reader. For example: I am writing to "
        "ask whether I could submit the report on Friday instead of Wednesday. I need two "
        "more days to check the numbers. Thank you for considering this.",
        [],
    ),
    (
        "What is a healthy breakfast?",
        "A healthy breakfast combines protein, fiber and some fruit, for example oatmeal "
        "with yogurt and berries, or whole grain toast with eggs and a piece of fruit.",
        [],
    ),
    (
        "How do I fix a squeaky door?",
        "Lift the hinge pins out one at a time, wipe them clean, and apply a little "
        "lubricant such as petroleum jelly or a silicone spray. Put the pins back and open "
        "and close the door a few times to spread the lubricant.",
        [],
    ),
    (
        "How many steps should I walk each day?",
        "Many people aim for about 7000 to 10000 steps a day. Any increase helps, so if "
        "you walk 3000 steps now, try adding 1000 more each week.",
        [],
    ),
    (
        "How do I start running if I have never run before?",
        "Start with walk and run intervals: run for one minute, walk for two, and repeat "
        "for 20 minutes, three times a week. Each week, run a little longer and walk a "
        "little less. Good shoes and a slow, comfortable pace matter more than speed.",
        [
            (
                "How long until I can run for 30 minutes?",
                "Most beginners can run for 30 minutes without stopping after about eight "
                "to ten weeks of steady practice.",
            )
        ],
    ),
    (
        "What is the difference between weather and climate?",
        "Weather is what the air is doing today or this week: rain, sun, wind. Climate is "
        "the average pattern of weather in a place over many years.",
        [],
    ),
    (
        "How do I clean a cast iron pan?",
        "Rinse it with hot water while it is still warm and scrub with a brush. Use a "
        "little soap if needed. Dry it completely on the stove, then rub in a thin layer "
        "of oil to protect it from rust.",
        [],
    ),
    (
        "What is a good gift for a coworker who is leaving?",
        "A card signed by the team is always welcome. Small useful gifts also work well, "
        "such as a good notebook, a plant, a coffee mug, or a gift card for a local cafe.",
        [],
    ),
    (
        "How can I remember names better?",
        "Repeat the name right away, for example: Nice to meet you, Sam. Link the name "
        "to something you notice about the person, and use it once more before you say "
        "goodbye. Writing it down later also helps.",
        [],
    ),
    (
        "Should I drink water before or after a meal?",
        "Either is fine. Drinking a glass of water before a meal can help you feel full "
        "sooner, and sipping water during a meal is also normal.",
        [],
    ),
    (
        "How do I plan meals for a week?",
        "Choose five or six dinners, check which ingredients they share, and write one "
        "shopping list. Cook larger portions on two of the days so you have leftovers for "
        "lunch. Keep a simple backup meal, like pasta, for busy evenings.",
        [],
    ),
    (
        "How do I choose a good password?",
        "Use a long passphrase of four or more unrelated words, or let a password manager "
        "create a random one. Use a different password for every site and turn on two "
        "factor login where you can.",
        [],
    ),
    (
        "Why do onions make me cry?",
        "Cutting an onion breaks its cells and releases a gas that irritates your eyes, "
        "so they make tears to wash it away. A sharp knife and a cold onion reduce the effect.",
        [],
    ),
    (
        "What is the best way to learn a new language?",
        "Practice a little every day. Learn the most common words first, listen to simple "
        "audio, and speak out loud as early as you can, even with mistakes. Talking with a "
        "partner once a week helps a lot.",
        [],
    ),
]

SCIENCE: list[Item] = [
    (
        "Why is the sky blue?",
        "Sunlight contains all colors. When it passes through the air, the small gas "
        "molecules scatter short blue wavelengths much more than long red ones. That "
        "scattered blue light reaches our eyes from every direction, so the sky looks blue.",
        [
            (
                "Then why are sunsets red?",
                "At sunset the light travels through much more air. Most of the blue is "
                "scattered away before it reaches you, so the remaining light is mostly "
                "orange and red.",
            )
        ],
    ),
    (
        "What is photosynthesis?",
        "Photosynthesis is the process plants use to make food. Using energy from light, "
        "they combine carbon dioxide from the air and water from the soil to make glucose, "
        "a sugar, and they release oxygen.",
        [
            (
                "Where does it happen in the plant?",
                "Mostly in the leaves, inside small parts of the cells called chloroplasts. "
                "They contain chlorophyll, the green pigment that absorbs light.",
            )
        ],
    ),
    (
        "How far is the Moon from the Earth?",
        "On average the Moon is about 384,400 kilometers from the Earth. Light covers that "
        "distance in about 1.3 seconds.",
        [],
    ),
    (
        "What is the boiling point of water?",
        "At sea level, pure water boils at 100 degrees Celsius, which is 212 degrees "
        "Fahrenheit. At higher altitude the air pressure is lower, so water boils at a "
        "lower temperature.",
        [],
    ),
    (
        "What are atoms made of?",
        "An atom has a small, dense nucleus made of protons and neutrons, surrounded by "
        "electrons. Protons have a positive charge, electrons a negative charge, and "
        "neutrons no charge.",
        [
            (
                "What decides which element an atom is?",
                "The number of protons. For example, every carbon atom has 6 protons and every oxygen atom has 8.",
            )
        ],
    ),
    (
        "Why do we have seasons?",
        "The Earth's axis is tilted by about 23.5 degrees. As the Earth goes around the "
        "Sun, each half of the planet takes turns leaning toward the Sun. The half that "
        "leans toward it gets more direct sunlight and longer days, which is summer.",
        [],
    ),
    (
        "What is the speed of light?",
        "In a vacuum, light travels at about 299,792 kilometers per second, often rounded "
        "to 300,000 kilometers per second.",
        [],
    ),
    (
        "How many bones are in the adult human body?",
        "An adult human has 206 bones. Babies are born with more, but some of them fuse together as they grow.",
        [],
    ),
    (
        "What is the largest planet in our solar system?",
        "Jupiter. It is a gas giant with a mass more than twice that of all the other planets combined.",
        [],
    ),
    (
        "What is DNA?",
        "DNA is the molecule that stores genetic instructions in living things. It is a "
        "long double helix made of four bases, A, T, C and G, and the order of those bases "
        "encodes how to build proteins.",
        [],
    ),
    (
        "Why does ice float on water?",
        "When water freezes, its molecules line up in an open crystal pattern that takes "
        "more space than liquid water. So ice is less dense than water, and it floats.",
        [],
    ),
    (
        "What is gravity?",
        "Gravity is the attraction between objects that have mass. The more mass an object "
        "has, and the closer you are to it, the stronger its pull. It keeps us on the "
        "ground and keeps the planets in orbit around the Sun.",
        [],
    ),
    (
        "How does a rainbow form?",
        "Sunlight enters raindrops, bends, reflects off the back of the drop, and bends "
        "again as it leaves. Each color bends by a slightly different amount, so the "
        "white light spreads into a band of colors.",
        [],
    ),
    (
        "What is the chemical formula of water?",
        "H2O: each water molecule has two hydrogen atoms bonded to one oxygen atom.",
        [],
    ),
    (
        "What causes thunder?",
        "Lightning heats the air around it to tens of thousands of degrees in a fraction "
        "of a second. The air expands very fast and creates a shock wave, which we hear "
        "as thunder.",
        [
            (
                "Why do we see lightning before we hear thunder?",
                "Light travels about a million times faster than sound. You can estimate "
                "the distance: every 3 seconds between the flash and the sound is about "
                "one kilometer.",
            )
        ],
    ),
    (
        "What is the difference between a virus and a bacterium?",
        "Bacteria are single celled living organisms that can grow and divide on their "
        "own. Viruses are much smaller and can only multiply inside the cells of a host. "
        "Antibiotics can treat many bacterial infections but do not work on viruses.",
        [],
    ),
    (
        "How hot is the surface of the Sun?",
        "The visible surface of the Sun is about 5,500 degrees Celsius. Its core is far "
        "hotter, about 15 million degrees Celsius.",
        [],
    ),
    (
        "What is an element?",
        "An element is a pure substance made of only one kind of atom, such as oxygen, "
        "iron or gold. There are 118 known elements, listed in the periodic table.",
        [],
    ),
    (
        "Why do objects fall at the same rate in a vacuum?",
        "Gravity pulls harder on heavier objects, but heavier objects are also harder to "
        "accelerate. The two effects cancel exactly, so without air resistance a hammer "
        "and a feather fall together.",
        [],
    ),
    (
        "What is the function of the heart?",
        "The heart is a muscle that pumps blood through the body. Blood carries oxygen "
        "and nutrients to the cells and carries carbon dioxide away. An adult heart beats "
        "about 60 to 100 times a minute at rest.",
        [],
    ),
    (
        "How many planets are in the solar system?",
        "There are eight planets: Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus "
        "and Neptune. Pluto was reclassified as a dwarf planet in 2006.",
        [
            (
                "Which one is closest to the Sun?",
                "Mercury is the closest planet to the Sun.",
            )
        ],
    ),
    (
        "What is energy?",
        "Energy is the ability to do work or cause change. It comes in forms such as "
        "motion, heat, light, chemical energy and electrical energy, and it can change "
        "from one form to another but is never created or destroyed.",
        [],
    ),
    (
        "What is an ecosystem?",
        "An ecosystem is a community of living things, such as plants, animals and "
        "microbes, together with their environment of air, water and soil, all "
        "interacting with each other.",
        [],
    ),
    (
        "Why is the ocean salty?",
        "Rain slowly dissolves minerals from rocks, and rivers carry them to the sea. "
        "When ocean water evaporates, the salt stays behind, so over millions of years "
        "the ocean has become salty.",
        [],
    ),
    (
        "What is the difference between speed and velocity?",
        "Speed tells you how fast something moves. Velocity tells you how fast and in "
        "which direction. A car going around a circle at a steady 50 km/h has constant "
        "speed but changing velocity.",
        [],
    ),
    (
        "How do vaccines work?",
        "A vaccine shows the immune system a harmless piece or a weakened form of a germ. "
        "The body learns to recognize it and makes memory cells, so if the real germ "
        "arrives later, the immune system can fight it off quickly.",
        [],
    ),
    (
        "What is a light year?",
        "A light year is a distance, not a time: how far light travels in one year, about 9.46 trillion kilometers.",
        [],
    ),
    (
        "What are the three states of matter?",
        "The three common states are solid, liquid and gas. A solid keeps its shape, a "
        "liquid takes the shape of its container, and a gas spreads out to fill it. "
        "Plasma is a fourth state found in stars and lightning.",
        [],
    ),
    (
        "What is friction?",
        "Friction is a force that resists motion when two surfaces rub against each "
        "other. It slows a sliding box, but it also lets our shoes grip the ground.",
        [],
    ),
    (
        "Why do leaves change color in autumn?",
        "In autumn, trees stop making green chlorophyll. As it breaks down, the yellow "
        "and orange pigments that were hidden underneath become visible, and some trees "
        "also make new red pigments.",
        [],
    ),
    (
        "What is the pH of pure water?",
        "Pure water at 25 degrees Celsius has a pH of 7, which is neutral. Lower values "
        "are acidic and higher values are basic.",
        [],
    ),
    (
        "How does a magnet work?",
        "In a magnet, the tiny magnetic fields of many electrons line up in the same "
        "direction. Together they make a magnetic field with a north and a south pole. "
        "Opposite poles attract and like poles repel.",
        [],
    ),
]

PROGRAMMING: list[Item] = [
    (
        "How do I reverse a string in Python?",
        "Use slicing with a step of -1:\n\n"
        '```python\ntext = "hello"\nreversed_text = text[::-1]\nprint(reversed_text)  # olleh\n```',
        [
            (
                "Does that work for lists too?",
                "Yes. my_list[::-1] returns a new reversed list. To reverse a list in place, call my_list.reverse().",
            )
        ],
    ),
    (
        "What is a list comprehension in Python?",
        "A list comprehension builds a new list from an iterable in one expression. For "
        "example, the squares of the even numbers below 10:\n\n"
        "```python\nsquares = [n * n for n in range(10) if n % 2 == 0]\n"
        "print(squares)  # [0, 4, 16, 36, 64]\n```\n\n"
        "It is shorter than a for loop that appends to a list, and usually a bit faster.",
        [],
    ),
    (
        "How do I read a file line by line in Python?",
        "Open the file in a with block and loop over it; the file is closed automatically "
        "at the end:\n\n"
        '```python\nwith open("notes.txt", encoding="utf-8") as f:\n'
        '    for line in f:\n        print(line.rstrip("\\n"))\n```',
        [],
    ),
    (
        "Write a Python function that returns the factorial of n.",
        "Here is an iterative version:\n\n"
        "```python\ndef factorial(n: int) -> int:\n    if n < 0:\n"
        '        raise ValueError("n must be non-negative")\n    result = 1\n'
        "    for k in range(2, n + 1):\n        result *= k\n    return result\n```\n\n"
        "For example, factorial(5) returns 120.",
        [
            (
                "Can you write it recursively?",
                "```python\ndef factorial(n: int) -> int:\n    if n < 0:\n"
                '        raise ValueError("n must be non-negative")\n'
                "    return 1 if n < 2 else n * factorial(n - 1)\n```\n\n"
                "The recursive version is elegant, but Python limits recursion depth to about "
                "1000 calls, so the loop is safer for large n.",
            )
        ],
    ),
    (
        "What is the difference between a list and a tuple in Python?",
        "A list is mutable: you can add, remove and change items. A tuple is immutable: "
        "once created it cannot change. Tuples can be used as dictionary keys and are "
        "a good fit for fixed records such as a point (x, y).",
        [],
    ),
    (
        "How do I get a value from a dictionary without a KeyError?",
        "Use the get method, which returns None or a default you choose when the key is "
        "missing:\n\n"
        '```python\nages = {"ann": 31}\nprint(ages.get("bob"))      # None\n'
        'print(ages.get("bob", 0))   # 0\n```',
        [],
    ),
    (
        "Explain binary search.",
        "Binary search finds a value in a sorted list by repeatedly halving the search "
        "range. Compare the target with the middle item; if the target is smaller, keep "
        "the left half, otherwise keep the right half. It needs about log2(n) steps.\n\n"
        "```python\ndef binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n"
        "    while lo <= hi:\n        mid = (lo + hi) // 2\n"
        "        if items[mid] == target:\n            return mid\n"
        "        if items[mid] < target:\n            lo = mid + 1\n        else:\n"
        "            hi = mid - 1\n    return -1\n```",
        [
            (
                "What is its time complexity?",
                "O(log n), because each step halves the number of remaining items. A list "
                "of one million items needs at most about 20 comparisons.",
            )
        ],
    ),
    (
        "How do I undo the last git commit but keep my changes?",
        "Run git reset --soft HEAD~1. It moves the branch back one commit and leaves "
        "your changes staged, so you can edit them and commit again. Avoid this on "
        "commits you have already pushed to a shared branch.",
        [],
    ),
    (
        "What does SELECT * FROM users WHERE age > 30 do?",
        "It is an SQL query that returns every column of every row in the users table whose age is greater than 30.",
        [
            (
                "How do I sort the result by name?",
                "Add an ORDER BY clause: SELECT * FROM users WHERE age > 30 ORDER BY name; "
                "add DESC after name for reverse order.",
            )
        ],
    ),
    (
        "How do I remove duplicates from a list in Python while keeping the order?",
        "Use dict.fromkeys, because dictionaries keep insertion order:\n\n"
        "```python\nitems = [3, 1, 3, 2, 1]\nunique = list(dict.fromkeys(items))\n"
        "print(unique)  # [3, 1, 2]\n```",
        [],
    ),
    (
        "What is a variable?",
        "A variable is a name that refers to a value stored in memory. In Python, x = 5 "
        "makes the name x refer to the integer 5; later you can use x in expressions or "
        "make it refer to something else.",
        [],
    ),
    (
        "How do I write a for loop in JavaScript?",
        "```javascript\nfor (let i = 0; i < 5; i++) {\n  console.log(i);\n}\n```\n\n"
        "To loop over the items of an array, use for (const item of items) { ... }.",
        [],
    ),
    (
        "What is recursion?",
        "Recursion is when a function calls itself to solve a smaller version of the same "
        "problem. Every recursive function needs a base case that stops the calls, for "
        "example returning 1 when computing the factorial of 0 or 1.",
        [],
    ),
    (
        "How do I check if a number is prime in Python?",
        "Check divisors up to the square root of the number:\n\n"
        "```python\ndef is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n"
        "    d = 2\n    while d * d <= n:\n        if n % d == 0:\n            return False\n"
        "        d += 1\n    return True\n```\n\n"
        "For example, is_prime(29) is True and is_prime(21) is False.",
        [],
    ),
    (
        "What is the difference between == and is in Python?",
        "== compares values: are the two objects equal? is compares identity: are they "
        "the very same object in memory? Use is mainly to compare with None, as in "
        "if x is None.",
        [],
    ),
    (
        "How do I sort a list of dictionaries by a key in Python?",
        "Pass a key function to sorted:\n\n"
        '```python\npeople = [{"name": "Ann", "age": 31}, {"name": "Bob", "age": 25}]\n'
        'by_age = sorted(people, key=lambda p: p["age"])\n```\n\n'
        "Add reverse=True to sort from oldest to youngest.",
        [],
    ),
    (
        "What is an API?",
        "An API, or application programming interface, is a defined way for one program "
        "to ask another for data or actions. For example, a weather service offers an "
        "API that your app can call with a city name to get the forecast.",
        [],
    ),
    (
        "How do I count words in a string in Python?",
        "Split on whitespace and count the parts; for counts per word, use "
        "collections.Counter:\n\n"
        '```python\nfrom collections import Counter\n\ntext = "the cat and the hat"\n'
        "print(len(text.split()))          # 5\n"
        "print(Counter(text.split()))      # Counter({'the': 2, 'cat': 1, 'and': 1, 'hat': 1})\n```",
        [],
    ),
    (
        "What does a hash table do?",
        "A hash table stores key and value pairs. It runs the key through a hash function "
        "to pick a slot in an array, so looking up, inserting or deleting a key takes "
        "constant time on average. Python dictionaries are hash tables.",
        [],
    ),
    (
        "How do I handle an exception in Python?",
        "Wrap the risky code in try and catch the specific exception you expect:\n\n"
        "```python\ntry:\n    value = int(user_input)\nexcept ValueError:\n"
        '    print("Please enter a whole number.")\n```\n\n'
        "Catch only exceptions you can handle; let the others propagate.",
        [],
    ),
    (
        "What is Big O notation?",
        "Big O notation describes how the running time or memory of an algorithm grows "
        "with the input size n, ignoring constant factors. O(1) is constant, O(n) grows "
        "linearly, and O(n^2) grows with the square of n.",
        [],
    ),
    (
        "How do I create a virtual environment in Python?",
        "Run python -m venv .venv in your project folder. Activate it with "
        "source .venv/bin/activate on Linux or macOS, or .venv\\Scripts\\activate on "
        "Windows, then install packages with pip as usual.",
        [],
    ),
    (
        "Write a function that checks whether a word is a palindrome.",
        "```python\ndef is_palindrome(word: str) -> bool:\n"
        "    cleaned = word.lower()\n    return cleaned == cleaned[::-1]\n```\n\n"
        'is_palindrome("Level") returns True and is_palindrome("hello") returns False.',
        [],
    ),
    (
        "What is the difference between a process and a thread?",
        "A process is a running program with its own memory. A thread is a unit of "
        "execution inside a process; threads of the same process share its memory, so "
        "they can communicate cheaply but must be careful when changing shared data.",
        [],
    ),
    (
        "How do I join a list of strings with commas in Python?",
        'Call join on the separator: ", ".join(["a", "b", "c"]) returns '
        '"a, b, c". All items must be strings, so convert numbers first, for example '
        '", ".join(str(n) for n in numbers).',
        [],
    ),
    (
        "Write a Python function that returns the n-th Fibonacci number.",
        "```python\ndef fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a\n```\n\n"
        "fibonacci(10) returns 55. The loop runs in O(n) time and constant memory.",
        [],
    ),
    (
        "What is a unit test?",
        "A unit test is a small automated test that checks one piece of code, such as a "
        "single function, in isolation. For example, a test could assert that "
        "add(2, 3) == 5. Running many unit tests after each change catches bugs early.",
        [],
    ),
    (
        "How do I find the largest number in a list without using max?",
        "```python\ndef largest(numbers):\n    best = numbers[0]\n    for n in numbers[1:]:\n"
        "        if n > best:\n            best = n\n    return best\n```\n\n"
        "It assumes the list is not empty; check for that first if it might be.",
        [],
    ),
    (
        "What does the HTTP status code 404 mean?",
        "404 Not Found means the server could not find the requested page or resource. "
        "Codes in the 400 range are client errors; 500 range codes are server errors.",
        [],
    ),
]

CLOSERS: list[Exchange] = [
    ("Thanks!", "You are welcome!"),
    ("Great, that helps.", "Glad to hear it. Let me know if you have more questions."),
    ("Thank you, that was clear.", "You are welcome. Happy to help."),
    ("Perfect.", "Great!"),
    ("Got it, thanks.", "Any time."),
]

ANOTHER = ["Another question: ", "One more thing. ", "Next question. ", "Also, ", ""]


def _add(rng: random.Random) -> list[Exchange]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    c = rng.randint(2, 9)
    return [
        (f"What is {a} + {b}?", f"{a} + {b} = {a + b}."),
        (
            f"Now multiply that by {c}.",
            f"{a + b} * {c} = {(a + b) * c}.",
        ),
    ]


def _subtract(rng: random.Random) -> list[Exchange]:
    a = rng.randint(100, 5000)
    b = rng.randint(1, a)
    return [
        (
            f"Compute {a} - {b}.",
            f"{a} - {b} = {a - b}.",
        ),
        (
            "Can you check it?",
            f"Adding back: {a - b} + {b} = {a}, which matches, so {a - b} is correct.",
        ),
    ]


def _multiply(rng: random.Random) -> list[Exchange]:
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    tens, ones = b // 10 * 10, b % 10
    steps = (
        f"Split {b} into {tens} + {ones}. Then {a} * {tens} = {a * tens} and "
        f"{a} * {ones} = {a * ones}. Adding them: {a * tens} + {a * ones} = {a * b}."
    )
    return [
        (f"What is {a} times {b}? Show your steps.", f"{steps} So {a} * {b} = {a * b}."),
        (f"And {a} times {b + 1}?", f"That is one more {a}: {a * b} + {a} = {a * (b + 1)}."),
    ]


def _divide(rng: random.Random) -> list[Exchange]:
    b = rng.randint(3, 19)
    q = rng.randint(5, 120)
    r = rng.randint(0, b - 1)
    a = b * q + r
    answer = f"{a} divided by {b} is {q} with a remainder of {r}, because {b} * {q} = {b * q} and {a} - {b * q} = {r}."
    if r == 0:
        answer = f"{a} divided by {b} is exactly {q}, because {b} * {q} = {a}."
    return [
        (f"Divide {a} by {b}.", answer),
        ("As a decimal?", f"{a} / {b} = {a / b:.4f}, rounded to four decimal places."),
    ]


def _percent(rng: random.Random) -> list[Exchange]:
    p = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 75])
    price = rng.randint(8, 400)
    off = price * p / 100
    return [
        (
            f"A jacket costs ${price} and is {p}% off. What is the sale price?",
            f"{p}% of {price} is {price} * {p} / 100 = {off:g}. The sale price is "
            f"{price} - {off:g} = ${price - off:g}.",
        ),
        (
            "And if there is 8% sales tax on the sale price?",
            f"The tax is {price - off:g} * 0.08 = {(price - off) * 0.08:.2f}, so you pay "
            f"{(price - off) * 1.08:.2f} dollars in total.",
        ),
    ]


def _word_problem(rng: random.Random) -> list[Exchange]:
    per_box = rng.randint(4, 24)
    boxes = rng.randint(3, 30)
    eaten = rng.randint(1, per_box * boxes - 1)
    left = per_box * boxes - eaten
    friends = rng.randint(2, 6)
    return [
        (
            f"A baker packs {per_box} cookies in each box and fills {boxes} boxes. "
            f"Then {eaten} cookies are sold. How many cookies are left?",
            f"First the total: {per_box} * {boxes} = {per_box * boxes} cookies. After "
            f"selling {eaten}, {per_box * boxes} - {eaten} = {left} cookies are left.",
        ),
        (
            f"If the rest is shared equally among {friends} friends, how many does each get?",
            f"{left} divided by {friends} is {left // friends} with {left % friends} "
            f"left over, so each friend gets {left // friends} cookies.",
        ),
    ]


def _average(rng: random.Random) -> list[Exchange]:
    scores = [rng.randint(50, 100) for _ in range(rng.randint(3, 6))]
    total = sum(scores)
    listed = ", ".join(str(s) for s in scores)
    return [
        (
            f"What is the average of {listed}?",
            f"Add them: {' + '.join(str(s) for s in scores)} = {total}. There are "
            f"{len(scores)} numbers, so the average is {total} / {len(scores)} = "
            f"{total / len(scores):.2f}.",
        ),
        (
            "What is the largest and the smallest?",
            f"The largest is {max(scores)} and the smallest is {min(scores)}, so the "
            f"range is {max(scores) - min(scores)}.",
        ),
    ]


ARITHMETIC = [_add, _subtract, _multiply, _divide, _percent, _word_problem, _average]


class _Pool:
    """Deals items in a reshuffled cycle so every item is used before any repeats."""

    def __init__(self, items: list[Item], rng: random.Random) -> None:
        self._items = items
        self._rng = rng
        self._queue: list[Item] = []

    def draw(self) -> Item:
        if not self._queue:
            self._queue = list(self._items)
            self._rng.shuffle(self._queue)
        return self._queue.pop()


def _arithmetic_item(rng: random.Random) -> Item:
    first, *rest = rng.choice(ARITHMETIC)(rng)
    return first[0], first[1], rest


def build_conversations(seed: int = SEED, n: int = N_CONVERSATIONS) -> list[list[dict[str, str]]]:
    """Build the demo conversations as OpenAI-style message lists.

    Args:
        seed: Seed of the random generator that picks topics, lengths and numbers.
        n: Number of conversations.

    Returns:
        ``n`` conversations; each is a list of ``{"role", "content"}`` dicts with
        1-4 user/assistant exchanges and sometimes a leading system message.
    """
    rng = random.Random(seed)
    pools = {
        "everyday": _Pool(EVERYDAY, rng),
        "science": _Pool(SCIENCE, rng),
        "programming": _Pool(PROGRAMMING, rng),
        "greeting": _Pool(GREETINGS, rng),
    }
    topics = ["everyday", "science", "programming", "arithmetic", "greeting"]
    weights = [3, 3, 3, 3, 1]

    def draw(topic: str) -> Item:
        return _arithmetic_item(rng) if topic == "arithmetic" else pools[topic].draw()

    conversations = []
    for _ in range(n):
        topic = rng.choices(topics, weights)[0]
        n_exchanges = rng.choices([1, 2, 3, 4], [4, 3, 3, 2])[0]
        messages: list[dict[str, str]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        question, answer, follow_ups = draw(topic)
        exchanges = [(question, answer), *follow_ups]
        while len(exchanges) < n_exchanges:
            if rng.random() < 0.25:
                exchanges.append(rng.choice(CLOSERS))
                continue
            question, answer, follow_ups = draw(rng.choices(topics, weights)[0])
            exchanges += [(rng.choice(ANOTHER) + question, answer), *follow_ups]
        for question, answer in exchanges[:n_exchanges]:
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        conversations.append(messages)
    return conversations


_SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def write_files(out_dir: str | Path) -> None:
    """Write ``chat_sharegpt.jsonl`` and ``chat_openai.jsonl`` (same conversations) into ``out_dir``.

    Args:
        out_dir: Destination directory, created if missing.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conversations = build_conversations()
    with open(out / "chat_openai.jsonl", "w", encoding="ascii", newline="\n") as f:
        for i, messages in enumerate(conversations):
            f.write(json.dumps({"id": f"demo-{i:04d}", "messages": messages}) + "\n")
    with open(out / "chat_sharegpt.jsonl", "w", encoding="ascii", newline="\n") as f:
        for i, messages in enumerate(conversations):
            turns = [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]
            f.write(json.dumps({"id": f"demo-{i:04d}", "conversations": turns}) + "\n")


def main() -> None:
    """Regenerate the bundled files in ``data/`` next to this module."""
    write_files(Path(__file__).resolve().parent / "data")


if __name__ == "__main__":
    main()
