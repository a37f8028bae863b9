"""TorchEngine's memory release, for a trainer that shares the device (``meshrl.actors.hybrid``).

A mixin of ``TorchEngine`` (its state lives there): while nothing runs, ``release_memory`` frees
the KV cache, and with ``weights=True`` the parameters (held in one allocation when
``contiguous_weights``), back to torch's caching allocator; ``restore_memory`` takes both back at
the same sizes and re-captures the CUDA graphs only if an address moved (``graph_recaptures``
counts it). Restored weights are undefined until the caller writes a whole version
(``write_params``); restored KV is zeroed where attention could read it before a write.
"""

from __future__ import annotations

import torch


class MemoryRelease:
    """The memory half of ``TorchEngine``'s interface."""

    def _make_weights_contiguous(self) -> torch.Tensor:
        """Move every parameter into views of one flat buffer (each start 256-byte aligned); returns its
        storage. Tensor objects stay the same (``set_``); the model's derived views are rebuilt."""
        m, align = self.model, max(1, 256 // torch.empty((), dtype=self.dtype).element_size())
        offsets, total = {}, 0
        for name, p in m.params.items():
            offsets[name] = total
            total += -(-p.numel() // align) * align
        flat = torch.zeros(total, dtype=self.dtype, device=self.device)
        storage = flat.untyped_storage()
        with torch.no_grad():
            for name, p in m.params.items():
                p.set_(storage, offsets[name], p.shape, p.stride())
        m.layers = [type(layer)(m.params, i) for i, layer in enumerate(m.layers)]  # .t() views of new storage
        return storage


    @property
    def memory_released(self) -> bool:
        return self.cache.released

    def release_memory(self, *, weights: bool = False) -> None:
        """Free the KV cache (and the parameters with ``weights``) while nothing runs or waits; nothing
        may generate until ``restore_memory``."""
        self._no_in_place("release_memory")
        if self._batch.size or self._waiting or self._stage is not None:
            raise RuntimeError(f"release_memory on a busy engine (running={self._batch.size}, waiting="
                               f"{len(self._waiting)}, updating={self._stage is not None}): let generate calls finish")
        if weights:
            if self._weights is None:
                raise RuntimeError("release_memory(weights=True) needs TorchEngineConfig.contiguous_weights=True")
            self._weights.resize_(0)
            self.weights_released = True
        self.cache.release()

    def restore_memory(self) -> bool:
        """Allocate what ``release_memory`` freed, parameters first; re-capture the CUDA graphs if an
        address moved. Returns whether they were re-captured. Released weights are undefined until
        the caller writes a whole version."""
        moved = False
        if self.weights_released:
            self._weights.resize_(self._weights_nbytes)
            moved, self._weights_ptr = self._weights.data_ptr() != self._weights_ptr, self._weights.data_ptr()
            self.weights_released = False
        moved = self.cache.restore() or moved
        recapture = moved and self._graphs is not None
        if recapture:
            self._capture_graphs()  # (its warm-up steps write into the cache: zeroed below if need be)
            self.graph_recaptures += 1
        if self.cache.stale and not self.model.fused_kernels:
            # the torch decode reads every position up to the batch's longest row (under a mask), and
            # 0 * NaN is NaN: zero it all (the fused path zeroes only what a prefill reads; batch.py)
            self.cache.kv.zero_()
            self.cache.stale = False
        return recapture
