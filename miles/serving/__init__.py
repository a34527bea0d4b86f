"""miles.serving: ``miles serve``, the embedded engine behind SGLang's HTTP protocol.

The SGLang adapter (``miles.engines.sglang``) is tested against it, and it is how a user runs
rollout engines apart from the trainer (docs/sglang.md).

- ``server.py``         ServeConfig, Server (state, info and control endpoints, the app)
- ``generate.py``       ``/generate``: single, batch, streamed
- ``protocol.py``       request parsing and response building (pure functions)
- ``weight_updates.py`` ``/init_weights_update_group``, ``/update_weights_from_*`` (the group
                        and transfers are ``miles.transports.weight_sync``, shared with the sender)
"""

from miles.serving.server import ServeConfig, Server

__all__ = ["ServeConfig", "Server"]
