"""A static KV cache: one preallocated row per running sequence, sized from a memory budget.

Layout ``kv[L, 2, rows, Hkv, S, D]`` (2 = key, value), allocated once. A running sequence owns
one row; the engine keeps running rows packed at ``[0, B)`` (``move_rows`` fills holes left by
finished sequences), so decode attention reads the contiguous views ``kv[l, :, :B, :, :S]`` with no
gather. A decode step writes one position per row with a single ``index_put_`` per layer, whose
flat indices are computed once per step and shared by all layers.

Simplifications, on purpose: no paging and no prefix sharing (the ``n`` samples of a prompt share
its prefill *compute*; its KV is copied into each sample's row), and every row reserves
``max_seq_len`` positions, so the budget is ``rows * bytes_per_row``.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values for ``rows`` sequences of up to ``max_seq_len`` tokens, in every layer."""

    def __init__(self, *, num_layers: int, rows: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if rows < 1:
            raise ValueError(f"the KV cache needs at least one row, got rows={rows}")
        self.rows, self.max_seq_len, self.num_kv_heads = rows, max_seq_len, num_kv_heads
        self.kv = torch.zeros(num_layers, 2, rows, num_kv_heads, max_seq_len, head_dim, dtype=dtype, device=device)
        self._flat = [self.kv[i].view(-1, head_dim) for i in range(num_layers)]  # [2*rows*Hkv*S, D]
        self.positions = torch.arange(max_seq_len, device=device)  # [S]
        # flat index of (kind, row 0, head, position 0); a row adds Hkv*S, a position adds 1
        kind = torch.arange(2, device=device)[:, None]
        head = torch.arange(num_kv_heads, device=device)[None, :]
        self._write_base = ((kind * rows * num_kv_heads + head) * max_seq_len)[None]  # [1, 2, Hkv]
        self._row_offset = torch.arange(rows, device=device) * (num_kv_heads * max_seq_len)  # [rows]

    @staticmethod
    def bytes_per_row(*, num_layers: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                      dtype: torch.dtype) -> int:
        """Bytes one sequence's row occupies (keys and values, every layer)."""
        return 2 * num_layers * num_kv_heads * max_seq_len * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def decode_write_index(self, pos: torch.Tensor) -> torch.Tensor:
        """Flat indices ``[B, 2, Hkv]`` where rows ``[0, B)`` write the key/value of position ``pos``."""
        b = pos.shape[0]
        return self._write_base + (self._row_offset[:b] + pos)[:, None, None]

    def write_index(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Flat indices ``[K, 2, Hkv]`` of position ``pos[i]`` in cache row ``rows[i]``."""
        return self._write_base + (self._row_offset[rows] + pos)[:, None, None]

    def write_decode(self, layer: int, index: torch.Tensor, kv_new: torch.Tensor) -> None:
        """Store ``kv_new[K, 2, Hkv, D]`` (keys then values) at flat ``index`` ``[K, 2, Hkv]``."""
        self._flat[layer].index_put_((index,), kv_new)

    def rows_prefix(self, layer: int, rows: torch.Tensor, rows_start: int | None, s: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[N, Hkv, s, D]`` of the given rows: a view when they are consecutive."""
        if rows_start is not None:
            kv = self.kv[layer, :, rows_start: rows_start + rows.shape[0], :, :s]
        else:
            kv = self.kv[layer, :, :, :, :s].index_select(1, rows)
        return kv[0], kv[1]

    def layer_prefix(self, layer: int, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of keys and values ``[b, Hkv, s, D]`` of rows ``[0, b)``, positions ``[0, s)``."""
        kv = self.kv[layer, :, :b, :, :s]
        return kv[0], kv[1]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, seq_len: int) -> None:
        """Copy positions ``[0, seq_len)`` of rows ``src`` into rows ``dst`` (disjoint sets; sources may repeat)."""
        view = self.kv[:, :, :, :, :seq_len]
        view.index_copy_(2, dst, view.index_select(2, src))
