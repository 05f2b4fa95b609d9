"""Seeded, labelled emotion text for the offline demo model and sample corpora.

Nothing here is real data: sentences are drawn from templates filled with per-label cue
words and phrases plus neutral subjects, contexts and fillers, so that

* the demo model (`serve_app.demo_model`) can be trained offline, in seconds, and still
  answer plain hand-written sentences sensibly, and
* sample corpora for the pipeline (`paragraphs`) have realistic, varied lengths, which is
  what makes length bucketing in the server matter.

Output depends only on ``(n, seed)`` and `DATA_VERSION`: the same call returns the same
list on every machine. Bump `DATA_VERSION` whenever a change alters the output, because
the demo model's cache fingerprint includes it.
"""

from __future__ import annotations

import random

__all__ = ["DATA_VERSION", "LABELS", "paragraphs", "sentences"]

#: The six labels of the classic "emotion" task, in label-index order.
LABELS: tuple[str, ...] = ("sadness", "joy", "love", "anger", "fear", "surprise")

#: Changes whenever `sentences`/`paragraphs` would produce different text for a seed.
DATA_VERSION = 3

# ---------------------------------------------------------------------------------------
# Per-label vocabulary. Each label has
#   adj:   fits "I am ___" / "she felt so ___"
#   act:   a past-tense verb phrase, fits "my brother ___"
#   event: a cause, fits "after ___," / "___ made me feel ..."
#   now:   a present-tense verb phrase, fits "I ___" / "we still ___"
#   said:  a whole utterance, used as is
# ---------------------------------------------------------------------------------------
# fmt: off
_VOCAB: dict[str, dict[str, tuple[str, ...]]] = {
    "sadness": {
        "adj": (
            "sad", "unhappy", "heartbroken", "miserable", "depressed", "gloomy",
            "lonely", "hopeless", "devastated", "down", "blue", "crushed",
            "disappointed", "empty inside", "grief-stricken", "sorrowful", "low",
            "defeated", "homesick", "tearful", "melancholy", "hurt", "broken",
            "discouraged", "numb with grief", "close to tears", "despondent",
            "downhearted", "forlorn", "wretched",
        ),
        "act": (
            "cried all night", "burst into tears", "could not stop crying",
            "sobbed quietly", "stayed in bed all day", "felt like giving up",
            "missed them terribly", "wept at the funeral", "lost all hope",
            "stared at the empty room", "could not eat anything", "grieved for weeks",
            "felt completely alone", "mourned the loss", "wiped away tears",
            "sat alone in the dark", "felt the tears coming", "kept thinking about the past",
            "lost the will to do anything", "felt a heavy ache in the chest",
            "whispered goodbye", "regretted every word", "cried on the phone",
            "dropped out of the race", "missed home so much",
        ),
        "event": (
            "the day our dog died", "the night grandpa died", "my cat dying", "my friend's death",
            "losing my mother",
            "the funeral", "my grandmother's funeral", "losing my job", "the breakup",
            "saying goodbye to our old dog", "the divorce", "my best friend moving away",
            "the death of my uncle", "failing the exam", "being left out again",
            "the miscarriage", "losing the house", "the rejection letter",
            "hearing that she passed away", "the end of our friendship",
            "another lonely birthday", "putting the cat to sleep", "the layoffs",
            "watching him leave", "the news about the accident",
        ),
        "now": (
            "cry myself to sleep", "still cry about it", "miss him every single day", "feel so alone",
            "can't stop crying", "feel empty inside", "have no energy left", "keep thinking about her",
            "don't want to see anyone", "feel like nothing matters", "wish she were still here",
            "can't get out of bed", "feel sad all the time", "cry when I see old photos",
            "grieve for my friend", "feel heartbroken",
        ),
        "said": (
            "Nothing will ever be the same again.", "I miss her so much it hurts.",
            "Everything feels pointless lately.", "I just want to be alone and cry.",
            "Nobody even noticed that I was gone.", "I can't stop thinking about what we lost.",
            "The house feels so empty without him.", "Some days the grief is unbearable.",
            "I feel like I let everyone down.", "It hurts to remember the good times.",
        ),
    },
    "joy": {
        "adj": (
            "happy", "delighted", "thrilled", "overjoyed", "cheerful", "glad",
            "ecstatic", "elated", "joyful", "content", "excited", "proud", "grateful",
            "over the moon", "on top of the world", "in a great mood", "pleased",
            "satisfied", "jubilant", "upbeat", "thankful", "relieved and happy",
            "full of energy", "so lucky", "blissful", "in high spirits", "giddy",
            "triumphant", "carefree", "euphoric",
        ),
        "act": (
            "laughed all evening", "could not stop smiling", "danced around the kitchen",
            "celebrated with friends", "jumped for joy", "cheered loudly",
            "sang in the car", "threw a little party", "grinned from ear to ear",
            "had the best day ever", "passed the exam with top marks",
            "got the promotion", "won the championship", "finished the marathon",
            "hugged everyone in sight", "laughed until it hurt", "felt on top of the world",
            "treated everyone to ice cream", "enjoyed every minute",
            "shouted with happiness", "got the job offer", "bought the dream house",
            "aced the interview", "had a wonderful time", "smiled all day",
        ),
        "event": (
            "the great news", "my birthday party", "our trip to the mountains", "getting a puppy",
            "getting the promotion", "passing the exam", "the holiday at the beach",
            "winning the match", "the graduation ceremony", "finishing the project",
            "the good news from the doctor", "our team winning", "the job offer",
            "a sunny day off", "the birth of my nephew", "the concert last night",
            "finally getting my license", "the acceptance letter",
            "a great dinner with friends", "paying off the loan", "the pay rise",
            "scoring the winning goal", "the first day of summer", "the excellent grade",
        ),
        "now": (
            "love my new job", "can't stop laughing", "feel amazing", "smile all the time",
            "enjoy every single day", "feel so happy", "celebrate every little win", "laugh with my friends",
            "have so much fun", "feel lucky to be here", "dance around the house", "can't wait for the trip",
            "feel fantastic", "sing in the shower", "grin like a kid",
        ),
        "said": (
            "This is the best day of my life!", "Everything is going perfectly!",
            "I can't wait to tell everyone the good news!", "Life is wonderful right now.",
            "We did it, we actually did it!", "What a fantastic day this has been!",
            "I'm so glad everything worked out.", "Today could not have gone better.",
            "Hooray, the weekend is finally here!", "I feel like celebrating all night.",
        ),
    },
    "love": {
        "adj": (
            "in love", "head over heels", "smitten", "devoted", "affectionate",
            "romantic", "tender", "fond of them", "loving", "adoring", "passionate",
            "attached to her", "crazy about him", "warm and loved", "cherished",
            "lovestruck", "infatuated", "caring", "sweet on her", "deeply attached",
            "full of love", "charmed", "enamoured", "besotted", "treasured",
            "safe in his arms", "close to my partner", "in awe of her kindness",
        ),
        "act": (
            "adored my wife", "kissed her goodnight", "held hands all evening",
            "cuddled on the couch", "wrote a love letter", "whispered i love you",
            "hugged my husband tightly", "cherished every moment together",
            "fell in love all over again", "proposed on the beach",
            "married my soulmate", "cooked dinner for my sweetheart",
            "missed my girlfriend's hugs", "gazed into his eyes", "held my baby close",
            "planned a romantic date", "bought roses for my partner",
            "adored my grandchildren", "snuggled with my boyfriend",
            "felt my heart melt", "treasured our time together",
            "said our wedding vows", "danced with my darling",
            "cared for my mother with all my heart", "kissed my fiance",
        ),
        "event": (
            "our first date", "his warm hug", "her kiss",
            "our anniversary", "my wedding day", "our first kiss", "seeing my partner again",
            "the honeymoon", "holding my newborn daughter", "our date night",
            "the proposal", "our Valentine's dinner", "a long hug from my husband",
            "the love letter she wrote", "meeting my soulmate", "our wedding vows",
            "cuddling with my wife", "my boyfriend's sweet message",
            "spending the evening with my darling", "his tender smile",
            "our romantic weekend", "her gentle touch", "my grandparents' love story",
        ),
        "now": (
            "love him with all my heart", "adore my wife", "cherish every moment with her",
            "think about him all day", "melt when she smiles", "hold hands everywhere we go",
            "cuddle every evening", "can't live without her", "care about him deeply", "kiss her every morning",
            "feel so loved", "love my family", "love my kids more than anything", "want to marry him",
            "write her love notes",
        ),
        "said": (
            "You mean the world to me.", "I love you more than words can say.",
            "My heart belongs to you forever.", "I adore everything about her.",
            "Being with him feels like home.", "I can't imagine my life without you, darling.",
            "She is the love of my life.", "Every moment with you is precious.",
            "I fall for him a little more every day.", "Hold me close and never let go.",
        ),
    },
    "anger": {
        "adj": (
            "angry", "furious", "mad", "livid", "enraged", "irritated", "annoyed",
            "outraged", "fuming", "infuriated", "resentful", "bitter", "hostile",
            "fed up", "sick of it", "seething", "irate", "cross", "frustrated",
            "boiling with rage", "hot with anger", "indignant", "aggravated",
            "exasperated", "offended", "insulted", "pissed off", "up in arms",
        ),
        "act": (
            "slammed the door", "yelled at the manager", "screamed in rage",
            "punched the wall", "stormed out of the meeting", "cursed under my breath",
            "threw the phone across the room", "lost my temper", "shouted at the driver",
            "hated every second", "demanded an apology", "refused to forgive them",
            "clenched my fists", "snapped at everyone", "kicked the chair",
            "swore at the referee", "wanted to scream", "blew up at my brother",
            "complained furiously", "glared at the cashier", "ripped up the letter",
            "banged on the table", "hung up in anger", "cut them off for good",
            "raged about the unfair fine",
        ),
        "event": (
            "my boss yelling at me", "the rude driver", "the scam",
            "the rude customer", "being lied to", "the unfair decision", "the broken promise",
            "the landlord keeping our deposit", "the insult", "being cheated",
            "the endless traffic jam", "the stolen bike", "the betrayal",
            "being blamed for nothing", "the parking ticket", "the disrespect",
            "waiting three hours for nothing", "the neighbour's loud music",
            "the hidden fees", "the lies in the news", "the cancelled refund",
            "my coworker taking credit", "the racist comment",
        ),
        "now": (
            "hate when people lie", "can't stand my boss", "want to scream at them", "refuse to put up with this",
            "get so mad at him", "lose my temper every time", "feel like punching the wall",
            "hate this stupid rule", "get furious when they ignore me", "yell at the TV", "resent them for it",
            "feel so angry", "demand a refund", "argue with them every day", "can't forgive that insult",
        ),
        "said": (
            "How dare they treat me like that!", "I am sick and tired of this nonsense.",
            "This is completely unacceptable!", "Don't you ever talk to me like that again.",
            "I hate it when people lie to my face.", "They have no right to do this!",
            "Stop wasting my time!", "I will never forgive them for this.",
            "That was the most insulting thing anyone has said to me.",
            "Enough is enough, I'm done with their excuses.",
        ),
    },
    "fear": {
        "adj": (
            "scared", "afraid", "terrified", "frightened", "nervous", "anxious",
            "worried", "panicked", "petrified", "uneasy", "fearful", "alarmed",
            "horrified", "jumpy", "tense", "shaken", "paranoid", "timid",
            "scared to death", "on edge", "full of dread", "apprehensive",
            "shaky", "spooked", "insecure", "helpless", "restless with worry",
            "trembling with fear",
        ),
        "act": (
            "hid under the blanket", "could not sleep because of the noises",
            "trembled all over", "had a panic attack", "checked the locks twice",
            "ran home in the dark", "froze in terror", "screamed at the shadow",
            "held my breath", "felt my heart pounding", "dreaded the results",
            "woke up from a nightmare", "shook with fear", "hid in the closet",
            "called the police", "backed away slowly", "avoided the dark alley",
            "prayed the plane would land safely", "kept looking over my shoulder",
            "broke into a cold sweat", "locked myself in the bathroom",
            "begged them not to leave me alone", "panicked during the storm",
            "jumped at every sound", "worried all night about the surgery",
        ),
        "event": (
            "someone breaking into the house", "the noise at 3 am", "the flight tomorrow",
            "the storm", "the strange noise downstairs", "the job interview",
            "the diagnosis", "the earthquake", "the stranger following me",
            "the dark forest", "the turbulence on the flight", "the break-in next door",
            "the horror movie", "the surgery tomorrow", "the threatening message",
            "the spider in the bed", "walking home alone at night", "the big exam tomorrow",
            "the footsteps behind me", "the fire alarm", "the dog growling at me",
            "the lump the doctor found", "the test results",
        ),
        "now": (
            "feel scared of the dark", "can't sleep at night", "hear noises in the house",
            "panic when the phone rings", "worry about everything", "fear the worst",
            "tremble when I think about it", "dread going to the dentist", "hide when the thunder starts",
            "check the locks every night", "feel terrified of heights", "get nervous before exams",
            "freeze when I see spiders", "avoid walking home at night", "shake before every speech",
        ),
        "said": (
            "Please don't leave me alone in the dark.", "What if something terrible happens?",
            "I keep hearing footsteps outside my window.", "I'm too scared to go out tonight.",
            "My hands won't stop shaking.", "I have a bad feeling about this.",
            "Somebody is watching the house, I'm sure of it.",
            "I dread opening that letter.", "Every little sound makes me jump.",
            "I'm afraid they won't come back.",
        ),
    },
    "surprise": {
        "adj": (
            "surprised", "shocked", "astonished", "amazed", "stunned", "speechless",
            "startled", "taken aback", "dumbfounded", "flabbergasted", "astounded",
            "caught off guard", "lost for words", "bewildered", "baffled",
            "in disbelief", "gobsmacked", "thunderstruck", "blown away",
            "stupefied", "agape", "perplexed", "shocked to the core",
            "struck by the twist", "puzzled", "awestruck", "wide-eyed", "floored",
        ),
        "act": (
            "could not believe my eyes", "never saw it coming", "did a double take",
            "gasped out loud", "dropped my coffee in shock", "stared in disbelief",
            "was caught completely off guard", "had no idea", "blinked twice to be sure",
            "found out by accident", "jumped when the lights came on",
            "read the message three times", "never expected that",
            "heard the news out of nowhere", "opened the door to a crowd of friends",
            "discovered a hidden letter", "learned the truth all of a sudden",
            "froze with my mouth open", "did not expect the ending",
            "watched the twist unfold", "checked the numbers again in shock",
            "found a stranger's gift on the doorstep", "was stunned by the result",
            "heard an old friend's voice on the phone", "saw the sudden announcement",
        ),
        "event": (
            "the unexpected call", "the news nobody saw coming", "my friend showing up unannounced",
            "the surprise party", "the plot twist", "the sudden announcement",
            "the unexpected gift", "the shocking news", "an old friend showing up",
            "the unexpected visit", "the strange coincidence", "the sudden resignation",
            "the secret being revealed", "the unexpected result", "the twist ending",
            "the out-of-the-blue phone call", "finding money in an old coat",
            "the surprise engagement", "the unbelievable score", "the sudden snowfall in May",
            "the announcement nobody expected", "running into my teacher abroad",
            "the hidden room behind the wall",
        ),
        "now": (
            "can't believe it happened", "still can't believe my eyes", "never expected this",
            "didn't see it coming", "still can't get over the shock", "feel totally stunned",
            "just found out out of nowhere", "couldn't believe the news", "can't wrap my head around the twist",
            "stare at the screen in shock", "feel so surprised", "double-check the numbers in disbelief",
            "wonder how it happened so suddenly", "keep rereading the letter in disbelief",
            "gasp every time I think of it",
        ),
        "said": (
            "Wow, I did not see that coming!", "No way, are you serious?",
            "I can't believe this actually happened!", "What on earth just happened?",
            "Who would have guessed it?", "Well, that was totally unexpected!",
            "You're kidding me, really?", "I had absolutely no idea!",
            "Out of nowhere, everything changed.", "Is this some kind of joke?",
        ),
    },
}

