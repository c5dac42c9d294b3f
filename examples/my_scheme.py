"""A user's positional scheme, outside posbench: ALiBi inside a sliding window.

Load it from the repository root with `--scheme examples.my_scheme:MyScheme` (train),
`--schemes alibi,examples.my_scheme:MyScheme` (extrapolate) or `schemes: [examples.my_scheme:MyScheme]`
in YAML, and check it with `posbench check-scheme examples.my_scheme:MyScheme`.

Why it is useful: a query attends only to the last `window` keys (the training length by
default), with ALiBi's linear penalty inside the window. At any test length, every distance the
model sees is one it trained on, so nothing is out of distribution; the price is that nothing
farther than the window back can be used (sliding-window attention, as in Longformer's local
attention or Mistral, here on top of ALiBi).
"""

from posbench.errors import PosbenchError
from posbench.schemes import PositionalScheme, alibi_slopes


class MyScheme(PositionalScheme):
    description = "ALiBi inside a sliding window: keys more than `window` back are not seen"
    options = {"window": None}  # keys a query sees, itself included; None = the training length

    def __init__(self, cfg):
        super().__init__(cfg)  # checks the options; sets self.cfg and self.opt
        self.window = self.opt["window"] or cfg.train_len
        if not (isinstance(self.window, int) and self.window > 0):  # a None default is not type-checked
            raise PosbenchError(f"scheme_options.{cfg.scheme}.window={self.window!r} must be a positive integer")
        self.register_buffer("slopes", alibi_slopes(cfg.n_head), persistent=False)  # (H,)

    # embed and rotate keep the base class's no-ops: this scheme is a bias only

    def bias(self, q, k, qpos, kpos, layer):
        # the same bias in every layer: build it once per forward pass
        return self.once_per_forward((qpos, kpos), lambda: self.windowed(qpos, kpos, q.dtype))

    def windowed(self, qpos, kpos, dtype):
        dist = (qpos[:, None] - kpos[None, :]).to(dtype)  # (Tq, Tk); the future is masked anyway
        b = -self.slopes.to(dtype)[:, None, None] * dist  # (H, Tq, Tk), ALiBi's penalty
        b = b.masked_fill(dist >= self.window, float("-inf"))  # out of the window
        return b.unsqueeze(0)  # (1, H, Tq, Tk)
