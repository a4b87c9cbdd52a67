"""Model families (one file each), shared layers, attention over the paged cache, and checkpoint loading."""
