"""A bias that is a function of head and distance alone, b_h(i - j), read as a table over distances.

ALiBi, T5's buckets and KERPLE's kernels write their function of distance once
(`distance_bias`), and every backend reads it as a per-head table over the distances a block of
queries meets: FlexAttention indexes the table inside its score_mod (or, for a linear one,
computes slope times distance), so no (Tq, Tk) bias is ever built; eager, sdpa and native
expand it to (1, H, Tq, Tk), once per forward pass for a table all layers share. A learned
function's gradient reaches its parameters through the table.
"""

from __future__ import annotations

from typing import Optional

import torch

from posbench.schemes.base import PositionalScheme


class DistanceTable:
    """values[h, c] (fp32) is head h's bias at distance lo + c; qpos (Tq,) and kpos (Tk,) are the
    positions it is read at, distance qpos[i] - kpos[j] (a future key's too: masked later);
    dtype, the logits' (bf16 under a GPU's autocast), is what the dense form is made in.
    slopes (H,), where the bias is -slopes[h] * distance (ALiBi): flex computes it in its kernel
    instead of gathering it from the table (docs/performance.md: a table's gather is most of
    what a bias costs flex)."""

    def __init__(self, values, lo: int, qpos, kpos, dtype, slopes: Optional[torch.Tensor] = None):
        self.values, self.lo, self.qpos, self.kpos, self.dtype = values, lo, qpos, kpos, dtype  # values: (H, n)
        self.slopes = slopes
        self._dense: Optional[torch.Tensor] = None

    def dense(self) -> torch.Tensor:
        """(1, H, Tq, Tk), made once. index_select along the distances, not values[:, idx]: the
        same values, and its backward (an index_add) is faster than advanced indexing's (an
        accumulating index_put) or a gather of the transposed table."""
        if self._dense is None:
            idx = self.qpos[:, None] - self.kpos[None, :] - self.lo  # (Tq, Tk) columns of values
            table = self.values.to(self.dtype)  # (H, n): cast before the gather, the same values
            self._dense = table.index_select(1, idx.flatten()).view(-1, *idx.shape).unsqueeze(0)
        return self._dense


class DistanceBias(PositionalScheme):
    """Base of a scheme whose bias is b_h(qpos - kpos): it defines `distance_bias(d, layer)`,
    the bias at a vector of distances, (n,) -> (H, n), and gets `bias` and `distance_table` from it.
    `per_layer`: the function differs by layer (made in each layer), else one per forward pass."""

    per_layer = False

    def distance_bias(self, d: torch.Tensor, layer: int) -> torch.Tensor:
        raise NotImplementedError  # (H, n): the bias at each distance d (fp32; negative ones are masked)

    def linear_slopes(self, layer: int) -> Optional[torch.Tensor]:
        """(H,) fp32 where distance_bias(d) is exactly -slopes[:, None] * d, else None."""
        return None

    def bias(self, q, k, qpos, kpos, layer):
        table = self.distance_table(qpos, kpos, layer, q.dtype)
        if table is not None:
            return table.dense()
        d = (qpos[:, None] - kpos[None, :]).float()  # (Tq, Tk): a remap's fractional positions, each pair's own
        return self.distance_bias(d.flatten(), layer).view(-1, *d.shape).unsqueeze(0).to(q.dtype)

    def distance_table(self, qpos, kpos, layer: int, dtype) -> Optional[DistanceTable]:
        """The table of whole-number positions' distances. None for fractional ones, and while
        torch.compile traces (train.compile): the table's extent is read from the positions'
        values, which would break the graph, and the per-pair formula traces whole."""
        if qpos.is_floating_point() or kpos.is_floating_point() or torch.compiler.is_compiling():
            return None

        def make():
            # every distance a (query, key) pair of them has, read in one transfer from a GPU
            lo, hi = torch.stack([qpos.min() - kpos.max(), qpos.max() - kpos.min()]).tolist()
            d = torch.arange(lo, hi + 1, device=qpos.device, dtype=torch.float32)  # (n,)
            # fp32: flex reads it as is, and sums its gradient in fp32 on any torch
            return DistanceTable(self.distance_bias(d, layer).float(), lo, qpos, kpos, dtype, self.linear_slopes(layer))

        return make() if self.per_layer else self.once_per_forward((qpos, kpos), make)

    def tiled_bias(self, qpos, kpos, layer, dtype):
        """The table, for posbench's Triton kernels, where it is the whole bias (has_table)."""
        return self.distance_table(qpos, kpos, layer, dtype) if reads_as_table(self, qpos) else None


def has_table(scheme: PositionalScheme) -> bool:
    """Whether `scheme`'s bias is its table over distances: a DistanceBias whose `bias` is the
    table's own (a subclass that overrides it, a window on ALiBi say, adds what no table holds)."""
    return isinstance(scheme, DistanceBias) and type(scheme).bias is DistanceBias.bias


def reads_as_table(scheme: PositionalScheme, pos: torch.Tensor) -> bool:
    """Whether `scheme`'s bias at positions `pos` is read as its table: it has one, and the
    positions are whole numbers (T,) shared by the batch, outside torch.compile."""
    whole = pos.dim() == 1 and not pos.is_floating_point()
    return has_table(scheme) and whole and not torch.compiler.is_compiling()
