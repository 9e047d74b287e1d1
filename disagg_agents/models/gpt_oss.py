from typing import Any

from .base import Adapter


class GptOssAdapter(Adapter):
    """gpt-oss: transformers 5's expert layout, optional biases, SwiGLU clamp."""

    model_type = "gpt_oss"

    def mlx_weights(self, weights: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
        import mlx.core as mx

        if not any(k.endswith("mlp.experts.gate_up_proj") for k in weights):
            # Not transformers 5's float layout: an mlx-converted dir, or OpenAI's
            # MXFP4 *_blocks/*_scales; mlx-lm's own sanitize handles those as they are.
            return weights
        out: dict[str, Any] = {}
        for k, v in weights.items():
            # transformers stores the experts as in its matmuls, x @ W:
            #   gate_up_proj [E, hidden, 2I], gate/up interleaved on the last axis,
            #   down_proj [E, I, hidden].
            # mlx-lm's SwitchGLU wants Linear orientation [E, out, in] per projection.
            if k.endswith("mlp.experts.gate_up_proj"):
                base = k[: -len("gate_up_proj")]
                out[base + "gate_proj.weight"] = mx.contiguous(v[..., ::2].swapaxes(-1, -2))
                out[base + "up_proj.weight"] = mx.contiguous(v[..., 1::2].swapaxes(-1, -2))
            elif k.endswith("mlp.experts.gate_up_proj_bias"):
                base = k[: -len("gate_up_proj_bias")]
                out[base + "gate_proj.bias"] = mx.contiguous(v[..., ::2])
                out[base + "up_proj.bias"] = mx.contiguous(v[..., 1::2])
            elif k.endswith("mlp.experts.down_proj"):
                out[k + ".weight"] = mx.contiguous(v.swapaxes(-1, -2))
            elif k.endswith("mlp.experts.down_proj_bias"):
                out[k[: -len("_bias")] + ".bias"] = v
            else:
                out[k] = v
        # mlx-lm's attention always has biases and its model always has an lm_head;
        # a checkpoint without them computes the same as zero biases / tied head.
        if not cfg.get("attention_bias", True):
            for name, w in list(out.items()):
                for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    if name.endswith(f"self_attn.{proj}.weight"):
                        bias = name[: -len("weight")] + "bias"
                        out.setdefault(bias, mx.zeros((w.shape[0],), w.dtype))
        if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def patch_mlx_model(self, model: Any, cfg: dict[str, Any]) -> None:
        super().patch_mlx_model(model, cfg)
        # mlx-lm's SwigluOAI hardcodes alpha 1.702 and limit 7.0; the config may not.
        alpha = float(cfg.get("swiglu_alpha", 1.702))
        limit = float(cfg.get("swiglu_limit", 7.0))
        for _, mod in model.named_modules():
            if type(mod).__name__ == "SwigluOAI":
                mod._alpha, mod._limit = alpha, limit
