"""Paper reproductions (`secvfl reproduce NAME`): experiment grids, seeds, tables."""
