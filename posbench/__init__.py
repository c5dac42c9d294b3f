"""posbench: which positional encoding lets a transformer LM work beyond its training length?"""

__version__ = "0.1.0"
