"""A small byte-level BPE chat tokenizer trained offline on the examples' own text.

No hub: the project trains its tokenizer from a corpus it generates (names, the AlphabetSort prompt
templates, tags, digits, punctuation). Byte-level BPE encodes any text, so the corpus only decides how
compact the encoding is. The chat template is ChatML, the format Qwen models use.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TEMPLATE_TEXT = """system
user
assistant
You are a helpful assistant.
Sort these names in alphabetical order by FIRST name: {names}
Sort these names in alphabetical order by LAST name: {names}
Use exactly this format:
<alphabetical_sorted>
Name1
Name2
Name3
</alphabetical_sorted>
Now sort ALL of these names alphabetically by LAST name: {names}
Now sort ALL of these names alphabetically by FIRST name: {names}
These are in addition to the prior list. Mark any NEW names (that weren't in the prior list) with `// new name!` at the end.
<combined_alphabetical_sorted>
Name1
Name2 // new name!
</combined_alphabetical_sorted>
Follow the same format as before.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 , . ; : ! ? ' " ( ) [ ] { } < > / \\ - + = * & % $ # @
"""


def training_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic corpus: the prompt templates filled with generated names."""
    from torchtitan_rl.assets.names import NameBank

    rng = random.Random(seed)
    bank = NameBank(seed=seed)
    names = bank.all_names()
    lines: list[str] = []
    for _ in range(num_lines):
        picked = rng.sample(names, rng.randint(1, 6))
        lines.append(_TEMPLATE_TEXT.replace("{names}", ", ".join(picked)))
        lines.append("\n".join(sorted(picked)) + "\n" + " // new name!\n".join(picked))
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """Train a byte-level BPE with the chat special tokens (ids 0, 1, 2)."""
    # tokenizers parallelises with rayon; one thread keeps the merge order reproducible.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(seed=seed), trainer=trainer)
    return tokenizer


def load_tokenizer(model_dir: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer of an HF model dir: the class its ``tokenizer_config.json`` names, imported
    alone, else ``AutoTokenizer``'s choice. ``AutoTokenizer`` itself imports transformers' auto
    machinery (model mappings, torch._dynamo): seconds of start-up in every process that
    tokenizes (controller, rollout workers, eval)."""
    import transformers

    config_file = pathlib.Path(model_dir) / "tokenizer_config.json"
    name = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.exists() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is None:
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(model_dir)
