"""The decode agent's model: one loaded mlx model, its tokenizer and chat format,
and how a request's prompt becomes token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import _get_classes, load_model, load_tokenizer

from disagg_agents.chatformat import (
    ChatStream,
    FormatError,
    detect,
    open_stream,
    render_chat,
    render_fim,
)
from disagg_agents.decode.grammar import Grammars
from disagg_agents.decode.kvcaches import MX_DTYPES, cache_kinds
from disagg_agents.models import get_adapter, load_hf_config
from disagg_agents.models.pooling import pooling_config
from disagg_agents.quant import check_supported, weights_identity
from disagg_agents.wire.promptsize import max_token_bytes, too_long
from disagg_agents.wire.request import GenerateRequest


class BadRequest(Exception):
    """The request itself is wrong; the agent stays healthy."""


class DecodeEngine:
    """One loaded mlx model and its tokenizer."""

    def __init__(self, model_dir: str, dtype: str = "auto", device: str = "auto") -> None:
        if device in ("cpu", "gpu"):
            mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)
        self.model_dir = model_dir
        check_supported(model_dir)
        self.cfg = load_hf_config(model_dir)
        self.adapter = adapter = get_adapter(self.cfg["model_type"])
        overrides = adapter.mlx_config(self.cfg)
        self.model, self.mlx_cfg = load_model(
            Path(model_dir), model_config=overrides, get_model_classes=adapted_classes(adapter)
        )
        adapter.patch_mlx_model(self.model, self.mlx_cfg)
        stored = self.cfg.get("dtype") or self.cfg.get("torch_dtype") or "float32"
        self.dtype = stored if dtype == "auto" and stored in MX_DTYPES else dtype
        if self.dtype == "auto":
            self.dtype = "float32"
        self.model.set_dtype(MX_DTYPES[self.dtype])
        mx.eval(self.model.parameters())
        self.tokenizer = load_tokenizer(Path(model_dir))
        self.chat = detect(self.tokenizer)  # its chat format, from vocab and template
        self.context = int(self.cfg.get("max_position_embeddings") or 1 << 20)
        self.vocab_size = int(self.cfg["vocab_size"])
        self.max_token_bytes = max_token_bytes(self.tokenizer)
        # Structured outputs: compiled grammars for this tokenizer, cached.
        eos_ids = self.tokenizer.eos_token_ids or []
        self.grammars = Grammars(self.tokenizer, self.vocab_size, eos_ids)
        # The chat format ("harmony", "qwen_json", "qwen_xml", "plain") decides what a
        # grammar wraps around the JSON.
        self.format_kind = self.chat.kind
        # Reasoning that ends with "</think>" (one token in Qwen3's vocab): a
        # constraint then starts after it.
        think_end = self.tokenizer.encode("</think>", add_special_tokens=False)
        self.think_end: list[int] | None = think_end if len(think_end) == 1 else None
        think_start = self.tokenizer.encode("<think>", add_special_tokens=False)
        self.think_start: int | None = think_start[0] if len(think_start) == 1 else None
        self.device = str(mx.default_device())
        self.fingerprint = {
            "architecture": self.cfg["model_type"],
            "num_layers": len(self.model.layers),
            "num_kv_heads": adapter.num_kv_heads(self.cfg),
            "head_dim": adapter.head_dim(self.cfg),
            "dtype": self.dtype,
            "layers": cache_kinds(make_prompt_cache(self.model)),
            "weights": weights_identity(model_dir),
        }

    def check_fits(self, req: GenerateRequest) -> None:
        """Refuse, before tokenizing, a prompt that surely cannot fit the context."""
        why = too_long(req, self.context, self.max_token_bytes)
        if why:
            raise BadRequest(why)

    def encode(self, req: GenerateRequest) -> list[int]:
        """The request's prompt as token ids: chat template unless raw, or the
        fill-in-the-middle prompt when it has a suffix. Chat messages and FIM code
        are text (special tokens' names in them stay characters); a raw prompt is
        the caller's own markup, encoded as the tokenizer encodes it, specials and all.
        A prompt that surely cannot fit the context is refused before any of that."""
        self.check_fits(req)
        tok = self.tokenizer
        try:
            if req.suffix is not None:
                return render_fim(tok, self.chat, req.prompt or "", req.suffix)
            if not self.is_chat(req):
                if req.messages is not None:
                    raise BadRequest(
                        f"{Path(self.model_dir).name} has no chat template: "
                        "send a raw prompt instead"
                    )
                assert req.prompt is not None  # GenerateRequest checked it
                return list(tok.encode(req.prompt))
            messages = req.messages or [{"role": "user", "content": req.prompt}]
            # A Lark-grammar answer is a forced custom tool's input: its tools are context.
            lark = (req.response_format or {}).get("type") == "lark"
            forced = req.tool_choice not in (None, "auto", "none") or lark
            return render_chat(
                tok,
                self.chat,
                messages,
                system=req.system,
                tools=shown_tools(req),
                think=req.think,
                forced=forced,
                structured=req.response_format is not None,
            )
        except FormatError as e:
            raise BadRequest(str(e)) from None

    def chat_info(self) -> dict[str, Any]:
        """What /api/show tells clients: the chat format, its template, what stops it,
        and the fill-in-the-middle tokens where the tokenizer has them."""
        tok = self.tokenizer
        stop_ids = set(tok.eos_token_ids or []) | self.chat.stop_ids
        info = {
            **self.chat.describe(),
            "template": self.chat.template,
            "stop": sorted({tok.convert_ids_to_tokens(i) for i in stop_ids}),
        }
        if self.chat.fim is not None:
            info["fim_tokens"] = tok.convert_ids_to_tokens(list(self.chat.fim))
        if pooling_config(self.model_dir) is not None:  # an embedding model's checkpoint
            info["capabilities"] = [*info["capabilities"], "embedding"]
        return info

    def is_chat(self, req: GenerateRequest) -> bool:
        """Whether the prompt goes through the chat template."""
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        return req.suffix is None and has_template and (req.messages is not None or not req.raw)

    def stops(self, req: GenerateRequest) -> frozenset[int]:
        """Token ids that end the answer (and are not sent): EOS, harmony's
        <|return|> and <|call|>, and for FIM what starts another file."""
        if req.ignore_eos:
            return frozenset()
        ids = set(self.tokenizer.eos_token_ids or []) | self.chat.stop_ids
        if req.suffix is not None:
            ids |= self.chat.fim_stop_ids
        return frozenset(ids)

    def stream(self, req: GenerateRequest, ids: list[int]) -> ChatStream:
        """The answer's parser: reasoning, content and tool calls apart."""
        return open_stream(
            self.chat,
            self.tokenizer,
            ids,
            chat=self.is_chat(req),
            tools=shown_tools(req),
            structured=req.response_format is not None,
            forced=req.tool_choice not in (None, "auto", "none"),
        )


def shown_tools(req: GenerateRequest) -> list[dict[str, Any]] | None:
    """The tools the model is shown: none when tool_choice is "none"."""
    return None if req.tool_choice == "none" else req.tools


def adapted_classes(adapter: Any) -> Any:
    """mlx-lm's `get_model_classes` for `adapter`'s models: its weights mapped in
    before the model's own sanitize."""

    def classes(config: dict[str, Any]) -> tuple[type, type]:
        model_cls, args_cls = _get_classes(config)

        class Adapted(model_cls):  # type: ignore[valid-type, misc]
            def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
                weights = adapter.mlx_weights(weights, config)
                base = getattr(super(), "sanitize", None)
                return base(weights) if base else weights

        return Adapted, args_cls

    return classes
