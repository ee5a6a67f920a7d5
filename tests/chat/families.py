"""Small, faithful copies of each family's chat format, for tests: a byte-level BPE (the demo's corpus)
with the family's markup tokens and a Jinja chat template that writes its tool declarations, tool
calls, tool results and thinking switch as the family's own template (or Python encoder) does.

- deepseek_v31: DeepSeek-V3.1's template: `<｜tool▁calls▁begin｜>` markers (added tokens, not
  special), arguments concatenated as the JSON text they are (the real template does `+` on them, so
  it needs string arguments), `thinking` switch, tool outputs in `<｜tool▁output▁begin｜>`.
- deepseek_v32: DeepSeek-V3.2's `encoding_dsv32.py`: DSML `function_calls` blocks.
- deepseek_v4: the demo checkpoint's own template (dayzero/demo/tokenizer.py: `encoding_dsv4.py`).
- kimi_k2: Kimi K2's template: `<|im_*|>` roles, `tool_declare` system message, `functions.name:i`
  call ids, `## Return of {id}` results; markers are special tokens; `<think>` blocks (K2 Thinking).
- gpt_oss: gpt-oss's harmony template: system / developer (tools as a `functions` namespace), calls as
  `<|start|>assistant to=functions.name<|channel|>commentary json<|message|>{args}<|call|>`, results
  from `functions.name to=assistant`; every `<|...|>` marker is a special token; `<|return|>` and
  `<|call|>` end a turn (EOS).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken

from dayzero.demo import tokenizer as demo

FAMILIES = ("deepseek_v31", "deepseek_v32", "deepseek_v4", "kimi_k2", "gpt_oss")

_V31_TOKENS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]

_V31_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% endif %}{% endfor %}"
    "{{ ns.system }}"
    "{%- if tools %}{{ '\\n\\n## Tools\\nYou have access to the following tools:\\n' }}"
    "{%- for tool in tools %}{{ '\\n### ' + tool['function']['name'] + '\\nDescription: ' + "
    "(tool['function']['description'] or '') + '\\n\\nParameters: ' + (tool['function']['parameters'] | tojson) + '\\n' }}"
    "{%- endfor %}"
    "{{ '\\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    "tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<｜Assistant｜></think>' }}{% endif %}"
    "{{ m['content'] or '' }}"
    "{%- if m['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}"
    "{%- for tool in m['tool_calls'] %}"
    "{{ '<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>' }}"
    "{%- endfor %}{{ '<｜tool▁calls▁end｜>' }}{% endif %}{{ eos_token }}"
    "{%- elif m['role'] == 'tool' %}{{ '<｜tool▁output▁begin｜>' + m['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{%- if messages[-1]['role'] == 'tool' %}{{ '' }}{% else %}"
    "{{ '<｜Assistant｜>' + ('<think>' if thinking is defined and thinking else '</think>') }}{% endif %}"
    "{%- endif %}"
)

_V32_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% endif %}{% endfor %}"
    "{{ ns.system }}"
    "{%- if tools %}{{ '\\n\\n## Tools\\n\\nYou have access to a set of tools you can use to answer the user\\'s question.\\n"
    "You can invoke functions by writing a \"<｜DSML｜function_calls>\" block like the following as part of your reply:\\n"
    "<｜DSML｜function_calls>\\n<｜DSML｜invoke name=\"$FUNCTION_NAME\">\\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\\n...\\n"
    "</｜DSML｜invoke>\\n</｜DSML｜function_calls>\\n\\nHere are the functions available in JSONSchema format:\\n<functions>\\n' }}"
    "{%- for tool in tools %}{{ tool['function'] | tojson }}{{ '\\n' }}{% endfor %}{{ '</functions>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] + '<｜Assistant｜>' }}"
    "{{ '<think>' if (thinking is defined and thinking and loop.last) else '</think>' }}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<function_results>' }}{% endif %}"
    "{{ '\\n<result>' + m['content'] + '</result>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '\\n</function_results>' }}{% endif %}"
    "{%- elif m['role'] == 'assistant' %}{{ m['content'] or '' }}"
    "{%- if m['tool_calls'] %}{{ '\\n\\n<｜DSML｜function_calls>\\n' }}"
    "{%- for call in m['tool_calls'] %}{{ '<｜DSML｜invoke name=\"' + call['function']['name'] + '\">\\n' }}"
    "{%- for key, value in call['function']['arguments'].items() %}"
    "{{ '<｜DSML｜parameter name=\"' + key + '\" string=\"' + ('true' if value is string else 'false') + '\">' }}"
    "{{ value if value is string else value | tojson }}{{ '</｜DSML｜parameter>' }}{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{%- endfor %}{{ '\\n</｜DSML｜invoke>' }}{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{%- endfor %}{{ '\\n</｜DSML｜function_calls>' }}{% endif %}{{ eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)

_KIMI_TOKENS = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
                "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"]

_KIMI_TEMPLATE = (
    "{%- if tools %}{{ '<|im_system|>tool_declare<|im_middle|>' }}{{ tools | tojson }}{{ '<|im_end|>' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>' }}{% endif %}"
    "{%- if m['role'] == 'user' %}{{ '<|im_user|>user<|im_middle|>' }}"
    "{%- elif m['role'] == 'assistant' %}{{ '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- elif m['role'] == 'tool' %}{{ '<|im_system|>tool<|im_middle|>' }}"
    "{%- else %}{{ '<|im_system|>system<|im_middle|>' }}{% endif %}"
    "{%- if m['role'] == 'tool' %}{{ '## Return of ' + m['tool_call_id'] + '\\n' + m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}"
    "{%- if m['reasoning_content'] is defined and m['reasoning_content'] %}{{ '<think>' + m['reasoning_content'] + '</think>' }}{% endif %}"
    "{{ m['content'] or '' }}"
    "{%- if m['tool_calls'] %}{{ '<|tool_calls_section_begin|>' }}"
    "{%- for call in m['tool_calls'] %}{{ '<|tool_call_begin|>' + call['id'] + '<|tool_call_argument_begin|>' }}"
    "{%- if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{%- else %}{{ call['function']['arguments'] | tojson }}{% endif %}{{ '<|tool_call_end|>' }}"
    "{%- endfor %}{{ '<|tool_calls_section_end|>' }}{% endif %}"
    "{%- else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
)

_HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

_HARMONY_TEMPLATE = (
    "{{ '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n"
    "Knowledge cutoff: 2024-06\\n\\nReasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + "
    "'\\n\\n# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}"
    "{%- if tools %}{{ '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}{% endif %}"
    "{{ '<|end|>' }}"
    "{%- set ns = namespace(instructions='') %}"
    "{%- for m in messages %}{% if m['role'] in ['system', 'developer'] %}{% set ns.instructions = m['content'] %}{% endif %}{% endfor %}"
    "{%- if ns.instructions or tools %}{{ '<|start|>developer<|message|>' }}"
    "{%- if ns.instructions %}{{ '# Instructions\\n\\n' + ns.instructions + '\\n\\n' }}{% endif %}"
    "{%- if tools %}{{ '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{%- for tool in tools %}{{ '// ' + (tool['function']['description'] or '') + '\\ntype ' + tool['function']['name'] + "
    "' = (_: ' + (tool['function']['parameters'] | tojson) + ') => any;\\n\\n' }}{% endfor %}"
    "{{ '} // namespace functions' }}{% endif %}{{ '<|end|>' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ '<|start|>user<|message|>' + m['content'] + '<|end|>' }}"
    "{%- elif m['role'] == 'assistant' %}"
    "{%- if m['reasoning_content'] is defined and m['reasoning_content'] %}"
    "{{ '<|start|>assistant<|channel|>analysis<|message|>' + m['reasoning_content'] + '<|end|>' }}{% endif %}"
    "{%- if m['tool_calls'] %}{% for call in m['tool_calls'] %}"
    "{{ '<|start|>assistant to=functions.' + call['function']['name'] + '<|channel|>commentary json<|message|>' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '<|call|>' }}{% endfor %}"
    "{%- else %}{{ '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' }}{% endif %}"
    "{%- elif m['role'] == 'tool' %}"
    "{{ '<|start|>functions.' + (m['name'] if m['name'] is defined else 'tool') + ' to=assistant<|channel|>commentary<|message|>' "
    "+ m['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)

_SPEC = {  # family: (added tokens, special?, eos token, chat template)
    "deepseek_v31": (_V31_TOKENS, False, demo.EOS, _V31_TEMPLATE),
    "deepseek_v32": ([], False, demo.EOS, _V32_TEMPLATE),
    "deepseek_v4": ([], False, demo.EOS, demo.CHAT_TEMPLATE),
    "kimi_k2": (_KIMI_TOKENS, True, "<|im_end|>", _KIMI_TEMPLATE),
    "gpt_oss": (_HARMONY_TOKENS, True, "<|return|>", _HARMONY_TEMPLATE),
}
EOS_TOKENS = {"gpt_oss": ["<|return|>", "<|call|>"]}  # generation_config.json's eos_token_id


def write_family_tokenizer(family: str, out_dir: Path) -> int:
    """Write tokenizer.json, tokenizer_config.json (and generation_config.json's EOS ids) for `family`
    into out_dir; return the vocabulary size."""
    tokens, special, eos, template = _SPEC[family]
    tok = demo.build_tokenizer()
    if tokens:
        tok.add_tokens([AddedToken(t, special=special, normalized=False) for t in tokens])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    config = {**demo.tokenizer_config(), "eos_token": eos, "chat_template": template}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    eos_ids = [tok.token_to_id(t) for t in EOS_TOKENS.get(family, [eos])]
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}), encoding="utf-8")
    return tok.get_vocab_size(with_added_tokens=True)
