"""The console's routes, one module per page (and its live parts)."""
