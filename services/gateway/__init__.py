"""splitgemma gateway process."""
