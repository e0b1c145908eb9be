"""The built-in calibration text: written for this project (Apache-2.0, like the code).

Varied registers on purpose (prose, dialogue, instructions, code, lists, numbers), since the
activation statistics GPTQ and AWQ fit should look like what the model will be asked to do.
The quality report evaluates on different text (scripts/quant_heldout.txt).
"""

CALIBRATION_TEXT = """\
The river town woke slowly that morning. Fog lay over the water like a folded blanket, and the
ferry that usually crossed at seven waited at the pier with its engine idling. Marta walked down
the hill with a basket of bread for her aunt, counting the gulls on the railing as she went. There
were eleven, then twelve, then a sudden cloud of them when the ferry horn sounded twice.

"You are late," her aunt said, opening the door before Marta could knock.
"The fog," Marta answered. "Nobody can see the road past the bakery."
"Then it is a good day to stay inside and mend nets." Her aunt took the basket, lifted the cloth,
and smiled at the smell of warm rye. "Sit. The kettle is already on."

How to make a simple vegetable soup:
1. Chop one onion, two carrots, two sticks of celery and three cloves of garlic.
2. Warm two tablespoons of olive oil in a large pot over medium heat.
3. Cook the onion for five minutes, then add the carrots, celery and garlic.
4. Pour in one and a half litres of stock and bring it to a gentle boil.
5. Add a tin of chopped tomatoes, a handful of lentils and a bay leaf.
6. Simmer for thirty minutes, season with salt and pepper, and serve with bread.

Photosynthesis is the process by which green plants, algae and some bacteria turn light into
chemical energy. In the chloroplasts, chlorophyll absorbs mostly red and blue light. The energy
splits water molecules, releasing oxygen, and drives the synthesis of ATP and NADPH. In the
Calvin cycle these molecules are used to fix carbon dioxide into three-carbon sugars, which the
plant later combines into glucose, sucrose and starch. Almost all of the oxygen in the atmosphere
was produced this way over billions of years.

def fibonacci(n):
    \"\"\"Return the first n Fibonacci numbers as a list.\"\"\"
    if n <= 0:
        return []
    numbers = [0, 1]
    while len(numbers) < n:
        numbers.append(numbers[-1] + numbers[-2])
    return numbers[:n]


class Stack:
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty stack")
        return self._items.pop()

    def __len__(self):
        return len(self._items)

Question: A train leaves the station at 14:20 and arrives at 17:05. How long is the journey?
Answer: From 14:20 to 17:20 is three hours; 17:05 is fifteen minutes earlier, so the journey
takes two hours and forty-five minutes.

Question: What is 15 percent of 240?
Answer: Ten percent of 240 is 24 and five percent is 12, so fifteen percent is 36.

The history of the bicycle begins in the early nineteenth century with the draisine, a wooden
frame with two wheels that the rider pushed along with his feet. Pedals attached to the front
wheel came in the 1860s, and the huge front wheels of the penny-farthing followed because a
larger wheel travelled further with each turn of the pedals. The safety bicycle of the 1880s,
with two wheels of equal size and a chain driving the rear one, is the design we still ride.
Pneumatic tyres, invented soon after, made it comfortable, and within a decade millions of people
in Europe and America used bicycles to travel to work.

Dear Mr. Okafor,
Thank you for your letter of 3 March. I am pleased to confirm that the meeting room on the second
floor is reserved for your team from 9:30 to 12:00 on Thursday. A projector and a whiteboard will
be available, and coffee will be served at 10:45. Please let me know if you need anything else.
Kind regards,
Helen Marsh, Office Manager

SELECT customers.name, COUNT(orders.id) AS order_count
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
GROUP BY customers.name
HAVING COUNT(orders.id) > 3
ORDER BY order_count DESC;

The moon is about 384,400 kilometres from the Earth, and light takes a little more than one
second to cover that distance. The moon always shows us the same face because its rotation is
locked to its orbit: it turns once on its axis in the same 27.3 days it takes to go around us.
The phases we see, from new moon to full moon and back, come from the changing angle between the
sun, the moon and the Earth, not from the Earth's shadow, which only matters during an eclipse.

User: Can you suggest a name for my new cat? She is grey with white paws.
Assistant: How about "Mittens", for the white paws? If you like something less common, "Ash",
"Pebble" or "Nimbus" would suit a grey cat. You could also pick a name from a book you love.
User: I like Nimbus. Is it hard to teach a cat its name?
Assistant: Not very. Say the name in a calm, happy voice just before good things happen, such as
meals or treats. Most cats learn to respond within a few weeks, although they may still decide
not to come when called.

In economics, inflation is the rate at which the general level of prices rises over time. When
inflation is moderate and predictable, households and firms can plan ahead. When it is high or
volatile, money loses value quickly, savings shrink, and contracts written in money become risky.
Central banks usually respond to rising inflation by raising interest rates, which makes
borrowing more expensive, slows spending and, with a delay of months, brings price growth down.

for (int i = 0; i < n; ++i) {
    sum += values[i] * weights[i];
}
printf("weighted sum = %f\\n", sum);

function debounce(fn, delay) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), delay);
  };
}

Shopping list: eggs, milk, spinach, two lemons, rice, black beans, coffee, dish soap, batteries.

The old lighthouse keeper kept a logbook for forty years. Every entry began with the weather, the
direction of the wind and the height of the waves. Storms filled whole pages; calm weeks took a
single line. Near the end of the book, in a shakier hand, he wrote that the new electric lamp
would not need him any more, and that he would miss climbing the ninety-two steps each evening to
watch the ships come home.

Tips for a good night's sleep: keep a regular schedule, even at weekends; keep the bedroom dark,
quiet and cool; avoid caffeine after midday and heavy meals late in the evening; put screens away
an hour before bed; and if you cannot fall asleep after twenty minutes, get up and read until you
feel tired.

The French Revolution began in 1789 with the meeting of the Estates-General and the storming of
the Bastille. Over the following decade France abolished feudal privileges, declared the rights
of man and of the citizen, ended the monarchy and fought wars against much of Europe. The period
ended when Napoleon Bonaparte seized power in 1799, but its ideas about equality before the law
and the sovereignty of the nation shaped politics across the world for the next two centuries.

Table of results:
| trial | temperature (C) | time (s) | yield (%) |
|-------|-----------------|----------|-----------|
| 1     | 20              | 340      | 61.2      |
| 2     | 35              | 215      | 74.8      |
| 3     | 50              | 160      | 80.5      |
| 4     | 65              | 140      | 78.9      |

Water expands by about nine percent when it freezes, which is why ice floats and why pipes can
burst in winter. Most substances are denser as solids than as liquids; water is unusual because
its molecules form an open hexagonal lattice held together by hydrogen bonds. Lakes therefore
freeze from the top down, and the layer of ice insulates the water below, allowing fish to
survive the winter.

To install the package, create a virtual environment, activate it and run the installer:
    python -m venv .venv
    source .venv/bin/activate
    pip install -e .
Then start the server with the default model and open http://localhost:8000 in a browser.

A haiku about the sea:
Grey waves fold and break,
salt wind carries the gulls' cries,
the tide keeps its time.

The committee reviewed three proposals. The first, a new footbridge over the canal, was the
cheapest but would take two years to build. The second, widening the existing road bridge, would
disrupt traffic for eight months. The third, a ferry service, could start next spring but would
need a permanent subsidy. After a long discussion the committee recommended the footbridge and
asked the council to look for funding from the regional transport fund.
"""
