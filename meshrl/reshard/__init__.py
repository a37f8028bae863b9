"""Weight flow from the trainer to the engines, one whole policy version at a time.

Now: the full Hugging Face-named state dict travels through Ray's object store, put once by the
driver and fetched by every engine, which stages it and flips to the new version between two
decode steps. Simplification on purpose until the DTensor planner lands: no sharded layouts, no
buckets, no NCCL.
"""

from meshrl.reshard.object_store import PushStats, push_weights

__all__ = ["PushStats", "push_weights"]
