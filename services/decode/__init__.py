"""splitgemma decode process."""
