"""Writes the prompt sets (code.jsonl, math.jsonl, chat.jsonl) beside this file.

All prompts are written by this project (no data set is copied). TRAIN prompts are templated
combinations of the lists below; EVAL prompts are hand-written separately, on subjects that no
train prompt uses, so the benchmark measures a drafter on prompts it never saw; GATE prompts are
more of those, held out for the acceptance gate's later looks.

Run ``python -m dflash_trt.prompts.build`` after editing; the jsonl files are committed.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import click

HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------
# code
# ---------------------------------------------------------------------------------------------
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the factorial of n",
    "computes the n-th Fibonacci number", "counts the vowels in a string", "removes duplicates from a list",
    "finds the largest element in a list", "sorts a list of integers with bubble sort",
    "checks whether a string is a palindrome", "merges two sorted lists",
    "converts Celsius to Fahrenheit", "returns the sum of the digits of an integer",
    "flattens a nested list", "counts how often each word appears in a sentence",
    "returns the greatest common divisor of two numbers", "checks whether a year is a leap year",
    "finds the second smallest number in a list", "capitalizes the first letter of every word",
    "computes the average of a list of numbers", "returns all even numbers from a list",
    "implements binary search on a sorted list", "transposes a matrix given as a list of lists",
    "checks whether two strings are anagrams", "converts a decimal number to binary",
    "returns the length of the longest word in a sentence", "rotates a list by k positions",
    "computes the dot product of two vectors", "counts the lines in a text file",
    "returns the intersection of two lists", "splits a list into chunks of size n",
    "checks whether parentheses in a string are balanced", "returns the median of a list",
    "computes the power set of a small list", "converts a Roman numeral to an integer",
    "validates a simple email address", "finds the most common element in a list",
    "reads a CSV file and returns its rows", "computes compound interest",
    "generates the first n prime numbers", "implements a stack class with push and pop",
]
CODE_TEMPLATES = [
    "Write a Python function that {t}.",
    "Write a short Python function that {t}, and explain it briefly.",
    "Show me Python code that {t}.",
    "Implement a function in Python that {t}. Include a docstring.",
    "How would I write a JavaScript function that {t}?",
]

# Second wave of train prompts (appended after the first so existing ids, and the responses
# generated for them, stay valid): more subjects, still none of the eval subjects.
CODE_TASKS_2 = [
    "returns the minimum value in a dictionary", "counts the words in a sentence",
    "reverses the words in a sentence", "computes the area of a circle from its radius",
    "returns the square of every number in a list", "filters out negative numbers from a list",
    "returns the first n characters of a string", "joins a list of integers into a comma-separated string",
    "finds the index of an element in a list", "counts the occurrences of a character in a string",
    "checks whether a list contains duplicates", "merges two dictionaries",
    "returns the keys of a dictionary sorted alphabetically", "generates a random password of a given length",
    "converts minutes to hours and minutes", "returns the n largest numbers in a list",
    "replaces every space in a string with an underscore", "computes the hypotenuse of a right triangle",
    "returns the number of days between two dates", "removes the punctuation from a string",
    "finds the longest common prefix of a list of strings", "computes the sum of all odd numbers up to n",
    "implements insertion sort", "implements selection sort",
    "implements a linked list with append and print methods", "counts the number of set bits in an integer",
    "checks whether a matrix is symmetric", "converts a hexadecimal string to an integer",
    "returns the unique characters of a string in order", "groups a list of words by their first letter",
    "computes the mean and standard deviation of a list", "checks whether a number is an Armstrong number",
    "returns the prime factors of an integer", "implements a simple calculator for two numbers and an operator",
    "writes a list of strings to a text file, one per line", "parses a date string in the format YYYY-MM-DD",
    "computes the n-th triangular number", "checks whether all elements of a list are equal",
    "interleaves two lists", "shuffles a list randomly", "computes the distance between two points in 2D",
    "returns the middle element of a list", "counts the words longer than five letters in a text",
    "computes the body mass index from weight and height", "returns the Collatz sequence starting at n",
    "zips two lists into a dictionary", "returns every second element of a list",
    "computes the factorial of n recursively", "finds all pairs in a list that add up to a target",
    "implements a counter class with increment and reset", "converts Fahrenheit to Kelvin",
    "returns the list of divisors of n", "removes all vowels from a string",
    "checks whether a sentence is a pangram", "computes simple interest", "returns the longest string in a list",
    "converts a list of tuples into a dictionary", "returns the sum of the squares of a list",
    "checks whether a number is a power of two", "encrypts a string with a Caesar cipher",
    "counts the even and odd numbers in a list", "prints a multiplication table for n",
    "finds the missing number in a list containing 1 to n", "merges overlapping intervals",
    "checks whether a binary tree is balanced", "returns the mode of a list of numbers",
]

CODE_EVAL = [
    "Write a Python function that returns the number of uppercase letters in a string.",
    "Write a Python function that checks whether a list is sorted in ascending order.",
    "Write a Python function that computes the least common multiple of two integers.",
    "Write a Python function that swaps the keys and values of a dictionary.",
    "Write a Python function that returns the product of all numbers in a list.",
    "Write a Python function that removes all whitespace from a string.",
    "Write a Python class for a queue with enqueue and dequeue methods.",
    "Write a Python function that converts a list of strings to uppercase.",
    "Write a Python function that returns the cumulative sum of a list.",
    "Write a JavaScript function that returns the maximum of three numbers.",
    "Write a Python function that counts the digits in a string.",
    "Write a Python function that checks whether a number is a perfect square.",
    "Write a Python function that returns the last n elements of a list.",
]

# ---------------------------------------------------------------------------------------------
# math
# ---------------------------------------------------------------------------------------------
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Leo"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "cards"]
MATH_TEMPLATES = [
    "{n} has {a} {i}. {n} buys {b} more {i}. How many {i} does {n} have now? Explain step by step.",
    "{n} has {a} {i} and gives {b} of them to a friend. How many {i} are left? Show your work.",
    "A box holds {a} {i}. How many {i} are in {b} boxes? Solve step by step.",
    "{n} shares {c} {i} equally among {d} friends. How many {i} does each friend get?",
    "What is {a} times {b}? Show the calculation.",
    "What is {a} plus {b} minus {d}? Explain each step.",
    "A rectangle is {a} cm long and {b} cm wide. What is its area and its perimeter?",
    "A train travels at {a} km per hour for {d} hours. How far does it go?",
    "Solve for x: {d}x + {a} = {e}. Show each step.",
    "What is {p} percent of {c}? Explain how you computed it.",
    "{n} reads {a} pages a day. How many pages does {n} read in {d} weeks?",
    "A shirt costs {a} dollars and is on sale for {p} percent off. What is the sale price?",
]
MATH_TEMPLATES_2 = [
    "{n} saves {a} dollars every week. How much money does {n} save in {d} weeks? Explain step by step.",
    "A class has {a} students and {b} of them are absent. How many students are present?",
    "What is {c} divided by {d}? Show the calculation.",
    "A garden is {a} meters long and {b} meters wide. How much fence is needed to go around it?",
    "{n} runs {d} km every day. How many km does {n} run in {a} days?",
    "A bus has {a} passengers. At the next stop {b} get on and {d} get off. How many are on the bus now?",
    "What is {a} squared? Explain how you computed it.",
    "A store sells {i} at {d} dollars each. How much do {a} {i} cost? Show your work.",
    "{n} is {a} years old. How old will {n} be in {b} years?",
    "What is the sum of {a}, {b} and {e}? Show your work.",
    "A tank holds {e} liters of water and {a} liters are used. How many liters are left? Explain step by step.",
    "{n} has {c} {i} and puts them into bags of {d}. How many bags are filled?",
    "A worker earns {a} dollars per hour. How much does the worker earn in {d} hours?",
    "Convert {e} centimeters to meters. Explain the steps.",
    "What is {a} minus {b}, times {d}? Show the calculation.",
    "A cube has sides of {b} cm. What is its volume? Explain step by step.",
    "{n} scored {a}, {b} and {e} points in three games. What is the total score?",
    "A pack has {d} {i}. How many packs are needed for {c} {i}?",
]

MATH_EVAL = [
    "A farmer has 48 cows and sells 15 of them. Then he buys 9 more. How many cows does he have? Explain step by step.",
    "What is the perimeter of a square with side length 13 meters?",
    "A bakery makes 36 muffins per hour. How many muffins does it make in 7 hours? Show your work.",
    "Solve for y: 5y - 12 = 38. Show each step.",
    "A bike costs 240 dollars. The price drops by 25 percent. What is the new price?",
    "What is the average of 14, 22, 30 and 38? Explain how you computed it.",
    "A car uses 6 liters of fuel per 100 km. How much fuel does it need for 350 km?",
    "If a pizza is cut into 8 slices and 3 people each eat 2 slices, how many slices are left?",
    "What is 125 divided by 5, plus 17? Show the calculation.",
    "A swimming pool is 25 meters long. How many lengths does a swimmer need to swim 1.5 km?",
    "The sum of two consecutive integers is 57. What are the integers? Explain step by step.",
    "A recipe needs 3 eggs for 12 pancakes. How many eggs are needed for 36 pancakes?",
    "What is the area of a triangle with base 10 cm and height 7 cm?",
]

# ---------------------------------------------------------------------------------------------
# chat / instructions
# ---------------------------------------------------------------------------------------------
CHAT_TOPICS = [
    "photosynthesis", "the water cycle", "how vaccines work", "the causes of the seasons",
    "why the sky is blue", "how a rainbow forms", "what gravity is", "how the internet works",
    "what a black hole is", "how bees make honey", "the history of the printing press",
    "how a bicycle stays upright", "what inflation is", "how volcanoes erupt", "the life cycle of a butterfly",
    "how the heart pumps blood", "what machine learning is", "why we need sleep", "how tides work",
    "what a democracy is", "how plants grow from seeds", "what renewable energy is",
    "how a refrigerator keeps food cold", "what DNA is", "how clouds form",
]
CHAT_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Can you explain {t} to a ten-year-old?",
    "Give me three key facts about {t}.",
    "Write a short paragraph about {t}.",
    "What should a beginner know about {t}?",
]
CHAT_TASKS = [
    "Give me five tips for staying focused while studying.", "Suggest a healthy breakfast for a busy morning.",
    "Write a polite email asking a colleague for a meeting next week.", "List some ways to save money on groceries.",
    "How can I improve my sleep habits?", "Write a haiku about the ocean.", "Give me ideas for a rainy weekend.",
    "How do I start learning to play the guitar?", "Write a short thank-you note to a teacher.",
    "What are some good habits for staying healthy?", "Suggest a name for a small coffee shop.",
    "Write a short story about a lost cat that finds its way home.", "How can I be more productive at work?",
    "Give me tips for a job interview.", "What are the benefits of reading every day?",
    "Write a limerick about a forgetful robot.", "How do I make a simple tomato pasta sauce?",
    "Give me a packing list for a weekend camping trip.", "How can I reduce stress before an exam?",
    "Write a short poem about autumn leaves.", "What are some fun activities for a family picnic?",
    "How do I take care of a houseplant?", "Give me advice for running my first 5 km race.",
    "Write a friendly message inviting neighbours to a barbecue.", "How can I learn a new language faster?",
]
CHAT_TOPICS_2 = [
    "how a rocket reaches space", "what electricity is", "how the human eye sees", "how a car engine works",
    "how fish breathe underwater", "what the ozone layer is", "how sound travels", "how coffee is made",
    "what recycling is", "how batteries store energy", "what the stock market is",
    "how the brain stores memories", "what a virus is", "how a microwave oven heats food",
    "what the Roman Empire was", "how bread rises", "what an atom is", "how glaciers form",
    "what the Olympic Games are", "how a solar panel works", "what climate change is", "how antibiotics work",
    "what a galaxy is", "how the immune system works", "what a budget is", "how paper is made",
    "how wind is created", "what a spreadsheet is", "how the stomach digests food", "what friction is",
    "how chocolate is made", "what the Renaissance was", "how a lighthouse works", "how elections work",
    "what a desert is", "how whales communicate", "what an ecosystem is", "how a thermometer works",
    "what a language model is", "how muscles grow", "how coral reefs form", "how a clock keeps time",
    "what the speed of light is", "how dinosaurs became extinct", "how a submarine dives",
]
CHAT_TASKS_2 = [
    "Give me five tips for keeping a tidy desk.", "Suggest a simple dinner I can cook in twenty minutes.",
    "Write a polite email asking for a deadline extension.", "List some ways to save energy at home.",
    "How can I make new friends in a new city?", "Write a haiku about a summer storm.",
    "Give me ideas for a quiet evening at home.", "How do I start learning to draw?",
    "Write a short thank-you note to a neighbour who helped me move.", "What are some good habits for managing money?",
    "Suggest a name for a bakery.", "Write a short story about a robot who learns to paint.",
    "How can I stay motivated to exercise?", "Give me tips for giving a good presentation.",
    "What are the benefits of drinking water?", "Write a limerick about a sleepy cat.",
    "How do I make a simple vegetable soup?", "Give me a packing list for a beach holiday.",
    "How can I manage my time better?", "Write a short poem about the city at night.",
    "What are some fun games to play with friends?", "How do I clean a cast iron pan?",
    "Give me advice for my first day at a new job.", "Write a friendly message welcoming a new team member.",
    "How can I improve my handwriting?", "Suggest three books for someone who likes adventure stories.",
    "How do I write a good resume?", "Give me tips for studying math.",
    "Write a short speech for a friend's wedding.", "How can I drink less coffee?",
    "What are some ways to be kind to others?", "Write a short story about a boy who finds a secret door.",
    "How do I train a puppy to sit?", "Give me ideas for a school science project.",
    "Write a product description for a reusable water bottle.", "Suggest a weekly workout plan for a beginner.",
    "Write a short review of a pizza restaurant.", "How do I plan a road trip?",
    "Give me tips for writing a short essay.", "Write a motivational message for a friend before an exam.",
    "What are some easy ways to reduce plastic waste?", "How do I make pancakes from scratch?",
    "Write a short poem about friendship.", "Give me advice on saving for a holiday.",
    "How can I become a better listener?", "Write a short fable about a fox and a crow.",
    "How do I organise my email inbox?", "Write the opening of a cover letter for a teaching job.",
    "How do I keep my bike in good condition?", "Suggest a playlist theme for a long drive.",
    "Write a short story about a lighthouse keeper.", "How can I stop procrastinating?",
    "Give me tips for a first-time home cook.", "Write a riddle and its answer.",
    "What are good questions to ask at the end of an interview?", "How do I make a paper airplane?",
    "Write a short letter to my future self.", "Give me tips for learning to swim as an adult.",
    "Describe a perfect Sunday morning.", "How can I keep a conversation going?",
    "Write a short mystery story set in a library.", "Suggest healthy snacks for work.",
    "How do I calm down when I feel angry?", "Write a tweet announcing a new bookshop opening.",
    "Give me tips for keeping a journal.", "What are some ways to celebrate a small win?",
    "How do I care for a goldfish?",
]

CHAT_EVAL = [
    "Explain how a compass works in simple terms.",
    "Give me three key facts about the Moon.",
    "Write a short paragraph about the importance of trees.",
    "Suggest five ways to make a small apartment feel bigger.",
    "Write a haiku about winter mornings.",
    "How do I prepare for a long flight?",
    "Write a short apology email for missing a meeting.",
    "What are some tips for taking better photos with a phone?",
    "Explain what an earthquake is to a child.",
    "Give me ideas for a birthday party for an eight-year-old.",
    "How can I keep my computer secure?",
    "Write a short story about a dragon who is afraid of the dark.",
    "What should a beginner know about gardening?",
]


# ---------------------------------------------------------------------------------------------
# gate: more held-out prompts, for the acceptance gate's later looks (engine/gate_looks.py)
# ---------------------------------------------------------------------------------------------
# Hand-written like the eval prompts, on subjects no train or eval prompt uses (checked against
# both by shared rare words when written; build() asserts no prompt occurs twice). Their own split,
# so the benchmark's eval set stays the 39 it was; the gate decodes eval first, then these.
CODE_GATE = [
    'Write a Python function that checks whether a string is a valid ISBN-10 number.',
    'Write a Python function that wraps a sentence into lines of at most 40 characters without breaking words.',
    'Write a Python function that computes the edit distance between two words.',
    'Write a Python function that turns a title like Hello World Again into a URL slug.',
    'Write a Python function that returns the longest strictly increasing run in a list of numbers.',
    'Write a Python class for a parking lot that tracks free and taken spaces.',
    'Write a Python function that checks whether a 3x3 grid of numbers is a magic square.',
    'Write a Python function that counts the ways to climb n stairs taking one or two steps at a time.',
    'Write a Python function that checks a credit card number with the Luhn algorithm.',
    'Write a Python function that spells out a whole number below one hundred in English words.',
    'Write a Python function that returns the positions of the local peaks of a list, the values larger than both neighbours.',
    'Write a Python function that returns the elements of a square matrix in spiral order.',
    'Write a Python function that flood-fills a region of a grid starting from one cell.',
    'Write a Python function that returns the weekday name of a date given as day, month and year.',
    'Write a Python generator that yields the lines of a log file that contain the word ERROR.',
    'Write a Python function that finds the two numbers in a list whose product is the largest.',
    'Write a Python function that computes the Jaccard similarity of two sets.',
    'Write a Python class for a to-do list with add, complete and show methods.',
    'Write a Python function that returns the elements that occur exactly once in a list.',
    'Write a Python function that returns an order in which tasks can run, given which tasks each one depends on.',
    'Write a Python function that finds the length of the shortest path through a maze given as a grid of walls and open cells.',
    'Write a Python function that computes the centroid of a list of 2D points.',
    'Write a Python decorator that prints how many seconds a function took.',
    'Write a Python function that scales a list of numbers so that they add up to one.',
    'Write a Python function that returns the three highest scores from a dictionary of players and scores.',
    'Write a SQL query that returns the ten most recent rows of an orders table.',
    'Write a JavaScript function that debounces another function by a given delay.',
    'Write a JavaScript function that makes a deep copy of a plain object.',
    'Write a bash script that counts the files in a folder by their extension.',
    'Write a Python function that parses a URL query string like a=1&b=2 into a dictionary.',
    'Write a Python function that tells whether a day, month and year form a real calendar date.',
    'Write a Python function that converts a weight in pounds and ounces into kilograms.',
    'Write a Python function that writes a positive integer in base 7.',
    'Write a Python function that estimates pi by throwing random points into a square.',
    'Write a Python function that checks whether a number is divisible by the sum of its digits.',
    'Write a Python function that says a clock time like 14:05 in words, like five past two.',
    'Write a Python class for a 2D vector with addition and length.',
    'Write a Python function that returns the longest run of the same character in a string.',
    'Write a Python function that converts a list of Celsius readings into a small text bar chart.',
]
MATH_GATE = [
    'A recipe uses 2/3 cup of sugar for one cake. How much sugar is needed for 4 cakes? Show your work.',
    'A bag has 5 red and 7 blue marbles. If you pick one at random, what is the chance it is red?',
    'The angles of a triangle are 48 degrees and 67 degrees. What is the third angle? Explain.',
    'A circle has a radius of 6 cm. What is its circumference? Use 3.14 for pi and show your steps.',
    'A map uses a scale of 1 cm to 4 km. Two towns are 7.5 cm apart on the map. How far apart are they?',
    'A phone battery loses 12 percent of its charge every hour. Starting full, how much is left after 3 hours?',
    'A hiker climbs 350 meters in the first hour and 280 meters in the second. What is the average climb per hour?',
    'What is the least common multiple of 12 and 18? Show how you found it.',
    'Write 0.375 as a fraction in lowest terms. Explain each step.',
    'A tree is 3 meters tall and grows 45 cm a year. How tall will it be in 6 years?',
    'Two angles are supplementary and one is 38 degrees larger than the other. Find both angles.',
    'A loan of 2000 dollars has 5 percent simple interest per year. How much interest is paid in 3 years?',
    'A clock shows 3:00. What is the angle between the hour hand and the minute hand?',
    'A cylinder has a radius of 3 cm and a height of 10 cm. What is its volume? Use 3.14 for pi.',
    'The ratio of cats to dogs at a shelter is 3 to 5. There are 40 animals. How many are cats?',
    'A runner finishes 5 km in 27 minutes. What is the average pace per kilometer?',
    'What is the median of 7, 3, 9, 4, 12 and 6? Explain how you found it.',
    'A flight leaves at 22:40 and lands 5 hours and 35 minutes later. At what time does it land?',
    'A quiz has 20 questions. Each right answer gives 4 points and each wrong one loses 1. Mia answers all and gets 55 points. How many did she get right?',
    'What is 3/4 plus 5/6? Give the answer as a fraction and explain.',
    'A square garden has an area of 144 square meters. How long is one side, and what is the perimeter?',
    'A bike wheel has a diameter of 70 cm. How far does the bike move in 100 turns of the wheel?',
    'Prices rose by 10 percent one year and fell by 10 percent the next. Are they back where they started? Explain.',
    'A pool fills at 15 liters per minute. How long does it take to fill 2700 liters, in hours and minutes?',
    'What is the greatest common factor of 84 and 126? Show each step.',
    'A shop mixes 3 kg of nuts at 8 dollars per kg with 2 kg at 13 dollars per kg. What is the price per kg of the mix?',
    'Round 4.5678 to two decimal places and to the nearest whole number.',
    'A right triangle has legs of 9 cm and 12 cm. How long is the hypotenuse? Explain.',
    'The temperature was -6 degrees at night and 11 degrees at noon. By how much did it rise?',
    'A die is rolled twice. What is the probability that both rolls show a six?',
    "A car's value drops by 2400 dollars a year. It cost 18000 dollars. What is it worth after 4 years?",
    'Order these from smallest to largest: 0.6, 5/8, 0.58, 3/5. Explain how you compared them.',
    'A school trip needs 130 seats and each coach has 48 seats. How many coaches are needed?',
    'What is 15 percent of 80, and what is 80 percent of 15? Compare the answers.',
    'A ladder 5 meters long leans on a wall with its foot 3 meters from the wall. How high up the wall does it reach?',
    'Three friends split a bill of 87 dollars and add a 15 percent tip. How much does each pay?',
    'Simplify the expression 3(2x - 4) + 5x. Show each step.',
    'A train leaves at 9:15 and travels 210 km at 84 km per hour. When does it arrive?',
    'What is the sum of the interior angles of a hexagon? Explain the rule you used.',
]
CHAT_GATE = [
    'Explain how a violin produces sound.',
    'Give me three key facts about octopuses.',
    'Write a short paragraph about the history of chess.',
    'Suggest five ways to make a long commute more enjoyable.',
    'Write a haiku about a foggy harbour.',
    'How do I prepare for my first marathon swim in open water?',
    'Write a short email asking a school to excuse a child from sports day.',
    'What are some tips for shooting a good video on a tablet?',
    'Explain what a tornado is to a child.',
    'Give me ideas for a farewell gift for a colleague who is retiring.',
    'How can I protect my online accounts from phishing?',
    'Write a short story about a turtle who becomes a postman.',
    'What should a beginner know about beekeeping?',
    'Explain how noise travels through walls and how to reduce it.',
    'Give me three key facts about the Sahara.',
    'Write a short paragraph about why libraries lend tools as well as books.',
    'Suggest five houseplants that are hard to kill.',
    'Write a haiku about a heron standing in a river.',
    'How do I get ready for a job that starts very early in the morning?',
    'Write a short note congratulating a colleague on a promotion.',
    'What are some tips for reading faster without losing understanding?',
    'Explain what a sandstorm is to someone who has never seen one.',
    'Give me ideas for a weekend trip with a dog.',
    'How can I make my old laptop run faster?',
    'Write a short story about a painter who can only paint the colour blue.',
    'What should a beginner know about rock climbing?',
    'Explain how a suspension bridge carries a load.',
    'Give me three key facts about Antarctica.',
    'Write a short paragraph about the first people to reach the top of Mount Everest.',
    'Suggest five ways to use leftover rice.',
    'Write a haiku about an empty playground.',
    'How do I choose a good pair of hiking boots?',
    'Write a short message to a landlord saying I will move out at the end of the month.',
    'What are some tips for staying warm at an outdoor football match in December?',
    'Explain what a heat wave is and how to stay safe in one.',
    'Give me ideas for a neighbourhood clean-up day.',
    'How can I teach my grandparents to use video calls?',
    'Write a short story about a cloud that is afraid of heights.',
    'What should a beginner know about birdwatching?',
]


# Third wave (appended again; ids of the first two stay valid): new phrasings of the train
# subjects above, and more math from a third random stream. Still none of the eval subjects.
CODE_TEMPLATES_3 = [
    "Write a Python function that {t}, and add a few test cases.",
    "Write a Python function that {t}. Use type hints.",
    "Give me a simple Python example of a function that {t}.",
]
CHAT_TEMPLATES_3 = [
    "Describe {t} in a few sentences.",
    "I am curious about {t}. Can you help me understand it?",
    "Summarize {t} in three bullet points.",
]


# Fourth wave (appended again; earlier ids stay valid): NEW subjects, for breadth, since a drafter
# scores ~0.25 tokens/step better on train prompts than on held-out ones. Still none of the eval
# subjects (the assert in build() checks exact prompts; the lists below were checked by hand).
CODE_TASKS_4 = [
    "returns the nth row of Pascal's triangle", "checks whether a string contains only digits",
    "counts the islands in a grid of 0s and 1s", "converts a string to title case without using title()",
    "returns the running maximum of a list", "finds the first non-repeating character in a string",
    "computes the Levenshtein distance between two strings", "returns the k most frequent words in a text",
    "checks whether a number is a happy number", "formats a number with thousands separators",
    "implements a min-heap with push and pop", "reverses a linked list",
    "finds the maximum subarray sum", "checks whether a Sudoku row is valid",
    "converts snake_case to camelCase", "returns the depth of a nested dictionary",
    "computes the area of a polygon from its vertices", "counts the characters in a file",
    "implements a simple LRU cache", "removes the None values from a list",
    "rounds every number in a list to two decimals", "finds the longest increasing subsequence",
    "returns the sum of a matrix's diagonal", "checks whether a string is a valid IPv4 address",
    "implements run-length encoding of a string", "decodes a run-length encoded string",
    "finds the duplicate number in a list", "computes the nth Catalan number",
    "returns the words of a sentence sorted by length", "checks whether two rectangles overlap",
    "generates all permutations of a string", "returns the binary representation of a number without bin()",
    "implements a queue using two stacks", "counts the paths in a grid from the top left to the bottom right",
    "converts a dictionary to a JSON string", "loads a JSON file and prints its keys",
    "computes the moving average of a list with window k", "finds the peak element of a list",
    "checks whether a graph given as an adjacency list has a cycle", "performs a breadth-first search on a graph",
    "performs a depth-first search on a graph", "computes the shortest path in an unweighted graph",
    "returns the number of vowels and consonants in a string", "validates a password against simple rules",
    "converts a time in 24-hour format to 12-hour format", "returns the day of the week for a date",
    "implements a class for a bank account with deposit and withdraw", "implements a class for a 2D point with a distance method",
    "implements a class for a rectangle with area and perimeter methods", "counts the frequency of each letter in a string",
    "splits a string into words without using split()", "finds the common elements of three lists",
    "returns the sum of all numbers in a nested list", "checks whether a list is a palindrome",
    "removes the adjacent duplicates from a string", "computes the square root of a number with Newton's method",
    "computes the integer logarithm base 2 of a number", "converts an integer to a Roman numeral",
    "returns the largest prime factor of a number", "finds the smallest missing positive integer in a list",
    "checks whether a string has all unique characters", "compresses a list of numbers into ranges",
    "pads a string to a fixed width", "returns the Hamming distance between two strings",
    "implements the sieve of Eratosthenes", "returns the n smallest numbers in a list",
    "builds a frequency table of dice rolls", "simulates flipping a coin n times",
    "generates a random list of integers", "normalises a list of numbers to the range 0 to 1",
    "counts the sentences in a paragraph", "extracts all the numbers from a string",
    "finds the longest palindromic substring", "checks whether one string is a rotation of another",
    "returns the angle between the hands of a clock", "computes the total price of a shopping cart given as a dictionary",
    "merges k sorted lists", "implements quicksort", "implements merge sort",
    "returns the leaves of a binary tree", "computes the height of a binary tree",
]
CHAT_TOPICS_4 = [
    "how a plane stays in the air", "what a calendar year is", "how honeybees communicate", "what a comet is",
    "how a camera takes a picture", "what a library is for", "how salt dissolves in water", "what a glacier is",
    "how recycling plastic works", "what the Great Wall of China is", "how a piano makes sound",
    "what a hurricane is", "how a credit card works", "what an allergy is", "how a wind turbine makes electricity",
    "how the lungs work", "what a fossil is", "how a map is made", "what a planet is", "how cheese is made",
    "what a vaccine trial is", "how a canal lock works", "what a mortgage is", "how a spider spins a web",
    "what an eclipse is", "how a bridge holds weight", "what a rainforest is", "how a satellite orbits the Earth",
    "what a password manager is", "how a heat pump works", "what a tsunami is", "how ice cream is made",
    "what the Industrial Revolution was", "how a 3D printer works", "what a carbon footprint is",
    "how birds migrate", "what a constitution is", "how soap removes dirt", "what a pandemic is",
    "how a search engine works", "what a marathon is", "how a kite flies", "what a sonnet is",
    "how a vaccine is stored", "what a nebula is", "how the kidneys work", "what a museum curator does",
    "how a steam engine works", "what an orchestra is", "how yeast works in baking", "what a coral is",
    "how a lock and key work", "what a savings account is", "how a traffic light works", "what a cell is",
    "how an elevator works", "what a haiku is", "how a hot air balloon flies", "what the Silk Road was",
    "how a dishwasher cleans dishes",
]
CHAT_TASKS_4 = [
    "Give me five tips for a long car journey with children.", "Suggest a cheap and healthy lunch for work.",
    "Write a polite email declining a job offer.", "List some ways to make mornings less rushed.",
    "How can I get better at public speaking?", "Write a haiku about a mountain lake.",
    "Give me ideas for a relaxing day at the beach.", "How do I start running if I have never run before?",
    "Write a short thank-you note for a birthday gift.", "What are some good habits for a healthy back?",
    "Suggest a name for a pet turtle.", "Write a short story about a snowman who wants to see summer.",
    "How can I organise my wardrobe?", "Give me tips for a video call interview.",
    "What are the benefits of walking every day?", "Write a limerick about a clumsy penguin.",
    "How do I make a simple fruit salad?", "Give me a packing list for a business trip.",
    "How can I keep my plants alive while on holiday?", "Write a short poem about the first snow.",
    "What are some fun things to do in a small town?", "How do I write a good birthday card message?",
    "Give me advice for learning to cook rice.", "Write a friendly reminder about a team lunch.",
    "How can I remember names better?", "Suggest three board games for a family evening.",
    "How do I ask my manager for feedback?", "Give me tips for sleeping in a noisy city.",
    "Write a short speech to thank volunteers.", "How can I eat more vegetables?",
    "What are some ways to relax after work?", "Write a short story about a clock that runs backwards.",
    "How do I teach a child to ride a bike?", "Give me ideas for a class presentation topic.",
    "Write a product description for a wooden desk lamp.", "Suggest a stretching routine for the morning.",
    "Write a short review of a walking tour.", "How do I prepare for a job fair?",
    "Give me tips for writing a short story.", "Write an encouraging note for a friend starting university.",
    "What are some easy ways to save water at home?", "How do I make a simple omelette?",
    "Write a short poem about rivers.", "Give me advice on buying a used car.",
    "How can I become more patient?", "Write a short fable about a tortoise and an eagle.",
    "How do I plan a small garden party?", "Write the opening of a welcome speech for a school year.",
    "How do I keep my phone battery healthy?", "Suggest a theme for a book club this month.",
]
MATH_TEMPLATES_4 = [
    "{n} buys {d} notebooks at {a} dollars each and pays with {e} dollars. How much change does {n} get? Explain step by step.",
    "A library has {e} books and lends out {a} of them. Then {b} are returned. How many books are in the library now?",
    "What is {a} times {d}, minus {b}? Show the calculation.",
    "A field is {a} meters by {b} meters. What is its area in square meters? Show your work.",
    "{n} walks {d} km in the morning and {b} km in the evening. How far does {n} walk in total in {a} days?",
    "A ticket costs {a} dollars. How much do {d} tickets cost with a {p} percent discount? Explain step by step.",
    "Solve for x: x - {a} = {e}. Show each step.",
    "{n} collects {a} {i} on Monday and twice as many on Tuesday. How many {i} does {n} have? Show your work.",
    "A jar holds {c} candies. {n} eats {d} candies a day. How many days do the candies last?",
    "What is {e} minus {a}, divided by {d}? Round to two decimals and explain.",
]


# Fifth wave (appended again; earlier ids stay valid): new phrasings across every train subject,
# task templates over new activity/story/email subjects, and more math. None of the eval subjects
# (moon, compass, trees, apartments, winter, flights, apologies, phone photos, earthquakes,
# birthday parties, computer security, dragons, gardening were left out by hand).
CODE_TEMPLATES_5 = [
    "Write a Python function that {t}. Keep it short and explain how it works.",
    "Can you write Python code that {t}? Show an example call.",
    "Write a Python function that {t}, with a comment on each step.",
]
CHAT_TEMPLATES_5 = [
    "Tell me about {t}.",
    "Explain {t} step by step.",
    "Write a short explanation of {t} for a student.",
]
CHAT_ACTIVITIES_5 = [
    "learning to knit", "keeping a tidy kitchen", "writing a weekly plan", "training for a half marathon",
    "hosting a dinner for friends", "learning to play chess", "saving for a new bike", "starting a podcast",
    "studying for a history test", "making bread at home", "painting a room", "choosing a new laptop",
    "caring for a rabbit", "learning to juggle", "reading more books", "cycling to work",
    "baking cookies with children", "working from home", "starting a small business", "writing a blog",
    "learning to sew", "preparing for a driving test", "volunteering at a food bank", "visiting a museum with kids",
    "shopping at a farmers market", "keeping a budget as a student", "learning to meditate",
    "fixing a flat bike tire", "moving to a new city", "learning to play the piano",
]
CHAT_ACTIVITY_TEMPLATES_5 = [
    "Give me five tips for {t}.",
    "How do I get started with {t}?",
    "What are common mistakes people make when {t}?",
]
CHAT_STORY_SUBJECTS_5 = [
    "a cat who wants to fly", "an old bookshop", "a robot chef", "a windy afternoon", "a lost umbrella",
    "a busy market", "a village by the sea", "a train at night", "a quiet library", "a young inventor",
    "a brave little mouse", "a field of sunflowers", "a kite stuck in a tree", "a rainy bus stop", "a friendly ghost",
    "the last day of school", "a mountain path", "a talking parrot", "a lighthouse in a storm",
    "a balloon that floats away",
]
CHAT_STORY_TEMPLATES_5 = ["Write a short poem about {t}.", "Write a short story about {t}."]
CHAT_EMAIL_PURPOSES_5 = [
    "asking a landlord to fix a leaking tap", "inviting a speaker to a school event", "asking for a day off",
    "thanking a client for their order", "requesting a refund for a broken kettle",
    "introducing yourself to a new team", "asking a professor for a recommendation letter",
    "confirming a dentist appointment", "following up after an interview", "asking a neighbour to keep the noise down",
]
MATH_TEMPLATES_5 = [
    "{n} has {e} dollars and spends {a} dollars on {i}. How much money is left? Explain step by step.",
    "A school orders {d} boxes of {i} with {a} in each box. How many {i} is that in total? Show your work.",
    "What is {b} percent of {e}? Show the calculation.",
    "A car travels {e} km in {d} hours. What is its average speed? Explain step by step.",
    "{n} cuts a {e} cm ribbon into pieces of {d} cm. How many whole pieces are there, and how much is left over?",
    "The price of a game goes up from {a} dollars to {e} dollars. By how many dollars did it rise, and by what percent?",
    "Solve for x: {d}x = {c}. Show each step.",
    "What is the perimeter of a rectangle that is {a} m long and {b} m wide? Explain how you computed it.",
    "{n} plants {d} rows of {a} flowers. {b} flowers do not grow. How many flowers grow? Show your work.",
    "A water bottle holds {d} liters. How many bottles are needed to fill a {c} liter tank?",
]


# Sixth wave (appended again; earlier ids stay valid): NEW subjects only, for breadth: the GPU-trained
# leg-7 drafter scores tau 2.54 on train prompts and 2.12 on held-out ones, so it still generalises
# only as far as its prompts reach. None of the eval subjects (checked by hand as for the fifth wave;
# build() asserts that no eval prompt and no duplicate is among the train prompts).
CODE_TASKS_6 = [
    "parses a date string like 2024-03-15 into year, month and day",
    "merges two dictionaries, adding the values of shared keys", "flattens a nested list of any depth",
    "removes duplicate words from a sentence, keeping the order",
    "converts a temperature from Celsius to Fahrenheit and back", "returns the median of a list of numbers",
    "computes the standard deviation of a list", "checks whether a string is a pangram",
    "counts the words in a text file", "returns the longest word in a sentence",
    "checks whether brackets in a string are balanced", "multiplies two matrices",
    "finds the second largest number in a list", "returns the intersection of two lists without duplicates",
    "reads a CSV file and returns the rows as dictionaries", "writes a list of dictionaries to a CSV file",
    "returns the file extension of a path", "counts how often each letter occurs in a string",
    "implements bubble sort", "checks whether a linked list has a cycle",
    "computes the greatest common divisor with Euclid's algorithm",
    "returns the digits of a number as a list", "converts a hex color like #ff8800 to an RGB tuple",
    "masks all but the last four digits of a card number",
    "validates an email address with a regular expression", "extracts all numbers from a string",
    "returns the n largest values of a dictionary", "implements a stack with push, pop and peek",
    "computes the factorial of a number iteratively", "returns a histogram of word lengths in a text",
    "shuffles a list without using random.shuffle",
    "simulates rolling two dice many times and counts the sums",
    "converts seconds to hours, minutes and seconds", "computes the distance between two points",
    "checks whether a point lies inside a circle", "returns the common prefix of two strings",
    "finds the missing number in a list of 1 to n", "builds a multiplication table as a list of lists",
    "truncates a string to n characters and adds an ellipsis", "returns the mode of a list",
    "converts a list of tuples to a dictionary", "finds the longest palindrome inside a string",
    "computes the sum of the digits of a number until one digit is left",
    "checks whether a string is a valid hexadecimal number",
    "returns the elements that appear in only one of two lists",
    "draws a right triangle of stars with n rows", "returns every third element of a list",
    "counts the lines, words and characters of a string",
    "checks whether a list contains a pair of equal neighbours",
    "converts kilometers to miles for a list of distances",
    "finds the index of the smallest element of a list", "returns the sum of the even numbers in a list",
    "builds an acronym from a phrase", "checks whether a tic-tac-toe board has a winner",
    "returns the number of trailing zeros of a factorial", "splits a full name into first and last name",
    "returns the words that appear in both of two sentences",
    "converts a number of minutes to a string like 2h 05m",
    "computes the grade letter for a score from 0 to 100",
]
CHAT_TOPICS_6 = [
    "how a submarine dives and surfaces", "what photosynthesis is", "what the water cycle is",
    "how a battery stores energy", "what an election is", "how a bicycle gear system works",
    "what a volcano is", "how vaccines train the immune system", "how a compost heap works",
    "what a rainbow is", "what a stock market is", "how a thermostat works", "what a food chain is",
    "how a lighthouse guides ships", "how an electric car works", "how glass is made", "what a time zone is",
    "what a migraine is", "how a vending machine works", "what a coral reef is", "what a leap year is",
    "how a printer prints", "what a tide is", "what an insurance policy is", "what erosion is",
    "how a zipper works", "how a bread machine works", "what a cloud is made of",
    "how a smoke detector works", "what a bank loan is", "how tea is grown", "what sleep is for",
    "how a parachute slows a fall", "what a species is", "how the internet sends data", "what a marsh is",
    "how a fridge magnet works", "what a pension is", "how a sailboat sails against the wind",
    "what a meteor is", "how a barcode scanner works", "what a lunar calendar is",
    "how a dam makes electricity", "what a symphony is", "how a hearing aid works",
    "what a wetland does for a river", "how a sewing machine works", "what an avalanche is",
    "how a seed grows into a plant", "what a referendum is", "how noise-cancelling headphones work",
    "what an aurora is", "how a toaster works", "what a mountain glacier leaves behind",
    "how a fire extinguisher works", "what a cooperative is", "how a wind chime makes music",
    "what a geyser is", "how an escalator works", "what a nature reserve is",
]
CHAT_ACTIVITIES_6 = [
    "learning a new language", "learning to fold origami", "planning a camping trip", "keeping a journal",
    "learning to swim as an adult", "cooking for one person", "decluttering a garage", "learning to draw",
    "running a book club", "training a puppy", "planning a wedding on a budget", "learning to code",
    "learning to play the guitar", "organising a family reunion", "learning to skateboard", "packing for a move",
    "writing a cover letter", "planning a road trip", "making a photo album", "learning to bake a cake",
    "teaching a child to ride a bike", "keeping a study timetable", "hosting a board game night",
    "cooking soup for the week", "learning to type faster",
]
CHAT_STORY_SUBJECTS_6 = [
    "a clock tower in a small town", "a penguin in the city", "a secret garden door", "a snail who wants to race",
    "an old map in the attic", "a musician on a street corner", "a paper boat on a river", "a fox and a crow",
    "a lost kite on the beach", "a tiny dragonfly", "a bakery at dawn", "a forgotten toy", "a storm over the fields",
    "a girl who collects stones", "a spaceship made of cardboard", "a sleepy owl", "a lonely scarecrow",
    "a bridge between two villages", "a whale who sings", "a bicycle with a bell",
]
CHAT_EMAIL_PURPOSES_6 = [
    "asking a colleague to review a report", "inviting neighbours to a street party",
    "asking a shop about a delayed delivery", "thanking a teacher at the end of the year",
    "asking for a quote to paint a fence", "welcoming a new member to a club",
    "asking a hotel about late check-in", "reminding a friend to return a book",
    "asking the city about a broken street light", "thanking a host after a dinner",
]
MATH_TEMPLATES_6 = [
    "{n} saves {a} dollars a week. How many weeks does it take to save {e} dollars? Explain step by step.",
    "A bus has {e} seats. {a} people get on at the first stop and {b} at the second. How many seats are still free?",
    "What is {a} squared minus {b}? Show the calculation.",
    "A garden is {a} m long and {d} m wide. Fencing costs {b} dollars per meter. How much does fencing it cost?",
    "{n} runs {d} laps of a {e} m track. How many meters is that, and how many kilometers?",
    "A phone plan costs {a} dollars a month plus {d} dollars per gigabyte. What is the bill for {b} gigabytes?",
    "Solve for x: {d}(x + {a}) = {c}. Show each step.",
    "{n} has {e} {i} and puts them in bags of {d}. How many full bags are there, and how many {i} are left?",
    "A movie starts at 7:{b:02d} pm and lasts {e} minutes. When does it end? Explain how you worked it out.",
    "What is the sum of all whole numbers from {d} to {e}? Show your reasoning.",
]


def _fill(subjects: list[str], templates: list[str]) -> list[str]:
    return [tpl.format(t=t) for t, tpl in itertools.product(subjects, templates)]


def _code_train() -> list[str]:
    return (_fill(CODE_TASKS, CODE_TEMPLATES) + _fill(CODE_TASKS_2, CODE_TEMPLATES)
            + _fill(CODE_TASKS + CODE_TASKS_2, CODE_TEMPLATES_3) + _fill(CODE_TASKS_4, CODE_TEMPLATES)
            + _fill(CODE_TASKS_4, CODE_TEMPLATES_3)
            + _fill(CODE_TASKS + CODE_TASKS_2 + CODE_TASKS_4, CODE_TEMPLATES_5)
            + _fill(CODE_TASKS_6, CODE_TEMPLATES + CODE_TEMPLATES_5))


def _math_train(rng: random.Random, n: int, templates: list[str], exclude: frozenset[str] = frozenset()) -> list[str]:
    out: set[str] = set()
    for _ in range(100 * n):  # bounded: a template with few distinct fillings must not spin forever
        if len(out) >= n:
            break
        tpl = templates[len(out) % len(templates)]
        d = rng.randint(2, 9)
        prompt = tpl.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=rng.randint(3, 60), b=rng.randint(2, 40),
                            c=d * rng.randint(3, 25), d=d, e=rng.randint(61, 200),
                            p=rng.choice([10, 15, 20, 25, 30, 40, 50]))
        if prompt not in exclude:
            out.add(prompt)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct math prompts for {n} wanted: a template has too few fillings")
    return sorted(out)


def _chat_train() -> list[str]:
    return (_fill(CHAT_TOPICS, CHAT_TEMPLATES) + CHAT_TASKS
            + _fill(CHAT_TOPICS_2, CHAT_TEMPLATES) + CHAT_TASKS_2
            + _fill(CHAT_TOPICS + CHAT_TOPICS_2, CHAT_TEMPLATES_3)
            + _fill(CHAT_TOPICS_4, CHAT_TEMPLATES) + CHAT_TASKS_4
            + _fill(CHAT_TOPICS_4, CHAT_TEMPLATES_3)
            + _fill(CHAT_TOPICS + CHAT_TOPICS_2 + CHAT_TOPICS_4, CHAT_TEMPLATES_5)
            + _fill(CHAT_ACTIVITIES_5, CHAT_ACTIVITY_TEMPLATES_5)
            + _fill(CHAT_STORY_SUBJECTS_5, CHAT_STORY_TEMPLATES_5)
            + [f"Write a polite email {t}." for t in CHAT_EMAIL_PURPOSES_5]
            + _fill(CHAT_TOPICS_6, CHAT_TEMPLATES + CHAT_TEMPLATES_5)
            + _fill(CHAT_ACTIVITIES_6, CHAT_ACTIVITY_TEMPLATES_5)
            + _fill(CHAT_STORY_SUBJECTS_6, CHAT_STORY_TEMPLATES_5)
            + [f"Write a polite email {t}." for t in CHAT_EMAIL_PURPOSES_6])


def build(seed: int = 0) -> dict[str, list[dict]]:
    math_first = _math_train(random.Random(seed), 200, MATH_TEMPLATES)
    # the second wave draws from its own stream, so the first wave is the same with or without it
    math_second = _math_train(random.Random(seed + 1), 450, MATH_TEMPLATES + MATH_TEMPLATES_2,
                              exclude=frozenset(math_first))
    math_third = _math_train(random.Random(seed + 2), 600, MATH_TEMPLATES + MATH_TEMPLATES_2,
                             exclude=frozenset(math_first + math_second))
    math_fourth = _math_train(random.Random(seed + 3), 500, MATH_TEMPLATES_4,
                              exclude=frozenset(math_first + math_second + math_third))
    math_fifth = _math_train(random.Random(seed + 4), 700, MATH_TEMPLATES_5,
                             exclude=frozenset(math_first + math_second + math_third + math_fourth))
    math_before = math_first + math_second + math_third + math_fourth + math_fifth
    math_sixth = _math_train(random.Random(seed + 5), 700, MATH_TEMPLATES_6, exclude=frozenset(math_before))
    sets = {"code": (_code_train(), CODE_EVAL, CODE_GATE),
            "math": (math_before + math_sixth, MATH_EVAL, MATH_GATE),
            "chat": (_chat_train(), CHAT_EVAL, CHAT_GATE)}
    out: dict[str, list[dict]] = {}
    for cat, (train, evals, gate) in sets.items():
        assert not set(train) & set(evals), cat
        assert len(set(train)) == len(train), f"{cat}: a train prompt occurs twice"
        assert len(set(gate)) == len(gate) and not set(gate) & (set(train) | set(evals)), f"{cat}: a gate prompt repeats"
        rows = [{"id": f"{cat}-train-{i:03d}", "category": cat, "split": "train", "prompt": p} for i, p in enumerate(train)]
        rows += [{"id": f"{cat}-eval-{i:03d}", "category": cat, "split": "eval", "prompt": p} for i, p in enumerate(evals)]
        rows += [{"id": f"{cat}-gate-{i:03d}", "category": cat, "split": "gate", "prompt": p} for i, p in enumerate(gate)]
        out[cat] = rows
    return out


@click.command()
def main() -> None:
    """Rewrite code.jsonl, math.jsonl and chat.jsonl beside this module from the lists in it
    (python -m dflash_trt.prompts.build)."""
    from dflash_trt.fsutil import write_text_atomic

    for cat, rows in build().items():
        write_text_atomic(HERE / f"{cat}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        print(cat, *(f"{sum(r['split'] == split for r in rows)} {split}" for split in ("train", "eval", "gate")))


if __name__ == "__main__":
    main(prog_name="python -m dflash_trt.prompts.build")
