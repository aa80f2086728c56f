"""splitgemma prefill process."""
