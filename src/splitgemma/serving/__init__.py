"""Python code shared by the three services: tokenizer, chat template, shared-memory arena, telemetry."""
