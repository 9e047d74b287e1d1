"""Tokenizers that speak the real chat formats, built here from the formats'
public specs: the special tokens by their real names, and chat templates
written from the format descriptions (harmony from OpenAI's harmony guide,
Qwen3 and Qwen3-Coder from their model cards). The vocab is a small byte-level
BPE trained on a few sentences, so tests and tiny models stay fast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HARMONY_SPECIALS = [
    "<|endoftext|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TAGS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
FIM = [
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]

CORPUS = [
    "The capital of France is Paris. The weather in Paris is sunny and 22 degrees.",
    "assistant analysis commentary final functions json user system developer",
    "Let me think about what the user wants. The user asks about the weather.",
    "get_weather city unit celsius fahrenheit location query result",
    'def add(a, b):\n    return a + b\n\nprint(add(2, 3)) {"name": "x", "arguments": {}}',
    "<function=get_weather> <parameter=city> </parameter> </function> to=functions.",
]

# harmony: system carries the reasoning effort, developer the instructions and
# tools; an assistant tool call goes to=functions.NAME on commentary; results
# come back from functions.NAME; earlier reasoning is dropped unless it led to a call.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are a helpful assistant.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}\nCalls to these tools must go to the commentary channel: 'functions'."
    "{% endif %}"
    "<|end|>"
    "{% set ns = namespace(dev='', start=0, last='') %}"
    "{% if messages and messages[0].role in ['system', 'developer'] %}"
    "{% set ns.dev = messages[0].content %}{% set ns.start = 1 %}{% endif %}"
    "{% if ns.dev or tools %}<|start|>developer<|message|>"
    "{% if ns.dev %}# Instructions\n\n{{ ns.dev }}{% endif %}"
    "{% if tools %}\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{% for t in tools %}// {{ t.function.description }}\n"
    "type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;\n\n"
    "{% endfor %}} // namespace functions{% endif %}<|end|>{% endif %}"
    "{% for m in messages[ns.start:] %}"
    "{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>"
    "{% endif %}"
    "{% set call = m.tool_calls[0].function %}{% set ns.last = call.name %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary <|constrain|>json"
    "<|message|>{{ call.arguments | tojson }}<|call|>"
    "{% elif m.role == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}"
    "<|start|>functions.{{ m.name or ns.last }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

_QWEN_SYSTEM = (
    "{% if messages and messages[0].role == 'system' %}{% set sys = messages[0].content %}"
    "{% else %}{% set sys = '' %}{% endif %}"
)

# Qwen3: tools as JSON in <tools>, calls as JSON in <tool_call>, results as
# <tool_response> in a user turn, <think> kept only after the last user turn.
QWEN3_TEMPLATE = (
    _QWEN_SYSTEM + "{% if tools %}<|im_start|>system\n{% if sys %}{{ sys }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif sys %}<|im_start|>system\n{{ sys }}<|im_end|>\n{% endif %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content and loop.index0 > ns.last_user %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{% if loop.first and m.content %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}"
    "{% endif %}"
)

# Qwen3-Coder: tools as <function><name>…<parameters>, calls as
# <tool_call>\n<function=NAME>\n<parameter=ARG>\nvalue\n</parameter>\n</function>\n</tool_call>.
QWEN3_CODER_TEMPLATE = (
    _QWEN_SYSTEM
    + "{% if tools %}<|im_start|>system\n{{ sys or 'You are Qwen, a helpful AI assistant.' }}"
    "\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{% for t in tools %}{{ '\\n' }}<function>\n<name>{{ t.function.name }}</name>\n"
    "<description>{{ t.function.description }}</description>\n<parameters>"
    "{% for p, s in (t.function.parameters.properties or {}).items() %}{{ '\\n' }}<parameter>\n"
    "<name>{{ p }}</name>\n<type>{{ s.type }}</type>\n</parameter>{% endfor %}\n</parameters>\n"
    "</function>{% endfor %}\n</tools>\n\nIf you choose to call a function ONLY reply in the "
    "following format:\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
    "{% elif sys %}<|im_start|>system\n{{ sys }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{{ '\\n' }}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n"
    "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
]

# Llama 3: a header per turn, content trimmed, tool results in the ipython role.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% set role = 'ipython' if m.role == 'tool' else m.role %}"
    "<|start_header_id|>{{ role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}<|eom_id|>"
    "{% else %}{{ m.content | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

KINDS = {
    # kind: (special tokens, added non-special tokens, template, eos)
    "harmony": (HARMONY_SPECIALS, [], HARMONY_TEMPLATE, "<|return|>"),
    "qwen3": (QWEN_SPECIALS, QWEN_TAGS, QWEN3_TEMPLATE, "<|im_end|>"),
    "qwen3_coder": (QWEN_SPECIALS + FIM, QWEN_TAGS, QWEN3_CODER_TEMPLATE, "<|im_end|>"),
    "llama3": (LLAMA3_SPECIALS, [], LLAMA3_TEMPLATE, "<|eot_id|>"),
}


def build(kind: str, vocab_size: int = 600) -> Any:
    """A Hugging Face fast tokenizer for `kind` (harmony, qwen3, qwen3_coder, llama3)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, tags, template, eos = KINDS[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    # Qwen's tags are added tokens that decode as text (not special), as in Qwen's vocab.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    pad = specials[0]
    bos = "<|begin_of_text|>" if kind == "llama3" else None
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos)
    out.chat_template = template
    return out


def save(kind: str, out_dir: Path) -> Path:
    build(kind).save_pretrained(out_dir)
    return out_dir
