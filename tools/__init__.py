"""Developer tools (tiny model maker, ...)."""
