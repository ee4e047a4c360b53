"""Multimodal inputs (images): loading, processing with Hugging Face image processors, hashing,
and the plain data that carries them from the engine to the workers."""
