"""Shared by the Mosaic GPU kernels' lowering tests."""


class record_smem:
    """Records the shared memory Mosaic GPU allocates while lowering (a private hook; if
    a jax version lacks it, nothing is recorded and the tests' budget checks are skipped)."""

    def __enter__(self):
        from jax.experimental.mosaic.gpu import core as mosaic_core

        self.sizes = []
        self.core, self.original = mosaic_core, getattr(mosaic_core, "_smem_tree_size", None)
        if self.original is not None:

            def spy(tree):
                self.sizes.append(self.original(tree))
                return self.sizes[-1]

            mosaic_core._smem_tree_size = spy
        return self.sizes

    def __exit__(self, *exc):
        if self.original is not None:
            self.core._smem_tree_size = self.original
