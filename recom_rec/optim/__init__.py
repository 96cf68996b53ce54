"""The fused optimizers' pieces: their specs (which torch / torchrec optimizers fuse, and how), the
row-update formulas of the pure-torch path, and the torchrec KeyedOptimizer the module exposes."""
