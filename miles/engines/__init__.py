"""miles.engines: rollout engines behind ``miles.protocols.RolloutEngine``.

- ``embedded.py`` EmbeddedEngine — pure PyTorch, continuous batching, abort/resume, staged
  weight updates with per-token versions (the default backend, CPU and GPU)
- ``config.py``   EngineConfig
- ``runner.py``   device side: KV cache, prefill/decode forwards, CUDA graphs
- ``warmup.py``   the compiled step functions readied by a child process while the eager ones serve
- ``kv_cache.py`` slot KV cache and its prefill/decode attention backends
- ``sampling.py`` batched sampling (temperature, top-k, top-p, seeded counter-based draws)
- ``requests.py`` per-request state and stop rules
- ``weights.py``  staged weight updates
- ``spec/``       speculative decoding: draft models' device side, speculative sampling,
  one-forward verify, the measured on/off and k rule, CUDA graphs for whole rounds
"""

from miles.engines.config import EngineConfig
from miles.engines.embedded import EmbeddedEngine
from miles.engines.weights import WeightError

__all__ = ["EmbeddedEngine", "EngineConfig", "WeightError"]
