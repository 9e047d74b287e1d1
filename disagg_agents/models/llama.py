from .base import Adapter


class LlamaAdapter(Adapter):
    model_type = "llama"
