"""Readers that turn checkpoint files on disk into a config dict, named weights and a tokenizer."""
