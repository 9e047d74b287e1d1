from .base import Adapter


class GptOssAdapter(Adapter):
    model_type = "gpt_oss"