# Neutral material: carries no label, so the model learns to look for the cues.
_SUBJECT_BE = (
    "I feel", "I felt", "I am", "I was", "I've been", "I'm", "I'm feeling",
    "she is", "she felt", "he was", "he seems", "we were", "we felt", "they are",
    "my sister was", "my dad felt", "my best friend is", "everyone was",
    "honestly I am", "I was just", "the whole team was", "my mom seemed",
    "our teacher looked", "my roommate is", "the kids were", "I still feel",
    "I kind of feel", "my neighbour was", "my coworker felt", "grandpa looked",
)
_SUBJECT_NOW = (
    "I", "we", "they", "I still", "honestly I", "sometimes I", "we both", "I always", "I just",
    "lately I", "some days I", "my parents and I",
)
_SUBJECT = (
    "I", "she", "he", "we", "they", "my mom", "my brother", "our neighbour",
    "my roommate", "the kids", "my coworker", "my friend", "my aunt", "Sam",
    "Maria", "my partner", "the old man", "my cousin", "our coach", "my son",
)
_OBJECT = ("me", "her", "him", "us", "them", "everyone", "my family", "the whole class")
_INTENSIFIER = (
    "", "", "", "so", "really", "very", "incredibly", "a little", "quite",
    "completely", "truly", "deeply", "pretty", "extremely", "kind of", "utterly",
    "totally", "rather", "terribly", "absolutely",
)
# Topics every label talks about: without them a model learns "test" means fear because
# only fear sentences mention tests, and then misreads "I passed the test, so happy".
_TOPIC = (
    "the driving test", "the exam", "my dog", "the new job", "my sister", "the phone call",
    "the trip", "the letter", "my car", "the meeting", "the game", "the results", "my birthday",
    "the neighbours", "school", "the house", "my boss", "the holidays", "the news", "my parents",
    "the weekend", "the doctor", "our old friends", "the flight", "the party", "the interview",
    "my grandmother", "the kids", "the bill", "the weather",
)
_CONTEXT = (
    "", "", "", "today", "this morning", "last night", "at work", "at school",
    "after the call", "when I got home", "all week", "during dinner",
    "on the way home", "since yesterday", "this weekend", "at the party",
    "in the office", "right now", "after reading the message", "when I saw the news",
    "on the train", "for the whole afternoon", "after lunch", "before bed",
    "in the middle of class", "at the airport", "on my birthday", "over the holidays",
    "during the meeting", "at the hospital",
)
_FILLER = (
    "Honestly", "To be fair", "Well", "I have to say", "Looking back", "Somehow",
    "For what it's worth", "To be honest", "Funny enough", "Anyway", "Of course",
    "Believe it or not", "As usual", "Once again", "In the end", "Lately",
)
_NEUTRAL = (
    "The bus was ten minutes late again.", "We had pasta for dinner.",
    "It rained a bit in the afternoon.", "I went to the supermarket after work.",
    "The meeting was moved to Thursday.", "My phone battery died around noon.",
    "We watched the evening news.", "The train was crowded as always.",
    "I spent the morning answering emails.", "The kids went to school early.",
    "There was a lot of traffic on the highway.", "I need to call the bank tomorrow.",
    "The shop on the corner closed at six.", "We talked about the weekend plans.",
    "My cousin lives in another city now.", "The office printer is broken again.",
    "I made a cup of tea and sat down.", "The weather report said it would be cloudy.",
    "We took the long road through the village.", "She works at the library downtown.",
    "The package arrived on Tuesday.", "He drove the old car to the garage.",
    "I read a few pages before bed.", "We met at the café near the station.",
    "The neighbours painted their fence green.", "Dinner was at seven as usual.",
)
# Clauses that stretch a sentence without changing its meaning; they give paragraphs a
# long tail of lengths (up to ~200 words).
_LONG_CLAUSE = (
    "even though the whole week had been busy with meetings, errands and phone calls",
    "while the rain kept tapping on the kitchen window and the radio played quietly",
    "which was strange because nothing else about the day had been out of the ordinary",
    "just after we had finished cleaning the apartment and taking out the recycling",
    "as the train rolled slowly past the fields, the warehouses and the small stations",
    "although I had spent most of the afternoon sorting through old papers and receipts",
    "right when everyone was gathering in the living room to decide what to eat",
    "after a long drive across town in heavy traffic with the heater barely working",
    "while my neighbour was mowing the lawn and the dog barked at every passing car",
    "just as the meeting was wrapping up and people started packing their laptops",
)
# fmt: on


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def _sentence(rng: random.Random, label: int) -> str:
    v = _VOCAB[LABELS[label]]
    c = rng.choice
    # Templates are picked uniformly; each fills its slots from the label's vocabulary and
    # the neutral pools, so the cue is the only thing that separates the labels.
    template = rng.randrange(15)
    if template == 0:
        body = _join(c(_SUBJECT_BE), c(_INTENSIFIER), c(v["adj"]), c(_CONTEXT)) + "."
    elif template == 1:
        body = _join(c(_SUBJECT), c(v["act"]), c(_CONTEXT)) + "."
    elif template == 2:
        body = _join(c(v["event"]), "made", c(_OBJECT), "feel", c(_INTENSIFIER), c(v["adj"])) + "."
    elif template == 3:
        body = _join("after", c(v["event"]) + ",", c(_SUBJECT), c(v["act"])) + "."
    elif template == 4:
        body = _join(c(_FILLER) + ",", c(_SUBJECT_BE), c(_INTENSIFIER), c(v["adj"])) + "."
    elif template == 5:
        body = _join(c(_SUBJECT_BE), c(v["adj"]), "about", c(v["event"])) + "."
    elif template == 6:
        first, second = rng.sample(v["adj"], 2)
        body = _join(c(_SUBJECT_BE), first, "and", second, c(_CONTEXT)) + "."
    elif template == 7:
        body = _join(c(v["event"]), c(_CONTEXT) + ",", "and", c(_SUBJECT), c(v["act"])) + "."
        body = body.replace(" ,", ",")
    elif template == 8:
        body = _join("it was", c(v["event"]) + ";", c(_SUBJECT_BE), c(v["adj"])) + "."
    elif template == 9:
        body = _join(c(_SUBJECT), c(v["act"]), "because of", c(v["event"])) + "."
    elif template == 10:
        body = _join(c(_SUBJECT_NOW), c(v["now"]), c(_CONTEXT)) + "."
    elif template == 11:
        body = _join("ever since", c(v["event"]) + ",", c(_SUBJECT_NOW), c(v["now"])) + "."
    elif template == 12:
        body = _join(c(_SUBJECT_BE), c(_INTENSIFIER), c(v["adj"]), "about", c(_TOPIC), c(_CONTEXT)) + "."
    elif template == 13:
        body = _join("when it came to", c(_TOPIC) + ",", c(_SUBJECT), c(v["act"])) + "."
    else:
        body = c(v["said"])
    return _capitalise(body)


