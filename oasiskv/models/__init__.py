"""Model definitions (one shared decoder) and checkpoint loading."""
