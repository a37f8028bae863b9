"""meshrl: asynchronous RL post-training of LLMs on Ray actor meshes."""

__version__ = "0.1.0"
