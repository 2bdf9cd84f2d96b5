"""An explicit KV cache, passed into ``forward`` (never hidden state on modules).

Slots are shared by all rows of a batch; each slot also stores its token's position, block and
validity, so rows with prompts of different lengths (right padding) live in one cache and the
attention masks stay exact. Only clean (encoder) tokens are ever written: a decoder pass over a
noisy canvas reads the cache and attends to its own keys transiently, leaving every filled slot
as it was. Its keys go into the free slots after the cursor, used as scratch (the cursor does not
move), so a denoising step copies no prefix: the buffers are allocated once, at the first write,
for ``max_len`` slots. Under autograd (training) it concatenates instead.

Lifecycle::

    cache = KVCache(batch, max_len)
    model(prompt, info=prompt_info, cache=cache)            # prefill: slots [0, P)
    model(canvas, info=noisy_info, cache=cache, write=False)  # denoise: reads [0, P), writes nothing
    model(canvas, info=clean_info, cache=cache)              # append the finished canvas
    model(cat([canvas, x]), info=clean_info.cat(noisy_info), cache=cache, append=C)
                                        # or: append it and denoise the next canvas in one forward
    cache.truncate(P)                                        # roll back to the prompt
"""

from __future__ import annotations

import torch
from torch import Tensor

from dgemma.models.masks import TokenInfo


