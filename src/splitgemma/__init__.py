"""splitgemma: CPU-only disaggregated serving of Gemma 4 text models."""

__version__ = "0.1.0"
