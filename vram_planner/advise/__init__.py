"""`vram-plan advise`: read an out-of-memory log and rank the fixes."""
