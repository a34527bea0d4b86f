"""miles: asynchronous RL for post-training language models.

Rollout workers, a policy trainer, a draft trainer and a weight broadcaster never block on
each other; they meet in versioned replay buffers (``miles.buffers``) under a staleness
budget (``miles.scheduler``). See README.md for the file tree.
"""

__version__ = "0.1.0"
