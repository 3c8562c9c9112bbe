"""Where the pages of one SGLang host pool lie: page ids of host indices, each page's
regions from the pool's own metadata (``get_page_buffer_meta``), and those regions as
payload views in place (`PageRegions`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import Payload
from .conversion import raw_view


class PageRegions:
    """The pages of one host pool as kvpack sees them (`PoolBinding.pages`).

    Attributes:
        name: SGLang pool name (for errors).
        page_size: tokens (slots) per page.
        part_sizes: byte size of each region of one page, in metadata order.
        page_bytes: the sum of `part_sizes` (a page's payload in SGLang's own bytes).
    """

    def __init__(self, name: str, host_pool: Any, page_size: int, part_sizes: tuple[int, ...]) -> None:
        self.name = name
        self.host_pool = host_pool
        self.page_size = page_size
        self.part_sizes = part_sizes
        self.parts = len(part_sizes)
        self.page_bytes = sum(part_sizes)
        self._steps = np.arange(page_size, dtype=np.int64)
        self._span: tuple[int, int, memoryview] | None = None
        """(address, bytes, view) of the pool's buffer, while it stays where it was."""

    def page_ids(self, host_indices: torch.Tensor, n_pages: int) -> list[int]:
        """The host pool page of each of `n_pages` pages of `host_indices` (each a whole, aligned page)."""
        self._check_count(host_indices, n_pages)
        idx = host_indices.to("cpu", torch.int64).numpy().reshape(n_pages, self.page_size)  # numpy: half torch's time
        first = idx[:, 0]
        if (first % self.page_size).any() or (idx != first[:, None] + self._steps).any():
            raise ValueError(f"pool {self.name}: host indices are not whole, aligned pages")
        return (first // self.page_size).tolist()

    def _check_count(self, host_indices: torch.Tensor | None, n_pages: int) -> None:
        """ValueError unless `host_indices` holds `n_pages` pages' worth of indices."""
        if host_indices is None or int(host_indices.numel()) != n_pages * self.page_size:
            got = None if host_indices is None else int(host_indices.numel())
            raise ValueError(f"pool {self.name}: {got} host indices for {n_pages} pages of {self.page_size}")

    def regions(self, host_indices: torch.Tensor, n_pages: int) -> tuple[list[int], list[int]]:
        """Pointers and sizes of every page's regions (``n_pages * parts`` each).

        Raises ValueError when the indices do not cover `n_pages` pages or the
        pool's metadata does not match the geometry seen at registration.
        """
        self._check_count(host_indices, n_pages)
        ptrs, sizes = self.host_pool.get_page_buffer_meta(host_indices.to("cpu"))
        if len(ptrs) != n_pages * self.parts or len(sizes) != len(ptrs):
            raise ValueError(f"pool {self.name}: {len(ptrs)} regions for {n_pages} pages of {self.parts}")
        sizes = list(map(int, sizes))
        if sizes != list(self.part_sizes) * n_pages:
            raise ValueError(f"pool {self.name}: region sizes changed since registration")
        return list(map(int, ptrs)), sizes

    def page_payloads(self, host_indices: torch.Tensor, n_pages: int) -> list[Payload]:
        """Every page's kvpack payload regions, in place in the host pool, from one metadata
        call: one view when a page's regions are contiguous in memory, else one view per
        region (kvpack's tiers read and write regions in order: no staging copy)."""
        ptrs, _ = self.regions(host_indices, n_pages)
        return self._payloads(ptrs, 0, n_pages, self._buffer_span())

    def _buffer_span(self) -> tuple[int, int, memoryview] | None:
        """A view over the pool's whole ``kv_buffer`` (CPU tensor), re-made if it moved."""
        buf = getattr(self.host_pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" or not buf.is_contiguous():
            return None
        addr, nbytes = int(buf.data_ptr()), int(buf.numel() * buf.element_size())
        span = self._span
        if span is None or span[0] != addr or span[1] != nbytes:
            span = self._span = (addr, nbytes, raw_view(addr, nbytes)) if nbytes else None
        return span

    def _payloads(self, ptrs: list[int], lo: int, hi: int, span: tuple[int, int, memoryview] | None) -> list[Payload]:
        if span is not None and hi > lo:
            sliced = self._sliced_payloads(ptrs[lo * self.parts : hi * self.parts], span)
            if sliced is not None:
                return sliced
        parts, sizes, page_bytes = self.parts, self.part_sizes, self.page_bytes
        start, length, whole = span if span is not None else (0, 0, None)

        def view(ptr: int, size: int) -> memoryview:
            offset = ptr - start
            if whole is not None and 0 <= offset and offset + size <= length:
                return whole[offset : offset + size]
            return raw_view(ptr, size)

        out: list[Payload] = []
        for page in range(lo, hi):
            base = page * parts
            if self.contiguous(ptrs, page):
                out.append(view(ptrs[base], page_bytes))
            else:
                out.append(tuple(view(ptrs[base + j], size) for j, size in enumerate(sizes)))
        return out

    def _sliced_payloads(self, ptrs: list[int], span: tuple[int, int, memoryview]) -> list[Payload] | None:
        """Payloads as slices of the pool's view, bounds and contiguity checked
        for the whole batch at once; None when a region lies outside the view."""
        start, length, whole = span
        offsets = np.asarray(ptrs, dtype=np.int64).reshape(-1, self.parts) - start
        ends = offsets + np.asarray(self.part_sizes, dtype=np.int64)
        if offsets.min() < 0 or ends.max() > length:
            return None
        rows = offsets.tolist()
        if self.parts == 1 or bool((offsets[:, 1:] == ends[:, :-1]).all()):
            n = self.page_bytes
            return [whole[row[0] : row[0] + n] for row in rows]
        if self.parts == 2:
            k, v = self.part_sizes
            return [(whole[a : a + k], whole[b : b + v]) for a, b in rows]
        sizes = self.part_sizes
        return [tuple(whole[o : o + n] for o, n in zip(row, sizes)) for row in rows]

    def contiguous(self, ptrs: list[int], page: int) -> bool:
        """Whether page `page`'s regions form one contiguous run in host memory."""
        base = page * self.parts
        addr = ptrs[base]
        for j, size in enumerate(self.part_sizes):
            if ptrs[base + j] != addr:
                return False
            addr += size
        return True
