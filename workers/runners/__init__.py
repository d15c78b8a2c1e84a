"""Model runners: loading, unloading, the memory budget and batch sizing."""
