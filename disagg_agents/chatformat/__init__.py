"""What a model says, read from its tokenizer: chat formats for the decode agent.

- `detect`: the tokenizer's vocab, special tokens and chat template decide a
  `ChatFormat` (harmony, Qwen3's JSON tool calls, Qwen3-Coder's XML ones, plain).
- `render`: a request's messages (tools, reasoning effort, earlier tool calls
  and their results) or a fill-in-the-middle prompt as token ids; `harmony`
  (with `tstypes`) writes gpt-oss prompts as openai-harmony does; `literal`
  keeps message text text, so only a template's markup is control tokens.
- `parse` / `stream`: the model's tokens, one at a time, split into reasoning,
  content and tool calls (`qwenxml`: Qwen3-Coder's, recovered when unclosed);
  markup never reaches the text.
"""

from .detect import ChatFormat, detect
from .parse import ParsedCall, Piece
from .render import FormatError, render_chat, render_fim
from .stream import ChatStream, open_stream

__all__ = [
    "ChatFormat",
    "ChatStream",
    "FormatError",
    "Piece",
    "ParsedCall",
    "detect",
    "open_stream",
    "render_chat",
    "render_fim",
]
