"""A small byte-level BPE chat tokenizer trained offline on the examples' own text.

No hub: the project trains its tokenizer from a corpus it generates (names, the AlphabetSort prompt
templates, tags, digits, punctuation), or from the text of the run's task (`task_corpus`:
``model.tokenizer_corpus = "task"``). Byte-level BPE encodes any text, so the corpus only decides
how compact the encoding is. The chat template is ChatML, the format Qwen models use.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    # Offered tools: a system turn that lists them (the user's system message first), as Qwen3's.
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first and tools %}"
    # An assistant reply: its text (none for a reply that only calls tools), then each call.
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if not loop.first or content %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    # Tool results: consecutive ones share one user turn, each in <tool_response> tags.
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML, and tools the way Qwen3's template renders them: offered tools listed in a system turn,
an assistant's ``tool_calls`` as ``<tool_call>`` JSON blocks (what vLLM's ``hermes`` parser reads
back), tool results in ``<tool_response>`` blocks of a user turn. Without tools it renders exactly
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message."""

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


def messages_and_tools(conversation: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A solved conversation's messages and the tools it offers: it is its messages, or
    ``{"messages": [...], "tools": [...]}`` for one that offers tools (the chat-dataset form TRL's
    SFT takes; its assistant messages may hold ``tool_calls``)."""
    if isinstance(conversation, dict):
        return conversation["messages"], list(conversation.get("tools") or [])
    return conversation, []


def task_corpus(solved_conversation: Callable[[int], Any],
                num_conversations: int = 2000) -> list[str]:
    """The text of a task's first solved training conversations, one message (its role, then its
    content and tool calls as JSON) a line, and the tools they offer: the corpus of a tokenizer
    that fits the task's own prose (``model.tokenizer_corpus = "task"``)."""
    lines: list[str] = []
    for i in range(num_conversations):
        messages, tools = messages_and_tools(solved_conversation(i))
        lines += [json.dumps(tool) for tool in tools]
        for message in messages:
            calls = "".join(f"\n<tool_call>\n{json.dumps(call.get('function', call))}\n</tool_call>"
                            for call in message.get("tool_calls") or [])
            lines.append(f"{message['role']}\n{message.get('content') or ''}{calls}")
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0,
                    corpus: Sequence[str] | None = None) -> Tokenizer:
    """Train a byte-level BPE with the chat special tokens (ids 0, 1, 2) on ``corpus`` (default:
    `training_corpus`, the AlphabetSort text)."""
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
    tokenizer.train_from_iterator(training_corpus(seed=seed) if corpus is None else corpus,
                                  trainer=trainer)
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
