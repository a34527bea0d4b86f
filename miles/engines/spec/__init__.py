"""Speculative decoding in the embedded engine.

- ``config.py``     SpeculativeConfig (the ``speculative`` flag section; SGLang flag mapping)
- ``sampling.py``   draft draws, accept / residual / bonus (rejection and coupled modes)
- ``drafters.py``   the draft models' device side: KV caches, catch-up, k-step proposals
- ``decoder.py``    one round: propose, verify in one forward, accept, read back
- ``controller.py`` the measured rule that picks plain decoding or a round of k drafts
- ``graphs.py``     CUDA graphs for verify steps

Wiring: ``EmbeddedEngine(model, draft=..., speculative=SpeculativeConfig(...))`` builds a
``SpecDecoder`` that the stepper consults before every step.
"""

from miles.engines.spec.config import SpeculativeConfig, from_sglang_args, sglang_args

__all__ = ["SpeculativeConfig", "from_sglang_args", "sglang_args"]