class KVCache:
    def __init__(self, batch: int, max_len: int):
        self.batch = batch
        self.max_len = max_len
        self.cursor = 0
        self.keys: dict[int, Tensor] = {}  # layer -> [B, H_kv, max_len, D], allocated on first write
        self.values: dict[int, Tensor] = {}
        self._info: TokenInfo | None = None  # [B, max_len] metadata, allocated on first write

    # -- reading ------------------------------------------------------------------------------
    def info(self) -> TokenInfo:
        """Metadata of the filled slots ``[0, cursor)``."""
        if self._info is None:
            raise RuntimeError("empty KVCache: prefill it before decoding")
        return self._info[:, : self.cursor]

    def __len__(self) -> int:
        return self.cursor

    # -- the per-layer hook used by attention ------------------------------------------------
    def attend_keys(self, layer: int, k: Tensor, v: Tensor, write: bool, at: int | Tensor | None = None,
                    end: int | None = None) -> tuple[Tensor, Tensor]:
        """Return the keys/values a layer attends to: filled slots followed by ``k``/``v``.

        With ``write`` the new keys are stored at ``[at, at + L)`` (the cursor itself moves once
        per forward, in :meth:`advance`); without it nothing is stored. ``at`` defaults to the
        cursor; a checkpointed layer passes the cursor of its first run, so recomputing it in
        backward rewrites the same slots with the same values.

        ``end`` (no ``write``): a partial canvas pass. ``k``/``v`` are slots ``[at, at + L)`` of a
        canvas whose scratch spans ``[cursor, end)``; the other canvas slots keep the keys an
        earlier pass left there, and the layer attends to ``[0, end)``
        (``DiffusionGemma.forward``'s ``partial``). There ``at`` may be a ``[B]`` tensor: row ``b``'s
        slots ``[at[b], at[b] + L)``.
        """
        n = k.shape[2]
        start = self.cursor if at is None else at
        if write:
            if start + n > self.max_len:
                raise RuntimeError(f"KVCache overflow: {start} + {n} > max_len {self.max_len}")
            if start == 0 and n == self.max_len:
                self.keys[layer], self.values[layer] = k, v  # one-shot fill (training): no copy
                return k, v
            self._allocate(layer, k, v)
            self.keys[layer][:, :, start : start + n] = k
            self.values[layer][:, :, start : start + n] = v
            end = start + n
            return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        if layer not in self.keys:
            raise RuntimeError("empty KVCache: prefill it before decoding")
        keys, values = self.keys[layer], self.values[layer]
        if end is not None:  # a partial canvas pass: overwrite its own slots, read the whole canvas
            rowwise = isinstance(start, Tensor)  # (checked against the canvas by DiffusionGemma.forward)
            inside = rowwise or self.cursor <= start and start + n <= end
            if not inside or end > self.max_len or (torch.is_grad_enabled() and k.requires_grad):
                raise RuntimeError(f"partial canvas pass: slots [{start}, {start + n}) must lie in the scratch "
                                   f"[{self.cursor}, {end}) <= max_len {self.max_len}, without autograd")
            if rowwise:
                put_rows(keys, start, k)
                put_rows(values, start, v)
            else:
                keys[:, :, start:start + n] = k
                values[:, :, start:start + n] = v
            return keys[:, :, :end], values[:, :, :end]
        if start + n <= self.max_len and not (torch.is_grad_enabled() and (keys.requires_grad or k.requires_grad)):
            # scratch: the free slots after the cursor hold the noisy keys for this forward only
            # (the cursor does not move, so the next write overwrites them): no copy of the prefix
            keys[:, :, start:start + n] = k
            values[:, :, start:start + n] = v
            return keys[:, :, :start + n], values[:, :, :start + n]
        return torch.cat([keys[:, :, :start], k], 2), torch.cat([values[:, :, :start], v], 2)

    def key_info(self, q: TokenInfo) -> TokenInfo:
        """Metadata of every key a forward over ``q`` attends to (filled slots, then ``q``)."""
        return q if self.cursor == 0 else self.info().cat(q)

    def advance(self, q: TokenInfo) -> None:
        """Record the metadata of tokens just written and move the cursor past them."""
        n = q.shape[1]
        if self._info is None:
            dev = q.positions.device
            z = torch.zeros(self.batch, self.max_len, dtype=torch.long, device=dev)
            f = torch.zeros(self.batch, self.max_len, dtype=torch.bool, device=dev)
            self._info = TokenInfo(z, z.clone(), f, f.clone())
        for dst, src in zip(
            (self._info.positions, self._info.blocks, self._info.noisy, self._info.valid),
            (q.positions, q.blocks, q.noisy, q.valid),
        ):
            dst[:, self.cursor : self.cursor + n] = src
        self.cursor += n

    def put_row(self, row: int, src: "KVCache") -> None:
        """Copy a one-row cache's filled slots into ``row``'s slots ``[0, src.cursor)`` (keys and values
        only: the metadata comes with :meth:`advance`). A prefill a prompt at a time
        (``dgemma/diffusion/sampler.py:prefill_prompts``) fills a batch's cache this way."""
        if src.batch != 1 or not 0 <= row < self.batch or src.cursor > self.max_len or self.cursor:
            raise ValueError(f"put_row: a one-row cache of at most {self.max_len} slots into row [0, {self.batch}) "
                             f"of an empty cache (got {src.batch} rows, {src.cursor} slots, row {row}, "
                             f"cursor {self.cursor})")
        n = src.cursor
        for layer, k in src.keys.items():
            v = src.values[layer]
            self._allocate(layer, k, v)
            self.keys[layer][row, :, :n] = k[0, :, :n]
            self.values[layer][row, :, :n] = v[0, :, :n]

    def _allocate(self, layer: int, k: Tensor, v: Tensor) -> None:
        """The layer's ``[B, H_kv, max_len, D]`` buffers, zeroed, shaped after ``k``/``v``, once."""
        if layer not in self.keys:
            shape = (self.batch, k.shape[1], self.max_len, k.shape[3])
            self.keys[layer], self.values[layer] = k.new_zeros(shape), v.new_zeros(shape)

    # -- editing --------------------------------------------------------------------------------
    def truncate(self, length: int) -> None:
        """Forget every slot from ``length`` on (slots are overwritten by later appends)."""
        if not 0 <= length <= self.cursor:
            raise ValueError(f"cannot truncate a cache of {self.cursor} slots to {length}")
        self.cursor = length

    def select(self, rows: Tensor, max_len: int | None = None) -> "KVCache":
        """A new cache holding only ``rows`` of the batch (finished examples stop costing compute).

        ``max_len`` (at least the cursor) caps the copy's slots: a cache that will only be read,
        plus one canvas of scratch, needs ``cursor + C``, not room for every later canvas, so the
        copy moves that many slots per layer instead of ``self.max_len``.
        """
        n = self.max_len if max_len is None else max_len
        if not self.cursor <= n <= self.max_len:
            raise ValueError(f"select: max_len must lie in [{self.cursor}, {self.max_len}], got {n}")
        out = KVCache(int(rows.numel()), n)
        out.cursor = self.cursor
        out.keys = {layer: t[:, :, :n].index_select(0, rows) for layer, t in self.keys.items()}
        out.values = {layer: t[:, :, :n].index_select(0, rows) for layer, t in self.values.items()}
        if self._info is not None:
            out._info = self._info[rows][:, :n]
        return out


def put_rows(buf: Tensor, at: Tensor, x: Tensor, *, indexed: bool | None = None) -> None:
    """``buf[b, :, at[b]:at[b] + L] = x[b]`` for every row (``buf [B, H, S, D]``, ``x [B, H, L, D]``):
    a partial pass whose rows have their own windows. On a CPU a slice copy a row: one indexed write
    of all rows cost more than the narrower windows saved (a batch-16 pass of 8 positions a row,
    181 against 145 ms for the shared window; 2026-12-07). Elsewhere one indexed write, with no
    host sync. ``indexed`` overrides that choice (tests compare the two)."""
    if indexed is None:
        indexed = buf.device.type != "cpu"
    n = x.shape[2]
    if indexed:
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        buf[rows, :, at[:, None] + torch.arange(n, device=x.device)] = x.transpose(1, 2)  # [B, L, H, D] there
        return
    for r, a in enumerate(at.tolist()):
        buf[r, :, a:a + n] = x[r]
