"""The built-in prompt set for self-distillation: templates crossed with subjects.

Written for aerie; deliberately unrelated to the Spec-Bench questions (those are for evaluation).
It covers the same kinds of requests a chat model sees: writing, explanation, advice, reasoning,
math, code, extraction, translation, summarisation and short factual questions.
"""

from __future__ import annotations

import random

SUBJECTS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "compound interest",
    "machine learning", "volcanoes", "the immune system", "renewable energy", "the printing press",
    "climate change", "electric cars", "the Roman Empire", "honeybees", "coffee", "the internet",
    "sleep", "chess", "plate tectonics", "vaccines", "inflation", "the moon landing", "recycling",
    "public libraries", "jazz music", "rainforests", "smartphones", "the Olympic Games", "gravity",
    "friendship", "remote work", "bread baking", "ocean tides", "the human heart", "bicycles",
    "earthquakes", "solar panels", "the stock market", "dinosaurs", "democracy", "tea ceremonies",
    "programming languages", "the Great Wall of China", "antibiotics", "music theory", "glaciers",
    "urban gardening", "the speed of light", "ancient Egypt", "cybersecurity",
]

TEMPLATES = [
    "Explain {s} to a ten-year-old.",
    "Write a short poem about {s}.",
    "Give me three interesting facts about {s}.",
    "What are the main advantages and disadvantages of {s}?",
    "Write a short blog post introduction about {s}.",
    "Summarize the history of {s} in one paragraph.",
    "How would you teach a beginner about {s}? Give a step-by-step plan.",
    "Write a persuasive paragraph arguing that everyone should learn about {s}.",
    "List five questions a curious student might ask about {s}, with short answers.",
    "Describe {s} in exactly three sentences.",
    "Write a dialogue between a teacher and a student about {s}.",
    "What is a common misconception about {s}, and what is the truth?",
]

STANDALONE = [
    "What is 17 multiplied by 23? Show your work.",
    "A train travels 180 km in 2.5 hours. What is its average speed?",
    "If a shirt costs $40 and is discounted by 15%, what is the final price?",
    "Solve for x: 3x + 7 = 25.",
    "What is the sum of the first 20 positive integers?",
    "A rectangle has a perimeter of 36 cm and a length of 10 cm. What is its area?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a SQL query that selects the ten most recent orders from a table called orders.",
    "How do I reverse a linked list? Explain and give code.",
    "Write a JavaScript function that removes duplicates from an array.",
    "Translate into French: 'The weather is beautiful today, let's go for a walk.'",
    "Translate into Spanish: 'I would like to book a table for two at seven o'clock.'",
    "Translate into German: 'Where is the nearest train station?'",
    "Give me a recipe for a simple vegetable soup.",
    "How can I improve my time management at work?",
    "What should I pack for a three-day hiking trip?",
    "Write a polite email asking a colleague to review my report by Friday.",
    "Write a thank-you note to a neighbour who watered my plants.",
    "What are good habits for staying healthy while working from home?",
    "Compare cats and dogs as pets.",
    "What is the capital of Australia, and why was it chosen?",
    "Who wrote 'Pride and Prejudice', and what is it about?",
    "Why is the sky blue?",
    "How does a refrigerator keep food cold?",
    "What causes the seasons on Earth?",
    "Extract the names and dates from this text: 'Alice met Bob on 3 March 2021, and they visited Carol on 14 July 2022.'",
    "Summarize in one sentence: 'The city council voted on Tuesday to expand the bike lane network, citing rising cycling rates and safety concerns raised by residents over the past year.'",
    "Classify the sentiment of this review as positive or negative: 'The food was cold and the service was slow.'",
    "Write a haiku about autumn leaves.",
    "Tell me a short story about a robot who learns to paint.",
    "Give me a motivational message for a student before an exam.",
    "What is the difference between weather and climate?",
    "Explain what an API is with an everyday analogy.",
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain.",
    "I have two coins that add up to 30 cents, and one of them is not a nickel. What are they?",
    "Plan a one-day itinerary for a visit to a new city.",
    "What are three tips for writing a good resume?",
    "Describe the taste of a lemon to someone who has never had one.",
]


def default_prompts(seed: int = 0) -> list[str]:
    """All template x subject prompts plus the standalone ones, in a fixed shuffled order."""
    prompts = [t.format(s=s) for t in TEMPLATES for s in SUBJECTS] + list(STANDALONE)
    random.Random(seed).shuffle(prompts)
    return prompts
