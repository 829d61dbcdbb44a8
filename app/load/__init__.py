"""Load generation: the presets a teacher launches (presets.py) and the prompt files they draw from (prompts/)."""
