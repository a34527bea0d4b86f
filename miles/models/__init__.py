"""miles.models: the Qwen3 / Qwen3-MoE / Qwen2(-MoE) / Llama decoder the embedded engine and
trainer share, Hugging Face checkpoint IO, and the tokenizer wrapper.

- ``config.py``     ModelConfig (HF config.json keys), ``tiny_config`` for tests/examples
- ``layers.py``     RMSNorm, RoPE, attention (pluggable backend), SwiGLU MLP, sparse MoE
- ``model.py``      CausalLM, ModelOutput, ``token_logprobs``
- ``checkpoint.py`` ``load_pretrained`` / ``save_pretrained`` (safetensors, HF names)
- ``tokenizer.py``  Tokenizer over ``tokenizers``, ``load_tokenizer``, ``build_tiny_tokenizer``
"""

from miles.models.checkpoint import CheckpointError, check_checkpoint, load_config, load_pretrained, save_pretrained
from miles.models.config import ConfigError, ModelConfig, tiny_config
from miles.models.layers import AttentionBackend, FullAttention
from miles.models.model import CausalLM, ModelOutput, token_logprobs
from miles.models.tokenizer import Tokenizer, build_tiny_tokenizer, load_tokenizer

__all__ = [
    "AttentionBackend",
    "CausalLM",
    "CheckpointError",
    "check_checkpoint",
    "ConfigError",
    "FullAttention",
    "ModelConfig",
    "ModelOutput",
    "Tokenizer",
    "build_tiny_tokenizer",
    "load_config",
    "load_pretrained",
    "load_tokenizer",
    "save_pretrained",
    "tiny_config",
    "token_logprobs",
]
