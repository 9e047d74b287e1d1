from .base import Adapter


class Qwen3Adapter(Adapter):
    model_type = "qwen3"