def sentences(n: int, *, seed: int) -> list[tuple[str, int]]:
    """``n`` labelled sentences ``(text, label index into LABELS)``, balanced over labels.

    Deterministic in ``(n, seed)``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"sentences:{seed}")  # noqa: S311  seeded demo text
    return [(_sentence(rng, label), label) for label in (i % len(LABELS) for i in range(n))]


def _stretch(rng: random.Random, sentence: str, clauses: int) -> str:
    """Append neutral clauses before the final punctuation mark."""
    if clauses == 0:
        return sentence
    extra = ", ".join(rng.sample(_LONG_CLAUSE, clauses))
    return f"{sentence[:-1]}, {extra}{sentence[-1]}"


def paragraphs(n: int, *, seed: int) -> list[tuple[str, int]]:
    """``n`` paragraphs of 1-5 sentences, each with one dominant label (the returned index).

    At least half the sentences (and at least one) carry the dominant label; the rest are
    neutral, and at most one carries another label. Lengths vary from a few words to
    about 200, so a corpus of them exercises length bucketing. Deterministic in
    ``(n, seed)``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"paragraphs:{seed}")  # noqa: S311  seeded demo text
    out: list[tuple[str, int]] = []
    for i in range(n):
        label = i % len(LABELS)
        count = rng.randint(1, 5)
        emotional = max(1, (count + 1) // 2 + rng.randint(0, count // 2))
        parts = [_sentence(rng, label) for _ in range(emotional)]
        rest = count - emotional
        # One minority sentence of another label, only when it cannot outvote the dominant.
        if rest and emotional >= 2 and rng.random() < 0.3:
            other = rng.choice([j for j in range(len(LABELS)) if j != label])
            parts.append(_sentence(rng, other))
            rest -= 1
        parts += rng.sample(_NEUTRAL, rest)
        rng.shuffle(parts)
        # Roughly a quarter of paragraphs get long clauses, which makes the length tail.
        if rng.random() < 0.25:
            parts = [_stretch(rng, p, rng.randint(0, 3)) for p in parts]
        out.append((" ".join(parts), label))
    return out
