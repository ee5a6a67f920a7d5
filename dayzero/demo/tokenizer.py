"""The demo checkpoint's tokenizer: a byte-level BPE trained locally, with DeepSeek-V4's special tokens.

DeepSeek-V4 ships a byte-level BPE (`tokenizer.json`) whose first ids are the sequence markers
(0 `<｜begin▁of▁sentence｜>`, 1 `<｜end▁of▁sentence｜>`, 2 `<｜▁pad▁｜>`) and whose chat markup
(`<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`) are added tokens that are *not* special, so
decoding keeps them. Its `tokenizer_config.json` has no `chat_template`; the prompt format lives in
the Python encoder `encoding/encoding_dsv4.py` of the Hugging Face repository:

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>

with `<think>` instead of `</think>` after the last `<｜Assistant｜>` in thinking mode, and earlier
turns' reasoning dropped. The demo writes that format as a Jinja `chat_template` so that
`AutoTokenizer.apply_chat_template` works on it.

The merges are learnt from `CORPUS` below in a few milliseconds; the same text always gives the
same `tokenizer.json`.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2, as in DeepSeek-V4
CHAT_TOKENS = [USER, ASSISTANT, THINK_START, THINK_END]

BPE_VOCAB_SIZE = 768  # byte alphabet + merges + the three special tokens

# `thinking` (bool, default false) chooses the thinking mode, as `thinking_mode="thinking"` does in
# DeepSeek's encoder. Assistant turns render as chat-mode turns: their reasoning is dropped.
# Tools (OpenAI function tools) follow `encoding_dsv4.py`: the "## Tools" section after the system
# message's content (alone when there is none), calls as a DSML `tool_calls` block after the
# assistant's content (arguments as a mapping: strings as is, other values as JSON), and each tool
# result as a `<tool_result>` block of the user turn that follows.
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "### Available Tool Schemas\n\n"
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(tools_done=false) %}"
    "{%- macro tools_section() %}" + "{{ " + repr(TOOLS_SECTION) + " }}"
    "{%- for tool in tools %}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}\n{% endfor %}"
    "{{ '\\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\\n' }}"
    "{%- endmacro %}"
    "{%- if tools and messages[0]['role'] != 'system' %}{{ tools_section() }}{% set ns.tools_done = true %}{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ message['content'] }}"
    "{%- if tools and not ns.tools_done %}{{ '\\n\\n' }}{{ tools_section() }}{% set ns.tools_done = true %}{% endif %}"
    "{%- elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<｜User｜>' }}"
    "{%- else %}{{ '\\n\\n' }}{% endif %}"
    "{{ '<tool_result>' + message['content'] + '</tool_result>' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜></think>' + (message['content'] or '') }}"
    "{%- if message['tool_calls'] %}{{ '\\n\\n<｜DSML｜tool_calls>\\n' }}"
    "{%- for call in message['tool_calls'] %}{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<｜DSML｜invoke name=\"' + f['name'] + '\">\\n' }}"
    "{%- for key, value in f['arguments'].items() %}"
    "{{ '<｜DSML｜parameter name=\"' + key + '\" string=\"' + ('true' if value is string else 'false') + '\">' }}"
    "{{ value if value is string else value | tojson }}{{ '</｜DSML｜parameter>' }}{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{%- endfor %}"
    "{{ '\\n</｜DSML｜invoke>' }}{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{%- endfor %}{{ '\\n</｜DSML｜tool_calls>' }}{% endif %}"
    "{{ eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{ '<｜Assistant｜>' + ('<think>' if thinking is defined and thinking else '</think>') }}"
    "{%- endif %}"
)

CORPUS = """\
The lighthouse keeper climbed the stairs every evening to light the lamp before the ships came home.
She counted the steps as she went, one hundred and twelve of them, and at the top she wrote the
weather in a small book: the wind, the clouds, the colour of the sea and the time the sun went down.
On calm nights the water was as flat as glass and the beam crossed it without a tremble. On stormy
nights the waves broke over the rocks below and the whole tower seemed to hum with the wind.

A good engine reads its weights once, keeps its cache small, and spends its time on the work that
matters. The scheduler decides which requests run in the next step; the runner owns the tensors on
the device; the model code reads like the paper. When a token is generated, it is appended to the
sequence, the cache grows by one slot, and the next step begins. Prefill processes many tokens at
once, while decode produces one token per sequence per step.

Hello, how are you today? I am fine, thank you. What would you like to talk about? Tell me a story
about a cat who lived in a library and read a new book every night. The cat liked history best,
then poetry, then the long and patient books about mathematics, numbers, and the shapes of things.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024. Dates like 2026-04-24 and times like
12:30 appear in logs. Code looks like def main(): return 0, or for i in range(10): print(i).
Questions end with a question mark? Exclamations end with a bang! Lists use commas, semicolons; and
parentheses (like these) or [brackets] and {braces}. Quotes are "double" or 'single'.

Mixture of experts models route each token to a few experts out of many. A router scores the experts,
keeps the top ones, and mixes their outputs with the routing weights. Attention looks back over the
sequence; sparse attention keeps only the most useful entries, and compressed attention summarises
blocks of tokens into single entries so that very long contexts stay cheap to read.
"""


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE on `CORPUS` and add DeepSeek-V4's special and chat tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TOKENS])
    bos_id = tokenizer.token_to_id(BOS)
    # DeepSeek tokenizers prepend BOS to every encoded text (`add_bos_token: true`).
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 $B:1", special_tokens=[(BOS, bos_id)]
        ),
    ])
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(out_dir: Path) -> int:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`; return the vocabulary size."""
    tokenizer = build_tokenizer()
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    config = json.dumps(tokenizer_config(), indent=2, sort_keys=True, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    return tokenizer.get_vocab_size(with_added_tokens=True)
