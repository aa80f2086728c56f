// The Gemma 4 forward pass (to be written).
